//! A beat job that cannot be published (any reason) never stops the other jobs from being
//! published (docs/design.md "Limits and validation").

use drumline_e2e::{http_get, setup, unused_port, wait_until, PrivateRabbit};
use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use std::collections::BTreeSet;
use std::time::Duration;

/// Messages ready in `queue` on the broker at `url` (passive declare), 0 when it is missing.
async fn ready(url: &str, queue: &str) -> u32 {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("broker");
    let ch = conn.create_channel().await.expect("channel");
    let n = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_or(0, |q| q.message_count());
    let _ = conn.close(200, "bye".into()).await;
    n
}

/// The broker refuses one job's messages in a way that closes the channel (a body over the
/// broker's `max_message_size`). That job is first in every batch (its instants are the
/// oldest), so before jobs were isolated every other job's message in the batch failed with
/// it, and nothing was ever published again.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_the_broker_refuses_does_not_hold_up_the_others() {
    let env = setup("e2e_isolation");
    let rabbit = PrivateRabbit::start_with("isolation", "max_message_size = 2048");
    let big = "x".repeat(4096);
    let cfg = env.config(
        "drumline.toml",
        &format!(
            "[broker]\nurl = \"{}\"\n\
             [[jobs]]\nname = \"big\"\ntask = \"t\"\nevery = \"1s\"\nargs = {{ blob = \"{big}\" }}\n\
             [[jobs]]\nname = \"small\"\ntask = \"t\"\nevery = \"1s\"\n\
             [[jobs]]\nname = \"other\"\ntask = \"t\"\nevery = \"1s\"\n\
             [tasks.t]\ncommand = [\"/bin/true\"]\n",
            rabbit.url()
        ),
    );
    let metrics = unused_port();
    let metrics_addr = format!("127.0.0.1:{metrics}");
    let mut beat = env.beat(
        "beat",
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--metrics-addr",
            &metrics_addr,
        ],
    );
    let queue = env.names().work_queue("default");
    let url = rabbit.url();
    let mut published = 0;
    for _ in 0..300 {
        published = ready(&url, &queue).await;
        if published >= 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        published >= 10,
        "only {published} messages in 30 s:\n{}",
        beat.log_tail(20)
    );
    // The one job that cannot be published is the one the beat reports stalled.
    assert!(
        wait_until(Duration::from_secs(20), || http_get(metrics, "/metrics")
            .is_some_and(
                |(_, body)| body.contains("drumline_beat_stalled_jobs 1\n")
            )),
        "{:?}",
        http_get(metrics, "/metrics")
    );
    assert!(beat.terminate(Duration::from_secs(20)).success());

    // Every message is the small or the other job's, each instant once, both jobs moving.
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect("broker");
    let ch = conn.create_channel().await.expect("channel");
    let mut keys = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.as_str().into(), BasicGetOptions::default())
        .await
        .expect("get")
    {
        keys.push(
            m.delivery
                .properties
                .message_id()
                .as_ref()
                .expect("message id")
                .to_string(),
        );
        m.delivery
            .ack(BasicAckOptions::default())
            .await
            .expect("ack");
    }
    let _ = conn.close(200, "bye".into()).await;
    let distinct: BTreeSet<&String> = keys.iter().collect();
    assert_eq!(
        distinct.len(),
        keys.len(),
        "an instant published twice: {keys:?}"
    );
    assert!(
        keys.iter()
            .all(|k| k.starts_with("small@") || k.starts_with("other@")),
        "{keys:?}"
    );
    for job in ["small@", "other@"] {
        assert!(
            keys.iter().filter(|k| k.starts_with(job)).count() >= 4,
            "{job}: {keys:?}"
        );
    }
}
