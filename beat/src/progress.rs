//! The beat's progress (docs/design.md): one instant per job, `{ns}:beat:last:{job}`, meaning
//! everything up to it has been decided (published, or dropped and reported). Loaded at each
//! gain of leadership and written after the broker confirmed, always through the [`Store`] and
//! fenced by the leader lease's token; it only moves forward, and never past Redis `TIME` +
//! `misfire_threshold`. `progress_after` is the pure rule for how far one batch moves it.

use crate::reload;
use chrono::{DateTime, Utc};
use drumline_shared::config::Job;
use drumline_shared::schedule::Schedule;
use drumline_shared::store::{ProgressError, Store, StoreError};
use std::sync::Arc;
use std::time::Duration;
use tracing::warn;

/// Keys per `MGET` when the beat loads every job's last instant at start.
pub(crate) const LOAD_BATCH: usize = 1000;

/// `MGET`s sent per round trip (pipelined) at start.
pub(crate) const LOAD_PIPELINE: usize = 10;

/// Progress writes per script call (each call checks the lease once); the calls of one save go
/// in one round trip.
pub(crate) const SAVE_PER_CALL: usize = 1000;

/// Every job's persisted last instant (`None`: the job never ran, or the value is unreadable,
/// which is logged), in `jobs` order: one pipelined round trip per
/// `LOAD_BATCH`·`LOAD_PIPELINE` jobs rather than one per job.
pub async fn load_last(
    store: &Store,
    jobs: &[Job],
) -> Result<Vec<Option<DateTime<Utc>>>, StoreError> {
    let names: Vec<&str> = jobs.iter().map(|j| j.name.as_str()).collect();
    let lasts = store
        .last_published_many(&names, LOAD_BATCH, LOAD_PIPELINE)
        .await?;
    Ok(jobs
        .iter()
        .zip(lasts)
        .map(|(job, last)| match last? {
            Ok(last) => Some(last),
            Err(text) => {
                warn!(job = %job.name, key = %store.names().beat_last(&job.name), value = %text,
                    "unreadable last instant; treating the job as never run");
                None
            }
        })
        .collect())
}

/// Whether each job's recorded rule ([`reload::rule`], `{ns}:beat:rule:{job}`) is the rule
/// it runs now (`None`: none recorded), in `jobs` order, loaded like [`load_last`]; each rule
/// is compared as it arrives, none is kept.
pub(crate) async fn load_rules(
    store: &Store,
    jobs: &[Job],
) -> Result<Vec<Option<bool>>, StoreError> {
    let names: Vec<&str> = jobs.iter().map(|j| j.name.as_str()).collect();
    let same =
        |i: usize, recorded: Option<String>| recorded.map(|r| r == reload::rule(&jobs[i].schedule));
    store
        .progress_rules(&names, same, LOAD_BATCH, LOAD_PIPELINE)
        .await
}

/// The schedules the jobs `which` (indexes into `jobs`) had when their progress was recorded,
/// where a rule is recorded and reads back ([`reload::schedule_of`]).
pub(crate) async fn load_recorded_schedules(
    store: &Store,
    jobs: &[Job],
    which: &[usize],
) -> Result<Vec<Option<Schedule>>, StoreError> {
    let names: Vec<&str> = which.iter().map(|&i| jobs[i].name.as_str()).collect();
    let read =
        |_: usize, recorded: Option<String>| recorded.as_deref().and_then(reload::schedule_of);
    store
        .progress_rules(&names, read, LOAD_BATCH, LOAD_PIPELINE)
        .await
}

/// Where a job's progress stands after one batch: `sent` are the instants published for it
/// (oldest first), `confirmed[i]` whether the broker confirmed `sent[i]`, and `decided_up_to`
/// the plan's newest decided instant when `sent` was the whole of its plan (`None` when the
/// batch took only part of it).
///
/// Progress moves to the newest instant of the *contiguous confirmed prefix*: an instant
/// confirmed after a failed one is not recorded, since that would skip the failed one. It is
/// planned again on the retry and, if the policy keeps it, published again — a duplicate
/// message with the same key, which workers deduplicate — rather than lost. Only when
/// everything sent was confirmed does progress move on to `decided_up_to`. Never before `last`.
///
/// Returns the new progress and the length of that prefix (the instants it records as
/// published).
pub(crate) fn progress_after(
    last: DateTime<Utc>,
    sent: &[DateTime<Utc>],
    confirmed: &[bool],
    decided_up_to: Option<DateTime<Utc>>,
) -> (DateTime<Utc>, usize) {
    let prefix = confirmed
        .iter()
        .take_while(|ok| **ok)
        .count()
        .min(sent.len());
    let mut to = sent[..prefix].iter().copied().fold(last, DateTime::max);
    if prefix == sent.len() {
        to = decided_up_to.map_or(to, |d| to.max(d));
    }
    (to, prefix)
}

/// Writes each `(job, instant)` as the job's progress (never moving it back) while `token` holds
/// the leader lease and no instant is more than `max_ahead` past Redis `TIME`: one round trip,
/// [`SAVE_PER_CALL`] jobs per script call. Returns each one's failure, if any, in order (all of
/// them when Redis did not answer or the lease is not ours). Shared (`Arc`) because one
/// failure can stall many jobs.
pub(crate) async fn save(
    store: &Store,
    token: &str,
    max_ahead: Duration,
    progress: &[(&str, DateTime<Utc>)],
) -> Vec<Option<Arc<ProgressError>>> {
    if progress.is_empty() {
        return Vec::new();
    }
    per_job(
        store
            .advance_progress(token, progress, max_ahead, SAVE_PER_CALL)
            .await,
        progress.len(),
    )
}

/// [`save`] for jobs whose rule is not recorded yet: writes each `(job, instant, rule)` as the
/// job's progress and the rule it is recorded under, in one fenced script per call.
pub(crate) async fn start(
    store: &Store,
    token: &str,
    max_ahead: Duration,
    starts: &[(&str, DateTime<Utc>, &str)],
) -> Vec<Option<Arc<ProgressError>>> {
    if starts.is_empty() {
        return Vec::new();
    }
    per_job(
        store
            .start_progress(token, starts, max_ahead, SAVE_PER_CALL)
            .await,
        starts.len(),
    )
}

/// A fenced write's answer as each of its `jobs` jobs' failure: its own, or the call's.
fn per_job(
    written: Result<Vec<Result<(), ProgressError>>, ProgressError>,
    jobs: usize,
) -> Vec<Option<Arc<ProgressError>>> {
    match written {
        Ok(outcomes) => outcomes
            .into_iter()
            .map(|r| r.err().map(Arc::new))
            .collect(),
        Err(e) => vec![Some(Arc::new(e)); jobs],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::misfire::plan;
    use crate::misfire::tests::{at, job, minutes, LAST, THRESHOLD};
    use drumline_shared::store::parse_last_instant as parse_last;

    #[test]
    fn a_persisted_instant_covers_its_whole_millisecond() {
        let last = parse_last("2026-03-02T12:00:00.000Z").unwrap();
        assert_eq!(last, at("2026-03-02T12:00:00.000999999Z"));
        // An `every` with a sub-millisecond anchor is not republished after a restart.
        let j = job("every = \"1s\"\nanchor = \"2026-01-01T00:00:00.0005Z\"");
        let published = at("2026-03-02T12:00:00.0005Z");
        let persisted = drumline_shared::store::last_instant_text(published);
        assert_eq!(persisted, "2026-03-02T12:00:00.000Z");
        let p = plan(
            &j,
            parse_last(&persisted).unwrap(),
            at("2026-03-02T12:00:00.9Z"),
            THRESHOLD,
        );
        assert!(p.publish.is_empty(), "{p:?}");
        assert_eq!(parse_last("garbage"), None);
        // A value written by hand with sub-millisecond digits is taken as is.
        assert_eq!(
            parse_last("2026-03-02T12:00:00.0000005Z"),
            Some(at("2026-03-02T12:00:00.0000005Z"))
        );
    }

    #[test]
    fn progress_moves_to_the_newest_of_the_contiguous_confirmed_prefix() {
        let last = at(LAST);
        let sent = minutes(1..=4);
        let decided = at("2026-03-02T12:04:30Z");
        // All confirmed: on to what the plan decided (beyond its last publish).
        assert_eq!(
            progress_after(last, &sent, &[true; 4], Some(decided)),
            (decided, 4)
        );
        // The third failed: the fourth, confirmed, is not recorded — that would skip the third.
        assert_eq!(
            progress_after(last, &sent, &[true, true, false, true], Some(decided)),
            (sent[1], 2)
        );
        // The first failed: nothing moves.
        assert_eq!(
            progress_after(last, &sent, &[false, true, true, true], Some(decided)),
            (last, 0)
        );
        // Part of the plan sent (a full batch): the newest sent, not the plan's decided edge.
        assert_eq!(
            progress_after(last, &sent[..2], &[true, true], None),
            (sent[1], 2)
        );
        // Nothing to publish (drops only): the decided edge.
        assert_eq!(progress_after(last, &[], &[], Some(decided)), (decided, 0));
        // Never back, even if the instants sent were older than `last`.
        let ahead = at("2026-03-02T13:00:00Z");
        assert_eq!(
            progress_after(ahead, &sent, &[true; 4], Some(decided)),
            (ahead, 4)
        );
    }
}
