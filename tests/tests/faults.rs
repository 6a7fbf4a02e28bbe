//! Faults that must not break the promise: Redis going away makes workers fail closed (nothing
//! runs without its claim) and resume by themselves when it is back. Uses a private
//! `redis-server` on a free port, never the shared one.

use chrono::Utc;
use drumline_e2e::snoop::Snoop;
use drumline_e2e::{adhoc, http_get, metric, setup, toml_string, unused_port, wait_until};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);

struct PrivateRedis {
    port: u16,
    child: Child,
}

impl PrivateRedis {
    fn start(port: u16) -> Self {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (scripts/services installs it)");
        let up = wait_until(Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        assert!(up, "private redis-server on {port} did not start");
        Self { port, child }
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_outage_fails_closed_and_resumes() {
    let env = setup("e2e_redis_down");
    let port = free_port();
    let mut redis = PrivateRedis::start(port);
    let cfg = env.config(
        "drumline.toml",
        &format!(
            "[redis]\nurl = {}\n[worker]\nlease = \"3s\"\n[tasks.append]\ncommand = {}\n",
            toml_string(&format!("redis://127.0.0.1:{}/0", redis.port)),
            env.append_key_command("effects", 0.0)
        ),
    );
    let metrics = unused_port();
    let metrics_addr = format!("127.0.0.1:{metrics}");
    let mut worker = env.worker(
        "worker",
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--metrics-addr",
            &metrics_addr,
        ],
    );
    env.wait_for_topology(&worker).await;
    env.publish(&adhoc("k-before", "append")).await;
    assert!(
        wait_until(WAIT, || env.lines("effects").len() == 1),
        "{}",
        worker.log_tail(20)
    );
    assert_eq!(http_get(metrics, "/healthz").map(|r| r.0), Some(200));
    // The task writes its effect before the worker records `done`: wait for the record, or the
    // outage below would erase an unrecorded success (this Redis keeps nothing on disk).
    assert!(wait_until(WAIT, || metric(
        metrics,
        "drumline_worker_succeeded_total"
    ) == Some(1.0)));

    redis.stop();
    // The health check reports the outage even before any delivery hits it.
    assert!(
        wait_until(WAIT, || http_get(metrics, "/healthz").is_some_and(
            |(code, body)| code == 503 && body.contains("redis unreachable")
        )),
        "{:?}",
        http_get(metrics, "/healthz")
    );
    env.publish(&adhoc("k-during", "append")).await;
    // While Redis is gone nothing may run: watch for a while (no claim, no run).
    let watch_until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < watch_until {
        assert_eq!(
            env.lines("effects"),
            vec!["k-before"],
            "ran without its claim"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        worker.is_running(),
        "the worker waits for Redis, it does not die"
    );

    let _redis = PrivateRedis::start(port);
    assert!(
        wait_until(WAIT, || env.lines("effects").len() == 2),
        "did not resume\n{}",
        worker.log_tail(30)
    );
    assert!(wait_until(WAIT, || http_get(metrics, "/healthz")
        .map(|r| r.0)
        == Some(200)));
    // The effect is written by the task before the worker records `done` and counts it.
    let counted = wait_until(WAIT, || {
        http_get(metrics, "/metrics")
            .is_some_and(|(_, body)| body.contains("drumline_worker_succeeded_total 2"))
    });
    let (_, exposition) = http_get(metrics, "/metrics").unwrap();
    assert!(counted, "{exposition}");
    assert!(
        exposition.contains("drumline_worker_redis_up 1"),
        "{exposition}"
    );
    assert!(worker.terminate(Duration::from_secs(20)).success());
    assert_eq!(env.lines("effects"), vec!["k-before", "k-during"]);
    assert_eq!(
        env.queue_len(&env.names().work_queue("default")).await,
        Some(0)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_restart_loses_nothing_and_doubles_nothing() {
    let mut env = setup("e2e_broker_restart");
    let mut rabbit = drumline_e2e::PrivateRabbit::start("restart");
    let cfg = env.config(
        "drumline.toml",
        &format!(
            r#"
[broker]
url = {url}
[worker]
lease = "3s"

[[jobs]]
name = "tick"
task = "append"
every = "1s"
misfire = "catch_up"
overlap = "queue"

[tasks.append]
command = {cmd}
"#,
            url = toml_string(&rabbit.url()),
            cmd = env.append_key_command("effects", 0.0)
        ),
    );
    let cfg = cfg.to_str().unwrap();
    let mut workers = [
        env.worker("w1", &["--config", cfg]),
        env.worker("w2", &["--config", cfg]),
    ];
    // Records what the beat publishes on the private broker, across its restart.
    let snoop = Snoop::start_at(&mut env, &rabbit.url(), "default");
    let mut beat = env.beat("beat", &["--config", cfg]);
    assert!(
        wait_until(WAIT, || env.lines("effects").len() >= 4),
        "{}",
        beat.log_tail(20)
    );

    rabbit.restart();
    let before = env.lines("effects").len();
    assert!(
        wait_until(Duration::from_secs(90), || env.lines("effects").len()
            >= before + 4),
        "no progress after the broker restart\n{}\n{}",
        beat.log_tail(20),
        workers[0].log_tail(20)
    );
    assert!(
        beat.terminate(Duration::from_secs(10)).success(),
        "{}",
        beat.log_tail(20)
    );
    let published = snoop.published_keys();
    let mut unique = published.clone();
    unique.sort();
    unique.dedup();
    assert!(
        wait_until(WAIT, || env.lines("effects").len() >= unique.len()),
        "published {} instances, ran {}",
        unique.len(),
        env.lines("effects").len()
    );
    for w in &mut workers {
        assert!(
            w.terminate(Duration::from_secs(20)).success(),
            "{}",
            w.log_tail(20)
        );
    }

    // Exactly once, and with catch_up nothing in the outage window is lost.
    let mut lines = env.lines("effects");
    lines.sort();
    let mut deduped = lines.clone();
    deduped.dedup();
    assert_eq!(lines, deduped, "an instance ran twice");
    assert_eq!(lines, unique, "every published instance ran, nothing else");
    let instants: Vec<chrono::DateTime<Utc>> = lines
        .iter()
        .map(|k| {
            chrono::DateTime::parse_from_rfc3339(k.split_once('@').unwrap().1)
                .unwrap()
                .with_timezone(&Utc)
        })
        .collect();
    for pair in instants.windows(2) {
        assert_eq!(
            (pair[1] - pair[0]).num_seconds(),
            1,
            "gap between {} and {}",
            pair[0],
            pair[1]
        );
    }
}
