//! One delivery, start to finish (docs/design.md): admit → claim → run (with the lease watchdog) →
//! record → ack. What to do at each step is decided in [`crate::decision`] (pure); this module
//! performs it ([`Processor::execute`]): it may touch the broker (publish, ack) and Redis (the
//! [`Store`]). Every path ends in exactly one ack or one requeue; nothing is requeued that would
//! fail the same way again (those go to `{ns}.dead`).

use crate::acks::{Settled, Ticket, SETTLE_TIMEOUT};
use crate::decision::{self, Action, LimitWait, Next, Outcome, Recheck, Rejected, RunResult};
use crate::handler::{self, Handler, HandlerError, HandlerFuture, TaskContext};
use crate::lease::{self, LeaseLost};
use crate::retry;
use crate::stats::{RunOutcome, Stats, UNKNOWN_TASK};
use crate::{Gate, WorkerError};
use chrono::Utc;
use drumline_shared::backoff::Backoff;
use drumline_shared::broker::{self, BrokerError, Channel, DeadHeaders, Delivery};
use drumline_shared::config::{Config, Limit, Overlap, Task};
use drumline_shared::envelope::{self, Arrival, DeadReason, Envelope};
use drumline_shared::names::Names;
use drumline_shared::planted::{self, planted, Defect};
use drumline_shared::store::{
    now_text, Claim, ClaimRequest, Ended, Ending, Final, LimitClaim, OverlapMode, RunRecord, Store,
    StoreError, Unclaimed, Waiter,
};
use prometheus_client::metrics::gauge::Gauge;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn, Instrument};

/// How long an outcome write is retried from its first failure before the worker gives up on
/// it: long enough to ride out a Redis blip or a Sentinel failover (2–3 s with
/// `down-after-milliseconds 1000`).
pub const FINISH_RETRY_FOR: Duration = Duration::from_secs(10);

/// Between tries of an outcome write: 100 ms, doubled up to 1 s.
const FINISH_BACKOFF: Backoff =
    Backoff::constant(Duration::from_millis(100), Duration::from_secs(1), 0.0);

/// Everything processing needs that outlives one broker connection.
pub struct Processor {
    /// Checked config.
    pub config: Arc<Config>,
    /// Names for the namespace.
    pub names: Names,
    /// Redis state.
    pub store: Store,
    /// Task name → handler.
    pub handlers: HashMap<String, Arc<dyn Handler>>,
    /// This worker's id (host:pid:random).
    pub worker_id: String,
    /// Counters.
    pub stats: Arc<Stats>,
    /// Closed while Redis is unreachable: fail closed.
    pub gate: Gate,
    /// Fires when the shutdown grace ran out: in-flight handlers are cancelled.
    pub abandon: CancellationToken,
    /// Job name → overlap policy, from this worker's config. A job the worker's config does not
    /// list gets the default, `skip`.
    pub overlap: HashMap<String, Overlap>,
}

/// How a delivery ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Disposition {
    Ack,
    /// Back to the broker, to be decided again (by us or another worker).
    Requeue,
}

/// Why processing could not reach a decision; the delivery is requeued.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Interrupted {
    #[error("redis: {0}")]
    Redis(#[from] StoreError),
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

impl Processor {
    /// The same worker serving a reloaded `config` with `handlers` (SIGHUP): Redis, the
    /// counters, the gate and the abandon signal are shared; a delivery already in hand
    /// finishes under the processor it started with.
    pub fn reloaded(
        &self,
        config: Arc<Config>,
        handlers: HashMap<String, Arc<dyn Handler>>,
    ) -> Processor {
        Processor {
            overlap: overlaps(&config),
            config,
            names: self.names.clone(),
            store: self.store.clone(),
            handlers,
            worker_id: self.worker_id.clone(),
            stats: self.stats.clone(),
            gate: self.gate.clone(),
            abandon: self.abandon.clone(),
        }
    }

    /// The overlap rule for `env`'s job; ad-hoc tasks have none. A backfilled instance of a
    /// `skip` job queues instead: a backfill asks every instant to run (docs/design.md).
    fn overlap<'e>(&self, env: &'e Envelope) -> OverlapMode<'e> {
        let Some(job) = env.job.as_deref() else {
            return OverlapMode::Allow;
        };
        if planted(Defect::IgnoreOverlap) {
            return OverlapMode::Allow;
        }
        match self.overlap.get(job).copied().unwrap_or_default() {
            Overlap::Skip if env.backfill => OverlapMode::Queue(job),
            Overlap::Skip => OverlapMode::Skip(job),
            Overlap::Queue => OverlapMode::Queue(job),
            Overlap::Allow => OverlapMode::Allow,
        }
    }

    /// The `task` label of `task`: itself when this worker has it, else [`UNKNOWN_TASK`], so
    /// that messages cannot grow the label set.
    pub(crate) fn task_label<'t>(&self, task: &'t str) -> &'t str {
        if self.handlers.contains_key(task) && self.config.tasks.contains_key(task) {
            task
        } else {
            UNKNOWN_TASK
        }
    }

    /// The `[limits.NAME]` of `env`'s task, if any (docs/design.md#limits).
    fn limit(&self, env: &Envelope) -> Option<&Limit> {
        self.config.tasks.get(&env.task)?.limit.as_ref()
    }

    /// The store as the holder of a claim of `env` uses it: renewals move the claim's group
    /// slot, and ending the claim frees it.
    fn holder(&self, env: &Envelope) -> Store {
        self.store
            .with_limit(self.limit(env).map(|l| l.name.as_str()))
    }

    /// The job a claim of `env` belongs to, if any: the store keeps its running set (and, with
    /// `overlap` skip or queue, its lock) through the claim's renewals and ending.
    fn lock_job<'e>(&self, env: &'e Envelope) -> Option<&'e str> {
        env.job.as_deref()
    }

    /// Processes one delivery and acks or requeues it; says how, so the consumer can pace
    /// itself when the broker side keeps failing. Settling is bounded: on a dead channel the
    /// broker redelivers anyway, and a stuck ack must not hold a concurrency slot.
    /// `ticket` settles it: acks are coalesced with the channel's others ([`crate::acks`]).
    pub(crate) async fn process(
        self: Arc<Self>,
        publisher: Channel,
        delivery: Delivery,
        ticket: Ticket,
    ) -> Settled {
        let mut broker_trouble = false;
        let disposition = match self.disposition(&publisher, &delivery).await {
            Ok(d) => d,
            Err(Interrupted::Redis(e)) => {
                error!(error = %e, "redis unreachable: requeueing and pausing (fail closed)");
                self.gate.close();
                Disposition::Requeue
            }
            Err(e) => {
                warn!(error = %e, "cannot finish handling a delivery; requeueing");
                broker_trouble = true;
                Disposition::Requeue
            }
        };
        drop(delivery);
        let settle = async {
            match disposition {
                Disposition::Ack => ticket.ack().await,
                Disposition::Requeue => {
                    ticket.requeue().await?;
                    self.stats.requeued.inc();
                    Ok(())
                }
            }
        };
        let settled = match tokio::time::timeout(SETTLE_TIMEOUT, settle).await {
            Ok(Ok(())) if disposition == Disposition::Ack => Settled::Acked,
            Ok(Ok(())) => Settled::Requeued,
            Ok(Err(e)) => {
                // The channel is gone: the broker redelivers, and dedupe makes that harmless.
                warn!(error = %e, ?disposition, "could not settle delivery; the broker will redeliver it");
                Settled::Unsettled
            }
            Err(_) => {
                warn!(
                    ?disposition,
                    timeout_ms = SETTLE_TIMEOUT.as_millis() as u64,
                    "the broker did not take the ack in time; it will redeliver the delivery"
                );
                Settled::Unsettled
            }
        };
        if broker_trouble {
            Settled::BrokerTrouble
        } else {
            settled
        }
    }

    /// Admits the delivery (size and shape, before anything touches Redis: docs/design.md), then
    /// handles its envelope inside the task's span.
    async fn disposition(
        &self,
        publisher: &Channel,
        delivery: &Delivery,
    ) -> Result<Disposition, Interrupted> {
        let body = &delivery.body;
        let max = self.config.worker.max_message_bytes;
        let arrival = arrival(&self.names, delivery);
        match decision::admit(body, &arrival, max, |job| self.overlap.contains_key(job)) {
            Ok(env) => {
                let span = tracing::info_span!("task", key = %env.key, task = %env.task, attempt = env.attempt, worker = %self.worker_id);
                self.handle(publisher, delivery, env).instrument(span).await
            }
            Err(Rejected { reason, error }) => {
                if reason == DeadReason::Malformed {
                    self.stats.malformed.inc();
                }
                // The task label only when the envelope decodes (it broke a limit) and names
                // one of ours; an oversize body is not even decoded.
                let decoded = (reason == DeadReason::Malformed)
                    .then(|| Envelope::decode_delivered(body, &arrival).ok())
                    .flatten();
                let task = decoded
                    .as_ref()
                    .map_or(UNKNOWN_TASK, |env| self.task_label(&env.task));
                self.stats.outcome(task, RunOutcome::Malformed);
                self.journal_rejected(delivery, &arrival, reason, &error)
                    .await;
                self.dead_letter(publisher, delivery, None, reason, &error, 0)
                    .await?;
                Ok(Disposition::Ack)
            }
        }
    }

    /// A copy naming a task this worker does not have: recorded `dead` under its key, then
    /// dead-lettered `unknown_task`. Recorded first: a Redis failure requeues the copy (fail
    /// closed) and the repeat finds the key recorded.
    async fn unknown_task(
        &self,
        publisher: &Channel,
        delivery: &Delivery,
        env: &Envelope,
    ) -> Result<Disposition, Interrupted> {
        let Rejected { reason, error } = decision::unknown_task(&env.task);
        self.stats.outcome(UNKNOWN_TASK, RunOutcome::Dead);
        self.dead_unclaimed(&env.key, Some(env), reason, &error)
            .await?;
        self.dead_letter(publisher, delivery, Some(env), reason, &error, env.attempt)
            .await?;
        Ok(Disposition::Ack)
    }

    /// Journals a rejected delivery `dead` under its key when [`decision::rejected_key`] finds
    /// one it may speak for (docs/audit.md#the-journal). Best effort: a message refused this
    /// early must not wait on Redis or come back, so a failed write is only logged.
    async fn journal_rejected(
        &self,
        delivery: &Delivery,
        arrival: &Arrival<'_>,
        reason: DeadReason,
        error: &str,
    ) {
        let body = (reason != DeadReason::Oversize).then_some(&delivery.body[..]);
        let id = delivery.message_id.as_deref();
        let is_job = |job: &str| self.overlap.contains_key(job);
        let Some((key, env)) = decision::rejected_key(body, id, arrival, is_job) else {
            return;
        };
        if let Err(e) = self.dead_unclaimed(&key, env.as_ref(), reason, error).await {
            warn!(key = %key, error = %e, "could not journal the rejected message");
        }
    }

    /// Records an instance its copy left unrun (`reason`) as `dead` under `key`, with `env`'s
    /// run record for a job's instance, unless the key has a state already
    /// ([`Store::dead_unclaimed`]).
    async fn dead_unclaimed(
        &self,
        key: &str,
        env: Option<&Envelope>,
        reason: DeadReason,
        error: &str,
    ) -> Result<(), StoreError> {
        let error = format!("{reason}: {error}");
        let record = env.and_then(|env| self.run_record(env, Outcome::Dead, None, Some(error)));
        let job = env.and_then(|env| env.job.as_deref());
        let what = Unclaimed {
            key,
            reason: reason.as_str(),
            worker: &self.worker_id,
            attempt: env.map_or(0, |env| env.attempt),
            retention: self.config.worker.done_ttl,
            record: job.zip(record.as_ref()),
        };
        if !self.store.dead_unclaimed(&what).await? {
            debug!(
                key,
                "dead-lettered unrun; the instance was recorded already"
            );
        }
        Ok(())
    }

    /// Claims the instance and asks [`decision::on_claim`] what to do; when that is to run it,
    /// runs it and asks [`decision::after_run`] how the result settles. [`Processor::execute`] performs the answer.
    async fn handle(
        &self,
        publisher: &Channel,
        delivery: &Delivery,
        env: Envelope,
    ) -> Result<Disposition, Interrupted> {
        let (Some(handler), Some(task)) = (
            self.handlers.get(&env.task),
            self.config.tasks.get(&env.task),
        ) else {
            return self.unknown_task(publisher, delivery, &env).await;
        };
        if planted(Defect::DropDelivery) && env.attempt == 0 && planted::one_in(&env.key, 5) {
            return Ok(Disposition::Ack);
        }
        let token = uuid::Uuid::new_v4().to_string();
        let (claim, claimed_at) = self.claim(&env, &token, delivery.epoch).await?;
        let mut step = Step {
            publisher,
            delivery,
            env: &env,
            token: &token,
            started_at: None,
            ended: None,
        };
        let fence = match decision::on_claim(&claim) {
            Next::Run { fence } => fence,
            Next::Settle(action) => return self.execute(&step, action).await,
        };
        step.started_at = Some(now_text());
        let _in_use = self
            .limit(&env)
            .map(|l| Counted::new(self.stats.limit_in_use(&l.name)));
        self.stats
            .run_started(&env.task, Utc::now() - env.scheduled_for);
        let started = Instant::now();
        // `_renewing` keeps the lease renewed until the action has recorded the result.
        let (result, _renewing) = self
            .run(
                handler.clone(),
                (&env, &delivery.body),
                &token,
                fence,
                claimed_at,
            )
            .await;
        if planted(Defect::DoubleRun) && matches!(result, RunResult::Succeeded) {
            let delivered = (&env, &delivery.body[..]);
            let _ = self
                .run(handler.clone(), delivered, &token, fence, claimed_at)
                .await;
        }
        step.ended = Some(Instant::now());
        self.stats.run_ended(&env.task, started.elapsed());
        let jitter = rand::random::<f64>();
        let action = decision::after_run(fence, &result, task, env.attempt, jitter);
        self.execute(&step, action).await
    }

    /// Asks Redis for the instance (docs/design.md steps 3–4: dedupe, expiry, lease, overlap,
    /// limit). Over the task's limit, the delivery is held and claimed again with the same
    /// token as [`decision::on_limited`] says, for up to [`decision::LIMIT_HOLD`]
    /// (docs/design.md#limits). `epoch` is the publishing leader's, for the journal. Returns
    /// the last answer and when its claim was sent (the lease runs from there).
    async fn claim(
        &self,
        env: &Envelope,
        token: &str,
        epoch: u64,
    ) -> Result<(Claim, Instant), StoreError> {
        let limit = self.limit(env);
        let held_since = Instant::now();
        let mut waiting: Option<Counted> = None;
        let mut looks = 0;
        loop {
            let sent = Instant::now();
            // A start is reserved only as far ahead as this delivery will still be held.
            let left = decision::LIMIT_HOLD.saturating_sub(held_since.elapsed());
            let reserve_within = left.saturating_sub(Duration::from_millis(100));
            let limit = limit.map(|limit| LimitClaim {
                limit,
                reserve_within,
            });
            let claim = self.claim_once(env, token, limit, epoch).await?;
            let (Claim::Limited { retry_in, by }, Some(limit)) = (&claim, limit) else {
                return Ok((claim, sent));
            };
            let wait = match decision::on_limited(*retry_in, *by, held_since.elapsed(), looks) {
                LimitWait::Hold(wait) => wait,
                LimitWait::Release => return Ok((claim, sent)),
            };
            let name = &limit.limit.name;
            if waiting.is_none() {
                debug!(limit = %name, by = by.as_str(), "over the limit: waiting (not an attempt)");
                waiting = Some(Counted::new(self.stats.limit_waiting(name)));
            }
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                // Shutting down: no new run; the copy goes to a delay queue.
                _ = self.abandon.cancelled() => return Ok((claim, sent)),
            }
            looks += 1;
        }
    }

    /// One claim of `env` (see [`claim`](Self::claim)).
    async fn claim_once(
        &self,
        env: &Envelope,
        token: &str,
        limit: Option<LimitClaim<'_>>,
        epoch: u64,
    ) -> Result<Claim, StoreError> {
        self.store
            .claim(&ClaimRequest {
                key: &env.key,
                token,
                worker: &self.worker_id,
                job: env.job.as_deref(),
                attempt: env.attempt,
                lease: self.config.worker.lease,
                overlap: self.overlap(env),
                retention: self.config.worker.done_ttl,
                // Judged after dedupe (in the claim): an expired copy of a finished instance
                // is a duplicate, not a failure.
                expired: env.is_expired(Utc::now()),
                limit,
                epoch,
            })
            .await
    }

    /// Performs one [`Action`]: where a decision turns into broker and Redis calls.
    async fn execute(&self, step: &Step<'_>, action: Action) -> Result<Disposition, Interrupted> {
        let (publisher, env) = (step.publisher, step.env);
        match action {
            Action::Duplicate { state } => {
                info!(state = %state, redelivered = step.delivery.redelivered, "duplicate delivery: already finished or retried");
                self.stats.duplicates.inc();
                self.stats.outcome(&env.task, RunOutcome::Duplicate);
                self.pass_the_turn(publisher, env).await;
            }
            Action::Expire => self.expire(step).await?,
            Action::Recheck { why, delay } => self.recheck(step, why, delay).await?,
            Action::Skip { running } => {
                info!(running = %running, "skipped: the job's previous instance still runs (overlap = skip)");
                self.stats.skipped.inc();
                self.stats.outcome(&env.task, RunOutcome::Skipped);
                let error = Some(format!("{running} still running"));
                self.record(env, Outcome::Skipped, None, error).await;
            }
            Action::Done { fence } => return self.done(step, fence).await,
            Action::Retry { delay, error } => self.retry(step, delay, error).await?,
            Action::Dead { reason, error } => self.fail_dead(step, reason, &error).await?,
            Action::Requeue { lost } => {
                warn!(reason = ?lost, "lease lost mid-run: result not recorded; requeueing");
                self.stats.outcome(&env.task, RunOutcome::LeaseLost);
                if matches!(lost, LeaseLost::Unreachable(_)) {
                    self.gate.close();
                }
                return Ok(Disposition::Requeue);
            }
            Action::Release => {
                warn!("shutdown grace exhausted: abandoned; releasing the claim for redelivery");
                self.stats.abandoned.inc();
                self.stats.outcome(&env.task, RunOutcome::Abandoned);
                if let Ok(ended) = self
                    .holder(env)
                    .with_ended(step.ended)
                    .release(&env.key, self.lock_job(env), step.token)
                    .await
                {
                    self.wake(publisher, ended.woken).await;
                }
                return Ok(Disposition::Requeue);
            }
        }
        Ok(Disposition::Ack)
    }

    /// An instance that expired before it could run: dead-lettered `expired` and recorded;
    /// the job's turn passes to the next waiting copy.
    async fn expire(&self, step: &Step<'_>) -> Result<(), Interrupted> {
        let (publisher, env) = (step.publisher, step.env);
        info!("expired before it could run");
        self.stats.expired.inc();
        self.stats.outcome(&env.task, RunOutcome::Expired);
        let error = "expires_at passed before the run";
        let reason = DeadReason::Expired;
        self.dead_letter(
            publisher,
            step.delivery,
            Some(env),
            reason,
            error,
            env.attempt,
        )
        .await?;
        self.record(env, Outcome::Expired, None, None).await;
        self.pass_the_turn(publisher, env).await;
        Ok(())
    }

    /// A copy held back (another live lease, or the job's lock under `overlap = "queue"`):
    /// a copy to look again after `delay`, and, for the job's lock, a place in its waiters.
    async fn recheck(
        &self,
        step: &Step<'_>,
        why: Recheck,
        delay: Duration,
    ) -> Result<(), Interrupted> {
        let delay_ms = delay.as_millis() as u64;
        match why {
            Recheck::Busy => debug!(delay_ms, "held under another live lease; re-checking later"),
            Recheck::Waiting { ref running } => debug!(running = %running, delay_ms,
                "waiting for the job's lock (overlap = queue, or a started instance)"),
            Recheck::Limited { by } => debug!(
                by = by.as_str(),
                delay_ms, "over the task's limit: looking again later (not an attempt)"
            ),
        }
        self.stats.busy.inc();
        self.publish_delayed(step.publisher, step.delivery, step.env, delay)
            .await?;
        if let (Recheck::Waiting { .. }, OverlapMode::Queue(job) | OverlapMode::Skip(job)) =
            (&why, self.overlap(step.env))
        {
            self.park(step, job, delay).await?;
        }
        Ok(())
    }

    /// Marks a success `done` and records it; requeues when another worker claimed the
    /// instance before the result could be recorded.
    async fn done(&self, step: &Step<'_>, fence: u64) -> Result<Disposition, Interrupted> {
        let record = self.run_record(step.env, Outcome::Done, step.started_at.clone(), None);
        let ended = self
            .finish_with_retries(step, Final::Done, record.as_ref())
            .await?;
        self.wake(step.publisher, ended.woken).await;
        if ended.ours {
            info!(fence, "done");
            self.stats.succeeded.inc();
            self.stats.outcome(&step.env.task, RunOutcome::Success);
            Ok(Disposition::Ack)
        } else {
            warn!("succeeded, but another worker claimed the instance before it could be recorded; requeueing");
            self.stats.outcome(&step.env.task, RunOutcome::LeaseLost);
            Ok(Disposition::Requeue)
        }
    }

    /// Publishes attempt + 1 after `delay`, then hands the claim over to it.
    async fn retry(
        &self,
        step: &Step<'_>,
        delay: Duration,
        error: String,
    ) -> Result<(), Interrupted> {
        let env = step.env;
        warn!(error = %error, delay_ms = delay.as_millis() as u64, "failed; retrying");
        self.record(env, Outcome::Failed, step.started_at.clone(), Some(error))
            .await;
        let mut next = env.clone();
        next.attempt = env.attempt.saturating_add(1);
        next.id = uuid::Uuid::new_v4();
        next.published_at = Utc::now();
        // Publish the retry first, then hand the claim to it: if we crash in between, our
        // lease expires and the retry (or a redelivery) takes over. Marking `retrying` instead
        // of deleting the claim makes every older copy a duplicate, so no copy starts a second
        // chain.
        if !planted(Defect::SkipRetry) {
            self.publish_delayed(step.publisher, step.delivery, &next, delay)
                .await?;
        }
        // The instance keeps its job through the retry delay, until a lease past it if the
        // retry's message is lost (docs/guarantees.md#overlap).
        let ending = Ending::Retry {
            next_attempt: next.attempt,
            hold: retry::bucket(delay) + self.config.worker.lease,
        };
        let retention = self.config.worker.done_ttl;
        let job = self.lock_job(env);
        let holder = self.holder(env).with_ended(step.ended);
        let handed =
            outcome_write_retried(|| holder.finish(&env.key, job, step.token, ending, retention))
                .await;
        match handed {
            Ok(Ended { ours: true, woken }) => self.wake(step.publisher, woken).await,
            Ok(Ended { ours: false, woken }) => {
                self.wake(step.publisher, woken).await;
                // Our lease lapsed and another copy took the instance over: its attempt is
                // recorded, and ours is a duplicate when it arrives.
                warn!("the retry is published, but another claim holds the instance now");
            }
            Err(e) => {
                // The retry copy is confirmed and carries the instance: once our lease lapses
                // it takes over (its attempt is never older than the recorded one). Requeueing
                // this copy instead would repeat this attempt.
                error!(error = %e, "redis unreachable: the retry is published but not handed over; pausing (fail closed)");
                self.gate.close();
            }
        }
        self.stats.retried.inc();
        self.stats.outcome(&env.task, RunOutcome::Retry);
        Ok(())
    }

    /// Registers a copy that found its job's overlap lock held, so the worker that releases
    /// the lock publishes it again at once (docs/design.md#waiting-copies-wake-up); the copy
    /// just sent to the delay queue stays as the fallback, and dedupe absorbs whichever of the
    /// two comes second. When the lock was released meanwhile, the copy is published now.
    async fn park(&self, step: &Step<'_>, job: &str, delay: Duration) -> Result<(), Interrupted> {
        let waiter = Waiter {
            epoch: step.delivery.epoch,
            body: step.env.encode(),
        };
        // Kept until well after the fallback copy: an entry woken later is only a duplicate.
        let keep = delay * 2 + Duration::from_secs(1);
        if !self.store.park(job, &waiter, keep).await? {
            debug!("the job's lock was released meanwhile: looking again now");
            self.publish_woken(step.publisher, waiter).await?;
        }
        Ok(())
    }

    /// After a copy of a job with an overlap lock ended without holding the lock (a
    /// duplicate, an expired copy), wakes the next waiting copy if the lock is free: the copy
    /// may itself have been woken, and the turn must not stop with it.
    pub(crate) async fn pass_the_turn(&self, publisher: &Channel, env: &Envelope) {
        let (OverlapMode::Queue(job) | OverlapMode::Skip(job)) = self.overlap(env) else {
            return;
        };
        match self.store.wake(job).await {
            Ok(woken) => self.wake(publisher, woken).await,
            Err(e) => debug!(error = %e, "could not look for a waiting copy"),
        }
    }

    /// Publishes a copy taken off the job's waiters to its work queue. Best effort: its own
    /// fallback copy is in a delay queue already.
    async fn wake(&self, publisher: &Channel, woken: Option<Waiter>) {
        let Some(waiter) = woken else { return };
        if let Err(e) = self.publish_woken(publisher, waiter).await {
            warn!(error = %e, "could not wake a waiting copy; it looks again from its delay queue");
        }
    }

    /// Publishes `waiter` to its work queue with confirms.
    async fn publish_woken(&self, publisher: &Channel, waiter: Waiter) -> Result<(), Interrupted> {
        let Ok(env) = Envelope::decode(&waiter.body) else {
            warn!("an unreadable waiting copy was dropped; its delay queue copy remains");
            return Ok(());
        };
        let props = drumline_shared::broker::properties(&env, Utc::now(), waiter.epoch);
        // Straight to the work queue (the default exchange), as re-check copies go straight
        // to their delay queue: the tasks exchange carries only what producers publish.
        let queue = self.names.work_queue(&env.queue);
        debug!(key = %env.key, "waking a waiting copy");
        Ok(broker::publish_confirmed(publisher, "", &queue, false, &waiter.body, props).await?)
    }

    /// Runs the handler under the lease watchdog, with `env` and the body it was `delivered` in
    /// (the HTTP executor sends it as is). `claimed_at` is when the claim was sent: the
    /// lease runs from there (docs/design.md "Lease loss stops the run in time"). A finished run
    /// comes with its [`Renewing`] watchdog, which renews the lease until it is dropped.
    async fn run(
        &self,
        handler: Arc<dyn Handler>,
        (env, delivered): (&Envelope, &[u8]),
        token: &str,
        fence: u64,
        claimed_at: Instant,
    ) -> (RunResult, Option<Renewing>) {
        let budget = lease::Budget::new(self.config.worker.lease);
        let cancel = CancellationToken::new();
        let lost = CancellationToken::new();
        let stop_watchdog = CancellationToken::new();
        let (expiry_tx, expiry) = tokio::sync::watch::channel(claimed_at + budget.lease);
        let held = lease::Held {
            store: self.holder(env),
            key: env.key.clone(),
            job: self.lock_job(env).map(str::to_owned),
            token: token.to_owned(),
        };
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
        let ctx = context(env, fence, cancel.clone(), budget.kill_grace());
        self.stats.running.inc();
        // The lease goes along for a shell task's supervisor, which stops the task at the
        // loss's instant even if this worker is frozen then (docs/design.md#the-task-supervisor).
        let clock = lease::LeaseClock::new(expiry.clone(), budget);
        let call = lease::with_lease(clock, || {
            crate::http::with_delivered(delivered.into(), || handler::call_guarded(&*handler, ctx))
        });
        let stopped = self.call(call, cancel, &lost, expiry.clone(), budget).await;
        let given_up = budget.given_up(*expiry.borrow(), Instant::now());
        if matches!(&stopped, Stopped::Returned(Err(e)) if e.is_panic()) {
            self.stats.panics.inc();
        }
        self.stats.running.dec();
        let renewing = Renewing {
            stop: stop_on_drop.disarm(),
            watchdog,
        };
        renewing
            .settle(stopped, lost.is_cancelled(), given_up)
            .await
    }

    /// Awaits the handler's `call` until it returns, the lease is `lost` or the shutdown grace
    /// runs out; an end that is ready counts over a loss, and a loss noticed late waits
    /// [`lease::Budget::catch_up`] for an end reached unseen. When stopped, the handler is told
    /// (the shell executor SIGTERMs its group, then SIGKILLs it after `kill_grace`) and dropped
    /// before the lease could be taken whatever it does: dropping a shell run SIGKILLs its group.
    async fn call(
        &self,
        mut call: HandlerFuture,
        cancel: CancellationToken,
        lost: &CancellationToken,
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
            _ = self.abandon.cancelled() => Stopped::Abandoned,
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

    /// Marks `key` finished, retrying a Redis blip or a Sentinel failover
    /// ([`outcome_write_retried`]): a success we fail to record would run again once the lease
    /// expires.
    async fn finish_with_retries(
        &self,
        step: &Step<'_>,
        state: Final,
        record: Option<&RunRecord>,
    ) -> Result<Ended, StoreError> {
        let (env, token) = (step.env, step.token);
        let retention = self.config.worker.done_ttl;
        let job = self.lock_job(env);
        let holder = self.holder(env).with_ended(step.ended);
        outcome_write_retried(|| {
            holder.finish_recorded(&env.key, job, token, state, retention, record)
        })
        .await
    }

    /// Dead-letters after a run, marks the instance `dead` and records it.
    async fn fail_dead(
        &self,
        step: &Step<'_>,
        reason: DeadReason,
        error: &str,
    ) -> Result<(), Interrupted> {
        match reason {
            DeadReason::Permanent => warn!(error = %error, "permanent failure: dead-lettering"),
            _ => warn!(error = %error, "failed; retries exhausted: dead-lettering"),
        }
        let env = step.env;
        let runs = env.attempt.saturating_add(1);
        self.dead_letter(
            step.publisher,
            step.delivery,
            Some(env),
            reason,
            error,
            runs,
        )
        .await?;
        let started_at = step.started_at.clone();
        let record = self.run_record(env, Outcome::Dead, started_at, Some(error.to_owned()));
        let ended = self
            .finish_with_retries(step, Final::Dead, record.as_ref())
            .await?;
        self.wake(step.publisher, ended.woken).await;
        self.stats.outcome(&env.task, RunOutcome::Dead);
        Ok(())
    }

    /// The run record of `env`'s run, for its job's history (ad-hoc tasks have none).
    fn run_record(
        &self,
        env: &Envelope,
        outcome: Outcome,
        started_at: Option<String>,
        error: Option<String>,
    ) -> Option<RunRecord> {
        env.job.as_ref()?;
        Some(RunRecord {
            key: env.key.clone(),
            scheduled_for: envelope::format_instant(env.scheduled_for),
            status: outcome.as_str().to_owned(),
            attempt: env.attempt,
            worker: self.worker_id.clone(),
            started_at,
            finished_at: now_text(),
            error,
            // An `after` job's skips are recorded by the beat with reason `upstream`.
            reason: (outcome == Outcome::Skipped).then(|| "overlap".to_owned()),
        })
    }

    /// Appends to the job's history (ad-hoc tasks have none); the outcomes that end a claim in
    /// a final state record through [`Store::finish_recorded`] instead.
    pub(crate) async fn record(
        &self,
        env: &Envelope,
        outcome: Outcome,
        started_at: Option<String>,
        error: Option<String>,
    ) {
        let (Some(job), Some(record)) =
            (&env.job, self.run_record(env, outcome, started_at, error))
        else {
            return;
        };
        let retention = self.config.worker.done_ttl;
        if let Err(e) = self.store.record(job, &record, retention).await {
            // History is for people; the run state (already written) is what dedupe relies on.
            warn!(error = %e, "could not append to the job history");
        }
    }

    /// Publishes `env` (a retry or a re-check of `delivery`) to the delay queue of `delay`,
    /// with the epoch of the copy it comes from.
    async fn publish_delayed(
        &self,
        publisher: &Channel,
        delivery: &Delivery,
        env: &Envelope,
        delay: Duration,
    ) -> Result<(), Interrupted> {
        let delay = retry::bucket(delay);
        let queue = broker::declare_delay_queue(publisher, &self.names, &env.queue, delay).await?;
        let props = broker::properties(env, Utc::now(), delivery.epoch);
        Ok(broker::publish_confirmed(publisher, "", &queue, false, &env.encode(), props).await?)
    }

    /// Publishes `env` (encoded, with its own properties and the epoch of `delivery`), or, with
    /// none, `delivery` as it came, to `{ns}.dead` with the reason headers (docs/design.md) and
    /// waits for the confirm. Keeps the properties, minus any per-message expiration.
    async fn dead_letter(
        &self,
        publisher: &Channel,
        delivery: &Delivery,
        env: Option<&Envelope>,
        reason: DeadReason,
        error: &str,
        attempts: u32,
    ) -> Result<(), Interrupted> {
        warn!(reason = reason.as_str(), error, "dead-lettering");
        self.stats.dead_lettered.inc();
        let why = DeadHeaders {
            reason: reason.as_str(),
            error,
            attempts,
        };
        let now = Utc::now();
        let (body, out) = match env {
            Some(env) => {
                let own = broker::properties(env, now, delivery.epoch);
                (env.encode(), broker::dead_letter_properties(&own, why, now))
            }
            None => {
                let out = broker::dead_letter_properties(delivery.properties(), why, now);
                (delivery.body.clone(), out)
            }
        };
        Ok(broker::publish_confirmed(publisher, &self.names.dead(), "", false, &body, out).await?)
    }
}

/// A gauge counted up while this lives (`drumline_limit_in_use`, `drumline_limit_waiting`).
struct Counted(Gauge);

impl Counted {
    fn new(gauge: Gauge) -> Self {
        gauge.inc();
        Counted(gauge)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Runs an outcome write (`done`, `dead`, the retry hand-over) until it answers, retrying a
/// Redis error (a blip, a failover, a `WAIT` shortfall) for up to [`FINISH_RETRY_FOR`] from
/// the first failure. Repeating is safe: a write that landed although its reply was lost is
/// found by its own token and reported recorded (docs/design.md#outcome-writes-are-idempotent).
async fn outcome_write_retried<F, Fut>(mut write: F) -> Result<Ended, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Ended, StoreError>>,
{
    let mut backoff = FINISH_BACKOFF;
    let mut give_up = None;
    loop {
        match write().await {
            Ok(ended) => return Ok(ended),
            Err(e) => {
                let give_up = *give_up.get_or_insert_with(|| Instant::now() + FINISH_RETRY_FOR);
                let delay = backoff.next_delay();
                if Instant::now() + delay >= give_up {
                    return Err(e);
                }
                warn!(error = %e, "could not record the outcome yet; retrying");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// What the delivery says about its message besides the body: the defaults of the fields a
/// producer may omit (docs/envelope.md). The AMQP timestamp has whole seconds only; without
/// one, the message was published when it arrived, as far as we can tell.
pub(crate) fn arrival<'a>(names: &Names, delivery: &'a Delivery) -> Arrival<'a> {
    let stamped = delivery
        .timestamp
        .and_then(|t| chrono::DateTime::from_timestamp(t.min(i64::MAX as u64) as i64, 0));
    Arrival {
        routing_key: names.logical_queue(&delivery.routing_key),
        published_at: stamped.unwrap_or_else(Utc::now),
    }
}

/// One delivery being handled: what every action needs.
struct Step<'a> {
    publisher: &'a Channel,
    delivery: &'a Delivery,
    env: &'a Envelope,
    /// Our claim's token.
    token: &'a str,
    /// When the run started; `None` before a run.
    started_at: Option<String>,
    /// When the run ended, for the journal ([`Store::with_ended`]); `None` before a run's end.
    ended: Option<Instant>,
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
    fence: u64,
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
    }
}

/// A run's lease watchdog, still renewing; stopped when dropped.
struct Renewing {
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

/// Task-name lookup used by [`crate::Worker`]: every configured task with a `command` gets the
/// shell executor, one with `http` the HTTP executor, unless a Rust handler was registered for
/// it. An `http` task whose secret is missing from the environment is a config error.
pub fn resolve_handlers(
    config: &Config,
    custom: &HashMap<String, Arc<dyn Handler>>,
) -> Result<HashMap<String, Arc<dyn Handler>>, WorkerError> {
    let mut handlers = HashMap::new();
    for (name, task) in &config.tasks {
        let handler: Arc<dyn Handler> = match custom.get(name) {
            // The executors keep their own timeout; a Rust handler gets this one.
            Some(h) => match task.timeout {
                Some(timeout) => Arc::new(handler::WithTimeout {
                    inner: h.clone(),
                    timeout,
                }),
                None => h.clone(),
            },
            None => built_in(config, task)?.ok_or_else(|| WorkerError::NoHandler {
                path: config.path.clone(),
                task: name.clone(),
            })?,
        };
        handlers.insert(name.clone(), handler);
    }
    if let Some(name) = custom.keys().find(|name| !config.tasks.contains_key(*name)) {
        return Err(WorkerError::UnknownTask {
            path: config.path.clone(),
            task: name.clone(),
        });
    }
    Ok(handlers)
}

/// Job name → overlap policy, from `config`.
pub fn overlaps(config: &Config) -> HashMap<String, Overlap> {
    config
        .jobs
        .iter()
        .map(|j| (j.name.clone(), j.spec.overlap))
        .collect()
}

/// The built-in executor of `task`: its `command` (shell) or its `http` endpoint, if either.
fn built_in(config: &Config, task: &Task) -> Result<Option<Arc<dyn Handler>>, WorkerError> {
    let http = crate::http::HttpExecutor::for_task(task, |var| std::env::var(var).ok()).map_err(
        |source| WorkerError::Http {
            path: config.path.clone(),
            source,
        },
    )?;
    if let Some(http) = http {
        return Ok(Some(Arc::new(http)));
    }
    Ok(
        crate::executor::ShellExecutor::for_task(task, &config.hidden_from_tasks())
            .map(|e| Arc::new(e) as Arc<dyn Handler>),
    )
}
