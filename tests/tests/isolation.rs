//! A beat job that cannot be published (any reason) never stops the other jobs from being
//! published (docs/design.md "Limits and validation").

use drumline_e2e::cfg::{every, Cfg, Keys};
use drumline_e2e::scenario::Scenario;
use drumline_e2e::{metric, toml_string, wait_until, wait_until_async, PrivateRabbit};
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::{Connection, ConnectionProperties};
use std::collections::BTreeSet;
use std::time::Duration;

/// Messages ready in `queue` on the broker at `url`, 0 when it is missing.
async fn ready(url: &str, queue: &str) -> u32 {
    let counts = drumline_e2e::scenario::queue_counts_at(url, queue).await;
    counts.map_or(0, |(ready, _)| ready)
}

/// Takes every message off `queue` on the broker at `url`: their keys (message ids).
async fn drain(url: &str, queue: &str) -> Vec<String> {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("broker");
    let ch = conn.create_channel().await.expect("channel");
    let mut keys = Vec::new();
    let get = || ch.basic_get(queue.into(), BasicGetOptions::default());
    while let Some(m) = get().await.expect("get") {
        let id = m
            .delivery
            .properties
            .message_id()
            .as_ref()
            .expect("message id");
        keys.push(id.to_string());
        m.delivery
            .ack(BasicAckOptions::default())
            .await
            .expect("ack");
    }
    let _ = conn.close(200, "bye".into()).await;
    keys
}

/// Jobs `big`, `small` and `other`, every second, on the broker at `url`; `big`'s args (4 KiB)
/// are over the broker's `max_message_size`.
fn big_small_and_other(url: &str) -> Cfg {
    let on_t = || every("1s").with("task", "\"t\"");
    let big = format!("{{ blob = \"{}\" }}", "x".repeat(4096));
    Cfg::new()
        .set("broker", "url", &toml_string(url))
        .job("big", on_t().with("args", &big))
        .job("small", on_t())
        .job("other", on_t())
        .task("t", Keys::default().with("command", "[\"/bin/true\"]"))
}

/// The broker refuses one job's messages in a way that closes the channel (a body over the
/// broker's `max_message_size`). That job is first in every batch (its instants are the
/// oldest), so before jobs were isolated every other job's message in the batch failed with
/// it, and nothing was ever published again.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_the_broker_refuses_does_not_hold_up_the_others() {
    let rabbit = PrivateRabbit::start_with("isolation", "max_message_size = 2048");
    let url = rabbit.url();
    let mut sc = Scenario::new("e2e_isolation", |_| big_small_and_other(&url));
    let metrics = sc.start_metered_beat();
    // On the private broker: count what waits in the work queue there.
    let queue = sc.names().work_queue("default");
    let ten = || async { ready(&url, &queue).await >= 10 };
    let published = wait_until_async(Duration::from_secs(30), ten).await;
    let only = ready(&url, &queue).await;
    sc.check(published, format!("only {only} messages in 30 s"));
    // The one job that cannot be published is the one the beat reports stalled.
    let stalled = || metric(metrics, "drumline_beat_stalled_jobs");
    let one = wait_until(Duration::from_secs(20), || stalled() == Some(1.0));
    sc.check(one, format!("drumline_beat_stalled_jobs {:?}", stalled()));
    sc.stop();
    // Every message is the small or the other job's, each instant once, both jobs moving.
    let keys = drain(&url, &queue).await;
    let distinct = keys.iter().collect::<BTreeSet<_>>().len();
    assert_eq!(distinct, keys.len(), "an instant published twice: {keys:?}");
    let ours = |k: &String| k.starts_with("small@") || k.starts_with("other@");
    assert!(keys.iter().all(ours), "{keys:?}");
    for job in ["small@", "other@"] {
        let n = keys.iter().filter(|k| k.starts_with(job)).count();
        assert!(n >= 4, "{job}: {keys:?}");
    }
}
