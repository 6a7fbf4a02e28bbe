//! Job dependencies (docs/design.md#job-dependencies), end to end: `after = "UPSTREAM"` runs a
//! job's instance for instant T once UPSTREAM's instance for T succeeded, in order along a
//! chain; skips it (reason `upstream`, cascading) when UPSTREAM's instance is dead or
//! `after_timeout` passes; `check` refuses cycles and unknown upstreams.
// See: issues/21

use drumline_e2e::cfg::{every, shell, Cfg, Keys};
use drumline_e2e::{instant_of, setup, toml_string, wait_until, wait_until_async, TestEnv};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(40);

/// A task that writes `start KEY NS`, sleeps `sleep` s, then ends with `tail` (`exit 1`) or
/// writes `end KEY NS`.
fn stamped(env: &TestEnv, sleep: f64, tail: &str) -> Keys {
    let log = env.path("spans").display().to_string();
    let end = if tail.is_empty() {
        format!("echo \"end $DRUMLINE_KEY $(date +%s%N)\" >> {log}")
    } else {
        tail.to_owned()
    };
    shell(&format!(
        "echo \"start $DRUMLINE_KEY $(date +%s%N)\" >> {log}; sleep {sleep}; {end}"
    ))
}

/// A job that follows `upstream`.
fn after(upstream: &str, timeout: &str) -> Keys {
    Keys::default()
        .with("after", &toml_string(upstream))
        .with("after_timeout", &toml_string(timeout))
        .with("overlap", "\"queue\"")
}

/// The stamps of the effect file: per key, (start, end) in ns.
fn spans(env: &TestEnv) -> BTreeMap<String, (u128, Option<u128>)> {
    let mut out: BTreeMap<String, (u128, Option<u128>)> = BTreeMap::new();
    for line in env.lines("spans") {
        let parts: Vec<&str> = line.split(' ').collect();
        let at: u128 = parts[2].parse().unwrap();
        if parts[0] == "start" {
            let first = out.insert(parts[1].to_owned(), (at, None));
            assert!(first.is_none(), "{} started twice", parts[1]);
        } else {
            out.get_mut(parts[1]).expect("end after start").1 = Some(at);
        }
    }
    out
}

/// Keys of `job` in the effect file.
fn keys_of(spans: &BTreeMap<String, (u128, Option<u128>)>, job: &str) -> Vec<String> {
    let prefix = format!("{job}@");
    spans
        .keys()
        .filter(|k| k.starts_with(&prefix))
        .cloned()
        .collect()
}

fn key(job: &str, upstream_key: &str) -> String {
    format!("{job}@{}", upstream_key.split_once('@').unwrap().1)
}

/// `field` of instance `key`'s run record.
async fn run_field(env: &TestEnv, key: &str, field: &str) -> Option<String> {
    let mut redis = env.redis().await;
    redis::cmd("HGET")
        .arg(env.names().run_key(key))
        .arg(field)
        .query_async(&mut redis)
        .await
        .expect("redis")
}

/// The keys of `upstream_keys` whose `follower` instance is recorded `skipped`.
async fn skipped_after(env: &TestEnv, follower: &str, upstream_keys: Vec<String>) -> Vec<String> {
    let mut out = Vec::new();
    for a in upstream_keys {
        if run_field(env, &key(follower, &a), "state").await.as_deref() == Some("skipped") {
            out.push(a);
        }
    }
    out
}

fn start(env: &TestEnv, cfg: &Cfg) -> (PathBuf, drumline_e2e::Proc, drumline_e2e::Proc) {
    let cfg = env.write_config("drumline.toml", cfg);
    let path = cfg.to_str().unwrap();
    let worker = env.worker("worker", &["--config", path]);
    let beat = env.beat("beat", &["--config", path]);
    (cfg, worker, beat)
}

fn base() -> Cfg {
    Cfg::new()
        .set("worker", "concurrency", "6")
        .set("worker", "lease", "\"3s\"")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_chain_runs_in_order_for_each_instant() {
    let env = setup("e2e_after_chain");
    let cfg = base()
        .task("a", stamped(&env, 0.2, ""))
        .task("b", stamped(&env, 0.2, ""))
        .task("c", stamped(&env, 0.1, ""))
        .job("a", every("2s").with("overlap", "\"queue\""))
        .job("b", after("a", "20s"))
        .job("c", after("b", "20s"));
    let (_cfg, mut worker, mut beat) = start(&env, &cfg);
    let three = wait_until(WAIT, || {
        let s = spans(&env);
        keys_of(&s, "c")
            .iter()
            .filter(|k| s[*k].1.is_some())
            .count()
            >= 3
    });
    assert!(three, "{}\n{}", beat.log_tail(30), worker.log_tail(30));
    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(20)).success());
    let s = spans(&env);
    let last_c = keys_of(&s, "c")
        .into_iter()
        .map(|k| instant_of(&k))
        .max()
        .unwrap();
    // Every instant of `a` up to the last `c` ran the whole chain, each step after the one
    // before it had ended.
    let mut chains = 0;
    for a in keys_of(&s, "a").iter().filter(|k| instant_of(k) <= last_c) {
        let (b, c) = (key("b", a), key("c", a));
        let end = |k: &str| {
            s.get(k)
                .and_then(|(_, e)| *e)
                .unwrap_or_else(|| panic!("{k} did not run: {s:?}"))
        };
        assert!(end(a) <= s[&b].0, "{b} started before {a} ended");
        assert!(end(&b) <= s[&c].0, "{c} started before {b} ended");
        chains += 1;
    }
    assert!(chains >= 3, "{s:?}");
    for k in keys_of(&s, "c") {
        assert_eq!(env.run_state(&k).await.as_deref(), Some("done"), "{k}");
    }
}

/// The leader publishes followers: killed (kill -9) while they run, the next leader decides
/// the instants it left undecided from the upstream's records, and no follower of a success is
/// lost or run twice.
#[tokio::test(flavor = "multi_thread")]
async fn a_leader_killed_mid_chain_loses_no_follower() {
    let env = setup("e2e_after_kill");
    let cfg = base()
        .set("beat", "leader_lease", "\"1s\"")
        .task("a", stamped(&env, 0.3, ""))
        .task("b", stamped(&env, 0.0, ""))
        .job("a", every("1s").with("overlap", "\"allow\""))
        .job("b", after("a", "20s"));
    let (cfg, mut worker, mut beat) = start(&env, &cfg);
    let path = cfg.to_str().unwrap();
    let two = wait_until(WAIT, || keys_of(&spans(&env), "b").len() >= 2);
    assert!(two, "{}", beat.log_tail(30));
    // Often while an instance of `a` runs, whose success then lands with no leader to see it.
    beat.kill9();
    let killed_at = chrono::Utc::now();
    let mut beat = env.beat("beat2", &["--config", path]);
    let after_kill = |s: &BTreeMap<String, (u128, Option<u128>)>| {
        keys_of(s, "b")
            .iter()
            .filter(|k| instant_of(k) > killed_at)
            .count()
    };
    assert!(
        wait_until(WAIT, || after_kill(&spans(&env)) >= 2),
        "{}",
        beat.log_tail(30)
    );
    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(20)).success());
    let s = spans(&env);
    let last_b = keys_of(&s, "b")
        .into_iter()
        .map(|k| instant_of(&k))
        .max()
        .unwrap();
    // Every success of `a` up to the last `b` has its `b` (each started once: `spans` checks).
    for a in keys_of(&s, "a").iter().filter(|k| instant_of(k) <= last_b) {
        if env.run_state(a).await.as_deref() == Some("done") {
            assert!(
                s.contains_key(&key("b", a)),
                "{a} succeeded, its b was lost: {s:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_upstream_skips_the_chain_below_it() {
    let env = setup("e2e_after_dead");
    let cfg = base()
        .task("a", stamped(&env, 0.0, "exit 1").with("max_retries", "0"))
        .task("b", stamped(&env, 0.0, ""))
        .task("c", stamped(&env, 0.0, ""))
        .job("a", every("1s"))
        .job("b", after("a", "30s"))
        .job("c", after("b", "30s"));
    let (cfg, mut worker, mut beat) = start(&env, &cfg);
    // Two instants of `a` dead, and `c` skipped for both (well before the 30 s timeout).
    let skipped_c = || async { skipped_after(&env, "c", keys_of(&spans(&env), "a")).await };
    let two = wait_until_async(WAIT, || async { skipped_c().await.len() >= 2 }).await;
    let skipped = skipped_c().await;
    assert!(two, "{}\n{}", beat.log_tail(30), worker.log_tail(30));
    for a in &skipped {
        assert_eq!(env.run_state(a).await.as_deref(), Some("dead"), "{a}");
        for follower in ["b", "c"] {
            let k = key(follower, a);
            assert_eq!(
                run_field(&env, &k, "state").await.as_deref(),
                Some("skipped"),
                "{k}"
            );
            assert_eq!(
                run_field(&env, &k, "reason").await.as_deref(),
                Some("upstream"),
                "{k}"
            );
        }
    }
    let path = cfg.to_str().unwrap();
    let (status, out, err) = env.run("drumline-beat", &["--config", path, "status", "--json"]);
    assert!(status.success(), "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    let job = |name: &str| {
        json["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["job"] == name)
            .unwrap()
            .clone()
    };
    assert_eq!(job("b")["after"], "a");
    assert_eq!(job("c")["after"], "b");
    assert!(job("a")["after"].is_null());
    assert_eq!(job("b")["last_skipped"]["reason"], "upstream");
    assert!(
        job("b")["last_skipped"]["detail"]
            .as_str()
            .unwrap()
            .ends_with("is dead"),
        "{out}"
    );
    assert!(
        job("c")["last_skipped"]["detail"]
            .as_str()
            .unwrap()
            .ends_with("was skipped"),
        "{out}"
    );
    let (_, table, _) = env.run("drumline-beat", &["--config", path, "status"]);
    assert!(
        table.contains("after a") && table.contains("b last skipped: b@"),
        "{table}"
    );
    // `audit` shows the skips with their reason: the skip is journaled like every fate decision.
    let (status, out, err) = env.run("drumline", &["--config", path, "audit", "c", "--json"]);
    assert!(status.success(), "{err}");
    let audit: serde_json::Value = serde_json::from_str(&out).unwrap();
    for a in &skipped {
        let k = key("c", a);
        let row = audit["instants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["key"] == k.as_str())
            .unwrap_or_else(|| panic!("{k} not in {out}"))
            .clone();
        assert_eq!(
            (row["class"].as_str(), row["reason"].as_str()),
            (Some("skipped"), Some("upstream")),
            "{row}"
        );
    }
    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(20)).success());
    // Neither follower ever ran.
    let s = spans(&env);
    assert!(
        keys_of(&s, "b").is_empty() && keys_of(&s, "c").is_empty(),
        "{s:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn after_timeout_skips_an_instance_whose_upstream_is_late() {
    let env = setup("e2e_after_timeout");
    let cfg = base()
        .task("a", stamped(&env, 1.5, ""))
        .task("b", stamped(&env, 0.0, ""))
        .job("a", every("2s"))
        .job("b", after("a", "500ms"));
    let (_cfg, mut worker, mut beat) = start(&env, &cfg);
    // Two instants of `a` that succeeded, `b` skipped for each: `a` took longer than 500 ms.
    let done_a = || {
        let s = spans(&env);
        keys_of(&s, "a")
            .into_iter()
            .filter(|k| s[k].1.is_some())
            .collect::<Vec<_>>()
    };
    let late_b = || async { skipped_after(&env, "b", done_a()).await };
    let two = wait_until_async(WAIT, || async { late_b().await.len() >= 2 }).await;
    let late = late_b().await;
    assert!(two, "{}\n{}", beat.log_tail(30), worker.log_tail(30));
    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(20)).success());
    for a in &late {
        let b = key("b", a);
        assert_eq!(
            run_field(&env, &b, "reason").await.as_deref(),
            Some("upstream")
        );
        let ok = wait_until_async(WAIT, || async {
            env.run_state(a).await.as_deref() == Some("done")
        })
        .await;
        assert!(ok, "{a} did not end done");
    }
    assert!(keys_of(&spans(&env), "b").is_empty(), "b ran");
}

#[test]
fn check_refuses_cycles_unknown_upstreams_and_a_schedule_beside_after() {
    let env = setup("e2e_after_check");
    let cases = [
        (
            base()
                .task("t", shell("true"))
                .job("a", after("c", "1s").with("task", "\"t\""))
                .job("b", after("a", "1s").with("task", "\"t\""))
                .job("c", after("b", "1s").with("task", "\"t\"")),
            "job \"a\": key `after`: a cycle: a → c → b → a",
        ),
        (
            base()
                .task("t", shell("true"))
                .job("a", every("1s").with("task", "\"t\""))
                .job("b", after("nope", "1s").with("task", "\"t\"")),
            "job \"b\": key `after`: no job named \"nope\"",
        ),
        (
            base()
                .task("t", shell("true"))
                .job("a", every("1s").with("task", "\"t\""))
                .job(
                    "b",
                    after("a", "1s")
                        .with("task", "\"t\"")
                        .with("cron", "\"* * * * *\""),
                ),
            "job \"b\": key `after`: an `after` job runs on its upstream's instants: remove `cron`",
        ),
    ];
    for (cfg, expected) in cases {
        let path = env.write_config("drumline.toml", &cfg);
        let (status, _, err) = env.run(
            "drumline-beat",
            &["--config", path.to_str().unwrap(), "check"],
        );
        assert_eq!(status.code(), Some(2), "{err}");
        assert!(err.contains(expected), "{err}");
    }
}

/// A name for a job with `jitter = max` in `env`'s namespace whose offset is at least `least`:
/// the offset is a hash of the namespace, which is new on every run.
fn jittered_name(env: &TestEnv, least: Duration, max: Duration) -> String {
    (0..1000)
        .map(|i| format!("up{i}"))
        .find(|name| drumline_shared::jitter::offset(&env.ns, name, max) >= least)
        .expect("one name in a thousand has a late offset")
}

/// A jittered upstream is published its offset after the instant; its expiry and its
/// followers' `after_timeout` count from then, so neither its `expires` (shorter than the
/// offset) nor the default `after_timeout` skips a follower of a success.
// See: issues/33
#[tokio::test(flavor = "multi_thread")]
async fn a_jittered_upstreams_followers_run_after_its_late_success() {
    let env = setup("e2e_after_jitter");
    let up = jittered_name(&env, Duration::from_secs(8), Duration::from_secs(9));
    let cfg = base()
        .task(&up, stamped(&env, 2.5, ""))
        .task("b", stamped(&env, 0.0, ""))
        .task("c", stamped(&env, 0.0, ""))
        .job(
            &up,
            every("10s")
                .with("jitter", "\"9s\"")
                .with("expires", "\"5s\""),
        )
        // The default after_timeout: the root's `every`, 10 s.
        .job("b", Keys::default().with("after", &toml_string(&up)))
        .job("c", after(&up, "60s"));
    let (_cfg, mut worker, mut beat) = start(&env, &cfg);
    let followed = |s: &BTreeMap<String, (u128, Option<u128>)>| {
        keys_of(s, &up)
            .iter()
            .filter(|a| s.contains_key(&key("b", a)) && s.contains_key(&key("c", a)))
            .count()
    };
    let two = wait_until(Duration::from_secs(60), || followed(&spans(&env)) >= 2);
    let s = spans(&env);
    let mut skips = Vec::new();
    for a in keys_of(&s, &up) {
        for f in ["b", "c"] {
            let k = key(f, &a);
            if let Some(state) = run_field(&env, &k, "state").await {
                skips.push(format!("{k}: {state}"));
            }
        }
    }
    assert!(
        two,
        "followers of {up}'s successes: {skips:?}\n{}",
        beat.log_tail(20)
    );
    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(20)).success());
}

/// Whole seconds in `(from, to)`: the instants of an `every = "1s"` job.
fn seconds_between(
    from: chrono::DateTime<chrono::Utc>,
    to: chrono::DateTime<chrono::Utc>,
) -> Vec<chrono::DateTime<chrono::Utc>> {
    let first = from.timestamp() + 1;
    (first..)
        .map(|s| chrono::DateTime::from_timestamp(s, 0).unwrap())
        .take_while(|t| *t < to)
        .collect()
}

/// Waits until each of `job`'s instances at `instants` is recorded `skipped` with reason
/// `upstream`; the ones that are not, when `within` ran out.
async fn skipped_upstream(
    env: &TestEnv,
    job: &str,
    instants: &[chrono::DateTime<chrono::Utc>],
    within: Duration,
) -> Vec<String> {
    let keys: Vec<String> = instants
        .iter()
        .map(|t| drumline_shared::envelope::instance_key(job, *t))
        .collect();
    let not_yet = || async {
        let mut out = Vec::new();
        for k in &keys {
            let state = run_field(env, k, "state").await;
            let reason = run_field(env, k, "reason").await;
            if (state.as_deref(), reason.as_deref()) != (Some("skipped"), Some("upstream")) {
                out.push(format!("{k}: {state:?} {reason:?}"));
            }
        }
        out
    };
    wait_until_async(within, || async { not_yet().await.is_empty() }).await;
    not_yet().await
}

/// A paused upstream's instants, and the ones a restarted beat drops by its misfire policy,
/// are never published: their followers are skipped (reason `upstream`, down the chain) at
/// once, not after `after_timeout`.
// See: issues/33
#[tokio::test(flavor = "multi_thread")]
async fn a_paused_or_misfired_upstream_skips_its_followers_at_once() {
    let env = setup("e2e_after_paused");
    let cfg = base()
        .task("a", stamped(&env, 0.0, ""))
        .task("b", stamped(&env, 0.0, ""))
        .task("c", stamped(&env, 0.0, ""))
        .job("a", every("1s").with("misfire", "\"skip\""))
        .job("b", after("a", "60s"))
        .job("c", after("b", "60s"));
    let (cfg, mut worker, mut beat) = start(&env, &cfg);
    let path = cfg.to_str().unwrap();
    assert!(
        wait_until(WAIT, || !keys_of(&spans(&env), "c").is_empty()),
        "{}",
        beat.log_tail(20)
    );
    let (status, _, err) = env.run("drumline", &["--config", path, "pause", "a"]);
    assert!(status.success(), "{err}");
    let paused_at = chrono::Utc::now();
    // The leader reads the paused set within a second.
    let paused = seconds_between(
        paused_at + chrono::Duration::seconds(2),
        paused_at + chrono::Duration::seconds(5),
    );
    for job in ["b", "c"] {
        let late = skipped_upstream(&env, job, &paused, Duration::from_secs(15)).await;
        assert!(late.is_empty(), "paused: {late:?}\n{}", beat.log_tail(20));
    }
    let (status, _, err) = env.run("drumline", &["--config", path, "resume", "a"]);
    assert!(status.success(), "{err}");

    // Down for 10 s: at the restart the instants more than 5 s (misfire_threshold) late are
    // dropped by `misfire = "skip"`.
    assert!(beat.terminate(Duration::from_secs(10)).success());
    let down_at = chrono::Utc::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let restart_at = chrono::Utc::now();
    let mut beat = env.beat("beat2", &["--config", path]);
    let missed = seconds_between(down_at, restart_at - chrono::Duration::seconds(6));
    assert!(missed.len() >= 3, "{missed:?}");
    for job in ["b", "c"] {
        let late = skipped_upstream(&env, job, &missed, Duration::from_secs(15)).await;
        assert!(late.is_empty(), "misfired: {late:?}\n{}", beat.log_tail(20));
    }
    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(20)).success());
}

/// `drumline audit JOB --from FROM --json`: its rows.
fn audit_rows(env: &TestEnv, cfg: &str, job: &str, from: &str) -> Vec<serde_json::Value> {
    let args = ["--config", cfg, "audit", job, "--from", from, "--json"];
    let (status, out, err) = env.run("drumline", &args);
    assert!(status.success(), "audit {job}: {err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("audit --json");
    doc["instants"].as_array().expect("instants").clone()
}

/// `trigger` and `backfill` of an upstream publish the upstream's instances only: the
/// follower's instance for a backfilled instant keeps its decision (skipped, reason
/// `upstream`, while the upstream was paused), a trigger's off-schedule instant has none, and
/// `audit` shows exactly that, with no follower row left pending (docs/configuration.md).
// See: issues/33
#[tokio::test(flavor = "multi_thread")]
async fn a_triggered_or_backfilled_upstream_runs_alone_and_audit_says_so() {
    let env = setup("e2e_after_operate");
    let cfg = base()
        .task("a", stamped(&env, 0.0, ""))
        .task("b", stamped(&env, 0.0, ""))
        .job("a", every("1s").with("overlap", "\"allow\""))
        .job("b", after("a", "60s"));
    let (cfg, mut worker, mut beat) = start(&env, &cfg);
    let path = cfg.to_str().unwrap();
    let from = drumline_shared::envelope::format_instant(chrono::Utc::now());
    assert!(
        wait_until(WAIT, || !keys_of(&spans(&env), "b").is_empty()),
        "{}",
        beat.log_tail(20)
    );
    let (status, _, err) = env.run("drumline", &["--config", path, "pause", "a"]);
    assert!(status.success(), "{err}");
    let paused_at = chrono::Utc::now();
    let paused = seconds_between(
        paused_at + chrono::Duration::seconds(2),
        paused_at + chrono::Duration::seconds(5),
    );
    let late = skipped_upstream(&env, "b", &paused, Duration::from_secs(15)).await;
    assert!(late.is_empty(), "{late:?}\n{}", beat.log_tail(20));
    let (status, _, err) = env.run("drumline", &["--config", path, "resume", "a"]);
    assert!(status.success(), "{err}");

    let fmt = drumline_shared::envelope::format_instant;
    let to = *paused.last().unwrap() + chrono::Duration::milliseconds(1);
    // `backfill` takes only the past.
    assert!(wait_until(WAIT, || chrono::Utc::now() > to));
    let window = [fmt(paused[0]), fmt(to)];
    let backfill = [
        "--config", path, "backfill", "a", "--from", &window[0], "--to", &window[1],
    ];
    let (status, out, err) = env.run("drumline", &backfill);
    assert!(status.success(), "{out}{err}");
    let (status, out, err) = env.run("drumline", &["--config", path, "trigger", "a"]);
    assert!(status.success(), "{out}{err}");
    let triggered = out
        .split_whitespace()
        .find_map(|w| w.strip_prefix("key="))
        .unwrap_or_else(|| panic!("no key in {out}"))
        .to_owned();
    let mut upstream: Vec<String> = paused
        .iter()
        .map(|t| drumline_shared::envelope::instance_key("a", *t))
        .collect();
    upstream.push(triggered.clone());
    let ran = wait_until(WAIT, || {
        let s = spans(&env);
        upstream
            .iter()
            .all(|k| s.get(k).is_some_and(|(_, e)| e.is_some()))
    });
    assert!(ran, "{upstream:?}: {:?}", spans(&env));

    // No follower row is pending once the instants are past; each backfilled instant's is
    // the skip it had, and nothing is decided for the trigger's instant.
    let settled = wait_until(WAIT, || {
        audit_rows(&env, path, "b", &from)
            .iter()
            .filter(|r| r["class"] == "pending")
            .all(|r| {
                drumline_e2e::instant_of(r["key"].as_str().unwrap())
                    > chrono::Utc::now() - chrono::Duration::seconds(3)
            })
    });
    let rows = audit_rows(&env, path, "b", &from);
    assert!(settled, "{rows:#?}");
    for t in &paused {
        let k = drumline_shared::envelope::instance_key("b", *t);
        let row = rows.iter().find(|r| r["key"] == k.as_str()).expect("a row");
        assert_eq!(
            (row["class"].as_str(), row["reason"].as_str()),
            (Some("skipped"), Some("upstream")),
            "{row}"
        );
    }
    assert!(
        rows.iter()
            .all(|r| r["key"] != key("b", &triggered).as_str()),
        "{rows:#?}"
    );
    for row in audit_rows(&env, path, "a", &from) {
        if upstream.iter().any(|k| row["key"] == k.as_str()) {
            assert_eq!(row["class"], "ran", "{row}");
        }
    }
    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(20)).success());
    let s = spans(&env);
    for a in &upstream {
        assert!(!s.contains_key(&key("b", a)), "{a}'s follower ran: {s:?}");
    }
}

/// Issue 33: a → b → c with `a` retrying its instant T when a reload reschedules `a`: b and c
/// still decide T (b's and c's schedule is a's, so the reload restarted them from its moment
/// and T was never published, never skipped).
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_that_reschedules_the_root_keeps_the_chains_in_flight() {
    let env = setup("e2e_after_reload");
    let log = env.path("runs").display().to_string();
    let append = |tail: &str| {
        shell(&format!(
            "echo \"$DRUMLINE_KEY $DRUMLINE_ATTEMPT\" >> {log}; {tail}"
        ))
    };
    let config = |every_a: &str| {
        let cfg = Cfg::new()
            .task(
                "a",
                append("[ \"$DRUMLINE_ATTEMPT\" != 0 ]")
                    .with("max_retries", "1")
                    .with("retry_base", "\"4s\"")
                    .with("retry_max", "\"4s\""),
            )
            .task("b", append("true"))
            .task("c", append("true"))
            .job("a", every(every_a).with("overlap", "\"allow\""))
            .job("b", after("a", "60s"))
            .job("c", after("b", "60s"));
        env.write_config("drumline.toml", &cfg)
    };
    let cfg = config("5s");
    let cfg = cfg.to_str().unwrap();
    let mut worker = env.worker("worker", &["--config", cfg]);
    env.wait_for_topology(&worker).await;
    let mut beat = env.beat("beat", &["--config", cfg]);
    // The first instance of `a` failed its attempt 0: its retry comes 4 s later.
    let failed = |env: &TestEnv| {
        env.lines("runs")
            .iter()
            .find(|l| l.starts_with("a@") && l.ends_with(" 0"))
            .map(|l| l.trim_end_matches(" 0").to_owned())
    };
    assert!(
        wait_until(WAIT, || failed(&env).is_some()),
        "{}",
        beat.log_tail(20)
    );
    let t = failed(&env).unwrap();
    config("7s");
    beat.signal(libc::SIGHUP);
    for job in ["b", "c"] {
        let want = format!("{} 0", key(job, &t));
        assert!(
            wait_until(WAIT, || env.lines("runs").contains(&want)),
            "{want} never ran: {:?}\n{}",
            env.lines("runs"),
            beat.log_tail(30)
        );
    }
    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(20)).success());
}

/// A beat that takes over with a config rescheduling the root (the last leader died, the file
/// changed) still runs the followers of the old rule's instants that succeeded before it led:
/// the chain in flight is carried over, as a reload on the leader carries it.
#[tokio::test(flavor = "multi_thread")]
async fn a_takeover_that_reschedules_the_root_keeps_the_chains_in_flight() {
    let env = setup("e2e_after_gain");
    let chain = |every_s: &str| {
        base()
            .set("beat", "leader_lease", "\"1s\"")
            .task("a", stamped(&env, 0.0, ""))
            .task("b", stamped(&env, 0.0, ""))
            .job("a", every(every_s).with("overlap", "\"allow\""))
            .job("b", after("a", "1h"))
    };
    let cfg = env.write_config("drumline.toml", &chain("1s"));
    let path = cfg.to_str().unwrap();
    // No worker yet: the leader publishes `a`'s instants and no follower can be decided.
    let mut beat = env.beat("beat", &["--config", path]);
    let queue = env.names().work_queue("default");
    let waiting = || async { env.queue_len(&queue).await.unwrap_or(0) >= 3 };
    let published = wait_until_async(WAIT, waiting).await;
    assert!(published, "{}", beat.log_tail(30));
    beat.kill9();
    let killed_at = chrono::Utc::now();
    // The old instants run and succeed with no leader to see them.
    let mut worker = env.worker("worker", &["--config", path]);
    let ran = wait_until(WAIT, || keys_of(&spans(&env), "a").len() >= 3);
    assert!(ran, "{}", worker.log_tail(30));
    // The next leader's file reschedules the root.
    env.write_config("drumline.toml", &chain("7s"));
    let mut beat = env.beat("beat2", &["--config", path]);
    let old: Vec<String> = keys_of(&spans(&env), "a")
        .into_iter()
        .filter(|k| instant_of(k) < killed_at)
        .collect();
    let followed = wait_until(WAIT, || {
        let s = spans(&env);
        old.iter().all(|a| s.contains_key(&key("b", a)))
    });
    assert!(
        followed,
        "old instants {old:?}, ran {:?}\n{}",
        spans(&env).keys().collect::<Vec<_>>(),
        beat.log_tail(30)
    );
    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(20)).success());
}
