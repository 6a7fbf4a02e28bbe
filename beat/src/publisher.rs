//! The beat's side of the broker: one connection, one confirm-mode channel, topology declared
//! on every (re)connect. A publish counts only once the broker confirmed it and it was routed;
//! any failure drops the connection so the next publish reconnects.
//!
//! [`Publisher::publish_batch`] sends a whole batch before awaiting the first confirm
//! ([`broker::publish_batch`]), so a batch costs about one round trip to the broker rather than
//! one per message. The scheduler goes further: [`Publisher::send_batch`] sends a batch and
//! [`Publisher::confirms`] reads its confirms after the next batches were sent, so the broker's
//! confirm of one batch (its disk write) overlaps the sending of the next.

use chrono::Utc;
use drumline_shared::broker::{self, BrokerError, Outgoing, Sending};
use drumline_shared::broker::{Channel, Connection};
use drumline_shared::config::{Config, QueueType};
use drumline_shared::envelope::Envelope;
use drumline_shared::names::Names;
use drumline_shared::spans;
use std::collections::HashSet;
use std::time::Duration;
use tracing::info;

/// Publishes envelopes with confirms.
pub struct Publisher {
    nodes: broker::Nodes,
    queue_type: QueueType,
    names: Names,
    queues: Vec<String>,
    dead_ttl: Duration,
    session: Option<(Connection, Channel)>,
    /// Counts the sessions opened: a batch's confirms drop the session only if it is still the
    /// one the batch was sent on ([`Publisher::session`]).
    sessions: u64,
}

impl Publisher {
    /// A publisher for `config`'s broker; connects lazily.
    pub fn new(config: &Config) -> Self {
        Self {
            nodes: broker::Nodes::new(config),
            queue_type: config.broker.queue_type,
            names: Names::new(config.namespace.clone()),
            queues: job_queues(config),
            dead_ttl: config.worker.dead_ttl,
            session: None,
            sessions: 0,
        }
    }

    /// Publishes for `config`'s jobs from now on (a reload): a queue not declared yet makes the
    /// next publish reconnect and declare it.
    pub(crate) fn reconfigure(&mut self, config: &Config) {
        let queues = job_queues(config);
        if queues.iter().any(|q| !self.queues.contains(q)) {
            self.session = None;
        }
        self.queues = queues;
    }

    /// Connects and declares the topology if not connected.
    pub async fn connect(&mut self) -> Result<&Channel, BrokerError> {
        if self
            .session
            .as_ref()
            .is_some_and(|(c, ch)| !c.status().connected() || !ch.status().connected())
        {
            self.session = None;
        }
        if self.session.is_none() {
            // After a lost connection, the other nodes first (`[broker] urls`); every call
            // bounded, a re-declaration not awaited (docs/design.md#reconnecting-past-a-hung-node).
            let what = broker::Declaration {
                names: &self.names,
                queues: &self.queues,
                dead_ttl: self.dead_ttl,
                queue_type: self.queue_type,
            };
            let session = self.nodes.open_session(&what).await?;
            info!(namespace = %self.names.namespace(), "connected to the broker; topology declared");
            self.session = Some(session);
            self.sessions += 1;
        }
        Ok(&self.session.as_ref().expect("just set").1)
    }

    /// Publishes every envelope of `batch` to `{ns}.tasks`, all sent before the first confirm
    /// is awaited, then awaits the confirms in order. Returns one outcome per envelope, in
    /// `batch` order (those after a failed send were not sent and carry its error), or `Err`
    /// when nothing could be sent (no connection; the topology refused). After a failure of the
    /// channel or the broker the connection is dropped, so the next publish starts from a clean
    /// one.
    ///
    /// `may_send` is asked before each message is handed to the client: once it says no (the
    /// beat's leadership lapsed), the rest fail with [`BrokerError::Withdrawn`] unsent.
    pub async fn publish_batch(
        &mut self,
        batch: &[Envelope],
        epoch: u64,
        may_send: impl FnMut() -> bool,
    ) -> Result<Vec<Result<(), BrokerError>>, BrokerError> {
        let outcomes = self.try_publish_batch(batch, epoch, may_send).await;
        let broker_failed = match &outcomes {
            Ok(all) => channel_failed(all),
            Err(_) => true,
        };
        if broker_failed {
            self.drop_session("publish failed");
        }
        outcomes
    }

    async fn try_publish_batch(
        &mut self,
        batch: &[Envelope],
        epoch: u64,
        may_send: impl FnMut() -> bool,
    ) -> Result<Vec<Result<(), BrokerError>>, BrokerError> {
        let exchange = self.names.tasks_exchange();
        let channel = self.connect().await?;
        Ok(broker::publish_batch(channel, &exchange, outgoing(batch, epoch), may_send).await)
    }

    /// Sends every envelope of `batch` as [`Publisher::publish_batch`] does, without awaiting a
    /// confirm: the scheduler sends the next batch before it reads this one's
    /// ([`Publisher::confirms`]). `Err` when nothing could be sent.
    pub async fn send_batch(
        &mut self,
        batch: &[Envelope],
        epoch: u64,
        may_send: impl FnMut() -> bool,
    ) -> Result<Sending, BrokerError> {
        let exchange = self.names.tasks_exchange();
        let sent = match self.connect().await {
            Ok(channel) => {
                Ok(broker::send_batch(channel, &exchange, outgoing(batch, epoch), may_send).await)
            }
            Err(e) => Err(e),
        };
        if sent.is_err() {
            self.drop_session("publish failed");
        }
        sent
    }

    /// The confirms of a batch sent by [`Publisher::send_batch`], one outcome per envelope
    /// ([`Sending::confirms`]: `returned` and `later`, the batches sent after it, match
    /// returns across the batches in flight). After a broker failure the connection is dropped.
    pub async fn confirms<'a>(
        &mut self,
        (sending, session): (Sending, u64),
        returned: &mut HashSet<String>,
        later: impl IntoIterator<Item = &'a mut Sending>,
    ) -> Vec<Result<(), BrokerError>> {
        let outcomes = sending.confirms(returned, later).await;
        // A session opened since (a later batch reconnected) is not this failure's.
        if channel_failed(&outcomes) && session == self.sessions {
            self.drop_session("publish failed");
        }
        outcomes
    }

    /// The session a batch sent now goes out on (for [`Publisher::confirms`]).
    pub fn session(&self) -> u64 {
        self.sessions
    }

    fn drop_session(&mut self, why: &'static str) {
        if let Some((conn, _)) = self.session.take() {
            // Not awaited: a hung node never answers, and the next publish reconnects now.
            broker::close_later(conn, why);
        }
    }

    /// Closes the connection (waiting at most the connect timeout for the broker).
    pub async fn close(&mut self) {
        if let Some((conn, _)) = self.session.take() {
            let closing = conn.close(200, "beat stopping".into());
            let _ = tokio::time::timeout(broker::CONNECT_TIMEOUT, closing).await;
        }
    }
}

/// The queues `config`'s jobs publish to, each once.
fn job_queues(config: &Config) -> Vec<String> {
    let mut queues: Vec<String> = Vec::new();
    for job in &config.jobs {
        if !queues.iter().any(|q| **q == *job.spec.queue) {
            queues.push(job.spec.queue.to_string());
        }
    }
    queues
}

/// Whether a batch's outcomes show a failure of the channel or the broker (the session is then
/// dropped). Neither a message left unsent because leadership lapsed, nor an unroutable one
/// (the broker returned it), nor a nacked one beside confirmed ones (the broker refused it, e.g.
/// a full queue that rejects publishes) is one: the channel carries on, and with it the batches
/// in flight. A batch the broker nacked whole is: a channel opened while a quorum queue's
/// leader was dying keeps that leader and has every later publish nacked (CI's cluster test
/// saw four minutes of it), where a fresh channel finds the new leader.
fn channel_failed(outcomes: &[Result<(), BrokerError>]) -> bool {
    let hard = outcomes.iter().any(|o| {
        o.as_ref().is_err_and(|e| {
            !matches!(
                e,
                BrokerError::Withdrawn | BrokerError::Unroutable(_) | BrokerError::Nacked
            )
        })
    });
    let nacked = outcomes
        .iter()
        .any(|o| matches!(o, Err(BrokerError::Nacked)));
    hard || (nacked && !outcomes.iter().any(Result::is_ok))
}

/// The messages of `batch`, each made when its turn to be sent comes.
/// With `[telemetry]`, each one's `publish` span: from its `published_at` to its send (the
/// first span of its trace: docs/envelope.md#trace-context).
fn outgoing(batch: &[Envelope], epoch: u64) -> impl ExactSizeIterator<Item = Outgoing> + '_ {
    batch.iter().map(move |env| {
        if spans::enabled() {
            let start = std::time::SystemTime::from(env.published_at);
            if let Some(span) = spans::Span::publish(env, None, start) {
                spans::record(span);
            }
        }
        Outgoing {
            routing_key: env.queue.to_string(),
            body: env.encode(),
            properties: drumline_shared::broker::properties(env, Utc::now(), epoch),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_nacked_whole_drops_the_channel_a_nack_beside_confirms_does_not() {
        let ok = || Ok(());
        let nack = || Err(BrokerError::Nacked);
        assert!(channel_failed(&[nack()]));
        assert!(channel_failed(&[nack(), nack()]));
        assert!(channel_failed(&[nack(), Err(BrokerError::Withdrawn)]));
        assert!(!channel_failed(&[ok(), nack()]));
        assert!(!channel_failed(&[Err(BrokerError::Withdrawn)]));
        assert!(!channel_failed(&[ok()]));
        assert!(!channel_failed(&[]));
    }
}
