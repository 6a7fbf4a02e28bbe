//! The queue gauges on the beat's `/metrics`: `drumline_queue_depth{queue}` (ready messages)
//! and `drumline_queue_consumers{queue}` of every queue the config names (its jobs' queues and
//! `[worker] queues`), read from the broker every [`REFRESH`] by a passive declare each, on the
//! status page's connection
//! (docs/design.md#queues-and-workers).

use crate::dead_letters::DeadLetters;
use drumline_shared::broker;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::time::Duration;

/// How often the gauges are read again.
pub const REFRESH: Duration = Duration::from_secs(5);

/// The label of a queue gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabel {
    /// The logical queue.
    pub queue: String,
}

/// The two gauge families, shared with the refresh task.
#[derive(Clone, Debug, Default)]
pub struct QueueGauges {
    depth: Family<QueueLabel, Gauge>,
    consumers: Family<QueueLabel, Gauge>,
}

impl QueueGauges {
    /// Adds both families to `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "drumline_queue_depth",
            "Messages ready in the work queue, per logical queue (read by the beat)",
            self.depth.clone(),
        );
        registry.register(
            "drumline_queue_consumers",
            "Consumers (workers) on the work queue, per logical queue (read by the beat)",
            self.consumers.clone(),
        );
    }

    /// Reads the counts of the configured queues every [`REFRESH`], in the background, for as
    /// long as the process runs, through `counts`: the connection the status page reads through
    /// too, so the page and the gauges hold one broker connection between them
    /// (docs/design.md#bounded-work). An unknown count leaves the gauges at their last values.
    pub fn spawn_refresh(
        &self,
        counts: std::sync::Arc<DeadLetters>,
    ) -> tokio::task::JoinHandle<()> {
        let gauges = self.clone();
        tokio::spawn(async move {
            let queues = counts.queues().to_vec();
            loop {
                let read = counts.count().await;
                if read.queues.len() == queues.len() {
                    gauges.set(&queues, &read.queues);
                }
                tokio::time::sleep(REFRESH).await;
            }
        })
    }

    fn set(&self, queues: &[String], counts: &[Option<broker::QueueCounts>]) {
        for (queue, counts) in queues.iter().zip(counts) {
            let label = QueueLabel {
                queue: queue.clone(),
            };
            let counts = counts.unwrap_or(broker::QueueCounts {
                depth: 0,
                consumers: 0,
            });
            self.depth
                .get_or_create(&label)
                .set(i64::from(counts.depth));
            self.consumers
                .get_or_create(&label)
                .set(i64::from(counts.consumers));
        }
    }
}
