//! What a run is, as the worker decides and the store records it: the claim's answer, the run
//! record's state, how a claim ends, and the replicas a durable write waits for. Plain data,
//! no I/O: `decision.rs` and `config.rs` use it without the store.

use std::fmt;
use std::time::Duration;

/// The `state` field of `{ns}:run:{key}` (docs/design.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    /// Claimed under a live (or expired, if its holder died) lease.
    Running,
    /// A run failed and attempt `attempt` waits in a delay queue; older copies are duplicates.
    Retrying,
    /// Succeeded.
    Done,
    /// Dead-lettered (permanent failure or retries exhausted).
    Dead,
    /// Not run: the job's previous instance still ran (`overlap = "skip"`).
    Skipped,
}

impl RunState {
    /// The text stored in Redis.
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Running => "running",
            RunState::Retrying => "retrying",
            RunState::Done => "done",
            RunState::Dead => "dead",
            RunState::Skipped => "skipped",
        }
    }

    /// Parses the text stored in Redis.
    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "running" => RunState::Running,
            "retrying" => RunState::Retrying,
            "done" => RunState::Done,
            "dead" => RunState::Dead,
            "skipped" => RunState::Skipped,
            _ => return None,
        })
    }
}

impl std::fmt::Display for RunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A final state a run ends in (what the store's `Store::finish` writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Final {
    /// Succeeded.
    Done,
    /// Dead-lettered.
    Dead,
}

impl Final {
    /// Its name in run records and the journal.
    pub fn as_str(self) -> &'static str {
        match self {
            Final::Done => RunState::Done.as_str(),
            Final::Dead => RunState::Dead.as_str(),
        }
    }
}

/// How a run's claim ends (what the store's `Store::finish` writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// In a final state.
    Final(Final),
    /// Handed to the retry carrying `next_attempt`: older copies become duplicates.
    Retry {
        /// The attempt that may claim the instance next.
        next_attempt: u32,
        /// How long the job's overlap lock stays with the instance for its retry (the retry's
        /// delay plus a lease): the instance holds its job until it ends, and the hold ends
        /// at this deadline if the retry's message is lost (docs/guarantees.md#overlap).
        hold: std::time::Duration,
    },
}

/// Outcome of a claim attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// We hold the lease now.
    Claimed {
        /// Fencing token: strictly greater than any earlier claim's in this namespace.
        fence: u64,
    },
    /// A duplicate copy: the instance already finished (`done`, `skipped` or `dead`), or a
    /// later attempt has been recorded (`retrying`, or `running` an attempt after this copy's).
    Duplicate {
        /// The recorded state.
        state: RunState,
    },
    /// Another worker holds a live lease; look again after `retry_in`.
    Busy {
        /// The lease's remaining time.
        retry_in: Duration,
        /// This copy is a later attempt than the one running: that run has ended (only a
        /// failed run publishes the next attempt) and its hand-over is on its way, so the
        /// copy may look again well before the lease would lapse.
        handover: bool,
    },
    /// `overlap = "skip"` and the job's previous instance still runs: recorded `skipped`.
    Skipped {
        /// Key of the instance that still runs.
        running: String,
    },
    /// `overlap = "queue"` and the job's previous instance still runs; look again after
    /// `retry_in`.
    Waiting {
        /// The running instance's remaining lease.
        retry_in: Duration,
        /// Key of the instance that still runs.
        running: String,
    },
    /// The copy's `expires_at` has passed and no run of it is recorded or live: nothing was
    /// taken; the caller dead-letters it as `expired`.
    Expired,
    /// The task's `[limits.NAME]` is full: nothing was claimed (no attempt, no fence); the copy
    /// looks again after `retry_in` (docs/design.md#limits).
    Limited {
        /// For a rate, when the start reserved for this claim's token comes (or, past the
        /// reservation horizon, when the window will have room); for concurrency, when the
        /// first slot's lease lapses unless its holder renews it.
        retry_in: Duration,
        /// Which part of the limit is full.
        by: LimitedBy,
    },
}

/// Which part of a `[limits.NAME]` held a copy back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitedBy {
    /// Every concurrency slot is held.
    Concurrency,
    /// The rate's window is full.
    Rate,
}

impl LimitedBy {
    /// `concurrency` or `rate`, for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitedBy::Concurrency => "concurrency",
            LimitedBy::Rate => "rate",
        }
    }
}

/// `[redis] wait_replicas` (docs/design.md "Scale-out"): how many replicas must have a durable
/// write (`done`, `dead`, `retrying`, progress) before it counts, and how long to wait for
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitReplicas {
    /// Replicas that must acknowledge; 0 waits for none.
    pub replicas: u32,
    /// How long `WAIT` may block.
    pub timeout: Duration,
}

/// What is wrong with `wait_replicas` against the replicas the primary has, said once at start
/// (docs/scaling.md#redis-with-sentinel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaAdvice {
    /// Fewer than every replica under Sentinel: a failover may promote a replica that lacks
    /// an acknowledged write (an outcome lost, a run repeated).
    FewerThanEvery {
        /// `wait_replicas`.
        wanted: u32,
        /// Replicas connected to the primary now.
        connected: u32,
    },
    /// More than are connected: every durable write fails (the processes fail closed) until
    /// enough replicas are back.
    MoreThanConnected {
        /// `wait_replicas`.
        wanted: u32,
        /// Replicas connected to the primary now.
        connected: u32,
    },
}

impl WaitReplicas {
    /// Advice for this setting when the primary has `connected` replicas; `sentinel` when the
    /// URL is `redis+sentinel://` (failovers are automatic). `None`: nothing to say.
    pub fn advice(&self, connected: u32, sentinel: bool) -> Option<ReplicaAdvice> {
        let wanted = self.replicas;
        if wanted > connected {
            Some(ReplicaAdvice::MoreThanConnected { wanted, connected })
        } else if sentinel && wanted < connected {
            Some(ReplicaAdvice::FewerThanEvery { wanted, connected })
        } else {
            None
        }
    }
}

impl fmt::Display for ReplicaAdvice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ReplicaAdvice::FewerThanEvery { wanted, connected } => write!(
                f,
                "[redis] wait_replicas = {wanted} but the primary has {connected} replicas: a \
                 Sentinel failover may promote one that lacks an acknowledged write (a run \
                 repeated, an outcome lost); set it to {connected} (docs/scaling.md)"
            ),
            ReplicaAdvice::MoreThanConnected { wanted, connected } => write!(
                f,
                "[redis] wait_replicas = {wanted} but the primary has {connected} replicas \
                 connected: every durable write fails until enough are back (docs/scaling.md)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait(replicas: u32) -> WaitReplicas {
        WaitReplicas {
            replicas,
            timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn wait_replicas_is_every_replica_under_sentinel_and_never_more_than_connected() {
        use ReplicaAdvice::*;
        // Under Sentinel: every replica, or a failover may lose an acknowledged write.
        assert_eq!(wait(2).advice(2, true), None);
        let fewer = wait(1).advice(2, true);
        assert_eq!(
            fewer,
            Some(FewerThanEvery {
                wanted: 1,
                connected: 2
            })
        );
        assert!(fewer.unwrap().to_string().contains("set it to 2"));
        assert_eq!(
            wait(0).advice(2, true),
            Some(FewerThanEvery {
                wanted: 0,
                connected: 2
            })
        );
        // Without Sentinel nobody fails over on their own: fewer is a choice.
        assert_eq!(wait(0).advice(2, false), None);
        assert_eq!(wait(0).advice(0, true), None);
        // More than connected fails every durable write, with or without Sentinel.
        for sentinel in [true, false] {
            assert_eq!(
                wait(3).advice(2, sentinel),
                Some(MoreThanConnected {
                    wanted: 3,
                    connected: 2
                })
            );
        }
    }
}
