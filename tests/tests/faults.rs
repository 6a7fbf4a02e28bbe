//! Faults that must not break the promise: Redis going away makes workers fail closed (nothing
//! runs without its claim) and resume by themselves when it is back. Uses a private
//! `redis-server` on a free port, never the shared one.

use drumline_e2e::cfg::{every, Cfg};
use drumline_e2e::scenario::{appends, stop, Scenario};
use drumline_e2e::snoop::Snoop;
use drumline_e2e::{
    adhoc, assert_contiguous_exactly_once, http_get, metric, toml_string, wait_until, TestEnv,
};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

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

/// The worker's `/healthz` answer: (status, body).
fn healthz(port: u16) -> Option<(u16, String)> {
    http_get(port, "/healthz")
}

/// Task `append` appends its key to `effects`, with Redis at `url` (lease 3 s).
fn appending_on_redis(env: &TestEnv, url: &str) -> Cfg {
    let cfg = Cfg::new()
        .set("redis", "url", &toml_string(url))
        .set("worker", "lease", "\"3s\"");
    cfg.task("append", appends(env, "effects"))
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_outage_fails_closed_and_resumes() {
    let port = free_port();
    let mut redis = PrivateRedis::start(port);
    let url = format!("redis://127.0.0.1:{}/0", redis.port);
    let mut sc = Scenario::new("e2e_redis_down", |env| appending_on_redis(env, &url));
    let metrics = sc.start_metered_worker().await;
    sc.publish(&adhoc("k-before", "append")).await;
    sc.wait(WAIT, "k-before ran", || sc.lines("effects").len() == 1);
    assert_eq!(healthz(metrics).map(|r| r.0), Some(200));
    // The task writes its effect before the worker records `done`: wait for the record, or the
    // outage below would erase an unrecorded success (this Redis keeps nothing on disk).
    let succeeded = || metric(metrics, "drumline_worker_succeeded_total");
    sc.wait(WAIT, "k-before recorded", || succeeded() == Some(1.0));
    redis.stop();
    // The health check reports the outage even before any delivery hits it.
    let outage = |(code, body): (u16, String)| code == 503 && body.contains("redis unreachable");
    let reported = wait_until(WAIT, || healthz(metrics).is_some_and(outage));
    assert!(reported, "{:?}", healthz(metrics));
    sc.publish(&adhoc("k-during", "append")).await;
    // While Redis is gone nothing may run: watch for a while (no claim, no run).
    let only_before = || sc.lines("effects") == ["k-before"];
    sc.hold(Duration::from_secs(4), "ran without its claim", only_before);
    let what = "the worker waits for Redis, it does not die";
    assert!(sc.workers[0].is_running(), "{what}");
    let _redis = PrivateRedis::start(port);
    sc.wait(WAIT, "did not resume", || sc.lines("effects").len() == 2);
    let healthy = || healthz(metrics).map(|r| r.0) == Some(200);
    sc.wait(WAIT, "not healthy", healthy);
    // The effect is written by the task before the worker records `done` and counts it.
    let counted = wait_until(WAIT, || succeeded() == Some(2.0));
    let (_, exposition) = http_get(metrics, "/metrics").unwrap();
    assert!(counted, "{exposition}");
    let up = exposition.contains("drumline_worker_redis_up 1");
    assert!(up, "{exposition}");
    sc.stop();
    assert_eq!(sc.lines("effects"), vec!["k-before", "k-during"]);
    let queue = sc.names().work_queue("default");
    assert_eq!(sc.queue_len(&queue).await, Some(0));
}

/// Job `tick` (every second, `catch_up`, `queue`) appends its key to `effects`, on the broker
/// at `url`.
fn catching_up_on(env: &TestEnv, url: &str) -> Cfg {
    let tick = every("1s")
        .with("task", "\"append\"")
        .with("misfire", "\"catch_up\"")
        .with("overlap", "\"queue\"");
    let cfg = Cfg::new()
        .set("broker", "url", &toml_string(url))
        .set("worker", "lease", "\"3s\"");
    cfg.job("tick", tick)
        .task("append", appends(env, "effects"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_restart_loses_nothing_and_doubles_nothing() {
    let mut rabbit = drumline_e2e::PrivateRabbit::start("restart");
    let url = rabbit.url();
    let mut sc = Scenario::new("e2e_broker_restart", |env| catching_up_on(env, &url));
    // On the private broker: the kit's topology wait asks the shared one, so start by hand.
    let workers = ["w1", "w2"].map(|label| sc.worker_on(label, sc.cfg()));
    sc.workers.extend(workers);
    // Records what the beat publishes on the private broker, across its restart.
    let snoop = Snoop::start_at(&mut sc, &rabbit.url(), "default");
    sc.start_beat();
    sc.wait(WAIT, "four runs", || sc.lines("effects").len() >= 4);
    rabbit.restart();
    let before = sc.lines("effects").len();
    let what = "no progress after the broker restart";
    let four_more = || sc.lines("effects").len() >= before + 4;
    sc.wait(Duration::from_secs(90), what, four_more);
    stop(&mut [sc.last_beat()]);
    let mut unique = snoop.published_keys();
    unique.sort();
    unique.dedup();
    let all_ran = wait_until(WAIT, || sc.lines("effects").len() >= unique.len());
    let ran = sc.lines("effects").len();
    assert!(all_ran, "published {} instances, ran {ran}", unique.len());
    sc.stop();
    // Exactly once, and with catch_up nothing in the outage window is lost.
    let mut lines = sc.lines("effects");
    assert_contiguous_exactly_once(&lines, before + 4);
    lines.sort();
    assert_eq!(lines, unique, "every published instance ran, nothing else");
}
