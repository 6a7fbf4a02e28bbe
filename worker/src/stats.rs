//! Counters a worker keeps: what it ran, skipped as duplicate, retried, dead-lettered.

use std::sync::atomic::{AtomicI64, Ordering};

/// One monotonic or up/down counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicI64);

impl Counter {
    /// +1.
    pub fn inc(&self) {
        self.add(1);
    }

    /// +n (n may be negative for gauges).
    pub fn add(&self, n: i64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// Current value.
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The worker's counters.
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
    /// Handlers running now (gauge).
    pub running: Counter,
}

impl Stats {
    /// One line for logs.
    pub fn summary(&self) -> String {
        format!(
            "succeeded={} duplicates={} busy={} skipped={} retried={} dead_lettered={} expired={} abandoned={}",
            self.succeeded.get(),
            self.duplicates.get(),
            self.busy.get(),
            self.skipped.get(),
            self.retried.get(),
            self.dead_lettered.get(),
            self.expired.get(),
            self.abandoned.get()
        )
    }
}
