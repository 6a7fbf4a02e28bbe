//! Operating a running schedule (docs/design.md "Operations at run time"), end to end with the real
//! beat, worker, RabbitMQ and Redis: `pause`/`resume`, `trigger`, `backfill`, and the bad input
//! each refuses (exit 2, nothing published or changed). Effects are lines the tasks append.

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use drumline_e2e::{
    binary, counts, setup, toml_string, wait_until, wait_until_async, with_metrics, TestEnv,
};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// `drumline-beat --config CFG ARGS…`: (exit code, stdout, stderr).
fn beat_cmd(env: &TestEnv, cfg: &str, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["--config", cfg];
    all.extend_from_slice(args);
    let (status, out, err) = env.run("drumline-beat", &all);
    (status.code().unwrap_or(-1), out, err)
}

fn instant_of(key: &str) -> DateTime<Utc> {
    let text = key.split_once('@').expect("job@instant").1;
    DateTime::parse_from_rfc3339(text)
        .expect("rfc3339")
        .with_timezone(&Utc)
}

/// The instants run for `job` (from effect lines `job@instant`), each asserted run once.
fn runs_of(env: &TestEnv, file: &str, job: &str) -> Vec<DateTime<Utc>> {
    let lines: Vec<String> = env
        .lines(file)
        .into_iter()
        .filter(|l| l.starts_with(&format!("{job}@")))
        .collect();
    let counts = counts(&lines);
    let doubled: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "run more than once: {doubled:?}");
    counts.keys().map(|k| instant_of(k)).collect()
}

fn assert_every_second(instants: &[DateTime<Utc>], what: &str) {
    for pair in instants.windows(2) {
        assert_eq!(
            (pair[1] - pair[0]).num_seconds(),
            1,
            "{what}: a gap between {} and {}",
            pair[0],
            pair[1]
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_job_runs_nothing_meanwhile_and_resume_publishes_none_of_it() {
    let env = setup("ops_pause");
    let cfg = env.config(
        "drumline.toml",
        &format!(
            r#"
[worker]
concurrency = 4
lease = "3s"

[[jobs]]
name = "a"
task = "append"
every = "1s"

[[jobs]]
name = "b"
task = "append"
every = "1s"

[tasks.append]
command = {}
"#,
            env.append_key_command("effects", 0.0)
        ),
    );
    let cfg = cfg.to_str().unwrap();
    let mut worker = env.worker("worker", &["--config", cfg]);
    let (args, metrics) = with_metrics(&["--config", cfg]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut beat = env.beat("beat", &args);
    assert!(
        wait_until(WAIT, || runs_of(&env, "effects", "a").len() >= 2),
        "{}",
        beat.log_tail(20)
    );

    let (code, out, err) = beat_cmd(&env, cfg, &["pause", "a"]);
    assert_eq!(code, 0, "{out}{err}");
    let paused_at = Utc::now();
    // Five seconds of `b` running (its own effects, not a sleep) while `a` is paused.
    let b_before = runs_of(&env, "effects", "b").len();
    assert!(wait_until(WAIT, || runs_of(&env, "effects", "b").len() >= b_before + 5));
    let (code, out, err) = beat_cmd(&env, cfg, &["resume", "a"]);
    assert_eq!(code, 0, "{out}{err}");
    let resumed_at = Utc::now();
    // Resumed: `a`'s next instants run again.
    let after_resume = resumed_at + TimeDelta::seconds(3);
    assert!(
        wait_until(WAIT, || runs_of(&env, "effects", "a")
            .last()
            .is_some_and(|t| *t >= after_resume)),
        "{}",
        beat.log_tail(20)
    );
    let paused_series = r#"drumline_beat_dropped_total{job="a",reason="paused"}"#;
    let dropped = env.metric(metrics, paused_series).unwrap_or(0.0);
    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(20)).success());

    // Honoured within a second of the command, both ways.
    let a = runs_of(&env, "effects", "a");
    let during: Vec<_> = a
        .iter()
        .filter(|t| **t > paused_at + TimeDelta::seconds(1) && **t < resumed_at)
        .collect();
    assert!(during.is_empty(), "ran while paused: {during:?}");
    let (before, after): (Vec<_>, Vec<_>) = a.iter().partition(|t| **t <= paused_at);
    let after: Vec<_> = after
        .into_iter()
        .filter(|t| *t >= resumed_at + TimeDelta::seconds(1))
        .collect();
    assert_every_second(&before, "a before the pause");
    assert_every_second(&after, "a after the resume");
    let gap = (after[0] - *before.last().expect("a ran before the pause")).num_seconds();
    assert!(
        gap >= 5,
        "the paused window was never caught up: gap {gap} s"
    );
    assert!(
        dropped >= 4.0,
        "paused instants are counted as dropped: {dropped}"
    );
    // The other job never noticed.
    assert_every_second(&runs_of(&env, "effects", "b"), "b");
    let mut redis = env.redis().await;
    let paused: Vec<String> = redis::cmd("SMEMBERS")
        .arg(env.names().paused())
        .query_async(&mut redis)
        .await
        .unwrap();
    assert!(paused.is_empty(), "{paused:?}");
}

/// Two jobs never due during the test (hourly, anchored away from now): one `skip`s overlaps and
/// takes 3 s, one allows them and records its args.
fn trigger_config(env: &TestEnv) -> std::path::PathBuf {
    let anchor = (Utc::now() + TimeDelta::minutes(30))
        .duration_trunc(TimeDelta::seconds(1))
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let effects = env.path("effects");
    let with_args = format!("echo \"$DRUMLINE_KEY $(cat)\" >> {}", effects.display());
    env.config(
        "drumline.toml",
        &format!(
            r#"
[worker]
concurrency = 4
lease = "5s"

[[jobs]]
name = "slow"
task = "slow"
every = "1h"
anchor = "{anchor}"
overlap = "skip"

[[jobs]]
name = "free"
task = "args"
every = "1h"
anchor = "{anchor}"
overlap = "allow"
args = {{ n = 7 }}

[tasks.slow]
command = {}

[tasks.args]
command = ["/bin/sh", "-c", {}]
"#,
            env.append_key_command("effects", 3.0),
            toml_string(&with_args)
        ),
    )
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
    let cfg = trigger_config(&env);
    let cfg = cfg.to_str().unwrap();
    let mut worker = env.worker("worker", &["--config", cfg]);
    env.wait_for_topology(&worker).await;

    // overlap = skip: a trigger while the previous instance still runs is recorded `skipped`.
    let (code, out, err) = beat_cmd(&env, cfg, &["trigger", "slow"]);
    assert_eq!(code, 0, "{err}");
    let first = triggered_key(&out);
    assert!(first.starts_with("slow@"), "{first}");
    let running = wait_until_async(WAIT, || async {
        env.run_state(&first).await.as_deref() == Some("running")
    })
    .await;
    assert!(running, "{}", worker.log_tail(20));
    let (code, out, err) = beat_cmd(&env, cfg, &["trigger", "slow"]);
    assert_eq!(code, 0, "{err}");
    let second = triggered_key(&out);
    let skipped = wait_until_async(WAIT, || async {
        env.run_state(&second).await.as_deref() == Some("skipped")
    })
    .await;
    assert!(skipped, "{}", worker.log_tail(20));

    // overlap = allow: runs with the job's args, or with --args instead; status sees it.
    let (code, out, err) = beat_cmd(&env, cfg, &["trigger", "free"]);
    assert_eq!(code, 0, "{err}");
    let own = triggered_key(&out);
    let (code, out, err) = beat_cmd(&env, cfg, &["trigger", "free", "--args", r#"{"n": 8}"#]);
    assert_eq!(code, 0, "{err}");
    let replaced = triggered_key(&out);
    assert!(wait_until(WAIT, || env.lines("effects").len() >= 3));
    let status = || {
        let (code, out, err) = beat_cmd(&env, cfg, &["status", "free", "--json"]);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let succeeded = wait_until(WAIT, || status()["jobs"][0]["last_success"].is_string());
    assert!(succeeded, "{}", status());
    assert!(worker.terminate(Duration::from_secs(20)).success());

    let mut lines = env.lines("effects");
    lines.sort();
    let mut want = vec![
        format!("{own} {{\"n\":7}}"),
        format!("{replaced} {{\"n\":8}}"),
        first.clone(),
    ];
    want.sort();
    assert_eq!(lines, want, "each trigger ran once (the skipped one never)");
}

#[tokio::test(flavor = "multi_thread")]
async fn backfill_twice_runs_each_instant_once_oldest_first() {
    let env = setup("ops_backfill");
    let cfg = env.config(
        "drumline.toml",
        &format!(
            r#"
[worker]
concurrency = 1
lease = "5s"

[[jobs]]
name = "daily"
task = "append"
cron = "0 3 * * *"
expires = "1h"

[tasks.append]
command = {}
"#,
            env.append_key_command("effects", 0.0)
        ),
    );
    let cfg = cfg.to_str().unwrap();
    let (from, to) = ("2026-01-01T00:00:00Z", "2026-01-11T00:00:00Z");
    let range = ["backfill", "daily", "--from", from, "--to", to];

    // A dry run lists the ten instants and publishes nothing.
    let mut dry = range.to_vec();
    dry.push("--dry-run");
    let (code, out, err) = beat_cmd(&env, cfg, &dry);
    assert_eq!(code, 0, "{err}");
    let listed: Vec<&str> = out.lines().filter(|l| l.starts_with("daily@")).collect();
    assert_eq!(listed.len(), 10, "{out}");
    assert_eq!(listed[0], "daily@2026-01-01T03:00:00Z");

    let mut worker = env.worker("worker", &["--config", cfg]);
    env.wait_for_topology(&worker).await;
    for _ in 0..2 {
        let (code, out, err) = beat_cmd(&env, cfg, &range);
        assert_eq!(code, 0, "{out}{err}");
    }
    assert!(
        wait_until(WAIT, || env.lines("effects").len() >= 10),
        "{}",
        worker.log_tail(20)
    );
    // The second backfill's ten copies are duplicates: wait until they are all settled.
    let queue = env.names().work_queue("default");
    let drained = wait_until_async(WAIT, || async { env.queue_len(&queue).await == Some(0) }).await;
    assert!(drained);
    assert!(worker.terminate(Duration::from_secs(20)).success());
    let want: Vec<String> = (1..=10)
        .map(|d| format!("daily@2026-01-{d:02}T03:00:00Z"))
        .collect();
    assert_eq!(
        env.lines("effects"),
        want,
        "ten runs, oldest first, none twice"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backfilled_skip_job_queues_its_instants_instead_of_skipping_them() {
    let env = setup("ops_backfill_skip");
    let cfg = env.config(
        "drumline.toml",
        &format!(
            r#"
[worker]
concurrency = 2
lease = "2s"

[[jobs]]
name = "slow"
task = "slow"
every = "1m"
overlap = "skip"

[tasks.slow]
command = {}
"#,
            env.append_key_command("effects", 1.0)
        ),
    );
    let cfg = cfg.to_str().unwrap();
    let mut worker = env.worker("worker", &["--config", cfg]);
    env.wait_for_topology(&worker).await;
    let (from, to) = ("2026-01-01T00:00:00Z", "2026-01-01T00:02:00Z");
    let (code, out, err) = beat_cmd(&env, cfg, &["backfill", "slow", "--from", from, "--to", to]);
    assert_eq!(code, 0, "{out}{err}");
    // Both delivered at once to two slots: the second waits for the first instead of being
    // recorded `skipped`.
    assert!(
        wait_until(WAIT, || env.lines("effects").len() >= 2),
        "{}",
        worker.log_tail(20)
    );
    assert!(worker.terminate(Duration::from_secs(20)).success());
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
    let cfg = env.config(
        "drumline.toml",
        r#"
[[jobs]]
name = "tick"
task = "t"
every = "1m"

[tasks.t]
command = ["/bin/true"]
"#,
    );
    let cfg = cfg.to_str().unwrap();
    let future = (Utc::now() + TimeDelta::hours(1)).to_rfc3339();
    let cases: [(&[&str], &str); 8] = [
        (&["pause", "nope"], "no job named \"nope\""),
        (&["resume", "tick", "nope"], "no job named \"nope\""),
        (&["trigger", "nope"], "no job named \"nope\""),
        (
            &["trigger", "tick", "--args", "{oops"],
            "--args is not JSON",
        ),
        (
            &[
                "backfill",
                "tick",
                "--from",
                "2026-01-02T00:00:00Z",
                "--to",
                "2026-01-01T00:00:00Z",
            ],
            "must be before --to",
        ),
        (
            &[
                "backfill",
                "tick",
                "--from",
                "2026-01-01T00:00:00Z",
                "--to",
                "2026-01-02T00:00:00Z",
            ],
            "more than 1000 instants",
        ),
        (
            &[
                "backfill",
                "tick",
                "--from",
                "2026-01-01T00:00:00Z",
                "--to",
                &future,
            ],
            "in the future",
        ),
        (
            &[
                "backfill",
                "tick",
                "--from",
                "yesterday",
                "--to",
                "2026-01-01T00:00:00Z",
            ],
            "not an RFC 3339 instant",
        ),
    ];
    for (args, message) in cases {
        let (code, out, err) = beat_cmd(&env, cfg, args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains(message), "{args:?}: {err}");
        assert_eq!(
            err.trim().lines().count(),
            1,
            "{args:?}: one clear line: {err}"
        );
        assert!(out.is_empty(), "{args:?}: {out}");
    }
    // Nothing was declared, published or paused.
    assert_eq!(
        env.queue_len(&env.names().work_queue("default")).await,
        None
    );
    let mut redis = env.redis().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}:*", env.names().namespace()))
        .query_async(&mut redis)
        .await
        .unwrap();
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
    let cfg = env.config(
        "drumline.toml",
        &format!(
            "[worker]\nconcurrency = 2\n\n[[jobs]]\nname = \"short\"\ntask = \"short\"\n\
             every = \"1m\"\n\n[tasks.short]\ncommand = [\"/bin/sh\", \"-c\", {}]\n",
            toml_string(&script)
        ),
    );
    let cfg = cfg.to_str().unwrap();
    let workers = [
        env.worker("w1", &["--config", cfg]),
        env.worker("w2", &["--config", cfg]),
    ];
    env.wait_for_topology(&workers[0]).await;
    let (from, to) = ("2026-01-01T00:00:00Z", "2026-01-01T00:20:00Z");
    let args = [
        "--config", cfg, "backfill", "short", "--from", from, "--to", to, "--wait",
    ];
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
    let job = |every: &str| {
        format!(
            "[[jobs]]\nname = \"fast\"\ntask = \"append\"\nevery = \"{every}\"\n\
             [tasks.append]\ncommand = {}\n",
            env.append_key_command("effects", 0.0)
        )
    };
    let too_fast = env.config("1ms.toml", &job("1ms"));
    let answer = beat_cmd_within(too_fast.to_str().unwrap(), &["trigger", "fast"], hung);
    let (code, out, err) =
        answer.unwrap_or_else(|| panic!("trigger of a 1ms job hung for {hung:?}"));
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("key `every`"), "{err}");

    let cfg = env.config("drumline.toml", &job("100ms"));
    let cfg = cfg.to_str().unwrap();
    let mut worker = env.worker("worker", &["--config", cfg]);
    env.wait_for_topology(&worker).await;
    let mut keys = Vec::new();
    for _ in 0..5 {
        let answer = beat_cmd_within(cfg, &["trigger", "fast"], hung);
        let (code, out, err) =
            answer.unwrap_or_else(|| panic!("trigger of a 100ms job hung for {hung:?}"));
        assert_eq!(code, 0, "{out}{err}");
        let key = triggered_key(&out);
        // Never one of the job's instants (multiples of 100 ms): those keys are the beat's.
        let ms = instant_of(&key).timestamp_subsec_millis();
        assert_ne!(ms % 100, 0, "{key} is a scheduled instant's key");
        keys.push(key);
    }
    assert!(
        wait_until(WAIT, || env.lines("effects").len() >= keys.len()),
        "{}",
        worker.log_tail(20)
    );
    assert!(worker.terminate(Duration::from_secs(20)).success());
    let mut ran = env.lines("effects");
    ran.sort();
    keys.sort();
    assert_eq!(ran, keys, "each trigger ran once");
}
