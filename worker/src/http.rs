//! The HTTP executor (docs/design.md#the-http-executor): `[tasks.NAME] http = { url, … }`
//! sends each run to one configured endpoint and maps the response onto the worker's decision.
//!
//! The body is the envelope exactly as delivered; the headers carry the key
//! (`Idempotency-Key`, `webhook-id`), the attempt, the fencing token and the scheduled instant,
//! and, with `secret_env`, a Standard Webhooks signature ([`sign`]). 2xx is success; 408, 429,
//! 5xx, connection errors and timeouts are retried (a `Retry-After` is honoured up to
//! `retry_max`); any other status, 3xx included, is permanent ([`outcome`]). Redirects are never
//! followed and no proxy is used, so only the configured URL is ever called. A cancelled run
//! (lease lost, shutdown) drops the request at once.

use crate::decision::ERROR_KEPT;
use crate::handler::{Handler, HandlerError, HandlerFuture, TaskContext};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use chrono::{DateTime, Utc};
use drumline_shared::config::Task;
use drumline_shared::envelope::format_instant;
use hmac::{Hmac, Mac};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use reqwest::{Method, StatusCode, Url};
use sha2::Sha256;
use std::sync::Arc;
use std::time::Duration;

/// How much of a response body is kept with a failed run's outcome.
pub const BODY_KEPT: usize = 4096;

tokio::task_local! {
    /// The delivery's body while a handler's future is created (see [`with_delivered`]).
    static DELIVERED: Arc<[u8]>;
}

/// Creates a run's future with `body` (the delivery as received) at hand: [`TaskContext`]
/// carries the decoded envelope, and the HTTP executor sends the bytes as delivered, unknown
/// fields included (docs/design.md#the-http-executor).
pub(crate) fn with_delivered<R>(body: Arc<[u8]>, create: impl FnOnce() -> R) -> R {
    DELIVERED.sync_scope(body, create)
}

/// An `http` task's endpoint cannot be used: a config error found at worker start.
#[derive(Debug, thiserror::Error)]
pub enum HttpSetupError {
    /// `secret_env` names a variable the worker's environment does not have.
    #[error("task {task:?}: key `http.secret_env`: the variable {var} is not set")]
    SecretMissing {
        /// The task.
        task: String,
        /// The variable.
        var: String,
    },
    /// The variable does not hold `whsec_` + base64.
    #[error("task {task:?}: key `http.secret_env`: {var} does not hold a secret of the form whsec_<base64>")]
    SecretMalformed {
        /// The task.
        task: String,
        /// The variable.
        var: String,
    },
    /// The URL, a header or the CA file was refused by the HTTP client.
    #[error("task {task:?}: key `http`: {message}")]
    Client {
        /// The task.
        task: String,
        /// What was refused.
        message: String,
    },
}

/// Runs a `[tasks.*] http` task. Cheap to clone (one client per task).
#[derive(Clone)]
pub struct HttpExecutor {
    inner: Arc<Inner>,
}

struct Inner {
    client: reqwest::Client,
    url: Url,
    method: Method,
    headers: HeaderMap,
    /// The request's deadline: `http.timeout`, or the task's `timeout` when shorter.
    timeout: Duration,
    /// The decoded Standard Webhooks secret.
    secret: Option<Vec<u8>>,
}

impl std::fmt::Debug for HttpExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret.
        f.debug_struct("HttpExecutor")
            .field("url", &self.inner.url.as_str())
            .field("method", &self.inner.method)
            .field("signed", &self.inner.secret.is_some())
            .finish()
    }
}

impl HttpExecutor {
    /// The executor for `task`, `None` when it has no `http`; `env` reads the worker's
    /// environment (for the secret).
    pub fn for_task(
        task: &Task,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, HttpSetupError> {
        let Some(http) = &task.http else {
            return Ok(None);
        };
        let refused = |message: String| HttpSetupError::Client {
            task: task.name.clone(),
            message,
        };
        let secret = match &http.secret_env {
            None => None,
            Some(var) => {
                let text = env(var).ok_or_else(|| HttpSetupError::SecretMissing {
                    task: task.name.clone(),
                    var: var.clone(),
                })?;
                Some(
                    decode_secret(&text).ok_or_else(|| HttpSetupError::SecretMalformed {
                        task: task.name.clone(),
                        var: var.clone(),
                    })?,
                )
            }
        };
        let mut headers = HeaderMap::new();
        for (name, value) in &http.headers {
            let name =
                HeaderName::from_bytes(name.as_bytes()).map_err(|e| refused(e.to_string()))?;
            let value = HeaderValue::from_str(value).map_err(|e| refused(e.to_string()))?;
            headers.insert(name, value);
        }
        let inner = Inner {
            client: client(http.ca_file.as_deref()).map_err(refused)?,
            url: Url::parse(&http.url).map_err(|e| refused(format!("url: {e}")))?,
            method: Method::from_bytes(http.method.as_bytes())
                .map_err(|e| refused(format!("method: {e}")))?,
            headers,
            timeout: task.timeout.map_or(http.timeout, |t| t.min(http.timeout)),
            secret,
        };
        Ok(Some(Self {
            inner: Arc::new(inner),
        }))
    }
}

/// The task's client: no redirects, no proxy, the system roots or `ca_file` alone.
fn client(ca_file: Option<&std::path::Path>) -> Result<reqwest::Client, String> {
    let mut builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .user_agent(concat!("drumline/", env!("CARGO_PKG_VERSION")));
    if let Some(path) = ca_file {
        let ca = drumline_shared::tls::read_ca_file(path).map_err(|e| e.to_string())?;
        builder = builder.tls_built_in_root_certs(false);
        for cert in
            reqwest::Certificate::from_pem_bundle(&ca.pem).map_err(|e| format!("ca_file: {e}"))?
        {
            builder = builder.add_root_certificate(cert);
        }
    }
    builder.build().map_err(|e| e.to_string())
}

impl Inner {
    /// The request of one run: the configured URL and headers, plus the run's own.
    fn request(
        &self,
        ctx: &TaskContext,
        body: Arc<[u8]>,
    ) -> Result<reqwest::Request, HandlerError> {
        let timestamp = Utc::now().timestamp();
        let mut headers = self.headers.clone();
        let pairs = run_headers(ctx, &body, timestamp, self.secret.as_deref());
        for (name, value) in pairs {
            let value = HeaderValue::from_str(&value).map_err(|e| {
                HandlerError::permanent(format!("cannot send {name} as a header")).because(e)
            })?;
            headers.insert(name, value);
        }
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        self.client
            .request(self.method.clone(), self.url.clone())
            .headers(headers)
            .timeout(self.timeout)
            .body(body.to_vec())
            .build()
            .map_err(|e| {
                HandlerError::permanent("cannot build the request").because(e.without_url())
            })
    }

    async fn run(self: Arc<Self>, ctx: TaskContext, body: Arc<[u8]>) -> Result<(), HandlerError> {
        let request = self.request(&ctx, body)?;
        let exchange = async {
            let response = self.client.execute(request).await?;
            let status = response.status();
            let retry_after = response
                .headers()
                .get(RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            // A success's body is not kept: nothing records it.
            let head = if status.is_success() {
                Vec::new()
            } else {
                body_head(response).await
            };
            Ok::<_, reqwest::Error>((status, retry_after, head))
        };
        let timeout = self.timeout;
        let ended = tokio::select! {
            ended = tokio::time::timeout(timeout, exchange) => ended,
            // Dropping the exchange aborts the request (docs/design.md "Lease loss stops the
            // run in time").
            () = ctx.cancel.cancelled() => return Err(HandlerError::retryable("cancelled")),
        };
        match ended {
            Err(_) => Err(timed_out(timeout)),
            Ok(Err(e)) if e.is_timeout() => Err(timed_out(timeout)),
            // Without the URL: a query string may hold a token, and the error is recorded.
            Ok(Err(e)) => Err(HandlerError::retryable("request failed").because(e.without_url())),
            Ok(Ok((status, retry_after, head))) => {
                outcome(status.as_u16(), retry_after.as_deref(), &head, Utc::now())
            }
        }
    }
}

fn timed_out(timeout: Duration) -> HandlerError {
    HandlerError::retryable(format!(
        "no response within {}",
        humantime::format_duration(timeout)
    ))
}

/// The first [`BODY_KEPT`] bytes of a response's body; a body that breaks off keeps what came.
async fn body_head(mut response: reqwest::Response) -> Vec<u8> {
    let mut head = Vec::new();
    while head.len() < BODY_KEPT {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = BODY_KEPT - head.len();
                head.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(None) | Err(_) => break,
        }
    }
    head
}

/// The headers a run adds to the configured ones (docs/design.md#the-http-executor): the key
/// twice (`Idempotency-Key`, `webhook-id`), the attempt, the fencing token, the scheduled
/// instant, the run's `traceparent`, `webhook-timestamp` and, with a secret,
/// `webhook-signature`.
pub fn run_headers(
    ctx: &TaskContext,
    body: &[u8],
    timestamp: i64,
    secret: Option<&[u8]>,
) -> Vec<(&'static str, String)> {
    let mut headers = vec![
        ("idempotency-key", ctx.key.clone()),
        ("x-drumline-attempt", ctx.attempt.to_string()),
        ("x-drumline-fencing-token", ctx.fencing_token.to_string()),
        (
            "x-drumline-scheduled-for",
            format_instant(ctx.scheduled_for),
        ),
        ("traceparent", ctx.trace.to_string()),
        ("webhook-id", ctx.key.clone()),
        ("webhook-timestamp", timestamp.to_string()),
    ];
    if let Some(secret) = secret {
        headers.push(("webhook-signature", sign(secret, &ctx.key, timestamp, body)));
    }
    headers
}

/// The Standard Webhooks signature: `v1,` + base64 of HMAC-SHA256 over
/// `{id}.{timestamp}.{body}`, keyed by the decoded secret.
pub fn sign(secret: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()))
}

/// The key bytes of a Standard Webhooks secret `whsec_<base64>`; `None` when it is not one
/// (or decodes to nothing).
pub fn decode_secret(text: &str) -> Option<Vec<u8>> {
    let key = BASE64.decode(text.trim().strip_prefix("whsec_")?).ok()?;
    (!key.is_empty()).then_some(key)
}

/// `Retry-After` (RFC 9110): whole seconds, or an HTTP date (IMF-fixdate) judged against
/// `now` (a date in the past: no wait). `None` when it is neither.
pub fn retry_after(value: &str, now: DateTime<Utc>) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = DateTime::parse_from_rfc2822(value).ok()?;
    Some(
        (at.with_timezone(&Utc) - now)
            .to_std()
            .unwrap_or(Duration::ZERO),
    )
}

/// A response's outcome (docs/design.md#the-http-executor): 2xx succeeded; 408, 429 and 5xx
/// are retried, after `Retry-After` when given (the decision caps it at `retry_max`); every
/// other status, redirects included, is permanent. The error carries the status and the start
/// of the body (`head`).
pub fn outcome(
    status: u16,
    retry_after_header: Option<&str>,
    head: &[u8],
    now: DateTime<Utc>,
) -> Result<(), HandlerError> {
    if (200..300).contains(&status) {
        return Ok(());
    }
    let reason = StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("");
    let message = format!("HTTP {status} {reason}").trim_end().to_owned();
    let retryable = matches!(status, 408 | 429 | 500..=599);
    let error = match (
        retryable,
        retry_after_header.and_then(|v| retry_after(v, now)),
    ) {
        (true, Some(after)) => HandlerError::retry_after(message, after),
        (true, None) => HandlerError::retryable(message),
        (false, _) => HandlerError::permanent(message),
    };
    if head.is_empty() {
        return Err(error);
    }
    // The start is what says what failed (the exception, the error object): kept whole, its end
    // cut so that the whole report fits what is recorded.
    let room = ERROR_KEPT.saturating_sub(error.report().len() + ": response: …".len());
    let mut body = String::from_utf8_lossy(head).into_owned();
    if body.len() > room {
        let mut end = room;
        while !body.is_char_boundary(end) {
            end -= 1;
        }
        body.truncate(end);
        body.push('…');
    }
    Err(error.because(ResponseBody(body)))
}

/// The start of a failed response's body, kept as the cause of its error.
#[derive(Debug, thiserror::Error)]
#[error("response: {0}")]
pub struct ResponseBody(pub String);

impl Handler for HttpExecutor {
    fn call(&self, ctx: TaskContext) -> HandlerFuture {
        // Outside a delivery (a handler called directly), the body is the context as JSON.
        let body = DELIVERED
            .try_with(Arc::clone)
            .unwrap_or_else(|_| context_body(&ctx));
        Box::pin(self.inner.clone().run(ctx, body))
    }
}

/// A body for a run that did not come from a delivery: the context's fields as JSON.
fn context_body(ctx: &TaskContext) -> Arc<[u8]> {
    let value = serde_json::json!({
        "key": ctx.key,
        "task": ctx.task,
        "job": ctx.job,
        "args": ctx.args,
        "scheduled_for": format_instant(ctx.scheduled_for),
        "attempt": ctx.attempt,
    });
    serde_json::to_vec(&value).unwrap_or_default().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 3, 8, 7, 30, 0).unwrap()
    }

    fn kind(r: Result<(), HandlerError>) -> String {
        match r {
            Ok(()) => "ok".into(),
            Err(HandlerError::Permanent { .. }) => "permanent".into(),
            Err(HandlerError::Retryable { after: None, .. }) => "retry".into(),
            Err(HandlerError::Retryable { after: Some(d), .. }) => format!("retry {d:?}"),
        }
    }

    #[test]
    fn statuses_map_onto_the_decision() {
        let at = |status| kind(outcome(status, None, b"", now()));
        for ok in [200, 201, 204, 299] {
            assert_eq!(at(ok), "ok", "{ok}");
        }
        for retry in [408, 429, 500, 502, 503, 599] {
            assert_eq!(at(retry), "retry", "{retry}");
        }
        for permanent in [301, 302, 304, 307, 400, 401, 404, 409, 422, 100, 600] {
            assert_eq!(at(permanent), "permanent", "{permanent}");
        }
    }

    #[test]
    fn retry_after_is_honoured_only_where_a_retry_follows() {
        let with = |status, ra| kind(outcome(status, Some(ra), b"", now()));
        assert_eq!(with(429, "2"), "retry 2s");
        assert_eq!(with(503, "Sun, 08 Mar 2026 07:31:00 GMT"), "retry 60s");
        assert_eq!(with(500, "soon"), "retry");
        assert_eq!(with(404, "2"), "permanent");
    }

    #[test]
    fn retry_after_takes_seconds_and_http_dates() {
        assert_eq!(retry_after("120", now()), Some(Duration::from_secs(120)));
        assert_eq!(retry_after(" 0 ", now()), Some(Duration::ZERO));
        assert_eq!(
            retry_after("Sun, 08 Mar 2026 07:30:05 GMT", now()),
            Some(Duration::from_secs(5))
        );
        // A date in the past: no wait.
        assert_eq!(
            retry_after("Sun, 08 Mar 2026 07:00:00 GMT", now()),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after("-1", now()), None);
        assert_eq!(retry_after("later", now()), None);
    }

    #[test]
    fn a_long_failed_body_keeps_its_start_within_what_is_recorded() {
        use crate::decision::{bounded, ERROR_KEPT};
        let body = format!(
            "Traceback: ValueError: bad customer\n{}",
            "frame\n".repeat(2000)
        );
        let now = Utc::now();
        let error = outcome(500, None, body.as_bytes(), now).expect_err("a failure");
        let recorded = bounded(error.report(), ERROR_KEPT);
        let expected =
            "HTTP 500 Internal Server Error: response: Traceback: ValueError: bad customer";
        assert!(recorded.starts_with(expected), "{}", &recorded[..200]);
        assert!(recorded.len() <= ERROR_KEPT && recorded.ends_with('…'));
        let kept = &recorded["HTTP 500 Internal Server Error: response: ".len()..];
        let kept = kept.trim_end_matches('…');
        assert!(
            body.starts_with(kept) && kept.len() > 3_000,
            "{} bytes kept",
            kept.len()
        );
    }

    #[test]
    fn a_failure_carries_the_status_and_the_body() {
        let e = outcome(404, None, b"no such invoice", now()).unwrap_err();
        assert_eq!(e.report(), "HTTP 404 Not Found: response: no such invoice");
        let e = outcome(599, None, b"", now()).unwrap_err();
        assert_eq!(e.report(), "HTTP 599");
    }

    #[test]
    fn the_signature_is_the_standard_webhooks_one() {
        // The Standard Webhooks spec's example (standard-webhooks/libraries test vectors).
        let secret = decode_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let id = "msg_p5jXN8AQM9LWM0D4loKWxJek";
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            sign(&secret, id, 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn secrets_need_the_prefix_and_base64() {
        assert_eq!(decode_secret("whsec_aGk="), Some(b"hi".to_vec()));
        assert_eq!(decode_secret("aGk="), None);
        assert_eq!(decode_secret("whsec_!!"), None);
        assert_eq!(decode_secret("whsec_"), None);
    }

    #[test]
    fn a_run_sends_its_context_and_signs_only_with_a_secret() {
        let ctx = TaskContext {
            task: "t".into(),
            key: "j@2026-03-08T07:30:00Z".into(),
            job: Some("j".into()),
            scheduled_for: now(),
            attempt: 2,
            fencing_token: 41,
            args: serde_json::Value::Null,
            cancel: Default::default(),
            kill_grace: Duration::ZERO,
            trace: drumline_shared::trace::TraceParent::root(),
        };
        let unsigned = run_headers(&ctx, b"{}", 1_700_000_000, None);
        let get = |hs: &[(&str, String)], n: &str| {
            hs.iter().find(|(k, _)| *k == n).map(|(_, v)| v.clone())
        };
        assert_eq!(get(&unsigned, "idempotency-key").unwrap(), ctx.key);
        assert_eq!(get(&unsigned, "webhook-id").unwrap(), ctx.key);
        assert_eq!(get(&unsigned, "x-drumline-attempt").unwrap(), "2");
        assert_eq!(get(&unsigned, "x-drumline-fencing-token").unwrap(), "41");
        assert_eq!(
            get(&unsigned, "x-drumline-scheduled-for").unwrap(),
            "2026-03-08T07:30:00Z"
        );
        assert_eq!(get(&unsigned, "webhook-timestamp").unwrap(), "1700000000");
        assert_eq!(get(&unsigned, "webhook-signature"), None);
        let signed = run_headers(&ctx, b"{}", 1_700_000_000, Some(b"k"));
        assert_eq!(
            get(&signed, "webhook-signature").unwrap(),
            sign(b"k", &ctx.key, 1_700_000_000, b"{}")
        );
    }
}
