//! The bodies of `audit` and `verify` (docs/design.md#audit-and-verify): read what Redis holds
//! through the [`Store`], hand it to the pure [`audit`] and [`verify`] modules, print.

use crate::audit::{self, Evidence, Row};
use crate::commands::{find_job, instant_arg, store};
use crate::verify::{self, Bound, Report, Violation};
use chrono::{DateTime, Utc};
use drumline_shared::config::{Config, Job, Overlap};
use drumline_shared::envelope::{format_instant, instance_key};
use drumline_shared::exit::Failure;
use drumline_shared::store::{JournalEntry, Store};
use drumline_shared::table;
use serde::Serialize;
use std::collections::HashSet;
use std::time::Duration;

/// How far before a window the journal is read: entries come after their instant, but a
/// beat's clock may run a little ahead of Redis `TIME`.
const CLOCK_SLACK_MS: i64 = 60_000;

fn redis_failure(e: impl std::fmt::Display) -> Failure {
    Failure::other(format!("redis: {e}"))
}

/// What Redis holds about `job` for instants in `[from, to]`: progress first, so every instant
/// it covers has its journal entries written by the time they are read.
async fn evidence(
    store: &Store,
    job: &Job,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    journal: Option<&[JournalEntry]>,
) -> Result<Evidence, Failure> {
    let progress = store
        .last_published(&job.name)
        .await
        .map_err(redis_failure)?;
    let prefix = format!("{}@", job.name);
    let entries = match journal {
        Some(all) => all
            .iter()
            .filter(|e| e.key.starts_with(&prefix))
            .cloned()
            .collect(),
        None => store
            .journal_since(from.timestamp_millis() - CLOCK_SLACK_MS, |k| {
                k.starts_with(&prefix)
            })
            .await
            .map_err(redis_failure)?,
    };
    let history = store.history_all(&job.name).await.map_err(redis_failure)?;
    let keys: Vec<String> = audit::expected(job, from, to)
        .into_iter()
        .map(|t| instance_key(&job.name, t))
        .collect();
    let states = store.run_states(&keys).await.map_err(redis_failure)?;
    let states = keys
        .into_iter()
        .zip(states)
        .filter_map(|(k, s)| Some((k, s?)))
        .collect();
    Ok(Evidence {
        entries,
        history,
        states,
        progress,
    })
}

/// The `audit --json` document.
#[derive(Serialize)]
struct AuditDoc<'a> {
    job: &'a str,
    from: String,
    to: String,
    instants: &'a [Row],
}

/// `audit JOB`: the job's expected instants in `[from, to]` (default: the last 24 h) and what
/// became of each.
pub async fn audit(
    config: &Config,
    job: &str,
    (from, to): (Option<&str>, Option<&str>),
    json: bool,
) -> Result<(), Failure> {
    let job = find_job(config, job)?;
    let now = Utc::now();
    let to = to
        .map(|t| instant_arg("--to", t))
        .transpose()?
        .unwrap_or(now);
    let from = match from {
        Some(t) => instant_arg("--from", t)?,
        None => to - chrono::Duration::hours(24),
    };
    if from > to {
        return Err(Failure::usage("--from is after --to"));
    }
    let store = store(config).await?;
    let rows = audit::audit(job, from, to, &evidence(&store, job, from, to, None).await?);
    if json {
        let doc = AuditDoc {
            job: &job.name,
            from: format_instant(from),
            to: format_instant(to),
            instants: &rows,
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&doc).expect("serialises")
        );
        return Ok(());
    }
    print!("{}", audit_table(&job.name, (from, to), &rows));
    Ok(())
}

fn audit_table(job: &str, (from, to): (DateTime<Utc>, DateTime<Utc>), rows: &[Row]) -> String {
    let mut out = format!(
        "{job} from {} to {}: {} instants ({})\n",
        format_instant(from),
        format_instant(to),
        rows.len(),
        audit::summary(rows)
    );
    let ms = |v: Option<i64>| v.map_or(String::new(), |v| format!("{v}ms"));
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.instant.clone(),
                r.class.as_str().to_owned(),
                r.attempts.map_or(String::new(), |a| a.to_string()),
                ms(r.lateness_ms),
                ms(r.duration_ms),
                r.worker.clone().unwrap_or_default(),
                table::one_line(r.reason.as_deref().unwrap_or(""), 60),
            ]
        })
        .collect();
    if !cells.is_empty() {
        let headers = [
            "INSTANT", "CLASS", "ATTEMPTS", "LATENESS", "DURATION", "WORKER", "REASON",
        ];
        out.push_str(&table::render(&headers, &cells));
    }
    out
}

/// `verify --since D`: every key of the window checked; exit 0 when the promise holds, 1 with
/// each violation.
pub async fn verify(config: &Config, since: Duration, json: bool) -> Result<(), Failure> {
    let now = Utc::now();
    let since = now - chrono::Duration::from_std(since).map_err(Failure::usage)?;
    let store = store(config).await?;
    // Progress before the journal (see `evidence`): one read per job.
    let mut evidences = Vec::with_capacity(config.jobs.len());
    for job in &config.jobs {
        let progress = store
            .last_published(&job.name)
            .await
            .map_err(redis_failure)?;
        evidences.push(progress);
    }
    let entries = store
        .journal_since(since.timestamp_millis() - CLOCK_SLACK_MS, |_| true)
        .await
        .map_err(redis_failure)?;
    let report = check(config, &store, &entries, evidences, (since, now)).await?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("serialises")
        );
    } else {
        print!("{}", verify_text(&report));
    }
    if report.holds {
        Ok(())
    } else {
        Err(Failure::Reported)
    }
}

/// The checks of `verify` over `entries` (the whole journal of the window) and each job's
/// audit of the window.
async fn check(
    config: &Config,
    store: &Store,
    entries: &[JournalEntry],
    progress: Vec<Option<DateTime<Utc>>>,
    (since, now): (DateTime<Utc>, DateTime<Utc>),
) -> Result<Report, Failure> {
    let by_key = verify::by_key(entries);
    let mut checked: HashSet<String> = by_key.keys().map(|k| k.to_string()).collect();
    let mut violations: Vec<Violation> = Vec::new();
    let adhoc_bound = config
        .tasks
        .values()
        .map(|t| t.max_retries)
        .max()
        .unwrap_or(0);
    for (key, list) in &by_key {
        let task = key
            .split_once('@')
            .and_then(|(job, _)| config.job(job))
            .and_then(|job| config.tasks.get(&*job.spec.task));
        let max_retries = task.map_or(adhoc_bound, |t| t.max_retries);
        violations.extend(verify::check_key(key, list, Bound { max_retries }));
    }
    let margin = config.worker.lease.as_millis() as i64;
    for (job, progress) in config.jobs.iter().zip(progress) {
        let prefix = format!("{}@", job.name);
        let own: Vec<JournalEntry> = entries
            .iter()
            .filter(|e| e.key.starts_with(&prefix))
            .cloned()
            .collect();
        if job.spec.overlap != Overlap::Allow {
            let refs: Vec<&JournalEntry> = own.iter().collect();
            violations.extend(verify::check_overlap(&verify::spans(&refs), margin));
        }
        let mut evidence = evidence(store, job, since, now, Some(&own)).await?;
        evidence.progress = progress;
        let rows = audit::audit(job, since, now, &evidence);
        checked.extend(rows.iter().map(|r| r.key.clone()));
        violations.extend(verify::from_audit(&rows, |k| by_key.contains_key(k)));
    }
    Ok(Report {
        since: format_instant(since),
        checked: checked.len(),
        holds: violations.is_empty(),
        violations,
    })
}

fn verify_text(report: &Report) -> String {
    if report.holds {
        return format!(
            "since {}: {} keys checked: the promise holds\n",
            report.since, report.checked
        );
    }
    let mut out = format!(
        "since {}: {} keys checked: {} violations\n",
        report.since,
        report.checked,
        report.violations.len()
    );
    let cells: Vec<Vec<String>> = report
        .violations
        .iter()
        .map(|v| vec![v.key.clone(), v.rule.to_owned(), v.evidence.clone()])
        .collect();
    out.push_str(&table::render(&["KEY", "RULE", "EVIDENCE"], &cells));
    out
}
