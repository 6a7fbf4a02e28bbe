//! The HTTP executor end to end (docs/design.md#the-http-executor): the real worker calls a
//! webhook receiver started by the test ([`drumline_e2e::hook`]) and the outcome of each answer
//! is read from Redis, the receiver's own records and `{ns}.dead`.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use drumline_e2e::cfg::{Cfg, Keys};
use drumline_e2e::hook::{Hook, Received, Reply};
use drumline_e2e::scenario::Scenario;
use drumline_e2e::{adhoc, setup, toml_string, wait_until_async, TestEnv};
use drumline_shared::envelope::{format_instant, Envelope};
use drumline_worker::handler::{Handler, HandlerError, TaskContext};
use drumline_worker::http::HttpExecutor;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);
/// The receivers' secret key bytes; the worker gets them as `whsec_` + base64.
const SECRET: &[u8] = b"drumline test secret";

/// `[tasks.NAME] http = { url = URL, … }` with small retry delays; `extra` is more of the
/// inline table (`timeout = "1s"`).
fn http_task(url: &str, extra: &str) -> Keys {
    let table = format!("{{ url = {}{extra} }}", toml_string(url));
    Keys::default()
        .with("http", &table)
        .with("max_retries", "3")
        .with("retry_base", "\"100ms\"")
        .with("retry_max", "\"5s\"")
}

/// Publishes an ad-hoc run of `task` with key `key`; returns the envelope as published.
async fn publish(env: &TestEnv, key: &str, task: &str) -> Envelope {
    let envelope = adhoc(key, task);
    env.publish(&envelope).await;
    envelope
}

/// Recomputes the Standard Webhooks signature of a received request, as a receiver would.
fn expected_signature(r: &Received) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(SECRET).unwrap();
    let signed = format!(
        "{}.{}.",
        r.header("webhook-id"),
        r.header("webhook-timestamp")
    );
    mac.update(signed.as_bytes());
    mac.update(&r.body);
    format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()))
}

#[tokio::test(flavor = "multi_thread")]
async fn every_key_is_sent_once_signed_with_its_context() {
    let hook = Hook::start(|_, _| Reply::status(200)).await;
    let extra = ", secret_env = \"HOOK_SECRET\", headers = { X-Tenant = \"acme\" }";
    let cfg = Cfg::new().task("hook", http_task(&hook.url("/ok"), extra));
    let mut sc = Scenario::new("e2e_http_once", |_| cfg);
    let secret = format!("whsec_{}", BASE64.encode(SECRET));
    sc.start_worker_env(&[("HOOK_SECRET", &secret)]).await;
    let mut sent = Vec::new();
    for i in 0..5 {
        let envelope = publish(&sc, &format!("k{i}"), "hook").await;
        // A second copy of the same key: dedupe, not a second request.
        sc.publish(&envelope).await;
        sent.push(envelope);
    }
    for envelope in &sent {
        sc.wait_state(&envelope.key, "done").await;
    }
    let received = hook.on("/ok");
    assert_eq!(received.len(), 5, "{received:#?}");
    for envelope in &sent {
        let mine: Vec<&Received> = received
            .iter()
            .filter(|r| r.key() == envelope.key)
            .collect();
        assert_eq!(mine.len(), 1, "{}: {mine:#?}", envelope.key);
        assert_sent_with_context(mine[0], envelope);
    }
}

/// `r` is a signed POST of `envelope` exactly as delivered, with its context headers and the
/// task's own (`X-Tenant: acme`), stamped within two minutes of now.
fn assert_sent_with_context(r: &Received, envelope: &Envelope) {
    let now = chrono::Utc::now().timestamp();
    assert_eq!(r.method, "POST");
    assert_eq!(r.body, envelope.encode());
    assert_eq!(r.header("content-type"), "application/json");
    assert_eq!(r.header("webhook-id"), envelope.key);
    assert_eq!(r.header("x-drumline-attempt"), "0");
    assert!(r.header("x-drumline-fencing-token").parse::<u64>().unwrap() >= 1);
    let scheduled_for = format_instant(envelope.scheduled_for);
    assert_eq!(r.header("x-drumline-scheduled-for"), scheduled_for);
    assert_eq!(r.header("x-tenant"), "acme");
    let timestamp: i64 = r.header("webhook-timestamp").parse().unwrap();
    assert!((now - timestamp).abs() < 120, "{timestamp} vs {now}");
    assert_eq!(r.header("webhook-signature"), expected_signature(r));
}

/// The `X-Drumline-Attempt` of each request `hook` received on `path`, in order.
fn attempts(hook: &Hook, path: &str) -> Vec<String> {
    let received = hook.on(path);
    let attempt = |r: &Received| r.header("x-drumline-attempt").to_owned();
    received.iter().map(attempt).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn retryable_answers_and_timeouts_are_retried() {
    // Each path fails its first request for a key, then succeeds.
    let hook = Hook::start(|path, before| match (path, before) {
        ("/flaky", 0) => Reply::With(500, vec![], "database is down".into()),
        ("/busy", 0) => Reply::With(429, vec![("Retry-After".into(), "2".into())], String::new()),
        ("/slow", 0) => Reply::Hang(Duration::from_secs(4), 200),
        _ => Reply::status(200),
    })
    .await;
    let cfg = Cfg::new()
        .task("flaky", http_task(&hook.url("/flaky"), ""))
        .task("busy", http_task(&hook.url("/busy"), ""))
        .task("slow", http_task(&hook.url("/slow"), ", timeout = \"1s\""));
    let sc = Scenario::start("e2e_http_retry", 0, 1, |_| cfg).await;
    for task in ["flaky", "busy", "slow"] {
        publish(&sc, &format!("{task}-1"), task).await;
    }
    for task in ["flaky", "busy", "slow"] {
        sc.wait_state(&format!("{task}-1"), "done").await;
        // One failure, one retry, and nothing after the success.
        assert_eq!(attempts(&hook, &format!("/{task}")), ["0", "1"], "{task}");
    }
    // The retry after `429 Retry-After: 2` came no earlier than 2 s after the 429, by the
    // receiver's own clock.
    let busy = hook.on("/busy");
    let gap = busy[1].at - busy[0].at;
    assert!(gap >= Duration::from_secs(2), "retried after {gap:?}");
}

/// `dlq list --json` rows, by key: (key, reason, error).
fn dead_letters(sc: &Scenario) -> Vec<(String, String, String)> {
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
    let row = |r: &serde_json::Value| (text(&r["key"]), text(&r["reason"]), text(&r["error"]));
    sc.dlq_rows().iter().map(row).collect()
}

/// A `302 Found` to `location`, with no body: a path on the same receiver, so a request that
/// followed the redirect would be seen.
fn redirect(location: &str) -> Reply {
    Reply::With(
        302,
        vec![("Location".into(), location.into())],
        String::new(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn other_answers_are_permanent_and_redirects_are_not_followed() {
    let hook = Hook::start(|path, _| match path {
        "/missing" => Reply::With(404, vec![], "no such invoice".into()),
        "/moved" => redirect("/target"),
        _ => Reply::status(200),
    })
    .await;
    let cfg = Cfg::new()
        .task("missing", http_task(&hook.url("/missing"), ""))
        .task("moved", http_task(&hook.url("/moved"), ""));
    let sc = Scenario::start("e2e_http_permanent", 0, 1, |_| cfg).await;
    for (key, task) in [("m-1", "missing"), ("r-1", "moved")] {
        publish(&sc, key, task).await;
        sc.wait_state(key, "dead").await;
    }
    // One request each, and none to the redirect's target.
    let requests = ["/missing", "/moved", "/target"].map(|path| hook.on(path).len());
    assert_eq!(requests, [1, 1, 0]);
    let rows = dead_letters(&sc);
    assert_eq!(rows.len(), 2, "{rows:?}");
    let (key, reason, error) = &rows[0];
    assert_eq!((key.as_str(), reason.as_str()), ("m-1", "permanent"));
    assert!(error.contains("HTTP 404 Not Found"), "{error}");
    // The response's body is kept with the outcome.
    assert!(error.contains("no such invoice"), "{error}");
    let (key, reason, error) = &rows[1];
    assert_eq!((key.as_str(), reason.as_str()), ("r-1", "permanent"));
    assert!(error.contains("HTTP 302 Found"), "{error}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_secret_is_a_config_error_at_start() {
    let env = setup("e2e_http_secret");
    let cfg = env.write_config(
        "drumline.toml",
        &Cfg::new().task(
            "hook",
            http_task("http://127.0.0.1:9/x", ", secret_env = \"NO_SUCH_SECRET\""),
        ),
    );
    let mut worker = env.worker("worker", &["--config", cfg.to_str().unwrap()]);
    let status = worker.wait(Duration::from_secs(30));
    assert_eq!(status.code(), Some(2), "{}", worker.log_tail(20));
    let log = worker.log();
    assert!(
        log.contains("key `http.secret_env`") && log.contains("NO_SUCH_SECRET"),
        "{log}"
    );
}

/// The HTTP executor of task `hook`, which calls `url` with a 60 s timeout, run in the
/// test's own process.
fn executor_calling(url: &str) -> HttpExecutor {
    let http = format!("{{ url = {}, timeout = \"60s\" }}", toml_string(url));
    let cfg = Cfg::new().task("hook", Keys::default().with("http", &http));
    let text = format!("namespace = \"t\"\n{}", cfg.toml());
    let path = std::path::Path::new("drumline.toml");
    let config = drumline_shared::config::Config::parse(&text, path, |_| None).unwrap();
    let executor = HttpExecutor::for_task(&config.tasks["hook"], |_| None).unwrap();
    executor.expect("an HTTP task")
}

/// A first attempt of task `hook` (key `c-1`) that `cancel` cancels.
fn attempt_of_hook(cancel: &CancellationToken) -> TaskContext {
    TaskContext {
        task: "hook".into(),
        key: "c-1".into(),
        job: None,
        scheduled_for: chrono::Utc::now(),
        attempt: 0,
        fencing_token: 1,
        args: serde_json::json!({}),
        cancel: cancel.clone(),
        kill_grace: Duration::from_millis(100),
        trace: drumline_shared::trace::TraceParent::root(),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_run_drops_its_request() {
    let hook = Hook::start(|_, _| Reply::Hang(Duration::from_secs(60), 200)).await;
    let cancel = CancellationToken::new();
    let run = tokio::spawn(executor_calling(&hook.url("/hang")).call(attempt_of_hook(&cancel)));
    assert!(
        wait_until_async(WAIT, || async { hook.on("/hang").len() == 1 }).await,
        "the request never arrived"
    );
    // What the worker does when the lease is lost: the run ends without waiting for the
    // answer (due in 60 s), well within any lease.
    cancel.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(10), run).await;
    let result = ended
        .expect("the request outlived its cancellation")
        .unwrap();
    assert!(
        matches!(&result, Err(HandlerError::Retryable { message, .. }) if message == "cancelled"),
        "{result:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn https_trusts_the_ca_file_and_not_an_unknown_ca() {
    use drumline_e2e::tls::{Certs, Stunnel};
    let mut sc = Scenario::new("e2e_http_tls", |_| Cfg::new());
    let hook = Hook::start(|_, _| Reply::status(200)).await;
    let certs = Certs::generate(&sc.path("certs"));
    let tls = Stunnel::start(&sc.dir, &certs, hook.port);
    let url = format!("https://127.0.0.1:{}/tls", tls.port);
    let ca_file = format!(", ca_file = {}", toml_string(certs.ca.to_str().unwrap()));
    // The system roots do not know the test's CA: the handshake fails, every time.
    let untrusted = Keys::default()
        .with("http", &format!("{{ url = {} }}", toml_string(&url)))
        .with("max_retries", "0");
    let cfg = Cfg::new()
        .task("trusted", http_task(&url, &ca_file))
        .task("untrusted", untrusted);
    sc.rewrite(&cfg);
    sc.start_workers(1).await;
    publish(&sc, "t-1", "trusted").await;
    publish(&sc, "u-1", "untrusted").await;
    sc.wait_state("t-1", "done").await;
    sc.wait_state("u-1", "dead").await;
    let keys: Vec<String> = hook.on("/tls").iter().map(|r| r.key().to_owned()).collect();
    assert_eq!(keys, ["t-1"]);
    let rows = dead_letters(&sc);
    let (key, reason, error) = &rows[0];
    assert_eq!(key, "u-1");
    assert_eq!(reason, "retries_exhausted");
    assert!(error.starts_with("request failed: "), "{error}");
    assert!(!error.contains("/tls"), "the URL is not recorded: {error}");
}
