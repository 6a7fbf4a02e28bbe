//! `drumline-beat status`: per job, its schedule, next due instant, last published, last
//! success and failure, instances running now, and a stale warning — the answer to "did my job
//! silently stop running?" (DESIGN §7–8). Reads Redis only.

use chrono::{DateTime, Utc};
use drumline_shared::config::{Config, Job};
use drumline_shared::envelope::format_instant;
use drumline_shared::names::Names;
use drumline_shared::schedule::Schedule;
use drumline_shared::store::{RunRecord, Store, StoreError};
use redis::AsyncCommands;
use serde::Serialize;
use std::collections::HashMap;

/// How many history entries are searched for the last failure.
const FAILURE_LOOKBACK: isize = 100;

/// The leader lease, as the beat writes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Leader {
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// Leadership epoch.
    pub epoch: u64,
    /// RFC 3339 UTC.
    pub since: String,
}

/// One job's line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JobStatus {
    /// Job name.
    pub job: String,
    /// The rule as written.
    pub schedule: String,
    /// IANA zone.
    pub timezone: String,
    /// RFC 3339 UTC, or null when the schedule has no further instant.
    pub next_due: Option<String>,
    /// RFC 3339 UTC of the beat's recorded progress (last published or decided).
    pub last_published: Option<String>,
    /// RFC 3339 UTC.
    pub last_success: Option<String>,
    /// RFC 3339 UTC of the newest failed, dead or expired run in the history.
    pub last_failure: Option<String>,
    /// Instances of the job running now.
    pub running: u64,
    /// No success within two periods (for cron, twice the gap between the two latest
    /// instants), for a job that has been published and has run records that old.
    pub stale: bool,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Status {
    /// The current leader, if a beat holds the lease.
    pub leader: Option<Leader>,
    /// One entry per job, in config order.
    pub jobs: Vec<JobStatus>,
}

/// The job's period at `now`: `every`, or for cron the gap between the two latest instants.
pub fn period(schedule: &Schedule, now: DateTime<Utc>) -> Option<chrono::Duration> {
    if let Schedule::Every { every, .. } = schedule {
        return Some(*every);
    }
    // No "previous instant" API: walk forward from ever earlier points until two instants at or
    // before `now` are found (a per-second cron needs a short window, a yearly one a long one).
    for back in [120i64, 7_200, 172_800, 5_529_600, 63_072_000, 283_824_000] {
        let mut cursor = now - chrono::Duration::seconds(back);
        let (mut older, mut newer) = (None, None);
        while let Some(t) = schedule.next_after(cursor) {
            if t > now {
                break;
            }
            older = newer;
            newer = Some(t);
            cursor = t;
        }
        if let (Some(a), Some(b)) = (older, newer) {
            return Some(b - a);
        }
    }
    None
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
    let (Some(period), Some(_)) = (period(schedule, now), last_published) else {
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

fn parse(text: Option<String>) -> Option<DateTime<Utc>> {
    text.and_then(|t| DateTime::parse_from_rfc3339(&t).ok())
        .map(|t| t.with_timezone(&Utc))
}

/// Reads the status of every job (or only `only`) from Redis.
pub async fn read(
    config: &Config,
    only: Option<&Job>,
    now: DateTime<Utc>,
) -> Result<Status, StoreError> {
    let names = Names::new(config.namespace.clone());
    let store = Store::connect(
        &config.redis_url,
        config.redis_ca_file.as_deref(),
        names.clone(),
    )
    .await?;
    let mut conn = store.connection();
    let leader: Option<String> = conn.get(names.beat_leader()).await?;
    let leader = leader.and_then(|l| serde_json::from_str::<Leader>(&l).ok());
    let running = running_counts(&mut conn, &names).await?;

    let jobs: Vec<&Job> = match only {
        Some(job) => vec![job],
        None => config.jobs.iter().collect(),
    };
    let mut out = Vec::with_capacity(jobs.len());
    for chunk in jobs.chunks(500) {
        let mut pipe = redis::pipe();
        for job in chunk {
            pipe.get(names.beat_last(&job.name))
                .get(names.last_success(&job.name))
                .lrange(names.history(&job.name), 0, FAILURE_LOOKBACK - 1)
                .lindex(names.history(&job.name), -1);
        }
        type Row = (Option<String>, Option<String>, Vec<String>, Option<String>);
        let rows: Vec<Row> = pipe.query_async(&mut conn).await?;
        for (job, (last, success, history, oldest)) in chunk.iter().zip(rows) {
            let records: Vec<RunRecord> = history
                .iter()
                .filter_map(|h| serde_json::from_str(h).ok())
                .collect();
            let last_failure = records
                .iter()
                .find(|r| matches!(r.status.as_str(), "failed" | "dead" | "expired"))
                .map(|r| r.finished_at.clone());
            let first_seen = oldest
                .and_then(|o| serde_json::from_str::<RunRecord>(&o).ok())
                .and_then(|r| parse(Some(r.scheduled_for)));
            let last_dt = parse(last.clone());
            let success_dt = parse(success.clone());
            let from = last_dt.map_or(now, |l| l.max(now));
            out.push(JobStatus {
                job: job.name.clone(),
                schedule: job.schedule_text.clone(),
                timezone: job.timezone.name().to_owned(),
                next_due: job.schedule.next_after(from).map(format_instant),
                last_published: last_dt.map(format_instant),
                last_success: success_dt.map(format_instant),
                last_failure,
                running: running.get(job.name.as_str()).copied().unwrap_or(0),
                stale: is_stale(&job.schedule, now, last_dt, success_dt, first_seen),
            });
        }
    }
    Ok(Status { leader, jobs: out })
}

/// Counts `running` run states per job with one SCAN over `{ns}:run:*`.
async fn running_counts(
    conn: &mut redis::aio::ConnectionManager,
    names: &Names,
) -> Result<HashMap<String, u64>, StoreError> {
    let prefix = names.run_key("");
    let mut keys = Vec::new();
    {
        let mut iter: redis::AsyncIter<String> = conn.scan_match(format!("{prefix}*")).await?;
        while let Some(key) = iter.next_item().await {
            keys.push(key?);
        }
    }
    let mut counts = HashMap::new();
    for chunk in keys.chunks(1000) {
        let mut pipe = redis::pipe();
        for key in chunk {
            pipe.hget(key, "state");
        }
        let states: Vec<Option<String>> = pipe.query_async(conn).await?;
        for (key, state) in chunk.iter().zip(states) {
            if state.as_deref() != Some("running") {
                continue;
            }
            // {ns}:run:{job}@{instant}; ad-hoc keys have no job.
            if let Some((job, _)) = key[prefix.len()..].rsplit_once('@') {
                *counts.entry(job.to_owned()).or_insert(0) += 1;
            }
        }
    }
    Ok(counts)
}

/// Renders the report as an aligned table.
pub fn table(status: &Status) -> String {
    let mut out = match &status.leader {
        Some(l) => format!(
            "leader: {} pid {} epoch {} since {}\n",
            l.host, l.pid, l.epoch, l.since
        ),
        None => "leader: none (no beat holds the leader lease)\n".to_owned(),
    };
    let dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    let rows: Vec<Vec<String>> = status
        .jobs
        .iter()
        .map(|j| {
            let schedule = if j.timezone == "UTC" {
                j.schedule.clone()
            } else {
                format!("{} {}", j.schedule, j.timezone)
            };
            vec![
                j.job.clone(),
                schedule,
                dash(&j.next_due),
                dash(&j.last_published),
                dash(&j.last_success),
                dash(&j.last_failure),
                j.running.to_string(),
                if j.stale { "STALE".into() } else { "-".into() },
            ]
        })
        .collect();
    let headers = [
        "JOB",
        "SCHEDULE",
        "NEXT DUE",
        "LAST PUBLISHED",
        "LAST SUCCESS",
        "LAST FAILURE",
        "RUNNING",
        "STALE",
    ];
    out.push_str(&drumline_shared::table::render(&headers, &rows));
    out
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
            cron: CronExpr::parse(expr).unwrap(),
            tz: chrono_tz::UTC,
            gap: DstGap::Shift,
            fold: DstFold::First,
        }
    }

    #[test]
    fn period_of_every_and_of_cron() {
        let every = Schedule::Every {
            every: chrono::Duration::seconds(30),
            anchor: DateTime::UNIX_EPOCH,
        };
        assert_eq!(
            period(&every, at(7, 0)),
            Some(chrono::Duration::seconds(30))
        );
        assert_eq!(
            period(&cron("*/15 * * * *"), at(7, 7)),
            Some(chrono::Duration::minutes(15))
        );
        assert_eq!(
            period(&cron("0 3 * * *"), at(7, 7)),
            Some(chrono::Duration::days(1))
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
