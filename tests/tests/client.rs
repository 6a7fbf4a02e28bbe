//! The producer client (`drumline_shared::client`): a URL and a namespace are enough; a message
//! no queue is bound for is an error, not a silent drop; with `declare` a message waits for
//! workers that have not started; a failed publish does not spoil the next one.

use drumline_e2e::cfg::{shell, Cfg};
use drumline_e2e::scenario::Scenario;
use drumline_e2e::AMQP_URL;
use drumline_shared::broker::BrokerError;
use drumline_shared::client::{ClientError, Message, Producer};
use drumline_shared::config::QueueType;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread")]
async fn the_client_publishes_with_confirms_and_reports_what_cannot_be_routed() {
    let mut sc = Scenario::new("e2e_client", |env| {
        let script = format!(
            "echo \"$DRUMLINE_KEY $(cat)\" >> {}",
            env.path("effects").display()
        );
        Cfg::new().task("append", shell(&script))
    });
    // Nothing of the namespace exists yet: a bare producer's publish fails, typed.
    let bare = Producer::connect(AMQP_URL, &sc.ns).await.unwrap();
    let nowhere = bare.publish(&Message::new("append").key("early")).await;
    assert!(
        matches!(&nowhere, Err(e @ ClientError::Broker(_)) if !e.is_request()),
        "{nowhere:?}"
    );

    // With `declare` (as the workers will: classic queues, the default `dead_ttl` of 7 days),
    // the message waits in its queue for a worker that starts later.
    let declaring = Producer::builder(sc.ns.as_str())
        .url(AMQP_URL)
        .declare(QueueType::Classic, Duration::from_secs(7 * 24 * 3600))
        .connect()
        .await
        .unwrap();
    let waiting = Message::new("append")
        .key("k1")
        .args(serde_json::json!({"n": 1}));
    let published = declaring.publish(&waiting).await.unwrap();
    assert_eq!(published.key, "k1");
    declaring.close().await;
    let worker = sc.env.worker("worker", &["--config", sc.cfg()]);
    sc.workers.push(worker);
    sc.wait(WAIT, "k1 did not run", || {
        sc.lines("effects") == ["k1 {\"n\":1}"]
    });

    // The bare producer recovers from its failed publish; a queue nobody is bound for is
    // `Unroutable`, and the producer goes on publishing after it.
    let unbound = bare.publish(&Message::new("append").queue("nobody")).await;
    assert!(
        matches!(unbound, Err(ClientError::Broker(BrokerError::Unroutable(ref q))) if q == "nobody"),
        "{unbound:?}"
    );
    bare.publish(&Message::new("append").key("k2"))
        .await
        .unwrap();
    sc.wait_state("k2", "done").await;
    assert_eq!(sc.lines("effects").len(), 2);
    bare.close().await;
}
