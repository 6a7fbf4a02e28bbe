//! `drumline-beat publish` and `drumline-beat status` against the real broker, Redis and worker.

use drumline_e2e::cfg::{cron, every, Cfg, Keys};
use drumline_e2e::scenario::{appends, stop, Scenario};
use drumline_e2e::{counts, http_get, metric, unused_port, wait_until, TestEnv};
use serde_json::Value;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// `drumline-beat --config CFG args…`, expected to fail with exit code 2: its stderr.
fn usage_error(sc: &Scenario, args: &[&str]) -> String {
    let mut all = vec!["--config", sc.cfg()];
    all.extend_from_slice(args);
    let (status, _, stderr) = sc.run("drumline-beat", &all);
    assert_eq!(status.code(), Some(2), "{stderr}");
    stderr
}

#[tokio::test(flavor = "multi_thread")]
async fn adhoc_publish_runs_once_per_key_and_delayed_tasks_run_too() {
    let mut sc = Scenario::new("e2e_publish", |env| {
        let cfg = Cfg::new().set("worker", "lease", "\"3s\"");
        cfg.task("append", appends(env, "effects"))
    });
    let port = sc.start_metered_worker().await;
    let twice: Vec<&str> = "publish append --key invoice-42 --args {\"n\":1}"
        .split(' ')
        .collect();
    for _ in 0..2 {
        let out = sc.run_ok("drumline-beat", &twice);
        assert!(out.contains("key=invoice-42"), "{out}");
    }
    let out = sc.run_ok("drumline-beat", &["publish", "append", "--delay", "2s"]);
    let delayed_key = out.split("key=").nth(1).unwrap().split(' ').next().unwrap();
    let two = wait_until(WAIT, || sc.lines("effects").len() == 2);
    sc.check(two, format!("{:?}", sc.lines("effects")));
    // Both delivered copies of invoice-42 settled: one ran, the other was a duplicate.
    let duplicates = || metric(port, "drumline_worker_duplicates_total");
    let settled = wait_until(WAIT, || duplicates().is_some_and(|n| n >= 1.0));
    sc.check(settled, format!("duplicates: {:?}", duplicates()));
    assert_eq!(duplicates(), Some(1.0), "one duplicate copy");
    sc.stop();
    let expected = ["invoice-42".to_owned(), delayed_key.to_owned()];
    assert_eq!(counts(&sc.lines("effects")), counts(&expected));
    // Bad requests are usage errors.
    let stderr = usage_error(&sc, &["publish", "nope"]);
    assert!(stderr.contains("no task named \"nope\""), "{stderr}");
    usage_error(&sc, &["publish", "append", "--args", "{oops"]);
}

/// Task `append` appends its key to `effects`; job `tick` runs it every second, `never` on
/// New Year's midnight.
fn tick_and_never(env: &TestEnv) -> Cfg {
    let on_append = |keys: Keys| keys.with("task", "\"append\"");
    Cfg::new()
        .job("tick", on_append(every("1s")))
        .job("never", on_append(cron("0 0 1 1 *")))
        .task("append", appends(env, "effects"))
}

/// `status --json` document `s` shows a success of `tick`, which is not stale.
fn tick_succeeded(s: &Value) -> bool {
    let tick = &s["jobs"][0];
    tick["job"] == "tick" && tick["last_success"].is_string() && tick["stale"] == false
}

/// `status --json` document `s` names the beat `pid` as the leader, with the lease's first
/// epoch, its host and since when, and not its token (which stays in Redis).
fn assert_first_leader(s: &Value, pid: i32) {
    let leader = &s["leader"];
    assert_eq!(leader["pid"], pid, "{s}");
    assert_eq!(leader["epoch"], 1, "{s}");
    let described = leader["host"].is_string() && leader["since"].is_string();
    assert!(described, "{s}");
    assert!(
        leader.get("token").is_none(),
        "the token stays in Redis: {s}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn status_reports_progress_success_and_staleness() {
    let mut sc = Scenario::start("e2e_status", 0, 1, tick_and_never).await;
    let metrics = sc.start_metered_beat();
    sc.wait(WAIT, "two runs", || sc.lines("effects").len() >= 2);
    let health = http_get(metrics, "/healthz");
    assert_eq!(health, Some((200, "ok\n".to_owned())));
    // The worker can finish a run before the beat has handled the broker's confirm of it:
    // poll the counter rather than read it once.
    let series = r#"drumline_beat_published_total{job="tick"}"#;
    let two = wait_until(WAIT, || metric(metrics, series).is_some_and(|n| n >= 2.0));
    assert!(two, "{:?}", http_get(metrics, "/metrics"));
    let healthy = wait_until(WAIT, || tick_succeeded(&sc.status_json()));
    assert!(healthy, "{}", sc.status_json());
    let s = sc.status_json();
    assert_first_leader(&s, sc.beats[0].pid());
    assert_eq!(s["dead_letters"], 0, "{s}");
    let tick = &s["jobs"][0];
    assert_eq!(tick["schedule"], "every 1s");
    assert!(tick["next_due"].is_string() && tick["last_published"].is_string());
    let never = &s["jobs"][1];
    assert_eq!(never["last_success"], Value::Null);
    let what = "a job that never came due is not stale";
    assert_eq!(never["stale"], false, "{what}");
    // Stop the workers: the job keeps being published but nothing succeeds; after two periods
    // it is flagged stale.
    stop(&mut [&mut sc.workers[0]]);
    let stale = wait_until(WAIT, || sc.status_json()["jobs"][0]["stale"] == true);
    assert!(stale, "{}", sc.status_json());
    let table = sc.run_ok("drumline-beat", &["status"]);
    let flagged = |l: &str| l.starts_with("tick") && l.trim_end().ends_with("STALE");
    assert!(table.lines().any(flagged), "{table}");
    sc.stop();
}

/// `slow` (1 s, sleeps 10 s, overlap allowed) and `broken` (1 s, fails, no retry).
fn slow_and_broken() -> Cfg {
    Cfg::new()
        .set("worker", "concurrency", "4")
        .set("worker", "lease", "\"2s\"")
        .job("slow", every("1s").with("overlap", "\"allow\""))
        .job("broken", every("1s"))
        .task(
            "slow",
            Keys::default().with("command", "[\"/bin/sleep\", \"10\"]"),
        )
        .task(
            "broken",
            Keys::default()
                .with("command", "[\"/bin/false\"]")
                .with("max_retries", "0"),
        )
}

/// `cfg` with a broker URL on a port nothing listens on.
fn without_a_broker(cfg: Cfg) -> Cfg {
    let url = format!("\"amqp://guest:guest@127.0.0.1:{}/%2f\"", unused_port());
    cfg.set("broker", "url", &url)
}

/// `status --json` document `s` shows two or more `slow` instances running, a last failure of
/// `broken` and a dead letter.
fn piled_up_and_failed(s: &Value) -> bool {
    s["jobs"][0]["running"].as_u64() >= Some(2)
        && s["jobs"][1]["last_failure"].is_string()
        && s["dead_letters"].as_u64() >= Some(1)
}

#[tokio::test(flavor = "multi_thread")]
async fn status_counts_running_instances_failures_and_dead_letters() {
    let mut sc = Scenario::start("e2e_status_running", 1, 1, |_| slow_and_broken()).await;
    // Instances of `slow` pile up (overlap = allow, 4 slots); `broken` fails, is dead-lettered
    // and becomes the job's last failure.
    let seen = wait_until(WAIT, || piled_up_and_failed(&sc.status_json()));
    sc.check(seen, sc.status_json());
    let s = sc.status_json();
    assert_eq!(s["jobs"][1]["running"], 0, "{s}");
    assert_eq!(s["jobs"][0]["last_failure"], Value::Null, "{s}");
    stop(&mut [sc.last_beat()]);
    // A killed worker's instances age out with their leases.
    sc.workers[0].kill9();
    let aged = wait_until(WAIT, || sc.status_json()["jobs"][0]["running"] == 0);
    assert!(aged, "{}", sc.status_json());
    // Without a broker, status still answers from Redis; only the dead letters are unknown.
    let offline = sc.config_named("offline.toml", &without_a_broker(slow_and_broken()));
    let status = |extra: &[&str]| {
        let (code, out, err) = sc.beat_cmd(&offline, &[&["status"], extra].concat());
        assert_eq!(code, 0, "{err}");
        out
    };
    let s: Value = serde_json::from_str(&status(&["--json"])).expect("status --json");
    assert_eq!(s["dead_letters"], Value::Null, "{s}");
    assert!(s["jobs"][1]["last_failure"].is_string(), "{s}");
    let table = status(&[]);
    let unknown = table.lines().any(|l| l.starts_with("dead letters: -"));
    assert!(unknown, "{table}");
}

/// Job `i` of [`many_jobs`]: the last has the longest name.
fn many_name(i: usize) -> String {
    match i {
        1999 => "a-much-longer-name-than-any-other-job".to_owned(),
        _ => format!("job-{i:04}"),
    }
}

/// 2,000 hourly jobs of one task.
fn many_jobs() -> Cfg {
    let true_task = Keys::default().with("command", "[\"/bin/true\"]");
    (0..2000).fold(Cfg::new().task("t", true_task), |cfg, i| {
        cfg.job(&many_name(i), every("1h").with("task", "\"t\""))
    })
}

/// `drumline-beat --config CFG status | head -n LINES`: the lines read, and how the command
/// ended once its reader had gone.
fn status_head(sc: &Scenario, lines: usize) -> (String, std::process::Output) {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut child = Command::new(drumline_e2e::binary("drumline-beat"))
        .args(["--config", sc.cfg(), "status"])
        .env_remove("DRUMLINE_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut first = String::new();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    for _ in 0..lines {
        out.read_line(&mut first).unwrap();
    }
    drop(out);
    (first, child.wait_with_output().unwrap())
}

/// `status` writes rows as it reads them (docs/operations.md#status-of-many-jobs): for 2,000
/// jobs (several steps) `--json` is one document in config order, the table's columns line up
/// across steps (the longest name comes last), and `status | head` ends quietly once the reader
/// has what it wanted (the whole report written at once panicked on the closed pipe).
#[test]
fn status_of_many_jobs_is_written_as_read_and_stops_quietly_for_head() {
    let sc = Scenario::new("e2e_status_many", |_| many_jobs());
    let doc = sc.status_json();
    assert_eq!(doc["total"], 2000);
    let jobs = doc["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 2000);
    for (i, job) in jobs.iter().enumerate() {
        assert_eq!(job["job"], many_name(i));
        assert_eq!(job["schedule"], "every 1h");
    }
    let lists = doc["workers"].is_array() && doc["queues"].is_array();
    assert!(lists, "{doc}");
    let table = sc.run_ok("drumline-beat", &["status"]);
    let mut lines = table.lines().skip_while(|l| !l.starts_with("JOB"));
    let header = lines.next().expect("the jobs table");
    let at = header.find("SCHEDULE").unwrap();
    let rows: Vec<&str> = lines.take_while(|l| !l.is_empty()).collect();
    assert_eq!(rows.len(), 2000);
    for row in &rows {
        assert_eq!(row.find("every 1h"), Some(at), "{row}");
    }
    let (first, ended) = status_head(&sc, 3);
    let stderr = String::from_utf8_lossy(&ended.stderr);
    assert!(first.starts_with("leader: "), "{first}");
    assert!(ended.status.success(), "{:?} {stderr}", ended.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}
