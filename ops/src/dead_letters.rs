//! The dead-letter count and the queues' depths and consumers the status page shows
//! (docs/design.md#bounded-work): read through one broker connection of the page's own, kept
//! between requests, one read at a time, and cached for [`FRESH_FOR`]. However many requests
//! come, the page holds at most that one connection and asks the broker at most once per
//! [`FRESH_FOR`]. What a read finds is a [`BrokerCounts`], of the queues [`queues_of`] names.

use drumline_shared::broker;
use drumline_shared::config::Config;
use drumline_shared::names::Names;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

/// How long a count read from the broker is shown before it is read again (a failed read too:
/// an unreachable broker is asked again only after that long).
pub const FRESH_FOR: Duration = Duration::from_secs(5);

/// How long a request waits for a read (connecting included) before it shows the counts as
/// unknown. The read itself goes on (see [`DeadLetters::count`]).
pub const READ_WAIT: Duration = Duration::from_secs(3);

/// How long a read on a connection made may take before the connection is closed and the
/// counts are unknown until the next read (the connect has its own bound,
/// `broker::CONNECT_TIMEOUT` per node).
pub const READ_LIMIT: Duration = Duration::from_secs(15);

/// The page's count and the connection it is read through.
pub struct DeadLetters {
    config: Arc<Config>,
    names: Names,
    queues: Arc<[String]>,
    state: Arc<Mutex<State>>,
}

/// Held (locked) for the whole of a read, so there is never a second read, nor a second
/// connection, beside it.
#[derive(Default)]
struct State {
    conn: Option<broker::Connection>,
    /// When the last read ended and what it found (unknowns: the broker did not say).
    last: Option<(Instant, BrokerCounts)>,
}

impl DeadLetters {
    /// For `config`'s broker and namespace (neither changes on reload); connects at the first
    /// read.
    pub fn new(config: Arc<Config>) -> Self {
        let names = Names::new(config.namespace.clone());
        let queues = queues_of(&config).into();
        Self {
            config,
            names,
            queues,
            state: Arc::default(),
        }
    }

    /// The logical queues whose counts [`Self::count`] reads, in its order.
    pub fn queues(&self) -> &[String] {
        &self.queues
    }

    /// The messages in `{ns}.dead` and the queues' counts as read at most [`FRESH_FOR`] ago,
    /// or unknown when no read gave them within [`READ_WAIT`]. A caller that finds a read under
    /// way waits for it and takes its answer.
    ///
    /// The read is a task of its own, holding the lock until it ends: a caller that stops
    /// waiting (after [`READ_WAIT`], or because its client left) cancels nothing, so a connect
    /// is never abandoned half-way (a half-open connection would stay beside the next one while
    /// the broker is slow) and a slow broker still gives its counts, to the callers that come
    /// after.
    pub async fn count(&self) -> BrokerCounts {
        let state = self.state.clone();
        let (config, names) = (self.config.clone(), self.names.clone());
        let queues = self.queues.clone();
        let read = tokio::spawn(async move {
            let mut state = state.lock_owned().await;
            if let Some((at, count)) = &state.last {
                if at.elapsed() < FRESH_FOR {
                    return count.clone();
                }
            }
            let count = read(&mut state, &config, (&names, &queues)).await;
            state.last = Some((Instant::now(), count.clone()));
            count
        });
        match tokio::time::timeout(READ_WAIT, read).await {
            Ok(count) => count.unwrap_or_default(),
            Err(_) => {
                tracing::debug!(
                    wait_ms = READ_WAIT.as_millis() as u64,
                    "status page: the broker's counts are not read yet; shown as unknown"
                );
                BrokerCounts::default()
            }
        }
    }
}

/// One read: a connect when there is no live connection (bounded per node by
/// `broker::CONNECT_TIMEOUT`), then the counts within [`READ_LIMIT`]. A connection that failed
/// is closed, and the next read connects afresh.
async fn read(
    state: &mut State,
    config: &Config,
    (names, queues): (&Names, &[String]),
) -> BrokerCounts {
    if !state.conn.as_ref().is_some_and(|c| c.status().connected()) {
        if let Some(conn) = state.conn.take() {
            broker::close_later(conn, "status page: connection lost");
        }
        match broker::connect(config).await {
            Ok(conn) => state.conn = Some(conn),
            Err(e) => {
                tracing::warn!(error = %e, "status page: dead letters and queues unknown");
                return BrokerCounts::default();
            }
        }
    }
    let conn = state.conn.as_ref().expect("connected just now");
    let failure =
        match tokio::time::timeout(READ_LIMIT, broker_counts_on(conn, names, queues)).await {
            Ok(Ok(count)) => return count,
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {} s", READ_LIMIT.as_secs()),
        };
    tracing::warn!(error = %failure, "status page: dead letters and queues unknown");
    if let Some(conn) = state.conn.take() {
        broker::close_later(conn, "status page: read failed");
    }
    BrokerCounts::default()
}

/// What the broker said for a report: the dead letters and each queue's counts (each `None`
/// when it did not answer).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BrokerCounts {
    /// Messages in `{ns}.dead`.
    pub dead_letters: Option<u64>,
    /// Per queue of [`queues_of`], in that order; empty when unknown.
    pub queues: Vec<Option<broker::QueueCounts>>,
}

/// Reads the [`BrokerCounts`] of `queues` on `conn` (passive declares on channels of their own).
pub async fn broker_counts_on(
    conn: &broker::Connection,
    names: &Names,
    queues: &[String],
) -> Result<BrokerCounts, broker::BrokerError> {
    let dead_letters = broker::dead_letter_count_on(conn, names).await?;
    let mut counts = Vec::with_capacity(queues.len());
    for queue in queues {
        counts.push(broker::queue_counts_on(conn, &names.work_queue(queue)).await?);
    }
    Ok(BrokerCounts {
        dead_letters: Some(dead_letters),
        queues: counts,
    })
}

/// Every logical queue `config` names, once each, sorted: its jobs' and `[worker] queues`.
pub fn queues_of(config: &Config) -> Vec<String> {
    let mut queues: BTreeSet<String> = config.worker.queues.iter().cloned().collect();
    for job in &config.jobs {
        if !queues.contains(job.spec.queue.as_ref()) {
            queues.insert(job.spec.queue.to_string());
        }
    }
    queues.into_iter().collect()
}
