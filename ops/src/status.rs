//! `drumline-beat status`: per job, its schedule, next due instant, last published, last
//! success and failure, instances running now, and a stale warning — the answer to "did my job
//! silently stop running?" (docs/design.md–8) — plus the dead letters waiting in `{ns}.dead`.
//! Costs O(jobs), whatever the number of run records (docs/design.md): Redis through the [`Store`]
//! in one round trip per batch of jobs (plus one `SMEMBERS` of the paused set), the broker
//! through one passive queue declare. The beat's status page ([`crate::page`]) builds the same
//! document for a window of the jobs with [`read_window`].

use crate::dead_letters::{broker_counts_on, queues_of, BrokerCounts};
use crate::recent::RecentRun;
use chrono::{DateTime, Utc};
use drumline_shared::broker;
use drumline_shared::config::{Config, Job};
use drumline_shared::envelope::{format_instant, parse_instant};
use drumline_shared::names::Names;
use drumline_shared::schedule::Schedule;
pub use drumline_shared::store::Leader;
use drumline_shared::store::{JobHistory, Store, StoreError, WorkerInfo, HISTORY_TRIP};
use futures_util::StreamExt;
use serde::Serialize;
use std::collections::HashSet;
use std::future::Future;
use std::io::Write;
use std::ops::Range;
use std::time::Duration;

/// How long `status` waits for the broker before showing the dead letters as unknown.
const BROKER_WAIT: Duration = Duration::from_secs(3);

/// One job's line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JobStatus {
    /// Job name.
    pub job: String,
    /// The rule as written.
    pub schedule: String,
    /// IANA zone.
    pub timezone: String,
    /// RFC 3339 UTC, or null when the schedule has no further instant: the next instant not
    /// yet published, as its key names it.
    pub next_due: Option<String>,
    /// RFC 3339 UTC: when the leader publishes `next_due`, the job's `jitter` added (equal
    /// to `next_due` without one; docs/design.md#jitter).
    pub next_runs_at: Option<String>,
    /// RFC 3339 UTC of the beat's recorded progress (last published or decided).
    pub last_published: Option<String>,
    /// RFC 3339 UTC.
    pub last_success: Option<String>,
    /// RFC 3339 UTC of when the newest failed, dead or expired run finished (kept for the
    /// worker's `done_ttl`).
    pub last_failure: Option<String>,
    /// The error of the job's last run when that run failed (failed, dead or expired): a
    /// shell task's stderr tail, an HTTP response's body, a handler's error chain, at most
    /// 4 KiB (docs/design.md#failures-you-can-read).
    pub last_error: Option<String>,
    /// Instances of the job running now.
    pub running: u64,
    /// Paused (`drumline-beat pause`): the leader publishes none of its instants.
    pub paused: bool,
    /// No success within two periods (for cron, twice the gap between the two latest
    /// instants), for a job that has been published and has run records that old.
    pub stale: bool,
    /// Its newest runs (at most [`drumline_shared::store::RECENT_RUNS`]), newest first
    /// (docs/design.md#recent-runs).
    pub recent: Vec<RecentRun>,
    /// The job it follows (`after`); null for a job with a schedule of its own
    /// (docs/design.md#job-dependencies).
    pub after: Option<String>,
    /// The job's newest run record when that is a skip; null otherwise.
    pub last_skipped: Option<SkipStatus>,
}

/// A skipped instance, as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SkipStatus {
    /// Its idempotency key.
    pub key: String,
    /// `upstream` (an `after` job whose upstream did not succeed), `overlap` (the job's
    /// previous instance still ran), `paused`; null for a record written before reasons.
    pub reason: Option<String>,
    /// What happened, when known (`upstream nightly@… is dead`).
    pub detail: Option<String>,
}

/// One work queue's line: ready messages and consumers (null when the broker did not say).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QueueStatus {
    /// The logical queue.
    pub queue: String,
    /// Messages ready in its work queue (0 when the broker has no such queue yet).
    pub depth: Option<u32>,
    /// Consumers (workers) on it.
    pub consumers: Option<u32>,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Status {
    /// The current leader, if a beat holds the lease.
    pub leader: Option<Leader>,
    /// Messages in the dead-letter queue `{ns}.dead`; null when the broker could not be asked.
    pub dead_letters: Option<u64>,
    /// How many jobs the report is about: the config's (or the one job asked for). `jobs`
    /// lists all of them, except on the status page, which lists a window of them.
    pub total: usize,
    /// One entry per job listed, in config order.
    pub jobs: Vec<JobStatus>,
    /// The workers announced now (`{ns}:worker:{id}`), by id.
    pub workers: Vec<WorkerInfo>,
    /// Every queue the config names, with its depth and consumers.
    pub queues: Vec<QueueStatus>,
}

/// Stale: the job has been published for at least two periods and its last success (if any)
/// is older than two periods.
pub fn is_stale(
    schedule: &Schedule,
    now: DateTime<Utc>,
    last_published: Option<DateTime<Utc>>,
    last_success: Option<DateTime<Utc>>,
    first_seen: Option<DateTime<Utc>>,
) -> bool {
    let (Some(period), Some(_)) = (schedule.period(now), last_published) else {
        return false;
    };
    let window = period * 2;
    match last_success {
        Some(success) => now - success > window,
        // Never succeeded: stale once its oldest recorded run is older than the window. With
        // no run recorded at all there is nothing to date the job by: not flagged.
        None => first_seen.is_some_and(|seen| now - seen > window),
    }
}

/// Why a streamed report ([`stream`]) stopped.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// Redis did not answer, or answered nonsense.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The report could not be written (a closed pipe: the reader has what it wanted).
    #[error("cannot write the report: {0}")]
    Output(#[from] std::io::Error),
}

/// Jobs whose history is read per step of a streamed report, and steps kept in flight.
const STREAM_STEP: usize = HISTORY_TRIP;
const STEPS_IN_FLIGHT: usize = 4;

/// Writes the status of `jobs` (every job of `config`, or the one asked for) to `out` as it is
/// read, so the first rows come at once and a million jobs never sit in memory as one report:
/// the leader, paused set, workers and (meanwhile, from the broker) the dead-letter and queue
/// counts first, then each job's history [`STREAM_STEP`] jobs a round trip, several in flight.
/// The table's columns are as wide as the config says they can be; `--json` is the same
/// document as [`Status`], one job a line. Redis is required; the broker is not (an
/// unreachable broker leaves the counts unknown).
pub async fn stream(
    config: &Config,
    jobs: &[Job],
    (json, runs): (bool, bool),
    out: impl Write,
) -> Result<(), StreamError> {
    let names = Names::new(config.namespace.clone());
    let queues = queues_of(config);
    let redis = async {
        let store = Store::connect(
            &config.redis_url,
            config.redis_ca_file.as_deref(),
            names.clone(),
        )
        .await?;
        let (leader, paused, workers) =
            tokio::try_join!(store.leader(), store.paused(), store.workers())?;
        Ok::<_, StoreError>((store, leader, paused, workers))
    };
    let (redis, counts) = tokio::join!(redis, counts(config, &names, &queues));
    let (store, leader, paused, workers) = redis?;
    let format = if json {
        Format::Json
    } else {
        Format::Table {
            widths: widths_of(jobs),
            runs,
        }
    };
    let mut report = Report::begin(out, format, &leader, counts.dead_letters, jobs.len())?;
    let now = Utc::now();
    let mut steps = futures_util::stream::iter(jobs.chunks(STREAM_STEP))
        .map(|step| {
            let store = &store;
            async move {
                let names: Vec<&str> = step.iter().map(|j| j.name.as_str()).collect();
                store.job_histories(&names).await.map(|h| (step, h))
            }
        })
        .buffered(STEPS_IN_FLIGHT);
    while let Some(read) = steps.next().await {
        let (step, histories) = read?;
        for (job, history) in step.iter().zip(histories) {
            report.row(&job_status(job, history, paused.contains(&job.name), now))?;
        }
        report.flush()?;
    }
    report.end(&workers, &queue_statuses(&queues, &counts))?;
    Ok(())
}

/// The report on the jobs of `window` (positions in the config, cut to its length) through a
/// store already connected, with the dead-letter count `dead_letters` resolves to (read
/// meanwhile): the status page's, which keeps its own store and count. Redis work is
/// O(window), whatever the number of jobs.
pub async fn read_window(
    store: &Store,
    config: &Config,
    window: Range<usize>,
    counts: impl Future<Output = BrokerCounts>,
    now: DateTime<Utc>,
) -> Result<Status, StoreError> {
    let total = config.jobs.len();
    let window = window.start.min(total)..window.end.clamp(window.start.min(total), total);
    let jobs: Vec<&Job> = config.jobs[window].iter().collect();
    let queues = queues_of(config);
    let (redis, counts) = tokio::join!(read_redis(store, &jobs), counts);
    Ok(assemble(&jobs, total, now, redis?, (&queues, counts)))
}

/// What Redis holds for the report: the leader, the paused set, each job's history, the
/// workers.
type RedisPart = (
    Option<Leader>,
    HashSet<String>,
    Vec<JobHistory>,
    Vec<WorkerInfo>,
);

/// The Redis reads of a report, sent together: O(jobs) whatever the number of run records.
async fn read_redis(store: &Store, jobs: &[&Job]) -> Result<RedisPart, StoreError> {
    let job_names: Vec<&str> = jobs.iter().map(|j| j.name.as_str()).collect();
    // Sent together on the one multiplexed connection.
    tokio::try_join!(
        store.leader(),
        store.paused(),
        store.job_histories(&job_names),
        store.workers()
    )
}

/// The report on `jobs` of `total`, from what Redis and the broker said.
fn assemble(
    jobs: &[&Job],
    total: usize,
    now: DateTime<Utc>,
    (leader, paused, histories, workers): RedisPart,
    (queues, counts): (&[String], BrokerCounts),
) -> Status {
    let jobs = jobs
        .iter()
        .zip(histories)
        .map(|(job, history)| {
            let is_paused = paused.contains(&job.name);
            job_status(job, history, is_paused, now)
        })
        .collect();
    Status {
        leader,
        dead_letters: counts.dead_letters,
        total,
        jobs,
        workers,
        queues: queue_statuses(queues, &counts),
    }
}

/// Each of `queues` with what the broker said of it (unknown when it did not answer).
fn queue_statuses(queues: &[String], counts: &BrokerCounts) -> Vec<QueueStatus> {
    queues
        .iter()
        .enumerate()
        .map(|(i, queue)| {
            let known = counts.queues.get(i).copied();
            let zero = broker::QueueCounts {
                depth: 0,
                consumers: 0,
            };
            let at = known.map(|c| c.unwrap_or(zero));
            QueueStatus {
                queue: queue.clone(),
                depth: at.map(|c| c.depth),
                consumers: at.map(|c| c.consumers),
            }
        })
        .collect()
}

/// The dead letters and the counts of `queues`, each unknown (logged) when the broker cannot
/// say within [`BROKER_WAIT`].
async fn counts(config: &Config, names: &Names, queues: &[String]) -> BrokerCounts {
    let read = async {
        let conn = broker::connect(config).await?;
        let counts = broker_counts_on(&conn, names, queues).await;
        broker::close_later(conn, "status read");
        counts
    };
    match tokio::time::timeout(BROKER_WAIT, read).await {
        Ok(Ok(counts)) => counts,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "broker: dead letters and queues unknown");
            BrokerCounts::default()
        }
        Err(_) => {
            tracing::warn!(
                wait_ms = BROKER_WAIT.as_millis() as u64,
                "broker: no answer; dead letters and queues unknown"
            );
            BrokerCounts::default()
        }
    }
}

/// Whether `t` is one of `schedule`'s instants. A job's progress starts at the moment its
/// first leader started it, which is none for a cron job: `status` shows no LAST PUBLISHED
/// until an instant is.
fn is_instant(schedule: &Schedule, t: DateTime<Utc>) -> bool {
    schedule.next_after(t - chrono::TimeDelta::milliseconds(1)) == Some(t)
}

/// One job's line, from what Redis holds about it.
fn job_status(job: &Job, history: JobHistory, paused: bool, now: DateTime<Utc>) -> JobStatus {
    let first_seen = history.oldest.and_then(|r| parse_instant(&r.scheduled_for));
    let (last, success) = (history.last_published, history.last_success);
    // A jittered job's instant `t` is published at `t + offset`: one in `(now - offset, now]`
    // is still to come.
    let offset = job.jitter_offset();
    let from = last.map_or(now - offset, |l| l.max(now - offset));
    let next = job.schedule.next_after(from);
    JobStatus {
        job: job.name.clone(),
        schedule: job.schedule_text(),
        timezone: job.timezone.name().to_owned(),
        next_due: next.map(format_instant),
        next_runs_at: next.map(|t| format_instant(t + offset)),
        last_published: last
            .filter(|t| is_instant(&job.schedule, *t))
            .map(format_instant),
        last_success: success.map(format_instant),
        last_failure: history.last_failure.map(format_instant),
        last_error: history
            .newest
            .as_ref()
            .filter(|r| r.is_failure())
            .and_then(|r| r.error.clone()),
        running: history.running,
        paused,
        stale: is_stale(&job.schedule, now, last, success, first_seen),
        recent: history.recent.into_iter().map(RecentRun::from).collect(),
        after: job.after.as_ref().map(|a| a.upstream.clone()),
        last_skipped: history
            .newest
            .filter(|r| r.status == "skipped")
            .map(|r| SkipStatus {
                key: r.key,
                reason: r.reason,
                detail: r.error,
            }),
    }
}

/// Renders the report as an aligned table: the jobs, each failed last run's error, then with
/// `runs` each job's recent runs, then the workers and queues.
#[cfg(test)]
pub fn table_with(status: &Status, runs: bool) -> String {
    let mut widths: Vec<usize> = HEADERS.iter().map(|h| h.chars().count()).collect();
    for j in &status.jobs {
        for (w, cell) in widths.iter_mut().zip(job_cells(j)) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = Vec::new();
    let format = Format::Table { widths, runs };
    let written = Report::begin(
        &mut out,
        format,
        &status.leader,
        status.dead_letters,
        status.total,
    )
    .and_then(|mut report| {
        for j in &status.jobs {
            report.row(j)?;
        }
        report.end(&status.workers, &status.queues)
    });
    written.expect("writing to memory");
    String::from_utf8(out).expect("the report is text")
}

/// [`table_with`] without the recent runs.
#[cfg(test)]
pub fn table(status: &Status) -> String {
    table_with(status, false)
}

/// The jobs table's columns.
const HEADERS: [&str; 9] = [
    "JOB",
    "SCHEDULE",
    "NEXT DUE",
    "LAST PUBLISHED",
    "LAST SUCCESS",
    "LAST FAILURE",
    "RUNNING",
    "PAUSED",
    "STALE",
];

/// The widest an instant is shown (`2026-03-08T07:00:00.123Z`).
const INSTANT_WIDTH: usize = 24;

/// The jobs table's column widths for `jobs`, known before any is read: names and schedules
/// from the config, instants at their widest (a jittered job's NEXT DUE with its offset).
fn widths_of(jobs: &[Job]) -> Vec<usize> {
    let mut widths: Vec<usize> = HEADERS.iter().map(|h| h.chars().count()).collect();
    for job in jobs {
        let schedule = job.schedule_text().chars().count()
            + if job.timezone.name() == "UTC" {
                0
            } else {
                1 + job.timezone.name().len()
            };
        let next = INSTANT_WIDTH
            + job.jitter.as_ref().map_or(0, |j| {
                let offset = chrono::TimeDelta::from_std(j.offset).unwrap_or_default();
                1 + offset_text(offset).len()
            });
        widths[0] = widths[0].max(job.name.chars().count());
        widths[1] = widths[1].max(schedule);
        widths[2] = widths[2].max(next);
    }
    for w in &mut widths[3..6] {
        *w = (*w).max(INSTANT_WIDTH);
    }
    widths
}

/// One job's cells in the jobs table.
fn job_cells(j: &JobStatus) -> [String; 9] {
    let dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    let schedule = if j.timezone == "UTC" {
        j.schedule.clone()
    } else {
        format!("{} {}", j.schedule, j.timezone)
    };
    [
        j.job.clone(),
        schedule,
        next_cell(j),
        dash(&j.last_published),
        dash(&j.last_success),
        dash(&j.last_failure),
        j.running.to_string(),
        if j.paused {
            "PAUSED".into()
        } else {
            "-".into()
        },
        if j.stale { "STALE".into() } else { "-".into() },
    ]
}

/// The lines under the jobs table for one job: its last run's error, its last skip.
fn job_notes(j: &JobStatus) -> String {
    let mut out = String::new();
    if let Some(error) = &j.last_error {
        out.push_str(&format!(
            "{} last error: {}\n",
            j.job,
            drumline_shared::table::one_line(error, 300)
        ));
    }
    if let Some(skip) = &j.last_skipped {
        let why = match (&skip.reason, &skip.detail) {
            (Some(reason), Some(detail)) => format!("{reason} ({detail})"),
            (Some(reason), None) => reason.clone(),
            (None, detail) => detail.clone().unwrap_or_else(|| "-".into()),
        };
        out.push_str(&format!("{} last skipped: {}: {}\n", j.job, skip.key, why));
    }
    out
}

/// How a report is written.
enum Format {
    /// `--json`: the [`Status`] document, one job a line.
    Json,
    /// The text table, columns `widths` wide; with `runs`, each job's recent runs after it.
    Table { widths: Vec<usize>, runs: bool },
}

/// A report being written, row by row ([`stream`], [`table_with`]). The table's notes (errors,
/// skips) and recent runs, which follow the table, are kept until [`end`](Self::end).
struct Report<W: Write> {
    out: W,
    format: Format,
    rows: usize,
    /// Text that follows the jobs table.
    after: String,
}

impl<W: Write> Report<W> {
    fn begin(
        mut out: W,
        format: Format,
        leader: &Option<Leader>,
        dead_letters: Option<u64>,
        total: usize,
    ) -> std::io::Result<Self> {
        match &format {
            Format::Json => {
                out.write_all(b"{\"leader\":")?;
                serde_json::to_writer(&mut out, leader)?;
                out.write_all(b",\"dead_letters\":")?;
                serde_json::to_writer(&mut out, &dead_letters)?;
                write!(out, ",\"total\":{total},\"jobs\":[")?;
            }
            Format::Table { widths, .. } => {
                match leader {
                    Some(l) => writeln!(
                        out,
                        "leader: {} pid {} epoch {} since {}",
                        l.host, l.pid, l.epoch, l.since
                    )?,
                    None => writeln!(out, "leader: none (no beat holds the leader lease)")?,
                }
                match dead_letters {
                    Some(n) => writeln!(out, "dead letters: {n}")?,
                    None => writeln!(out, "dead letters: - (broker unreachable)")?,
                }
                writeln!(out, "{}", drumline_shared::table::line(&HEADERS, widths))?;
            }
        }
        Ok(Report {
            out,
            format,
            rows: 0,
            after: String::new(),
        })
    }

    fn row(&mut self, j: &JobStatus) -> std::io::Result<()> {
        match &self.format {
            Format::Json => {
                self.out
                    .write_all(if self.rows == 0 { b"\n" } else { b",\n" })?;
                serde_json::to_writer(&mut self.out, j)?;
            }
            Format::Table { widths, runs } => {
                let cells = job_cells(j);
                let cells: Vec<&str> = cells.iter().map(String::as_str).collect();
                writeln!(self.out, "{}", drumline_shared::table::line(&cells, widths))?;
                self.after.push_str(&job_notes(j));
                if *runs {
                    self.after
                        .push_str(&crate::recent::table(&j.job, &j.recent));
                }
            }
        }
        self.rows += 1;
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }

    fn end(mut self, workers: &[WorkerInfo], queues: &[QueueStatus]) -> std::io::Result<()> {
        match &self.format {
            Format::Json => {
                self.out.write_all(b"\n],\"workers\":")?;
                serde_json::to_writer(&mut self.out, workers)?;
                self.out.write_all(b",\"queues\":")?;
                serde_json::to_writer(&mut self.out, queues)?;
                self.out.write_all(b"}\n")?;
            }
            Format::Table { .. } => {
                self.out.write_all(self.after.as_bytes())?;
                self.out
                    .write_all(workers_table(workers, queues).as_bytes())?;
            }
        }
        self.out.flush()
    }
}

/// The workers and queues sections of the text report.
fn workers_table(workers: &[WorkerInfo], queues: &[QueueStatus]) -> String {
    let mut out = format!("\nworkers: {}\n", workers.len());
    if !workers.is_empty() {
        let rows: Vec<Vec<String>> = workers
            .iter()
            .map(|w| {
                vec![
                    w.id.clone(),
                    w.host.clone(),
                    w.pid.to_string(),
                    w.version.clone(),
                    w.queues.join(","),
                    format!("{}/{}", w.running, w.concurrency),
                    w.started.clone(),
                ]
            })
            .collect();
        let headers = [
            "WORKER", "HOST", "PID", "VERSION", "QUEUES", "RUNNING", "STARTED",
        ];
        out.push_str(&drumline_shared::table::render(&headers, &rows));
    }
    out.push_str("\nqueues:\n");
    let number = |n: Option<u32>| n.map_or_else(|| "-".to_owned(), |n| n.to_string());
    let rows: Vec<Vec<String>> = queues
        .iter()
        .map(|q| vec![q.queue.clone(), number(q.depth), number(q.consumers)])
        .collect();
    out.push_str(&drumline_shared::table::render(
        &["QUEUE", "DEPTH", "CONSUMERS"],
        &rows,
    ));
    out
}

/// The NEXT DUE cell: the instant, and for a jittered job the offset it is published after
/// (`2026-03-08T07:00:00Z+37s`).
fn next_cell(j: &JobStatus) -> String {
    let (Some(due), Some(runs)) = (&j.next_due, &j.next_runs_at) else {
        return j.next_due.clone().unwrap_or_else(|| "-".into());
    };
    match (parse_instant(due), parse_instant(runs)) {
        (Some(d), Some(r)) if r > d => format!("{due}+{}", offset_text(r - d)),
        _ => due.clone(),
    }
}

/// A jitter offset in one word: whole seconds (`4m12s`), or milliseconds under a second.
pub(crate) fn offset_text(offset: chrono::TimeDelta) -> String {
    let ms = offset.num_milliseconds().max(0) as u64;
    let shown = if ms < 1000 {
        std::time::Duration::from_millis(ms)
    } else {
        std::time::Duration::from_secs(ms / 1000)
    };
    drumline_shared::duration::format(shown).replace(' ', "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use drumline_shared::schedule::{CronExpr, DstFold, DstGap};

    fn at(h: u32, m: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 3, 8, h, m, 0).unwrap()
    }

    fn cron(expr: &str) -> Schedule {
        Schedule::Cron {
            cron: CronExpr::parse(expr).unwrap().into(),
            tz: chrono_tz::UTC,
            gap: DstGap::Shift,
            fold: DstFold::First,
        }
    }

    #[test]
    fn progress_that_is_no_instant_is_not_shown_as_published() {
        let hourly = cron("0 * * * *");
        assert!(is_instant(&hourly, at(3, 0)));
        // The first leader started the job at 03:17: nothing was published yet.
        assert!(!is_instant(&hourly, at(3, 17)));
    }

    #[test]
    fn the_table_marks_paused_and_stale_jobs() {
        let line = |job: &str, paused: bool, stale: bool| JobStatus {
            job: job.into(),
            schedule: "every 1s".into(),
            timezone: "UTC".into(),
            next_due: None,
            next_runs_at: None,
            last_published: None,
            last_success: None,
            last_failure: None,
            last_error: None,
            running: 0,
            paused,
            stale,
            recent: vec![],
            after: None,
            last_skipped: None,
        };
        let status = Status {
            leader: None,
            dead_letters: Some(0),
            total: 3,
            jobs: vec![
                line("a", false, false),
                line("b", true, false),
                line("c", false, true),
            ],
            workers: vec![],
            queues: vec![],
        };
        let text = table(&status);
        let row = |job: &str| -> Vec<String> {
            let line = text.lines().find(|l| l.starts_with(job)).unwrap();
            line.split_whitespace().map(str::to_owned).collect()
        };
        let header: Vec<&str> = text.lines().nth(2).unwrap().split_whitespace().collect();
        assert_eq!(header[header.len() - 3..], ["RUNNING", "PAUSED", "STALE"]);
        assert_eq!(row("a")[row("a").len() - 2..], ["-", "-"]);
        assert_eq!(row("b")[row("b").len() - 2..], ["PAUSED", "-"]);
        assert_eq!(row("c")[row("c").len() - 2..], ["-", "STALE"]);
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["jobs"][1]["paused"], true);
        assert_eq!(json["jobs"][0]["paused"], false);
        // No failed last run: no error line.
        assert!(!text.contains("last error"), "{text}");
    }

    #[test]
    fn a_failed_last_run_shows_its_error_under_the_table() {
        let mut status = Status {
            leader: None,
            dead_letters: Some(1),
            total: 1,
            jobs: vec![JobStatus {
                job: "nightly".into(),
                schedule: "every 1s".into(),
                timezone: "UTC".into(),
                next_due: None,
                next_runs_at: None,
                last_published: None,
                last_success: None,
                last_failure: Some("2026-03-08T07:00:00Z".into()),
                last_error: Some("exit code 1: stderr: disk full\nretry later".into()),
                running: 0,
                paused: false,
                stale: false,
                recent: vec![],
                after: None,
                last_skipped: None,
            }],
            workers: vec![],
            queues: vec![],
        };
        let text = table(&status);
        let last = text.lines().find(|l| l.contains("last error")).unwrap();
        assert_eq!(
            last,
            "nightly last error: exit code 1: stderr: disk full ⏎ retry later"
        );
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(
            json["jobs"][0]["last_error"],
            "exit code 1: stderr: disk full\nretry later"
        );
        status.jobs[0].last_error = None;
        assert!(!table(&status).contains("last error"));
    }

    #[test]
    fn recent_runs_are_listed_only_when_asked() {
        let record = drumline_shared::store::RunRecord {
            key: "nightly@2026-03-08T07:00:00Z".into(),
            scheduled_for: "2026-03-08T07:00:00Z".into(),
            status: "failed".into(),
            attempt: 0,
            worker: "w".into(),
            started_at: Some("2026-03-08T07:00:00Z".into()),
            finished_at: "2026-03-08T07:00:00.250Z".into(),
            error: Some("exit code 1".into()),
            reason: None,
        };
        let mut status = Status {
            leader: None,
            dead_letters: Some(0),
            total: 1,
            jobs: vec![],
            workers: vec![],
            queues: vec![],
        };
        let mut job = JobStatus {
            job: "nightly".into(),
            schedule: "every 1s".into(),
            timezone: "UTC".into(),
            next_due: None,
            next_runs_at: None,
            last_published: None,
            last_success: None,
            last_failure: None,
            last_error: None,
            running: 0,
            paused: false,
            stale: false,
            recent: vec![],
            after: None,
            last_skipped: None,
        };
        job.recent.push(record.into());
        status.jobs.push(job);
        assert!(!table(&status).contains("recent runs"));
        let text = table_with(&status, true);
        let at = text.find("recent runs of nightly:\n").unwrap();
        assert!(at < text.find("workers:").unwrap(), "{text}");
        let line = text[at..].lines().nth(2).unwrap();
        assert!(
            line.starts_with("nightly@2026-03-08T07:00:00Z  failed   0"),
            "{line}"
        );
        assert!(line.ends_with("250 ms    exit code 1"), "{line}");
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["jobs"][0]["recent"][0]["duration_ms"], 250);
        assert_eq!(json["jobs"][0]["recent"][0]["error"], "exit code 1");
    }

    #[test]
    fn a_follower_shows_its_upstream_and_why_it_was_skipped() {
        let status = Status {
            leader: None,
            dead_letters: Some(0),
            total: 1,
            jobs: vec![JobStatus {
                job: "report".into(),
                schedule: "after load".into(),
                timezone: "UTC".into(),
                next_due: None,
                next_runs_at: None,
                last_published: None,
                last_success: None,
                last_failure: None,
                last_error: None,
                running: 0,
                paused: false,
                stale: false,
                after: Some("load".into()),
                last_skipped: Some(SkipStatus {
                    key: "report@2026-03-08T07:00:00Z".into(),
                    reason: Some("upstream".into()),
                    detail: Some("upstream load@2026-03-08T07:00:00Z is dead".into()),
                }),
                recent: vec![],
            }],
            workers: vec![],
            queues: vec![],
        };
        let text = table(&status);
        assert!(text.contains("report  after load"), "{text}");
        assert!(text.contains("report last skipped: report@2026-03-08T07:00:00Z: upstream (upstream load@2026-03-08T07:00:00Z is dead)"), "{text}");
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["jobs"][0]["after"], "load");
        assert_eq!(json["jobs"][0]["last_skipped"]["reason"], "upstream");
    }

    /// A jittered job's next instant is the one not yet published, even when its time has
    /// passed but its offset has not; `next_runs_at` and the table add the offset.
    #[test]
    fn a_jittered_jobs_next_instant_counts_its_offset() {
        let job = crate::fixtures::job("every = \"1m\"\njitter = \"50s\"");
        let offset = job.jitter_offset();
        assert!(offset > chrono::TimeDelta::seconds(2), "{offset}");
        let twelve = Utc.with_ymd_and_hms(2026, 3, 8, 12, 0, 0).unwrap();
        let one = twelve + chrono::TimeDelta::minutes(1);
        let history = JobHistory {
            last_published: Some(twelve),
            last_success: None,
            last_failure: None,
            running: 0,
            oldest: None,
            newest: None,
            recent: vec![],
        };
        // 12:01 has passed, 12:01 + offset has not: 12:01 is next.
        let line = job_status(&job, history, false, one + offset / 2);
        assert_eq!(line.next_due.as_deref(), Some("2026-03-08T12:01:00Z"));
        assert_eq!(line.next_runs_at, Some(format_instant(one + offset)));
        let status = Status {
            leader: None,
            dead_letters: Some(0),
            total: 1,
            jobs: vec![line],
            workers: vec![],
            queues: vec![],
        };
        let shown = offset_text(offset);
        assert!(!shown.contains(' ') && shown.ends_with('s'), "{shown}");
        let text = table(&status);
        assert!(
            text.contains(&format!("2026-03-08T12:01:00Z+{shown} ")),
            "{text}"
        );
    }

    #[test]
    fn stale_after_two_periods_without_success() {
        let s = cron("*/15 * * * *");
        let now = at(7, 7);
        assert!(!is_stale(&s, now, Some(at(7, 0)), Some(at(6, 45)), None));
        assert!(is_stale(&s, now, Some(at(7, 0)), Some(at(6, 30)), None));
        // Never published: a new job is not stale.
        assert!(!is_stale(&s, now, None, None, None));
        // Published for long, never succeeded.
        assert!(is_stale(&s, now, Some(at(7, 0)), None, Some(at(5, 0))));
        assert!(!is_stale(&s, now, Some(at(7, 0)), None, Some(at(6, 50))));
    }
}
