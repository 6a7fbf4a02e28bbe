//! Counters a worker keeps: what it ran, skipped as duplicate, retried, dead-lettered. They are
//! Prometheus metrics (`--metrics-addr`) and the summary logged at shutdown.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The worker's counters and gauges.
#[derive(Debug, Default)]
pub struct Stats {
    /// Runs that ended `done`.
    pub succeeded: Counter,
    /// Deliveries whose key was already finished (acked, not run).
    pub duplicates: Counter,
    /// Deliveries held under another worker's live lease, or waiting for the job's previous
    /// instance (`overlap = queue`), sent to re-check later.
    pub busy: Counter,
    /// Instances recorded `skipped` because the job's previous instance still ran.
    pub skipped: Counter,
    /// Failed runs sent to a delay queue.
    pub retried: Counter,
    /// Messages published to `{ns}.dead`.
    pub dead_lettered: Counter,
    /// Deliveries that had expired before they could run.
    pub expired: Counter,
    /// Runs cancelled when the shutdown grace ran out.
    pub abandoned: Counter,
    /// Deliveries dead-lettered `malformed` (undecodable, or breaking the limits of DESIGN §9).
    pub malformed: Counter,
    /// Deliveries handed back to the broker (nack with requeue) to be decided again.
    pub requeued: Counter,
    /// Handlers running now.
    pub running: Gauge,
    /// 1 while consuming from the broker.
    pub broker_connected: Gauge,
    /// 1 while Redis answers (0: failing closed, not taking work).
    pub redis_up: Gauge,
}

impl Stats {
    /// Registers every metric under `drumline_worker_*`.
    pub fn register(&self, registry: &mut Registry) {
        let counters: [(&str, &str, &Counter); 10] = [
            ("succeeded", "Runs that ended done", &self.succeeded),
            ("duplicates", "Deliveries of already finished instances, acked without running", &self.duplicates),
            ("busy", "Deliveries held by another live lease or waiting for the job's previous instance, re-checked later", &self.busy),
            ("skipped", "Instances recorded skipped because the job's previous instance still ran", &self.skipped),
            ("retried", "Failed runs sent to a delay queue for another attempt", &self.retried),
            ("dead_lettered", "Messages published to the dead-letter queue", &self.dead_lettered),
            ("expired", "Deliveries whose deadline had passed before they could run", &self.expired),
            ("abandoned", "Runs cancelled because the shutdown grace ran out", &self.abandoned),
            ("malformed", "Deliveries dead-lettered as malformed", &self.malformed),
            ("requeued", "Deliveries handed back to the broker to be decided again", &self.requeued),
        ];
        for (name, help, counter) in counters {
            registry.register(format!("drumline_worker_{name}"), help, counter.clone());
        }
        let gauges: [(&str, &str, &Gauge); 3] = [
            ("running", "Handlers running now", &self.running),
            (
                "broker_connected",
                "1 while consuming from the broker",
                &self.broker_connected,
            ),
            (
                "redis_up",
                "1 while Redis answers; 0 while failing closed",
                &self.redis_up,
            ),
        ];
        for (name, help, gauge) in gauges {
            registry.register(format!("drumline_worker_{name}"), help, gauge.clone());
        }
    }

    /// One line for logs.
    pub fn summary(&self) -> String {
        format!(
            "succeeded={} duplicates={} busy={} skipped={} retried={} dead_lettered={} expired={} abandoned={} malformed={}",
            self.succeeded.get(),
            self.duplicates.get(),
            self.busy.get(),
            self.skipped.get(),
            self.retried.get(),
            self.dead_lettered.get(),
            self.expired.get(),
            self.abandoned.get(),
            self.malformed.get()
        )
    }

    /// `Ok` when the worker can take work: connected to the broker and Redis answering.
    pub fn health(&self) -> Result<(), String> {
        match (self.broker_connected.get(), self.redis_up.get()) {
            (1, 1) => Ok(()),
            (0, _) => Err("not connected to the broker".into()),
            _ => Err("redis unreachable: failing closed".into()),
        }
    }
}
