//! What a task handler sees and returns (docs/design.md#typed-rust-handlers). The error type
//! maps one-to-one onto the worker's decision: [`HandlerError::Retryable`] → retry after a
//! delay, the task's backoff or the one the handler asks for (or dead-letter once retries are
//! exhausted), [`HandlerError::Permanent`] → dead-letter now; `Ok` → done. Either keeps the
//! error that caused it as its `source`.
//!
//! A typed handler ([`typed`], [`Worker::typed_handler`](crate::Worker::typed_handler)) gets
//! its `args` decoded into its own type: a message whose `args` do not decode is dead-lettered
//! `permanent` with serde's error, naming the field. Every Rust handler runs under the task's
//! `timeout`, and a panic is caught: counted (`drumline_worker_panics_total`), retried like a
//! retryable error, and the worker keeps running.
//!
//! ```
//! use drumline_worker::handler::{typed, Handler, HandlerError, TaskContext};
//! use serde::Deserialize;
//! use std::time::Duration;
//!
//! #[derive(Deserialize)]
//! struct Resize {
//!     image: String,
//!     width: u32,
//! }
//!
//! let handler = typed(|args: Resize, ctx: TaskContext| async move {
//!     if args.width > 10_000 {
//!         return Err(HandlerError::permanent(format!("{} is too wide", args.image)));
//!     }
//!     if ctx.attempt == 0 {
//!         return Err(HandlerError::retry_after("the thumbnailer is warming up", Duration::from_secs(2)));
//!     }
//!     Ok(())
//! });
//! # let _: &dyn Handler = &handler;
//! ```

use chrono::{DateTime, Utc};
use futures_util::FutureExt;
use serde::de::DeserializeOwned;
use std::future::Future;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Everything a handler needs to run one instance.
#[derive(Debug, Clone)]
pub struct TaskContext {
    /// Task name.
    pub task: String,
    /// Idempotency key of the instance.
    pub key: String,
    /// Job name; `None` for ad-hoc tasks.
    pub job: Option<String>,
    /// The instant the instance is due.
    pub scheduled_for: DateTime<Utc>,
    /// 0 for the first run.
    pub attempt: u32,
    /// Fencing token of this claim; pass it to the systems you write so that a stale holder's
    /// late write can be rejected.
    pub fencing_token: u64,
    /// The envelope's `args`.
    pub args: serde_json::Value,
    /// Fires when the run must stop: lease lost, timeout, or shutdown grace exhausted. A
    /// cancelled run's result is not recorded. Once it fires, the worker drops the handler's
    /// future shortly before the lease could expire (docs/design.md "Lease loss stops the run in
    /// time"), so a handler that ignores it is stopped anyway at its next `.await`.
    pub cancel: CancellationToken,
    /// How long a handler may take to stop once `cancel` fires: the shell executor's wait
    /// between SIGTERM and SIGKILL. The worker derives it from the lease (at most
    /// `KILL_GRACE` in `lease.rs`), so the task is dead before anyone else
    /// could claim the instance.
    pub kill_grace: Duration,
    /// The run's span (docs/envelope.md#trace-context): a child of the message's
    /// `traceparent`, or the root of a new trace when it had none. Pass it on (`to_string()`
    /// is a `traceparent`) so the systems the handler calls join the trace.
    pub trace: drumline_shared::trace::TraceParent,
}

/// The error a run failure was caused by, shared so a [`HandlerError`] stays `Clone`.
pub type ErrorSource = Arc<dyn std::error::Error + Send + Sync>;

/// How a run failed.
///
/// ```
/// use drumline_worker::HandlerError;
/// use std::time::Duration;
///
/// let io = std::io::Error::other("connection reset");
/// let e = HandlerError::retryable("cannot reach the ledger").because(io);
/// assert_eq!(e.report(), "cannot reach the ledger: connection reset");
/// let later = HandlerError::retry_after("rate limited", Duration::from_secs(30));
/// assert!(matches!(later, HandlerError::Retryable { after: Some(_), .. }));
/// ```
#[derive(Debug, Clone, thiserror::Error)]
pub enum HandlerError {
    /// Try again later, up to the task's `max_retries`: after the task's backoff, or after
    /// `after` when the handler asks for it (at most `retry_max`).
    #[error("{message}")]
    Retryable {
        /// What went wrong.
        message: String,
        /// The delay the handler asks for; `None`: the task's backoff.
        after: Option<Duration>,
        /// The error that caused it.
        #[source]
        source: Option<ErrorSource>,
    },
    /// Do not try again: dead-letter now.
    #[error("permanent: {message}")]
    Permanent {
        /// What went wrong.
        message: String,
        /// The error that caused it.
        #[source]
        source: Option<ErrorSource>,
    },
}

impl HandlerError {
    /// A failure retried after the task's backoff.
    pub fn retryable(message: impl Into<String>) -> Self {
        HandlerError::Retryable {
            message: message.into(),
            after: None,
            source: None,
        }
    }

    /// A failure retried after `after` (at most the task's `retry_max`), not the backoff.
    pub fn retry_after(message: impl Into<String>, after: Duration) -> Self {
        HandlerError::Retryable {
            message: message.into(),
            after: Some(after),
            source: None,
        }
    }

    /// A failure that is not retried.
    pub fn permanent(message: impl Into<String>) -> Self {
        HandlerError::Permanent {
            message: message.into(),
            source: None,
        }
    }

    /// The same failure, caused by `source`.
    pub fn because(self, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        let cause: Option<ErrorSource> = Some(Arc::new(cause));
        match self {
            HandlerError::Retryable { message, after, .. } => HandlerError::Retryable {
                message,
                after,
                source: cause,
            },
            HandlerError::Permanent { message, .. } => HandlerError::Permanent {
                message,
                source: cause,
            },
        }
    }

    /// What went wrong, without the causes.
    pub fn message(&self) -> &str {
        match self {
            HandlerError::Retryable { message, .. } | HandlerError::Permanent { message, .. } => {
                message
            }
        }
    }

    /// The message and every cause after it, `: `-separated: what is recorded with the run
    /// and carried by a dead letter.
    pub fn report(&self) -> String {
        let mut out = self.message().to_owned();
        let mut cause = std::error::Error::source(self);
        while let Some(e) = cause {
            out.push_str(": ");
            out.push_str(&e.to_string());
            cause = e.source();
        }
        out
    }
}

/// Equal when of the same kind with the same message, delay and causes (as text).
impl PartialEq for HandlerError {
    fn eq(&self, other: &Self) -> bool {
        let after = |e: &HandlerError| match e {
            HandlerError::Retryable { after, .. } => (true, *after),
            HandlerError::Permanent { .. } => (false, None),
        };
        after(self) == after(other) && self.report() == other.report()
    }
}

impl Eq for HandlerError {}

/// The future a handler returns.
pub type HandlerFuture = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send>>;

/// A task handler. Implemented for any `Fn(TaskContext) -> impl Future<Output = Result<…>>`.
pub trait Handler: Send + Sync + 'static {
    /// Runs one instance.
    fn call(&self, ctx: TaskContext) -> HandlerFuture;
}

impl<F, Fut> Handler for F
where
    F: Fn(TaskContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    fn call(&self, ctx: TaskContext) -> HandlerFuture {
        Box::pin(self(ctx))
    }
}

/// A handler whose `args` are decoded into `T` before `f` runs: see [`typed`].
pub struct Typed<T, F> {
    f: F,
    args: PhantomData<fn() -> T>,
}

/// A handler that decodes the envelope's `args` into `T` (any `serde::de::DeserializeOwned`)
/// and calls `f(args, ctx)`. Args that do not decode are a permanent failure whose message is
/// serde's error with the path of the field (`args.width: invalid type: string "wide",
/// expected u32`): the message is dead-lettered, never retried.
pub fn typed<T, F, Fut>(f: F) -> Typed<T, F>
where
    T: DeserializeOwned + Send + 'static,
    F: Fn(T, TaskContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    Typed {
        f,
        args: PhantomData,
    }
}

/// Decodes `args` into `T`; the error names the field that did not fit (`args.a.b: …`).
pub fn decode_args<T: DeserializeOwned>(args: &serde_json::Value) -> Result<T, HandlerError> {
    serde_path_to_error::deserialize(args).map_err(|e| {
        let path = e.path().to_string();
        let at = if path == "." {
            "args".to_owned()
        } else {
            format!("args.{path}")
        };
        HandlerError::permanent(format!(
            "{at}: {} (as {})",
            e.inner(),
            std::any::type_name::<T>()
        ))
    })
}

impl<T, F, Fut> Handler for Typed<T, F>
where
    T: DeserializeOwned + Send + 'static,
    F: Fn(T, TaskContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    fn call(&self, ctx: TaskContext) -> HandlerFuture {
        match decode_args::<T>(&ctx.args) {
            Ok(args) => Box::pin((self.f)(args, ctx)),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }
}

/// A handler that panicked: the source of the retryable [`HandlerError`] a panic becomes.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the handler panicked: {0}")]
pub struct Panicked(
    /// The panic's message (`(no message)` when it was not a string).
    pub String,
);

impl HandlerError {
    /// True when the failure is a caught panic ([`Panicked`]).
    pub fn is_panic(&self) -> bool {
        let source = match self {
            HandlerError::Retryable { source, .. } | HandlerError::Permanent { source, .. } => {
                source
            }
        };
        source.as_ref().is_some_and(|s| s.is::<Panicked>())
    }
}

/// `handler.call(ctx)`, with a panic (in `call` itself or in its future) turned into a
/// retryable [`HandlerError`] caused by [`Panicked`], so that the run is retried and the
/// worker goes on (docs/design.md#typed-rust-handlers).
pub fn call_guarded(handler: &dyn Handler, ctx: TaskContext) -> HandlerFuture {
    match std::panic::catch_unwind(AssertUnwindSafe(|| handler.call(ctx))) {
        Ok(call) => Box::pin(
            AssertUnwindSafe(call)
                .catch_unwind()
                .map(|ended| ended.unwrap_or_else(|panic| Err(panicked(&*panic)))),
        ),
        Err(panic) => Box::pin(std::future::ready(Err(panicked(&*panic)))),
    }
}

/// The error a caught panic becomes, with the panic's message.
fn panicked(panic: &(dyn std::any::Any + Send)) -> HandlerError {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned());
    HandlerError::retryable("panicked").because(Panicked(text))
}

/// A Rust handler under its task's `timeout` (the shell executor keeps its own): when the
/// time is up the run's cancellation token fires, the handler has `kill_grace` to return, then
/// it is dropped; the run fails retryable, "timed out after …".
pub struct WithTimeout {
    /// The handler.
    pub inner: Arc<dyn Handler>,
    /// The task's `timeout`.
    pub timeout: Duration,
}

impl Handler for WithTimeout {
    fn call(&self, ctx: TaskContext) -> HandlerFuture {
        let (cancel, grace, timeout) = (ctx.cancel.clone(), ctx.kill_grace, self.timeout);
        let mut call = self.inner.call(ctx);
        Box::pin(async move {
            if let Ok(ended) = tokio::time::timeout(timeout, &mut call).await {
                return ended;
            }
            cancel.cancel();
            let _ = tokio::time::timeout(grace, call).await;
            Err(HandlerError::retryable(format!(
                "timed out after {}",
                humantime::format_duration(timeout)
            )))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    fn ctx(args: serde_json::Value) -> TaskContext {
        TaskContext {
            task: "t".into(),
            key: "k".into(),
            job: None,
            scheduled_for: DateTime::UNIX_EPOCH,
            attempt: 0,
            fencing_token: 1,
            args,
            cancel: CancellationToken::new(),
            kill_grace: Duration::from_millis(100),
            trace: drumline_shared::trace::TraceParent::root(),
        }
    }

    #[derive(Deserialize)]
    struct Resize {
        #[allow(dead_code)]
        size: Size,
    }

    #[derive(Deserialize)]
    struct Size {
        #[allow(dead_code)]
        width: u32,
    }

    #[tokio::test]
    async fn args_that_do_not_decode_are_permanent_and_name_the_field() {
        let handler = typed(|_: Resize, _| async { Ok(()) });
        let e = handler
            .call(ctx(serde_json::json!({"size": {"width": "wide"}})))
            .await
            .unwrap_err();
        assert!(matches!(e, HandlerError::Permanent { .. }), "{e:?}");
        assert!(
            e.report()
                .starts_with("args.size.width: invalid type: string \"wide\", expected u32"),
            "{}",
            e.report()
        );
        let e = handler.call(ctx(serde_json::json!({}))).await.unwrap_err();
        assert!(
            e.report().contains("missing field `size`"),
            "{}",
            e.report()
        );
        let fine = handler.call(ctx(serde_json::json!({"size": {"width": 3}})));
        assert_eq!(fine.await, Ok(()));
    }

    #[tokio::test]
    async fn a_panic_becomes_a_retryable_error_that_says_so() {
        let in_future = |_: TaskContext| async {
            if true {
                panic!("boom");
            }
            Ok(())
        };
        let e = call_guarded(&in_future, ctx(serde_json::json!({})))
            .await
            .unwrap_err();
        assert!(matches!(e, HandlerError::Retryable { after: None, .. }));
        assert!(e.is_panic());
        assert_eq!(e.report(), "panicked: the handler panicked: boom");
        let in_call = |_: TaskContext| -> HandlerFuture { panic!("early {}", 1) };
        let e = call_guarded(&in_call, ctx(serde_json::json!({})))
            .await
            .unwrap_err();
        assert!(e.is_panic());
        assert!(e.report().ends_with("early 1"), "{}", e.report());
        assert!(!HandlerError::retryable("x").is_panic());
    }

    #[tokio::test(start_paused = true)]
    async fn the_timeout_cancels_the_handler_then_fails_the_run_retryable() {
        let (seen_tx, seen) = tokio::sync::oneshot::channel();
        let seen_tx = std::sync::Mutex::new(Some(seen_tx));
        let slow = move |ctx: TaskContext| {
            let tx = seen_tx.lock().unwrap().take();
            async move {
                ctx.cancel.cancelled().await;
                let _ = tx.map(|tx| tx.send(()));
                Ok(())
            }
        };
        let timed = WithTimeout {
            inner: Arc::new(slow),
            timeout: Duration::from_secs(3),
        };
        let started = tokio::time::Instant::now();
        let e = timed.call(ctx(serde_json::json!({}))).await.unwrap_err();
        assert_eq!(e, HandlerError::retryable("timed out after 3s"));
        assert_eq!(started.elapsed(), Duration::from_secs(3));
        assert!(seen.await.is_ok(), "the handler saw the cancellation");
    }
}
