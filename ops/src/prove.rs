//! The bodies of `audit` and `verify` (docs/design.md#audit-and-verify): read what Redis holds
//! through the [`Store`], hand it to the pure [`audit`] and [`verify`] modules, print.

use crate::audit::{self, Evidence, Row};
use crate::commands::{find_job, instant_arg, store};
use crate::verify::{self, Bound, Report, Violation};
use chrono::{DateTime, Utc};
use drumline_shared::config::{Config, Job, Overlap};
use drumline_shared::envelope::{format_instant, instance_key};
use drumline_shared::exit::Failure;
use drumline_shared::planted::{self, planted, Defect};
use drumline_shared::store::{JournalEntry, Store};
use drumline_shared::table;
use serde::Serialize;
use std::collections::{BTreeMap, HashSet};
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
    let mut evidence = Evidence {
        entries,
        history,
        states,
        progress,
    };
    if planted(Defect::FalseMissed) {
        let hidden = |key: &str| planted::one_in(key, 7);
        evidence.entries.retain(|e| !hidden(&e.key));
        evidence.history.retain(|r| !hidden(&r.key));
        evidence.states.retain(|k, _| !hidden(k));
    }
    Ok(evidence)
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

/// `verify --since D --overdue O`: every key of the window checked; exit 0 when the promise
/// holds, 1 with each violation.
pub async fn verify(
    config: &Config,
    (since, overdue): (Duration, Duration),
    json: bool,
) -> Result<(), Failure> {
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
    let mut report = check(config, &store, &entries, evidences.clone(), (since, now)).await?;
    let by_key = verify::by_key(&entries);
    report
        .violations
        .extend(fates(config, &store, &by_key, overdue, now).await?);
    report
        .violations
        .extend(unpublished(config, &store, &evidences, since, now).await?);
    report.holds = report.violations.is_empty();
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
            violations.extend(verify::check_overlap(&verify::spans(&refs, margin), margin));
        }
        let mut evidence = evidence(store, job, since, now, Some(&own)).await?;
        evidence.progress = progress;
        let rows = audit::audit(job, since, now, &evidence);
        checked.extend(rows.iter().map(|r| r.key.clone()));
        violations.extend(verify::from_audit(&rows, |k| by_key.contains_key(k)));
    }
    violations.extend(limits(config, entries));
    violations.extend(order(config, &by_key));
    Ok(Report {
        since: format_instant(since),
        checked: checked.len(),
        holds: violations.is_empty(),
        violations,
    })
}

/// `order` (docs/audit.md#verify): each `after` job's instance against its upstream's for the
/// same instant.
fn order(config: &Config, by_key: &BTreeMap<&str, Vec<&JournalEntry>>) -> Vec<Violation> {
    let mut out = Vec::new();
    for (key, list) in by_key {
        let Some((name, instant)) = key.split_once('@') else {
            continue;
        };
        let Some(after) = config.job(name).and_then(|j| j.after.as_ref()) else {
            continue;
        };
        let upstream = format!("{}@{instant}", after.upstream);
        let upstream = by_key.get(upstream.as_str()).map_or(&[][..], Vec::as_slice);
        out.extend(verify::check_order(key, list, upstream));
    }
    out
}

/// `limit` (docs/audit.md#verify): per concurrency group, the runs of every job whose task is
/// in it (an ad-hoc key's journal does not name its task: not counted).
fn limits(config: &Config, entries: &[JournalEntry]) -> Vec<Violation> {
    let lease = config.worker.lease.as_millis() as i64;
    let mut out = Vec::new();
    for (group, limit) in &config.limits {
        let Some(concurrency) = limit.concurrency else {
            continue;
        };
        let in_group = |key: &str| {
            let job = key.split_once('@').and_then(|(j, _)| config.job(j));
            let task = job.and_then(|j| config.tasks.get(&*j.spec.task));
            task.and_then(|t| t.limit.as_ref())
                .is_some_and(|l| l.name == *group)
        };
        let refs: Vec<&JournalEntry> = entries.iter().filter(|e| in_group(&e.key)).collect();
        out.extend(verify::check_limit(
            group,
            concurrency,
            &verify::spans(&refs, lease),
        ));
    }
    out
}

/// `lost` and `retry_dropped` over every key of the window (docs/audit.md#verify): each key's
/// entries beside its run state and lease now.
async fn fates(
    config: &Config,
    store: &Store,
    by_key: &std::collections::BTreeMap<&str, Vec<&JournalEntry>>,
    overdue: Duration,
    now: DateTime<Utc>,
) -> Result<Vec<Violation>, Failure> {
    let keys: Vec<String> = by_key.keys().map(|k| k.to_string()).collect();
    let leases = store.run_leases(&keys).await.map_err(redis_failure)?;
    let overdue_ms = overdue.as_millis() as i64;
    let mut out = Vec::new();
    for ((key, list), (state, live)) in by_key.iter().zip(&leases) {
        let deadlines = verify::Deadlines {
            now_ms: now.timestamp_millis(),
            end_by_ms: end_by(config, key, list, overdue_ms),
            retry_wait_ms: overdue_ms + retry_max_ms(config, key) * 6 / 5,
        };
        let now = verify::Now {
            state: state.as_deref(),
            live: *live,
        };
        out.extend(verify::check_fate(key, list, now, deadlines));
    }
    Ok(out)
}

/// By when `key`, whose entries are `list`, must have ended (ms): an instance a leader
/// published at its due time (its root's jittered time) plus its `expires`, else plus
/// `overdue`; a key only an operator or a producer published (a backfill, a trigger, ad hoc:
/// no leader's epoch, no `expires_at` from the schedule) `overdue` after its first entry.
fn end_by(config: &Config, key: &str, list: &[&JournalEntry], overdue_ms: i64) -> i64 {
    let first_ms = list.first().map_or(0, |e| e.at_ms);
    let led = list.iter().any(|e| e.epoch.is_some());
    let instance = key.split_once('@').and_then(|(name, _)| {
        let job = config.job(name)?;
        Some((job, audit::instant_of(name, key)?))
    });
    let (Some((job, instant)), true) = (instance, led) else {
        return first_ms + overdue_ms;
    };
    let due = (instant + root_offset(config, job)).timestamp_millis();
    match job.spec.expires {
        Some(expires) => due + expires.as_millis() as i64,
        None => due + overdue_ms,
    }
}

/// The jitter offset `job`'s instants are published with: its root's, up its `after` chain
/// (docs/design.md#job-dependencies).
fn root_offset(config: &Config, job: &Job) -> chrono::TimeDelta {
    let mut root = job;
    // The checked config has no cycles; the bound only keeps a bad one finite.
    for _ in 0..config.jobs.len() {
        match root.after.as_ref().and_then(|a| config.job(&a.upstream)) {
            Some(up) => root = up,
            None => break,
        }
    }
    root.jitter_offset()
}

/// The longest retry delay of `key`'s task (ms): its job's task's `retry_max`, or for an
/// ad-hoc key the largest of the config's.
fn retry_max_ms(config: &Config, key: &str) -> i64 {
    let task = key
        .split_once('@')
        .and_then(|(name, _)| config.job(name))
        .and_then(|job| config.tasks.get(&*job.spec.task));
    let max = match task {
        Some(task) => task.retry_max,
        None => config
            .tasks
            .values()
            .map(|t| t.retry_max)
            .max()
            .unwrap_or_default(),
    };
    max.as_millis() as i64
}

/// `not_published` (docs/audit.md#verify): per job with a schedule of its own, recorded
/// progress and not paused, the first instant after its progress (and the window's start) that
/// is due — its jitter, `misfire_threshold` and 10 s past — yet undecided: no beat leads.
async fn unpublished(
    config: &Config,
    store: &Store,
    progress: &[Option<DateTime<Utc>>],
    since: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Result<Vec<Violation>, Failure> {
    let paused = store.paused().await.map_err(redis_failure)?;
    let slack = chrono::Duration::from_std(config.beat.misfire_threshold).unwrap_or_default()
        + chrono::Duration::seconds(10);
    let mut out = Vec::new();
    for (job, progress) in config.jobs.iter().zip(progress) {
        let Some(progress) = progress else { continue };
        if job.after.is_some() || paused.contains(&job.name) {
            continue;
        }
        let Some(next) = job.schedule.next_after((*progress).max(since)) else {
            continue;
        };
        if next + job.jitter_offset() + slack < now {
            let instant = format_instant(next);
            out.extend(verify::check_published(&job.name, Some(&instant)));
        }
    }
    Ok(out)
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
