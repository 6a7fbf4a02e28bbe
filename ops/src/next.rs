//! `drumline-beat next`: upcoming instants in UTC and local time, with DST annotations, as an
//! aligned table or (`--json`) as `[{job, utc, runs_at, local, offset, note}]` (docs/design.md–8).
//! `utc` is the instant (the key's); `runs_at` is when it is published, the job's jitter added
//! (docs/design.md#jitter).

use chrono::{DateTime, Offset, SecondsFormat, Utc};
use drumline_shared::calendar::{excluded_by, Calendar};
use drumline_shared::config::Job;
use drumline_shared::envelope::format_instant;
use serde::Serialize;
use std::collections::BTreeMap;

/// One line of `next`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Upcoming {
    /// Job name.
    pub job: String,
    /// RFC 3339 UTC: the instant, as in the key.
    pub utc: String,
    /// RFC 3339 UTC: when it is published, `utc` plus the job's jitter (equal without one).
    pub runs_at: String,
    /// RFC 3339 with the local offset (`+00:00`, never `Z`).
    pub local: String,
    /// `+HH:MM`.
    pub offset: String,
    /// `gap: shifted from 02:30`, `gap: skipped 02:30`, `fold: first of two`, `excluded: NAME`
    /// (a calendar skips it), … or null.
    pub note: Option<String>,
}

/// The next `count` occurrences of `job` strictly after `from`, skipped ones included (they are
/// what a reader of a DST schedule most needs to see), those a calendar of `calendars`
/// excludes marked `excluded: NAME` (docs/design.md#calendars).
pub fn upcoming(
    job: &Job,
    from: DateTime<Utc>,
    count: usize,
    calendars: &BTreeMap<String, Calendar>,
) -> Vec<Upcoming> {
    let mut out = Vec::with_capacity(count.min(1024));
    let mut cursor = from;
    while out.len() < count {
        let Some(occ) = job.schedule.next_occurrence_after(cursor) else {
            break;
        };
        let local = occ.at.with_timezone(&job.timezone);
        let secs = local.offset().fix().local_minus_utc();
        let sign = if secs < 0 { '-' } else { '+' };
        out.push(Upcoming {
            job: job.name.clone(),
            utc: format_instant(occ.at),
            runs_at: format_instant(occ.at + job.jitter_offset()),
            // Never `Z`: a zone at UTC+0 (London in winter) still shows its offset.
            local: local.to_rfc3339_opts(SecondsFormat::AutoSi, false),
            offset: format!(
                "{sign}{:02}:{:02}",
                secs.abs() / 3600,
                secs.abs() % 3600 / 60
            ),
            note: note(
                occ.note.map(|n| n.to_string()),
                excluded(job, occ.at, calendars),
            ),
        });
        cursor = occ.at;
    }
    out
}

/// `excluded: NAME` when a calendar of the job's `exclude` holds the instant's local date.
fn excluded(
    job: &Job,
    at: DateTime<Utc>,
    calendars: &BTreeMap<String, Calendar>,
) -> Option<String> {
    let name = excluded_by(&job.spec.exclude, at, job.timezone, |n| calendars.get(n))?;
    Some(format!("excluded: {name}"))
}

/// A DST note and an exclusion, either, both (`; `) or none.
fn note(dst: Option<String>, excluded: Option<String>) -> Option<String> {
    match (dst, excluded) {
        (Some(dst), Some(excluded)) => Some(format!("{dst}; {excluded}")),
        (dst, excluded) => dst.or(excluded),
    }
}

/// Renders lines as an aligned table with a header. A `RUNS AT` column appears when some
/// line is jittered (its `runs_at` differs from its `utc`).
pub fn table(lines: &[Upcoming]) -> String {
    let jittered = lines.iter().any(|l| l.runs_at != l.utc);
    let rows: Vec<Vec<&str>> = lines
        .iter()
        .map(|l| {
            let mut row = vec![&*l.job, &*l.utc];
            if jittered {
                row.push(&*l.runs_at);
            }
            row.extend([&*l.local, l.note.as_deref().unwrap_or("")]);
            row
        })
        .collect();
    let header: &[&str] = if jittered {
        &["JOB", "UTC", "RUNS AT", "LOCAL", "NOTE"]
    } else {
        &["JOB", "UTC", "LOCAL", "NOTE"]
    };
    drumline_shared::table::render(header, &rows)
}
