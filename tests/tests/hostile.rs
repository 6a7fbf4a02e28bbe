//! Hostile and inconsistent messages (docs/design.md "Limits and validation"): whoever can publish
//! to `{ns}.tasks` can run a configured task, but cannot make a worker loop, stall, or record
//! anything for a scheduled instance it does not carry. Dead-letter reasons are exact.

use chrono::{TimeZone, Utc};
use drumline_e2e::cfg::{every, Cfg};
use drumline_e2e::scenario::{appends, Scenario};
use drumline_e2e::{adhoc, metric, wait_until, TestEnv};
use drumline_shared::broker::header_str;
use drumline_shared::envelope::Envelope;
use lapin::types::ShortString;
use lapin::BasicProperties;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// A worker (serving `/metrics`) whose `append` task appends `$DRUMLINE_KEY` to `effects`, and
/// which knows the job `tick` (so it can tell an ad-hoc message that impersonates one of its
/// instances), once it consumes: the scenario and the metrics port.
async fn start_worker(test: &str) -> (Scenario, u16) {
    let mut sc = Scenario::new(test, |env| {
        Cfg::new()
            .set("worker", "concurrency", "2")
            .set("worker", "lease", "\"3s\"")
            .job("tick", every("1h").with("task", "\"append\""))
            .task("append", appends(env, "effects"))
    });
    let port = sc.start_metered_worker().await;
    (sc, port)
}

/// (message id, reason) of every letter in `{ns}.dead`, taken off the queue.
async fn dead_letter_reasons(env: &TestEnv) -> Vec<(Option<String>, String)> {
    let letters = drumline_e2e::scenario::take_dead_letters(env).await;
    let reason = |props: &BasicProperties| {
        let id = props.message_id().as_ref().map(|m| m.to_string());
        (
            id,
            header_str(props.headers().as_ref(), "x-drumline-reason").unwrap_or_default(),
        )
    };
    letters
        .iter()
        .map(|l| reason(&l.delivery.properties))
        .collect()
}
fn raw_props() -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type(ShortString::from("application/json"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_300_byte_key_is_dead_lettered_once_and_the_worker_keeps_serving() {
    let (mut sc, port) = start_worker("e2e_long_key").await;
    let long = adhoc(&"k".repeat(300), "append");
    sc.publish_raw("default", &long.encode(), raw_props()).await;
    sc.publish(&adhoc("k-after", "append")).await;

    let served = wait_until(WAIT, || sc.lines("effects") == vec!["k-after"]);
    sc.check(served, format!("{:?}", sc.lines("effects")));
    let malformed = || metric(port, "drumline_worker_malformed_total");
    let once = wait_until(WAIT, || malformed() == Some(1.0));
    assert!(once, "{:?}", drumline_e2e::http_get(port, "/metrics"));
    let letters = dead_letter_reasons(&sc).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].1, "malformed");
    assert!(letters[0].0.as_ref().is_none_or(|id| id.len() <= 255));
    // Taken once: still one after the worker served the next message.
    assert_eq!(malformed(), Some(1.0));
    sc.stop();
    let queue = sc.names().work_queue("default");
    assert_eq!(sc.queue_len(&queue).await, Some(0));
}

/// Three messages that impersonate `real_key` (an instance of job `tick` at 07:30 on
/// 2026-03-08) or another job's instance, and a fourth, ad hoc, that is fine.
fn impersonations(real_key: &str) -> [Envelope; 4] {
    let instant = Utc.with_ymd_and_hms(2026, 3, 8, 7, 30, 0).unwrap();
    // `job` set, but the key names another instant than `scheduled_for`.
    let mut shifted = adhoc(real_key, "append");
    shifted.job = Some("tick".into());
    shifted.scheduled_for = instant + chrono::Duration::seconds(1);
    // `job` set, key of another job.
    let mut other = adhoc("other@2026-03-08T07:30:00Z", "append");
    other.job = Some("tick".into());
    other.scheduled_for = instant;
    // Ad hoc (no job), keyed like an instance of a job this worker knows.
    let mut impostor = adhoc(real_key, "append");
    impostor.scheduled_for = instant;
    // Ad hoc with an `@` that names no job of ours is fine.
    let fine = adhoc("someone@2026-03-08T07:30:00Z", "append");
    [shifted, other, impostor, fine]
}

#[tokio::test(flavor = "multi_thread")]
async fn messages_that_impersonate_a_scheduled_instance_record_nothing() {
    let (mut sc, port) = start_worker("e2e_impersonate").await;
    let real_key = "tick@2026-03-08T07:30:00Z";
    for envelope in impersonations(real_key) {
        sc.publish(&envelope).await;
    }
    let malformed = || metric(port, "drumline_worker_malformed_total");
    let settled = wait_until(WAIT, || {
        malformed() == Some(3.0) && sc.lines("effects").len() == 1
    });
    sc.check(
        settled,
        format!("{:?} {:?}", malformed(), sc.lines("effects")),
    );
    sc.stop();
    assert_eq!(sc.lines("effects"), vec!["someone@2026-03-08T07:30:00Z"]);
    assert_eq!(sc.run_state(real_key).await, None, "nothing recorded");
    assert_eq!(sc.run_state("other@2026-03-08T07:30:00Z").await, None);
    let letters = dead_letter_reasons(&sc).await;
    let reasons: Vec<String> = letters.into_iter().map(|l| l.1).collect();
    assert_eq!(reasons, vec!["malformed"; 3]);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_copy_of_a_done_instance_is_a_duplicate() {
    let (mut sc, port) = start_worker("e2e_expired_dup").await;
    let mut envelope = adhoc("k-once", "append");
    envelope.expires_at = Some(Utc::now() + chrono::Duration::hours(1));
    sc.publish(&envelope).await;
    let succeeded = || metric(port, "drumline_worker_succeeded_total") == Some(1.0);
    sc.wait(WAIT, "k-once did not succeed", succeeded);

    // A late copy, past its deadline, published without an AMQP expiration so that it reaches
    // the worker.
    envelope.expires_at = Some(Utc::now() - chrono::Duration::seconds(1));
    sc.publish_raw("default", &envelope.encode(), raw_props())
        .await;
    let duplicate = || metric(port, "drumline_worker_duplicates_total") == Some(1.0);
    sc.wait(WAIT, "the late copy is no duplicate", duplicate);
    assert_eq!(metric(port, "drumline_worker_expired_total"), Some(0.0));
    assert_eq!(
        metric(port, "drumline_worker_dead_lettered_total"),
        Some(0.0)
    );
    sc.stop();
    assert_eq!(sc.lines("effects"), vec!["k-once"]);
    assert_eq!(sc.queue_len(&sc.names().dead()).await, Some(0));
    assert_eq!(sc.run_state("k-once").await.as_deref(), Some("done"));
}
