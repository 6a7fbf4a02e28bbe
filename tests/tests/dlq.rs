//! `drumline-worker dlq list | replay | purge` against the real broker, Redis and worker.

use drumline_e2e::cfg::{every, shell, Cfg};
use drumline_e2e::{adhoc, setup, toml_string, wait_until, wait_until_async, TestEnv};
use lapin::BasicProperties;
use serde_json::Value;
use std::collections::HashMap;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_are_listed_replayed_and_purged() {
    let mut env = setup("e2e_dlq");
    let broken = env.path("broken");
    std::fs::write(&broken, "").unwrap();
    // Fails permanently while the flag file exists.
    let script = format!(
        "[ -e {flag} ] && exit 3; echo \"$DRUMLINE_KEY\" >> {effects}",
        flag = broken.display(),
        effects = env.path("effects").display()
    );
    let cfg = env.config(
        "drumline.toml",
        &format!(
            "[worker]\nlease = \"3s\"\n[tasks.fragile]\ncommand = [\"/bin/sh\", \"-c\", {}]\npermanent_exit_codes = [3]\n",
            toml_string(&script)
        ),
    );
    let cfg = cfg.to_str().unwrap();
    let dead = env.names().dead();
    let mut worker = env.worker("worker", &["--config", cfg]);
    for key in ["k1", "k2"] {
        let (status, _, stderr) = env.run(
            "drumline-beat",
            &["--config", cfg, "publish", "fragile", "--key", key],
        );
        assert!(status.success(), "{stderr}");
    }
    // An instance that expires while queued where nobody consumes: the broker dead-letters it.
    env.forget_queue_later(env.names().work_queue("idle"));
    let (status, _, stderr) = env.run(
        "drumline-beat",
        &[
            "--config",
            cfg,
            "publish",
            "fragile",
            "--key",
            "k3",
            "--queue",
            "idle",
            "--expires",
            "100ms",
        ],
    );
    assert!(status.success(), "{stderr}");
    assert!(
        wait_until_async(WAIT, || async { env.queue_len(&dead).await == Some(3) }).await,
        "{:?}\n{}",
        env.queue_len(&dead).await,
        worker.log_tail(20)
    );

    let list = || {
        let (status, stdout, stderr) = env.run(
            "drumline-worker",
            &["--config", cfg, "dlq", "list", "--json"],
        );
        assert!(status.success(), "{stderr}");
        let mut rows: Vec<serde_json::Value> = serde_json::from_str(&stdout).unwrap();
        rows.sort_by_key(|r| r["key"].as_str().unwrap_or_default().to_owned());
        rows
    };
    let rows = list();
    assert_eq!(rows.len(), 3, "{rows:?}");
    assert_eq!(
        (
            rows[0]["key"].as_str(),
            rows[0]["reason"].as_str(),
            rows[0]["attempts"].as_u64()
        ),
        (Some("k1"), Some("permanent"), Some(1))
    );
    assert_eq!(rows[0]["error"], "exit code 3");
    assert_eq!(rows[0]["task"], "fragile");
    assert!(rows[0]["dead_at"].is_string());
    assert_eq!(
        (
            rows[2]["key"].as_str(),
            rows[2]["reason"].as_str(),
            rows[2]["attempts"].as_u64()
        ),
        (Some("k3"), Some("expired"), Some(0))
    );
    assert!(rows[2]["dead_at"].is_string(), "from x-death");
    // Listing leaves them in place.
    assert_eq!(env.queue_len(&dead).await, Some(3));

    // Fix the cause, replay one: it runs, the others stay.
    std::fs::remove_file(&broken).unwrap();
    let (status, stdout, stderr) =
        env.run("drumline-worker", &["--config", cfg, "dlq", "replay", "k1"]);
    assert!(status.success(), "{stderr}");
    assert_eq!(stdout.trim(), "replayed k1");
    assert!(
        wait_until(WAIT, || env.lines("effects") == vec!["k1"]),
        "{}",
        worker.log_tail(20)
    );
    let keys: Vec<_> = list()
        .iter()
        .map(|r| r["key"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(keys, vec!["k2", "k3"]);

    let (status, _, stderr) = env.run(
        "drumline-worker",
        &["--config", cfg, "dlq", "replay", "no-such-key"],
    );
    assert_eq!(status.code(), Some(1));
    assert!(
        stderr.contains("not found in the dead letters: no-such-key"),
        "{stderr}"
    );

    let (status, stdout, _) = env.run(
        "drumline-worker",
        &["--config", cfg, "dlq", "purge", "--yes"],
    );
    assert!(status.success());
    assert_eq!(stdout.trim(), "purged 2 dead letters");
    assert_eq!(env.queue_len(&dead).await, Some(0));
    assert!(worker.terminate(Duration::from_secs(20)).success());
    assert_eq!(env.lines("effects"), vec!["k1"], "k2 was purged, never run");
}

/// `drumline audit JOB --json` over the window from `from`: its rows.
fn audit(env: &TestEnv, cfg: &str, job: &str, from: &str) -> Vec<Value> {
    let (status, out, err) = env.run(
        "drumline",
        &["--config", cfg, "audit", job, "--from", from, "--json"],
    );
    assert!(status.success(), "audit {job}: {err}");
    let doc: Value = serde_json::from_str(&out).expect("audit --json");
    doc["instants"].as_array().expect("instants").clone()
}

/// The class `audit` gives `key` among `rows`.
fn class_of(rows: &[Value], key: &str) -> Option<String> {
    let row = rows.iter().find(|r| r["key"] == key)?;
    row["class"].as_str().map(str::to_owned)
}

/// Every journal entry of the namespace, oldest first.
async fn journal(env: &TestEnv) -> Vec<HashMap<String, String>> {
    let mut redis = env.redis().await;
    let entries: Vec<(String, HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(env.names().journal())
        .arg("-")
        .arg("+")
        .query_async(&mut redis)
        .await
        .unwrap();
    entries.into_iter().map(|(_, fields)| fields).collect()
}

// See: issues/33. Instances the broker expired in their queue while no worker ran are
// journaled `expired` once a worker is back, so `audit` never leaves them `pending`.
#[tokio::test(flavor = "multi_thread")]
async fn instances_the_broker_expired_are_audited_expired() {
    let env = setup("e2e_broker_expired");
    let ran = env.path("ran");
    let cfg = Cfg::new()
        .set("worker", "lease", "\"5s\"")
        .task(
            "ok",
            shell(&format!("echo \"$DRUMLINE_KEY\" >> {}", ran.display())),
        )
        .job(
            "tick",
            every("1s").with("task", "\"ok\"").with("expires", "\"2s\""),
        );
    let cfg = env.write_config("drumline.toml", &cfg);
    let cfg = cfg.to_str().unwrap();
    let from = chrono::Utc::now().to_rfc3339();
    let dead = env.names().dead();
    let mut beat = env.beat("beat", &["--config", cfg]);
    // No worker: the broker dead-letters each instance 2 s after it was published.
    assert!(
        wait_until_async(WAIT, || async {
            env.queue_len(&dead).await.is_some_and(|n| n >= 3)
        })
        .await,
        "{}",
        beat.log_tail(20)
    );
    assert!(beat.terminate(Duration::from_secs(10)).success());
    let (status, stdout, stderr) = env.run(
        "drumline-worker",
        &["--config", cfg, "dlq", "list", "--json"],
    );
    assert!(status.success(), "{stderr}");
    let letters: Vec<Value> = serde_json::from_str(&stdout).unwrap();
    let expired: Vec<String> = letters
        .iter()
        .filter(|l| l["reason"] == "expired")
        .map(|l| l["key"].as_str().unwrap().to_owned())
        .collect();
    assert!(expired.len() >= 3, "{letters:?}");

    let mut worker = env.worker("worker", &["--config", cfg]);
    let audited = wait_until(WAIT, || {
        let rows = audit(&env, cfg, "tick", &from);
        expired
            .iter()
            .all(|key| class_of(&rows, key).as_deref() == Some("expired"))
    });
    let rows = audit(&env, cfg, "tick", &from);
    assert!(audited, "{expired:?}\n{rows:#?}\n{}", worker.log_tail(20));
    assert!(worker.terminate(Duration::from_secs(20)).success());
    for key in &expired {
        assert!(!env.lines("ran").contains(key), "{key} never ran");
    }
    // Each once, journaled under its key; the letters stay listed for `dlq`.
    let entries = journal(&env).await;
    for key in &expired {
        let n = entries
            .iter()
            .filter(|e| e["ev"] == "expired" && &e["key"] == key)
            .count();
        assert_eq!(n, 1, "{key}: {entries:#?}");
    }
    assert!(env
        .queue_len(&dead)
        .await
        .is_some_and(|n| n as usize >= expired.len()));
}

// See: issues/33. A message naming a task no worker has, and a malformed one whose key can be
// read, are journaled `dead` under that key with their reason, so `audit` classes the job's
// instances `dead`; a key another instance already holds is left alone.
#[tokio::test(flavor = "multi_thread")]
async fn unknown_task_and_malformed_dead_letters_are_journaled_dead() {
    let env = setup("e2e_dead_journaled");
    // The beat schedules `gone`, whose task this worker's config does not have.
    let beat_cfg = Cfg::new()
        .task("gone", shell("true"))
        .job("gone", every("1s"));
    let beat_cfg = env.write_config("beat.toml", &beat_cfg);
    let beat_cfg = beat_cfg.to_str().unwrap();
    let worker_cfg = Cfg::new().task("ok", shell("true"));
    let worker_cfg = env.write_config("worker.toml", &worker_cfg);
    let worker_cfg = worker_cfg.to_str().unwrap();
    let from = chrono::Utc::now().to_rfc3339();
    let mut worker = env.worker("worker", &["--config", worker_cfg]);
    env.wait_for_topology(&worker).await;
    let mut beat = env.beat("beat", &["--config", beat_cfg]);
    let dead_rows = || {
        audit(&env, beat_cfg, "gone", &from)
            .into_iter()
            .filter(|r| r["class"] == "dead")
            .collect::<Vec<_>>()
    };
    let settled = wait_until(WAIT, || dead_rows().len() >= 2);
    assert!(settled, "{}\n{}", beat.log_tail(20), worker.log_tail(20));
    assert!(beat.terminate(Duration::from_secs(10)).success());
    for row in dead_rows() {
        let reason = row["reason"].as_str().unwrap_or_default();
        assert!(reason.starts_with("unknown_task"), "{row}");
    }

    // Ad hoc: an unknown task; a task name no config allows (malformed, its key readable);
    // an unknown task under the key of an instance that is done already.
    env.publish(&adhoc("k-unknown", "nope")).await;
    let bad_name = br#"{"key":"k-malformed","task":"no such task"}"#;
    env.publish_raw("default", bad_name, BasicProperties::default())
        .await;
    let mut redis = env.redis().await;
    let _: () = redis::cmd("HSET")
        .arg(env.names().run_key("k-done"))
        .arg("state")
        .arg("done")
        .query_async(&mut redis)
        .await
        .unwrap();
    env.publish(&adhoc("k-done", "nope")).await;
    let reason_of = |entries: &[HashMap<String, String>], key: &str| {
        entries
            .iter()
            .find(|e| e["ev"] == "dead" && e["key"] == key)
            .map(|e| e.get("r").cloned().unwrap_or_default())
    };
    let journaled = wait_until_async(WAIT, || async {
        let entries = journal(&env).await;
        reason_of(&entries, "k-unknown").is_some() && reason_of(&entries, "k-malformed").is_some()
    })
    .await;
    let entries = journal(&env).await;
    assert!(journaled, "{entries:#?}\n{}", worker.log_tail(20));
    assert_eq!(
        reason_of(&entries, "k-unknown").as_deref(),
        Some("unknown_task")
    );
    assert_eq!(
        reason_of(&entries, "k-malformed").as_deref(),
        Some("malformed")
    );
    assert_eq!(env.run_state("k-unknown").await.as_deref(), Some("dead"));
    assert_eq!(env.run_state("k-malformed").await.as_deref(), Some("dead"));
    // k-done was done: once the worker has taken and settled its copy, nothing changed.
    let drained = wait_until_async(WAIT, || async {
        env.queue_len(&env.names().work_queue("default")).await == Some(0)
    })
    .await;
    assert!(drained);
    assert!(worker.terminate(Duration::from_secs(20)).success());
    assert_eq!(reason_of(&journal(&env).await, "k-done"), None);
    assert_eq!(env.run_state("k-done").await.as_deref(), Some("done"));
}
