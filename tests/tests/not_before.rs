//! `not_before` (docs/envelope.md#not-before): a raw message published before it waits in a
//! delay queue, not in a worker's slot, then runs once, not sooner; one past it runs at once;
//! a malformed one, or one that expires before it, is a `malformed` dead letter naming it (and
//! `drumline publish` refuses the latter).
// See: issues/36

use chrono::{DateTime, Utc};
use drumline_e2e::cfg::{shell, Cfg};
use drumline_e2e::scenario::{Scenario, WAIT};
use drumline_e2e::{adhoc, metric};
use drumline_shared::envelope::format_instant;
use serde_json::{json, Value};
use std::time::Duration;

/// A worker with one slot whose task `stamp` appends `KEY MILLIS` (the Unix time it ran, in
/// ms) to `effects`: the scenario and the worker's metrics port.
async fn one_slot(test: &str) -> (Scenario, u16) {
    let mut sc = Scenario::new(test, |env| {
        let effects = env.path("effects");
        let stamp = format!(
            "echo \"$DRUMLINE_KEY $(date +%s%3N)\" >> {}",
            effects.display()
        );
        Cfg::new()
            .set("worker", "concurrency", "1")
            .task("stamp", shell(&stamp))
    });
    let port = sc.start_metered_worker().await;
    (sc, port)
}

/// (key, ms) of each line of `effects`, in order.
fn stamps(sc: &Scenario) -> Vec<(String, i64)> {
    let line = |l: &String| {
        let (key, ms) = l.split_once(' ')?;
        Some((key.to_owned(), ms.parse().ok()?))
    };
    sc.lines("effects").iter().filter_map(line).collect()
}

/// Publishes `body` (JSON) to the `default` queue as any AMQP producer would: no delay queue.
async fn publish_raw(sc: &Scenario, body: &Value) {
    let body = body.to_string();
    sc.publish_raw("default", body.as_bytes(), Default::default())
        .await;
}

fn keys(sc: &Scenario) -> Vec<String> {
    stamps(sc).into_iter().map(|(key, _)| key).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_message_before_its_not_before_waits_outside_the_slot_and_runs_once_after_it() {
    let (sc, port) = one_slot("not_before_early").await;
    let not_before: DateTime<Utc> = Utc::now() + chrono::Duration::seconds(3);
    let later =
        json!({"key": "k-later", "task": "stamp", "not_before": format_instant(not_before)});
    publish_raw(&sc, &later).await;
    sc.publish(&adhoc("k-now", "stamp")).await;

    // The one slot is free for the message published after it: k-later is not sleeping in it.
    sc.wait(WAIT, "k-now did not run", || !stamps(&sc).is_empty());
    assert_eq!(keys(&sc)[0], "k-now", "k-now runs first");
    let parked = sc.run_state("k-later").await;
    if Utc::now() < not_before {
        assert_eq!(parked, None, "nothing claimed or recorded while it waits");
    }
    assert_eq!(
        metric(port, "drumline_worker_deferred_total").map(|n| n >= 1.0),
        Some(true)
    );

    sc.wait(WAIT, "k-later did not run", || stamps(&sc).len() == 2);
    let ran_at = stamps(&sc)[1].1;
    let due = not_before.timestamp_millis();
    assert!(ran_at >= due, "k-later ran {} ms early", due - ran_at);
    sc.wait_state("k-later", "done").await;
    let attempt = drumline_e2e::scenario::run_field(&sc, "k-later", "attempt").await;
    assert_eq!(attempt.as_deref(), Some("0"), "waiting used no attempt");
    sc.hold(Duration::from_secs(2), "k-later ran once", || {
        keys(&sc) == vec!["k-now", "k-later"]
    });
}

#[tokio::test(flavor = "multi_thread")]
async fn a_past_not_before_runs_at_once_and_a_bad_one_is_dead_lettered_naming_it() {
    let (sc, port) = one_slot("not_before_past_bad").await;
    let hour = chrono::Duration::hours(1);
    let at = |t: DateTime<Utc>| format_instant(t);
    let past = json!({"key": "k-past", "task": "stamp", "not_before": at(Utc::now() - hour)});
    let bad = json!({"key": "k-bad", "task": "stamp", "not_before": "tomorrow"});
    let never = json!({"key": "k-never", "task": "stamp", "not_before": at(Utc::now() + hour),
        "expires_at": at(Utc::now() + hour / 2)});
    for body in [&bad, &never, &past] {
        publish_raw(&sc, body).await;
    }
    sc.wait_state("k-past", "done").await;
    let deferred = metric(port, "drumline_worker_deferred_total");
    assert_eq!(deferred, Some(0.0), "k-past was not held back");
    let dead = || {
        sc.run("drumline", &["--config", sc.cfg(), "dlq", "list", "--json"])
            .1
    };
    let letters = || serde_json::from_str::<Vec<Value>>(&dead()).unwrap_or_default();
    sc.wait(WAIT, "two dead letters", || letters().len() == 2);
    for letter in letters() {
        let (reason, error) = (&letter["reason"], letter["error"].as_str());
        assert_eq!(reason, "malformed", "{letter}");
        assert!(error.is_some_and(|e| e.contains("not_before")), "{letter}");
    }
    assert_eq!(keys(&sc), vec!["k-past"]);
    let (later, sooner) = (at(Utc::now() + hour), at(Utc::now() + hour / 2));
    let publish = [
        "publish",
        "stamp",
        "--not-before",
        &later,
        "--expires-at",
        &sooner,
    ];
    let (status, _, err) = sc.run(
        "drumline",
        &[&["--config", sc.cfg()][..], &publish].concat(),
    );
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains("--expires-at"),
        "the command line refuses it too: {err}"
    );
}
