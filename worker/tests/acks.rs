//! A consumer channel's acks (`acks.rs`) against the real RabbitMQ: lapin and the broker decide
//! what an ack and a closed channel do to the deliveries, so this is not a unit test (and
//! `cargo test --lib` needs no services).

use drumline_worker::acks::Acks;

/// The shared broker `scripts/test` starts.
const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

// See: issues/16 (a channel's ack table could grow for a whole session behind one delivery
// that never settles). Against the real broker: lapin and RabbitMQ decide what an ack and a
// closed channel do to the deliveries; a private queue, exclusive to the test's connection.
#[tokio::test]
async fn a_delivery_that_is_not_settled_closes_the_channel_and_comes_back() {
    use futures_util::StreamExt;
    use lapin::options::{BasicGetOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, Connection, ConnectionProperties};
    use std::time::{Duration, Instant};

    let conn = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .expect("amqp connection");
    let channel = conn.create_channel().await.expect("channel");
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    let queue = channel
        .queue_declare("".into(), exclusive, FieldTable::default())
        .await
        .expect("queue.declare")
        .name()
        .clone();
    for body in [b"one", b"two", b"six"] {
        channel
            .basic_publish(
                "".into(),
                queue.clone(),
                Default::default(),
                body,
                BasicProperties::default(),
            )
            .await
            .expect("publish");
    }
    let mut consumer = drumline_shared::broker::consume(&channel, queue.as_str(), "")
        .await
        .expect("basic.consume");
    let acks = Acks::start(channel.clone());
    let mut tickets = Vec::new();
    for _ in 0..3 {
        let delivery = consumer
            .next()
            .await
            .expect("a delivery")
            .expect("delivery");
        tickets.push((acks.taken(&delivery), delivery.body));
    }
    let (unsettled, body) = tickets.remove(0);
    for (ticket, _) in tickets {
        ticket.ack().await.expect("ack");
    }
    // Its settle is cut off (the settle timeout fired, or its run died): dropped unsettled.
    drop(unsettled);

    let other = conn.create_channel().await.expect("channel");
    let deadline = Instant::now() + Duration::from_secs(10);
    let back = loop {
        let got = other
            .basic_get(queue.clone(), BasicGetOptions::default())
            .await
            .expect("basic.get");
        if let Some(message) = got {
            break Some(message);
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = conn.close(200, "bye".into()).await;
    let back = back.expect("the delivery that was not settled never came back to the queue");
    assert_eq!(back.delivery.data, body);
    assert!(back.delivery.redelivered);
}
