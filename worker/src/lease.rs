//! The lease watchdog (docs/design.md, "Lease loss stops the run in time"): renews the
//! claim every `lease/3` and cancels the handler early enough that the task is dead before the
//! lease could expire when renewals fail. Validity is judged on the monotonic clock from the
//! moment the last successful renewal (or the claim) was *sent* — Redis applied it later, so
//! its expiry is no earlier than that instant plus the lease — never on Redis's word alone.
//! A loss noticed late (the worker was frozen) first gives the run [`Budget::catch_up`] to
//! report an end it reached meanwhile: a success is not thrown away (docs/guarantees.md).
//! A shell task's supervisor follows the same expiry ([`LeaseClock`]) and stops the task at the
//! loss's instant itself, so a frozen worker's task is dead in time too.
//!
//! With `L` the lease and `E` that expiry ([`Budget`] has the numbers):
//!
//! ```text
//! E − L        E − 2L/3      E − L/3         E − L/6         E − L/12     E
//! sent ─────── renew ─────── loss declared ─ SIGKILL ─────── future ───── someone else
//!              (retried)     SIGTERM         (≤ 5 s grace)   dropped      may claim
//! ```

use crate::supervisor::{deadline, wire::Deadline};
use drumline_shared::store::Store;
use std::fmt::Display;
use std::future::Future;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The longest grace between SIGTERM and SIGKILL when a task is stopped. The worker gives a
/// shorter one ([`TaskContext::kill_grace`](crate::handler::TaskContext::kill_grace)) when the
/// lease leaves less room.
pub const KILL_GRACE: Duration = Duration::from_secs(5);

/// Why the watchdog gave up the lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseLost {
    /// Redis says the claim is no longer ours (expired and taken, or deleted).
    Taken,
    /// Renewals kept failing; too little of the lease was left to keep waiting for one.
    Unreachable(String),
}

/// How one lease's length is shared out between renewing and stopping the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// The lease length.
    pub lease: Duration,
}

impl Budget {
    /// The budget for `lease`.
    pub fn new(lease: Duration) -> Self {
        Self { lease }
    }

    /// Renewal period after a success: `lease/3`.
    pub fn renew_every(&self) -> Duration {
        self.lease / 3
    }

    /// How long one renewal may take: `lease/6`.
    pub fn attempt_timeout(&self) -> Duration {
        self.lease / 6
    }

    /// Pause before retrying a failed renewal: `lease/12`.
    pub fn retry_pause(&self) -> Duration {
        self.lease / 12
    }

    /// The loss is declared this long before the expiry, leaving that much to stop the run:
    /// `lease/3`.
    pub fn kill_budget(&self) -> Duration {
        self.lease / 3
    }

    /// SIGTERM → SIGKILL: `lease/6`, at most [`KILL_GRACE`]. With the loss declared
    /// [`kill_budget`](Self::kill_budget) before the expiry, the SIGKILL comes at least
    /// `lease/6` before it.
    pub fn kill_grace(&self) -> Duration {
        (self.lease / 6).min(KILL_GRACE)
    }

    /// A cancelled handler's future is dropped this long before the expiry, whatever it is
    /// doing: `lease/12`.
    pub fn drop_margin(&self) -> Duration {
        self.lease / 12
    }

    /// How long a loss noticed late waits for the handler to report an end it reached while
    /// the worker was not looking, before the run is stopped: `lease/12`, at most
    /// [`CATCH_UP`]. A loss is late when it comes more than this after it was due
    /// ([`kill_budget`](Self::kill_budget) before `expiry`): the worker was frozen or starved,
    /// so its task, which runs on under the supervisor, may have ended meanwhile, its end still
    /// unread in a socket. A loss on time stops the run at once.
    pub fn catch_up(&self, expiry: Instant, now: Instant) -> Option<Duration> {
        let catch_up = (self.lease / 12).min(CATCH_UP);
        (now > expiry - self.kill_budget() + catch_up).then_some(catch_up)
    }

    /// Whether the lease is given up by `now`: the loss is due
    /// ([`kill_budget`](Self::kill_budget) before `expiry`), the watchdog declares it when it
    /// next runs, and a shell task's supervisor stops the task from then on. A run that fails
    /// from then on may have failed because it was stopped: it counts as the lease's loss, not
    /// as an attempt.
    pub fn given_up(&self, expiry: Instant, now: Instant) -> bool {
        expiry
            .checked_sub(self.kill_budget())
            .is_none_or(|due| now >= due)
    }

    /// The supervisor's [`Deadline`] for `expiry`: SIGTERM when the loss is due
    /// ([`kill_budget`](Self::kill_budget) before it), SIGKILL [`kill_grace`](Self::kill_grace)
    /// later, as the worker's own stop, on the supervisor's clock, where `clock_now` is what
    /// it reads at `now`.
    pub fn deadline(&self, expiry: Instant, now: Instant, clock_now: u64) -> Deadline {
        let left = expiry
            .checked_sub(self.kill_budget())
            .map_or(Duration::ZERO, |due| due.saturating_duration_since(now));
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let term = clock_now.saturating_add(nanos(left));
        Deadline {
            term,
            kill: term.saturating_add(nanos(self.kill_grace())),
        }
    }
}

/// A run's lease as its handler may follow it: the earliest instant it could expire at, moved
/// by each renewal ([`watch`]'s `expiry`), and its [`Budget`]. The shell executor hands its
/// [`deadline`](Self::deadline) to the task's supervisor at the start and after each renewal.
#[derive(Debug, Clone)]
pub(crate) struct LeaseClock {
    expiry: watch::Receiver<Instant>,
    budget: Budget,
}

tokio::task_local! {
    /// The lease of the run whose handler's future is being created (see [`with_lease`]).
    static LEASE: LeaseClock;
}

impl LeaseClock {
    /// The clock of a run whose watchdog sends its expiries to `expiry`.
    pub fn new(expiry: watch::Receiver<Instant>, budget: Budget) -> Self {
        Self { expiry, budget }
    }

    /// The supervisor's deadline for the lease as it stands.
    pub fn deadline(&self) -> Deadline {
        let expiry = *self.expiry.borrow();
        self.budget
            .deadline(expiry, Instant::now(), deadline::now())
    }

    /// The deadline after the next renewal; `None` once the watchdog has stopped (it renews no
    /// more).
    pub async fn renewed(&mut self) -> Option<Deadline> {
        self.expiry.changed().await.ok()?;
        Some(self.deadline())
    }
}

/// Creates a run's future with its lease at hand ([`current`]): [`TaskContext`] stays as
/// handlers know it, and only the executors that can hand the lease on read it.
///
/// [`TaskContext`]: crate::handler::TaskContext
pub(crate) fn with_lease<R>(lease: LeaseClock, create: impl FnOnce() -> R) -> R {
    LEASE.sync_scope(lease, create)
}

/// The lease of the run being created, if it has one (a handler called directly has none).
pub(crate) fn current() -> Option<LeaseClock> {
    LEASE.try_with(Clone::clone).ok()
}

/// The longest [`Budget::catch_up`]: ample for an end already in a socket to be read (a
/// driver turn and two task hops), short beside a run that did not end.
pub const CATCH_UP: Duration = Duration::from_millis(100);

/// The claim a watchdog keeps alive.
#[derive(Clone)]
pub struct Held {
    /// Redis state.
    pub store: Store,
    /// Idempotency key.
    pub key: String,
    /// The claimed instance's job, if any (its running set and overlap lock).
    pub job: Option<String>,
    /// The claim's token.
    pub token: String,
}

/// Renews `held` until `stop` fires. `granted_at` is when the claim was sent. Returns `Some`
/// (and fires `lost`) when the lease is lost; `None` when stopped normally. `expiry` follows
/// the earliest instant the lease could expire at.
pub async fn watch(
    held: Held,
    budget: Budget,
    granted_at: Instant,
    stop: CancellationToken,
    lost: CancellationToken,
    expiry: watch::Sender<Instant>,
) -> Option<LeaseLost> {
    let renew = || {
        held.store
            .renew(&held.key, held.job.as_deref(), &held.token, budget.lease)
    };
    let outcome = watch_with(renew, budget, granted_at, stop, expiry).await;
    if outcome.is_some() {
        lost.cancel();
    }
    outcome
}

/// The watchdog's timing, with the renewal call injected (tests use fakes under paused time).
pub async fn watch_with<F, Fut, E>(
    mut renew: F,
    budget: Budget,
    granted_at: Instant,
    stop: CancellationToken,
    expiry: watch::Sender<Instant>,
) -> Option<LeaseLost>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool, E>>,
    E: Display,
{
    let mut last_ok = granted_at;
    expiry.send_replace(last_ok + budget.lease);
    let mut next = last_ok + budget.renew_every();
    let mut failure = String::from("renewal timed out");
    loop {
        let give_up_at = last_ok + budget.lease - budget.kill_budget();
        tokio::select! {
            () = stop.cancelled() => return None,
            () = tokio::time::sleep_until(next.min(give_up_at)) => {}
        }
        let sent = Instant::now();
        if sent >= give_up_at {
            return Some(LeaseLost::Unreachable(failure));
        }
        let attempt = tokio::select! {
            () = stop.cancelled() => return None,
            a = tokio::time::timeout_at((sent + budget.attempt_timeout()).min(give_up_at), renew()) => a,
        };
        match attempt {
            Ok(Ok(true)) => {
                last_ok = sent;
                expiry.send_replace(last_ok + budget.lease);
                next = sent + budget.renew_every();
                continue;
            }
            Ok(Ok(false)) => return Some(LeaseLost::Taken),
            Ok(Err(e)) => failure = e.to_string(),
            Err(_) => failure = "renewal timed out".into(),
        }
        tracing::warn!(reason = %failure, "lease renewal failed; retrying");
        next = Instant::now() + budget.retry_pause();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    const LEASE: Duration = Duration::from_secs(3);

    /// Runs the watchdog with `renew` under paused time; returns the outcome, how long after
    /// the grant it came, the final expiry (relative to the grant) and the number of renewals.
    async fn run<Fut>(
        mut renew: impl FnMut(u32) -> Fut,
    ) -> (Option<LeaseLost>, Duration, Duration, u32)
    where
        Fut: Future<Output = Result<bool, String>>,
    {
        let calls = Arc::new(AtomicU32::new(0));
        let granted = Instant::now();
        let (tx, rx) = watch::channel(granted);
        let counter = calls.clone();
        let outcome = watch_with(
            move || renew(counter.fetch_add(1, Ordering::SeqCst)),
            Budget::new(LEASE),
            granted,
            CancellationToken::new(),
            tx,
        )
        .await;
        let expiry = *rx.borrow() - granted;
        (
            outcome,
            granted.elapsed(),
            expiry,
            calls.load(Ordering::SeqCst),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_blackholed_renewal_declares_the_loss_a_third_of_the_lease_early() {
        let (outcome, at, expiry, calls) = run(|_| std::future::pending()).await;
        assert_eq!(
            outcome,
            Some(LeaseLost::Unreachable("renewal timed out".into()))
        );
        // Renewed at 1 s (timed out at 1.5 s), retried at 1.75 s (cut off at 2 s).
        assert_eq!(at, Duration::from_secs(2));
        assert_eq!(expiry, LEASE);
        assert_eq!(calls, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn each_success_moves_the_expiry_from_when_it_was_sent() {
        // Two renewals succeed after 100 ms each; then Redis stops answering.
        let (outcome, at, expiry, _) = run(|n| async move {
            if n < 2 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok(true)
            } else {
                std::future::pending().await
            }
        })
        .await;
        assert!(matches!(outcome, Some(LeaseLost::Unreachable(_))));
        // Sent at 1 s and 2 s (not 2.1 s: the next period starts from the send).
        assert_eq!(expiry, Duration::from_secs(5));
        assert_eq!(at, Duration::from_secs(4));
    }

    #[tokio::test(start_paused = true)]
    async fn errors_are_retried_until_the_kill_budget_is_reached() {
        let (outcome, at, _, calls) = run(|_| async { Err("connection refused".to_owned()) }).await;
        assert_eq!(
            outcome,
            Some(LeaseLost::Unreachable("connection refused".into()))
        );
        assert_eq!(at, Duration::from_secs(2));
        // At 1 s, then every 250 ms until 2 s: 1, 1.25, 1.5, 1.75.
        assert_eq!(calls, 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_taken_lease_is_lost_at_once() {
        let (outcome, at, _, _) = run(|_| async { Ok(false) }).await;
        assert_eq!(outcome, Some(LeaseLost::Taken));
        assert_eq!(at, Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn stop_returns_even_while_a_renewal_hangs() {
        let stop = CancellationToken::new();
        let granted = Instant::now();
        let (tx, _rx) = watch::channel(granted);
        let handle = tokio::spawn(watch_with(
            std::future::pending::<Result<bool, String>>,
            Budget::new(LEASE),
            granted,
            stop.clone(),
            tx,
        ));
        tokio::time::sleep(Duration::from_millis(1200)).await;
        stop.cancel();
        assert_eq!(handle.await.unwrap(), None);
        assert_eq!(granted.elapsed(), Duration::from_millis(1200));
    }

    #[test]
    fn only_a_loss_noticed_late_waits_for_an_end_on_its_way() {
        let b = Budget::new(LEASE);
        let expiry = Instant::now() + LEASE;
        let due = expiry - b.kill_budget();
        assert_eq!(b.catch_up(expiry, due), None, "on time");
        assert_eq!(
            b.catch_up(expiry, due + CATCH_UP),
            None,
            "within the catch-up"
        );
        let frozen = expiry + Duration::from_secs(4);
        assert_eq!(b.catch_up(expiry, frozen), Some(CATCH_UP));
        let short = Budget::new(Duration::from_millis(600));
        let expiry = Instant::now() + short.lease;
        assert_eq!(
            short.catch_up(expiry, expiry),
            Some(Duration::from_millis(50))
        );
    }

    #[test]
    fn the_supervisors_deadline_is_the_watchdogs_stop_on_its_clock() {
        let b = Budget::new(LEASE);
        let now = Instant::now();
        let expiry = now + LEASE;
        // 3 s lease: SIGTERM 2 s from now, SIGKILL half a second later.
        let d = b.deadline(expiry, now, 1_000_000_000);
        assert_eq!(d.term, 3_000_000_000);
        assert_eq!(d.kill, 3_500_000_000);
        // A loss already due is due at once.
        let late = b.deadline(expiry, now + Duration::from_secs(5), 7);
        assert_eq!(late.term, 7);
        assert_eq!(late.kill, 500_000_007);
        let long = Budget::new(Duration::from_secs(300));
        let d = long.deadline(now + long.lease, now, 0);
        assert_eq!(d.term, 200_000_000_000);
        assert_eq!(d.kill, 205_000_000_000, "the grace is at most KILL_GRACE");
    }

    #[test]
    fn a_lease_is_given_up_from_the_instant_its_loss_is_due() {
        let b = Budget::new(LEASE);
        let expiry = Instant::now() + LEASE;
        let due = expiry - b.kill_budget();
        assert!(!b.given_up(expiry, due - Duration::from_millis(1)));
        assert!(b.given_up(expiry, due));
        assert!(b.given_up(expiry, expiry + Duration::from_secs(4)));
    }

    #[test]
    fn the_task_is_killed_and_dropped_before_the_expiry() {
        for secs in [1, 3, 6, 30, 300] {
            let b = Budget::new(Duration::from_secs(secs));
            let loss = b.lease - b.kill_budget();
            let sigkill = loss + b.kill_grace();
            let dropped = b.lease - b.drop_margin();
            assert!(sigkill < dropped, "{secs}s: {sigkill:?} vs {dropped:?}");
            assert!(dropped < b.lease);
            // At least one retry fits between a timed-out renewal and the loss.
            assert!(b.renew_every() + b.attempt_timeout() + b.retry_pause() < loss);
        }
    }
}
