//! Reload on SIGHUP (docs/design.md "Reload"), end to end with the real binaries: a changed config
//! takes effect without a restart — added jobs start from the reload, removed ones stop, a
//! rescheduled one follows its new rule without catching up — and a broken file is refused
//! while the running schedule goes on. A standby that reloaded applies the same rules when it
//! comes to lead.

use chrono::{DateTime, TimeDelta, Utc};
use drumline_e2e::cfg::{cron, every, shell, Cfg, Keys};
use drumline_e2e::probe::{assert_spaced, expect, expect_async, stop, tails};
use drumline_e2e::{
    adhoc, counts, http_get, instant_of, setup, wait_until, Proc, TestEnv, REDIS_URL,
};
use drumline_shared::envelope::format_instant;
use drumline_shared::jitter::offset;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// The config with `jobs` (name, rule) all running the append task.
fn write_config(env: &TestEnv, jobs: Vec<(&str, Keys)>) -> String {
    let jobs = jobs
        .into_iter()
        .map(|(name, rule)| (name, rule.text("overlap", "allow")));
    let cfg = Cfg::new()
        .worker_slots(4, "3s")
        .jobs_of("append", jobs.collect());
    env.config_file(&cfg.task("append", env.appender("effects", 0.0)))
}

/// The instants run for `job`, each asserted run once.
fn runs_of(env: &TestEnv, job: &str) -> Vec<DateTime<Utc>> {
    env.runs_of("effects", job)
}

fn hup(proc: &Proc) {
    proc.signal(libc::SIGHUP);
}

#[tokio::test(flavor = "multi_thread")]
async fn sighup_adds_reschedules_and_removes_jobs_and_refuses_a_broken_file() {
    let env = setup("reload_beat");
    let jobs = ["keep", "change", "gone"].map(|j| (j, every("1s")));
    let config = write_config(&env, jobs.to_vec());
    let mut scene = env.scene(&config, &["beat"], &["worker"]);
    scene.expect(WAIT, "three runs of each job", || {
        ["keep", "change", "gone"]
            .iter()
            .all(|j| runs_of(&env, j).len() >= 3)
    });

    // A valid change: `change` every 2 s, `gone` removed, `added` new. The worker gets the
    // same file (it learns the new job too).
    let jobs = vec![
        ("added", every("1s")),
        ("change", every("2s")),
        ("keep", every("1s")),
    ];
    write_config(&env, jobs);
    scene.procs().into_iter().for_each(hup);
    let reloaded_at = Utc::now();
    let settled = reloaded_at + TimeDelta::seconds(2);
    scene.expect(WAIT, "added and the rescheduled change ran", || {
        let change = runs_of(&env, "change");
        runs_of(&env, "added").len() >= 4 && change.iter().filter(|t| **t > settled).count() >= 3
    });

    // A broken file: refused, and the schedule just loaded keeps running.
    std::fs::write(
        &config,
        "[[jobs]]\nname = \"broken\"\nevery = \"sometimes\"\n",
    )
    .unwrap();
    hup(&scene.beats[0]);
    let later = Utc::now() + TimeDelta::seconds(3);
    scene.expect(WAIT, "added ran past the broken file", || {
        runs_of(&env, "added").last().is_some_and(|t| *t >= later)
    });
    assert!(
        scene.beats[0].is_running(),
        "a broken file must not stop the beat"
    );
    scene.stop();
    // The refusal is the beat's output to its operator: one error naming the file and the job.
    let refused =
        |l: &str| l.contains("reload refused") && l.contains("drumline.toml: job \"broken\"");
    let log = scene.beats[0].log();
    assert!(log.lines().any(refused), "{}", scene.beats[0].log_tail(10));

    // `keep` ran every second straight through both reloads.
    let keep = runs_of(&env, "keep");
    assert_spaced(&keep, 1, "keep");
    assert!(*keep.last().unwrap() >= later);
    // `gone` stopped within a second of the reload.
    let gone = runs_of(&env, "gone");
    let last = *gone.last().unwrap();
    assert!(
        last <= reloaded_at + TimeDelta::seconds(1),
        "gone ran at {last} after the reload at {reloaded_at}"
    );
    // `added` started at the reload: nothing before it was caught up, then every second.
    let added = runs_of(&env, "added");
    let first = added[0];
    assert!(
        first >= reloaded_at - TimeDelta::seconds(1),
        "added caught up {first} before the reload at {reloaded_at}"
    );
    assert_spaced(&added, 1, "added");
    // `change` follows its new rule after the reload, without catching anything up.
    let change = runs_of(&env, "change").into_iter();
    let change_after: Vec<_> = change
        .filter(|t| *t > reloaded_at + TimeDelta::seconds(1))
        .collect();
    assert_spaced(&change_after, 2, "change after the reload");
}

/// A worker config whose task `t` appends `VERSION KEY` after `sleep` seconds.
fn versioned_worker_config(env: &TestEnv, version: &str, sleep: f64) -> String {
    let effects = env.path("effects");
    let script = format!(
        "sleep {sleep}; echo \"{version} $DRUMLINE_KEY\" >> {}",
        effects.display()
    );
    let cfg = Cfg::new().worker_slots(4, "5s").task("t", shell(&script));
    env.config_named("worker.toml", &cfg)
}

#[tokio::test(flavor = "multi_thread")]
async fn sighup_gives_the_worker_new_tasks_for_the_deliveries_that_follow() {
    let env = setup("reload_worker");
    let config = versioned_worker_config(&env, "v1", 2.0);
    let mut worker = env.worker_ready("worker", &config).await;
    // In flight across the reload: started under v1, it finishes under v1.
    env.publish(&adhoc("before", "t")).await;
    env.expect_state("before", "running", &[&worker]).await;
    versioned_worker_config(&env, "v2", 0.0);
    hup(&worker);
    // A delivery after the reload runs the new command (the reload lands within moments: poll
    // with fresh keys until one runs v2).
    let mut n = 0;
    let ran = |line: String| wait_until(WAIT, || env.lines("effects").contains(&line));
    expect_async(WAIT, &[&worker], "a delivery ran v2", || {
        n += 1;
        let (key, env) = (format!("after-{n}"), &env);
        async move {
            env.publish(&adhoc(&key, "t")).await;
            let any = || {
                env.lines("effects")
                    .iter()
                    .any(|l| l.ends_with(&format!(" {key}")))
            };
            wait_until(Duration::from_secs(5), any);
            env.lines("effects").contains(&format!("v2 {key}"))
        }
    })
    .await;
    assert!(ran("v1 before".to_owned()));

    // A broken file is refused: the worker keeps serving v2.
    std::fs::write(&config, "[tasks.t]\ncommand = 7\n").unwrap();
    hup(&worker);
    env.publish(&adhoc("after-broken", "t")).await;
    assert!(ran("v2 after-broken".to_owned()), "{}", tails(&[&worker]));
    stop(&mut [&mut worker]);
    let refused = worker.log().lines().any(|l| l.contains("reload refused"));
    assert!(refused, "{}", worker.log_tail(10));
    let runs = counts(&env.lines("effects"));
    assert!(runs.values().all(|n| *n == 1), "{runs:?}");
}

/// A config file `file` for two beats: a 3 s leader lease, `jobs` (name, rule) all `catch_up`
/// and running the append task.
fn standby_config(env: &TestEnv, file: &str, jobs: [(&str, &str); 2]) -> String {
    let rules = [("misfire", "catch_up"), ("overlap", "allow")];
    let jobs = jobs.map(|(name, rule)| (name, every(rule).texts(&rules)));
    let cfg = Cfg::new()
        .set("beat", "leader_lease", "\"3s\"")
        .worker_slots(4, "3s");
    let cfg = cfg.jobs_of("append", jobs.to_vec());
    env.config_named(file, &cfg.task("append", env.appender("effects", 0.0)))
}

/// The leader lease `{ns}:beat:leader`: (pid, epoch, since).
fn leader(env: &TestEnv) -> Option<(u32, u64, DateTime<Utc>)> {
    let mut redis = redis::Client::open(REDIS_URL)
        .and_then(|c| c.get_connection())
        .expect("redis");
    let text: Option<String> = redis::cmd("GET")
        .arg(env.names().beat_leader())
        .query(&mut redis)
        .expect("redis GET");
    let lease: serde_json::Value = serde_json::from_str(&text?).ok()?;
    let since = DateTime::parse_from_rfc3339(lease["since"].as_str()?).ok()?;
    Some((
        lease["pid"].as_u64()? as u32,
        lease["epoch"].as_u64()?,
        since.with_timezone(&Utc),
    ))
}

/// The schedule `job` has in the `/api/status` a beat serves on `port` (its running config).
fn schedule_on(port: u16, job: &str) -> Option<String> {
    let (200, body) = http_get(port, "/api/status")? else {
        return None;
    };
    let status: serde_json::Value = serde_json::from_str(&body).ok()?;
    status["jobs"]
        .as_array()?
        .iter()
        .find(|j| j["job"] == job)
        .and_then(|j| j["schedule"].as_str().map(str::to_owned))
}

/// A standby applies the reload rules when it comes to lead (docs/design.md#reload-on-a-standby):
/// with both beats reloaded, the leader's restart of a rescheduled job is what the standby
/// resumes (the failover gap caught up); with only the standby reloaded, the job it
/// rescheduled starts from its term, not from the progress the old leader recorded under the
/// old schedule. See: issues/16
#[tokio::test(flavor = "multi_thread")]
async fn a_standby_that_reloaded_applies_the_reload_rules_when_it_leads() {
    let env = setup("reload_standby");
    // v1 on both: `both` every 2 s, `only_b` every hour (never due while the test runs).
    let v1 = [("both", "2s"), ("only_b", "1h")];
    let a_cfg = standby_config(&env, "a.toml", v1);
    let b_cfg = standby_config(&env, "b.toml", v1);
    let mut worker = env.worker_on("worker", &b_cfg);
    let mut a = env.beat_on("beat-a", &a_cfg);
    let a_pid = a.pid() as u32;
    expect(WAIT, &[&a], "beat-a leads", || {
        leader(&env).is_some_and(|l| l.0 == a_pid)
    });
    let (mut b, b_port) = env.beat_serving("beat-b", &b_cfg);
    expect(WAIT, &[&a], "both ran twice", || {
        runs_of(&env, "both").len() >= 2
    });

    // v2 on both, both reloaded: `both` every second. The leader restarts it from the reload.
    let v2 = [("both", "1s"), ("only_b", "1h")];
    standby_config(&env, "a.toml", v2);
    standby_config(&env, "b.toml", v2);
    hup(&a);
    hup(&b);
    let reloaded_at = Utc::now();
    let after_reload = |env: &TestEnv| -> Vec<DateTime<Utc>> {
        let both = runs_of(env, "both").into_iter();
        both.filter(|t| *t > reloaded_at + TimeDelta::seconds(1))
            .collect()
    };
    expect(WAIT, &[&a], "both rescheduled", || {
        after_reload(&env).len() >= 3
    });

    // v3 on the standby only: `only_b` every second. The leader never hears of it.
    standby_config(&env, "b.toml", [("both", "1s"), ("only_b", "1s")]);
    hup(&b);
    let reloaded = wait_until(WAIT, || {
        schedule_on(b_port, "only_b").as_deref() == Some("every 1s")
    });
    assert!(
        reloaded,
        "the standby did not reload: {:?} {:?}\n{}",
        schedule_on(b_port, "only_b"),
        http_get(b_port, "/api/status"),
        b.log_tail(20)
    );
    a.kill9();
    let mut lease = None;
    let b_pid = b.pid() as u32;
    expect(WAIT, &[&b], "the standby did not take over", || {
        lease = leader(&env).filter(|l| l.0 == b_pid);
        lease.is_some()
    });
    let (_, _, since) = lease.expect("just checked");
    expect(WAIT, &[&b], "only_b ran and both resumed", || {
        let resumed = after_reload(&env)
            .last()
            .is_some_and(|t| *t > since + TimeDelta::seconds(2));
        runs_of(&env, "only_b").len() >= 3 && resumed
    });
    stop(&mut [&mut b, &mut worker]);

    // Rescheduled on the standby alone: it starts from the standby's term, as a reload starts
    // a rescheduled job; nothing before is caught up from the progress the old leader recorded
    // under the old rule.
    let only_b = runs_of(&env, "only_b");
    assert!(
        only_b[0] > since,
        "only_b was caught up from before the standby led at {since}: {only_b:?}"
    );
    assert_spaced(&only_b, 1, "only_b");
    // Rescheduled on both: the leader's restart is kept, and the standby caught up the
    // failover's gap from it (every second, straight through the kill).
    let both = after_reload(&env);
    assert!(*both.first().unwrap() < since && *both.last().unwrap() > since);
    assert_spaced(&both, 1, "both after the reload, across the failover");
}

/// A name for a job of `env`'s namespace whose offset under `jitter` is at least `least`
/// (the offset is a hash of the namespace and the name: docs/design.md#jitter), and its offset.
fn name_with_offset(env: &TestEnv, prefix: &str, jitter: u64, least: u64) -> (String, TimeDelta) {
    let ns = env.names();
    let offset_of = |name: &str| offset(ns.namespace(), name, Duration::from_secs(jitter));
    let name = (0..1000)
        .map(|i| format!("{prefix}{i}"))
        .find(|name| offset_of(name) >= Duration::from_secs(least))
        .expect("some name gets a large offset");
    let offset = TimeDelta::from_std(offset_of(&name)).expect("small");
    (name, offset)
}

/// `slow` (every 20 s from `anchor`, `misfire = "skip"`) and `tick` (a per-second cron, the
/// default `run_once`) with jitters `jitters`, under a 1 s misfire threshold, writing their keys.
fn jittered_config(env: &TestEnv, names: [&str; 2], jitters: [&str; 2], anchor: &str) -> String {
    let slow = every("20s").texts(&[("anchor", anchor), ("misfire", "skip")]);
    let tick = cron("* * * * * *").text("overlap", "allow");
    let jittered = [slow, tick]
        .into_iter()
        .zip(jitters)
        .map(|(k, j)| k.text("jitter", j));
    let cfg = Cfg::new()
        .set("beat", "misfire_threshold", "\"1s\"")
        .set("worker", "lease", "\"3s\"")
        .task("append", env.appender("effects", 0.0));
    env.config_file(&cfg.jobs_of("append", names.into_iter().zip(jittered).collect()))
}

/// `t` without its fraction of a second.
fn whole_second(t: DateTime<Utc>) -> DateTime<Utc> {
    t - TimeDelta::nanoseconds(t.timestamp_subsec_nanos().into())
}

/// When `beat` started leading (the lease's `since`).
fn leading_since(env: &TestEnv, beat: &Proc) -> DateTime<Utc> {
    let mut since = None;
    expect(WAIT, &[beat], "a leader", || {
        since = leader(env).map(|l| l.2);
        since.is_some()
    });
    since.expect("just checked")
}

/// `drumline audit JOB --from FROM --json`: (key, class) of each instant up to `to`, once
/// every one of them is decided (none `pending`) and the last is `to`.
fn decided(env: &TestEnv, cfg: &str, job: &str, (from, to): Window) -> Option<Vec<Row>> {
    let from = format_instant(from);
    let args = ["--config", cfg, "audit", job, "--from", &from, "--json"];
    let (status, out, err) = env.run("drumline", &args);
    assert!(status.success(), "audit {job}: {err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("audit --json");
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
    let rows: Vec<Row> = doc["instants"]
        .as_array()
        .expect("instants")
        .iter()
        .map(|row| (text(&row["key"]), text(&row["class"])))
        .filter(|(key, _)| instant_of(key) <= to)
        .collect();
    let all = rows.iter().all(|(_, class)| class != "pending");
    let last = rows.last().is_some_and(|(key, _)| instant_of(key) == to);
    (all && last).then_some(rows)
}

/// An audit row: (key, class).
type Row = (String, String);
/// From, to.
type Window = (DateTime<Utc>, DateTime<Utc>);

/// Lowering a job's jitter by a reload never drops an instant that was not yet due under the
/// old offset (docs/design.md#jitter): `slow`'s instant T, due at T + 12 s or later under
/// `jitter = "19s"`, is 2.5 s past T (more than the 1 s misfire threshold past its new jittered
/// time) when `jitter = "1s"` comes, and runs once; so does every instant of the per-second
/// `tick` that its 29 s jitter still held back. See: issues/33
#[test]
fn lowering_jitter_by_a_reload_publishes_the_pending_instants_and_drops_none() {
    let env = setup("reload_jitter");
    let (slow, slow_offset) = name_with_offset(&env, "slow", 19, 12);
    let (tick, tick_offset) = name_with_offset(&env, "tick", 29, 15);
    let names = [slow.as_str(), tick.as_str()];
    let anchor_at = whole_second(Utc::now()) + TimeDelta::seconds(4);
    let anchor = format_instant(anchor_at);
    let cfg = jittered_config(&env, names, ["19s", "29s"], &anchor);
    let mut scene = env.scene(&cfg, &["beat"], &["worker"]);
    let since = leading_since(&env, &scene.beats[0]);
    // `slow`'s first instant a second or more into the term, and `tick`'s.
    let mut t = anchor_at - TimeDelta::seconds(20);
    while t <= since + TimeDelta::seconds(1) {
        t += TimeDelta::seconds(20);
    }
    let first_tick = whole_second(since) + TimeDelta::seconds(2);
    assert!(wait_until(WAIT, || Utc::now() >= t + TimeDelta::milliseconds(2500)));

    // Not yet due under the old offsets: nothing of either job ran.
    let held_until = (t + slow_offset).min(first_tick + tick_offset);
    let late = Utc::now() - held_until + TimeDelta::seconds(2);
    assert!(
        late < TimeDelta::zero(),
        "too slow to reload before {held_until}"
    );
    assert_eq!(env.lines("effects"), Vec::<String>::new());
    jittered_config(&env, names, ["1s", "1s"], &anchor);
    hup(&scene.beats[0]);
    let settled = whole_second(Utc::now()) + TimeDelta::seconds(3);

    // Decided: `slow`'s T, and every instant of `tick` up to 3 s after the reload.
    let mut rows = (Vec::new(), Vec::new());
    scene.expect(WAIT, "every instant decided", || {
        let slow_rows = decided(&env, &cfg, &slow, (since, t));
        let tick_rows = decided(&env, &cfg, &tick, (since, settled));
        slow_rows.zip(tick_rows).map(|both| rows = both).is_some()
    });
    scene.stop();

    // Audit: T ran, and so did every instant of `tick` (none skipped as missed).
    let key = format!("{slow}@{}", format_instant(t));
    let slow_t = rows.0.iter().find(|(k, _)| *k == key);
    assert_eq!(slow_t.map(|(_, c)| c.as_str()), Some("ran"), "{:?}", rows.0);
    let ticks = rows.1.iter().filter(|(k, _)| instant_of(k) >= first_tick);
    let not_run: Vec<_> = ticks.filter(|(_, c)| c != "ran").collect();
    assert!(not_run.is_empty(), "not run: {not_run:?}");
    // The effects: T once, and `tick` once a second without a gap.
    assert_eq!(runs_of(&env, &slow), vec![t]);
    let ticks: Vec<_> = runs_of(&env, &tick)
        .into_iter()
        .filter(|i| *i >= first_tick)
        .collect();
    assert_eq!(ticks.first(), Some(&first_tick), "{ticks:?}");
    assert!(ticks.last().is_some_and(|l| *l >= settled), "{ticks:?}");
    assert_spaced(&ticks, 1, "tick across the reload");
}

/// Issue 33: a reload that reschedules a job is journaled (`start`), so `verify` does not plan
/// the time before the reload with the new rule: it reported every instant of the new rule
/// before the reload `missed`.
#[tokio::test(flavor = "multi_thread")]
async fn verify_holds_across_a_reload_that_reschedules_a_job() {
    let env = setup("e2e_reload_verify");
    let config = write_config(&env, vec![("tick", every("3s"))]);
    let mut worker = env.worker_ready("worker", &config).await;
    let mut beat = env.beat_on("beat", &config);
    expect(WAIT, &[&beat], "three ticks", || {
        runs_of(&env, "tick").len() >= 3
    });
    write_config(&env, vec![("tick", every("2s"))]);
    hup(&beat);
    let before = runs_of(&env, "tick").len();
    expect(WAIT, &[&beat], "three more ticks", || {
        runs_of(&env, "tick").len() >= before + 3
    });
    let verify = ["--config", &config, "verify", "--since", "10m", "--json"];
    let (status, out, err) = env.run("drumline", &verify);
    assert!(status.success(), "{out}{err}");
    stop(&mut [&mut beat, &mut worker]);
}
