//! What a task handler sees and returns. The error type maps one-to-one onto the worker's
//! decision: [`HandlerError::Retryable`] → retry after a delay, the task's backoff or the one
//! the handler asks for (or dead-letter once retries are exhausted), [`HandlerError::Permanent`]
//! → dead-letter now; `Ok` → done. Either keeps the error that caused it as its `source`.

use chrono::{DateTime, Utc};
use std::future::Future;
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
    /// [`KILL_GRACE`](crate::executor::KILL_GRACE)), so the task is dead before anyone else
    /// could claim the instance.
    pub kill_grace: Duration,
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
