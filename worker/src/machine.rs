//! One delivery's life as a state machine without I/O, in the manner of quinn-proto's
//! `Connection`: the driver ([`crate::processor`]) hands it [`Event`]s with the instant they
//! came ([`Machine::handle`]) and performs the [`Effect`]s it hands out ([`Machine::poll`]), in
//! order, until [`Effect::Settle`]. What each answer means is [`crate::decision`]'s (pure); the
//! machine keeps the order that makes a crash harmless (the new copy confirmed before the state
//! moves, the state before the ack), the hold over a full limit, the outcome write's retries,
//! and what a failed step interrupts. Every path ends in exactly one `Settle`.
//!
//! ```text
//!  new ─ Claim ─▶ claiming ─ Limited ─▶ holding ─ timer ─▶ claiming (the same token)
//!   │               │                      └─ shutdown ─▶ settling (a copy to look again)
//!   │               ├─ Claimed ─▶ running (the lease held) ─ run ended ─▶ settling
//!   │               └─ any other answer ─────────────────────────────────▶ settling
//!   └─ before its not_before ────────────────────────────────────────────▶ settling
//!  settling: one step at a time, each answered before the next; an outcome write retried
//!  (timer) for up to FINISH_RETRY_FOR ─▶ Settle: ack, requeue, or interrupted (requeue)
//! ```

use crate::decision::{self, Action, LimitWait, Next, Outcome, Recheck, RunResult, Start};
use crate::lease::LeaseLost;
use crate::retry;
use drumline_shared::backoff::Backoff;
use drumline_shared::config::Task;
use drumline_shared::envelope::DeadReason;
use drumline_shared::run::{Claim, LimitedBy, RunState};
use drumline_shared::store::{Ended, Waiter};
use std::collections::VecDeque;
use std::time::Duration;
use tokio::time::Instant;

/// How long an outcome write is retried from its first failure before the worker gives up on
/// it: long enough to ride out a Redis blip or a Sentinel failover (2–3 s with
/// `down-after-milliseconds 1000`).
pub(crate) const FINISH_RETRY_FOR: Duration = Duration::from_secs(10);

/// Between tries of an outcome write: 100 ms, doubled up to 1 s.
const FINISH_BACKOFF: Backoff =
    Backoff::constant(Duration::from_millis(100), Duration::from_secs(1), 0.0);

/// How much sooner than the hold's end a limit's start may be reserved: the claim's trip.
const RESERVE_MARGIN: Duration = Duration::from_millis(100);

/// What the machine knows of its delivery from the start.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Facts<'a> {
    /// The task (its retry settings).
    pub task: &'a Task,
    /// The copy's attempt, 0-based.
    pub attempt: u32,
    /// The task has a `[limits.NAME]`: a full limit holds the delivery for a while.
    pub limited: bool,
    /// The job's overlap lock has waiters (`overlap` queue or skip): a copy that waits for it
    /// joins them.
    pub parks: bool,
    /// The lease: a retry's hand-over keeps the job for the delay plus one lease.
    pub lease: Duration,
    /// Claim it, or defer it to its `not_before` ([`decision::on_delivery`]).
    pub start: Start,
}

/// What happened, as the driver tells it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Event {
    /// The claim sent at `sent` answered.
    Claimed {
        /// The answer.
        claim: Claim,
        /// When it was sent: the lease runs from there.
        sent: Instant,
    },
    /// The run ended; `jitter` in `[0, 1)` for a retry's backoff.
    RunEnded {
        /// How.
        result: RunResult,
        /// The jitter draw.
        jitter: f64,
    },
    /// The wait handed out last ([`Effect::Hold`], [`Effect::WriteAgain`]) is over.
    TimerFired,
    /// The shutdown grace ran out.
    Shutdown,
    /// The step handed out last went through (a publish confirmed, a record written).
    Done,
    /// [`Effect::Park`] answered: the copy joined the waiters (`true`), or the lock was
    /// released meanwhile (`false`).
    Parked(bool),
    /// An outcome write ([`Effect::Finish`], [`Effect::Release`]) answered.
    Written(Ended),
    /// The step handed out last failed.
    Failed(Failure),
}

/// A failed step: which side, and the error as logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Redis: the worker fails closed.
    Redis(String),
    /// The broker: the consumer paces itself.
    Broker(String),
}

/// How the delivery is settled at the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Settle {
    /// Acked.
    Ack,
    /// Handed back to be decided again.
    Requeue,
    /// A step failed before a decision was carried out: handed back.
    Interrupted(Failure),
}

/// An outcome write: the claim ends in this state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Finish {
    /// `done`, with the run record; the claim's fencing token, for the log.
    Done {
        /// The fence.
        fence: u64,
    },
    /// `dead`, with the run record carrying `error`.
    Dead {
        /// The run's error.
        error: String,
    },
    /// `retrying`: handed over to `next_attempt`, the job kept for `hold`.
    Retry {
        /// The retry's attempt.
        next_attempt: u32,
        /// How long the job stays held.
        hold: Duration,
    },
}

/// What the driver is to log and count (no answer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Report {
    /// A copy of an instance finished or moved on.
    Duplicate(RunState),
    /// Expired before it could run.
    Expired,
    /// Sent to look again later.
    Recheck(Recheck, Duration),
    /// The job's lock was released while the copy parked: published now.
    LockReleased,
    /// `overlap = skip`: `running` still runs.
    Skipped(String),
    /// Recorded `done` under the fence.
    Succeeded(u64),
    /// A success another worker's claim overtook before it was recorded.
    Overtaken,
    /// A retryable failure: the retry follows after the delay.
    Retrying(Duration, String),
    /// The retry is published, and another claim holds the instance now.
    HandedOverLate,
    /// The retry is published, and its hand-over was not written: fail closed.
    HandOverFailed(String),
    /// The retry is published (and handed over, or left to take over).
    Retried,
    /// A permanent or exhausted failure: dead-lettering.
    Dying(DeadReason, String),
    /// Recorded `dead`.
    Dead,
    /// The lease was lost mid-run.
    LeaseLost(LeaseLost),
    /// The shutdown grace ran out mid-run.
    Abandoned,
    /// An outcome write failed and is tried again after the wait.
    WriteRetried(String),
}

/// What the driver is to do. Those that say so await an [`Event`] before the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Effect {
    /// Claim the instance (again, with the same token, while held), reserving a limit's start
    /// at most this far ahead. Answered by [`Event::Claimed`] or [`Event::Failed`].
    Claim {
        /// How far ahead a start may be reserved.
        reserve_within: Duration,
    },
    /// Over the limit: wait, then [`Event::TimerFired`] (or [`Event::Shutdown`] if asked
    /// meanwhile). `first` of this delivery's holds: it starts waiting.
    Hold {
        /// How long.
        wait: Duration,
        /// Which part of the limit.
        by: LimitedBy,
        /// The first hold.
        first: bool,
    },
    /// Run the handler under the lease of the claim sent at `claimed_at`: [`Event::RunEnded`].
    Run {
        /// The claim's fencing token.
        fence: u64,
        /// When the claim was sent.
        claimed_at: Instant,
    },
    /// Log and count.
    Report(Report),
    /// Append to the job's history, best effort.
    Record(Outcome, Option<String>),
    /// Wake the job's next waiting copy if its lock is free, best effort.
    PassTheTurn,
    /// Publish a woken waiting copy, best effort.
    Wake(Waiter),
    /// Close the Redis gate (fail closed).
    CloseGate,
    /// Publish the copy to a delay queue: itself again, or its retry at `next_attempt`.
    /// Answered by [`Event::Done`] or [`Event::Failed`].
    PublishDelayed {
        /// `None`: this copy; else the retry's attempt.
        next_attempt: Option<u32>,
        /// The delay.
        delay: Duration,
    },
    /// Dead-letter the copy: [`Event::Done`] or [`Event::Failed`].
    DeadLetter {
        /// Why.
        reason: DeadReason,
        /// The error header.
        error: String,
        /// Runs made.
        attempts: u32,
    },
    /// Join the job's waiters for `delay` and more: [`Event::Parked`] or [`Event::Failed`].
    Park {
        /// The fallback copy's delay.
        delay: Duration,
    },
    /// Publish the copy itself to its work queue now: [`Event::Done`] or [`Event::Failed`].
    PublishWoken,
    /// Write the outcome: [`Event::Written`] or [`Event::Failed`].
    Finish(Finish),
    /// Wait, then [`Event::TimerFired`]: the outcome write goes again.
    WriteAgain(Duration),
    /// Release the claim (abandoned), best effort: [`Event::Written`] or [`Event::Failed`].
    Release,
    /// Settle the delivery: the last effect.
    Settle(Settle),
}

/// One step of settling, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    /// Handed out; nothing awaited.
    Tell(Effect),
    /// Handed out and awaited: done goes on, a failure interrupts.
    Must(Effect),
    /// Join the job's waiters.
    Park(Duration),
    /// An outcome write, retried.
    Write(Finish),
    /// Release the claim.
    Release,
    /// The end.
    Settle(Settle),
}

/// Over a limit: held since, and looked how many times.
#[derive(Debug, Clone, Copy)]
struct Held {
    since: Instant,
    looks: u32,
}

/// An outcome write's retries: the backoff and when to give up (from the first failure).
#[derive(Debug, Clone)]
struct Retries {
    finish: Finish,
    backoff: Backoff,
    give_up: Option<Instant>,
}

/// Where the delivery is in its life.
#[derive(Debug)]
enum State {
    /// The claim was sent.
    Claiming(Held),
    /// Over the limit: the hold's timer runs; the last answer, and when its claim was sent.
    Holding(Held, Claim, Instant),
    /// The handler runs under the lease.
    Running(u64),
    /// The step handed out last is awaited.
    Awaiting(Awaited),
    /// Settled (or, for a moment inside `handle`, between two states).
    Ended,
}

/// The settling step whose answer is awaited.
#[derive(Debug)]
enum Awaited {
    /// A publish or write that must go through.
    Must,
    /// Joining the job's waiters.
    Park,
    /// An outcome write, and its retries so far.
    Write(Retries),
    /// The wait before the outcome write goes again.
    WriteTimer(Retries),
    /// The release of an abandoned claim.
    Release,
}

/// One delivery's life: see the module docs.
#[derive(Debug)]
pub(crate) struct Machine<'a> {
    facts: Facts<'a>,
    state: State,
    /// The shutdown grace ran out: a full limit is not held any longer.
    shutdown: bool,
    plan: VecDeque<Step>,
    out: VecDeque<Effect>,
}

impl<'a> Machine<'a> {
    /// A machine for an admitted delivery of a task this worker has, at `now`: it claims, or,
    /// before its `not_before`, sends a copy to a delay queue and acks.
    pub(crate) fn new(facts: Facts<'a>, now: Instant) -> Self {
        let mut machine = Machine {
            facts,
            state: State::Ended,
            shutdown: false,
            plan: VecDeque::new(),
            out: VecDeque::new(),
        };
        let held = Held {
            since: now,
            looks: 0,
        };
        machine.state = match facts.start {
            Start::Claim => machine.claim(held, now),
            Start::Defer(delay) => machine.settle(Action::Recheck {
                why: Recheck::NotBefore,
                delay,
            }),
        };
        machine
    }

    /// The next effect to perform, if any is due (none while an answer is awaited, and none
    /// after [`Effect::Settle`]).
    pub(crate) fn poll(&mut self) -> Option<Effect> {
        self.out.pop_front()
    }

    /// Takes `event`, which came at `now`. An event the state does not wait for is ignored.
    pub(crate) fn handle(&mut self, event: Event, now: Instant) {
        let state = std::mem::replace(&mut self.state, State::Ended);
        self.state = match (state, event) {
            (State::Claiming(held), Event::Claimed { claim, sent }) => {
                self.claimed(held, claim, sent, now)
            }
            (State::Claiming(_), Event::Failed(failure)) => {
                self.plan = VecDeque::from([Step::Settle(Settle::Interrupted(failure))]);
                self.next_step()
            }
            (state @ (State::Claiming(_) | State::Running(_)), Event::Shutdown) => {
                // A run reports its own abandonment; a claim's answer is awaited first.
                self.shutdown = true;
                state
            }
            (State::Holding(held, ..), Event::TimerFired) => {
                let looks = held.looks + 1;
                self.claim(Held { looks, ..held }, now)
            }
            (State::Holding(_, claim, sent), Event::Shutdown) => {
                self.shutdown = true;
                self.next(decision::on_claim(&claim), sent)
            }
            (State::Running(fence), Event::RunEnded { result, jitter }) => {
                let (task, attempt) = (self.facts.task, self.facts.attempt);
                let action = decision::after_run(fence, &result, task, attempt, jitter);
                self.settle(action)
            }
            (State::Awaiting(awaited), event) => self.answered(awaited, event, now),
            (state, _) => state,
        };
    }

    /// Hands out a claim at `now`, reserving a start only as far ahead as the delivery is
    /// still held.
    fn claim(&mut self, held: Held, now: Instant) -> State {
        let held_for = now.saturating_duration_since(held.since);
        let left = decision::LIMIT_HOLD.saturating_sub(held_for);
        let reserve_within = left.saturating_sub(RESERVE_MARGIN);
        self.out.push_back(Effect::Claim { reserve_within });
        State::Claiming(held)
    }

    /// The claim's answer: a full limit is held (unless shutting down or held long enough),
    /// anything else decided.
    fn claimed(&mut self, held: Held, claim: Claim, sent: Instant, now: Instant) -> State {
        if let (Claim::Limited { retry_in, by }, true) = (&claim, self.facts.limited) {
            let waited = now.saturating_duration_since(held.since);
            let wait = decision::on_limited(*retry_in, *by, waited, held.looks);
            if let (LimitWait::Hold(wait), false) = (wait, self.shutdown) {
                let (by, first) = (*by, held.looks == 0);
                self.out.push_back(Effect::Hold { wait, by, first });
                return State::Holding(held, claim, sent);
            }
        }
        self.next(decision::on_claim(&claim), sent)
    }

    /// What the claim sent at `sent` leads to: the run under its lease, or settling.
    fn next(&mut self, next: Next, sent: Instant) -> State {
        match next {
            Next::Run { fence } => {
                let claimed_at = sent;
                self.out.push_back(Effect::Run { fence, claimed_at });
                State::Running(fence)
            }
            Next::Settle(action) => self.settle(action),
        }
    }

    /// Plans how `action` settles the delivery, and starts on it.
    fn settle(&mut self, action: Action) -> State {
        self.plan = plan(action, &self.facts);
        self.next_step()
    }

    /// Hands out the plan's steps up to the next that awaits an answer.
    fn next_step(&mut self) -> State {
        while let Some(step) = self.plan.pop_front() {
            let (effect, awaited) = match step {
                Step::Tell(effect) => {
                    self.out.push_back(effect);
                    continue;
                }
                Step::Settle(settle) => {
                    self.out.push_back(Effect::Settle(settle));
                    self.plan.clear();
                    return State::Ended;
                }
                Step::Must(effect) => (effect, Awaited::Must),
                Step::Park(delay) => (Effect::Park { delay }, Awaited::Park),
                Step::Release => (Effect::Release, Awaited::Release),
                Step::Write(finish) => (
                    Effect::Finish(finish.clone()),
                    Awaited::Write(Retries {
                        finish,
                        backoff: FINISH_BACKOFF,
                        give_up: None,
                    }),
                ),
            };
            self.out.push_back(effect);
            return State::Awaiting(awaited);
        }
        State::Ended
    }

    /// The answer to the step awaited.
    fn answered(&mut self, awaited: Awaited, event: Event, now: Instant) -> State {
        match (awaited, event) {
            (Awaited::Must, Event::Done) | (Awaited::Park, Event::Parked(true)) => self.next_step(),
            (Awaited::Park, Event::Parked(false)) => {
                // The lock was released meanwhile: look again now.
                self.plan.push_front(Step::Must(Effect::PublishWoken));
                self.plan
                    .push_front(Step::Tell(Effect::Report(Report::LockReleased)));
                self.next_step()
            }
            (Awaited::Must | Awaited::Park, Event::Failed(failure)) => {
                self.plan = VecDeque::from([Step::Settle(Settle::Interrupted(failure))]);
                self.next_step()
            }
            (Awaited::Write(retries), Event::Written(ended)) => {
                self.plan = written(&retries.finish, ended);
                self.next_step()
            }
            (Awaited::Write(retries), Event::Failed(failure)) => {
                self.write_failed(retries, failure, now)
            }
            (Awaited::WriteTimer(retries), Event::TimerFired) => {
                self.out.push_back(Effect::Finish(retries.finish.clone()));
                State::Awaiting(Awaited::Write(retries))
            }
            (Awaited::Release, Event::Written(ended)) => {
                self.plan
                    .extend(ended.woken.map(|w| Step::Tell(Effect::Wake(w))));
                self.plan.push_back(Step::Settle(Settle::Requeue));
                self.next_step()
            }
            (Awaited::Release, Event::Failed(_)) => {
                self.plan.push_back(Step::Settle(Settle::Requeue));
                self.next_step()
            }
            (awaited, _) => State::Awaiting(awaited),
        }
    }

    /// An outcome write failed: it goes again after the backoff, until [`FINISH_RETRY_FOR`]
    /// from the first failure would pass. Repeating is safe: a write that landed although its
    /// reply was lost is found by its own token (docs/design.md#outcome-writes-are-idempotent).
    fn write_failed(&mut self, mut retries: Retries, failure: Failure, now: Instant) -> State {
        let give_up = *retries.give_up.get_or_insert(now + FINISH_RETRY_FOR);
        let delay = retries.backoff.next_delay();
        if now + delay >= give_up {
            self.plan = gave_up(&retries.finish, failure);
            return self.next_step();
        }
        let (Failure::Redis(error) | Failure::Broker(error)) = failure;
        self.out
            .push_back(Effect::Report(Report::WriteRetried(error)));
        self.out.push_back(Effect::WriteAgain(delay));
        State::Awaiting(Awaited::WriteTimer(retries))
    }
}

/// The steps that carry out `action`, in their order (docs/design.md#one-delivery-through-the-worker).
fn plan(action: Action, facts: &Facts<'_>) -> VecDeque<Step> {
    use Step::{Must, Settle as End, Tell};
    let report = |r| Tell(Effect::Report(r));
    let ack = End(Settle::Ack);
    let steps = match action {
        Action::Duplicate { state } => vec![
            report(Report::Duplicate(state)),
            Tell(Effect::PassTheTurn),
            ack,
        ],
        Action::Expire => vec![
            report(Report::Expired),
            Must(Effect::DeadLetter {
                reason: DeadReason::Expired,
                error: "expires_at passed before the run".into(),
                attempts: facts.attempt,
            }),
            Tell(Effect::Record(Outcome::Expired, None)),
            Tell(Effect::PassTheTurn),
            ack,
        ],
        Action::Recheck { why, delay } => recheck(why, delay, facts),
        Action::Skip { running } => vec![
            report(Report::Skipped(running.clone())),
            Tell(Effect::Record(
                Outcome::Skipped,
                Some(format!("{running} still running")),
            )),
            ack,
        ],
        Action::Done { fence } => vec![Step::Write(Finish::Done { fence })],
        Action::Retry { delay, error } => retry_steps(delay, error, facts),
        Action::Dead { reason, error } => vec![
            report(Report::Dying(reason, error.clone())),
            Must(Effect::DeadLetter {
                reason,
                error: error.clone(),
                attempts: facts.attempt.saturating_add(1),
            }),
            Step::Write(Finish::Dead { error }),
        ],
        Action::Requeue { lost } => {
            let unreachable = matches!(lost, LeaseLost::Unreachable(_));
            let mut steps = vec![report(Report::LeaseLost(lost))];
            steps.extend(unreachable.then_some(Tell(Effect::CloseGate)));
            steps.push(End(Settle::Requeue));
            steps
        }
        Action::Release => vec![report(Report::Abandoned), Step::Release],
    };
    steps.into()
}

/// A copy held back: a copy to look again after `delay`, and, for the job's lock, a place in
/// its waiters (docs/design.md#waiting-copies-wake-up).
fn recheck(why: Recheck, delay: Duration, facts: &Facts<'_>) -> Vec<Step> {
    let parks = facts.parks && matches!(why, Recheck::Waiting { .. });
    let mut steps = vec![
        Step::Tell(Effect::Report(Report::Recheck(why, delay))),
        Step::Must(Effect::PublishDelayed {
            next_attempt: None,
            delay,
        }),
    ];
    steps.extend(parks.then_some(Step::Park(delay)));
    steps.push(Step::Settle(Settle::Ack));
    steps
}

/// A retry: recorded `failed`, attempt + 1 published after `delay`, then the claim handed over
/// to it. Published first: if the worker dies in between, its lease lapses and the retry (or a
/// redelivery) takes over; `retrying` rather than no claim makes every older copy a duplicate.
fn retry_steps(delay: Duration, error: String, facts: &Facts<'_>) -> Vec<Step> {
    let next_attempt = facts.attempt.saturating_add(1);
    vec![
        Step::Tell(Effect::Report(Report::Retrying(delay, error.clone()))),
        Step::Tell(Effect::Record(Outcome::Failed, Some(error))),
        Step::Must(Effect::PublishDelayed {
            next_attempt: Some(next_attempt),
            delay,
        }),
        // The job is kept through the delay, and a lease past it if the retry is lost
        // (docs/guarantees.md#overlap).
        Step::Write(Finish::Retry {
            next_attempt,
            hold: retry::bucket(delay) + facts.lease,
        }),
    ]
}

/// What follows an outcome write that answered.
fn written(finish: &Finish, ended: Ended) -> VecDeque<Step> {
    let mut steps: VecDeque<Step> = ended
        .woken
        .map(|w| Step::Tell(Effect::Wake(w)))
        .into_iter()
        .collect();
    let report = |r| Step::Tell(Effect::Report(r));
    match finish {
        Finish::Done { fence } if ended.ours => {
            steps.push_back(report(Report::Succeeded(*fence)));
            steps.push_back(Step::Settle(Settle::Ack));
        }
        // Another worker claimed the instance before the success could be recorded.
        Finish::Done { .. } => {
            steps.push_back(report(Report::Overtaken));
            steps.push_back(Step::Settle(Settle::Requeue));
        }
        Finish::Dead { .. } => {
            steps.push_back(report(Report::Dead));
            steps.push_back(Step::Settle(Settle::Ack));
        }
        Finish::Retry { .. } => {
            // Our lease lapsed and another copy took over: ours is a duplicate when it comes.
            steps.extend((!ended.ours).then_some(report(Report::HandedOverLate)));
            steps.push_back(report(Report::Retried));
            steps.push_back(Step::Settle(Settle::Ack));
        }
    }
    steps
}

/// What follows an outcome write given up on.
fn gave_up(finish: &Finish, failure: Failure) -> VecDeque<Step> {
    match (finish, failure) {
        // The retry copy is confirmed and carries the instance: once our lease lapses it
        // takes over. Requeueing this copy instead would repeat this attempt.
        (Finish::Retry { .. }, Failure::Redis(error) | Failure::Broker(error)) => VecDeque::from([
            Step::Tell(Effect::Report(Report::HandOverFailed(error))),
            Step::Tell(Effect::CloseGate),
            Step::Tell(Effect::Report(Report::Retried)),
            Step::Settle(Settle::Ack),
        ]),
        (_, failure) => VecDeque::from([Step::Settle(Settle::Interrupted(failure))]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::HandlerError;
    use crate::retry::tests::task;

    const LEASE: Duration = Duration::from_secs(30);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A delivery at attempt 0 of a task without a limit, whose job has no waiters.
    fn facts(task: &Task) -> Facts<'_> {
        Facts {
            task,
            attempt: 0,
            limited: false,
            parks: false,
            lease: LEASE,
            start: Start::Claim,
        }
    }

    /// A machine fed events on a clock of its own.
    struct Drive<'a> {
        machine: Machine<'a>,
        t0: Instant,
        now: Instant,
    }

    impl<'a> Drive<'a> {
        /// A machine for `facts`; the effects it starts with.
        fn start(facts: Facts<'a>) -> (Self, Vec<Effect>) {
            let t0 = Instant::now();
            let mut drive = Drive {
                machine: Machine::new(facts, t0),
                t0,
                now: t0,
            };
            let first = drive.due();
            (drive, first)
        }

        /// Every effect due.
        fn due(&mut self) -> Vec<Effect> {
            std::iter::from_fn(|| self.machine.poll()).collect()
        }

        /// `event` now; the effects it makes due.
        fn feed(&mut self, event: Event) -> Vec<Effect> {
            self.machine.handle(event, self.now);
            self.due()
        }

        /// `event` after `later`.
        fn after(&mut self, later: Duration, event: Event) -> Vec<Effect> {
            self.now += later;
            self.feed(event)
        }

        /// The claim, sent at the start, answers `claim`.
        fn claimed(&mut self, claim: Claim) -> Vec<Effect> {
            let sent = self.t0;
            self.feed(Event::Claimed { claim, sent })
        }

        /// Claimed with fence 9, and the run ended with `result` (jitter 0.5).
        fn ran(&mut self, result: RunResult) -> Vec<Effect> {
            self.claimed(Claim::Claimed { fence: 9 });
            self.feed(Event::RunEnded {
                result,
                jitter: 0.5,
            })
        }
    }

    fn report(r: Report) -> Effect {
        Effect::Report(r)
    }

    fn ours(woken: Option<Waiter>) -> Event {
        Event::Written(Ended { ours: true, woken })
    }

    fn theirs() -> Event {
        Event::Written(Ended {
            ours: false,
            woken: None,
        })
    }

    fn redis_down() -> Event {
        Event::Failed(Failure::Redis("connection refused".into()))
    }

    fn waiter() -> Waiter {
        Waiter {
            epoch: 3,
            body: b"{}".to_vec(),
            trace: None,
        }
    }

    fn ack() -> Vec<Effect> {
        vec![Effect::Settle(Settle::Ack)]
    }

    fn retryable() -> RunResult {
        RunResult::Failed(HandlerError::retryable("flaky"))
    }

    #[test]
    fn a_delivery_is_claimed_first_reserving_within_the_hold() {
        let task = task(2);
        let (_, first) = Drive::start(facts(&task));
        let reserve_within = decision::LIMIT_HOLD - ms(100);
        assert_eq!(first, vec![Effect::Claim { reserve_within }]);
    }

    #[test]
    fn a_delivery_before_its_not_before_waits_in_a_delay_queue_unclaimed() {
        let task = task(2);
        let early = Facts {
            start: Start::Defer(ms(2900)),
            ..facts(&task)
        };
        let (mut d, first) = Drive::start(early);
        let why = Recheck::NotBefore;
        let copy = Effect::PublishDelayed {
            next_attempt: None,
            delay: ms(2900),
        };
        // No claim, no record, no new attempt: the copy itself, confirmed before the ack.
        assert_eq!(first, vec![report(Report::Recheck(why, ms(2900))), copy]);
        assert_eq!(d.feed(Event::Done), ack());
        // A broker failure before the confirm hands the delivery back instead.
        let (mut d, _) = Drive::start(early);
        let down = Failure::Broker("closed".into());
        let settled = d.feed(Event::Failed(down.clone()));
        assert_eq!(settled, vec![Effect::Settle(Settle::Interrupted(down))]);
    }

    #[test]
    fn a_won_claim_runs_under_the_lease_from_the_claims_sending() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        let sent = d.t0;
        d.now += ms(40);
        let run = d.feed(Event::Claimed {
            claim: Claim::Claimed { fence: 9 },
            sent,
        });
        assert_eq!(
            run,
            vec![Effect::Run {
                fence: 9,
                claimed_at: sent
            }]
        );
    }

    #[test]
    fn a_success_is_recorded_before_it_is_acked() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        let finish = d.ran(RunResult::Succeeded);
        assert_eq!(finish, vec![Effect::Finish(Finish::Done { fence: 9 })]);
        let done = d.feed(ours(None));
        assert_eq!(
            done,
            vec![report(Report::Succeeded(9)), Effect::Settle(Settle::Ack)]
        );
        assert_eq!(d.feed(Event::Done), vec![], "settled: nothing follows");
    }

    #[test]
    fn a_success_another_claim_overtook_before_its_record_is_requeued() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        d.ran(RunResult::Succeeded);
        assert_eq!(
            d.feed(theirs()),
            vec![report(Report::Overtaken), Effect::Settle(Settle::Requeue)]
        );
    }

    #[test]
    fn the_copy_a_finish_wakes_is_published_before_the_ack() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        d.ran(RunResult::Succeeded);
        let done = d.feed(ours(Some(waiter())));
        assert_eq!(done[0], Effect::Wake(waiter()));
        assert_eq!(done.last(), Some(&Effect::Settle(Settle::Ack)));
    }

    #[test]
    fn a_claim_race_lost_to_a_live_lease_looks_again_after_it() {
        let task = task(2);
        let mut facts = facts(&task);
        facts.parks = true;
        let (mut d, _) = Drive::start(facts);
        let busy = Claim::Busy {
            retry_in: ms(1000),
            handover: false,
        };
        let delay = ms(1250);
        assert_eq!(
            d.claimed(busy),
            vec![
                report(Report::Recheck(Recheck::Busy, delay)),
                Effect::PublishDelayed {
                    next_attempt: None,
                    delay
                }
            ]
        );
        // A busy copy does not join the job's waiters.
        assert_eq!(d.feed(Event::Done), ack());
    }

    #[test]
    fn a_later_attempt_waits_for_the_hand_over_not_the_lease() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        let busy = Claim::Busy {
            retry_in: Duration::from_secs(30),
            handover: true,
        };
        let publish = d.claimed(busy);
        let delay = decision::HANDOVER_RECHECK + decision::BUSY_RECHECK_MARGIN;
        assert_eq!(
            publish[1],
            Effect::PublishDelayed {
                next_attempt: None,
                delay
            }
        );
    }

    #[test]
    fn a_copy_of_a_finished_instance_is_a_duplicate_and_passes_the_turn() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        let state = RunState::Done;
        assert_eq!(
            d.claimed(Claim::Duplicate { state }),
            vec![
                report(Report::Duplicate(state)),
                Effect::PassTheTurn,
                Effect::Settle(Settle::Ack)
            ]
        );
    }

    #[test]
    fn a_copy_whose_fence_was_overtaken_by_a_later_attempt_does_not_run() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        let state = RunState::Retrying;
        let effects = d.claimed(Claim::Duplicate { state });
        assert!(!effects.iter().any(|e| matches!(e, Effect::Run { .. })));
        assert_eq!(effects[0], report(Report::Duplicate(state)));
    }

    #[test]
    fn a_lease_taken_mid_run_records_nothing_and_requeues() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        let lost = LeaseLost::Taken;
        assert_eq!(
            d.ran(RunResult::LeaseLost(lost.clone())),
            vec![
                report(Report::LeaseLost(lost)),
                Effect::Settle(Settle::Requeue)
            ]
        );
    }

    #[test]
    fn a_lease_lost_to_redis_mid_run_closes_the_gate_too() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        let lost = LeaseLost::Unreachable("down".into());
        assert_eq!(
            d.ran(RunResult::LeaseLost(lost.clone())),
            vec![
                report(Report::LeaseLost(lost)),
                Effect::CloseGate,
                Effect::Settle(Settle::Requeue)
            ]
        );
    }

    #[test]
    fn a_retryable_failure_below_max_retries_publishes_the_retry_then_hands_over() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        let delay = ms(1100);
        let error = String::from("flaky");
        assert_eq!(
            d.ran(retryable()),
            vec![
                report(Report::Retrying(delay, error.clone())),
                Effect::Record(Outcome::Failed, Some(error)),
                Effect::PublishDelayed {
                    next_attempt: Some(1),
                    delay
                }
            ]
        );
        let hold = retry::bucket(delay) + LEASE;
        let handover = Finish::Retry {
            next_attempt: 1,
            hold,
        };
        assert_eq!(d.feed(Event::Done), vec![Effect::Finish(handover)]);
        assert_eq!(
            d.feed(ours(None)),
            vec![report(Report::Retried), Effect::Settle(Settle::Ack)]
        );
    }

    #[test]
    fn the_retry_delay_backs_off_with_the_attempt() {
        let task = task(5);
        let delay_at = |attempt| {
            let (mut d, _) = Drive::start(Facts {
                attempt,
                ..facts(&task)
            });
            match &d.ran(retryable())[2] {
                Effect::PublishDelayed {
                    delay,
                    next_attempt,
                } => {
                    assert_eq!(*next_attempt, Some(attempt + 1));
                    *delay
                }
                other => panic!("not a retry: {other:?}"),
            }
        };
        assert_eq!([0, 1, 2].map(delay_at), [ms(1100), ms(2200), ms(4400)]);
    }

    #[test]
    fn a_retryable_failure_at_max_retries_is_dead_lettered_and_recorded_dead() {
        let task = task(2);
        let (mut d, _) = Drive::start(Facts {
            attempt: 2,
            ..facts(&task)
        });
        let (reason, error) = (DeadReason::RetriesExhausted, String::from("flaky"));
        assert_eq!(
            d.ran(retryable()),
            vec![
                report(Report::Dying(reason, error.clone())),
                Effect::DeadLetter {
                    reason,
                    error: error.clone(),
                    attempts: 3
                }
            ]
        );
        assert_eq!(
            d.feed(Event::Done),
            vec![Effect::Finish(Finish::Dead { error })]
        );
        assert_eq!(
            d.feed(ours(None)),
            vec![report(Report::Dead), Effect::Settle(Settle::Ack)]
        );
    }

    #[test]
    fn a_permanent_failure_is_dead_lettered_at_the_first_attempt() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        let effects = d.ran(RunResult::Failed(HandlerError::permanent("no")));
        assert_eq!(
            effects[1],
            Effect::DeadLetter {
                reason: DeadReason::Permanent,
                error: "no".into(),
                attempts: 1
            }
        );
    }

    #[test]
    fn a_retry_that_cannot_be_published_is_not_handed_over() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        d.ran(retryable());
        let refused = Failure::Broker("nacked".into());
        assert_eq!(
            d.feed(Event::Failed(refused.clone())),
            vec![Effect::Settle(Settle::Interrupted(refused))]
        );
    }

    #[test]
    fn a_dead_letter_that_cannot_be_published_leaves_the_state_alone() {
        let task = task(0);
        let (mut d, _) = Drive::start(facts(&task));
        d.ran(retryable());
        let refused = Failure::Broker("channel closed".into());
        let effects = d.feed(Event::Failed(refused.clone()));
        assert_eq!(effects, vec![Effect::Settle(Settle::Interrupted(refused))]);
    }

    #[test]
    fn an_outcome_write_that_fails_is_tried_again_with_backoff() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        d.ran(RunResult::Succeeded);
        let mut waits = Vec::new();
        for _ in 0..3 {
            let effects = d.feed(redis_down());
            let wait = match effects.as_slice() {
                [Effect::Report(Report::WriteRetried(_)), Effect::WriteAgain(wait)] => *wait,
                other => panic!("not a retry: {other:?}"),
            };
            waits.push(wait);
            let again = d.after(wait, Event::TimerFired);
            assert_eq!(again, vec![Effect::Finish(Finish::Done { fence: 9 })]);
        }
        assert_eq!(waits, [ms(100), ms(200), ms(400)]);
        assert_eq!(
            d.feed(ours(None)).last(),
            Some(&Effect::Settle(Settle::Ack))
        );
    }

    /// Fails every try of the outcome write until the machine gives up; what it hands out
    /// then, and how long after the first failure.
    fn fail_until_given_up(d: &mut Drive<'_>) -> (Vec<Effect>, Duration) {
        let first = d.now;
        loop {
            let effects = d.feed(redis_down());
            match effects.last() {
                Some(Effect::WriteAgain(wait)) => {
                    let wait = *wait;
                    d.after(wait, Event::TimerFired);
                }
                _ => return (effects, d.now - first),
            }
        }
    }

    #[test]
    fn a_done_write_is_given_up_within_the_retry_window_and_requeued() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        d.ran(RunResult::Succeeded);
        let (effects, spent) = fail_until_given_up(&mut d);
        assert!(matches!(
            effects.as_slice(),
            [Effect::Settle(Settle::Interrupted(Failure::Redis(_)))]
        ));
        assert!(spent < FINISH_RETRY_FOR, "{spent:?}");
        assert!(
            spent >= FINISH_RETRY_FOR - Duration::from_secs(1),
            "{spent:?}"
        );
    }

    #[test]
    fn a_hand_over_given_up_closes_the_gate_and_acks_the_published_retry() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        d.ran(retryable());
        d.feed(Event::Done);
        let (effects, _) = fail_until_given_up(&mut d);
        assert_eq!(
            effects,
            vec![
                report(Report::HandOverFailed("connection refused".into())),
                Effect::CloseGate,
                report(Report::Retried),
                Effect::Settle(Settle::Ack)
            ]
        );
    }

    #[test]
    fn a_retry_handed_over_after_another_claim_took_the_instance_is_acked() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        d.ran(retryable());
        d.feed(Event::Done);
        assert_eq!(
            d.feed(theirs()),
            vec![
                report(Report::HandedOverLate),
                report(Report::Retried),
                Effect::Settle(Settle::Ack)
            ]
        );
    }

    #[test]
    fn overlap_skip_records_the_instance_skipped() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        let running = String::from("j@1");
        assert_eq!(
            d.claimed(Claim::Skipped {
                running: running.clone()
            }),
            vec![
                report(Report::Skipped(running)),
                Effect::Record(Outcome::Skipped, Some("j@1 still running".into())),
                Effect::Settle(Settle::Ack)
            ]
        );
    }

    #[test]
    fn overlap_queue_parks_the_copy_after_its_fallback_is_published() {
        let task = task(2);
        let (mut d, _) = Drive::start(Facts {
            parks: true,
            ..facts(&task)
        });
        let waiting = Claim::Waiting {
            retry_in: ms(1000),
            running: "j@1".into(),
        };
        let publish = d.claimed(waiting);
        assert!(matches!(
            publish[1],
            Effect::PublishDelayed {
                next_attempt: None,
                ..
            }
        ));
        assert_eq!(d.feed(Event::Done), vec![Effect::Park { delay: ms(1250) }]);
        assert_eq!(d.feed(Event::Parked(true)), ack());
    }

    #[test]
    fn a_lock_released_while_parking_publishes_the_copy_at_once() {
        let task = task(2);
        let (mut d, _) = Drive::start(Facts {
            parks: true,
            ..facts(&task)
        });
        d.claimed(Claim::Waiting {
            retry_in: ms(1000),
            running: "j@1".into(),
        });
        d.feed(Event::Done);
        assert_eq!(
            d.feed(Event::Parked(false)),
            vec![report(Report::LockReleased), Effect::PublishWoken]
        );
        assert_eq!(d.feed(Event::Done), ack());
    }

    #[test]
    fn a_parking_that_redis_fails_interrupts() {
        let task = task(2);
        let (mut d, _) = Drive::start(Facts {
            parks: true,
            ..facts(&task)
        });
        d.claimed(Claim::Waiting {
            retry_in: ms(1000),
            running: "j@1".into(),
        });
        d.feed(Event::Done);
        let effects = d.feed(redis_down());
        assert!(matches!(
            effects.as_slice(),
            [Effect::Settle(Settle::Interrupted(Failure::Redis(_)))]
        ));
    }

    #[test]
    fn without_waiters_a_waiting_copy_only_looks_again_later() {
        // `overlap = allow`, or an ad-hoc task: no lock to wait in line for.
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        d.claimed(Claim::Waiting {
            retry_in: ms(1000),
            running: "j@1".into(),
        });
        assert_eq!(d.feed(Event::Done), ack());
    }

    #[test]
    fn a_full_rate_holds_the_delivery_and_claims_again_with_less_to_reserve() {
        let task = task(2);
        let (mut d, _) = Drive::start(Facts {
            limited: true,
            ..facts(&task)
        });
        let by = LimitedBy::Rate;
        let limited = Claim::Limited {
            retry_in: ms(730),
            by,
        };
        let hold = Effect::Hold {
            wait: ms(730),
            by,
            first: true,
        };
        assert_eq!(d.claimed(limited), vec![hold]);
        let reserve_within = decision::LIMIT_HOLD - ms(730) - ms(100);
        assert_eq!(
            d.after(ms(730), Event::TimerFired),
            vec![Effect::Claim { reserve_within }]
        );
        let sent = d.now;
        let run = d.feed(Event::Claimed {
            claim: Claim::Claimed { fence: 4 },
            sent,
        });
        assert_eq!(
            run,
            vec![Effect::Run {
                fence: 4,
                claimed_at: sent
            }]
        );
    }

    #[test]
    fn a_full_group_is_looked_at_again_with_backoff() {
        let task = task(2);
        let (mut d, _) = Drive::start(Facts {
            limited: true,
            ..facts(&task)
        });
        let by = LimitedBy::Concurrency;
        let limited = || Claim::Limited {
            retry_in: LEASE,
            by,
        };
        let mut waits = Vec::new();
        for look in 0..3 {
            let sent = d.now;
            let effects = d.feed(Event::Claimed {
                claim: limited(),
                sent,
            });
            let [Effect::Hold { wait, first, .. }] = effects.as_slice() else {
                panic!("not held: {effects:?}");
            };
            assert_eq!(*first, look == 0);
            waits.push(*wait);
            let wait = *wait;
            d.after(wait, Event::TimerFired);
        }
        assert_eq!(waits, [ms(50), ms(100), ms(200)]);
    }

    #[test]
    fn a_limit_that_stays_full_past_the_hold_sends_a_copy_to_a_delay_queue() {
        let task = task(2);
        let (mut d, _) = Drive::start(Facts {
            limited: true,
            ..facts(&task)
        });
        let by = LimitedBy::Rate;
        let far = Claim::Limited {
            retry_in: Duration::from_secs(7),
            by,
        };
        let effects = d.claimed(far);
        let delay = Duration::from_secs(7);
        assert_eq!(
            effects,
            vec![
                report(Report::Recheck(Recheck::Limited { by }, delay)),
                Effect::PublishDelayed {
                    next_attempt: None,
                    delay
                }
            ]
        );
    }

    #[test]
    fn without_a_limit_of_its_own_a_limited_answer_is_not_held() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        let effects = d.claimed(Claim::Limited {
            retry_in: ms(10),
            by: LimitedBy::Rate,
        });
        assert!(matches!(effects[0], Effect::Report(Report::Recheck(..))));
    }

    #[test]
    fn shutdown_during_a_hold_sends_the_copy_to_look_again_instead_of_running() {
        let task = task(2);
        let (mut d, _) = Drive::start(Facts {
            limited: true,
            ..facts(&task)
        });
        let by = LimitedBy::Concurrency;
        d.claimed(Claim::Limited {
            retry_in: LEASE,
            by,
        });
        let effects = d.after(ms(10), Event::Shutdown);
        let delay = decision::LIMIT_POLL_MAX * 2;
        assert_eq!(
            effects[0],
            report(Report::Recheck(Recheck::Limited { by }, delay))
        );
        assert_eq!(d.feed(Event::Done), ack());
    }

    #[test]
    fn shutdown_before_the_claim_answers_holds_nothing_more() {
        let task = task(2);
        let (mut d, _) = Drive::start(Facts {
            limited: true,
            ..facts(&task)
        });
        assert_eq!(d.feed(Event::Shutdown), vec![]);
        let effects = d.claimed(Claim::Limited {
            retry_in: ms(50),
            by: LimitedBy::Rate,
        });
        assert!(matches!(effects[0], Effect::Report(Report::Recheck(..))));
    }

    #[test]
    fn shutdown_before_a_won_claim_still_hands_out_the_run_which_reports_itself() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        d.feed(Event::Shutdown);
        let run = d.claimed(Claim::Claimed { fence: 2 });
        assert!(matches!(run.as_slice(), [Effect::Run { fence: 2, .. }]));
    }

    #[test]
    fn shutdown_mid_run_releases_the_claim_and_requeues() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        assert_eq!(
            d.ran(RunResult::Abandoned),
            vec![report(Report::Abandoned), Effect::Release]
        );
        assert_eq!(
            d.feed(ours(Some(waiter()))),
            vec![Effect::Wake(waiter()), Effect::Settle(Settle::Requeue)]
        );
    }

    #[test]
    fn a_release_redis_fails_still_requeues() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        d.ran(RunResult::Abandoned);
        assert_eq!(d.feed(redis_down()), vec![Effect::Settle(Settle::Requeue)]);
    }

    #[test]
    fn an_expired_copy_is_dead_lettered_then_recorded_and_passes_the_turn() {
        let task = task(2);
        let (mut d, _) = Drive::start(Facts {
            attempt: 1,
            ..facts(&task)
        });
        assert_eq!(
            d.claimed(Claim::Expired),
            vec![
                report(Report::Expired),
                Effect::DeadLetter {
                    reason: DeadReason::Expired,
                    error: "expires_at passed before the run".into(),
                    attempts: 1
                }
            ]
        );
        assert_eq!(
            d.feed(Event::Done),
            vec![
                Effect::Record(Outcome::Expired, None),
                Effect::PassTheTurn,
                Effect::Settle(Settle::Ack)
            ]
        );
    }

    #[test]
    fn a_claim_redis_fails_hands_the_copy_back() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        let effects = d.feed(redis_down());
        assert_eq!(
            effects,
            vec![Effect::Settle(Settle::Interrupted(Failure::Redis(
                "connection refused".into()
            )))]
        );
    }

    #[test]
    fn answers_the_state_does_not_wait_for_change_nothing() {
        let task = task(2);
        let (mut d, _) = Drive::start(facts(&task));
        let run_ended = Event::RunEnded {
            result: RunResult::Succeeded,
            jitter: 0.0,
        };
        assert_eq!(d.feed(run_ended), vec![], "no run yet");
        assert_eq!(d.feed(Event::TimerFired), vec![]);
        d.claimed(Claim::Claimed { fence: 1 });
        assert_eq!(d.feed(Event::Done), vec![], "the run has not ended");
        assert_eq!(d.feed(ours(None)), vec![]);
        let finish = d.feed(Event::RunEnded {
            result: RunResult::Succeeded,
            jitter: 0.0,
        });
        assert_eq!(finish, vec![Effect::Finish(Finish::Done { fence: 1 })]);
    }
}
