//! Counters a worker keeps: what it ran, skipped as duplicate, retried, dead-lettered — in total
//! and per task and outcome ([`RunOutcome`]), with histograms of lag and run time per task. They
//! are Prometheus metrics (`--metrics-addr`) and the summary logged at shutdown.
//!
//! Label sets are bounded: `task` is a task of this worker's config or `unknown` (a hostile
//! message cannot add series), `outcome` one of [`RunOutcome`]'s nine values.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The `task` label of a task this worker does not know (or of a message that did not decode).
pub const UNKNOWN_TASK: &str = "unknown";

/// Histogram buckets in seconds for a scheduler: 5 ms to 4 h.
pub const SECONDS_BUCKETS: [f64; 20] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1800.0, 3600.0, 7200.0, 14400.0,
];

/// How one delivery ended, the `outcome` label of `drumline_worker_runs_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RunOutcome {
    /// Ran and recorded `done`.
    Success,
    /// Ran, failed, sent to a delay queue for another attempt.
    Retry,
    /// Dead-lettered after a run (retries exhausted, permanent failure), or naming a task this
    /// worker does not have.
    Dead,
    /// Its deadline had passed before it could run.
    Expired,
    /// Already finished (or moved on to a later attempt): acked without running.
    Duplicate,
    /// Recorded `skipped`: the job's previous instance still ran (`overlap = "skip"`).
    Skipped,
    /// Dead-lettered before anything else: undecodable, over a limit, or over
    /// `max_message_bytes`.
    Malformed,
    /// The lease was lost: the result was not recorded and the delivery was requeued.
    LeaseLost,
    /// Cancelled when the shutdown grace ran out; released and requeued.
    Abandoned,
}

impl RunOutcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            RunOutcome::Success => "success",
            RunOutcome::Retry => "retry",
            RunOutcome::Dead => "dead",
            RunOutcome::Expired => "expired",
            RunOutcome::Duplicate => "duplicate",
            RunOutcome::Skipped => "skipped",
            RunOutcome::Malformed => "malformed",
            RunOutcome::LeaseLost => "lease_lost",
            RunOutcome::Abandoned => "abandoned",
        }
    }
}

/// Labels of `drumline_worker_runs_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RunLabels {
    /// A configured task, or [`UNKNOWN_TASK`].
    pub task: String,
    /// A [`RunOutcome`] label value.
    pub outcome: &'static str,
}

/// Labels of the per-task histograms and gauges.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct TaskLabels {
    /// A configured task (only runs are observed, and only known tasks run).
    pub task: String,
}

/// Labels of `drumline_worker_consumers`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct QueueLabels {
    /// A logical queue of this worker's config.
    pub queue: String,
}

/// Labels of the `drumline_limit_*` gauges.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct LimitLabels {
    /// A `[limits.NAME]` of this worker's config.
    pub limit: String,
}

/// A family of histograms with [`SECONDS_BUCKETS`].
pub type Seconds = Family<TaskLabels, Histogram, fn() -> Histogram>;

fn seconds_histogram() -> Histogram {
    Histogram::new(SECONDS_BUCKETS)
}

/// The worker's counters and gauges.
#[derive(Debug)]
pub struct Stats {
    /// Runs that ended `done`.
    pub succeeded: Counter,
    /// Deliveries whose key was already finished (acked, not run).
    pub duplicates: Counter,
    /// Deliveries held under another worker's live lease, or waiting for the job's previous
    /// instance (`overlap = queue`), sent to re-check later.
    pub busy: Counter,
    /// Deliveries that came before their `not_before`, sent to a delay queue until then
    /// (not claimed, not an attempt).
    pub deferred: Counter,
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
    /// Deliveries dead-lettered `malformed` (undecodable, or breaking the limits of docs/design.md).
    pub malformed: Counter,
    /// Deliveries handed back to the broker (nack with requeue) to be decided again.
    pub requeued: Counter,
    /// Rust handler runs that panicked (caught, and retried like a retryable failure).
    pub panics: Counter,
    /// Script calls that carried claims, renewals and endings to Redis (docs/design.md#batched-writes).
    pub redis_batches: Counter,
    /// Claims, renewals and endings sent to Redis; over `redis_batches`, the mean batch.
    pub redis_writes: Counter,
    /// Handlers running now.
    pub running: Gauge,
    /// 1 while consuming from the broker.
    pub broker_connected: Gauge,
    /// 1 while Redis answers (0: failing closed, not taking work).
    pub redis_up: Gauge,
    /// Per configured queue: 1 while this worker has a consumer on it
    /// (`drumline_worker_consumers{queue}`).
    pub consumers: Family<QueueLabels, Gauge>,
    /// The configured queues, each of which must have a consumer for `/healthz` to say ok.
    queues: Mutex<Vec<String>>,
    /// Deliveries per task and [`RunOutcome`] (`drumline_worker_runs_total{task, outcome}`).
    pub runs: Family<RunLabels, Counter>,
    /// Run start − `scheduled_for`, per task, in seconds (retries included: their
    /// `scheduled_for` is the instance's).
    pub lag: Seconds,
    /// How long the handler ran, per task, in seconds (every run: success, failure, lost lease).
    pub run_time: Seconds,
    /// Unix time of the last run per task that ended `done` on this worker.
    pub last_success: Family<TaskLabels, Gauge>,
    /// Per `[limits.NAME]`: runs of the group this worker runs now (`drumline_limit_in_use`;
    /// summed over the workers, the group's use).
    pub limit_in_use: Family<LimitLabels, Gauge>,
    /// Per `[limits.NAME]`: deliveries this worker holds waiting for the limit
    /// (`drumline_limit_waiting`; copies sent to a delay queue to look again are not counted).
    pub limit_waiting: Family<LimitLabels, Gauge>,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            succeeded: Counter::default(),
            duplicates: Counter::default(),
            busy: Counter::default(),
            deferred: Counter::default(),
            skipped: Counter::default(),
            retried: Counter::default(),
            dead_lettered: Counter::default(),
            expired: Counter::default(),
            abandoned: Counter::default(),
            malformed: Counter::default(),
            requeued: Counter::default(),
            panics: Counter::default(),
            redis_batches: Counter::default(),
            redis_writes: Counter::default(),
            running: Gauge::default(),
            broker_connected: Gauge::default(),
            redis_up: Gauge::default(),
            consumers: Family::default(),
            queues: Mutex::default(),
            runs: Family::default(),
            lag: Family::new_with_constructor(seconds_histogram),
            run_time: Family::new_with_constructor(seconds_histogram),
            last_success: Family::default(),
            limit_in_use: Family::default(),
            limit_waiting: Family::default(),
        }
    }
}

impl Stats {
    /// Counts the store's batches of writes and what they carry (docs/design.md#batched-writes).
    pub fn observe_batches(self: &Arc<Self>) -> drumline_shared::store::Observe {
        let stats = self.clone();
        Arc::new(move |size| {
            stats.redis_batches.inc();
            stats.redis_writes.inc_by(size as u64);
        })
    }

    /// Registers every metric under `drumline_worker_*` (and the `drumline_limit_*` gauges).
    pub fn register(&self, registry: &mut Registry) {
        self.register_counters(registry);
        self.register_gauges(registry);
        self.register_per_task(registry);
        self.register_limits(registry);
    }

    /// The totals: `drumline_worker_succeeded` … `drumline_worker_panics`.
    fn register_counters(&self, registry: &mut Registry) {
        let counters: [(&str, &str, &Counter); 14] = [
            ("succeeded", "Runs that ended done", &self.succeeded),
            ("duplicates", "Deliveries of already finished instances, acked without running", &self.duplicates),
            ("busy", "Deliveries held by another live lease or waiting for the job's previous instance, re-checked later", &self.busy),
            ("deferred", "Deliveries that came before their not_before, sent to a delay queue until it", &self.deferred),
            ("skipped", "Instances recorded skipped because the job's previous instance still ran", &self.skipped),
            ("retried", "Failed runs sent to a delay queue for another attempt", &self.retried),
            ("dead_lettered", "Messages published to the dead-letter queue", &self.dead_lettered),
            ("expired", "Deliveries whose deadline had passed before they could run", &self.expired),
            ("abandoned", "Runs cancelled because the shutdown grace ran out", &self.abandoned),
            ("malformed", "Deliveries dead-lettered as malformed", &self.malformed),
            ("requeued", "Deliveries handed back to the broker to be decided again", &self.requeued),
            ("panics", "Rust handler runs that panicked (caught and retried)", &self.panics),
            ("redis_batches", "Script calls that carried claims, renewals and endings to Redis", &self.redis_batches),
            ("redis_writes", "Claims, renewals and endings sent to Redis, batched into redis_batches", &self.redis_writes),
        ];
        for (name, help, counter) in counters {
            registry.register(format!("drumline_worker_{name}"), help, counter.clone());
        }
    }

    /// The gauges of what holds now: handlers running, the broker and Redis reached, a consumer
    /// per configured queue.
    fn register_gauges(&self, registry: &mut Registry) {
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
        registry.register(
            "drumline_worker_consumers",
            "1 while this worker consumes the queue, per configured queue",
            self.consumers.clone(),
        );
    }

    /// The families labelled by task: deliveries by outcome, lag, run time and last success.
    fn register_per_task(&self, registry: &mut Registry) {
        registry.register(
            "drumline_worker_runs",
            "Deliveries by task (unknown: not in this worker's config) and outcome",
            self.runs.clone(),
        );
        registry.register(
            "drumline_worker_lag_seconds",
            "Run start minus the instance's scheduled_for, per task",
            self.lag.clone(),
        );
        registry.register(
            "drumline_worker_run_seconds",
            "How long the handler ran, per task",
            self.run_time.clone(),
        );
        registry.register(
            "drumline_worker_last_success_timestamp_seconds",
            "Unix time of the last run of the task that ended done on this worker",
            self.last_success.clone(),
        );
    }

    /// The `drumline_limit_*` gauges, per `[limits.NAME]`.
    fn register_limits(&self, registry: &mut Registry) {
        registry.register(
            "drumline_limit_in_use",
            "Runs of the limit's group running on this worker now, per [limits.NAME]",
            self.limit_in_use.clone(),
        );
        registry.register(
            "drumline_limit_waiting",
            "Deliveries this worker holds waiting for the limit, per [limits.NAME]",
            self.limit_waiting.clone(),
        );
    }

    /// The `drumline_limit_in_use` gauge of `limit`.
    pub fn limit_in_use(&self, limit: &str) -> Gauge {
        self.limit_in_use
            .get_or_create(&LimitLabels {
                limit: limit.to_owned(),
            })
            .clone()
    }

    /// The `drumline_limit_waiting` gauge of `limit`.
    pub fn limit_waiting(&self, limit: &str) -> Gauge {
        self.limit_waiting
            .get_or_create(&LimitLabels {
                limit: limit.to_owned(),
            })
            .clone()
    }

    /// Counts one delivery of `task` (already [`UNKNOWN_TASK`] when not ours) ending `outcome`;
    /// a success also sets the task's last-success time.
    pub fn outcome(&self, task: &str, outcome: RunOutcome) {
        let labels = RunLabels {
            task: task.to_owned(),
            outcome: outcome.as_str(),
        };
        self.runs.get_or_create(&labels).inc();
        if outcome == RunOutcome::Success {
            let now = chrono::Utc::now().timestamp();
            self.last_success
                .get_or_create(&TaskLabels {
                    task: task.to_owned(),
                })
                .set(now);
        }
    }

    /// Observes a run of `task` starting `lag` after its instant (negative: early, counted 0).
    pub fn run_started(&self, task: &str, lag: chrono::TimeDelta) {
        let seconds = lag.to_std().unwrap_or_default().as_secs_f64();
        self.lag
            .get_or_create(&TaskLabels {
                task: task.to_owned(),
            })
            .observe(seconds);
    }

    /// Observes a run of `task` that took `took`.
    pub fn run_ended(&self, task: &str, took: Duration) {
        self.run_time
            .get_or_create(&TaskLabels {
                task: task.to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    /// The queues this worker is configured to consume (each shown 0 until consumed).
    pub fn expect_queues(&self, queues: &[String]) {
        for queue in queues {
            self.consuming(queue, false);
        }
        *self.queues.lock().unwrap_or_else(|e| e.into_inner()) = queues.to_vec();
    }

    /// The `[limits.*]` this worker's tasks count against: their gauges are shown (0) from the
    /// start.
    pub fn expect_limits<'a>(&self, limits: impl IntoIterator<Item = &'a str>) {
        for limit in limits {
            self.limit_in_use(limit);
            self.limit_waiting(limit);
        }
    }

    /// Whether this worker has a consumer on `queue` now.
    pub fn consuming(&self, queue: &str, yes: bool) {
        self.consumers
            .get_or_create(&QueueLabels {
                queue: queue.to_owned(),
            })
            .set(i64::from(yes));
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

    /// `Ok` when the worker can take work: connected to the broker, Redis answering, and a
    /// consumer on every configured queue.
    pub fn health(&self) -> Result<(), String> {
        // Redis first: the worker connects to it before the broker, so while Redis is down
        // the broker is not connected either, and Redis is the one to name.
        match (self.redis_up.get(), self.broker_connected.get()) {
            (1, 1) => {}
            (0, _) => return Err("redis unreachable: failing closed".into()),
            _ => return Err("not connected to the broker".into()),
        }
        let queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        let unconsumed: Vec<&str> = queues
            .iter()
            .filter(|queue| {
                let labels = QueueLabels {
                    queue: queue.to_string(),
                };
                self.consumers.get_or_create(&labels).get() != 1
            })
            .map(String::as_str)
            .collect();
        if unconsumed.is_empty() {
            return Ok(());
        }
        Err(format!(
            "no consumer on queue {}: the broker cancelled it; declaring it again and re-subscribing",
            unconsumed.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    #[test]
    fn runs_are_counted_per_task_and_outcome_with_histograms_per_task() {
        let stats = Stats::default();
        stats.outcome("report", RunOutcome::Success);
        stats.outcome("report", RunOutcome::Success);
        stats.outcome("report", RunOutcome::LeaseLost);
        stats.outcome(UNKNOWN_TASK, RunOutcome::Malformed);
        stats.run_started("report", chrono::TimeDelta::milliseconds(1500));
        stats.run_started("report", chrono::TimeDelta::milliseconds(-20));
        stats.run_ended("report", Duration::from_millis(30));
        let mut registry = Registry::default();
        stats.register(&mut registry);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        for line in [
            "drumline_worker_runs_total{task=\"report\",outcome=\"success\"} 2",
            "drumline_worker_runs_total{task=\"report\",outcome=\"lease_lost\"} 1",
            "drumline_worker_runs_total{task=\"unknown\",outcome=\"malformed\"} 1",
            "drumline_worker_lag_seconds_count{task=\"report\"} 2",
            "drumline_worker_lag_seconds_sum{task=\"report\"} 1.5",
            "drumline_worker_lag_seconds_bucket{le=\"1.0\",task=\"report\"} 1",
            "drumline_worker_run_seconds_count{task=\"report\"} 1",
            "drumline_worker_run_seconds_bucket{le=\"14400.0\",task=\"report\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        let stamp = text
            .lines()
            .find_map(|l| {
                l.strip_prefix("drumline_worker_last_success_timestamp_seconds{task=\"report\"} ")
            })
            .and_then(|n| n.parse::<i64>().ok())
            .unwrap_or_else(|| panic!("{text}"));
        assert!((chrono::Utc::now().timestamp() - stamp).abs() < 60);
        // Failures leave no last-success series.
        assert!(!text.contains("last_success_timestamp_seconds{task=\"unknown\"}"));
    }

    #[test]
    fn health_names_every_configured_queue_without_a_consumer() {
        let stats = Stats::default();
        stats.expect_queues(&["qa".to_owned(), "qb".to_owned()]);
        stats.broker_connected.set(1);
        stats.redis_up.set(1);
        stats.consuming("qb", true);
        let reason = stats.health().unwrap_err();
        assert!(reason.starts_with("no consumer on queue qa:"), "{reason}");
        stats.consuming("qa", true);
        assert_eq!(stats.health(), Ok(()));
        // The connections come first, Redis before the broker.
        stats.broker_connected.set(0);
        assert_eq!(stats.health(), Err("not connected to the broker".into()));
        stats.redis_up.set(0);
        assert_eq!(
            stats.health(),
            Err("redis unreachable: failing closed".into())
        );
    }
}
