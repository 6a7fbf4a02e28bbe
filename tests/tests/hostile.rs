//! Hostile and inconsistent messages (docs/design.md "Limits and validation"): whoever can publish
//! to `{ns}.tasks` can run a configured task, but cannot make a worker loop, stall, or record
//! anything for a scheduled instance it does not carry. Dead-letter reasons are exact.

use chrono::{TimeZone, Utc};
use drumline_e2e::{adhoc, metric, setup, wait_until, with_metrics, Proc, TestEnv};
use drumline_shared::broker::header_str;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::types::ShortString;
use lapin::BasicProperties;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// A worker whose `append` task appends `$DRUMLINE_KEY` to `effects`, and which knows the job
/// `tick` (so it can tell an ad-hoc message that impersonates one of its instances).
fn start_worker(env: &TestEnv) -> (Proc, u16) {
    let cfg = env.config(
        "drumline.toml",
        &format!(
            r#"
[worker]
concurrency = 2
lease = "3s"

[[jobs]]
name = "tick"
task = "append"
every = "1h"

[tasks.append]
command = {}
"#,
            env.append_key_command("effects", 0.0)
        ),
    );
    let (args, port) = with_metrics(&["--config", cfg.to_str().unwrap()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let worker = env.worker("worker", &args);
    (worker, port)
}

/// (message id, reason) of every letter in `{ns}.dead`, taken off the queue.
async fn take_dead_letters(env: &TestEnv) -> Vec<(Option<String>, String)> {
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    while let Some(msg) = ch
        .basic_get(
            env.names().dead().as_str().into(),
            BasicGetOptions::default(),
        )
        .await
        .unwrap()
    {
        let props = &msg.delivery.properties;
        out.push((
            props.message_id().as_ref().map(|m| m.to_string()),
            header_str(props.headers().as_ref(), "x-drumline-reason").unwrap_or_default(),
        ));
        msg.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    let _ = conn.close(200, "bye".into()).await;
    out
}

fn raw_props() -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type(ShortString::from("application/json"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_300_byte_key_is_dead_lettered_once_and_the_worker_keeps_serving() {
    let env = setup("e2e_long_key");
    let (mut worker, port) = start_worker(&env);
    env.wait_for_topology(&worker).await;

    let long = adhoc(&"k".repeat(300), "append");
    env.publish_raw("default", &long.encode(), raw_props())
        .await;
    env.publish(&adhoc("k-after", "append")).await;

    assert!(
        wait_until(WAIT, || env.lines("effects") == vec!["k-after"]),
        "{:?}\n{}",
        env.lines("effects"),
        worker.log_tail(30)
    );
    assert!(
        wait_until(WAIT, || metric(port, "drumline_worker_malformed_total")
            == Some(1.0)),
        "{:?}",
        drumline_e2e::http_get(port, "/metrics")
    );
    let letters = take_dead_letters(&env).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].1, "malformed");
    assert!(letters[0].0.as_ref().is_none_or(|id| id.len() <= 255));
    // Taken once: still one after the worker served the next message.
    assert_eq!(metric(port, "drumline_worker_malformed_total"), Some(1.0));
    assert!(worker.terminate(Duration::from_secs(20)).success());
    assert_eq!(
        env.queue_len(&env.names().work_queue("default")).await,
        Some(0)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn messages_that_impersonate_a_scheduled_instance_record_nothing() {
    let env = setup("e2e_impersonate");
    let (mut worker, port) = start_worker(&env);
    env.wait_for_topology(&worker).await;

    let instant = Utc.with_ymd_and_hms(2026, 3, 8, 7, 30, 0).unwrap();
    let real_key = "tick@2026-03-08T07:30:00Z";
    // `job` set, but the key names another instant than `scheduled_for`.
    let mut shifted = adhoc(real_key, "append");
    shifted.job = Some("tick".into());
    shifted.scheduled_for = instant + chrono::Duration::seconds(1);
    env.publish(&shifted).await;
    // `job` set, key of another job.
    let mut other = adhoc("other@2026-03-08T07:30:00Z", "append");
    other.job = Some("tick".into());
    other.scheduled_for = instant;
    env.publish(&other).await;
    // Ad hoc (no job), keyed like an instance of a job this worker knows.
    let mut impostor = adhoc(real_key, "append");
    impostor.scheduled_for = instant;
    env.publish(&impostor).await;
    // Ad hoc with an `@` that names no job of ours is fine.
    env.publish(&adhoc("someone@2026-03-08T07:30:00Z", "append"))
        .await;

    assert!(
        wait_until(WAIT, || {
            metric(port, "drumline_worker_malformed_total") == Some(3.0)
                && env.lines("effects").len() == 1
        }),
        "{:?} {:?}\n{}",
        metric(port, "drumline_worker_malformed_total"),
        env.lines("effects"),
        worker.log_tail(30)
    );
    assert!(worker.terminate(Duration::from_secs(20)).success());
    assert_eq!(env.lines("effects"), vec!["someone@2026-03-08T07:30:00Z"]);
    assert_eq!(env.run_state(real_key).await, None, "nothing recorded");
    assert_eq!(env.run_state("other@2026-03-08T07:30:00Z").await, None);
    let reasons: Vec<String> = take_dead_letters(&env)
        .await
        .into_iter()
        .map(|l| l.1)
        .collect();
    assert_eq!(reasons, vec!["malformed"; 3]);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_copy_of_a_done_instance_is_a_duplicate() {
    let env = setup("e2e_expired_dup");
    let (mut worker, port) = start_worker(&env);
    env.wait_for_topology(&worker).await;

    let mut envelope = adhoc("k-once", "append");
    envelope.expires_at = Some(Utc::now() + chrono::Duration::hours(1));
    env.publish(&envelope).await;
    assert!(wait_until(WAIT, || {
        metric(port, "drumline_worker_succeeded_total") == Some(1.0)
    }));

    // A late copy, past its deadline, published without an AMQP expiration so that it reaches
    // the worker.
    envelope.expires_at = Some(Utc::now() - chrono::Duration::seconds(1));
    env.publish_raw("default", &envelope.encode(), raw_props())
        .await;
    assert!(
        wait_until(WAIT, || {
            metric(port, "drumline_worker_duplicates_total") == Some(1.0)
        }),
        "{}",
        worker.log_tail(20)
    );
    assert_eq!(metric(port, "drumline_worker_expired_total"), Some(0.0));
    assert_eq!(
        metric(port, "drumline_worker_dead_lettered_total"),
        Some(0.0)
    );
    assert!(worker.terminate(Duration::from_secs(20)).success());
    assert_eq!(env.lines("effects"), vec!["k-once"]);
    assert_eq!(env.queue_len(&env.names().dead()).await, Some(0));
    assert_eq!(env.run_state("k-once").await.as_deref(), Some("done"));
}
