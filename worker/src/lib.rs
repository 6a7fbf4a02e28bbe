//! drumline-worker: consumes task messages, deduplicates through Redis, runs handlers.
//!
//! One delivery goes `consumer` → `processor` (claim, run, record, ack), the driver of its
//! state machine (`machine.rs`, no I/O), which asks `decision` (pure). Which module does what
//! is the map below.
//!
//! ```no_run
//! # async fn demo(config: drumline_shared::config::Config) -> Result<(), drumline_worker::WorkerError> {
//! use drumline_worker::{HandlerError, TaskContext, Worker};
//! Worker::new(config)
//!     .handler("report", |ctx: TaskContext| async move {
//!         println!("{} (fence {})", ctx.key, ctx.fencing_token);
//!         Ok::<(), HandlerError>(())
//!     })
//!     .run(async { let _ = tokio::signal::ctrl_c().await; })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! # Map
//!
//! - `main.rs`: parse the command line (feature `cli`), set up logging, load the config,
//!   dispatch on one tokio runtime; `exit::report` turns the `Failure` into the exit code.
//!   Touches: process.
//! - `cli.rs`: the `dlq` commands as a clap `Command` enum and its `run` (feature `cli`;
//!   flattened by `drumline-worker` and `drumline`); `dlq purge` asks for `--yes`.
//! - `commands.rs`: the commands' bodies (feature `cli`): the worker with its command-line
//!   overrides and metrics, `dlq list / replay / purge`; a `Failure` carrying the exit code.
//!   Touches: stdout, stderr (via the modules it calls).
//! - `dead_watch.rs`: the dead-letter watch: consume `{ns}.dead.watch` on a connection of its
//!   own, journal each instance the broker expired in its queue through the claim script's
//!   expired branch and its run record (docs/design.md#expired-in-the-queue). Touches: broker
//!   (via `broker`), Redis (via `store`).
//! - `consumer.rs`: broker side: connect, declare, consume within the concurrency slots,
//!   declare and consume again a queue whose consumer the broker cancelled, reconnect, pace
//!   failures, ordered shutdown. Touches: broker (via `broker`), Redis health ping.
//! - `reload.rs`: the processor new deliveries go to (`Current`), swapped whole on SIGHUP
//!   (`drumline-worker`, or `Worker::reload_on_sighup`). Touches: the config file.
//! - `decision.rs`: admit a body (oversize, malformed); `rejected_key`: the key a rejected
//!   message may be recorded under; `on_claim`: the claim's answer → run, or settle with an
//!   `Action`; `after_run`: the run's outcome, the task and the attempt → the `Action`. Pure.
//! - `machine.rs`: one delivery's life as a state machine without I/O: events in (the claim's
//!   answer, the run's end, a timer, shutdown, a step's answer or failure), effects out (claim,
//!   hold, run, publish, dead-letter, park, write the outcome and retry it, release, report,
//!   settle). Pure.
//! - `processor.rs`: the machine's driver: performs its effects and feeds the answers back;
//!   rejected and unknown-task messages. Touches: Redis (via `store`), broker (via `broker`).
//! - `run.rs`: one run of a handler under its claim's lease: the watchdog, the stop when the
//!   lease is lost or the shutdown grace runs out, the watchdog kept renewing until the result
//!   is recorded (`Renewing`). Touches: Redis (via `lease`), the handler.
//! - `acks.rs`: `Settled` (how a delivery ended at the broker) and the settle time limits; a
//!   consumer channel's acks, coalesced into `multiple` acks over recorded outcomes; bounded:
//!   done tags kept as runs, a delivery not settled in time closes the channel. Touches: broker
//!   (the deliveries' `broker::Acker`s, the consumer channel).
//! - `announce.rs`: the worker's announcement `{ns}:worker:{id}`, refreshed every 10 s with a
//!   30 s TTL, deleted on a clean stop. Touches: Redis (through the `Store`).
//! - `lease.rs`: the watchdog: renew every `lease/3`, cancel the run before the lease can
//!   lapse; the `Budget`'s numbers, and the `LeaseClock` a shell run hands its supervisor as
//!   deadlines. Touches: Redis (via `store`).
//! - `retry.rs`: a task's retry delay: `Backoff::nth(attempt)` from `retry_base` to `retry_max`
//!   with up to 20 % jitter, rounded up to whole milliseconds and bucketed; exhaustion. Pure.
//! - `executor.rs`: the shell executor: pipes, environment, stdin, kill ladder, a failure's
//!   stderr tail, through the supervisor; `make_non_dumpable` for the worker.
//! - `http.rs`: the HTTP executor: one `reqwest` client per task (rustls, no redirects, no
//!   proxy, `ca_file`), the request (the delivered body, the run's headers, the Standard
//!   Webhooks signature: `run_headers`, `sign`), and the pure mapping of an answer onto
//!   `HandlerError` (`outcome`, `retry_after`); a missing secret is `HttpSetupError` at start.
//!   Touches: the configured URL.
//! - `output.rs`: a shell task's output: stderr read to its end with the last 4 KiB kept
//!   (`Tail`), passed on raw, or as JSON log events per line (`key`, `task`, `stream`) with
//!   `--log-format json`. Touches: the task's pipes, the worker's stdout/stderr and log.
//! - `supervisor.rs` (binary `drumline-supervisor`, `src/bin/supervisor.rs`): a task supervisor
//!   (one per core, at most 4, per worker): non-dumpable, checks its parent, starts each
//!   command as a group leader, holds its pidfd, kills its group, stops it at its lease
//!   deadline on its own (a timerfd), kills every group when the worker's end closes. Touches:
//!   the tasks' processes.
//! - `supervisor/deadline.rs`: the tasks' lease deadlines, in the order they fall due: hold (a
//!   start's or a renewal's), forget (reaped), poll the SIGTERM or SIGKILL due. Pure.
//! - `supervisor/link.rs`, `supervisor/wire.rs`: the worker's side: starts the supervisors,
//!   gives them runs in turn, sends starts, signals and deadlines, routes replies to runs; the
//!   messages. Touches: the supervisors' sockets.
//! - `handler.rs`: the Rust handler API: context in, `HandlerError` out (`Retryable`, with an
//!   optional delay of the handler's own, or `Permanent`; each keeps its source); typed
//!   handlers (`typed`, `decode_args`), panics caught (`call_guarded`, `Panicked`), the task's
//!   timeout (`WithTimeout`) (docs/design.md#typed-rust-handlers).
//! - `stats.rs`: counters and gauges (Prometheus) and the shutdown summary; runs per task and
//!   outcome (unknown tasks labelled `unknown`), lag and run-time histograms per task. Touches:
//!   memory.

// Every public item is documented (docs/design.md#module-map): `cargo doc` is the reference.
#![warn(missing_docs)]

// Public for worker/tests/acks.rs (the real broker); not part of the API.
#[doc(hidden)]
pub mod acks;
pub(crate) mod announce;
#[cfg(feature = "cli")]
pub mod cli;
#[cfg(feature = "cli")]
pub mod commands;
pub(crate) mod consumer;
pub(crate) mod dead_watch;
pub(crate) mod decision;
pub(crate) use drumline_shared::dlq;
pub mod executor;
pub mod handler;
pub mod http;
pub(crate) mod lease;
mod machine;
pub mod output;
pub(crate) mod processor;
pub(crate) mod reload;
pub(crate) mod retry;
mod run;
pub mod stats;
pub mod supervisor;

pub use handler::{typed, Handler, HandlerError, TaskContext};

use drumline_shared::broker::BrokerError;
use drumline_shared::config::{Config, WorkerConfig};
use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::sync::watch;

/// Why a worker stopped with an error. [`WorkerError::needs_a_fix`] tells the ones a restart
/// cannot cure (the config, the install, the broker's queues: exit code 2) from the rest.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A task has neither a `command` nor a registered Rust handler.
    #[error("{}: task {task:?}: key `command`: missing (nor `http`), and no Rust handler is registered for it", path.display())]
    NoHandler {
        /// The config file.
        path: PathBuf,
        /// The task.
        task: String,
    },
    /// A Rust handler is registered for a task the config does not have.
    #[error("{}: a handler is registered for task {task:?}, but there is no [tasks.{task}] entry", path.display())]
    UnknownTask {
        /// The config file.
        path: PathBuf,
        /// The handler's task name.
        task: String,
    },
    /// An `http` task's endpoint cannot be used (its secret is missing, say).
    #[error("{}: {source}", path.display())]
    Http {
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        source: http::HttpSetupError,
    },
    /// `drumline-supervisor`, which runs every shell task, is not installed.
    #[error(transparent)]
    NoSupervisor(#[from] executor::SupervisorMissing),
    /// The broker holds one of the worker's queues with other arguments
    /// ([`BrokerError::Mismatch`]): the runs in flight were finished first.
    #[error(transparent)]
    Topology(BrokerError),
    /// The worker could not make itself non-dumpable, so tasks could read its environment.
    #[error("cannot make the worker non-dumpable: {0}")]
    NotDumpable(#[source] std::io::Error),
}

impl WorkerError {
    /// Whether a person must change something (the config, the install, the broker's queues)
    /// before the worker can serve: exit code 2. Otherwise 1.
    pub fn needs_a_fix(&self) -> bool {
        !matches!(self, WorkerError::NotDumpable(_))
    }
}

/// A worker, configured and ready to [`run`](Worker::run).
pub struct Worker {
    config: Config,
    handlers: HashMap<String, Arc<dyn Handler>>,
    stats: Arc<stats::Stats>,
    /// `[worker]` as the file had it, before command-line overrides.
    file_worker: WorkerConfig,
    reload_on_sighup: bool,
}

impl Worker {
    /// A worker for `config` (the `[worker]` section gives concurrency and queues).
    pub fn new(config: Config) -> Self {
        Self {
            file_worker: config.worker.clone(),
            config,
            handlers: HashMap::new(),
            stats: Arc::new(stats::Stats::default()),
            reload_on_sighup: false,
        }
    }

    /// On SIGHUP, re-read the config file and serve its `[tasks.*]` and `[[jobs]]` to the
    /// deliveries that follow (in-flight runs are untouched; a file that does not load is
    /// refused and logged). `drumline-worker` turns it on; off by default for embedders.
    pub fn reload_on_sighup(mut self) -> Self {
        self.reload_on_sighup = true;
        self
    }

    /// The worker's counters (register them for `/metrics` before [`run`](Worker::run)).
    pub fn stats(&self) -> Arc<stats::Stats> {
        self.stats.clone()
    }

    /// Overrides `[worker] concurrency` (the `--concurrency` flag).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.config.worker.concurrency = n.max(1);
        self
    }

    /// Overrides `[worker] queues` (the `--queues` flag).
    pub fn queues(mut self, queues: Vec<String>) -> Self {
        self.config.worker.queues = queues;
        self
    }

    /// Registers a Rust handler for `task` (it must have a `[tasks.NAME]` entry); it wins over
    /// the entry's `command`.
    pub fn handler(mut self, task: &str, handler: impl Handler) -> Self {
        self.handlers.insert(task.to_owned(), Arc::new(handler));
        self
    }

    /// Registers a typed Rust handler for `task`: `f(args, ctx)`, its `args` decoded into `T`
    /// first (see [`handler::typed`]: args that do not decode are dead-lettered `permanent`,
    /// naming the field).
    ///
    /// ```no_run
    /// # async fn demo(config: drumline_shared::config::Config) -> Result<(), drumline_worker::WorkerError> {
    /// use drumline_worker::{HandlerError, TaskContext, Worker};
    ///
    /// #[derive(serde::Deserialize)]
    /// struct Email { to: String }
    ///
    /// Worker::new(config)
    ///     .typed_handler("email", |email: Email, ctx: TaskContext| async move {
    ///         println!("{} to {} (fence {})", ctx.key, email.to, ctx.fencing_token);
    ///         Ok::<(), HandlerError>(())
    ///     })
    ///     .run(async { let _ = tokio::signal::ctrl_c().await; })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn typed_handler<T, F, Fut>(self, task: &str, f: F) -> Self
    where
        T: serde::de::DeserializeOwned + Send + 'static,
        F: Fn(T, TaskContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        self.handler(task, handler::typed(f))
    }

    /// Runs until `shutdown` completes, then stops in order (see `consumer.rs`). First,
    /// before anything is spawned, makes this process non-dumpable so that tasks running as
    /// the same user cannot read its environment or memory
    /// (docs/design.md#tasks-cannot-read-the-worker), and, when a task runs a `command`, finds
    /// the supervisor that runs it ([`executor::supervisor`]; missing: a config error).
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<Arc<stats::Stats>, WorkerError> {
        executor::make_non_dumpable().map_err(WorkerError::NotDumpable)?;
        let shell = |(name, task): (&String, &drumline_shared::config::Task)| {
            task.command.is_some() && !self.handlers.contains_key(name)
        };
        if self.config.tasks.iter().any(shell) {
            executor::supervisor()?;
        }
        let handlers = processor::resolve_handlers(&self.config, &self.handlers)?;
        let reload = self.reload_on_sighup.then(|| reload::Reload {
            custom: self.handlers,
            file_worker: self.file_worker,
        });
        consumer::run(
            Arc::new(self.config),
            (handlers, reload),
            self.stats,
            shutdown,
        )
        .await
    }
}

/// Open while Redis answers; closed (fail closed) from the first Redis error until a probe
/// gets through again. Deliveries wait at the gate, unacked.
#[derive(Clone)]
pub struct Gate {
    tx: Arc<watch::Sender<bool>>,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            tx: Arc::new(watch::channel(true).0),
        }
    }
}

impl Gate {
    /// Closes the gate (idempotent).
    pub fn close(&self) {
        self.tx
            .send_if_modified(|open| std::mem::replace(open, false));
    }

    /// Opens the gate.
    pub fn open(&self) {
        self.tx
            .send_if_modified(|open| !std::mem::replace(open, true));
    }

    /// True when open.
    pub fn is_open(&self) -> bool {
        *self.tx.borrow()
    }

    /// Waits until open.
    pub async fn wait_open(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|open| *open).await;
    }

    /// Waits until closed.
    pub async fn wait_closed(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|open| !*open).await;
    }
}
