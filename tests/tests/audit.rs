//! The journal, `audit` and `verify` (docs/audit.md), end to end with the real beat and worker:
//! a job that runs shows `ran` (one effect per row), a failing one `dead`, a paused one
//! `skipped (paused)`, and `verify` holds on the clean history; then histories broken on
//! purpose — an instant whose every trace is deleted, a forged second success — are reported
//! `MISSED` / `DOUBLED` by `audit` and as violations (key, rule, evidence, exit 1) by `verify`.

use drumline_e2e::cfg::{every, shell, Cfg, Keys};
use drumline_e2e::scenario::{appends, class_of, journal, Scenario};
use drumline_e2e::{instant_of, wait_until, TestEnv};
use redis::AsyncCommands;
use serde_json::Value;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);

/// `tick` (1 s) appends its key to `ran`, `bad` (2 s) fails twice, `held` (1 s) like `tick`.
fn config(env: &TestEnv) -> Cfg {
    let fail = Keys::default()
        .with("command", "[\"/bin/false\"]")
        .with("max_retries", "1")
        .with("retry_base", "\"1s\"");
    let on = |task: &str| every("1s").with("task", &format!("\"{task}\""));
    Cfg::new()
        .set("worker", "lease", "\"5s\"")
        .task("ok", appends(env, "ran"))
        .task("fail", fail)
        .job("tick", on("ok"))
        .job("bad", every("2s").with("task", "\"fail\""))
        .job("held", on("ok"))
}

/// `drumline audit JOB --from FROM --json`: its rows.
fn audit(sc: &Scenario, job: &str, from: &str) -> Vec<Value> {
    let out = sc.cli(&["audit", job, "--from", from, "--json"]);
    let doc: Value = serde_json::from_str(&out).expect("audit --json");
    assert_eq!(doc["job"], job);
    doc["instants"].as_array().expect("instants").clone()
}

fn with_class<'a>(rows: &'a [Value], class: &str) -> Vec<&'a Value> {
    rows.iter().filter(|r| r["class"] == class).collect()
}

/// `bin verify --since 10m [extra…] --json`: (exit code, document).
fn verify(sc: &Scenario, bin: &str, extra: &[&str]) -> (i32, Value) {
    let mut args = vec!["--config", sc.cfg(), "verify", "--since", "10m", "--json"];
    args.extend_from_slice(extra);
    let (status, out, err) = sc.run(bin, &args);
    let doc = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}"));
    (status.code().unwrap_or(-1), doc)
}

/// Runs the beat and a worker until `tick` ran 4 times, `bad` has a dead instance and `held`
/// (paused before the beat starts) skipped 2; stops them.
async fn run_a_while(sc: &mut Scenario, from: &str) {
    sc.cli(&["pause", "held"]);
    sc.start_workers(1).await;
    sc.start_beat();
    sc.wait(WAIT, "tick ran 4, bad died, held skipped 2", || {
        sc.lines("ran").len() >= 4
            && !with_class(&audit(sc, "bad", from), "dead").is_empty()
            && with_class(&audit(sc, "held", from), "skipped").len() >= 2
    });
    sc.stop();
}

/// Deletes every trace of instance `key` of `job`: its journal entries, run state and record.
async fn erase(env: &TestEnv, job: &str, key: &str) {
    let mut redis = env.redis().await;
    let journal_key = env.names().journal();
    for (id, fields) in journal(env).await {
        if fields.get("key").map(String::as_str) == Some(key) {
            let _: i64 = redis.xdel(&journal_key, &[id]).await.unwrap();
        }
    }
    let _: i64 = redis.del(format!("{}:run:{key}", env.ns)).await.unwrap();
    let history = format!("{}:history:{job}", env.ns);
    let records: Vec<String> = redis.lrange(&history, 0, -1).await.unwrap();
    for record in records.iter().filter(|r| r.contains(key)) {
        let _: i64 = redis.lrem(&history, 0, record).await.unwrap();
    }
}

/// A second `success` of `key`, by worker `forger`: its journal id.
async fn forge_success(env: &TestEnv, key: &str) -> String {
    let fields = [
        ("ev", "success"),
        ("key", key),
        ("att", "0"),
        ("tok", "forged"),
        ("w", "forger"),
    ];
    let mut redis = env.redis().await;
    redis
        .xadd(env.names().journal(), "*", &fields)
        .await
        .unwrap()
}

/// Each of `keys` has a `published` journal entry, and its `claim` names the same epoch.
async fn claims_name_their_epoch(env: &TestEnv, keys: &[&str]) {
    let entries = journal(env).await;
    let field = |ev: &str, key: &str| {
        let entry = entries
            .iter()
            .find(|(_, f)| f["ev"] == ev && f["key"] == key);
        entry.and_then(|(_, f)| f.get("ep").cloned())
    };
    for key in keys {
        let published = field("published", key);
        assert!(published.is_some(), "{key}: {entries:#?}");
        assert_eq!(field("claim", key), published, "{key}: {entries:#?}");
    }
}

/// `verify`'s document `doc` reports exactly two violations: `gone` missed, and `twice`
/// doubled with the forged journal entry `forged` (by `forger`) as its evidence.
fn assert_missed_and_doubled(doc: &Value, gone: &str, twice: &str, forged: &str) {
    let violations = doc["violations"].as_array().unwrap();
    let rule_of = |key: &str| {
        let found = violations.iter().find(|v| v["key"] == key);
        found.unwrap_or_else(|| panic!("{key} not reported: {doc:#}"))
    };
    assert_eq!(rule_of(gone)["rule"], "missed");
    assert_eq!(rule_of(twice)["rule"], "doubled");
    let evidence = rule_of(twice)["evidence"].as_str().unwrap();
    let signed = evidence.contains(forged) && evidence.contains("forger");
    assert!(signed, "{evidence}");
    assert_eq!(violations.len(), 2, "{doc:#}");
}

#[tokio::test(flavor = "multi_thread")]
async fn audit_classifies_each_instant_and_verify_catches_broken_histories() {
    let mut sc = Scenario::new("e2e_audit", config);
    let from = chrono::Utc::now().to_rfc3339();
    run_a_while(&mut sc, &from).await;
    // Every `ran` row is one effect, and every effect a `ran` row.
    let tick = audit(&sc, "tick", &from);
    let ran = with_class(&tick, "ran");
    let ran_keys: Vec<&str> = ran.iter().map(|r| r["key"].as_str().unwrap()).collect();
    let effects = sc.lines("ran");
    let of_tick = |k: &&str| k.starts_with("tick@");
    let tick_effects: Vec<&str> = effects.iter().map(String::as_str).filter(of_tick).collect();
    assert_eq!(ran_keys, tick_effects, "{tick:#?}");
    assert!(ran.len() >= 4);
    for row in &ran {
        assert_eq!(row["attempts"], 1, "{row}");
        let timed = row["lateness_ms"].is_i64() && row["duration_ms"].is_i64();
        assert!(timed, "{row}");
    }
    let ran_or_pending = |r: &Value| r["class"] == "ran" || r["class"] == "pending";
    assert!(tick.iter().all(ran_or_pending), "{tick:#?}");
    let bad = audit(&sc, "bad", &from);
    let dead = with_class(&bad, "dead");
    assert_eq!(dead[0]["attempts"], 2, "max_retries + 1: {bad:#?}");
    assert!(with_class(&bad, "ran").is_empty(), "{bad:#?}");
    let held = audit(&sc, "held", &from);
    let skipped = with_class(&held, "skipped");
    assert!(skipped.iter().all(|r| r["reason"] == "paused"), "{held:#?}");
    let what = format!("a paused job never runs: {held:#?}");
    assert_eq!(skipped.len(), held.len(), "{what}");
    let (code, doc) = verify(&sc, "drumline-beat", &[]);
    assert_eq!((code, &doc["holds"]), (0, &Value::Bool(true)), "{doc:#}");
    let decided = (ran.len() + dead.len() + skipped.len()) as u64;
    assert!(doc["checked"].as_u64().unwrap() >= decided);
    assert_eq!(doc["violations"], serde_json::json!([]));
    // A worker's claim names the epoch of the leader that published the copy it ran.
    claims_name_their_epoch(&sc, &ran_keys).await;
    // Broken on purpose: every trace of one instant gone, a second success forged for another.
    let (gone, twice) = (ran_keys[1].to_owned(), ran_keys[2].to_owned());
    erase(&sc, "tick", &gone).await;
    let forged = forge_success(&sc, &twice).await;
    let tick = audit(&sc, "tick", &from);
    let class = |key: &str| class_of(&tick, key);
    assert_eq!(class(&gone).as_deref(), Some("missed"), "{tick:#?}");
    assert_eq!(class(&twice).as_deref(), Some("doubled"), "{tick:#?}");
    let (code, doc) = verify(&sc, "drumline-beat", &[]);
    assert_eq!((code, &doc["holds"]), (1, &Value::Bool(false)), "{doc:#}");
    assert_missed_and_doubled(&doc, &gone, &twice, &forged);
    // The table says the same, with the same exit code, on both binaries.
    let table = ["--config", sc.cfg(), "verify", "--since", "10m"];
    let (status, out, _) = sc.run("drumline", &table);
    assert_eq!(status.code(), Some(1));
    assert!(out.contains("2 violations") && out.contains(&gone), "{out}");
}

/// `drumline verify --since 10m --overdue O --json`: (exit code, document).
fn verify_overdue(sc: &Scenario, overdue: &str) -> (i32, Value) {
    verify(sc, "drumline", &["--overdue", overdue])
}

fn rules_of(doc: &Value) -> Vec<(String, String)> {
    let rule = |v: &Value| {
        (
            v["rule"].as_str().unwrap().to_owned(),
            v["key"].as_str().unwrap().to_owned(),
        )
    };
    doc["violations"]
        .as_array()
        .expect("violations")
        .iter()
        .map(rule)
        .collect()
}

/// Issue 33: a backfill of instants before the job's first start is a documented operator
/// action: `verify` holds after it (it reported every instant between the backfill and the
/// first start `missed`).
#[tokio::test(flavor = "multi_thread")]
async fn verify_holds_after_a_backfill_of_instants_before_the_first_start() {
    let start = chrono::Utc::now();
    let mut sc = Scenario::start("e2e_verify_backfill", 1, 1, config).await;
    sc.wait(WAIT, "two runs", || sc.lines("ran").len() >= 2);
    let fmt = |t: chrono::DateTime<chrono::Utc>| t.format("%Y-%m-%dT%H:%M:%SZ").to_string();
    let from = fmt(start - chrono::Duration::seconds(60));
    let to = fmt(start - chrono::Duration::seconds(50));
    sc.cli(&["backfill", "tick", "--from", &from, "--to", &to]);
    let before_start = |k: &&String| {
        k.starts_with("tick@") && instant_of(k) < start - chrono::Duration::seconds(40)
    };
    let backfilled = |sc: &Scenario| sc.lines("ran").iter().filter(before_start).count();
    sc.wait(WAIT, "ten backfilled", || backfilled(&sc) >= 10);
    let (code, doc) = verify_overdue(&sc, "15m");
    assert_eq!((code, rules_of(&doc)), (0, vec![]), "{doc:#}");
    sc.stop();
}

/// `verify`'s document `doc` names at least `lost` instances `lost` and a `tick` instant
/// `not_published`.
fn reports_lost_and_unpublished(doc: &Value, lost: usize) -> bool {
    let rules = rules_of(doc);
    let reported_lost = rules.iter().filter(|(r, _)| r == "lost").count();
    let unpublished = |(r, k): &(String, String)| r == "not_published" && k.starts_with("tick@");
    reported_lost >= lost && rules.iter().any(unpublished)
}

/// Issue 33: the only beat killed, and the published copies it left lost by the broker (the
/// work queue purged): `verify` names the job's first unpublished instant (`not_published`)
/// and each published instance that never ended (`lost`); it said "holds".
#[tokio::test(flavor = "multi_thread")]
async fn verify_reports_a_dead_beat_and_published_instances_that_never_ended() {
    let mut sc = Scenario::start("e2e_verify_lost", 1, 0, |_| {
        Cfg::new()
            .set("beat", "misfire_threshold", "\"1s\"")
            .task("ok", shell("true"))
            .job("tick", every("1s").with("task", "\"ok\""))
    })
    .await;
    sc.wait_queued("default", 2).await;
    sc.last_beat().kill9();
    let queue = sc.names().work_queue("default");
    let amqp = sc.amqp().await;
    let channel = amqp.create_channel().await.unwrap();
    let purged = channel
        .queue_purge(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    assert!(purged >= 2, "{purged}");
    let reported = |doc: &Value| reports_lost_and_unpublished(doc, purged as usize);
    let mut last = Value::Null;
    let seen = wait_until(WAIT, || {
        let (code, doc) = verify_overdue(&sc, "1s");
        let hit = code == 1 && reported(&doc);
        last = doc;
        hit
    });
    assert!(seen, "{last:#}");
}
