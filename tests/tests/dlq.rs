//! `drumline-worker dlq list | replay | purge` against the real broker, Redis and worker.

use drumline_e2e::cfg::{every, shell, Cfg};
use drumline_e2e::scenario::{
    appends, appends_after, class_of, journal, stop, JournalEntry, Scenario,
};
use drumline_e2e::{adhoc, wait_until};
use lapin::BasicProperties;
use serde_json::Value;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// `drumline-worker dlq list --json`, sorted by key.
fn dlq_list(sc: &Scenario) -> Vec<Value> {
    let out = sc.run_ok("drumline-worker", &["dlq", "list", "--json"]);
    let mut rows: Vec<Value> = serde_json::from_str(&out).expect("dlq list --json");
    rows.sort_by_key(|r| r["key"].as_str().unwrap_or_default().to_owned());
    rows
}

/// (key, reason, attempts) of a dead letter.
fn letter(row: &Value) -> (Option<&str>, Option<&str>, Option<u64>) {
    (
        row["key"].as_str(),
        row["reason"].as_str(),
        row["attempts"].as_u64(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_are_listed_replayed_and_purged() {
    // Fails permanently while the flag file exists.
    let mut sc = Scenario::start("e2e_dlq", 0, 1, |env| {
        let flag = env.path("broken");
        std::fs::write(&flag, "").expect("flag");
        let fragile = appends_after(
            env,
            "effects",
            &format!("[ ! -e {} ] || exit 3", flag.display()),
        );
        let fragile = fragile.with("permanent_exit_codes", "[3]");
        Cfg::new()
            .set("worker", "lease", "\"3s\"")
            .task("fragile", fragile)
    })
    .await;
    let dead = sc.names().dead();
    for key in ["k1", "k2"] {
        sc.run_ok("drumline-beat", &["publish", "fragile", "--key", key]);
    }
    // An instance that expires while queued where nobody consumes: the broker dead-letters it.
    let idle = sc.names().work_queue("idle");
    sc.forget_queue_later(idle);
    let k3 = [
        "publish",
        "fragile",
        "--key",
        "k3",
        "--queue",
        "idle",
        "--expires",
        "100ms",
    ];
    sc.run_ok("drumline-beat", &k3);
    let three = || async { sc.queue_len(&dead).await == Some(3) };
    sc.wait_async(WAIT, "three dead letters", three).await;

    let rows = dlq_list(&sc);
    assert_eq!(rows.len(), 3, "{rows:?}");
    assert_eq!(letter(&rows[0]), (Some("k1"), Some("permanent"), Some(1)));
    assert_eq!(rows[0]["error"], "exit code 3");
    assert_eq!(rows[0]["task"], "fragile");
    assert!(rows[0]["dead_at"].is_string());
    assert_eq!(letter(&rows[2]), (Some("k3"), Some("expired"), Some(0)));
    assert!(rows[2]["dead_at"].is_string(), "from x-death");
    // Listing leaves them in place.
    assert_eq!(sc.queue_len(&dead).await, Some(3));

    // Fix the cause, replay one: it runs, the others stay.
    std::fs::remove_file(sc.path("broken")).expect("unflag");
    let out = sc.run_ok("drumline-worker", &["dlq", "replay", "k1"]);
    assert_eq!(out.trim(), "replayed k1");
    sc.wait(WAIT, "k1 ran", || sc.lines("effects") == vec!["k1"]);
    let keys: Vec<_> = dlq_list(&sc).iter().map(|r| r["key"].clone()).collect();
    assert_eq!(keys, vec!["k2", "k3"]);

    let args = ["--config", sc.cfg(), "dlq", "replay", "no-such-key"];
    let (status, _, stderr) = sc.run("drumline-worker", &args);
    assert_eq!(status.code(), Some(1));
    let what = "not found in the dead letters: no-such-key";
    assert!(stderr.contains(what), "{stderr}");

    let out = sc.run_ok("drumline-worker", &["dlq", "purge", "--yes"]);
    assert_eq!(out.trim(), "purged 2 dead letters");
    assert_eq!(sc.queue_len(&dead).await, Some(0));
    sc.stop();
    assert_eq!(sc.lines("effects"), vec!["k1"], "k2 was purged, never run");
}

/// The journal's entries of event `ev` under `key`.
fn entries_of<'a>(entries: &'a [JournalEntry], ev: &str, key: &str) -> Vec<&'a JournalEntry> {
    let of = |(_, e): &&JournalEntry| e["ev"] == ev && e["key"] == key;
    entries.iter().filter(of).collect()
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
    let dead = sc.names().dead();
    // No worker: the broker dead-letters each instance 2 s after it was published.
    let three = || async { sc.queue_len(&dead).await.is_some_and(|n| n >= 3) };
    sc.wait_async(WAIT, "three dead letters", three).await;
    sc.stop();
    let letters = dlq_list(&sc);
    let expired: Vec<String> = letters
        .iter()
        .filter(|l| l["reason"] == "expired")
        .map(|l| l["key"].as_str().expect("a key").to_owned())
        .collect();
    assert!(expired.len() >= 3, "{letters:?}");

    sc.start_workers(1).await;
    let rows = || sc.audit_rows("tick", &["--from", &from]);
    let all_expired = |rows: &[Value]| {
        expired
            .iter()
            .all(|key| class_of(rows, key).as_deref() == Some("expired"))
    };
    let audited = wait_until(WAIT, || all_expired(&rows()));
    sc.check(audited, format!("{expired:?}\n{:#?}", rows()));
    sc.stop();
    for key in &expired {
        assert!(!sc.lines("ran").contains(key), "{key} never ran");
    }
    // Each once, journaled under its key; the letters stay listed for `dlq`.
    let entries = journal(&sc).await;
    for key in &expired {
        assert_eq!(
            entries_of(&entries, "expired", key).len(),
            1,
            "{key}: {entries:#?}"
        );
    }
    let listed = sc.queue_len(&dead).await;
    assert!(listed.is_some_and(|n| n as usize >= expired.len()));
}

/// The reason (`r`) of the first `dead` entry for `key`, if any.
fn dead_reason(entries: &[JournalEntry], key: &str) -> Option<String> {
    let first = entries_of(entries, "dead", key).into_iter().next();
    first.map(|(_, e)| e.get("r").cloned().unwrap_or_default())
}

// See: issues/33. A message naming a task no worker has, and a malformed one whose key can be
// read, are journaled `dead` under that key with their reason, so `audit` classes the job's
// instances `dead`; a key another instance already holds is left alone.
#[tokio::test(flavor = "multi_thread")]
async fn unknown_task_and_malformed_dead_letters_are_journaled_dead() {
    // The beat schedules `gone`, whose task the worker's config does not have.
    let mut sc = Scenario::start("e2e_dead_journaled", 0, 1, |_| {
        Cfg::new().task("ok", shell("true"))
    })
    .await;
    let beat_cfg = Cfg::new()
        .task("gone", shell("true"))
        .job("gone", every("1s"));
    let beat_cfg = sc.write_config("beat.toml", &beat_cfg);
    let beat_cfg = beat_cfg.to_str().expect("utf-8");
    let from = chrono::Utc::now().to_rfc3339();
    let beat = sc.env.beat("beat", &["--config", beat_cfg]);
    sc.beats.push(beat);
    let dead_rows = |sc: &Scenario| {
        let args = [
            "--config", beat_cfg, "audit", "gone", "--from", &from, "--json",
        ];
        let (status, out, err) = sc.run("drumline", &args);
        assert!(status.success(), "audit gone: {err}");
        let doc: Value = serde_json::from_str(&out).expect("audit --json");
        let rows = doc["instants"].as_array().cloned().unwrap_or_default();
        rows.into_iter()
            .filter(|r| r["class"] == "dead")
            .collect::<Vec<_>>()
    };
    sc.wait(WAIT, "two dead rows", || dead_rows(&sc).len() >= 2);
    stop(&mut [sc.last_beat()]);
    for row in dead_rows(&sc) {
        let reason = row["reason"].as_str().unwrap_or_default();
        assert!(reason.starts_with("unknown_task"), "{row}");
    }

    // Ad hoc: an unknown task; a task name no config allows (malformed, its key readable);
    // an unknown task under the key of an instance that is done already.
    sc.publish(&adhoc("k-unknown", "nope")).await;
    let bad_name = br#"{"key":"k-malformed","task":"no such task"}"#;
    sc.publish_raw("default", bad_name, BasicProperties::default())
        .await;
    let _: () = redis::cmd("HSET")
        .arg(sc.names().run_key("k-done"))
        .arg("state")
        .arg("done")
        .query_async(&mut sc.redis().await)
        .await
        .expect("HSET");
    sc.publish(&adhoc("k-done", "nope")).await;
    let both = |entries: &[JournalEntry]| {
        dead_reason(entries, "k-unknown").is_some() && dead_reason(entries, "k-malformed").is_some()
    };
    let journaled = drumline_e2e::wait_until_async(WAIT, || async { both(&journal(&sc).await) });
    let journaled = journaled.await;
    let entries = journal(&sc).await;
    sc.check(journaled, format!("{entries:#?}"));
    assert_eq!(
        dead_reason(&entries, "k-unknown").as_deref(),
        Some("unknown_task")
    );
    assert_eq!(
        dead_reason(&entries, "k-malformed").as_deref(),
        Some("malformed")
    );
    assert_eq!(sc.run_state("k-unknown").await.as_deref(), Some("dead"));
    assert_eq!(sc.run_state("k-malformed").await.as_deref(), Some("dead"));
    // k-done was done: once the worker has taken and settled its copy, nothing changed.
    let queue = sc.names().work_queue("default");
    let drained = || async { sc.queue_len(&queue).await == Some(0) };
    sc.wait_async(WAIT, "the work queue drained", drained).await;
    sc.stop();
    assert_eq!(dead_reason(&journal(&sc).await, "k-done"), None);
    assert_eq!(sc.run_state("k-done").await.as_deref(), Some("done"));
}
