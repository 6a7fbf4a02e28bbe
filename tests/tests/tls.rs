//! `rediss://` and `amqps://` (docs/design.md "URLs and TLS"), with a throw-away CA each test makes
//! with `openssl`: a private TLS-only `redis-server`, and `stunnel` in front of the shared
//! RabbitMQ. The server certificates are trusted through `ca_file`; without it (system roots)
//! the connection is refused and nothing runs.

use drumline_e2e::cfg::{every, Cfg};
use drumline_e2e::probe::{expect, expect_async, stop};
use drumline_e2e::snoop::Snoop;
use drumline_e2e::tls::{Certs, CountingForwarder, Stunnel, TlsRedis};
use drumline_e2e::{adhoc, http_get, setup, toml_string, TestEnv};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// A worker's config `name`: `cfg` (its `[broker]` and `[redis]`), a 5 s lease and the
/// append task.
fn config(env: &TestEnv, name: &str, cfg: Cfg) -> String {
    let cfg = cfg.set("worker", "lease", "\"5s\"");
    env.config_named(name, &cfg.task("append", env.appender("effects", 0.0)))
}

/// `cfg` with `[section] url = URL` and `ca_file` the CA of `certs`.
fn trusting(cfg: Cfg, section: &str, url: &str, certs: &Certs) -> Cfg {
    let ca = toml_string(certs.ca.to_str().expect("utf-8 path"));
    cfg.set(section, "url", &toml_string(url))
        .set(section, "ca_file", &ca)
}

/// The worker's `drumline_worker_redis_up` gauge, from /metrics.
fn redis_up(metrics: u16) -> Option<String> {
    let (_, body) = http_get(metrics, "/metrics")?;
    body.lines()
        .find_map(|l| l.strip_prefix("drumline_worker_redis_up "))
        .map(|v| v.trim().to_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn rediss_with_ca_file_runs_a_task_once_with_its_state_in_that_redis() {
    let env = setup("tls_rediss");
    let certs = Certs::generate(&env.path("certs"));
    let redis = TlsRedis::start(&env.dir, &certs);
    let cfg = trusting(Cfg::new(), "redis", &redis.url(), &certs);
    let worker = env.worker_on("worker", &config(&env, "drumline.toml", cfg));
    env.wait_for_topology(&worker).await;

    env.publish(&adhoc("k-rediss", "append")).await;
    let ran = || !env.lines("effects").is_empty();
    expect(WAIT, &[&worker], "the task never ran", ran);
    // `done` is written after the task's effect: wait for it, in the private TLS Redis.
    let state = ["HGET", &env.names().run_key("k-rediss"), "state"];
    let done = || redis.query(&state).as_deref() == Some("done");
    expect(WAIT, &[&worker], "done in the TLS redis", done);
    assert_eq!(env.lines("effects"), vec!["k-rediss"], "ran exactly once");
    let shared = env.run_state("k-rediss").await;
    assert_eq!(
        shared, None,
        "the run state belongs in the TLS redis, not the shared one"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn rediss_without_ca_file_is_refused_and_nothing_runs() {
    let env = setup("tls_untrusted");
    let certs = Certs::generate(&env.path("certs"));
    let redis = TlsRedis::start(&env.dir, &certs);
    // Redis counts only connections whose handshake succeeded; this counts the attempts.
    let forwarder = CountingForwarder::start(redis.tls_port).await;
    // No ca_file: the system roots do not know the throw-away CA.
    let url = format!("rediss://127.0.0.1:{}/0", forwarder.port);
    let cfg = config(&env, "drumline.toml", Cfg::new().redis_url(&url));
    let (mut worker, metrics) = env.worker_serving("worker", &cfg);
    // The queue and the message exist whether or not the worker ever consumes.
    let publish = ["publish", "append", "--key", "k-untrusted"];
    let (code, _, stderr) = env.beat_cmd(&cfg, &publish);
    assert_eq!(code, 0, "publish: {stderr}");
    // The worker keeps trying (with backoff): its TLS handshakes reach the server and fail.
    // (Polled without blocking: the forwarder runs on this test's runtime.)
    let tried = || async { forwarder.accepted() >= 3 };
    expect_async(
        WAIT,
        &[&worker],
        "the worker never tried the TLS redis",
        tried,
    )
    .await;
    assert!(worker.is_running(), "fails closed, does not die");
    assert_eq!(redis_up(metrics).as_deref(), Some("0"));
    assert_eq!(http_get(metrics, "/healthz").map(|r| r.0), Some(503));
    assert!(
        env.lines("effects").is_empty(),
        "ran without a trusted redis"
    );
    let waiting = env.default_queue_len().await;
    assert_eq!(
        waiting,
        Some(1),
        "the message waits for a worker that can claim it"
    );
    assert_eq!(redis.query(&["DBSIZE"]).as_deref(), Some("0"));
}

#[tokio::test(flavor = "multi_thread")]
async fn amqps_with_ca_file_publishes_and_runs_a_task_once() {
    let env = setup("tls_amqps");
    let certs = Certs::generate(&env.path("certs"));
    let stunnel = Stunnel::start(&env.dir, &certs, 5672);
    let trusted = trusting(Cfg::new(), "broker", &stunnel.url(), &certs);
    let cfg = config(&env, "drumline.toml", trusted);
    let untrusted = Cfg::new().broker_url(&stunnel.url());
    let untrusted = config(&env, "untrusted.toml", untrusted);
    let worker = env.worker_ready("worker", &cfg).await;
    let publish =
        |config: &str, key: &str| env.beat_cmd(config, &["publish", "append", "--key", key]);

    // Without ca_file the broker's certificate is not trusted: publish fails, nothing is sent.
    let (code, stdout, stderr) = publish(&untrusted, "k-refused");
    // Exit 1 (the broker cannot be used), not 2 (the config was fine).
    assert_eq!(code, 1, "untrusted publish: {stdout}\n{stderr}");
    assert!(!stdout.contains("published"), "{stdout}\n{stderr}");

    let (code, stdout, stderr) = publish(&cfg, "k-amqps");
    assert_eq!(code, 0, "publish over amqps: {stdout}\n{stderr}");
    let ran = || !env.lines("effects").is_empty();
    expect(WAIT, &[&worker], "the task never ran", ran);
    env.expect_state("k-amqps", "done", &[&worker]).await;
    assert_eq!(env.lines("effects"), vec!["k-amqps"], "ran exactly once");
    assert_eq!(env.run_state("k-refused").await, None);
    assert_eq!(env.default_queue_len().await, Some(0));
}

/// The long-running pair over TLS only: the beat publishes through `amqps://` and keeps its
/// progress in a `rediss://` Redis, the worker consumes and claims through the same; every
/// published instance runs exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn beat_and_worker_over_amqps_and_rediss_run_each_instance_once() {
    let mut env = setup("tls_both");
    let certs = Certs::generate(&env.path("certs"));
    let stunnel = Stunnel::start(&env.dir, &certs, 5672);
    let redis = TlsRedis::start(&env.dir, &certs);
    let cfg = trusting(Cfg::new(), "broker", &stunnel.url(), &certs);
    let cfg = trusting(cfg, "redis", &redis.url(), &certs);
    let cfg = cfg.job("tick", every("1s").task("append"));
    let cfg = config(&env, "drumline.toml", cfg);
    let worker = env.worker_on("worker", &cfg);
    // The stunnel forwards to the shared broker: the snoop records there what the beat
    // published through it.
    let snoop = Snoop::start(&mut env, "default");
    let mut beat = env.beat_on("beat", &cfg);
    let runs = || env.lines("effects").len();
    expect(WAIT, &[&beat, &worker], "too few runs", || runs() >= 3);
    stop(&mut [&mut beat]);
    let published = snoop.published_keys();
    assert!(published.len() >= 3, "{published:?}");
    let all = || runs() >= published.len();
    expect(
        WAIT,
        &[&worker],
        format!("published {published:?}, all run"),
        all,
    );
    let ran = drumline_e2e::counts(&env.lines("effects"));
    assert!(ran.values().all(|&n| n == 1), "ran more than once: {ran:?}");
    let mut published_sorted = published.clone();
    published_sorted.sort();
    assert_eq!(ran.keys().cloned().collect::<Vec<_>>(), published_sorted);
    // The beat's progress and the runs' states are in the TLS Redis.
    let last = redis.query(&["GET", &env.names().beat_last("tick")]);
    assert!(
        last.is_some_and(|l| !l.is_empty()),
        "no beat progress in the TLS redis"
    );
}
