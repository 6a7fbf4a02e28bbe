//! The beat's side of the broker: one connection, one confirm-mode channel, topology declared
//! on every (re)connect. A publish counts only once the broker confirmed it and it was routed;
//! any failure drops the connection so the next publish reconnects.
//!
//! [`Publisher::publish_batch`] sends a whole batch before awaiting the first confirm, so a
//! batch costs about one round trip to the broker rather than one per message (the confirms of
//! the first messages come back while the last ones are still being sent).

use chrono::Utc;
use drumline_shared::config::{Config, QueueType};
use drumline_shared::envelope::Envelope;
use drumline_shared::names::Names;
use drumline_shared::topology::{self, TopologyError};
use lapin::options::BasicPublishOptions;
use lapin::Confirmation;
use lapin::{Channel, Connection};
use std::collections::HashSet;
use std::time::Duration;
use tracing::info;

/// Why a publish did not go through.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Connection, channel or confirm failure.
    #[error("broker: {0}")]
    Amqp(#[from] lapin::Error),
    /// The broker refused our topology (a changed argument: needs a human), or did not answer
    /// a call on the way to a session within the connect timeout (retried).
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// The broker nacked the message.
    #[error("the broker refused the message (nack)")]
    Nacked,
    /// No queue is bound for the routing key.
    #[error("the message could not be routed to {0}")]
    Unroutable(String),
    /// The broker did not confirm within [`CONFIRM_DEADLINE`] (a resource alarm blocks the
    /// connection, or it hangs): the connection is dropped and the job retried.
    #[error("the broker did not confirm within {}s", CONFIRM_DEADLINE.as_secs())]
    Unconfirmed,
    /// Not sent: this beat may not publish any more (its leadership lapsed mid-batch).
    #[error("not sent: this beat stopped leading")]
    NotLeading,
}

/// Longest wait for a batch's confirms: a broker that blocks publishers (a memory or disk
/// alarm) or hangs must not hold the beat in one batch (shutdown and leadership are checked
/// between batches).
pub const CONFIRM_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Publishes envelopes with confirms.
pub struct Publisher {
    nodes: topology::Nodes,
    queue_type: QueueType,
    names: Names,
    queues: Vec<String>,
    dead_ttl: Duration,
    session: Option<(Connection, Channel)>,
}

impl Publisher {
    /// A publisher for `config`'s broker; connects lazily.
    pub fn new(config: &Config) -> Self {
        Self {
            nodes: topology::Nodes::new(config),
            queue_type: config.broker.queue_type,
            names: Names::new(config.namespace.clone()),
            queues: job_queues(config),
            dead_ttl: config.worker.dead_ttl,
            session: None,
        }
    }

    /// Publishes for `config`'s jobs from now on (a reload): a queue not declared yet makes the
    /// next publish reconnect and declare it.
    pub fn reconfigure(&mut self, config: &Config) {
        let queues = job_queues(config);
        if queues.iter().any(|q| !self.queues.contains(q)) {
            self.session = None;
        }
        self.queues = queues;
    }

    /// Connects and declares the topology if not connected.
    pub async fn connect(&mut self) -> Result<&Channel, PublishError> {
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
            let what = topology::Declaration {
                names: &self.names,
                queues: &self.queues,
                dead_ttl: self.dead_ttl,
                queue_type: self.queue_type,
            };
            let session = self.nodes.open_session(&what).await.map_err(|e| match e {
                TopologyError::Amqp(e) => PublishError::Amqp(e),
                e => PublishError::Topology(e),
            })?;
            info!(namespace = %self.names.namespace(), "connected to the broker; topology declared");
            self.session = Some(session);
        }
        Ok(&self.session.as_ref().expect("just set").1)
    }

    /// Publishes every envelope of `batch` to `{ns}.tasks`, all sent before the first confirm
    /// is awaited, then awaits the confirms in order. Returns one outcome per envelope, in
    /// `batch` order (those after a failed send were not sent and carry its error), or `Err`
    /// when nothing could be sent (no connection; the topology refused). After any broker
    /// failure the connection is dropped, so the next publish starts from a clean one.
    ///
    /// `may_send` is asked before each message is handed to the client: once it says no (the
    /// beat's leadership lapsed), the rest fail with [`PublishError::NotLeading`] unsent.
    pub async fn publish_batch(
        &mut self,
        batch: &[Envelope],
        epoch: u64,
        may_send: impl FnMut() -> bool,
    ) -> Result<Vec<Result<(), PublishError>>, PublishError> {
        let outcomes = self.try_publish_batch(batch, epoch, may_send).await;
        let broker_failed = match &outcomes {
            Ok(all) => all.iter().any(|o| {
                o.as_ref()
                    .is_err_and(|e| !matches!(e, PublishError::NotLeading))
            }),
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
        mut may_send: impl FnMut() -> bool,
    ) -> Result<Vec<Result<(), PublishError>>, PublishError> {
        let exchange = self.names.tasks_exchange();
        let channel = self.connect().await?;
        let mut pending = Vec::with_capacity(batch.len());
        let mut send_failure = None;
        for env in batch {
            if !may_send() {
                send_failure = Some(PublishError::NotLeading);
                break;
            }
            let sent = channel
                .basic_publish(
                    exchange.as_str().into(),
                    env.queue.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &env.encode(),
                    env.properties(Utc::now(), epoch),
                )
                .await;
            match sent {
                Ok(confirm) => pending.push(confirm),
                Err(e) => {
                    // The channel is gone: nothing after this goes out either.
                    send_failure = Some(PublishError::Amqp(e));
                    break;
                }
            }
        }
        let mut outcomes = Vec::with_capacity(batch.len());
        // The broker returns an unroutable (`mandatory`) message before it confirms it, but
        // lapin hands the returned message to whichever confirm completes next — with a
        // `multiple` ack, possibly another message's. So it is matched by its message id (the
        // idempotency key), and the confirm that carried it stands for its own message.
        let mut returned: HashSet<String> = HashSet::new();
        let deadline = tokio::time::Instant::now() + CONFIRM_DEADLINE;
        for (env, confirm) in batch.iter().zip(pending) {
            let Ok(confirmed) = tokio::time::timeout_at(deadline, confirm).await else {
                outcomes.push(Err(PublishError::Unconfirmed));
                continue;
            };
            let outcome = match confirmed {
                Ok(Confirmation::Ack(None) | Confirmation::NotRequested) => Ok(()),
                Ok(Confirmation::Nack(None)) => Err(PublishError::Nacked),
                Ok(carrier @ (Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)))) => {
                    let acked = carrier.is_ack();
                    match carrier
                        .take_message()
                        .and_then(|m| m.properties.message_id().clone())
                    {
                        Some(id) => {
                            returned.insert(id.to_string());
                            if acked {
                                Ok(())
                            } else {
                                Err(PublishError::Nacked)
                            }
                        }
                        // No id to match: count it against the message that carried it.
                        None => Err(PublishError::Unroutable(self.names.work_queue(&env.queue))),
                    }
                }
                Err(e) => Err(PublishError::Amqp(e)),
            };
            outcomes.push(outcome);
        }
        if let Some(e) = send_failure {
            // What stopped the sending stands for every message it kept back.
            outcomes.resize_with(batch.len(), || match &e {
                PublishError::Amqp(e) => Err(PublishError::Amqp(e.clone())),
                _ => Err(PublishError::NotLeading),
            });
        }
        if !returned.is_empty() {
            for (env, outcome) in batch.iter().zip(&mut outcomes) {
                if returned.contains(&env.key) {
                    *outcome = Err(PublishError::Unroutable(self.names.work_queue(&env.queue)));
                }
            }
        }
        Ok(outcomes)
    }

    fn drop_session(&mut self, why: &'static str) {
        if let Some((conn, _)) = self.session.take() {
            // Not awaited: a hung node never answers, and the next publish reconnects now.
            topology::close_later(conn, why);
        }
    }

    /// Closes the connection (waiting at most the connect timeout for the broker).
    pub async fn close(&mut self) {
        if let Some((conn, _)) = self.session.take() {
            let closing = conn.close(200, "beat stopping".into());
            let _ = tokio::time::timeout(topology::CONNECT_TIMEOUT, closing).await;
        }
    }
}

/// The queues `config`'s jobs publish to, each once.
fn job_queues(config: &Config) -> Vec<String> {
    let mut queues: Vec<String> = Vec::new();
    for job in &config.jobs {
        if !queues.iter().any(|q| **q == *job.queue) {
            queues.push(job.queue.to_string());
        }
    }
    queues
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::live::Ns;
    use lapin::options::QueueDeleteOptions;

    /// Against the real RabbitMQ. The broker returns unroutable messages before it confirms
    /// them, and may confirm several at once: each returned message is charged to its own
    /// envelope, not to the confirm that happened to carry it.
    #[tokio::test]
    async fn unroutable_messages_fail_alone_in_a_batch() {
        let ns = Ns::new("unroutable");
        let config = ns.config(
            "[[jobs]]\nname = \"a\"\ntask = \"t\"\nevery = \"1h\"\nqueue = \"a\"\n\
             [[jobs]]\nname = \"b\"\ntask = \"t\"\nevery = \"1h\"\nqueue = \"b\"\n",
        );
        let mut publisher = Publisher::new(&config);
        publisher.connect().await.expect("broker");
        // Queue `b` goes away after the topology was declared: its messages route nowhere.
        let names = Names::new(config.namespace.clone());
        let amqp = topology::connect(&config).await.unwrap();
        let ch = amqp.create_channel().await.unwrap();
        ch.queue_delete(
            names.work_queue("b").as_str().into(),
            QueueDeleteOptions::default(),
        )
        .await
        .unwrap();
        let _ = amqp.close(200, "bye".into()).await;

        let at = Utc::now();
        let batch: Vec<Envelope> = (0..40)
            .map(|i| {
                let queue = if i % 4 == 1 { "b" } else { "a" };
                let t = at + chrono::TimeDelta::seconds(i);
                Envelope::scheduled(queue, "t", queue, serde_json::json!({}), t, None, at)
            })
            .collect();
        let outcomes = publisher
            .publish_batch(&batch, 0, || true)
            .await
            .expect("sent");
        for (env, outcome) in batch.iter().zip(&outcomes) {
            match (env.queue.as_str(), outcome) {
                ("a", Ok(())) | ("b", Err(PublishError::Unroutable(_))) => {}
                _ => panic!("{}: {outcome:?}", env.key),
            }
        }
        publisher.close().await;
    }
}
