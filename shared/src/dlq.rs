//! `drumline dlq list | replay | purge` and the status page's dead-letter buttons (docs/design.md–8): the dead letters in `{ns}.dead`,
//! both those the worker put there (headers `x-drumline-reason`/`-error`/`-attempts`) and those
//! the broker dead-lettered because they expired while queued (`x-death`).
//!
//! Reading uses `basic.get` without ack: every message read stays unacked on our channel, so
//! no message is read twice, and whatever is not replayed goes back to the queue when the
//! channel closes. Replay publishes a fresh copy (attempt 0, no deadline) to `{ns}.tasks` with a
//! confirm, clears the instance's `dead` state in Redis, and only then acks the dead letter.

use crate::broker::{self, BrokerError, Channel, Connection, Delivery};
use crate::config::Config;
use crate::envelope::{format_instant, Envelope};
use crate::names::Names;
use crate::store::Store;
use chrono::{DateTime, TimeZone, Utc};
use serde::Serialize;

/// One dead letter, as `dlq list --json` prints it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetter {
    /// Idempotency key (the message id), if known.
    pub key: Option<String>,
    /// Task name, if known.
    pub task: Option<String>,
    /// Job name; null for ad-hoc tasks or undecodable bodies.
    pub job: Option<String>,
    /// `permanent`, `retries_exhausted`, `expired`, `unknown_task`, `malformed`, `oversize`, or
    /// the broker's `x-death` reason.
    pub reason: String,
    /// Runs made.
    pub attempts: u32,
    /// The last error, if any.
    pub error: Option<String>,
    /// RFC 3339 UTC, when it was dead-lettered.
    pub dead_at: Option<String>,
}

/// Why a dlq command failed.
#[derive(Debug, thiserror::Error)]
pub enum DlqError {
    /// Broker trouble, or the topology refused.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// Redis trouble (replay must clear the `dead` state).
    #[error("redis: {0}")]
    Redis(#[from] crate::store::StoreError),
    /// The broker did not confirm a replayed copy.
    #[error("the broker did not accept the replayed copy of {0}: {1}")]
    NotConfirmed(String, BrokerError),
}

/// Describes one dead-lettered message.
pub fn describe(letter: &Delivery) -> DeadLetter {
    let env = Envelope::decode(&letter.body).ok();
    let death = letter.death.as_ref();
    let reason = (letter.reason.clone())
        .or_else(|| death.and_then(|d| d.reason.clone()))
        .unwrap_or_else(|| "unknown".into());
    // A broker-expired message never ran in its last attempt: runs made = its attempt number.
    let attempts = (letter.attempts)
        .map(|a| a.max(0) as u32)
        .or(env.as_ref().map(|e| e.attempt))
        .unwrap_or(0);
    let dead_at = match (&letter.reason, death) {
        (Some(_), _) => letter.timestamp,
        (None, Some(d)) => d.time,
        _ => None,
    };
    let dead_at = dead_at.and_then(|t| Utc.timestamp_opt(t as i64, 0).single());
    DeadLetter {
        key: (letter.message_id.clone()).or(env.as_ref().map(|e| e.key.clone())),
        task: (letter.task.clone()).or(env.as_ref().map(|e| e.task.clone())),
        job: env.as_ref().and_then(|e| e.job.clone()),
        reason,
        attempts,
        error: letter.error.clone(),
        dead_at: dead_at.map(|t: DateTime<Utc>| format_instant(t)),
    }
}

/// The namespace's names and a channel on which the worker's topology (so `{ns}.dead`) is declared.
async fn open_dead(config: &Config) -> Result<(Names, Connection, Channel), DlqError> {
    let names = Names::new(config.namespace.clone());
    let (conn, channel) = broker::open_channel(
        config,
        &names,
        &config.worker.queues,
        config.worker.dead_ttl,
    )
    .await?;
    Ok((names, conn, channel))
}

/// An open view of `{ns}.dead`: messages read stay unacked until replayed (acked) or returned
/// (channel closed).
pub struct DeadQueue {
    conn: Connection,
    channel: Channel,
    names: Names,
    /// The messages read, in queue order.
    pub messages: Vec<Delivery>,
}

impl DeadQueue {
    /// Reads every message now in `{ns}.dead` without acking.
    pub async fn open(config: &Config) -> Result<Self, DlqError> {
        let (names, conn, channel) = open_dead(config).await?;
        let mut messages = Vec::new();
        while let Some(m) = broker::get(&channel, &names.dead()).await? {
            messages.push(m);
        }
        Ok(Self {
            conn,
            channel,
            names,
            messages,
        })
    }

    /// Replays the messages whose key is in `keys` (all when `keys` is empty); returns the keys
    /// replayed and the ones that could not be (not an envelope).
    pub async fn replay(
        &self,
        store: &Store,
        keys: &[String],
    ) -> Result<(Vec<String>, Vec<String>), DlqError> {
        let (mut done, mut refused) = (Vec::new(), Vec::new());
        for m in &self.messages {
            let info = describe(m);
            let wanted = keys.is_empty() || info.key.as_ref().is_some_and(|k| keys.contains(k));
            if !wanted {
                continue;
            }
            let Ok(mut env) = Envelope::decode(&m.body) else {
                refused.push(info.key.unwrap_or_else(|| "(no key)".into()));
                continue;
            };
            // A fresh start: retries from zero, and no deadline (it has typically passed); the
            // same trace (docs/envelope.md#trace-context).
            env.trace = m.trace;
            env.id = uuid::Uuid::new_v4();
            env.attempt = 0;
            env.expires_at = None;
            env.published_at = Utc::now();
            store.clear_dead(&env.key).await?;
            broker::publish_confirmed(
                &self.channel,
                &self.names.tasks_exchange(),
                &env.queue,
                true,
                &env.encode(),
                broker::properties(&env, Utc::now(), 0),
            )
            .await
            .map_err(|e| DlqError::NotConfirmed(env.key.clone(), e))?;
            m.acker.ack(false).await?;
            done.push(env.key);
        }
        Ok((done, refused))
    }

    /// Returns the unreplayed messages to the queue.
    pub async fn close(self) {
        let _ = self.channel.close(200, "dlq done".into()).await;
        let _ = self.conn.close(200, "dlq done".into()).await;
    }
}

/// Empties `{ns}.dead`; returns how many messages were removed.
pub async fn purge(config: &Config) -> Result<u32, DlqError> {
    let (names, conn, channel) = open_dead(config).await?;
    let n = broker::purge(&channel, &names.dead()).await?;
    let _ = conn.close(200, "purged".into()).await;
    Ok(n)
}

/// Renders dead letters as an aligned table.
pub fn table(letters: &[DeadLetter]) -> String {
    let dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    let rows: Vec<Vec<String>> = letters
        .iter()
        .map(|d| {
            vec![
                dash(&d.key),
                dash(&d.task),
                d.reason.clone(),
                d.attempts.to_string(),
                dash(&d.dead_at),
                // One line per letter: `--json` has the whole error.
                d.error
                    .as_deref()
                    .map_or("-".into(), |e| crate::table::one_line(e, 200)),
            ]
        })
        .collect();
    crate::table::render(
        &["KEY", "TASK", "REASON", "ATTEMPTS", "DEAD AT", "ERROR"],
        &rows,
    )
}
