//! Operating a running schedule (docs/design.md "Operations at run time"), end to end with the real
//! beat, worker, RabbitMQ and Redis: `pause`/`resume`, `trigger`, `backfill`, and the bad input
//! each refuses (exit 2, nothing published or changed). Effects are lines the tasks append.

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use drumline_e2e::cfg::{cron, every, shell, Cfg, Keys};
use drumline_e2e::probe::{argv, assert_spaced, expect, stop};
use drumline_e2e::{binary, counts, instant_of, setup, wait_until, TestEnv};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_job_runs_nothing_meanwhile_and_resume_publishes_none_of_it() {
    let env = setup("ops_pause");
    let jobs = vec![("a", every("1s")), ("b", every("1s"))];
    let cfg = Cfg::new().worker_slots(4, "3s").jobs_of("append", jobs);
    let config = env.config_file(&cfg.task("append", env.appender("effects", 0.0)));
    let mut worker = env.worker_on("worker", &config);
    let (mut beat, metrics) = env.beat_serving("beat", &config);
    let runs = |job: &str| env.runs_of("effects", job);
    expect(WAIT, &[&beat], "a ran twice", || runs("a").len() >= 2);

    env.beat_ok(&config, &["pause", "a"]);
    let paused_at = Utc::now();
    // Five seconds of `b` running (its own effects, not a sleep) while `a` is paused.
    let b_before = runs("b").len();
    let b_ran_on = || runs("b").len() >= b_before + 5;
    expect(WAIT, &[&beat], "b ran on", b_ran_on);
    env.beat_ok(&config, &["resume", "a"]);
    let resumed_at = Utc::now();
    // Resumed: `a`'s next instants run again.
    let after_resume = resumed_at + TimeDelta::seconds(3);
    expect(WAIT, &[&beat], "a resumed", || {
        runs("a").last().is_some_and(|t| *t >= after_resume)
    });
    let paused_series = r#"drumline_beat_dropped_total{job="a",reason="paused"}"#;
    let dropped = env.metric(metrics, paused_series).unwrap_or(0.0);
    stop(&mut [&mut beat, &mut worker]);

    // Honoured within a second of the command, both ways.
    let a = runs("a");
    let paused = |t: &&DateTime<Utc>| **t > paused_at + TimeDelta::seconds(1) && **t < resumed_at;
    let during: Vec<_> = a.iter().filter(paused).collect();
    assert!(during.is_empty(), "ran while paused: {during:?}");
    let (before, after): (Vec<_>, Vec<_>) = a.iter().partition(|t| **t <= paused_at);
    let resumed = |t: &DateTime<Utc>| *t >= resumed_at + TimeDelta::seconds(1);
    let after: Vec<_> = after.into_iter().filter(|t| resumed(t)).collect();
    assert_spaced(&before, 1, "a before the pause");
    assert_spaced(&after, 1, "a after the resume");
    let gap = (after[0] - *before.last().expect("a ran before the pause")).num_seconds();
    assert!(gap >= 5, "the paused window was caught up: gap {gap} s");
    assert!(
        dropped >= 4.0,
        "paused instants counted as dropped: {dropped}"
    );
    // The other job never noticed.
    assert_spaced(&runs("b"), 1, "b");
    let paused = env.smembers(&env.names().paused()).await;
    assert!(paused.is_empty(), "{paused:?}");
}

/// Two jobs never due during the test (hourly, anchored away from now): one `skip`s overlaps and
/// takes 3 s, one allows them and records its args.
fn trigger_config(env: &TestEnv) -> String {
    let anchor = (Utc::now() + TimeDelta::minutes(30))
        .duration_trunc(TimeDelta::seconds(1))
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let hourly = |overlap: &str| every("1h").texts(&[("anchor", &anchor), ("overlap", overlap)]);
    let with_args = "echo \"$DRUMLINE_KEY $(cat)\" >> {effects}";
    let cfg = Cfg::new()
        .worker_slots(4, "5s")
        .job("slow", hourly("skip").task("slow"))
        .job(
            "free",
            hourly("allow").task("args").with("args", "{ n = 7 }"),
        )
        .task("slow", env.appender("effects", 3.0))
        .task("args", env.script(with_args));
    env.config_file(&cfg)
}

/// `triggered JOB key=KEY …` → KEY.
fn triggered_key(out: &str) -> String {
    out.split_whitespace()
        .find_map(|w| w.strip_prefix("key="))
        .unwrap_or_else(|| panic!("no key in {out:?}"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn trigger_runs_one_instance_now_as_the_job() {
    let env = setup("ops_trigger");
    let config = trigger_config(&env);
    let mut worker = env.worker_ready("worker", &config).await;
    let trigger = |args: &[&str]| triggered(&env, &config, args);

    // overlap = skip: a trigger while the previous instance still runs is recorded `skipped`.
    let first = trigger(&["trigger", "slow"]);
    assert!(first.starts_with("slow@"), "{first}");
    env.expect_state(&first, "running", &[&worker]).await;
    let second = trigger(&["trigger", "slow"]);
    env.expect_state(&second, "skipped", &[&worker]).await;

    // overlap = allow: runs with the job's args, or with --args instead; status sees it.
    let own = trigger(&["trigger", "free"]);
    let replaced = trigger(&["trigger", "free", "--args", r#"{"n": 8}"#]);
    env.expect_lines("effects", 3, &[&worker]);
    let out = || env.beat_ok(&config, &["status", "free", "--json"]);
    let status = || serde_json::from_str::<serde_json::Value>(&out()).unwrap();
    let succeeded = wait_until(WAIT, || status()["jobs"][0]["last_success"].is_string());
    assert!(succeeded, "{}", status());
    stop(&mut [&mut worker]);

    let (n7, n8) = (
        format!("{own} {{\"n\":7}}"),
        format!("{replaced} {{\"n\":8}}"),
    );
    let (ran, want) = (counts(&env.lines("effects")), counts(&[n7, n8, first]));
    assert_eq!(ran, want, "each trigger ran once (the skipped one never)");
}

/// `drumline-beat --config CONFIG ARGS…` asserted to exit 0: the key it `triggered`.
fn triggered(env: &TestEnv, config: &str, args: &[&str]) -> String {
    triggered_key(&env.beat_ok(config, args))
}

#[tokio::test(flavor = "multi_thread")]
async fn backfill_twice_runs_each_instant_once_oldest_first() {
    let env = setup("ops_backfill");
    let daily = cron("0 3 * * *").text("expires", "1h").task("append");
    let cfg = Cfg::new().worker_slots(1, "5s").job("daily", daily);
    let config = env.config_file(&cfg.task("append", env.appender("effects", 0.0)));
    let range = backfill("daily", "2026-01-01T00:00:00Z", "2026-01-11T00:00:00Z");

    // A dry run lists the ten instants and publishes nothing.
    let out = env.beat_ok(&config, &[&range[..], &["--dry-run"]].concat());
    let listed: Vec<&str> = out.lines().filter(|l| l.starts_with("daily@")).collect();
    assert_eq!(listed.len(), 10, "{out}");
    assert_eq!(listed[0], "daily@2026-01-01T03:00:00Z");

    let mut worker = env.worker_ready("worker", &config).await;
    env.beat_ok(&config, &range);
    env.beat_ok(&config, &range);
    env.expect_lines("effects", 10, &[&worker]);
    // The second backfill's ten copies are duplicates: wait until they are all settled.
    env.expect_drained(&[&worker]).await;
    stop(&mut [&mut worker]);
    let want: Vec<String> = (1..=10)
        .map(|d| format!("daily@2026-01-{d:02}T03:00:00Z"))
        .collect();
    assert_eq!(
        env.lines("effects"),
        want,
        "ten runs, oldest first, none twice"
    );
}

/// `backfill JOB --from FROM --to TO`.
fn backfill<'a>(job: &'a str, from: &'a str, to: &'a str) -> [&'a str; 6] {
    ["backfill", job, "--from", from, "--to", to]
}

/// A worker with `concurrency` slots and a `slow` job every minute on `task`.
fn backfill_cfg(concurrency: u32, lease: &str, overlap: &str, task: Keys) -> Cfg {
    let slow = every("1m").text("overlap", overlap).task("slow");
    Cfg::new()
        .worker_slots(concurrency, lease)
        .job("slow", slow)
        .task("slow", task)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backfilled_skip_job_queues_its_instants_instead_of_skipping_them() {
    let env = setup("ops_backfill_skip");
    let cfg = backfill_cfg(2, "2s", "skip", env.appender("effects", 1.0));
    let config = env.config_file(&cfg);
    let mut worker = env.worker_ready("worker", &config).await;
    let range = backfill("slow", "2026-01-01T00:00:00Z", "2026-01-01T00:02:00Z");
    env.beat_ok(&config, &range);
    // Both delivered at once to two slots: the second waits for the first instead of being
    // recorded `skipped`.
    env.expect_lines("effects", 2, &[&worker]);
    stop(&mut [&mut worker]);
    let mut lines = env.lines("effects");
    lines.sort();
    assert_eq!(
        lines,
        ["slow@2026-01-01T00:00:00Z", "slow@2026-01-01T00:01:00Z"]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_operations_exit_2_and_change_nothing() {
    let env = setup("ops_bad");
    let cfg = Cfg::new().job("tick", every("1m").task("t"));
    let config = env.config_file(&cfg.task("t", argv(&["/bin/true"])));
    let future = (Utc::now() + TimeDelta::hours(1)).to_rfc3339();
    let (jan1, jan2) = ("2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z");
    let nope = "no job named \"nope\"";
    let oops = ["trigger", "tick", "--args", "{oops"];
    let yesterday = backfill("tick", "yesterday", jan1);
    let cases: [(&[&str], &str); 8] = [
        (&["pause", "nope"], nope),
        (&["resume", "tick", "nope"], nope),
        (&["trigger", "nope"], nope),
        (&oops, "--args is not JSON"),
        (&backfill("tick", jan2, jan1), "must be before --to"),
        (&backfill("tick", jan1, jan2), "more than 1000 instants"),
        (&backfill("tick", jan1, &future), "in the future"),
        (&yesterday, "not an RFC 3339 instant"),
    ];
    for (args, message) in cases {
        let (code, out, err) = env.beat_cmd(&config, args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains(message), "{args:?}: {err}");
        let lines = err.trim().lines().count();
        assert_eq!(lines, 1, "{args:?}: one clear line: {err}");
        assert!(out.is_empty(), "{args:?}: {out}");
    }
    // Nothing was declared, published or paused.
    assert_eq!(env.default_queue_len().await, None);
    let keys = env.ns_keys().await;
    assert!(keys.is_empty(), "{keys:?}");
}

/// See: issues/16 "Backfill crawls". Twenty instants of a short `skip` job (a backfill queues
/// them) on two workers: each waiting copy starts within a second of the previous instance's
/// end (it is woken, not left to its delay queue), and `backfill --wait` prints `N/M done`
/// until `20/20 done`, then exits 0.
#[tokio::test(flavor = "multi_thread")]
async fn backfill_wait_follows_every_instant_and_waiting_copies_are_woken() {
    let env = setup("ops_backfill_wait");
    let stamps = env.path("stamps");
    let script = format!(
        "echo \"start $DRUMLINE_KEY $(date +%s%3N)\" >> {s}; sleep 0.005; \
         echo \"end $DRUMLINE_KEY $(date +%s%3N)\" >> {s}",
        s = stamps.display()
    );
    let short = every("1m").task("short");
    let cfg = Cfg::new()
        .set("worker", "concurrency", "2")
        .job("short", short);
    let config = env.config_file(&cfg.task("short", shell(&script)));
    let workers = [env.worker_on("w1", &config), env.worker_on("w2", &config)];
    env.wait_for_topology(&workers[0]).await;
    let range = backfill("short", "2026-01-01T00:00:00Z", "2026-01-01T00:20:00Z");
    let args = [&["--config", &config], &range[..], &["--wait"]].concat();
    let mut backfill = env.beat("backfill", &args);
    // Without waking, the waiting copies come back a lease (30 s) later each.
    let status = backfill.wait(Duration::from_secs(60));
    let out = backfill.log();
    assert!(status.success(), "{out}");
    let progress: Vec<&str> = out.lines().filter(|l| l.ends_with(" done")).collect();
    assert_eq!(progress.last(), Some(&"20/20 done"), "{out}");
    assert!(
        progress.len() >= 2,
        "progress as the instants finish: {progress:?}"
    );

    // One run each, and each start within a second of the end before it.
    let mut starts = Vec::new();
    let mut ends = Vec::new();
    for line in env.lines("stamps") {
        let mut parts = line.split(' ');
        let (what, key, ms) = (parts.next(), parts.next(), parts.next());
        let ms: u64 = ms.and_then(|m| m.parse().ok()).expect("a stamp");
        match what {
            Some("start") => starts.push((ms, key.unwrap().to_owned())),
            _ => ends.push(ms),
        }
    }
    let keys: std::collections::BTreeSet<&String> = starts.iter().map(|(_, k)| k).collect();
    assert_eq!((starts.len(), keys.len()), (20, 20), "{starts:?}");
    starts.sort();
    ends.sort();
    for (i, (start, key)) in starts.iter().enumerate().skip(1) {
        let previous_end = ends[i - 1];
        assert!(
            *start < previous_end + 1000,
            "{key} started {} ms after the previous instance ended",
            start - previous_end
        );
    }
}

/// `drumline-beat --config CFG ARGS…` killed if it has not exited within `limit`: (exit code,
/// stdout, stderr), or `None` when it had to be killed.
fn beat_cmd_within(cfg: &str, args: &[&str], limit: Duration) -> Option<(i32, String, String)> {
    use std::io::Read;
    let mut child = std::process::Command::new(binary("drumline-beat"))
        .arg("--config")
        .arg(cfg)
        .args(args)
        .env_remove("DRUMLINE_CONFIG")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("drumline-beat");
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (mut out, mut err) = (String::new(), String::new());
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    Some((status.code().unwrap_or(-1), out, err))
}

/// `trigger` returns for every valid job (docs/design.md "Bounded work for every request"). It
/// used to look for a millisecond that is not one of the job's instants, which never ends for
/// `every = "1ms"`; such a job is now refused (exit 2, naming the key) and the fastest valid
/// job, `every = "100ms"`, is triggered on a millisecond of its own and runs once.
// See: issues/16
#[tokio::test(flavor = "multi_thread")]
async fn trigger_returns_for_the_fastest_job_and_refuses_a_faster_one() {
    let env = setup("ops_trigger_fast");
    // Not a limit on speed: a trigger still running after this long is hung.
    let hung = Duration::from_secs(15);
    let job = |rule: &str| {
        let cfg = Cfg::new().job("fast", every(rule).task("append"));
        cfg.task("append", env.appender("effects", 0.0))
    };
    let trigger = |config: &str| {
        let answer = beat_cmd_within(config, &["trigger", "fast"], hung);
        answer.unwrap_or_else(|| panic!("trigger on {config} hung for {hung:?}"))
    };
    let (code, out, err) = trigger(&env.config_named("1ms.toml", &job("1ms")));
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("key `every`"), "{err}");

    let config = env.config_file(&job("100ms"));
    let mut worker = env.worker_ready("worker", &config).await;
    let mut keys = Vec::new();
    for _ in 0..5 {
        let (code, out, err) = trigger(&config);
        assert_eq!(code, 0, "{out}{err}");
        let key = triggered_key(&out);
        // Never one of the job's instants (multiples of 100 ms): those keys are the beat's.
        let ms = instant_of(&key).timestamp_subsec_millis();
        assert_ne!(ms % 100, 0, "{key} is a scheduled instant's key");
        keys.push(key);
    }
    let all = || env.lines("effects").len() >= keys.len();
    expect(WAIT, &[&worker], "every trigger ran", all);
    stop(&mut [&mut worker]);
    let ran = counts(&env.lines("effects"));
    assert_eq!(ran, counts(&keys), "each trigger ran once");
}
