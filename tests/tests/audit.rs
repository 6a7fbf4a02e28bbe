//! The journal, `audit` and `verify` (docs/audit.md), end to end with the real beat and worker:
//! a job that runs shows `ran` (one effect per row), a failing one `dead`, a paused one
//! `skipped (paused)`, and `verify` holds on the clean history; then histories broken on
//! purpose — an instant whose every trace is deleted, a forged second success — are reported
//! `MISSED` / `DOUBLED` by `audit` and as violations (key, rule, evidence, exit 1) by `verify`.

use drumline_e2e::cfg::{every, shell, Cfg, Keys};
use drumline_e2e::{setup, wait_until, wait_until_async, TestEnv};
use redis::AsyncCommands;
use serde_json::Value;
use std::collections::HashMap;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);

fn config(env: &TestEnv) -> String {
    let ran = env.path("ran");
    let cfg = Cfg::new()
        .set("worker", "lease", "\"5s\"")
        .task(
            "ok",
            shell(&format!("echo \"$DRUMLINE_KEY\" >> {}", ran.display())),
        )
        .task(
            "fail",
            Keys::default()
                .with("command", "[\"/bin/false\"]")
                .with("max_retries", "1")
                .with("retry_base", "\"1s\""),
        )
        .job("tick", every("1s").with("task", "\"ok\""))
        .job("bad", every("2s").with("task", "\"fail\""))
        .job("held", every("1s").with("task", "\"ok\""));
    env.write_config("drumline.toml", &cfg)
        .to_str()
        .unwrap()
        .to_owned()
}

/// `drumline audit JOB --from FROM --json`: its rows.
fn audit(env: &TestEnv, cfg: &str, job: &str, from: &str) -> Vec<Value> {
    let (status, out, err) = env.run(
        "drumline",
        &["--config", cfg, "audit", job, "--from", from, "--json"],
    );
    assert!(status.success(), "audit {job}: {err}");
    let doc: Value = serde_json::from_str(&out).expect("audit --json");
    assert_eq!(doc["job"], job);
    doc["instants"].as_array().expect("instants").clone()
}

fn with_class<'a>(rows: &'a [Value], class: &str) -> Vec<&'a Value> {
    rows.iter().filter(|r| r["class"] == class).collect()
}

/// `drumline-beat verify --since 10m --json`: (exit code, document).
fn verify(env: &TestEnv, cfg: &str) -> (i32, Value) {
    let args = ["--config", cfg, "verify", "--since", "10m", "--json"];
    let (status, out, err) = env.run("drumline-beat", &args);
    let doc = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}"));
    (status.code().unwrap_or(-1), doc)
}

/// Runs the beat and a worker until `tick` ran 4 times, `bad` has a dead instance and `held`
/// (paused before the beat starts) skipped 2; stops them.
fn run_a_while(env: &TestEnv, cfg: &str, from: &str) {
    let (status, _, err) = env.run("drumline", &["--config", cfg, "pause", "held"]);
    assert!(status.success(), "{err}");
    let mut worker = env.worker("worker", &["--config", cfg]);
    let mut beat = env.beat("beat", &["--config", cfg]);
    let settled = wait_until(WAIT, || {
        env.lines("ran").len() >= 4
            && !with_class(&audit(env, cfg, "bad", from), "dead").is_empty()
            && with_class(&audit(env, cfg, "held", from), "skipped").len() >= 2
    });
    assert!(settled, "{}\n{}", beat.log_tail(20), worker.log_tail(20));
    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(20)).success());
}

/// Deletes every trace of instance `key` of `job`: its journal entries, run state and record.
async fn erase(env: &TestEnv, job: &str, key: &str) {
    let mut redis = env.redis().await;
    let journal = format!("{}:journal", env.ns);
    let entries: Vec<(String, HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(&journal)
        .arg("-")
        .arg("+")
        .query_async(&mut redis)
        .await
        .unwrap();
    for (id, fields) in entries {
        if fields.get("key").map(String::as_str) == Some(key) {
            let _: i64 = redis.xdel(&journal, &[id]).await.unwrap();
        }
    }
    let _: i64 = redis.del(format!("{}:run:{key}", env.ns)).await.unwrap();
    let history = format!("{}:history:{job}", env.ns);
    let records: Vec<String> = redis.lrange(&history, 0, -1).await.unwrap();
    for record in records.iter().filter(|r| r.contains(key)) {
        let _: i64 = redis.lrem(&history, 0, record).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn audit_classifies_each_instant_and_verify_catches_broken_histories() {
    let env = setup("e2e_audit");
    let cfg = config(&env);
    let from = chrono::Utc::now().to_rfc3339();
    run_a_while(&env, &cfg, &from);

    // Every `ran` row is one effect, and every effect a `ran` row.
    let tick = audit(&env, &cfg, "tick", &from);
    let ran = with_class(&tick, "ran");
    let effects = env.lines("ran");
    let ran_keys: Vec<&str> = ran.iter().map(|r| r["key"].as_str().unwrap()).collect();
    let tick_effects: Vec<&str> = effects
        .iter()
        .map(String::as_str)
        .filter(|k| k.starts_with("tick@"))
        .collect();
    assert_eq!(ran_keys, tick_effects, "{tick:#?}");
    assert!(ran.len() >= 4);
    for row in &ran {
        assert_eq!(row["attempts"], 1, "{row}");
        assert!(
            row["lateness_ms"].is_i64() && row["duration_ms"].is_i64(),
            "{row}"
        );
    }
    assert!(
        tick.iter()
            .all(|r| r["class"] == "ran" || r["class"] == "pending"),
        "{tick:#?}"
    );

    let bad = audit(&env, &cfg, "bad", &from);
    let dead = with_class(&bad, "dead");
    assert_eq!(dead[0]["attempts"], 2, "max_retries + 1: {bad:#?}");
    assert!(with_class(&bad, "ran").is_empty(), "{bad:#?}");

    let held = audit(&env, &cfg, "held", &from);
    let skipped = with_class(&held, "skipped");
    assert!(skipped.iter().all(|r| r["reason"] == "paused"), "{held:#?}");
    assert_eq!(
        skipped.len(),
        held.len(),
        "a paused job never runs: {held:#?}"
    );

    let (code, doc) = verify(&env, &cfg);
    assert_eq!((code, &doc["holds"]), (0, &Value::Bool(true)), "{doc:#}");
    assert!(doc["checked"].as_u64().unwrap() >= (ran.len() + dead.len() + skipped.len()) as u64);
    assert_eq!(doc["violations"], serde_json::json!([]));

    // A worker's claim names the epoch of the leader that published the copy it ran.
    let mut redis = env.redis().await;
    let entries: Vec<(String, HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(format!("{}:journal", env.ns))
        .arg("-")
        .arg("+")
        .query_async(&mut redis)
        .await
        .unwrap();
    let field = |ev: &str, key: &str| {
        entries
            .iter()
            .find(|(_, f)| f["ev"] == ev && f["key"] == key)
            .and_then(|(_, f)| f.get("ep").cloned())
    };
    for key in &ran_keys {
        let published = field("published", key);
        assert!(published.is_some(), "{key}: {entries:#?}");
        assert_eq!(field("claim", key), published, "{key}: {entries:#?}");
    }

    // Broken on purpose: every trace of one instant gone, a second success forged for another.
    let (gone, twice) = (ran_keys[1].to_owned(), ran_keys[2].to_owned());
    erase(&env, "tick", &gone).await;
    let forged: String = redis
        .xadd(
            format!("{}:journal", env.ns),
            "*",
            &[
                ("ev", "success"),
                ("key", &twice),
                ("att", "0"),
                ("tok", "forged"),
                ("w", "forger"),
            ],
        )
        .await
        .unwrap();

    let tick = audit(&env, &cfg, "tick", &from);
    let class_of = |key: &str| {
        tick.iter()
            .find(|r| r["key"] == key)
            .map(|r| r["class"].clone())
    };
    assert_eq!(class_of(&gone), Some(Value::from("missed")), "{tick:#?}");
    assert_eq!(class_of(&twice), Some(Value::from("doubled")), "{tick:#?}");

    let (code, doc) = verify(&env, &cfg);
    assert_eq!((code, &doc["holds"]), (1, &Value::Bool(false)), "{doc:#}");
    let violations = doc["violations"].as_array().unwrap();
    let rule_of = |key: &str| {
        violations
            .iter()
            .find(|v| v["key"] == key)
            .unwrap_or_else(|| panic!("{key} not reported: {doc:#}"))
    };
    assert_eq!(rule_of(&gone)["rule"], "missed");
    assert_eq!(rule_of(&twice)["rule"], "doubled");
    let evidence = rule_of(&twice)["evidence"].as_str().unwrap();
    assert!(
        evidence.contains(&forged) && evidence.contains("forger"),
        "{evidence}"
    );
    assert_eq!(violations.len(), 2, "{doc:#}");

    // The table says the same, with the same exit code, on both binaries.
    let (status, out, _) = env.run("drumline", &["--config", &cfg, "verify", "--since", "10m"]);
    assert_eq!(status.code(), Some(1));
    assert!(out.contains("2 violations") && out.contains(&gone), "{out}");
}

/// `drumline verify --since 10m --overdue O --json`: (exit code, document).
fn verify_overdue(env: &TestEnv, cfg: &str, overdue: &str) -> (i32, Value) {
    let args = [
        "--config",
        cfg,
        "verify",
        "--since",
        "10m",
        "--overdue",
        overdue,
        "--json",
    ];
    let (status, out, err) = env.run("drumline", &args);
    let doc = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}"));
    (status.code().unwrap_or(-1), doc)
}

fn rules_of(doc: &Value) -> Vec<(String, String)> {
    doc["violations"]
        .as_array()
        .expect("violations")
        .iter()
        .map(|v| {
            (
                v["rule"].as_str().unwrap().to_owned(),
                v["key"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// Issue 33: a backfill of instants before the job's first start is a documented operator
/// action: `verify` holds after it (it reported every instant between the backfill and the
/// first start `missed`).
#[tokio::test(flavor = "multi_thread")]
async fn verify_holds_after_a_backfill_of_instants_before_the_first_start() {
    let env = setup("e2e_verify_backfill");
    let cfg = config(&env);
    let start = chrono::Utc::now();
    let mut worker = env.worker("worker", &["--config", &cfg]);
    env.wait_for_topology(&worker).await;
    let mut beat = env.beat("beat", &["--config", &cfg]);
    assert!(
        wait_until(WAIT, || env.lines("ran").len() >= 2),
        "{}",
        beat.log_tail(20)
    );
    let fmt = |t: chrono::DateTime<chrono::Utc>| t.format("%Y-%m-%dT%H:%M:%SZ").to_string();
    let (from, to) = (
        fmt(start - chrono::Duration::seconds(60)),
        fmt(start - chrono::Duration::seconds(50)),
    );
    let (status, out, err) = env.run(
        "drumline",
        &[
            "--config", &cfg, "backfill", "tick", "--from", &from, "--to", &to,
        ],
    );
    assert!(status.success(), "{out}{err}");
    let backfilled = |env: &TestEnv| {
        env.lines("ran")
            .iter()
            .filter(|k| {
                k.starts_with("tick@")
                    && drumline_e2e::instant_of(k) < start - chrono::Duration::seconds(40)
            })
            .count()
    };
    assert!(
        wait_until(WAIT, || backfilled(&env) >= 10),
        "{}",
        worker.log_tail(20)
    );
    let (code, doc) = verify_overdue(&env, &cfg, "15m");
    assert_eq!((code, rules_of(&doc)), (0, vec![]), "{doc:#}");
    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(20)).success());
}

/// Issue 33: the only beat killed, and the published copies it left lost by the broker (the
/// work queue purged): `verify` names the job's first unpublished instant (`not_published`)
/// and each published instance that never ended (`lost`); it said "holds".
#[tokio::test(flavor = "multi_thread")]
async fn verify_reports_a_dead_beat_and_published_instances_that_never_ended() {
    let env = setup("e2e_verify_lost");
    let cfg = Cfg::new()
        .set("beat", "misfire_threshold", "\"1s\"")
        .task("ok", shell("true"))
        .job("tick", every("1s").with("task", "\"ok\""));
    let cfg = env.write_config("drumline.toml", &cfg);
    let cfg = cfg.to_str().unwrap();
    let mut beat = env.beat("beat", &["--config", cfg]);
    let queue = env.names().work_queue("default");
    assert!(
        wait_until_async(WAIT, || async {
            env.queue_len(&queue).await.unwrap_or(0) >= 2
        })
        .await,
        "{}",
        beat.log_tail(20)
    );
    beat.kill9();
    let amqp = env.amqp().await;
    let channel = amqp.create_channel().await.unwrap();
    let purged = channel
        .queue_purge(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    assert!(purged >= 2, "{purged}");
    let reported = |doc: &Value| {
        let rules = rules_of(doc);
        let lost = rules.iter().filter(|(r, _)| r == "lost").count();
        let unpublished = rules
            .iter()
            .any(|(r, k)| r == "not_published" && k.starts_with("tick@"));
        lost >= purged as usize && unpublished
    };
    let mut last = Value::Null;
    let seen = wait_until(WAIT, || {
        let (code, doc) = verify_overdue(&env, cfg, "1s");
        let hit = code == 1 && reported(&doc);
        last = doc;
        hit
    });
    assert!(seen, "{last:#}");
}
