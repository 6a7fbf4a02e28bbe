//! Reading the broker's counts for `status`, the status page and the queue gauges: passive
//! declares, which create and change nothing (docs/design.md#queues-and-workers).

use super::reply_code;
#[cfg(feature = "config")]
use super::BrokerError;
#[cfg(feature = "config")]
use super::{close_later, connect, connect_or_name, Nodes};
#[cfg(feature = "config")]
use crate::config::Config;
use crate::names::Names;
use lapin::options::QueueDeclareOptions;
use lapin::protocol::AMQPSoftError;
use lapin::types::FieldTable;
use lapin::Connection;

/// How many messages wait in the dead-letter queue `{ns}.dead` (for `status`). A namespace
/// whose dead-letter queue was never declared holds none (0). Opens a connection of its own and
/// closes it.
#[cfg(feature = "config")]
pub async fn dead_letter_count(config: &Config, names: &Names) -> Result<u64, lapin::Error> {
    let conn = connect(config).await?;
    let count = dead_letter_count_on(&conn, names).await;
    let _ = conn.close(200, "status read".into()).await;
    count
}

/// [`dead_letter_count`] on a connection the caller keeps (the beat's status page), through a
/// channel of its own that is closed afterwards.
pub async fn dead_letter_count_on(conn: &Connection, names: &Names) -> Result<u64, lapin::Error> {
    let counts = queue_counts_on(conn, &names.dead()).await?;
    Ok(counts.map_or(0, |c| u64::from(c.depth)))
}

/// A work queue's ready messages and consumers, as the broker counts them now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct QueueCounts {
    /// Messages ready for delivery.
    pub depth: u32,
    /// Consumers subscribed.
    pub consumers: u32,
}

/// The counts of the work queue of each of `queues` (a passive declare each, on one
/// connection of its own): `None` for a queue the broker does not have. A failed connection
/// names the broker ([`BrokerError::Unreachable`]).
#[cfg(feature = "config")]
pub async fn queue_counts(
    config: &Config,
    names: &Names,
    queues: &[String],
) -> Result<Vec<Option<QueueCounts>>, BrokerError> {
    let nodes = Nodes::new(config);
    let conn = connect_or_name(config, &nodes).await?;
    let mut out = Vec::with_capacity(queues.len());
    for queue in queues {
        match queue_counts_on(&conn, &names.work_queue(queue)).await {
            Ok(counts) => out.push(counts),
            Err(e) => {
                close_later(conn, "counts read");
                return Err(e.into());
            }
        }
    }
    close_later(conn, "counts read");
    Ok(out)
}

/// The counts of the queue named `queue` on `conn` (`None` when it does not exist), through a
/// channel of its own.
pub async fn queue_counts_on(
    conn: &Connection,
    queue: &str,
) -> Result<Option<QueueCounts>, lapin::Error> {
    let channel = conn.create_channel().await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
    {
        Ok(q) => {
            let _ = channel.close(200, "counts read".into()).await;
            Ok(Some(QueueCounts {
                depth: q.message_count(),
                consumers: q.consumer_count(),
            }))
        }
        // The broker closed the channel with its answer.
        Err(e) if reply_code(&e) == Some(AMQPSoftError::NOTFOUND.get_id()) => Ok(None),
        Err(e) => Err(e),
    }
}
