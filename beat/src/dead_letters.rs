//! The dead-letter count and the queues' depths and consumers the status page shows
//! (docs/design.md#bounded-work): read through one broker connection of the page's own, kept
//! between requests, one read at a time, and cached for [`FRESH_FOR`]. However many requests
//! come, the page holds at most that one connection and asks the broker at most once per
//! [`FRESH_FOR`].

use crate::status::{broker_counts_on, BrokerCounts};
use drumline_shared::broker;
use drumline_shared::config::Config;
use drumline_shared::names::Names;
use lapin::Connection;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

/// How long a count read from the broker is shown before it is read again (a failed read too:
/// an unreachable broker is asked again only after that long).
pub const FRESH_FOR: Duration = Duration::from_secs(5);

/// How long one read (connecting included) may take before the count is shown as unknown.
pub const READ_WAIT: Duration = Duration::from_secs(3);

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
    conn: Option<Connection>,
    /// When the last read ended and what it found (unknowns: the broker did not say).
    last: Option<(Instant, BrokerCounts)>,
}

impl DeadLetters {
    /// For `config`'s broker and namespace (neither changes on reload); connects at the first
    /// read.
    pub fn new(config: Arc<Config>) -> Self {
        let names = Names::new(config.namespace.clone());
        let queues = crate::queues::queues_of(&config).into();
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
    /// or unknown (logged) when the broker could not say within [`READ_WAIT`]. A caller that
    /// finds a read under way waits for it and takes its answer.
    pub async fn count(&self) -> BrokerCounts {
        let mut state = self.state.clone().lock_owned().await;
        if let Some((at, count)) = &state.last {
            if at.elapsed() < FRESH_FOR {
                return count.clone();
            }
        }
        let (config, names) = (self.config.clone(), self.names.clone());
        let queues = self.queues.clone();
        // A task of its own, holding the lock: a request that gives up (its client left) does
        // not cancel the read half-way through a connect, which could leave that connection
        // open beside the next one.
        let read = tokio::spawn(async move {
            let count = read(&mut state, &config, (&names, &queues)).await;
            state.last = Some((Instant::now(), count.clone()));
            count
        });
        read.await.unwrap_or_default()
    }
}

/// One read, within [`READ_WAIT`]; a connection that failed is dropped (closed), and the next
/// read connects afresh.
async fn read(
    state: &mut State,
    config: &Config,
    (names, queues): (&Names, &[String]),
) -> BrokerCounts {
    let attempt = async {
        if !state.conn.as_ref().is_some_and(|c| c.status().connected()) {
            state.conn = None;
            state.conn = Some(broker::connect(config).await?);
        }
        let conn = state.conn.as_ref().expect("connected just now");
        broker_counts_on(conn, names, queues).await
    };
    match tokio::time::timeout(READ_WAIT, attempt).await {
        Ok(Ok(count)) => count,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "status page: dead letters and queues unknown");
            state.conn = None;
            BrokerCounts::default()
        }
        Err(_) => {
            tracing::warn!(
                wait_ms = READ_WAIT.as_millis() as u64,
                "status page: the broker did not answer; dead letters and queues unknown"
            );
            state.conn = None;
            BrokerCounts::default()
        }
    }
}
