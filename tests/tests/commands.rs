//! `drumline-beat publish` and `drumline-beat status` against the real broker, Redis and worker.

use drumline_e2e::{
    http_get, metric, setup, unused_port, wait_until, wait_until_async, with_metrics,
};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread")]
async fn adhoc_publish_runs_once_per_key_and_delayed_tasks_run_too() {
    let env = setup("e2e_publish");
    let cfg = env.config(
        "drumline.toml",
        &format!(
            "[worker]\nlease = \"3s\"\n[tasks.append]\ncommand = {}\n",
            env.append_key_command("effects", 0.0)
        ),
    );
    let cfg = cfg.to_str().unwrap();
    let (args, port) = with_metrics(&["--config", cfg]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut worker = env.worker("worker", &args);
    for _ in 0..2 {
        let (status, stdout, stderr) = env.run(
            "drumline-beat",
            &[
                "--config",
                cfg,
                "publish",
                "append",
                "--key",
                "invoice-42",
                "--args",
                "{\"n\":1}",
            ],
        );
        assert!(status.success(), "{stderr}");
        assert!(stdout.contains("key=invoice-42"), "{stdout}");
    }
    let (status, stdout, stderr) = env.run(
        "drumline-beat",
        &["--config", cfg, "publish", "append", "--delay", "2s"],
    );
    assert!(status.success(), "{stderr}");
    let delayed_key = stdout
        .split("key=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .to_owned();
    assert!(
        wait_until(WAIT, || env.lines("effects").len() == 2),
        "{:?}\n{}",
        env.lines("effects"),
        worker.log_tail(20)
    );
    // Both delivered copies of invoice-42 settled: one ran, the other was a duplicate.
    let duplicates = || metric(port, "drumline_worker_duplicates_total");
    assert!(
        wait_until(WAIT, || duplicates().is_some_and(|n| n >= 1.0)),
        "duplicates: {:?}\n{}",
        duplicates(),
        worker.log_tail(20)
    );
    assert_eq!(duplicates(), Some(1.0), "one duplicate copy");
    assert!(worker.terminate(Duration::from_secs(20)).success());
    let mut lines = env.lines("effects");
    lines.sort();
    let mut expected = vec!["invoice-42".to_owned(), delayed_key];
    expected.sort();
    assert_eq!(lines, expected);

    // Bad requests are usage errors.
    let (status, _, stderr) = env.run("drumline-beat", &["--config", cfg, "publish", "nope"]);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no task named \"nope\""), "{stderr}");
    let (status, _, stderr) = env.run(
        "drumline-beat",
        &["--config", cfg, "publish", "append", "--args", "{oops"],
    );
    assert_eq!(status.code(), Some(2), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn status_reports_progress_success_and_staleness() {
    let env = setup("e2e_status");
    let cfg = env.config(
        "drumline.toml",
        &format!(
            "[[jobs]]\nname = \"tick\"\ntask = \"append\"\nevery = \"1s\"\n[[jobs]]\nname = \"never\"\ntask = \"append\"\ncron = \"0 0 1 1 *\"\n[tasks.append]\ncommand = {}\n",
            env.append_key_command("effects", 0.0)
        ),
    );
    let cfg = cfg.to_str().unwrap();
    let mut worker = env.worker("worker", &["--config", cfg]);
    let metrics = unused_port();
    let metrics_addr = format!("127.0.0.1:{metrics}");
    let mut beat = env.beat("beat", &["--config", cfg, "--metrics-addr", &metrics_addr]);
    assert!(
        wait_until(WAIT, || env.lines("effects").len() >= 2),
        "{}",
        beat.log_tail(20)
    );
    assert_eq!(
        http_get(metrics, "/healthz"),
        Some((200, "ok\n".to_owned()))
    );
    // The worker can finish a run before the beat has handled the broker's confirm of it:
    // poll the counter rather than read it once.
    let series = r#"drumline_beat_published_total{job="tick"}"#;
    assert!(
        wait_until(WAIT, || metric(metrics, series).is_some_and(|n| n >= 2.0)),
        "{:?}",
        http_get(metrics, "/metrics")
    );

    let status_json = || {
        let (status, stdout, stderr) =
            env.run("drumline-beat", &["--config", cfg, "status", "--json"]);
        assert!(status.success(), "{stderr}");
        serde_json::from_str::<serde_json::Value>(&stdout).unwrap()
    };
    let healthy = wait_until_async(WAIT, || async {
        let s = status_json();
        let tick = &s["jobs"][0];
        tick["job"] == "tick" && tick["last_success"].is_string() && tick["stale"] == false
    })
    .await;
    assert!(healthy, "{}", status_json());
    let s = status_json();
    // The one beat leads: status names it, with the lease's first epoch.
    let leader = &s["leader"];
    assert_eq!(leader["pid"], beat.pid(), "{s}");
    assert_eq!(leader["epoch"], 1, "{s}");
    assert!(
        leader["host"].is_string() && leader["since"].is_string(),
        "{s}"
    );
    assert!(
        leader.get("token").is_none(),
        "the token stays in Redis: {s}"
    );
    assert_eq!(s["dead_letters"], 0, "{s}");
    let tick = &s["jobs"][0];
    assert_eq!(tick["schedule"], "every 1s");
    assert!(tick["next_due"].is_string() && tick["last_published"].is_string());
    let never = &s["jobs"][1];
    assert_eq!(never["last_success"], serde_json::Value::Null);
    assert_eq!(
        never["stale"], false,
        "a job that never came due is not stale"
    );

    // Stop the workers: the job keeps being published but nothing succeeds; after two periods
    // it is flagged stale.
    assert!(worker.terminate(Duration::from_secs(20)).success());
    let stale =
        wait_until_async(WAIT, || async { status_json()["jobs"][0]["stale"] == true }).await;
    assert!(stale, "{}", status_json());
    let (status, table, _) = env.run("drumline-beat", &["--config", cfg, "status"]);
    assert!(status.success());
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("tick") && l.trim_end().ends_with("STALE")),
        "{table}"
    );
    assert!(beat.terminate(Duration::from_secs(10)).success());
}

#[tokio::test(flavor = "multi_thread")]
async fn status_counts_running_instances_failures_and_dead_letters() {
    let env = setup("e2e_status_running");
    let body = r#"
[worker]
concurrency = 4
lease = "2s"

[[jobs]]
name = "slow"
task = "slow"
every = "1s"
overlap = "allow"

[[jobs]]
name = "broken"
task = "broken"
every = "1s"

[tasks.slow]
command = ["/bin/sleep", "10"]

[tasks.broken]
command = ["/bin/false"]
max_retries = 0
"#;
    let cfg = env.config("drumline.toml", body);
    let cfg = cfg.to_str().unwrap();
    let status_json = |cfg: &str| {
        let (status, stdout, stderr) =
            env.run("drumline-beat", &["--config", cfg, "status", "--json"]);
        assert!(status.success(), "{stderr}");
        serde_json::from_str::<serde_json::Value>(&stdout).unwrap()
    };
    let mut worker = env.worker("worker", &["--config", cfg]);
    let mut beat = env.beat("beat", &["--config", cfg]);
    // Instances of `slow` pile up (overlap = allow, 4 slots); `broken` fails, is dead-lettered
    // and becomes the job's last failure.
    let seen = wait_until_async(WAIT, || async {
        let s = status_json(cfg);
        s["jobs"][0]["running"].as_u64() >= Some(2)
            && s["jobs"][1]["last_failure"].is_string()
            && s["dead_letters"].as_u64() >= Some(1)
    })
    .await;
    assert!(seen, "{}\n{}", status_json(cfg), worker.log_tail(20));
    let s = status_json(cfg);
    assert_eq!(s["jobs"][1]["running"], 0, "{s}");
    assert_eq!(s["jobs"][0]["last_failure"], serde_json::Value::Null, "{s}");
    assert!(beat.terminate(Duration::from_secs(10)).success());

    // A killed worker's instances age out with their leases.
    worker.kill9();
    let aged = wait_until_async(WAIT, || async {
        status_json(cfg)["jobs"][0]["running"] == 0
    })
    .await;
    assert!(aged, "{}", status_json(cfg));

    // Without a broker, status still answers from Redis; only the dead letters are unknown.
    let offline = env.config(
        "offline.toml",
        &format!(
            "[broker]\nurl = \"amqp://guest:guest@127.0.0.1:{}/%2f\"\n{body}",
            unused_port()
        ),
    );
    let offline = offline.to_str().unwrap();
    let s = status_json(offline);
    assert_eq!(s["dead_letters"], serde_json::Value::Null, "{s}");
    assert!(s["jobs"][1]["last_failure"].is_string(), "{s}");
    let (status, table, stderr) = env.run("drumline-beat", &["--config", offline, "status"]);
    assert!(status.success(), "{stderr}");
    assert!(
        table.lines().any(|l| l.starts_with("dead letters: -")),
        "{table}"
    );
}

/// `status` writes rows as it reads them (docs/operations.md#status-of-many-jobs): for 2,000
/// jobs (several steps) `--json` is one document in config order, the table's columns line up
/// across steps (the longest name comes last), and `status | head` ends quietly once the reader
/// has what it wanted (the whole report written at once panicked on the closed pipe).
#[test]
fn status_of_many_jobs_is_written_as_read_and_stops_quietly_for_head() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let env = setup("e2e_status_many");
    let name = |i: usize| {
        if i == 1999 {
            "a-much-longer-name-than-any-other-job".to_owned()
        } else {
            format!("job-{i:04}")
        }
    };
    let mut text = String::from("[tasks.t]\ncommand = [\"/bin/true\"]\n");
    for i in 0..2000 {
        text.push_str(&format!(
            "[[jobs]]\nname = \"{}\"\ntask = \"t\"\nevery = \"1h\"\n",
            name(i)
        ));
    }
    let cfg = env.config("drumline.toml", &text);
    let cfg = cfg.to_str().unwrap();

    let (status, stdout, stderr) = env.run("drumline-beat", &["--config", cfg, "status", "--json"]);
    assert!(status.success(), "{stderr}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON document");
    assert_eq!(doc["total"], 2000);
    let jobs = doc["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 2000);
    for (i, job) in jobs.iter().enumerate() {
        assert_eq!(job["job"], name(i));
        assert_eq!(job["schedule"], "every 1h");
    }
    assert!(
        doc["workers"].is_array() && doc["queues"].is_array(),
        "{doc}"
    );

    let (status, table, stderr) = env.run("drumline-beat", &["--config", cfg, "status"]);
    assert!(status.success(), "{stderr}");
    let mut lines = table.lines().skip_while(|l| !l.starts_with("JOB"));
    let header = lines.next().expect("the jobs table");
    let at = header.find("SCHEDULE").unwrap();
    let rows: Vec<&str> = lines.take_while(|l| !l.is_empty()).collect();
    assert_eq!(rows.len(), 2000);
    for row in &rows {
        assert_eq!(row.find("every 1h"), Some(at), "{row}");
    }

    let mut child = Command::new(drumline_e2e::binary("drumline-beat"))
        .args(["--config", cfg, "status"])
        .env_remove("DRUMLINE_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut first = String::new();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    for _ in 0..3 {
        out.read_line(&mut first).unwrap();
    }
    drop(out);
    let ended = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&ended.stderr);
    assert!(first.starts_with("leader: "), "{first}");
    assert!(ended.status.success(), "{:?} {stderr}", ended.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}
