//! Each job's recent runs in `status` and on the status page (docs/design.md#recent-runs): the
//! newest run records of `{ns}:history:{job}` (read by [`Store::job_histories`], at most
//! [`RECENT_RUNS`] a job, in the same pipeline as the job's other keys) as shown to a person:
//! outcome, attempt, start, duration and the error on one bounded line.
//!
//! [`Store::job_histories`]: drumline_shared::store::Store::job_histories
//! [`RECENT_RUNS`]: drumline_shared::store::RECENT_RUNS

use drumline_shared::envelope::parse_instant;
use drumline_shared::store::RunRecord;
use drumline_shared::table;
use serde::Serialize;

/// Most characters of a recent run's `error` (the whole text of the last run is the job's
/// `last_error`).
pub const ERROR_CHARS: usize = 200;

/// One of a job's recent runs, newest first in [`crate::status::JobStatus::recent`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RecentRun {
    /// The instance's idempotency key (`job@instant` for a scheduled one).
    pub key: String,
    /// The instant it was scheduled for, RFC 3339 UTC.
    pub scheduled_for: String,
    /// `done`, `failed` (will be retried), `dead`, `expired` or `skipped`.
    pub outcome: String,
    /// The attempt (0 for the first run).
    pub attempt: u32,
    /// The worker that ran it.
    pub worker: String,
    /// When the run started, RFC 3339 UTC (null when it never started: expired, skipped).
    pub started_at: Option<String>,
    /// When the outcome was written, RFC 3339 UTC.
    pub finished_at: String,
    /// `finished_at − started_at` in milliseconds (null without a start).
    pub duration_ms: Option<u64>,
    /// The run's error on one line, at most [`ERROR_CHARS`] characters (its start and end).
    pub error: Option<String>,
}

impl From<RunRecord> for RecentRun {
    fn from(record: RunRecord) -> Self {
        let duration_ms = record
            .started_at
            .as_deref()
            .and_then(parse_instant)
            .zip(parse_instant(&record.finished_at))
            .map(|(start, end)| (end - start).num_milliseconds().max(0) as u64);
        Self {
            key: record.key,
            scheduled_for: record.scheduled_for,
            outcome: record.status,
            attempt: record.attempt,
            worker: record.worker,
            started_at: record.started_at,
            finished_at: record.finished_at,
            duration_ms,
            error: record.error.map(|e| table::one_line(&e, ERROR_CHARS)),
        }
    }
}

/// A duration for people: `850 ms`, `12.3 s`, `4 min 05 s`, `2 h 03 min`.
pub fn human_duration(ms: u64) -> String {
    match ms {
        ms if ms < 1_000 => format!("{ms} ms"),
        ms if ms < 60_000 => format!("{:.1} s", ms as f64 / 1000.0),
        ms if ms < 3_600_000 => format!("{} min {:02} s", ms / 60_000, ms / 1000 % 60),
        ms => format!("{} h {:02} min", ms / 3_600_000, ms / 60_000 % 60),
    }
}

/// The text table of `job`'s recent runs, under a `recent runs of JOB:` line; empty when it
/// has none.
pub fn table(job: &str, runs: &[RecentRun]) -> String {
    if runs.is_empty() {
        return String::new();
    }
    let dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            vec![
                r.key.clone(),
                r.outcome.clone(),
                r.attempt.to_string(),
                dash(r.started_at.clone()),
                dash(r.duration_ms.map(human_duration)),
                dash(r.error.clone()),
            ]
        })
        .collect();
    let headers = ["KEY", "OUTCOME", "ATTEMPT", "STARTED", "DURATION", "ERROR"];
    format!(
        "\nrecent runs of {job}:\n{}",
        table::render(&headers, &rows)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(status: &str, started: Option<&str>, error: Option<&str>) -> RunRecord {
        RunRecord {
            key: "nightly@2026-03-08T07:00:00Z".into(),
            scheduled_for: "2026-03-08T07:00:00Z".into(),
            status: status.into(),
            attempt: 1,
            worker: "w-1:77:abc".into(),
            started_at: started.map(str::to_owned),
            finished_at: "2026-03-08T07:00:02.350Z".into(),
            error: error.map(str::to_owned),
            reason: None,
        }
    }

    #[test]
    fn a_run_record_as_shown() {
        let run = RecentRun::from(record(
            "failed",
            Some("2026-03-08T07:00:00.050Z"),
            Some("exit code 1: stderr: disk full\nretry later"),
        ));
        assert_eq!(run.duration_ms, Some(2300));
        assert_eq!(run.outcome, "failed");
        assert_eq!(
            run.error.as_deref(),
            Some("exit code 1: stderr: disk full ⏎ retry later")
        );
        let never = RecentRun::from(record("expired", None, None));
        assert_eq!((never.duration_ms, never.error), (None, None));
        let long = "x".repeat(5000);
        let cut = RecentRun::from(record("dead", None, Some(&long)));
        assert_eq!(cut.error.unwrap().chars().count(), ERROR_CHARS);
    }

    #[test]
    fn durations_for_people() {
        assert_eq!(human_duration(850), "850 ms");
        assert_eq!(human_duration(12_345), "12.3 s");
        assert_eq!(human_duration(245_000), "4 min 05 s");
        assert_eq!(human_duration(7_380_000), "2 h 03 min");
    }

    #[test]
    fn the_table_of_recent_runs() {
        let runs = vec![
            RecentRun::from(record(
                "dead",
                Some("2026-03-08T07:00:00.050Z"),
                Some("exit code 3"),
            )),
            RecentRun::from(record("expired", None, None)),
        ];
        let text = table("nightly", &runs);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[1], "recent runs of nightly:");
        assert!(lines[2].starts_with("KEY") && lines[2].ends_with("ERROR"));
        assert!(lines[3].contains("dead") && lines[3].ends_with("2.3 s     exit code 3"));
        assert!(lines[4].contains("expired") && lines[4].ends_with("-         -"));
        assert_eq!(table("quiet", &[]), "");
    }
}
