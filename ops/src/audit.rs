//! `audit` (docs/design.md#audit-and-verify), the pure part: a job's expected instants,
//! recomputed with the beat's planner (its schedule, DST policies included), each classified by
//! what the journal, the run records and the run states say became of it. Reading Redis is the
//! store's; printing is `commands.rs`'s.

use chrono::{DateTime, Utc};
use drumline_shared::config::Job;
use drumline_shared::envelope::{instance_key, parse_instant};
use drumline_shared::store::{JournalEntry, RunRecord};
use serde::Serialize;
use std::collections::HashMap;

/// Most instants one audit lists (a 100 ms job over a day is 864,000: narrow the window).
pub const MAX_INSTANTS: usize = 100_000;

/// What became of one expected instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    /// Succeeded once.
    Ran,
    /// Failed, and waits for its next attempt.
    Retried,
    /// Failed for good (dead-lettered).
    Dead,
    /// Not run, on purpose (paused, misfire policy, overlap): `reason` says which.
    Skipped,
    /// Its `expires` passed before it could run.
    Expired,
    /// Not decided yet, published and waiting, or running.
    Pending,
    /// Due and decided, and nothing says what became of it: a broken promise.
    Missed,
    /// Succeeded more than once: a broken promise.
    Doubled,
}

impl Class {
    /// The name `--json` and the table use.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Ran => "ran",
            Class::Retried => "retried",
            Class::Dead => "dead",
            Class::Skipped => "skipped",
            Class::Expired => "expired",
            Class::Pending => "pending",
            Class::Missed => "MISSED",
            Class::Doubled => "DOUBLED",
        }
    }
}

/// One expected instant and its fate (the `audit --json` row; `worker` is for the table).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// The instant (RFC 3339).
    pub instant: String,
    /// Its idempotency key.
    pub key: String,
    /// What became of it.
    pub class: Class,
    /// Attempts run (a repeat after a crash counted once).
    pub attempts: Option<u32>,
    /// From the instant to the first claim.
    pub lateness_ms: Option<i64>,
    /// From the last claim to its outcome.
    pub duration_ms: Option<i64>,
    /// Why (skipped, dead, missed, doubled).
    pub reason: Option<String>,
    /// The worker of the outcome.
    #[serde(skip)]
    pub worker: Option<String>,
}

/// What Redis says about a job, as read for an audit.
#[derive(Debug, Default)]
pub struct Evidence {
    /// The job's journal entries (oldest first).
    pub entries: Vec<JournalEntry>,
    /// Run records of the job (any order).
    pub history: Vec<RunRecord>,
    /// Run states (`{ns}:run:{key}` state) by key.
    pub states: HashMap<String, String>,
    /// The beat's progress: every instant up to it has been decided.
    pub progress: Option<DateTime<Utc>>,
}

/// The instants of `job`'s schedule in `[from, to]`, at most [`MAX_INSTANTS`].
pub fn expected(job: &Job, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<DateTime<Utc>> {
    let mut out = Vec::new();
    let Some(mut cursor) = from.checked_sub_signed(chrono::TimeDelta::nanoseconds(1)) else {
        return out;
    };
    while let Some(t) = job.schedule.next_after(cursor) {
        if t > to || out.len() >= MAX_INSTANTS {
            break;
        }
        out.push(t);
        cursor = t;
    }
    out
}

/// The instant of an instance key of `job` (`{job}@{instant}`), if it is one.
pub fn instant_of(job: &str, key: &str) -> Option<DateTime<Utc>> {
    parse_instant(key.strip_prefix(job)?.strip_prefix('@')?)
}

/// The oldest instant the beat itself decided, as far as the journal or run records know:
/// instants before it are not expected (the job did not exist, or its records are gone). Only
/// entries carrying a leader's epoch count (the leader's own, and claims of copies a leader
/// published), so an operator's backfill or trigger of older instants does not move it back
/// and make every instant between them and the job's first start a false miss. Without such
/// entries (a journal from before epochs, or none), any entry or run record counts.
pub fn first_progress(job: &str, evidence: &Evidence) -> Option<DateTime<Utc>> {
    let led = evidence
        .entries
        .iter()
        .filter(|e| e.epoch.is_some())
        .filter_map(|e| instant_of(job, &e.key))
        .min();
    if led.is_some() {
        return led;
    }
    let journaled = evidence
        .entries
        .iter()
        .filter_map(|e| instant_of(job, &e.key));
    let recorded = evidence
        .history
        .iter()
        .filter_map(|r| parse_instant(&r.scheduled_for));
    journaled.chain(recorded).min()
}

/// The latest `start` the leader journaled for `job` up to `to` (docs/audit.md#the-journal).
fn last_start(job: &str, evidence: &Evidence, to: DateTime<Utc>) -> Option<DateTime<Utc>> {
    evidence
        .entries
        .iter()
        .filter(|e| e.event == "start")
        .filter_map(|e| instant_of(job, &e.key))
        .filter(|t| *t <= to)
        .max()
}

/// Every expected instant of `job` in `[from, to]` (from its first progress on, and any
/// earlier one the journal names: a backfilled instant), classified.
pub fn audit(job: &Job, from: DateTime<Utc>, to: DateTime<Utc>, evidence: &Evidence) -> Vec<Row> {
    let Some(first) = first_progress(&job.name, evidence) else {
        return Vec::new();
    };
    // The job's rule is in force from its latest start (a reload that rescheduled it): the
    // instants it names before then belonged to the rule before, and are listed only where the
    // journal names them.
    let after_start = |s: DateTime<Utc>| first.max(s + chrono::TimeDelta::nanoseconds(1));
    let first = last_start(&job.name, evidence, to).map_or(first, after_start);
    let mut by_key: HashMap<&str, Vec<&JournalEntry>> = HashMap::new();
    let mut ranges = Vec::new();
    for e in evidence.entries.iter().filter(|e| e.event != "start") {
        by_key.entry(e.key.as_str()).or_default().push(e);
        if let (Some(a), Some(b)) = (instant_of(&job.name, &e.key), parse_instant(&e.to)) {
            ranges.push((a, b, e.reason.as_str()));
        }
    }
    let mut records: HashMap<&str, Vec<&RunRecord>> = HashMap::new();
    for r in &evidence.history {
        records.entry(r.key.as_str()).or_default().push(r);
    }
    expected(job, from, to)
        .into_iter()
        .map(|t| (t, instance_key(&job.name, t)))
        .filter(|(t, key)| *t >= first || by_key.contains_key(key.as_str()))
        .map(|(t, key)| {
            let facts = Facts {
                entries: by_key.get(key.as_str()).map_or(&[][..], Vec::as_slice),
                records: records.get(key.as_str()).map_or(&[][..], Vec::as_slice),
                state: evidence.states.get(&key).map(String::as_str),
                range: ranges
                    .iter()
                    .find(|(a, b, _)| *a <= t && t <= *b)
                    .map(|r| r.2),
                decided: evidence.progress.is_some_and(|p| t <= p) && t >= first,
            };
            classify(t, key, &facts)
        })
        .collect()
}

/// What is known about one instance.
#[derive(Debug, Default)]
pub struct Facts<'a> {
    /// Its journal entries, oldest first.
    pub entries: &'a [&'a JournalEntry],
    /// Its run records.
    pub records: &'a [&'a RunRecord],
    /// Its run state, if recorded.
    pub state: Option<&'a str>,
    /// The reason of a dropped range it falls in.
    pub range: Option<&'a str>,
    /// Whether the beat has decided it (its progress is at or past it).
    pub decided: bool,
}

impl Facts<'_> {
    fn events<'s>(&'s self, ev: &'s str) -> impl Iterator<Item = &'s &'s JournalEntry> + 's {
        self.entries.iter().filter(move |e| e.event == ev)
    }

    fn has(&self, ev: &str, state: &str, status: &str) -> bool {
        self.events(ev).next().is_some()
            || self.state == Some(state)
            || self.records.iter().any(|r| r.status == status)
    }

    /// Successes: distinct claim tokens journaled `success`, or `done` run records, whichever
    /// says more.
    pub fn successes(&self) -> usize {
        let mut tokens: Vec<&str> = self.events("success").map(|e| e.token.as_str()).collect();
        tokens.sort_unstable();
        tokens.dedup();
        let recorded = self.records.iter().filter(|r| r.status == "done").count();
        tokens.len().max(recorded)
    }
}

/// Classifies one instant `t` (key `key`) from its facts.
pub fn classify(t: DateTime<Utc>, key: String, facts: &Facts<'_>) -> Row {
    let mut row = Row {
        instant: drumline_shared::envelope::format_instant(t),
        key,
        class: Class::Pending,
        attempts: None,
        lateness_ms: None,
        duration_ms: None,
        reason: None,
        worker: None,
    };
    let successes = facts.successes();
    let (class, reason) = if successes >= 2 {
        (Class::Doubled, Some(format!("{successes} successes")))
    } else if successes == 1 {
        (Class::Ran, None)
    } else if facts.has("dead", "dead", "dead") {
        let error = facts.records.iter().find(|r| r.status == "dead");
        (Class::Dead, error.and_then(|r| r.error.clone()))
    } else if facts.has("expired", "expired", "expired") {
        (Class::Expired, None)
    } else if let Some(reason) = skipped(facts) {
        (Class::Skipped, Some(reason))
    } else if in_flight(facts) {
        let retrying = facts.state == Some("retrying")
            || facts
                .entries
                .iter()
                .rev()
                .find(|e| is_run_event(e))
                .map(|e| e.event.as_str())
                == Some("retry");
        (
            if retrying {
                Class::Retried
            } else {
                Class::Pending
            },
            None,
        )
    } else if facts.decided {
        let why = "decided, but no journal entry, run record or state";
        (Class::Missed, Some(why.to_owned()))
    } else {
        (
            Class::Pending,
            Some("not decided by the beat yet".to_owned()),
        )
    };
    row.class = class;
    row.reason = reason;
    measure(t, facts, &mut row);
    row
}

/// Entries that start, hand over or end a run.
fn is_run_event(e: &JournalEntry) -> bool {
    matches!(
        e.event.as_str(),
        "claim" | "takeover" | "retry" | "release" | "success" | "dead"
    )
}

/// Why the instance was skipped, if it was: the beat's drop, the claim's overlap, a state or
/// run record `skipped`, or a dropped range it falls in.
fn skipped(facts: &Facts<'_>) -> Option<String> {
    if let Some(e) = facts.events("skipped").next() {
        return Some(e.reason.clone());
    }
    if let Some(record) = facts.records.iter().find(|r| r.status == "skipped") {
        return Some(
            record
                .reason
                .clone()
                .unwrap_or_else(|| "overlap".to_owned()),
        );
    }
    if facts.state == Some("skipped") {
        return Some("overlap".to_owned());
    }
    facts.range.map(str::to_owned)
}

/// Published, claimed, waiting for a retry, or running.
fn in_flight(facts: &Facts<'_>) -> bool {
    matches!(facts.state, Some("running" | "retrying"))
        || facts.entries.iter().any(|e| {
            matches!(
                e.event.as_str(),
                "published" | "claim" | "takeover" | "retry" | "release"
            )
        })
}

/// Attempts, lateness, duration and worker, from the journal, else from the run records.
fn measure(t: DateTime<Utc>, facts: &Facts<'_>, row: &mut Row) {
    let t_ms = t.timestamp_millis();
    let runs: Vec<&&JournalEntry> = facts
        .entries
        .iter()
        .filter(|e| matches!(e.event.as_str(), "claim" | "takeover"))
        .collect();
    let outcome = facts
        .entries
        .iter()
        .rev()
        .find(|e| matches!(e.event.as_str(), "success" | "dead"));
    if let Some(first) = runs.first() {
        row.attempts = runs.iter().filter_map(|e| e.attempt).max().map(|a| a + 1);
        row.lateness_ms = Some(first.at_ms - t_ms);
        if let (Some(last), Some(end)) = (runs.last(), outcome) {
            row.duration_ms = Some(end.ended_ms().max(last.at_ms) - last.at_ms);
        }
        row.worker = outcome.or(runs.last().copied()).map(|e| e.worker.clone());
        return;
    }
    let ms = |text: &str| parse_instant(text).map(|i| i.timestamp_millis());
    let Some(last) = facts.records.iter().max_by_key(|r| r.attempt) else {
        return;
    };
    row.attempts = Some(last.attempt + 1);
    row.worker = Some(last.worker.clone());
    let started = last.started_at.as_deref().and_then(ms);
    row.lateness_ms = started.map(|s| s - t_ms);
    row.duration_ms = started.zip(ms(&last.finished_at)).map(|(s, f)| f - s);
}

/// How many rows of each class, in [`Class`] order, for the summary line.
pub fn summary(rows: &[Row]) -> String {
    let classes = [
        Class::Ran,
        Class::Retried,
        Class::Dead,
        Class::Skipped,
        Class::Expired,
        Class::Pending,
        Class::Missed,
        Class::Doubled,
    ];
    let parts: Vec<String> = classes
        .iter()
        .filter_map(|c| {
            let n = rows.iter().filter(|r| r.class == *c).count();
            (n > 0).then(|| format!("{n} {}", c.as_str()))
        })
        .collect();
    if parts.is_empty() {
        "nothing expected".to_owned()
    } else {
        parts.join(", ")
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::fixtures::{at, job};

    pub(crate) fn entry(
        at_ms: i64,
        event: &str,
        key: &str,
        attempt: u32,
        token: &str,
    ) -> JournalEntry {
        JournalEntry {
            id: format!("{at_ms}-0"),
            at_ms,
            event: event.into(),
            key: key.into(),
            attempt: Some(attempt),
            token: token.into(),
            worker: "w1".into(),
            // As a leader's copy carries (an operator's has none: see `first_progress`).
            epoch: Some(1),
            ..JournalEntry::default()
        }
    }

    fn minute_job() -> Job {
        job("every = \"1m\"")
    }

    fn ms(text: &str) -> i64 {
        at(text).timestamp_millis()
    }

    fn key(j: &Job, t: &str) -> String {
        instance_key(&j.name, at(t))
    }

    fn evidence(j: &Job) -> Evidence {
        let k1 = key(j, "2026-01-01T00:01:00Z");
        let k2 = key(j, "2026-01-01T00:02:00Z");
        let k3 = key(j, "2026-01-01T00:03:00Z");
        Evidence {
            entries: vec![
                entry(ms("2026-01-01T00:01:00.020Z"), "claim", &k1, 0, "a"),
                entry(ms("2026-01-01T00:01:00.520Z"), "success", &k1, 0, "a"),
                entry(ms("2026-01-01T00:02:00.010Z"), "claim", &k2, 0, "b"),
                entry(ms("2026-01-01T00:02:01Z"), "retry", &k2, 0, "b"),
                entry(ms("2026-01-01T00:03:00Z"), "published", &k3, 0, ""),
            ],
            progress: Some(at("2026-01-01T00:05:00Z")),
            ..Evidence::default()
        }
    }

    fn classes(rows: &[Row]) -> Vec<Class> {
        rows.iter().map(|r| r.class).collect()
    }

    #[test]
    fn each_instant_is_classified_from_its_journal_entries() {
        let j = minute_job();
        let rows = audit(
            &j,
            at("2026-01-01T00:00:00Z"),
            at("2026-01-01T00:06:00Z"),
            &evidence(&j),
        );
        // 00:01 first progress; 00:04 and 00:05 decided with no trace: missed; 00:06 not decided.
        assert_eq!(
            classes(&rows),
            [
                Class::Ran,
                Class::Retried,
                Class::Pending,
                Class::Missed,
                Class::Missed,
                Class::Pending
            ]
        );
        assert_eq!(rows[0].attempts, Some(1));
        assert_eq!(rows[0].lateness_ms, Some(20));
        assert_eq!(rows[0].duration_ms, Some(500));
        assert_eq!(rows[0].worker.as_deref(), Some("w1"));
    }

    #[test]
    fn instants_before_the_first_progress_are_not_expected() {
        let j = minute_job();
        let rows = audit(
            &j,
            at("2025-12-31T23:00:00Z"),
            at("2026-01-01T00:02:00Z"),
            &evidence(&j),
        );
        assert_eq!(rows.len(), 2);
        assert!(audit(
            &j,
            at("2026-01-01T00:00:00Z"),
            at("2026-01-01T00:02:00Z"),
            &Evidence::default()
        )
        .is_empty());
    }

    /// Issue 33: a backfill of instants before the job's first start names them in the journal
    /// without a leader's epoch: they are listed as what became of them, and the instants
    /// between them and the first start are not expected (no false miss).
    #[test]
    fn a_backfill_before_the_first_start_moves_nothing_back() {
        let j = minute_job();
        let mut ev = evidence(&j);
        let old = key(&j, "2025-12-31T23:00:00Z");
        for (event, at_ms) in [("claim", 1), ("success", 2)] {
            let mut e = entry(ms("2026-01-01T00:05:00Z") + at_ms, event, &old, 0, "op");
            e.epoch = None;
            ev.entries.push(e);
        }
        let rows = audit(
            &j,
            at("2025-12-31T22:00:00Z"),
            at("2026-01-01T00:02:00Z"),
            &ev,
        );
        assert_eq!(classes(&rows), [Class::Ran, Class::Ran, Class::Retried]);
        assert_eq!(rows[0].key, old);
    }

    /// Issue 33: a reload rescheduled the job at 00:01:30 (journaled `start`): its rule's
    /// instants before then are not expected, those after it are, the start's own instant
    /// (never published: the first is after it) included in neither.
    #[test]
    fn a_journaled_start_ends_what_the_rule_expects_before_it() {
        let j = minute_job();
        let mut ev = evidence(&j);
        ev.entries.push(entry(
            ms("2026-01-01T00:02:30Z"),
            "start",
            &key(&j, "2026-01-01T00:02:00Z"),
            0,
            "",
        ));
        let rows = audit(
            &j,
            at("2026-01-01T00:00:00Z"),
            at("2026-01-01T00:06:00Z"),
            &ev,
        );
        // 00:01 and 00:02 are journaled (ran, retried); 00:03 on: the new rule's.
        assert_eq!(
            classes(&rows),
            [
                Class::Ran,
                Class::Retried,
                Class::Pending,
                Class::Missed,
                Class::Missed,
                Class::Pending
            ]
        );
        let mut bare = evidence(&j);
        bare.entries.truncate(1);
        bare.entries.push(entry(
            ms("2026-01-01T00:03:30Z"),
            "start",
            &key(&j, "2026-01-01T00:03:00Z"),
            0,
            "",
        ));
        let rows = audit(
            &j,
            at("2026-01-01T00:00:00Z"),
            at("2026-01-01T00:04:00Z"),
            &bare,
        );
        assert_eq!(
            rows.len(),
            2,
            "00:01 journaled, 00:04 after the start: {rows:?}"
        );
    }

    #[test]
    fn two_successes_are_doubled_and_one_token_twice_is_not() {
        let j = minute_job();
        let k = key(&j, "2026-01-01T00:01:00Z");
        let mut ev = evidence(&j);
        ev.entries
            .push(entry(ms("2026-01-01T00:01:02Z"), "success", &k, 0, "a"));
        assert_eq!(
            audit(
                &j,
                at("2026-01-01T00:01:00Z"),
                at("2026-01-01T00:01:00Z"),
                &ev
            )[0]
            .class,
            Class::Ran
        );
        ev.entries
            .push(entry(ms("2026-01-01T00:01:03Z"), "success", &k, 1, "z"));
        let row = &audit(
            &j,
            at("2026-01-01T00:01:00Z"),
            at("2026-01-01T00:01:00Z"),
            &ev,
        )[0];
        assert_eq!(row.class, Class::Doubled);
        assert_eq!(row.reason.as_deref(), Some("2 successes"));
    }

    #[test]
    fn drops_dead_expired_and_states_without_a_journal() {
        let j = minute_job();
        let mut ev = evidence(&j);
        let mut paused = entry(
            ms("2026-01-01T00:04:00Z"),
            "skipped",
            &key(&j, "2026-01-01T00:04:00Z"),
            0,
            "",
        );
        paused.reason = "paused".into();
        ev.entries.push(paused);
        ev.states
            .insert(key(&j, "2026-01-01T00:05:00Z"), "dead".into());
        let mut range = entry(0, "skipped", &key(&j, "2026-01-01T00:06:00Z"), 0, "");
        range.reason = "past_grace".into();
        range.to = "2026-01-01T00:07:00Z".into();
        ev.entries.push(range);
        ev.history.push(RunRecord {
            key: key(&j, "2026-01-01T00:08:00Z"),
            scheduled_for: "2026-01-01T00:08:00Z".into(),
            status: "expired".into(),
            attempt: 0,
            worker: "w2".into(),
            started_at: None,
            finished_at: "2026-01-01T00:09:00Z".into(),
            error: None,
            reason: None,
        });
        ev.progress = Some(at("2026-01-01T00:09:00Z"));
        let rows = audit(
            &j,
            at("2026-01-01T00:04:00Z"),
            at("2026-01-01T00:08:00Z"),
            &ev,
        );
        assert_eq!(
            classes(&rows),
            [
                Class::Skipped,
                Class::Dead,
                Class::Skipped,
                Class::Skipped,
                Class::Expired
            ]
        );
        assert_eq!(rows[0].reason.as_deref(), Some("paused"));
        assert_eq!(rows[2].reason.as_deref(), Some("past_grace"));
    }

    #[test]
    fn a_run_record_alone_measures_the_run() {
        let j = minute_job();
        let ev = Evidence {
            history: vec![RunRecord {
                key: key(&j, "2026-01-01T00:01:00Z"),
                scheduled_for: "2026-01-01T00:01:00Z".into(),
                status: "done".into(),
                attempt: 1,
                worker: "w2".into(),
                started_at: Some("2026-01-01T00:01:02Z".into()),
                finished_at: "2026-01-01T00:01:05Z".into(),
                error: None,
                reason: None,
            }],
            progress: Some(at("2026-01-01T00:01:00Z")),
            ..Evidence::default()
        };
        let row = &audit(
            &j,
            at("2026-01-01T00:00:00Z"),
            at("2026-01-01T00:01:30Z"),
            &ev,
        )[0];
        assert_eq!((row.class, row.attempts), (Class::Ran, Some(2)));
        assert_eq!((row.lateness_ms, row.duration_ms), (Some(2000), Some(3000)));
        assert_eq!(summary(std::slice::from_ref(row)), "1 ran");
    }
}
