//! What a task handler sees and returns. The error type maps one-to-one onto the worker's
//! decision: [`HandlerError::Retryable`] → retry after a delay (or dead-letter once retries are
//! exhausted), [`HandlerError::Permanent`] → dead-letter now; `Ok` → done.

use chrono::{DateTime, Utc};
use std::future::Future;
use std::pin::Pin;
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

/// How a run failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandlerError {
    /// Try again later (with backoff), up to the task's `max_retries`.
    #[error("{0}")]
    Retryable(String),
    /// Do not try again: dead-letter now.
    #[error("permanent: {0}")]
    Permanent(String),
}

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
