//! What the worker does with a delivery, as pure functions (docs/design.md): [`admit`] checks
//! the raw message, [`on_delivery`] holds back one that came before its `not_before`,
//! [`on_claim`] turns the claim into the run or an [`Action`] that settles the
//! copy without one, and [`after_run`] turns the run's result into its [`Action`]. No
//! I/O here: the processor performs the action, so every branch is a plain `#[test]`.

use crate::handler::HandlerError;
use crate::lease::LeaseLost;
use crate::retry::{self, Decision};
use chrono::{DateTime, Utc};
use drumline_shared::config::Task;
use drumline_shared::envelope::{parse_instant, Arrival, DeadReason, Envelope};
use drumline_shared::names::check_key;
use drumline_shared::run::{Claim, LimitedBy, RunState};
use std::time::Duration;

/// Margin added to a busy lease's remaining time before we look again.
pub const BUSY_RECHECK_MARGIN: Duration = Duration::from_millis(250);

/// The longest a retry copy waits (before the margin) for the hand-over of the attempt before
/// it, which that attempt's worker keeps retrying (docs/design.md#outcome-writes-are-idempotent).
pub const HANDOVER_RECHECK: Duration = Duration::from_secs(1);

/// The longest a delivery over its task's limit is held in the worker, looking again, before
/// it goes to a delay queue and its slot is given back (docs/design.md#limits). A rate's start
/// is reserved only this far ahead.
pub const LIMIT_HOLD: Duration = Duration::from_secs(5);

/// Between looks at a full concurrency group while held: 50 ms, doubled up to this.
pub const LIMIT_POLL_MAX: Duration = Duration::from_millis(500);

/// How long a copy sent to a delay queue for its limit waits at most before it looks again.
pub const LIMIT_RECHECK_MAX: Duration = Duration::from_secs(60);

/// What a delivery over its limit does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitWait {
    /// Keep the delivery and claim again (with the same token) after this long.
    Hold(Duration),
    /// Give up holding: settle it as [`on_claim`] says (a copy to a delay queue).
    Release,
}

/// Decides how a delivery answered [`Claim::Limited`] waits, having been held `held` so far
/// and looked `looks` times: a reserved start within [`LIMIT_HOLD`] is waited for exactly; a
/// full group is looked at again after 50 ms, doubling to [`LIMIT_POLL_MAX`], never past the
/// first slot's lease (when a dead holder's slot lapses).
pub fn on_limited(retry_in: Duration, by: LimitedBy, held: Duration, looks: u32) -> LimitWait {
    let left = LIMIT_HOLD.saturating_sub(held);
    let wait = match by {
        LimitedBy::Rate => retry_in,
        LimitedBy::Concurrency => {
            let poll = Duration::from_millis(50).saturating_mul(1 << looks.min(10));
            poll.min(LIMIT_POLL_MAX).min(retry_in)
        }
    };
    if wait > left || left.is_zero() {
        LimitWait::Release
    } else {
        LimitWait::Hold(wait)
    }
}

/// A message refused before anything touches Redis: dead-letter it and ack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// The dead-letter reason.
    pub reason: DeadReason,
    /// The error text for the dead letter's header.
    pub error: String,
}

/// Checks a delivery's body before anything else (docs/design.md): a message over `max_bytes`, one
/// that does not decode, or one that breaks the envelope's limits (`is_job` says whether a job
/// name is one we know) is rejected; it must not touch Redis or make us loop. The fields a
/// producer may omit are defaulted from `arrival` (docs/envelope.md).
pub fn admit(
    body: &[u8],
    arrival: &Arrival<'_>,
    max_bytes: usize,
    is_job: impl Fn(&str) -> bool,
) -> Result<Envelope, Rejected> {
    if body.len() > max_bytes {
        return Err(Rejected {
            reason: DeadReason::Oversize,
            error: format!(
                "{} bytes, more than max_message_bytes = {max_bytes}",
                body.len()
            ),
        });
    }
    Envelope::decode_delivered(body, arrival)
        .map_err(|e| e.to_string())
        .and_then(|env| env.check(is_job).map(|()| env).map_err(|e| e.to_string()))
        .map_err(|error| Rejected {
            reason: DeadReason::Malformed,
            error,
        })
}

/// What an admitted delivery of a task this worker has does first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// It is due: claim it.
    Claim,
    /// Its `not_before` is this far ahead (at most: a bucket of the time left, rounded down):
    /// a copy of it goes to a delay queue for that long, then the delivery is acked. Nothing
    /// is claimed, no attempt used, nothing journaled.
    Defer(Duration),
}

/// Decides whether `env`, delivered at `now`, is due (docs/envelope.md#not-before): a copy
/// that came early, however it came (a producer's message, a redelivery, a delay queue's
/// rounding), waits in a delay queue rather than in a sleep holding a concurrency slot. The
/// wait is rounded *down* to a delay queue's bucket so it never overshoots; a copy back
/// before its instant waits again for what is left. A late one (past `not_before`) is due.
pub fn on_delivery(env: &Envelope, now: DateTime<Utc>) -> Start {
    match env.early_by(now) {
        Some(left) => Start::Defer(retry::bucket_down(left)),
        None => Start::Claim,
    }
}

/// A message naming a task this worker's config does not have.
pub fn unknown_task(task: &str) -> Rejected {
    Rejected {
        reason: DeadReason::UnknownTask,
        error: format!("no task named {task:?} in this worker's config"),
    }
}

/// The key a delivery dead-lettered unrun may be journaled under (docs/audit.md#the-journal),
/// with its envelope when it decodes: the envelope's key, else the body's `key` field, else
/// the AMQP `message_id` (`body` is `None` when it was not decoded: oversize). `None` when
/// there is none, it breaks the key rule, or it names a scheduled instance the message does
/// not carry — `{job}@{instant}` of a job `is_job` knows, or any key of a message naming a job,
/// unless the decoded envelope is that job's instance at that instant: a producer cannot
/// record anything for an instance it does not carry (docs/design.md#trust-model).
pub fn rejected_key(
    body: Option<&[u8]>,
    message_id: Option<&str>,
    arrival: &Arrival<'_>,
    is_job: impl Fn(&str) -> bool,
) -> Option<(String, Option<Envelope>)> {
    let decoded = body.and_then(|b| Envelope::decode_delivered(b, arrival).ok());
    let raw: Option<serde_json::Value> = match decoded {
        Some(_) => None,
        None => body.and_then(|b| serde_json::from_slice(b).ok()),
    };
    let field = |name: &str| Some(raw.as_ref()?.get(name)?.as_str()?.to_owned());
    let (key, job, at) = match &decoded {
        Some(env) => (
            Some(env.key.clone()),
            env.job.clone(),
            Some(env.scheduled_for),
        ),
        None => (
            field("key").or(message_id.map(str::to_owned)),
            field("job"),
            None,
        ),
    };
    let key = key?;
    check_key(&key).ok()?;
    let instance = (key.split_once('@')).and_then(|(j, t)| Some((j, parse_instant(t)?)));
    let names_a_job = job.is_some() || instance.is_some_and(|(j, _)| is_job(j));
    let carried = match (instance, job.as_deref(), at) {
        (Some((j, t)), Some(job), Some(at)) => j == job && t == at,
        _ => false,
    };
    (!names_a_job || carried).then_some((key, decoded))
}

/// How a run ended, as far as the decision is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunResult {
    /// The handler returned `Ok` (recorded even if the lease lapsed meanwhile, docs/design.md).
    Succeeded,
    /// The handler returned an error while the lease was still ours.
    Failed(HandlerError),
    /// The lease was lost mid-run: the result must not be recorded.
    LeaseLost(LeaseLost),
    /// The shutdown grace ran out and the run was cancelled.
    Abandoned,
}

/// Why a copy is sent to re-check later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recheck {
    /// Another worker holds a live lease on the instance.
    Busy,
    /// It came before its `not_before` ([`on_delivery`]): not claimed, not an attempt.
    NotBefore,
    /// `overlap = "queue"`: the job's previous instance (key `running`) still runs.
    Waiting {
        /// Key of the instance that still runs.
        running: String,
    },
    /// The task's `[limits.NAME]` is full (after holding the delivery for [`LIMIT_HOLD`]): not
    /// an attempt; the copy keeps its attempt number.
    Limited {
        /// Which part of the limit.
        by: LimitedBy,
    },
}

/// The `status` of a job history entry (`RunRecord.status`, docs/design.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The run succeeded.
    Done,
    /// The run failed and will be retried.
    Failed,
    /// Dead-lettered after a run.
    Dead,
    /// Expired before it could run.
    Expired,
    /// Not run: the job's previous instance still ran (`overlap = "skip"`).
    Skipped,
}

impl Outcome {
    /// The text written to the history.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Done => "done",
            Outcome::Failed => "failed",
            Outcome::Dead => "dead",
            Outcome::Expired => "expired",
            Outcome::Skipped => "skipped",
        }
    }
}

/// What a claim leads to: the run, or an action that settles the delivery without one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// We hold the claim: run the handler with this fencing token, then ask [`after_run`].
    Run {
        /// The claim's fencing token.
        fence: u64,
    },
    /// Settle the delivery without running it.
    Settle(Action),
}

/// How the processor settles a delivery. Each action ends in one ack or one requeue; none of
/// them runs the task, so "run after the run" cannot be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// A duplicate copy (the instance finished or moved on to a later attempt): ack, do not run.
    Duplicate {
        /// The recorded state.
        state: RunState,
    },
    /// Expired before it could run: dead-letter `expired`, record `expired`, ack.
    Expire,
    /// Publish a copy to re-check after `delay` (a delay queue), then ack.
    Recheck {
        /// Why.
        why: Recheck,
        /// How long to wait (the lease's remaining time plus [`BUSY_RECHECK_MARGIN`]).
        delay: Duration,
    },
    /// `overlap = "skip"`: the claim recorded `skipped`; record it in the history, ack.
    Skip {
        /// Key of the instance that still runs.
        running: String,
    },
    /// The run succeeded: mark the instance `done` (requeue if the claim went to another
    /// worker meanwhile), record it, ack.
    Done {
        /// The claim's fencing token.
        fence: u64,
    },
    /// Publish attempt + 1 after `delay`, then hand the claim over to it (`retrying`), ack.
    Retry {
        /// The backoff before the next attempt.
        delay: Duration,
        /// The run's error.
        error: String,
    },
    /// Dead-letter after a run, mark the instance `dead`, record it, ack.
    Dead {
        /// Why.
        reason: DeadReason,
        /// The run's error.
        error: String,
    },
    /// The lease was lost mid-run: record nothing, requeue.
    Requeue {
        /// Why the lease was lost.
        lost: LeaseLost,
    },
    /// The run was abandoned at shutdown: release the claim, requeue.
    Release,
}

/// Decides what follows a `claim`: the run, or how to settle the copy without one.
pub fn on_claim(claim: &Claim) -> Next {
    let settle = match claim {
        Claim::Claimed { fence } => return Next::Run { fence: *fence },
        Claim::Duplicate { state } => Action::Duplicate { state: *state },
        // Judged after dedupe (in the claim): an expired copy of a finished instance is a
        // duplicate, not a failure.
        Claim::Expired => Action::Expire,
        // Someone else runs it under a live lease. If they die, the lease expires and this
        // copy, back from the delay queue, takes over. A later attempt than the running one
        // waits for a hand-over already on its way: it looks again soon.
        Claim::Busy { retry_in, handover } => Action::Recheck {
            why: Recheck::Busy,
            delay: if *handover {
                (*retry_in).min(HANDOVER_RECHECK)
            } else {
                *retry_in
            } + BUSY_RECHECK_MARGIN,
        },
        Claim::Waiting { retry_in, running } => Action::Recheck {
            why: Recheck::Waiting {
                running: running.clone(),
            },
            delay: *retry_in + BUSY_RECHECK_MARGIN,
        },
        Claim::Skipped { running } => Action::Skip {
            running: running.clone(),
        },
        // Held in the worker for a while already (`on_limited`): look again from a delay
        // queue, a rate when its window has room, a group soon.
        Claim::Limited { retry_in, by } => Action::Recheck {
            why: Recheck::Limited { by: *by },
            delay: match by {
                LimitedBy::Rate => (*retry_in).min(LIMIT_RECHECK_MAX),
                LimitedBy::Concurrency => LIMIT_POLL_MAX * 2,
            },
        },
    };
    Next::Settle(settle)
}

/// The most of a run's error that is recorded with it and carried by its dead letter
/// (`x-drumline-error`): 4 KiB (docs/design.md#failures-you-can-read).
pub const ERROR_KEPT: usize = 4096;

/// `text` cut to at most `max` bytes: its start (up to 256 bytes of the first line: what
/// failed) and as much of its end as fits (where a stderr's last lines are), joined by ` … `.
pub fn bounded(text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    const JOIN: &str = " … ";
    let first_line = text.find('\n').unwrap_or(text.len());
    let mut head = first_line.min(256).min(max / 2);
    while !text.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = text.len() - max.saturating_sub(head + JOIN.len());
    while !text.is_char_boundary(tail) {
        tail += 1;
    }
    format!("{}{JOIN}{}", &text[..head], &text[tail..])
}

/// Decides how a run under the claim with `fence` settles, for a copy at `attempt` (0-based)
/// of `task`. `jitter` in `[0, 1)` is injected so tests are exact.
pub fn after_run(fence: u64, result: &RunResult, task: &Task, attempt: u32, jitter: f64) -> Action {
    match result {
        RunResult::Succeeded => Action::Done { fence },
        RunResult::Failed(e @ HandlerError::Permanent { .. }) => Action::Dead {
            reason: DeadReason::Permanent,
            error: bounded(e.report(), ERROR_KEPT),
        },
        RunResult::Failed(e @ HandlerError::Retryable { after, .. }) => {
            match retry::decide(task, attempt, jitter) {
                Decision::Exhausted => Action::Dead {
                    reason: DeadReason::RetriesExhausted,
                    error: bounded(e.report(), ERROR_KEPT),
                },
                Decision::Retry { delay } => Action::Retry {
                    // The handler's own delay, within the task's `retry_max`.
                    delay: after.map_or(delay, |after| after.min(task.retry_max)),
                    error: bounded(e.report(), ERROR_KEPT),
                },
            }
        }
        RunResult::LeaseLost(lost) => Action::Requeue { lost: lost.clone() },
        RunResult::Abandoned => Action::Release,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::tests::task;

    fn before(claim: Claim) -> Action {
        match on_claim(&claim) {
            Next::Settle(action) => action,
            run => panic!("{claim:?} settles, but led to {run:?}"),
        }
    }

    fn after(result: RunResult, attempt: u32) -> Action {
        after_run(7, &result, &task(2), attempt, 0.5)
    }

    fn arrival() -> Arrival<'static> {
        Arrival {
            routing_key: "default",
            published_at: chrono::DateTime::UNIX_EPOCH,
            trace: None,
        }
    }

    /// An ad-hoc envelope with `key`.
    fn envelope_json(key: &str) -> Vec<u8> {
        let env = Envelope {
            v: 1,
            id: uuid::Uuid::nil(),
            key: key.into(),
            task: "t".into(),
            job: None,
            args: serde_json::Value::Null,
            scheduled_for: chrono::DateTime::UNIX_EPOCH,
            published_at: chrono::DateTime::UNIX_EPOCH,
            attempt: 0,
            expires_at: None,
            not_before: None,
            queue: "default".into(),
            backfill: false,
            overlap: None,
            trace: None,
        };
        env.encode()
    }

    #[test]
    fn admits_a_valid_envelope() {
        let env = admit(&envelope_json("k"), &arrival(), 1 << 20, |_| true).unwrap();
        assert_eq!(env.key, "k");
        // An ad-hoc key shaped like an instance of a job we do not know is fine.
        let key = "j@1970-01-01T00:00:00Z";
        assert_eq!(
            admit(&envelope_json(key), &arrival(), 1 << 20, |_| false)
                .unwrap()
                .key,
            key
        );
    }

    #[test]
    fn oversize_comes_before_decoding() {
        let body = vec![b'x'; 11];
        let rejected = admit(&body, &arrival(), 10, |_| true).unwrap_err();
        assert_eq!(rejected.reason, DeadReason::Oversize);
        assert_eq!(rejected.error, "11 bytes, more than max_message_bytes = 10");
        // Exactly the limit is not oversize (it is malformed here: not JSON).
        let at_limit = admit(&body[..10], &arrival(), 10, |_| true).unwrap_err();
        assert_eq!(at_limit.reason, DeadReason::Malformed);
    }

    #[test]
    fn undecodable_and_limit_breaking_messages_are_malformed() {
        let garbage = admit(b"{not json", &arrival(), 1 << 20, |_| true).unwrap_err();
        assert_eq!(garbage.reason, DeadReason::Malformed);
        // Decodes, but an ad-hoc key impersonates an instance of job `j`.
        let key = "j@1970-01-01T00:00:00Z";
        let impostor =
            admit(&envelope_json(key), &arrival(), 1 << 20, |job| job == "j").unwrap_err();
        assert_eq!(impostor.reason, DeadReason::Malformed);
        assert!(impostor.error.contains('j'), "{}", impostor.error);
    }

    #[test]
    fn a_rejected_message_is_journaled_only_under_a_key_it_carries() {
        let key_of = |body: Option<&[u8]>, id: Option<&str>| {
            rejected_key(body, id, &arrival(), |job| job == "j").map(|(key, _)| key)
        };
        let bad_task = br#"{"key":"k1","task":"no such task"}"#;
        assert_eq!(key_of(Some(bad_task), None).as_deref(), Some("k1"));
        let undecodable = br#"{"key":"k2","task":7}"#;
        assert_eq!(key_of(Some(undecodable), Some("id")).as_deref(), Some("k2"));
        assert_eq!(
            key_of(Some(b"{not json"), Some("k3")).as_deref(),
            Some("k3")
        );
        assert_eq!(key_of(None, Some("k4")).as_deref(), Some("k4"), "oversize");
        assert_eq!(
            key_of(Some(b"[]"), Some("a b")),
            None,
            "breaks the key rule"
        );
        assert_eq!(key_of(Some(b"[]"), None), None);
        // An instance of a job we know, or of any job the message names, only when the
        // decoded envelope is that instance.
        let instance = "j@1970-01-01T00:00:00Z";
        assert_eq!(key_of(Some(&envelope_json(instance)), None), None);
        assert_eq!(key_of(None, Some(instance)), None);
        let named = br#"{"key":"other@1970-01-01T00:00:00Z","task":7,"job":"other"}"#;
        assert_eq!(key_of(Some(named), None), None);
        let mut carried = Envelope::decode(&envelope_json(instance)).unwrap();
        carried.job = Some("j".into());
        carried.task = "no such task".into();
        assert_eq!(
            key_of(Some(&carried.encode()), None).as_deref(),
            Some(instance)
        );
        carried.scheduled_for += chrono::Duration::seconds(1);
        assert_eq!(
            key_of(Some(&carried.encode()), None),
            None,
            "another instant"
        );
    }

    #[test]
    fn a_delivery_before_its_not_before_is_deferred_for_the_time_left() {
        let now = chrono::DateTime::UNIX_EPOCH + chrono::Duration::seconds(100);
        let mut env = Envelope::decode(&envelope_json("k")).unwrap();
        assert_eq!(on_delivery(&env, now), Start::Claim, "no not_before");
        env.not_before = Some(now + chrono::Duration::milliseconds(2950));
        assert_eq!(
            on_delivery(&env, now),
            Start::Defer(Duration::from_millis(2900)),
            "rounded down to a bucket: never past the instant"
        );
        let back = now + chrono::Duration::milliseconds(2900);
        assert_eq!(
            on_delivery(&env, back),
            Start::Defer(Duration::from_millis(50))
        );
        let due = now + chrono::Duration::milliseconds(2950);
        assert_eq!(on_delivery(&env, due), Start::Claim, "due");
        let late = now + chrono::Duration::hours(1);
        assert_eq!(on_delivery(&env, late), Start::Claim, "late: at once");
    }

    #[test]
    fn a_malformed_not_before_is_refused_naming_it() {
        let body = br#"{"key":"k","task":"t","not_before":"tomorrow"}"#;
        let rejected = admit(body, &arrival(), 1 << 20, |_| false).unwrap_err();
        assert_eq!(rejected.reason, DeadReason::Malformed);
        assert!(rejected.error.contains("not_before"), "{}", rejected.error);
        let never = br#"{"key":"k","task":"t","not_before":"2030-01-01T00:00:00Z",
            "expires_at":"2029-01-01T00:00:00Z"}"#;
        let rejected = admit(never, &arrival(), 1 << 20, |_| false).unwrap_err();
        assert_eq!(rejected.reason, DeadReason::Malformed);
        assert!(rejected.error.contains("not_before"), "{}", rejected.error);
    }

    #[test]
    fn unknown_tasks_name_the_task() {
        let rejected = unknown_task("nope");
        assert_eq!(rejected.reason, DeadReason::UnknownTask);
        assert_eq!(
            rejected.error,
            "no task named \"nope\" in this worker's config"
        );
    }

    #[test]
    fn a_reserved_start_within_the_hold_is_waited_for_exactly() {
        let ms = Duration::from_millis;
        assert_eq!(
            on_limited(ms(730), LimitedBy::Rate, ms(0), 0),
            LimitWait::Hold(ms(730))
        );
        assert_eq!(
            on_limited(ms(4000), LimitedBy::Rate, ms(1500), 3),
            LimitWait::Release
        );
        assert_eq!(
            on_limited(ms(10), LimitedBy::Rate, LIMIT_HOLD, 9),
            LimitWait::Release
        );
    }

    #[test]
    fn a_full_group_is_polled_with_backoff_up_to_the_first_lease() {
        let ms = Duration::from_millis;
        let lease = Duration::from_secs(30);
        let by = LimitedBy::Concurrency;
        let polls: Vec<_> = (0..6).map(|n| on_limited(lease, by, ms(0), n)).collect();
        let expect = [50, 100, 200, 400, 500, 500].map(|n| LimitWait::Hold(ms(n)));
        assert_eq!(polls, expect);
        // A dead holder's slot lapses in 30 ms: look then, not later.
        assert_eq!(on_limited(ms(30), by, ms(0), 5), LimitWait::Hold(ms(30)));
        assert_eq!(on_limited(lease, by, ms(4900), 5), LimitWait::Release);
        assert_eq!(on_limited(lease, by, ms(4900), 0), LimitWait::Hold(ms(50)));
    }

    #[test]
    fn a_limited_copy_looks_again_from_a_delay_queue_keeping_its_attempt() {
        let limited = |ms, by| Claim::Limited {
            retry_in: Duration::from_millis(ms),
            by,
        };
        let recheck = |by, ms| {
            Next::Settle(Action::Recheck {
                why: Recheck::Limited { by },
                delay: Duration::from_millis(ms),
            })
        };
        let (rate, group) = (LimitedBy::Rate, LimitedBy::Concurrency);
        assert_eq!(on_claim(&limited(7000, rate)), recheck(rate, 7000));
        assert_eq!(on_claim(&limited(3_600_000, rate)), recheck(rate, 60_000));
        assert_eq!(on_claim(&limited(30_000, group)), recheck(group, 1000));
    }

    #[test]
    fn a_claim_runs() {
        assert_eq!(
            on_claim(&Claim::Claimed { fence: 9 }),
            Next::Run { fence: 9 }
        );
    }

    #[test]
    fn duplicates_are_acked_without_running() {
        for state in [RunState::Done, RunState::Retrying, RunState::Dead] {
            assert_eq!(
                before(Claim::Duplicate { state }),
                Action::Duplicate { state }
            );
        }
    }

    #[test]
    fn expired_copies_are_expired() {
        assert_eq!(before(Claim::Expired), Action::Expire);
    }

    #[test]
    fn busy_and_waiting_recheck_after_the_lease_plus_a_margin() {
        let retry_in = Duration::from_millis(1000);
        assert_eq!(
            before(Claim::Busy {
                retry_in,
                handover: false
            }),
            Action::Recheck {
                why: Recheck::Busy,
                delay: Duration::from_millis(1250)
            }
        );
        // A later attempt waits for the hand-over, not for the whole lease.
        assert_eq!(
            before(Claim::Busy {
                retry_in: Duration::from_secs(30),
                handover: true
            }),
            Action::Recheck {
                why: Recheck::Busy,
                delay: Duration::from_millis(1250)
            }
        );
        assert_eq!(
            before(Claim::Waiting {
                retry_in,
                running: "j@1".into()
            }),
            Action::Recheck {
                why: Recheck::Waiting {
                    running: "j@1".into()
                },
                delay: Duration::from_millis(1250)
            }
        );
    }

    #[test]
    fn skipped_claims_are_recorded_skipped() {
        assert_eq!(
            before(Claim::Skipped {
                running: "j@1".into()
            }),
            Action::Skip {
                running: "j@1".into()
            }
        );
    }

    #[test]
    fn a_success_is_marked_done_with_the_fence() {
        assert_eq!(after(RunResult::Succeeded, 0), Action::Done { fence: 7 });
    }

    #[test]
    fn a_permanent_failure_is_dead_at_any_attempt() {
        for attempt in [0, 5] {
            assert_eq!(
                after(RunResult::Failed(HandlerError::permanent("no")), attempt),
                Action::Dead {
                    reason: DeadReason::Permanent,
                    error: "no".into()
                }
            );
        }
    }

    #[test]
    fn a_retryable_failure_retries_with_backoff_until_exhausted() {
        let failed = || RunResult::Failed(HandlerError::retryable("flaky"));
        // attempt 1 of max_retries = 2: base 1 s · 2 = 2 s, plus half the 20 % jitter.
        assert_eq!(
            after(failed(), 1),
            Action::Retry {
                delay: Duration::from_millis(2200),
                error: "flaky".into()
            }
        );
        assert_eq!(
            after(failed(), 2),
            Action::Dead {
                reason: DeadReason::RetriesExhausted,
                error: "flaky".into()
            }
        );
    }

    #[test]
    fn a_handlers_own_delay_replaces_the_backoff_within_retry_max() {
        // task(2): retry_max is the retry tests' default; a delay above it is cut to it.
        let asked = |d| RunResult::Failed(HandlerError::retry_after("later", d));
        let retry_max = task(2).retry_max;
        assert_eq!(
            after(asked(Duration::from_millis(1500)), 0),
            Action::Retry {
                delay: Duration::from_millis(1500),
                error: "later".into()
            }
        );
        assert_eq!(
            after(asked(retry_max * 10), 0),
            Action::Retry {
                delay: retry_max,
                error: "later".into()
            }
        );
        // Still bounded by max_retries.
        assert!(matches!(
            after(asked(Duration::from_secs(1)), 2),
            Action::Dead {
                reason: DeadReason::RetriesExhausted,
                ..
            }
        ));
    }

    #[test]
    fn a_failure_is_recorded_with_its_causes() {
        let io = std::io::Error::other("connection reset");
        let failed = RunResult::Failed(HandlerError::permanent("ledger").because(io));
        assert_eq!(
            after(failed, 0),
            Action::Dead {
                reason: DeadReason::Permanent,
                error: "ledger: connection reset".into()
            }
        );
    }

    #[test]
    fn a_long_error_keeps_its_start_and_its_end_within_the_bound() {
        assert_eq!(bounded("short".into(), 10), "short");
        let stderr: String = (0..2000).map(|i| format!("line {i}\n")).collect();
        let text = format!("exit code 1: stderr: {stderr}");
        let cut = bounded(text.clone(), ERROR_KEPT);
        assert_eq!(cut.len(), ERROR_KEPT);
        assert!(
            cut.starts_with("exit code 1: stderr: line 0 … "),
            "{}",
            &cut[..40]
        );
        assert!(cut.ends_with("line 1999\n"));
        // Never a cut inside a character.
        let wide = "é".repeat(3000);
        let cut = bounded(wide, 101);
        assert!(cut.len() <= 101 && cut.contains(" … "), "{cut}");
        // Through the decision: the recorded error is bounded.
        let failed = RunResult::Failed(HandlerError::permanent(text));
        let Action::Dead { error, .. } = after(failed, 0) else {
            panic!("not dead")
        };
        assert_eq!(error.len(), ERROR_KEPT);
    }

    #[test]
    fn a_lost_lease_requeues_and_says_why() {
        for lost in [LeaseLost::Taken, LeaseLost::Unreachable("down".into())] {
            assert_eq!(
                after(RunResult::LeaseLost(lost.clone()), 0),
                Action::Requeue { lost }
            );
        }
    }

    #[test]
    fn an_abandoned_run_releases_its_claim() {
        assert_eq!(after(RunResult::Abandoned, 0), Action::Release);
    }

    #[test]
    fn outcomes_are_the_history_texts() {
        let texts = [
            Outcome::Done,
            Outcome::Failed,
            Outcome::Dead,
            Outcome::Expired,
            Outcome::Skipped,
        ]
        .map(Outcome::as_str);
        assert_eq!(texts, ["done", "failed", "dead", "expired", "skipped"]);
    }

    #[test]
    fn dead_reasons_are_the_header_texts() {
        let texts = [
            DeadReason::Permanent,
            DeadReason::RetriesExhausted,
            DeadReason::Expired,
            DeadReason::UnknownTask,
            DeadReason::Malformed,
            DeadReason::Oversize,
        ]
        .map(DeadReason::as_str);
        assert_eq!(
            texts,
            [
                "permanent",
                "retries_exhausted",
                "expired",
                "unknown_task",
                "malformed",
                "oversize"
            ]
        );
    }
}
