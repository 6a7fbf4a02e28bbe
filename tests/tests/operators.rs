//! For the person on call (docs/operations.md): errors that name the service, `publish`'s
//! warnings, `dlq purge --yes`, and the one `drumline` command.

use drumline_e2e::cfg::{every, shell, Cfg};
use drumline_e2e::probe::{expect, stop};
use drumline_e2e::proxy::{Fault, Proxy};
use drumline_e2e::{http_get, metric, setup, unused_port, wait_until, with_metrics, Proc};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);

#[test]
fn failed_connections_name_the_service_and_the_redacted_url() {
    let env = setup("e2e_op_refused");
    let cfg = Cfg::new()
        .set("broker", "url", "\"amqp://guest:guest@127.0.0.1:1/%2f\"")
        .set("redis", "url", "\"redis://127.0.0.1:1/\"")
        .task("t", shell("true"));
    let cfg = env.write_config("drumline.toml", &cfg);
    let cfg = cfg.to_str().unwrap();
    let broker = "cannot connect to the broker at amqp://guest:***@127.0.0.1:1/";
    for (bin, args) in [
        ("drumline-beat", &["publish", "t"][..]),
        ("drumline-worker", &["dlq", "list"][..]),
    ] {
        let (status, _, stderr) = env.run(bin, &[&["--config", cfg][..], args].concat());
        assert_eq!(status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(broker), "{bin} {args:?}: {stderr}");
        assert!(!stderr.contains("guest:guest"), "{stderr}");
    }
    let (status, _, stderr) = env.run("drumline-beat", &["--config", cfg, "status"]);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("cannot connect to Redis at redis://127.0.0.1:1/"),
        "{stderr}"
    );
}

#[test]
fn healthz_names_redis_when_redis_is_down_and_metrics_addr_takes_a_host_name() {
    let env = setup("e2e_op_health");
    let cfg = Cfg::new()
        .set("redis", "url", "\"redis://127.0.0.1:1/\"")
        .task("t", shell("true"));
    let cfg = env.write_config("drumline.toml", &cfg);
    let port = unused_port();
    let addr = format!("localhost:{port}");
    let mut worker = env.worker(
        "worker",
        &["--config", cfg.to_str().unwrap(), "--metrics-addr", &addr],
    );
    let health = || http_get(port, "/healthz");
    expect(WAIT, &[&worker], "/healthz answers", || health().is_some());
    let (code, body) = health().unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("redis unreachable") && !body.contains("broker"),
        "{body}"
    );
    worker.terminate(Duration::from_secs(10));
}

// See: issues/33
#[test]
fn beat_healthz_is_503_naming_redis_whenever_redis_fails_it_and_200_only_when_it_could_lead() {
    let env = setup("e2e_op_beat_health");
    let cfg = Cfg::new()
        .set("beat", "leader_lease", "\"3s\"")
        .task("t", shell("true"))
        .job("j", every("1m").with("task", "\"t\""));
    let cfg = env.write_config("drumline.toml", &cfg);
    let beat = |label: &str, redis_url: &str| {
        let port = unused_port();
        let addr = format!("127.0.0.1:{port}");
        let args = ["--config", cfg.to_str().unwrap(), "--metrics-addr", &addr];
        (
            env.beat_with_env(label, &args, &[("DRUMLINE_REDIS_URL", redis_url)]),
            port,
        )
    };
    // `/healthz` of `beat` (on `port`) comes to answer `code` with a body that starts `body`.
    let answers = |(beat, port): &(Proc, u16), code: u16, body: &str| {
        expect(WAIT, &[beat], format!("/healthz {code} {body}"), || {
            http_get(*port, "/healthz").is_some_and(|(c, b)| c == code && b.starts_with(body))
        })
    };
    let leader = beat("leader", "redis://127.0.0.1:6379/0");
    answers(&leader, 200, "ok");
    // A user Redis refuses (the shared Redis takes any password for `default`): AUTH fails.
    let refused = beat("refused", "redis://nosuchuser:pw@127.0.0.1:6379/0");
    answers(&refused, 503, "redis unreachable");
    // A standby that reached Redis, then loses it, and gets it back.
    let proxy = Proxy::start("127.0.0.1:6379".parse().unwrap());
    let standby = beat("standby", &format!("redis://127.0.0.1:{}/0", proxy.port));
    answers(&standby, 200, "standby");
    proxy.set(Fault::Reset);
    answers(&standby, 503, "redis unreachable");
    proxy.set(Fault::Pass);
    answers(&standby, 200, "standby");
    let (refused_port, mut procs) = (refused.1, [standby.0, refused.0, leader.0]);
    assert_eq!(http_get(refused_port, "/healthz").map(|r| r.0), Some(503));
    for proc in &mut procs {
        proc.terminate(Duration::from_secs(10));
    }
}

#[test]
fn config_errors_point_at_the_line_and_args_must_be_a_table() {
    let env = setup("e2e_op_toml");
    let bad = env.config("bad.toml", "[worker]\nlease = = \"3s\"\n");
    let (status, _, stderr) = env.run(
        "drumline-beat",
        &["--config", bad.to_str().unwrap(), "check"],
    );
    assert_eq!(status.code(), Some(2), "{stderr}");
    let text = std::fs::read_to_string(&bad).unwrap();
    let line = text.lines().position(|l| l.starts_with("lease")).unwrap() + 1;
    let expected = format!("error: {}:{line}:9: ", bad.display());
    assert!(stderr.starts_with(&expected), "{stderr}");
    assert!(stderr.lines().any(|l| l == "lease = = \"3s\""), "{stderr}");
    let cfg = Cfg::new().task("t", shell("true")).job(
        "j",
        every("1s").with("task", "\"t\"").with("args", "\"ny\""),
    );
    let cfg = env.write_config("args.toml", &cfg);
    let (status, _, stderr) = env.run(
        "drumline-beat",
        &["--config", cfg.to_str().unwrap(), "check"],
    );
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("args"), "{stderr}");
}

#[test]
fn publish_warns_of_no_consumer_and_of_a_recorded_key() {
    let env = setup("e2e_op_warn");
    let cfg = Cfg::new().set("worker", "lease", "\"3s\"");
    let cfg = env.config_file(&cfg.task("t", env.appender("effects", 0.0)));
    let publish = || env.beat_cmd(&cfg, &["publish", "t", "--key", "k1"]);
    let mut worker = env.worker_on("worker", &cfg);
    let (code, _, stderr) = publish();
    assert_eq!(code, 0, "{stderr}");
    assert!(!stderr.contains("already recorded"), "{stderr}");
    expect(WAIT, &[&worker], "k1 ran", || {
        env.lines("effects") == ["k1"]
    });
    worker.terminate(Duration::from_secs(10));
    let (code, stdout, stderr) = publish();
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("key=k1"), "{stdout}");
    for warning in [
        "warning: no worker consumes queue default",
        "key k1 already recorded (done at ",
        "this copy will not run",
    ] {
        assert!(stderr.contains(warning), "{stderr}");
    }
}

#[test]
fn dlq_purge_asks_for_yes() {
    let env = setup("e2e_op_purge");
    let cfg = env.write_config("drumline.toml", &Cfg::new().task("t", shell("true")));
    let (status, _, stderr) = env.run(
        "drumline-worker",
        &["--config", cfg.to_str().unwrap(), "dlq", "purge"],
    );
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--yes"), "{stderr}");
}

#[test]
fn every_operator_command_is_reachable_through_drumline() {
    let env = setup("e2e_op_drumline");
    let cfg = Cfg::new()
        .task("t", shell("true"))
        .job("j", every("1h").with("task", "\"t\""));
    let cfg = env.write_config("drumline.toml", &cfg);
    let cfg = cfg.to_str().unwrap();
    let drumline = |args: &[&str]| env.run("drumline", &[&["--config", cfg][..], args].concat());
    let ok: [&[&str]; 10] = [
        &["check"],
        &["next", "j", "--count", "1"],
        &["status", "--json"],
        &["pause", "j"],
        &["resume", "j"],
        &["publish", "t"],
        &["trigger", "j"],
        &[
            "backfill",
            "j",
            "--from",
            "2026-01-01T00:00:00Z",
            "--to",
            "2026-01-01T03:00:00Z",
            "--dry-run",
        ],
        &["dlq", "list", "--json"],
        &["completions", "bash"],
    ];
    for args in ok {
        let (status, stdout, stderr) = drumline(args);
        assert!(status.success(), "drumline {args:?}: {stderr}");
        assert!(!stdout.is_empty(), "drumline {args:?}: no output");
    }
    let (status, _, stderr) = drumline(&["dlq", "purge"]);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--yes"), "{stderr}");
    let (status, stdout, stderr) = drumline(&["dlq", "purge", "--yes"]);
    assert!(status.success(), "{stderr}");
    assert_eq!(stdout.trim(), "purged 0 dead letters");
}

#[test]
fn metrics_carry_build_info_process_and_queue_gauges() {
    let env = setup("e2e_op_metrics");
    let cfg = Cfg::new()
        .task("t", shell("true"))
        .job("j", every("1h").with("task", "\"t\""));
    let cfg = env.write_config("drumline.toml", &cfg);
    let (args, beat_port) = with_metrics(&["--config", cfg.to_str().unwrap()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut beat = env.beat("beat", &args);
    let (args, worker_port) = with_metrics(&["--config", cfg.to_str().unwrap()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut worker = env.worker("worker", &args);
    let version = env!("CARGO_PKG_VERSION");
    for (port, binary) in [(beat_port, "beat"), (worker_port, "worker")] {
        let ns = env.names().namespace().to_owned();
        let info = format!(
            "drumline_build_info{{version=\"{version}\",binary=\"{binary}\",namespace=\"{ns}\"}}"
        );
        assert!(
            wait_until(WAIT, || metric(port, &info) == Some(1.0)),
            "{binary}: {:?}",
            http_get(port, "/metrics")
        );
        for name in ["process_resident_memory_bytes", "process_open_fds"] {
            assert!(
                metric(port, name).is_some_and(|v| v > 0.0),
                "{binary} {name}"
            );
        }
        assert!(metric(port, "process_cpu_seconds_total").is_some_and(|v| v >= 0.0));
    }
    // The beat reads each queue's consumers and depth from the broker.
    let consumers = || metric(beat_port, "drumline_queue_consumers{queue=\"default\"}");
    assert!(
        wait_until(WAIT, || consumers() == Some(1.0)),
        "{:?}\n{}",
        consumers(),
        beat.log_tail(20)
    );
    assert_eq!(
        metric(beat_port, "drumline_queue_depth{queue=\"default\"}"),
        Some(0.0)
    );
    worker.terminate(Duration::from_secs(10));
    beat.terminate(Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread")]
async fn workers_announce_themselves_and_status_shows_them_with_the_queues() {
    let env = setup("e2e_op_workers");
    let cfg = Cfg::new().set("worker", "concurrency", "3");
    let cfg = env.config_file(&cfg.task("t", shell("true")));
    let mut worker = env.worker_on("worker", &cfg);
    let status = || env.status_json(&cfg);
    let announced = |s: &serde_json::Value| {
        s["workers"].as_array().is_some_and(|w| w.len() == 1) && s["queues"][0]["consumers"] == 1
    };
    expect(WAIT, &[&worker], "the worker announced", || {
        announced(&status())
    });
    let s = status();
    let w = &s["workers"][0];
    assert_eq!(w["pid"], worker.pid(), "{s}");
    assert_eq!(w["concurrency"], 3, "{s}");
    assert_eq!(w["queues"], serde_json::json!(["default"]), "{s}");
    assert_eq!(w["version"], env!("CARGO_PKG_VERSION"), "{s}");
    assert_eq!(s["queues"][0]["queue"], "default", "{s}");
    assert_eq!(s["queues"][0]["depth"], 0, "{s}");
    // The announcement is a hash with a TTL.
    let key = format!("{}:worker:{}", env.ns, w["id"].as_str().unwrap());
    let ttl = env.pttl(&key).await;
    assert!(ttl > 0, "{key}: {ttl}");
    let (code, text, _) = env.run("drumline", &["--config", &cfg, "status"]);
    assert!(code.success());
    assert!(text.contains("workers: 1"), "{text}");
    // A clean stop takes the announcement away.
    stop(&mut [&mut worker]);
    let s = status();
    assert_eq!(s["workers"], serde_json::json!([]), "{s}");
}
