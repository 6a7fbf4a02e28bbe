//! One run of a handler under its claim's lease (docs/design.md "Lease loss stops the run in
//! time"): the watchdog renews the lease; the run is stopped, in time, when the lease is lost
//! or the shutdown grace runs out; a finished run keeps the watchdog renewing until its result
//! is recorded ([`Renewing`]). Touches: Redis (the watchdog, via `lease`), the handler.

use crate::decision::RunResult;
use crate::handler::{self, Handler, HandlerError, HandlerFuture, TaskContext};
use crate::lease::{self, LeaseLost};
use crate::stats::Stats;
use drumline_shared::envelope::Envelope;
use drumline_shared::trace::TraceParent;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// One run: the handler, the copy, and the claim it runs under.
#[derive(Clone)]
pub(crate) struct Run<'a> {
    /// The task's handler.
    pub handler: Arc<dyn Handler>,
    /// The copy.
    pub env: &'a Envelope,
    /// The run's span, which the handler is given ([`TaskContext::trace`]).
    pub trace: TraceParent,
    /// The body it was delivered in (the HTTP executor sends it as is).
    pub delivered: &'a [u8],
    /// The claim the watchdog renews.
    pub held: lease::Held,
    /// The claim's fencing token.
    pub fence: u64,
    /// When the claim was sent: the lease runs from there.
    pub claimed_at: Instant,
    /// The lease, shared out between renewing and stopping.
    pub budget: lease::Budget,
}

/// Runs `run`'s handler under the lease watchdog (docs/design.md "Lease loss stops the run in
/// time"), counted in `stats`; `abandon` fires when the shutdown grace runs out. A finished
/// run comes with its [`Renewing`] watchdog, which renews the lease until it is dropped.
pub(crate) async fn run(
    run: Run<'_>,
    stats: &Stats,
    abandon: &CancellationToken,
) -> (RunResult, Option<Renewing>) {
    let Run {
        handler,
        env,
        trace,
        delivered,
        held,
        fence,
        claimed_at,
        budget,
    } = run;
    let cancel = CancellationToken::new();
    let lost = CancellationToken::new();
    let stop_watchdog = CancellationToken::new();
    let (expiry_tx, expiry) = tokio::sync::watch::channel(claimed_at + budget.lease);
    let watchdog = tokio::spawn(lease::watch(
        held,
        budget,
        claimed_at,
        stop_watchdog.clone(),
        lost.clone(),
        expiry_tx,
    ));
    // Stops the watchdog if this future is dropped or unwinds before the run's end is
    // handed to `Renewing` (a handler that panics): a lease must never outlive its run.
    let stop_on_drop = stop_watchdog.drop_guard();
    let ctx = context(env, (fence, trace), cancel.clone(), budget.kill_grace());
    stats.running.inc();
    // The lease goes along for a shell task's supervisor, which stops the task at the
    // loss's instant even if this worker is frozen then (docs/design.md#the-task-supervisor).
    let clock = lease::LeaseClock::new(expiry.clone(), budget);
    let call = lease::with_lease(clock, || {
        crate::http::with_delivered(delivered.into(), || handler::call_guarded(&*handler, ctx))
    });
    let stopped = call_until_stopped(call, cancel, (&lost, abandon), expiry.clone(), budget).await;
    let given_up = budget.given_up(*expiry.borrow(), Instant::now());
    if matches!(&stopped, Stopped::Returned(Err(e)) if e.is_panic()) {
        stats.panics.inc();
    }
    stats.running.dec();
    let renewing = Renewing {
        stop: stop_on_drop.disarm(),
        watchdog,
    };
    renewing
        .settle(stopped, lost.is_cancelled(), given_up)
        .await
}

/// Awaits the handler's `call` until it returns, the lease is `lost` or the shutdown grace
/// runs out (`abandon`); an end that is ready counts over a loss, and a loss noticed late waits
/// [`lease::Budget::catch_up`] for an end reached unseen. When stopped, the handler is told
/// (the shell executor SIGTERMs its group, then SIGKILLs it after `kill_grace`) and dropped
/// before the lease could be taken whatever it does: dropping a shell run SIGKILLs its group.
async fn call_until_stopped(
    mut call: HandlerFuture,
    cancel: CancellationToken,
    (lost, abandon): (&CancellationToken, &CancellationToken),
    expiry: tokio::sync::watch::Receiver<Instant>,
    budget: lease::Budget,
) -> Stopped {
    // The handler's end first: a worker resumed after a freeze finds its task ended and its
    // lease lapsed at once, and a success is recorded unless someone took the instance
    // over meanwhile (docs/guarantees.md "A success is not thrown away").
    let stopped = tokio::select! {
        biased;
        r = &mut call => return Stopped::Returned(r),
        _ = lost.cancelled() => Stopped::LeaseLost,
        _ = abandon.cancelled() => Stopped::Abandoned,
    };
    // A loss noticed late may have an end on its way ([`lease::Budget::catch_up`]).
    let late = budget.catch_up(*expiry.borrow(), Instant::now());
    if let (Stopped::LeaseLost, Some(catch_up)) = (&stopped, late) {
        if let Ok(r) = tokio::time::timeout(catch_up, &mut call).await {
            return Stopped::Returned(r);
        }
    }
    cancel.cancel();
    let drop_at = *expiry.borrow() - budget.drop_margin();
    if tokio::time::timeout_at(drop_at, call).await.is_err() {
        warn!("the handler did not stop when cancelled; dropped it");
    }
    stopped
}

/// How a handler call ended.
enum Stopped {
    /// It returned.
    Returned(Result<(), HandlerError>),
    /// Stopped: the lease was lost.
    LeaseLost,
    /// Stopped: the shutdown grace ran out.
    Abandoned,
}

/// What a handler is told about its run.
fn context(
    env: &Envelope,
    (fence, trace): (u64, TraceParent),
    cancel: CancellationToken,
    kill_grace: Duration,
) -> TaskContext {
    TaskContext {
        task: env.task.clone(),
        key: env.key.clone(),
        job: env.job.clone(),
        scheduled_for: env.scheduled_for,
        attempt: env.attempt,
        fencing_token: fence,
        args: env.args.clone(),
        cancel,
        kill_grace,
        trace,
    }
}

/// A run's lease watchdog, still renewing; stopped when dropped.
pub(crate) struct Renewing {
    stop: CancellationToken,
    watchdog: tokio::task::JoinHandle<Option<LeaseLost>>,
}

impl Renewing {
    /// The result of a run that `stopped`, with the watchdog kept renewing while a result to
    /// record is recorded. `lost`: the watchdog declared the loss; `given_up`: the loss was due
    /// when the run stopped ([`lease::Budget::given_up`]).
    async fn settle(
        self,
        stopped: Stopped,
        lost: bool,
        given_up: bool,
    ) -> (RunResult, Option<Renewing>) {
        match stopped {
            Stopped::Abandoned => {
                self.stop().await;
                (RunResult::Abandoned, None)
            }
            // A success is recorded even if the lease was lost meanwhile: `done` lands when
            // the claim is still ours or nobody took it (docs/design.md).
            Stopped::Returned(Ok(())) => (RunResult::Succeeded, Some(self)),
            // A failure once the lease was given up may be the supervisor's stop (the worker
            // was frozen): the lease's loss, not an attempt, whatever the watchdog says yet.
            Stopped::Returned(Err(e)) if !lost && !given_up => (RunResult::Failed(e), Some(self)),
            _ => {
                let lost = self.stop().await.unwrap_or_else(|| {
                    if given_up {
                        let why = "the lease ran out unrenewed (the worker was frozen or starved)";
                        LeaseLost::Unreachable(why.into())
                    } else {
                        LeaseLost::Taken
                    }
                });
                (RunResult::LeaseLost(lost), None)
            }
        }
    }

    /// Stops renewing; why the lease was lost, if it was.
    async fn stop(mut self) -> Option<LeaseLost> {
        self.stop.cancel();
        (&mut self.watchdog).await.ok().flatten()
    }
}

impl Drop for Renewing {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
