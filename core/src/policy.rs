//! The policies both a job's config and its message carry, so the message side (the envelope,
//! the broker, the producer client) needs no config parser: a job's [`Overlap`] and the
//! [`QueueType`] queues are declared with. `config` re-exports both.

use serde::Deserialize;
use std::fmt;

/// What to do when a job's previous instance still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// Record the instance `skipped` (default).
    #[default]
    Skip,
    /// Wait for the previous instance.
    Queue,
    /// Run concurrently.
    Allow,
}

/// What `[broker] queue_type` declares the work queues and `{ns}.dead` as. Delay queues are
/// classic whatever this says (docs/design.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueType {
    /// Classic queues (one node holds each queue). The default.
    #[default]
    Classic,
    /// Quorum queues (Raft-replicated over the cluster's nodes).
    Quorum,
}

impl QueueType {
    /// The `x-queue-type` argument's value.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

impl fmt::Display for QueueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
