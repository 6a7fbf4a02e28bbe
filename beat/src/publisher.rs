//! The beat's side of the broker: one connection, one confirm-mode channel, topology declared
//! on every (re)connect. A publish counts only once the broker confirmed it and it was routed;
//! any failure drops the connection so the next publish reconnects.

use chrono::{DateTime, Utc};
use drumline_shared::config::Config;
use drumline_shared::envelope::Envelope;
use drumline_shared::names::Names;
use drumline_shared::topology::{self, TopologyError};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::publisher_confirm::Confirmation;
use lapin::{Channel, Connection, ConnectionProperties};
use std::time::Duration;
use tracing::info;

/// Why a publish did not go through.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Connection, channel or confirm failure.
    #[error("broker: {0}")]
    Amqp(#[from] lapin::Error),
    /// The broker refused our topology (a changed argument); needs a human.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// The broker nacked the message.
    #[error("the broker refused the message (nack)")]
    Nacked,
    /// No queue is bound for the routing key.
    #[error("the message could not be routed to {0}")]
    Unroutable(String),
}

/// Publishes envelopes with confirms.
pub struct Publisher {
    url: String,
    names: Names,
    queues: Vec<String>,
    dead_ttl: Duration,
    session: Option<(Connection, Channel)>,
}

impl Publisher {
    /// A publisher for `config`'s broker; connects lazily.
    pub fn new(config: &Config) -> Self {
        let mut queues: Vec<String> = Vec::new();
        for job in &config.jobs {
            if !queues.contains(&job.queue) {
                queues.push(job.queue.clone());
            }
        }
        Self {
            url: config.broker_url.clone(),
            names: Names::new(config.namespace.clone()),
            queues,
            dead_ttl: config.worker.dead_ttl,
            session: None,
        }
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
            let conn = Connection::connect(&self.url, ConnectionProperties::default()).await?;
            let channel = conn.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            topology::declare(&channel, &self.names, &self.queues, self.dead_ttl).await?;
            info!(namespace = %self.names.namespace(), "connected to the broker; topology declared");
            self.session = Some((conn, channel));
        }
        Ok(&self.session.as_ref().expect("just set").1)
    }

    /// Publishes `env` to `{ns}.tasks` and waits for the confirm.
    pub async fn publish(
        &mut self,
        env: &Envelope,
        now: DateTime<Utc>,
        epoch: u64,
    ) -> Result<(), PublishError> {
        let result = self.try_publish(env, now, epoch).await;
        if result.is_err() {
            // Start from a clean connection next time.
            if let Some((conn, _)) = self.session.take() {
                let _ = conn.close(200, "publish failed").await;
            }
        }
        result
    }

    async fn try_publish(
        &mut self,
        env: &Envelope,
        now: DateTime<Utc>,
        epoch: u64,
    ) -> Result<(), PublishError> {
        let exchange = self.names.tasks_exchange();
        let channel = self.connect().await?;
        let confirmation = channel
            .basic_publish(
                &exchange,
                &env.queue,
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                &env.encode(),
                env.properties(now, Some(epoch)),
            )
            .await?
            .await?;
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)) => {
                Err(PublishError::Unroutable(self.names.work_queue(&env.queue)))
            }
            Confirmation::Nack(None) => Err(PublishError::Nacked),
            Confirmation::NotRequested => Ok(()),
        }
    }

    /// Closes the connection.
    pub async fn close(&mut self) {
        if let Some((conn, _)) = self.session.take() {
            let _ = conn.close(200, "beat stopping").await;
        }
    }
}
