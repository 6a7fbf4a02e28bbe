//! Operating a running schedule (docs/design.md "Operations at run time"): `pause` and `resume` (a
//! set in Redis the leader reads every second), `trigger` (one instance now, as the job) and
//! `backfill` (every instant of a past range, with the job's normal keys). What to publish is
//! decided by pure functions ([`trigger`], [`backfill`]); the commands in
//! [`commands`](crate::commands) carry it out through the [`Store`](drumline_shared::store::Store)
//! and the [`Publisher`](drumline_beat::publisher::Publisher).

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use drumline_shared::config::Job;
use drumline_shared::envelope::Envelope;

/// Most instants one `backfill` publishes unless `--max` says otherwise.
pub const DEFAULT_BACKFILL_MAX: usize = 1000;

/// Why a request is refused (exit code 2; nothing published or changed).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct BadRequest(pub String);

/// `trigger`: one instance of `job` due now (truncated to the millisecond, the one instant
/// codec's precision; a millisecond later when now is one of its scheduled instants), as the
/// job — its task, queue, `expires`, and its args unless `args` replaces them — with the key
/// `{job}@{now}`. Carries epoch 0 (not the leader's). Constant work whatever the schedule
/// (docs/design.md#bounded-work).
pub fn trigger(job: &Job, args: Option<serde_json::Value>, now: DateTime<Utc>) -> Envelope {
    let mut at = now
        .duration_trunc(TimeDelta::milliseconds(1))
        .unwrap_or(now);
    // On a scheduled instant's very millisecond the key would be that instance's, and one of
    // the two would be deduplicated away: the trigger takes the next millisecond. Once, not
    // until a free one is found (that never ended for `every = "1ms"`): a checked config's
    // instants are at least `MIN_EVERY` (100 ms) apart, so the next millisecond is free.
    if job.schedule.next_after(at - TimeDelta::nanoseconds(1)) == Some(at) {
        at += TimeDelta::milliseconds(1);
    }
    let expires_at = job
        .spec
        .expires
        .and_then(|e| TimeDelta::from_std(e).ok())
        .map(|e| at + e);
    let mut env = Envelope::of_job(job, at, expires_at, now);
    // Not the beat's trace: the publisher's own (the command's `TRACEPARENT`, the API's).
    env.trace = None;
    if let Some(args) = args {
        env.args = args;
    }
    env
}

/// `backfill`: every instant of `job`'s schedule in `[from, to)`, oldest first, as envelopes
/// with the job's normal keys (an instance already done is a duplicate the workers skip), no
/// `expires_at`, marked `backfill` (so `overlap = "skip"` queues instead). Refused when `from`
/// is not before `to`, `to` is later than `now`, or there are more than `max` instants.
pub fn backfill(
    job: &Job,
    (from, to): (DateTime<Utc>, DateTime<Utc>),
    max: usize,
    now: DateTime<Utc>,
) -> Result<Vec<Envelope>, BadRequest> {
    if from >= to {
        return Err(BadRequest(format!(
            "--from {} must be before --to {}",
            fmt(from),
            fmt(to)
        )));
    }
    if to > now {
        return Err(BadRequest(format!(
            "--to {} is in the future (now {}): backfill fills the past; the beat publishes the rest",
            fmt(to),
            fmt(now)
        )));
    }
    let mut instants = Vec::new();
    // Just before `from`, so an instant exactly at `from` is included.
    let mut cursor = from - TimeDelta::nanoseconds(1);
    while let Some(t) = job.schedule.next_after(cursor).filter(|t| *t < to) {
        if instants.len() == max {
            return Err(BadRequest(format!(
                "job {:?} has more than {max} instants in [{}, {}); narrow the range or raise --max",
                job.name,
                fmt(from),
                fmt(to)
            )));
        }
        instants.push(t);
        cursor = t;
    }
    Ok(instants
        .into_iter()
        .map(|t| {
            let mut env = Envelope::of_job(job, t, None, now);
            env.backfill = true;
            env
        })
        .collect())
}

fn fmt(t: DateTime<Utc>) -> String {
    drumline_shared::envelope::format_instant(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{at, job};

    const NOW: &str = "2026-03-02T12:10:30Z";

    #[test]
    fn trigger_is_the_job_now_with_its_args_unless_replaced() {
        let j = job("every = \"1h\"\nargs = { n = 1 }\nexpires = \"5m\"");
        let now = at("2026-03-02T12:10:30.123456Z");
        let env = trigger(&j, None, now);
        assert_eq!(env.key, format!("{}@2026-03-02T12:10:30.123Z", j.name));
        assert_eq!(env.job.as_deref(), Some(j.name.as_str()));
        assert_eq!(
            (env.task.as_str(), env.queue.as_str()),
            (&*j.spec.task, "default")
        );
        assert_eq!(env.args, serde_json::json!({"n": 1}));
        assert_eq!(env.expires_at, Some(at("2026-03-02T12:15:30.123Z")));
        assert!(!env.backfill);
        let env = trigger(&j, Some(serde_json::json!([2])), now);
        assert_eq!(env.args, serde_json::json!([2]));
    }

    #[test]
    fn a_trigger_never_takes_a_scheduled_instants_key() {
        let j = job("every = \"1m\"");
        let on_the_minute = at("2026-03-02T12:10:00Z");
        let env = trigger(&j, None, on_the_minute);
        assert_eq!(env.key, format!("{}@2026-03-02T12:10:00.001Z", j.name));
        let between = trigger(&j, None, at("2026-03-02T12:10:00.5Z"));
        assert_eq!(between.key, format!("{}@2026-03-02T12:10:00.500Z", j.name));
        // The fastest schedule a config allows.
        let fast = job("every = \"100ms\"");
        let env = trigger(&fast, None, at("2026-03-02T12:10:00.3Z"));
        assert_eq!(env.key, format!("{}@2026-03-02T12:10:00.301Z", fast.name));
    }

    #[test]
    fn a_trigger_returns_whatever_the_schedule() {
        // Every millisecond an instant (a config refuses it; a program can still build it):
        // the trigger still returns, a millisecond on.
        let mut j = job("every = \"1m\"");
        j.schedule = drumline_shared::schedule::Schedule::Every {
            every: TimeDelta::milliseconds(1),
            anchor: DateTime::UNIX_EPOCH,
        };
        let env = trigger(&j, None, at("2026-03-02T12:10:00.3Z"));
        assert_eq!(env.key, format!("{}@2026-03-02T12:10:00.301Z", j.name));
    }

    #[test]
    fn backfill_is_every_instant_of_the_range_oldest_first_without_expiry() {
        let j = job("every = \"1m\"\nexpires = \"30s\"");
        let from = at("2026-03-02T12:00:00Z");
        let to = at("2026-03-02T12:10:00Z");
        let envs = backfill(&j, (from, to), 1000, at(NOW)).unwrap();
        let instants: Vec<_> = envs.iter().map(|e| e.scheduled_for).collect();
        let want: Vec<_> = (0..10).map(|m| from + TimeDelta::minutes(m)).collect();
        assert_eq!(instants, want, "[from, to): from included, to not");
        assert!(envs.iter().all(|e| e.backfill && e.expires_at.is_none()));
        // Exactly `max` is fine; one more is refused.
        assert_eq!(backfill(&j, (from, to), 10, at(NOW)).unwrap().len(), 10);
        let refused = backfill(&j, (from, to), 9, at(NOW)).unwrap_err();
        assert!(refused.0.contains("more than 9 instants"), "{refused}");
    }

    #[test]
    fn backfill_refuses_a_reversed_or_future_range() {
        let j = job("every = \"1m\"");
        let (a, b) = (at("2026-03-02T12:00:00Z"), at("2026-03-02T12:05:00Z"));
        let e = backfill(&j, (b, a), 1000, at(NOW)).unwrap_err();
        assert!(e.0.contains("must be before --to"), "{e}");
        let e = backfill(&j, (a, a), 1000, at(NOW)).unwrap_err();
        assert!(e.0.contains("must be before --to"), "{e}");
        let e = backfill(&j, (a, at("2026-03-02T12:11:00Z")), 1000, at(NOW)).unwrap_err();
        assert!(e.0.contains("in the future"), "{e}");
    }
}
