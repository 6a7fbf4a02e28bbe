//! One delivery, start to finish (docs/design.md): admit → claim → run (with the lease watchdog) →
//! record → ack. The thin driver of the delivery's [`crate::machine`] (no I/O; what each answer
//! means is [`crate::decision`]'s): it performs each effect the machine hands out and hands it
//! the answer, touching the broker (publish, ack) and Redis (the [`Store`]); the run itself is
//! [`crate::run`]'s. Every path ends in exactly one ack or one requeue; nothing is requeued that
//! would fail the same way again (those go to `{ns}.dead`).

use crate::acks::{Settled, Ticket, SETTLE_TIMEOUT};
use crate::decision::{self, Outcome, Recheck, Rejected, RunResult};
use crate::handler::{self, Handler};
use crate::lease;
use crate::machine::{Effect, Event, Facts, Failure, Finish, Machine, Report, Settle};
use crate::retry;
use crate::run::{self, Renewing};
use crate::stats::{RunOutcome, Stats, UNKNOWN_TASK};
use crate::{Gate, WorkerError};
use chrono::Utc;
use drumline_shared::broker::{self, BrokerError, Channel, DeadHeaders, Delivery};
use drumline_shared::config::{Config, Limit, Overlap, Task};
use drumline_shared::envelope::{self, Arrival, DeadReason, Envelope};
use drumline_shared::names::Names;
use drumline_shared::planted::{self, planted, Defect};
use drumline_shared::run::LimitedBy;
use drumline_shared::spans::{self, Span};
use drumline_shared::store::{
    now_text, Claim, ClaimRequest, Ended, Ending, Final, LimitClaim, OverlapMode, RunRecord, Store,
    StoreError, Unclaimed, Waiter,
};
use drumline_shared::trace::TraceParent;
use prometheus_client::metrics::gauge::Gauge;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn, Instrument};

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
    /// list gets the policy its message carries, else the default, `skip`.
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
        // The worker's config first; a job it does not list (a schedule applied at run time)
        // by the policy its message carries.
        let overlap = self.overlap.get(job).copied().or(env.overlap);
        match overlap.unwrap_or_default() {
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
            Settle::Ack => Disposition::Ack,
            Settle::Requeue => Disposition::Requeue,
            Settle::Interrupted(Failure::Redis(e)) => {
                error!(error = %e, "redis unreachable: requeueing and pausing (fail closed)");
                self.gate.close();
                Disposition::Requeue
            }
            Settle::Interrupted(Failure::Broker(e)) => {
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
    async fn disposition(&self, publisher: &Channel, delivery: &Delivery) -> Settle {
        let body = &delivery.body;
        let max = self.config.worker.max_message_bytes;
        let arrival = arrival(&self.names, delivery);
        match decision::admit(body, &arrival, max, |job| self.overlap.contains_key(job)) {
            Ok(env) => {
                let span = tracing::info_span!("task", key = %env.key, task = %env.task, attempt = env.attempt, worker = %self.worker_id);
                self.handle(publisher, delivery, env).instrument(span).await
            }
            Err(rejected) => {
                let rejected = self.rejected(publisher, delivery, &arrival, rejected);
                settled(rejected.await)
            }
        }
    }

    /// A message refused before anything touches Redis: counted, journaled under a key it
    /// carries (best effort), dead-lettered as it came.
    async fn rejected(
        &self,
        publisher: &Channel,
        delivery: &Delivery,
        arrival: &Arrival<'_>,
        Rejected { reason, error }: Rejected,
    ) -> Result<(), Interrupted> {
        if reason == DeadReason::Malformed {
            self.stats.malformed.inc();
        }
        // The task label only when the envelope decodes (it broke a limit) and names one of
        // ours; an oversize body is not even decoded.
        let decoded = (reason == DeadReason::Malformed)
            .then(|| Envelope::decode_delivered(&delivery.body, arrival).ok())
            .flatten();
        let task = decoded
            .as_ref()
            .map_or(UNKNOWN_TASK, |env| self.task_label(&env.task));
        self.stats.outcome(task, RunOutcome::Malformed);
        self.journal_rejected(delivery, arrival, reason, &error)
            .await;
        self.dead_letter(publisher, delivery, None, reason, &error, 0)
            .await
    }

    /// A copy naming a task this worker does not have: recorded `dead` under its key, then
    /// dead-lettered `unknown_task`. Recorded first: a Redis failure requeues the copy (fail
    /// closed) and the repeat finds the key recorded.
    async fn unknown_task(
        &self,
        publisher: &Channel,
        delivery: &Delivery,
        env: &Envelope,
    ) -> Result<(), Interrupted> {
        let Rejected { reason, error } = decision::unknown_task(&env.task);
        self.stats.outcome(UNKNOWN_TASK, RunOutcome::Dead);
        self.dead_unclaimed(&env.key, Some(env), reason, &error)
            .await?;
        self.dead_letter(publisher, delivery, Some(env), reason, &error, env.attempt)
            .await
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

    /// Drives the delivery's [`Machine`]: performs each effect it hands out (claim, run under
    /// the lease, record, publish) and hands it the answer, until it says how to settle.
    async fn handle(&self, publisher: &Channel, delivery: &Delivery, env: Envelope) -> Settle {
        let (Some(handler), Some(task)) = (
            self.handlers.get(&env.task),
            self.config.tasks.get(&env.task),
        ) else {
            return settled(self.unknown_task(publisher, delivery, &env).await);
        };
        if planted(Defect::DropDelivery) && env.attempt == 0 && planted::one_in(&env.key, 5) {
            return Settle::Ack;
        }
        let facts = Facts {
            task,
            attempt: env.attempt,
            limited: self.limit(&env).is_some(),
            parks: matches!(
                self.overlap(&env),
                OverlapMode::Queue(_) | OverlapMode::Skip(_)
            ),
            lease: self.config.worker.lease,
            start: decision::on_delivery(&env, Utc::now()),
        };
        let token = uuid::Uuid::new_v4().to_string();
        let mut step = Step {
            publisher,
            delivery,
            env: &env,
            handler,
            token: &token,
            trace: env
                .trace
                .map_or_else(TraceParent::root, |parent| parent.child()),
            started_at: None,
            ended: None,
            record: None,
            renewing: None,
            in_use: None,
            waiting: None,
        };
        let mut machine = Machine::new(facts, Instant::now());
        while let Some(effect) = machine.poll() {
            if let Effect::Settle(settle) = effect {
                return settle;
            }
            if let Some(event) = self.perform(&mut step, effect).await {
                machine.handle(event, Instant::now());
            }
        }
        // The machine ends every path with `Settle`; were it ever left waiting, the copy goes
        // back rather than hang.
        error!("the delivery's machine stopped without settling it; requeueing");
        Settle::Requeue
    }

    /// Performs one effect; the answer the machine waits for, if it waits for one.
    async fn perform(&self, step: &mut Step<'_>, effect: Effect) -> Option<Event> {
        if !matches!(effect, Effect::Claim { .. } | Effect::Hold { .. }) {
            step.waiting = None;
        }
        let timed = spans::enabled().then(|| (span_name(&effect), SystemTime::now()));
        let event = match effect {
            Effect::Claim { reserve_within } => self.claim(step, reserve_within).await,
            Effect::Hold { wait, by, first } => self.hold(step, wait, by, first).await,
            Effect::Run { fence, claimed_at } => self.run_step(step, fence, claimed_at).await,
            Effect::WriteAgain(delay) => {
                tokio::time::sleep(delay).await;
                Event::TimerFired
            }
            Effect::Finish(finish) => answer(self.finish(step, finish).await.map(Event::Written)),
            Effect::Release => answer(self.release(step).await.map(Event::Written)),
            Effect::Park { delay } => answer(self.park(step, delay).await.map(Event::Parked)),
            publish @ (Effect::PublishDelayed { .. }
            | Effect::DeadLetter { .. }
            | Effect::PublishWoken) => {
                answer(self.publish(step, publish).await.map(|()| Event::Done))
            }
            told => {
                self.tell(step, told).await;
                return None;
            }
        };
        if let Some((Some(name), start)) = timed {
            // Under the publish; without one, the run is the trace's root and the others its.
            let ids = match name {
                "run" => (step.trace, step.env.trace),
                _ => (step.trace.child(), step.env.trace.or(Some(step.trace))),
            };
            let failed = match &event {
                Event::Failed(_) => true,
                Event::RunEnded { result, .. } => !matches!(result, RunResult::Succeeded),
                _ => false,
            };
            spans::record(Span::of(name, step.env, ids, start).failed_if(failed));
        }
        Some(event)
    }

    /// Performs a publish the machine waits on: a copy to a delay queue, a dead letter, the
    /// copy itself to its work queue.
    async fn publish(&self, step: &Step<'_>, effect: Effect) -> Result<(), Interrupted> {
        let (publisher, env) = (step.publisher, step.env);
        match effect {
            Effect::PublishDelayed {
                next_attempt,
                delay,
            } => self.publish_copy(step, next_attempt, delay).await,
            Effect::DeadLetter {
                reason,
                error,
                attempts,
            } => {
                let delivery = step.delivery;
                (self.dead_letter(publisher, delivery, Some(env), reason, &error, attempts)).await
            }
            Effect::PublishWoken => self.publish_woken(publisher, waiter_of(step)).await,
            _ => Ok(()),
        }
    }

    /// Performs an effect the machine does not wait on: a report, a best-effort write or
    /// publish, the gate.
    async fn tell(&self, step: &Step<'_>, effect: Effect) {
        let (publisher, env) = (step.publisher, step.env);
        match effect {
            Effect::Report(report) => self.report(step, report),
            Effect::Record(outcome, error) => {
                let started_at = step.started_at.clone();
                self.record(env, outcome, started_at, error).await
            }
            Effect::PassTheTurn => self.pass_the_turn(publisher, env).await,
            Effect::Wake(waiter) => self.wake(publisher, Some(waiter)).await,
            Effect::CloseGate => self.gate.close(),
            // The others are answered (`perform`), and `Settle` is taken by `handle`.
            _ => {}
        }
    }

    /// Claims the instance; the answer, and when its claim was sent (the lease runs from
    /// there). Over the task's limit, a start is reserved at most `reserve_within` ahead
    /// (docs/design.md#limits).
    async fn claim(&self, step: &Step<'_>, reserve_within: Duration) -> Event {
        let env = step.env;
        let sent = Instant::now();
        let limit = self.limit(env).map(|limit| LimitClaim {
            limit,
            reserve_within,
        });
        let epoch = step.delivery.epoch;
        match self.claim_once(env, step.token, limit, epoch).await {
            Ok(claim) => Event::Claimed { claim, sent },
            Err(e) => Event::Failed(Interrupted::from(e).into()),
        }
    }

    /// Holds a delivery over its task's limit for `wait` (not an attempt); a shutdown ends
    /// the hold at once: no new run, the copy goes to a delay queue.
    async fn hold(&self, step: &mut Step<'_>, wait: Duration, by: LimitedBy, first: bool) -> Event {
        if let (true, Some(limit)) = (first, self.limit(step.env)) {
            debug!(limit = %limit.name, by = by.as_str(), "over the limit: waiting (not an attempt)");
            step.waiting = Some(Counted::new(self.stats.limit_waiting(&limit.name)));
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => Event::TimerFired,
            _ = self.abandon.cancelled() => Event::Shutdown,
        }
    }

    /// Runs the handler under the claim's lease; the watchdog is kept renewing in `step`
    /// until the result is recorded.
    async fn run_step(&self, step: &mut Step<'_>, fence: u64, claimed_at: Instant) -> Event {
        let env = step.env;
        step.started_at = Some(now_text());
        step.in_use = (self.limit(env)).map(|l| Counted::new(self.stats.limit_in_use(&l.name)));
        self.stats
            .run_started(&env.task, Utc::now() - env.scheduled_for);
        let started = Instant::now();
        let held = lease::Held {
            store: self.holder(env),
            key: env.key.clone(),
            job: self.lock_job(env).map(str::to_owned),
            token: step.token.to_owned(),
        };
        let one = run::Run {
            handler: step.handler.clone(),
            env,
            trace: step.trace,
            delivered: &step.delivery.body,
            held,
            fence,
            claimed_at,
            budget: lease::Budget::new(self.config.worker.lease),
        };
        let (result, renewing) = run::run(one.clone(), &self.stats, &self.abandon).await;
        if planted(Defect::DoubleRun) && matches!(result, RunResult::Succeeded) {
            let _ = run::run(one, &self.stats, &self.abandon).await;
        }
        step.renewing = renewing;
        step.ended = Some(Instant::now());
        self.stats.run_ended(&env.task, started.elapsed());
        let jitter = rand::random::<f64>();
        Event::RunEnded { result, jitter }
    }

    /// Publishes `step`'s copy to the delay queue of `delay`: itself again, or its retry at
    /// `next_attempt` (a new id, published now).
    async fn publish_copy(
        &self,
        step: &Step<'_>,
        next_attempt: Option<u32>,
        delay: Duration,
    ) -> Result<(), Interrupted> {
        let (publisher, delivery) = (step.publisher, step.delivery);
        let Some(attempt) = next_attempt else {
            return self
                .publish_delayed(publisher, delivery, step.env, delay)
                .await;
        };
        if planted(Defect::SkipRetry) {
            return Ok(());
        }
        let mut next = step.env.clone();
        next.attempt = attempt;
        next.id = uuid::Uuid::new_v4();
        next.published_at = Utc::now();
        self.publish_delayed(publisher, delivery, &next, delay)
            .await
    }

    /// Registers a copy that found its job's overlap lock held, so the worker that releases
    /// the lock publishes it again at once (docs/design.md#waiting-copies-wake-up); the copy
    /// just sent to the delay queue stays as the fallback, and dedupe absorbs whichever of the
    /// two comes second. `false`: the lock was released meanwhile.
    async fn park(&self, step: &Step<'_>, delay: Duration) -> Result<bool, Interrupted> {
        let (OverlapMode::Queue(job) | OverlapMode::Skip(job)) = self.overlap(step.env) else {
            return Ok(true);
        };
        let waiter = waiter_of(step);
        // Kept until well after the fallback copy: an entry woken later is only a duplicate.
        let keep = delay * 2 + Duration::from_secs(1);
        Ok(self.store.park(job, &waiter, keep).await?)
    }

    /// Writes the claim's outcome: `done` or `dead` with the run record (made once, for every
    /// try), or the hand-over to the retry. A success we fail to record would run again once
    /// the lease expires: the machine retries a failed write.
    async fn finish(&self, step: &mut Step<'_>, finish: Finish) -> Result<Ended, Interrupted> {
        let env = step.env;
        let retention = self.config.worker.done_ttl;
        let (job, token) = (self.lock_job(env), step.token);
        let holder = self.holder(env).with_ended(step.ended);
        let (state, outcome, error) = match finish {
            Finish::Retry { next_attempt, hold } => {
                let ending = Ending::Retry { next_attempt, hold };
                return Ok(holder
                    .finish(&env.key, job, token, ending, retention)
                    .await?);
            }
            Finish::Done { .. } => (Final::Done, Outcome::Done, None),
            Finish::Dead { error } => (Final::Dead, Outcome::Dead, Some(error)),
        };
        let started_at = step.started_at.clone();
        let record = (step.record)
            .get_or_insert_with(|| self.run_record(env, outcome, started_at, error))
            .as_ref();
        Ok(holder
            .finish_recorded(&env.key, job, token, state, retention, record)
            .await?)
    }

    /// Releases an abandoned run's claim for redelivery.
    async fn release(&self, step: &Step<'_>) -> Result<Ended, Interrupted> {
        let env = step.env;
        let holder = self.holder(env).with_ended(step.ended);
        Ok(holder
            .release(&env.key, self.lock_job(env), step.token)
            .await?)
    }

    /// Logs and counts what the machine reports before a run, or hands the rest on.
    fn report(&self, step: &Step<'_>, report: Report) {
        let task = &step.env.task;
        match report {
            Report::Duplicate(state) => {
                let redelivered = step.delivery.redelivered;
                info!(state = %state, redelivered, "duplicate delivery: already finished or retried");
                self.stats.duplicates.inc();
                self.stats.outcome(task, RunOutcome::Duplicate);
            }
            Report::Expired => {
                info!("expired before it could run");
                self.stats.expired.inc();
                self.stats.outcome(task, RunOutcome::Expired);
            }
            Report::Recheck(why, delay) => self.report_recheck(why, delay),
            Report::LockReleased => {
                debug!("the job's lock was released meanwhile: looking again now")
            }
            Report::Skipped(running) => {
                info!(running = %running, "skipped: the job's previous instance still runs (overlap = skip)");
                self.stats.skipped.inc();
                self.stats.outcome(task, RunOutcome::Skipped);
            }
            Report::LeaseLost(lost) => {
                warn!(reason = ?lost, "lease lost mid-run: result not recorded; requeueing");
                self.stats.outcome(task, RunOutcome::LeaseLost);
            }
            Report::Abandoned => {
                warn!("shutdown grace exhausted: abandoned; releasing the claim for redelivery");
                self.stats.abandoned.inc();
                self.stats.outcome(task, RunOutcome::Abandoned);
            }
            report => self.report_outcome(task, report),
        }
    }

    /// Logs and counts a recorded outcome, or a try at recording it.
    fn report_outcome(&self, task: &str, report: Report) {
        match report {
            Report::Succeeded(fence) => {
                info!(fence, "done");
                self.stats.succeeded.inc();
                self.stats.outcome(task, RunOutcome::Success);
            }
            Report::Overtaken => {
                warn!("succeeded, but another worker claimed the instance before it could be recorded; requeueing");
                self.stats.outcome(task, RunOutcome::LeaseLost);
            }
            Report::Retrying(delay, error) => {
                let delay_ms = delay.as_millis() as u64;
                warn!(error = %error, delay_ms, "failed; retrying");
            }
            Report::HandedOverLate => {
                warn!("the retry is published, but another claim holds the instance now")
            }
            Report::HandOverFailed(error) => error!(error = %error,
                "redis unreachable: the retry is published but not handed over; pausing (fail closed)"),
            Report::Retried => {
                self.stats.retried.inc();
                self.stats.outcome(task, RunOutcome::Retry);
            }
            Report::Dying(DeadReason::Permanent, error) => {
                warn!(error = %error, "permanent failure: dead-lettering")
            }
            Report::Dying(_, error) => {
                warn!(error = %error, "failed; retries exhausted: dead-lettering")
            }
            Report::Dead => self.stats.outcome(task, RunOutcome::Dead),
            Report::WriteRetried(error) => {
                warn!(error = %error, "could not record the outcome yet; retrying")
            }
            _ => {}
        }
    }

    /// Logs and counts a copy sent to look again later.
    fn report_recheck(&self, why: Recheck, delay: Duration) {
        let delay_ms = delay.as_millis() as u64;
        match why {
            Recheck::Busy => debug!(delay_ms, "held under another live lease; re-checking later"),
            Recheck::Waiting { ref running } => debug!(running = %running, delay_ms,
                "waiting for the job's lock (overlap = queue, or a started instance)"),
            Recheck::Limited { by } => debug!(
                by = by.as_str(),
                delay_ms, "over the task's limit: looking again later (not an attempt)"
            ),
            Recheck::NotBefore => {
                debug!(delay_ms, "before its not_before: waiting in a delay queue");
                self.stats.deferred.inc();
                return;
            }
        }
        self.stats.busy.inc();
    }

    /// One claim of `env` with our `token` (docs/design.md steps 3–4: dedupe, expiry, lease,
    /// overlap, limit); `epoch` is the publishing leader's, for the journal.
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
        let Ok(mut env) = Envelope::decode(&waiter.body) else {
            warn!("an unreadable waiting copy was dropped; its delay queue copy remains");
            return Ok(());
        };
        env.trace = waiter.trace;
        let props = drumline_shared::broker::properties(&env, Utc::now(), waiter.epoch);
        // Straight to the work queue (the default exchange), as re-check copies go straight
        // to their delay queue: the tasks exchange carries only what producers publish.
        let queue = self.names.work_queue(&env.queue);
        debug!(key = %env.key, "waking a waiting copy");
        Ok(broker::publish_confirmed(publisher, "", &queue, false, &waiter.body, props).await?)
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
        trace: delivery.trace,
    }
}

/// One delivery being handled: what every effect needs, and what its run leaves behind.
struct Step<'a> {
    publisher: &'a Channel,
    delivery: &'a Delivery,
    env: &'a Envelope,
    handler: &'a Arc<dyn Handler>,
    /// Our claim's token.
    token: &'a str,
    /// The run's span (a child of the copy's `traceparent`), which its handler is given.
    trace: TraceParent,
    /// When the run started; `None` before a run.
    started_at: Option<String>,
    /// When the run ended, for the journal ([`Store::with_ended`]); `None` before a run's end.
    ended: Option<Instant>,
    /// The run's record, made once for every try of its outcome write.
    record: Option<Option<RunRecord>>,
    /// The lease watchdog, renewing until the result is recorded.
    renewing: Option<Renewing>,
    /// `drumline_limit_in_use` while the run holds a slot of its limit.
    in_use: Option<Counted>,
    /// `drumline_limit_waiting` while the delivery is held over its limit.
    waiting: Option<Counted>,
}

/// `step`'s copy as a waiter of its job's overlap lock: epoch, body and trace kept.
fn waiter_of(step: &Step<'_>) -> Waiter {
    Waiter {
        epoch: step.delivery.epoch,
        body: step.env.encode(),
        trace: step.env.trace,
    }
}

/// The span an effect is exported as (docs/operations.md#traces), if any.
fn span_name(effect: &Effect) -> Option<&'static str> {
    match effect {
        Effect::Claim { .. } => Some("claim"),
        Effect::Run { .. } => Some("run"),
        Effect::Finish(_) => Some("finish"),
        _ => None,
    }
}

/// A step's answer as the event the machine waits for: a failure is one too.
fn answer(done: Result<Event, Interrupted>) -> Event {
    done.unwrap_or_else(|e| Event::Failed(e.into()))
}

/// A step's result as the way the delivery settles: acked, or interrupted.
fn settled(done: Result<(), Interrupted>) -> Settle {
    match done {
        Ok(()) => Settle::Ack,
        Err(e) => Settle::Interrupted(e.into()),
    }
}

impl From<Interrupted> for Failure {
    fn from(e: Interrupted) -> Self {
        match e {
            Interrupted::Redis(e) => Failure::Redis(e.to_string()),
            Interrupted::Broker(e) => Failure::Broker(e.to_string()),
        }
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
