//! The beat's counters (Prometheus metrics under `--metrics-addr`, and the health check) and
//! the report of every instance it decided not to publish. Touches only logs and counters.
//!
//! The health check ([`health`], docs/operations.md#metrics-and-health) answers from what the beat last
//! heard: Redis's last answer to a lease try ([`RedisContact`]) and, on the leader, the stalled
//! jobs.
//!
//! Published and dropped instances are counted per job (`drumline_beat_published_total{job}`,
//! `drumline_beat_dropped_total{job, reason}`): the label sets are bounded by the config's jobs
//! and the [`DropReason`]s.

use crate::misfire::{Dropped, Plan};
use chrono::{DateTime, Utc};
use drumline_shared::config::{Job, Misfire};
use drumline_shared::envelope::instance_key;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::{Arc, Mutex};
use tracing::warn;

/// Why an instance was not published: the `reason` label of `drumline_beat_dropped_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Missed by more than `misfire_grace`.
    PastGrace,
    /// Missed; `misfire = "run_once"` publishes only the latest.
    MisfireRunOnce,
    /// Missed; beyond `max_catch_up` (`misfire = "catch_up"`).
    MisfireCatchUp,
    /// Missed; `misfire = "skip"`.
    MisfireSkip,
    /// `expires` had passed when it came due.
    Expired,
    /// The job was paused when it came due (`drumline-beat pause`).
    Paused,
    /// A calendar of the job's `exclude` holds its date (docs/design.md#calendars).
    Calendar,
}

impl DropReason {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::PastGrace => "past_grace",
            DropReason::MisfireRunOnce => "misfire_run_once",
            DropReason::MisfireCatchUp => "misfire_catch_up",
            DropReason::MisfireSkip => "misfire_skip",
            DropReason::Expired => "expired",
            DropReason::Paused => "paused",
            DropReason::Calendar => "calendar",
        }
    }

    /// The reason for a misfire policy's drops.
    fn policy(misfire: Misfire) -> Self {
        match misfire {
            Misfire::RunOnce => DropReason::MisfireRunOnce,
            Misfire::CatchUp => DropReason::MisfireCatchUp,
            Misfire::Skip => DropReason::MisfireSkip,
        }
    }
}

impl From<Dropped> for DropReason {
    fn from(why: Dropped) -> Self {
        match why {
            Dropped::PastGrace => DropReason::PastGrace,
            Dropped::Policy(misfire) => DropReason::policy(misfire),
            Dropped::Expired => DropReason::Expired,
            Dropped::Paused => DropReason::Paused,
            Dropped::Calendar => DropReason::Calendar,
        }
    }
}

/// What Redis did the last time the beat tried it (the connection at start, then each lease try,
/// standby or leader): a beat that cannot reach Redis cannot take over, nor go on leading.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum RedisContact {
    /// Not reached since start.
    #[default]
    NotYet,
    /// The last try was answered.
    Answered,
    /// The last try failed: the error (URL redacted).
    Failed(String),
    /// The last try had no answer in time.
    NoAnswer,
}

impl std::fmt::Display for RedisContact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RedisContact::NotYet => f.write_str("not reached yet"),
            RedisContact::Answered => f.write_str("answered"),
            RedisContact::Failed(error) => f.write_str(error),
            RedisContact::NoAnswer => f.write_str("no answer in time"),
        }
    }
}

/// `/healthz` from what the beat knows: `redis`, whether it leads and how many jobs are stalled.
/// 200 `ok` on a leader whose jobs move, 200 `standby` on a standby that reaches Redis (it could
/// take over now); otherwise the reason for the 503.
pub fn health(redis: &RedisContact, leading: bool, stalled: i64) -> Result<&'static str, String> {
    if *redis != RedisContact::Answered {
        return Err(format!("redis unreachable: {redis}"));
    }
    match (leading, stalled) {
        (false, _) => Ok("standby"),
        (true, 0) => Ok("ok"),
        (true, n) => Err(format!(
            "{n} jobs stalled: the broker or Redis is unreachable"
        )),
    }
}

/// Labels of `drumline_beat_published_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct JobLabels {
    /// A job of the config.
    pub job: String,
}

/// Labels of `drumline_beat_dropped_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct DropLabels {
    /// A job of the config.
    pub job: String,
    /// A [`DropReason`] label value.
    pub reason: &'static str,
}

/// Counters the beat keeps; Prometheus metrics under `--metrics-addr`. Clones share them.
#[derive(Debug, Default, Clone)]
pub struct BeatStats {
    /// Instances published and confirmed, in all (for the shutdown summary; `/metrics` has the
    /// per-job series, whose sum it is).
    published_all: Counter,
    /// Instances decided not to publish, in all (each logged with its key, or in a counted
    /// range); `/metrics` has them per job and reason.
    dropped_all: Counter,
    /// Instances published and confirmed, per job.
    published_per_job: Family<JobLabels, Counter>,
    /// Instances not published, per job and reason.
    dropped_per_job: Family<DropLabels, Counter>,
    /// Publish attempts that failed, per job (retried).
    pub publish_failures: Counter,
    /// Progress writes to Redis that failed, per job (the job waits until one succeeds).
    pub persist_failures: Counter,
    /// Jobs whose last attempt stalled (broker or Redis unreachable, or the broker refused
    /// the job's message); 0 when all move.
    pub stalled_jobs: Gauge,
    /// 1 while this beat holds the leader lease, else 0.
    pub is_leader: Gauge,
    /// The epoch of the lease as this beat last saw it: its own while it leads, the holder's
    /// on a standby (0 when no beat holds it).
    pub leader_epoch: Gauge,
    /// Redis's last answer, or its silence ([`BeatStats::redis`]).
    redis: Arc<Mutex<RedisContact>>,
}

impl BeatStats {
    /// Registers every metric under `drumline_beat_*`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "drumline_beat_published",
            "Instances published and confirmed by the broker, per job",
            self.published_per_job.clone(),
        );
        registry.register(
            "drumline_beat_dropped",
            "Instances not published, per job and reason (misfire policy, grace, expiry, paused)",
            self.dropped_per_job.clone(),
        );
        let counters: [(&str, &str, &Counter); 2] = [
            (
                "publish_failures",
                "Job publish attempts that failed (retried)",
                &self.publish_failures,
            ),
            (
                "persist_failures",
                "Job progress writes to Redis that failed (retried)",
                &self.persist_failures,
            ),
        ];
        for (name, help, counter) in counters {
            registry.register(format!("drumline_beat_{name}"), help, counter.clone());
        }
        registry.register(
            "drumline_beat_stalled_jobs",
            "Jobs whose last attempt stalled on the broker or Redis",
            self.stalled_jobs.clone(),
        );
        registry.register(
            "drumline_beat_is_leader",
            "1 while this beat holds the leader lease and publishes, else 0",
            self.is_leader.clone(),
        );
        registry.register(
            "drumline_beat_leader_epoch",
            "Epoch of the leader lease as this beat last saw it (0: no leader)",
            self.leader_epoch.clone(),
        );
    }

    /// Counts one instance of `job` published and confirmed.
    pub fn published(&self, job: &str) {
        self.published_all.inc();
        self.published_per_job
            .get_or_create(&JobLabels {
                job: job.to_owned(),
            })
            .inc();
    }

    /// Counts `n` instances of `job` not published for `reason`.
    pub fn dropped(&self, job: &str, reason: DropReason, n: u64) {
        if n == 0 {
            return;
        }
        self.dropped_all.inc_by(n);
        let labels = DropLabels {
            job: job.to_owned(),
            reason: reason.as_str(),
        };
        self.dropped_per_job.get_or_create(&labels).inc_by(n);
    }

    /// Instances published and confirmed since start, all jobs.
    pub fn published_total(&self) -> u64 {
        self.published_all.get()
    }

    /// Instances not published since start, all jobs and reasons.
    pub fn dropped_total(&self) -> u64 {
        self.dropped_all.get()
    }

    /// Records what the last lease try found.
    pub fn set_leader(&self, leading: bool, epoch: u64) {
        self.is_leader.set(i64::from(leading));
        self.leader_epoch.set(epoch as i64);
    }

    /// Records what Redis did at the beat's last try.
    pub fn redis(&self, contact: RedisContact) {
        // A poisoned lock still holds a whole value: every write replaces it.
        *self.redis.lock().unwrap_or_else(|e| e.into_inner()) = contact;
    }

    /// `/healthz`: `stats::health` of what the beat knows now.
    pub fn health(&self) -> Result<&'static str, String> {
        let redis = self.redis.lock().unwrap_or_else(|e| e.into_inner()).clone();
        health(&redis, self.is_leader.get() != 0, self.stalled_jobs.get())
    }
}

/// Logs every dropped instance with its key (beyond [`MAX_LISTED`](crate::misfire::MAX_LISTED):
/// one line with the count and the first and last key) and counts them.
pub fn report_dropped(job: &Job, plan: &Plan, stats: &BeatStats) {
    for (t, why) in &plan.dropped {
        warn!(job = %job.name, key = %instance_key(&job.name, *t), reason = why.reason(), "instance not published");
        stats.dropped(&job.name, DropReason::from(*why), 1);
    }
    let more = &plan.unlisted;
    if more.count > 0 {
        let key =
            |t: Option<DateTime<Utc>>| t.map(|t| instance_key(&job.name, t)).unwrap_or_default();
        warn!(
            job = %job.name,
            count = more.count,
            at_least = more.lower_bound,
            first_key = %key(more.first),
            last_key = %key(more.last),
            "more instances not published (missed; too many to list one by one)"
        );
    }
    for &(why, n) in &more.reasons {
        stats.dropped(&job.name, DropReason::from(why), n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    fn exposition(stats: &BeatStats) -> String {
        let mut registry = Registry::default();
        stats.register(&mut registry);
        let mut out = String::new();
        encode(&mut out, &registry).unwrap();
        out
    }

    // See: issues/33
    #[test]
    fn health_is_503_naming_redis_whenever_it_failed_the_last_try_leader_or_standby() {
        let failed = RedisContact::Failed("WRONGPASS".into());
        for leading in [false, true] {
            for (redis, reason) in [
                (&RedisContact::NotYet, "redis unreachable: not reached yet"),
                (&failed, "redis unreachable: WRONGPASS"),
                (
                    &RedisContact::NoAnswer,
                    "redis unreachable: no answer in time",
                ),
            ] {
                assert_eq!(health(redis, leading, 0), Err(reason.into()));
            }
        }
        let answered = &RedisContact::Answered;
        assert_eq!(health(answered, false, 0), Ok("standby"));
        assert_eq!(health(answered, true, 0), Ok("ok"));
        let stalled = health(answered, true, 2).unwrap_err();
        assert!(stalled.starts_with("2 jobs stalled"), "{stalled}");
        // Stats start before Redis is reached; each try replaces the last.
        let stats = BeatStats::default();
        assert!(stats.health().is_err());
        stats.redis(RedisContact::Answered);
        assert_eq!(stats.health(), Ok("standby"));
        stats.redis(RedisContact::NoAnswer);
        assert!(stats.health().is_err());
    }

    #[test]
    fn published_and_dropped_are_counted_per_job_and_reason() {
        let stats = BeatStats::default();
        stats.published("a");
        stats.published("a");
        stats.published("b");
        stats.dropped("a", DropReason::Expired, 0);
        stats.dropped("a", DropReason::PastGrace, 3);
        stats.dropped("b", DropReason::Paused, 2);
        stats.dropped("b", DropReason::from(Dropped::Policy(Misfire::Skip)), 1);
        let text = exposition(&stats);
        for line in [
            "drumline_beat_published_total{job=\"a\"} 2",
            "drumline_beat_published_total{job=\"b\"} 1",
            "drumline_beat_dropped_total{job=\"a\",reason=\"past_grace\"} 3",
            "drumline_beat_dropped_total{job=\"b\",reason=\"paused\"} 2",
            "drumline_beat_dropped_total{job=\"b\",reason=\"misfire_skip\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        // One family per name: the totals are not served under the same name.
        assert_eq!(
            text.matches("# TYPE drumline_beat_published counter")
                .count(),
            1,
            "{text}"
        );
        assert!(!text.contains("drumline_beat_published_total "), "{text}");
        // Nothing dropped, no series.
        assert!(!text.contains("reason=\"expired\""), "{text}");
        assert_eq!((stats.published_total(), stats.dropped_total()), (3, 6));
    }
}
