//! `drumline-worker dlq list | replay | purge` against the real broker, Redis and worker.

use drumline_e2e::cfg::{every, shell, Cfg};
use drumline_e2e::scenario::{
    appends, appends_after, class_of, journal, set_run_field, stop, JournalEntry, Scenario,
};
use drumline_e2e::{adhoc, wait_until, TestEnv};
use lapin::BasicProperties;
use serde_json::Value;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// (key, reason, attempts, whether it says when it died) of a dead letter.
fn letter(row: &Value) -> (Option<&str>, Option<&str>, Option<u64>, bool) {
    let died = row["dead_at"].is_string();
    let (key, reason) = (row["key"].as_str(), row["reason"].as_str());
    (key, reason, row["attempts"].as_u64(), died)
}

/// `drumline-worker --config CFG dlq ARGS` (words), which must succeed: its trimmed stdout.
fn dlq(sc: &Scenario, args: &str) -> String {
    let args: Vec<&str> = ["dlq"].into_iter().chain(args.split(' ')).collect();
    sc.run_ok("drumline-worker", &args).trim().to_owned()
}

/// Task `fragile` appends its key to `effects`, and fails permanently while the file
/// `broken` exists (it does at first).
fn fragile(env: &TestEnv) -> Cfg {
    let flag = env.path("broken");
    std::fs::write(&flag, "").expect("flag");
    let unless_broken = format!("[ ! -e {} ] || exit 3", flag.display());
    let fragile = appends_after(env, "effects", &unless_broken);
    let fragile = fragile.with("permanent_exit_codes", "[3]");
    Cfg::new()
        .set("worker", "lease", "\"3s\"")
        .task("fragile", fragile)
}

/// Publishes `k1` and `k2` of `fragile` (which fail for good while `broken` exists), and
/// `k3` to queue `idle`, where nobody consumes, expiring in 100 ms: the broker dead-letters it.
fn publish_three(sc: &mut Scenario) {
    for key in ["k1", "k2"] {
        sc.run_ok("drumline-beat", &["publish", "fragile", "--key", key]);
    }
    let idle = sc.names().work_queue("idle");
    sc.forget_queue_later(idle);
    let expiring = "publish fragile --key k3 --queue idle --expires 100ms";
    sc.run_ok("drumline-beat", &expiring.split(' ').collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_are_listed_replayed_and_purged() {
    let mut sc = Scenario::start("e2e_dlq", 0, 1, fragile).await;
    let dead = sc.names().dead();
    publish_three(&mut sc);
    sc.wait_dead_letters(3).await;
    let rows = sc.dlq_rows();
    assert_eq!(rows.len(), 3, "{rows:?}");
    let k1 = (Some("k1"), Some("permanent"), Some(1), true);
    assert_eq!(letter(&rows[0]), k1);
    assert_eq!(rows[0]["error"], "exit code 3");
    assert_eq!(rows[0]["task"], "fragile");
    // k3's `dead_at` is from x-death.
    let k3 = (Some("k3"), Some("expired"), Some(0), true);
    assert_eq!(letter(&rows[2]), k3);
    // Listing leaves them in place.
    assert_eq!(sc.queue_len(&dead).await, Some(3));
    // Fix the cause, replay one: it runs, the others stay.
    std::fs::remove_file(sc.path("broken")).expect("unflag");
    assert_eq!(dlq(&sc, "replay k1"), "replayed k1");
    sc.wait(WAIT, "k1 ran", || sc.lines("effects") == vec!["k1"]);
    let keys: Vec<_> = sc.dlq_rows().iter().map(|r| r["key"].clone()).collect();
    assert_eq!(keys, vec!["k2", "k3"]);
    assert_eq!(dlq(&sc, "purge --yes"), "purged 2 dead letters");
    assert_eq!(sc.queue_len(&dead).await, Some(0));
    sc.stop();
    assert_eq!(sc.lines("effects"), vec!["k1"], "k2 was purged, never run");
}

#[tokio::test(flavor = "multi_thread")]
async fn replaying_a_key_that_is_not_dead_lettered_fails() {
    let mut sc = Scenario::start("e2e_dlq_missing", 0, 1, fragile).await;
    let args = ["--config", sc.cfg(), "dlq", "replay", "no-such-key"];
    let (status, _, stderr) = sc.run("drumline-worker", &args);
    assert_eq!(status.code(), Some(1));
    let what = "not found in the dead letters: no-such-key";
    assert!(stderr.contains(what), "{stderr}");
    sc.stop();
}

/// The journal's entries of event `ev` under `key`.
fn entries_of<'a>(entries: &'a [JournalEntry], ev: &str, key: &str) -> Vec<&'a JournalEntry> {
    let of = |(_, e): &&JournalEntry| e["ev"] == ev && e["key"] == key;
    entries.iter().filter(of).collect()
}

/// The keys of the dead letters among `rows` whose reason is `reason`.
fn keys_with_reason(rows: &[Value], reason: &str) -> Vec<String> {
    let with = rows.iter().filter(|l| l["reason"] == reason);
    with.map(|l| l["key"].as_str().expect("a key").to_owned())
        .collect()
}

/// `audit` gives each of `keys` the class `class` among `rows`.
fn all_classed(rows: &[Value], keys: &[String], class: &str) -> bool {
    keys.iter()
        .all(|key| class_of(rows, key).as_deref() == Some(class))
}

// See: issues/33. Instances the broker expired in their queue while no worker ran are
// journaled `expired` once a worker is back, so `audit` never leaves them `pending`.
#[tokio::test(flavor = "multi_thread")]
async fn instances_the_broker_expired_are_audited_expired() {
    let mut sc = Scenario::start("e2e_broker_expired", 1, 0, |env| {
        let tick = every("1s").with("task", "\"ok\"").with("expires", "\"2s\"");
        let cfg = Cfg::new().set("worker", "lease", "\"5s\"");
        cfg.task("ok", appends(env, "ran")).job("tick", tick)
    })
    .await;
    let from = chrono::Utc::now().to_rfc3339();
    // No worker: the broker dead-letters each instance 2 s after it was published.
    sc.wait_dead_letters(3).await;
    sc.stop();
    let letters = sc.dlq_rows();
    let expired = keys_with_reason(&letters, "expired");
    assert!(expired.len() >= 3, "{letters:?}");
    sc.start_workers(1).await;
    let rows = || sc.audit_rows("tick", &["--from", &from]);
    let audited = wait_until(WAIT, || all_classed(&rows(), &expired, "expired"));
    sc.check(audited, format!("{expired:?}\n{:#?}", rows()));
    sc.stop();
    // None ran; each journaled once under its key; the letters stay listed for `dlq`.
    let entries = journal(&sc).await;
    for key in &expired {
        assert!(!sc.lines("ran").contains(key), "{key} never ran");
        let journaled = entries_of(&entries, "expired", key).len();
        assert_eq!(journaled, 1, "{key}: {entries:#?}");
    }
    let listed = sc.queue_len(&sc.names().dead()).await;
    assert!(listed.is_some_and(|n| n as usize >= expired.len()));
}

/// The reason (`r`) of the first `dead` entry for `key`, if any.
fn dead_reason(entries: &[JournalEntry], key: &str) -> Option<String> {
    let first = entries_of(entries, "dead", key).into_iter().next();
    first.map(|(_, e)| e.get("r").cloned().unwrap_or_default())
}

/// The rows among `rows` of class `class`.
fn with_class(rows: Vec<Value>, class: &str) -> Vec<Value> {
    rows.into_iter().filter(|r| r["class"] == class).collect()
}

// See: issues/33. An instance the beat publishes for a task no worker has is journaled `dead`
// (reason `unknown_task`), so `audit` classes it `dead`.
#[tokio::test(flavor = "multi_thread")]
async fn scheduled_instances_of_a_task_no_worker_has_are_audited_dead() {
    // The beat schedules `gone`, whose task the worker's config does not have.
    let gone = Cfg::new()
        .task("gone", shell("true"))
        .job("gone", every("1s"));
    let mut sc = Scenario::new("e2e_dead_unknown", |_| gone);
    let worker_cfg = sc.config_named("worker.toml", &Cfg::new().task("ok", shell("true")));
    let worker = sc.worker_ready("worker", &worker_cfg).await;
    sc.workers.push(worker);
    let from = chrono::Utc::now().to_rfc3339();
    sc.start_beat();
    let dead_rows = |sc: &Scenario| with_class(sc.audit_rows("gone", &["--from", &from]), "dead");
    sc.wait(WAIT, "two dead rows", || dead_rows(&sc).len() >= 2);
    stop(&mut [sc.last_beat()]);
    for row in dead_rows(&sc) {
        let reason = row["reason"].as_str().unwrap_or_default();
        assert!(reason.starts_with("unknown_task"), "{row}");
    }
    sc.stop();
}

// See: issues/33. A message naming a task no worker has, and a malformed one whose key can be
// read, are journaled `dead` under that key with their reason; a key another instance already
// holds is left alone.
#[tokio::test(flavor = "multi_thread")]
async fn unknown_task_and_malformed_dead_letters_are_journaled_dead() {
    let ok = |_: &TestEnv| Cfg::new().task("ok", shell("true"));
    let mut sc = Scenario::start("e2e_dead_journaled", 0, 1, ok).await;
    // Ad hoc: an unknown task; a task name no config allows (malformed, its key readable);
    // an unknown task under the key of an instance that is done already.
    sc.publish(&adhoc("k-unknown", "nope")).await;
    let bad_name = br#"{"key":"k-malformed","task":"no such task"}"#;
    sc.publish_raw("default", bad_name, BasicProperties::default())
        .await;
    set_run_field(&sc, "k-done", "state", "done").await;
    sc.publish(&adhoc("k-done", "nope")).await;
    let both = |entries: &[JournalEntry]| {
        dead_reason(entries, "k-unknown").is_some() && dead_reason(entries, "k-malformed").is_some()
    };
    let journaled = || async { both(&journal(&sc).await) };
    let journaled = drumline_e2e::wait_until_async(WAIT, journaled).await;
    let entries = journal(&sc).await;
    sc.check(journaled, format!("{entries:#?}"));
    let reason = |key| dead_reason(&entries, key);
    assert_eq!(reason("k-unknown").as_deref(), Some("unknown_task"));
    assert_eq!(reason("k-malformed").as_deref(), Some("malformed"));
    assert_eq!(sc.run_state("k-unknown").await.as_deref(), Some("dead"));
    assert_eq!(sc.run_state("k-malformed").await.as_deref(), Some("dead"));
    // k-done was done: once the worker has taken and settled its copy, nothing changed.
    sc.wait_drained("default").await;
    sc.stop();
    assert_eq!(dead_reason(&journal(&sc).await, "k-done"), None);
    assert_eq!(sc.run_state("k-done").await.as_deref(), Some("done"));
}
