//! The beat's counters (Prometheus metrics under `--metrics-addr`, and the health check) and
//! the report of every instance it decided not to publish. Touches only logs and counters.

use crate::misfire::Plan;
use chrono::{DateTime, Utc};
use drumline_shared::config::Job;
use drumline_shared::envelope::instance_key;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tracing::warn;

/// Counters the beat keeps; Prometheus metrics under `--metrics-addr`. Clones share them.
#[derive(Debug, Default, Clone)]
pub struct BeatStats {
    /// Instances published and confirmed.
    pub published: Counter,
    /// Instances decided not to publish (each logged with its key, or in a counted range).
    pub dropped: Counter,
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
}

impl BeatStats {
    /// Registers every metric under `drumline_beat_*`.
    pub fn register(&self, registry: &mut Registry) {
        let counters: [(&str, &str, &Counter); 4] = [
            (
                "published",
                "Instances published and confirmed by the broker",
                &self.published,
            ),
            (
                "dropped",
                "Instances not published (misfire policy, grace, expiry)",
                &self.dropped,
            ),
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

    /// Records what the last lease try found.
    pub fn set_leader(&self, leading: bool, epoch: u64) {
        self.is_leader.set(i64::from(leading));
        self.leader_epoch.set(epoch as i64);
    }

    /// `/healthz`: `ok` on a leader that moves, `standby` on a standby (both healthy: a standby
    /// is doing its job), an error when jobs are stalled.
    pub fn health(&self) -> Result<&'static str, String> {
        if self.is_leader.get() == 0 {
            return Ok("standby");
        }
        match self.stalled_jobs.get() {
            0 => Ok("ok"),
            n => Err(format!(
                "{n} jobs stalled: the broker or Redis is unreachable"
            )),
        }
    }
}

/// Logs every dropped instance with its key (beyond [`MAX_LISTED`](crate::misfire::MAX_LISTED):
/// one line with the count and the first and last key) and counts them.
pub fn report_dropped(job: &Job, plan: &Plan, stats: &BeatStats) {
    for (t, why) in &plan.dropped {
        warn!(job = %job.name, key = %instance_key(&job.name, *t), reason = why.reason(), "instance not published");
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
    stats.dropped.inc_by(plan.dropped_count());
}
