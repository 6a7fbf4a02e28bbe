//! The producer client (`drumline_shared::client`): a URL and a namespace are enough; a message
//! no queue is bound for is an error, not a silent drop; with `declare` a message waits for
//! workers that have not started; a failed publish does not spoil the next one.

use drumline_e2e::cfg::{shell, Cfg};
use drumline_e2e::scenario::Scenario;
use drumline_e2e::{TestEnv, AMQP_URL};
use drumline_shared::broker::BrokerError;
use drumline_shared::client::{ClientError, Message, Producer};
use drumline_shared::config::QueueType;
use serde_json::json;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);

/// Task `append` appends `KEY ARGS` to `effects`.
fn append_with_args(env: &TestEnv) -> Cfg {
    let effects = env.path("effects");
    let script = format!("echo \"$DRUMLINE_KEY $(cat)\" >> {}", effects.display());
    Cfg::new().task("append", shell(&script))
}

/// A producer for namespace `ns` that declares the topology as the workers will (classic
/// queues, the default `dead_ttl` of 7 days).
async fn declaring_producer(ns: &str) -> Producer {
    let dead_ttl = Duration::from_secs(7 * 24 * 3600);
    let builder = Producer::builder(ns).url(AMQP_URL);
    let producer = builder.declare(QueueType::Classic, dead_ttl).connect();
    producer.await.unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_client_publishes_with_confirms_and_reports_what_cannot_be_routed() {
    let mut sc = Scenario::new("e2e_client", append_with_args);
    // Nothing of the namespace exists yet: a bare producer's publish fails, typed.
    let bare = Producer::connect(AMQP_URL, &sc.ns).await.unwrap();
    let nowhere = bare.publish(&Message::new("append").key("early")).await;
    let typed = matches!(&nowhere, Err(e @ ClientError::Broker(_)) if !e.is_request());
    assert!(typed, "{nowhere:?}");
    // With `declare`, the message waits in its queue for a worker that starts later.
    let declaring = declaring_producer(&sc.ns).await;
    let waiting = Message::new("append").key("k1").args(json!({"n": 1}));
    let published = declaring.publish(&waiting).await.unwrap();
    assert_eq!(published.key, "k1");
    declaring.close().await;
    let worker = sc.env.worker("worker", &["--config", sc.cfg()]);
    sc.workers.push(worker);
    let ran = || sc.lines("effects") == ["k1 {\"n\":1}"];
    sc.wait(WAIT, "k1 did not run", ran);
    // The bare producer recovers from its failed publish; a queue nobody is bound for is
    // `Unroutable`, and the producer goes on publishing after it.
    let unbound = bare.publish(&Message::new("append").queue("nobody")).await;
    assert!(
        matches!(unbound, Err(ClientError::Broker(BrokerError::Unroutable(ref q))) if q == "nobody"),
        "{unbound:?}"
    );
    let k2 = Message::new("append").key("k2");
    bare.publish(&k2).await.unwrap();
    sc.wait_state("k2", "done").await;
    assert_eq!(sc.lines("effects").len(), 2);
    bare.close().await;
}
