//! The one door to RabbitMQ (docs/design.md#rabbitmq): every connection, declaration, publish
//! and settle drumline makes goes through here.
//!
//! - `connect` — the nodes of `[broker] urls` in failover order, TLS with `[broker] ca_file`, a
//!   session (a connection, the topology declared, a confirm-mode channel).
//! - `declare` — the exchanges, work queues, dead-letter queue and delay queues (idempotent:
//!   declared at start and after every reconnect), and the dead-letter count.
//! - `publish` — one message or a whole batch with confirms and returns.
//! - `consume` — taking messages, each decoded once into a [`Delivery`], and settling them.
//!
//! Every broker call on the way to a session (a node's connection, each channel's opening,
//! `confirm.select`, each declaration) is bounded by [`CONNECT_TIMEOUT`]: a hung node accepts
//! TCP and then answers nothing, and while a cluster has not given up on one of its nodes, a
//! binding (a write of the cluster's metadata) waits for it. A reconnect, which declares what
//! this process declared before, therefore sends its bindings without awaiting them and goes on
//! when a declaration does not answer in time (docs/design.md#reconnecting-past-a-hung-node).
//!
//! # Map
//!
//! - `amqp.rs`: an envelope's AMQP properties and drumline headers (`properties`), a dead
//!   letter's (`dead_letter_properties`), and headers read back (`header_str`, `header_int`).
//! - `consume.rs`: taking messages: a `Delivery` decoded once (body, AMQP facts, drumline
//!   headers, the broker's `x-death`) with its `Acker` (ack, requeue); a queue's `Consumer`
//!   (`consume`, `qos`, `cancel`), `get`, `purge`. Touches: broker.
//! - `connect.rs`: connecting: `Nodes` (the failover order of `[broker] urls`, the connect
//!   timeout on every call), sessions with the topology declared, a re-declaration not awaited,
//!   channels closed in the background. Touches: broker.
//! - `declare.rs`: declaring the exchanges and queues of a namespace; a mismatch named by
//!   queue. Touches: broker.
//! - `counts.rs`: the broker's counts for `status`, the page and the gauges: the dead letters
//!   and each work queue's depth and consumers, by passive declares. Touches: broker.
//! - `publish.rs`: publishing with confirms: one message (`publish_confirmed`), or a batch
//!   (`publish_batch`, or `send_batch` then `Sending::confirms` with the batches in flight
//!   after it: all sent, then every confirm awaited, returns matched by message id across the
//!   batches in flight, a `may_send` check before each message so a deposed leader stops
//!   mid-batch). Touches: broker.

// Every public item is documented (docs/design.md#module-map): `cargo doc` is the reference.
#![warn(missing_docs)]

// The core's modules, under the paths this crate's code names them by.
#[cfg(feature = "config")]
use drumline_core::config;
use drumline_core::{names, tls, url};

mod amqp;
mod connect;
mod consume;
mod counts;
mod declare;
mod publish;

pub use amqp::{
    dead_letter_properties, header_int, header_str, header_trace, long_string, properties,
    DeadHeaders,
};
pub use connect::{close_later, connect_to, failover_order, Nodes};
/// Opened from a config file's `[broker]` (feature `config`, on by default).
#[cfg(feature = "config")]
pub use connect::{connect, connect_or_name, open_channel};
pub use consume::{
    cancel, consume, expired_by_broker, get, purge, qos, Acker, Consumer, Death, Delivery,
};
/// Read with a connection opened from a config file (feature `config`).
#[cfg(feature = "config")]
pub use counts::{dead_letter_count, queue_counts};
pub use counts::{dead_letter_count_on, queue_counts_on, QueueCounts};
pub use declare::{declare, declare_delay_queue, Declaration, QUORUM_DELIVERY_LIMIT};
/// The broker's connection and channel handles, as the door hands them out.
pub use lapin::{Channel, Connection};
pub use publish::{
    open_confirm_channel, publish_batch, publish_confirmed, send_batch, Outgoing, Sending,
    CONFIRM_DEADLINE,
};

use drumline_core::policy::QueueType;
use std::future::Future;
use std::time::Duration;

/// The connect timeout: how long one node may take to accept a connection (TCP, TLS, the AMQP
/// handshake) before the next node is tried, and how long any other broker call on the way to a
/// session may take (opening a channel, `confirm.select`, each declaration). A node that does
/// not answer must not hold up the failover.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a broker call failed, with the fix where we know it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BrokerError {
    /// The broker refused a queue whose arguments differ from an existing one (406): needs a
    /// human; the text says what to do.
    #[error("{}", declare::mismatch_text(.queue, .source, *.queue_type))]
    Mismatch {
        /// The queue.
        queue: String,
        /// The broker's answer.
        source: lapin::Error,
        /// The `[broker] queue_type` it was declared with.
        queue_type: QueueType,
    },
    /// No node of `[broker] urls` accepted a connection: names them (redacted) and the last
    /// node's reason.
    #[error("cannot connect to the broker at {nodes}: {reason}")]
    Unreachable {
        /// The nodes tried, redacted, comma-separated.
        nodes: String,
        /// The last node's failure, without lapin's `IO error:` prefix.
        reason: String,
    },
    /// Connection or channel failure, or any other answer of the broker.
    #[error("broker: {0}")]
    Amqp(#[from] lapin::Error),
    /// The broker did not answer `what` within [`CONNECT_TIMEOUT`].
    #[error("the broker did not answer {what} within {}s", CONNECT_TIMEOUT.as_secs())]
    Timeout {
        /// The call: `connection`, `channel.open`, `confirm.select`, `queue.declare`, …
        what: &'static str,
    },
    /// The broker nacked the message.
    #[error("the broker refused the message (nack)")]
    Nacked,
    /// Published `mandatory` and no queue is bound for the routing key.
    #[error("the message could not be routed (no queue bound for {0:?})")]
    Unroutable(String),
    /// The broker did not confirm within [`CONFIRM_DEADLINE`] (a resource alarm blocks the
    /// connection, or it hangs).
    #[error("the broker did not confirm within {}s", CONFIRM_DEADLINE.as_secs())]
    Unconfirmed,
    /// Not sent: the publisher withdrew the rest of its batch (for the beat: it stopped
    /// leading mid-batch).
    #[error("not sent: the publisher withdrew the rest of its batch")]
    Withdrawn,
}

impl BrokerError {
    /// The AMQP reply code the broker closed the channel with, if it did (406 for a mismatch).
    pub fn reply_code(&self) -> Option<u16> {
        match self {
            BrokerError::Mismatch { source, .. } | BrokerError::Amqp(source) => reply_code(source),
            _ => None,
        }
    }

    /// A call refused because its channel closed: `why` says how.
    pub fn channel_closed(why: &'static str) -> BrokerError {
        let closed = lapin::ErrorKind::InvalidChannelState(lapin::ChannelState::Closed, why);
        BrokerError::Amqp(closed.into())
    }

    /// A copy for a message that shares this failure (a batch cut short by it): the broker's
    /// error cloned, anything else as [`BrokerError::Withdrawn`].
    pub fn for_the_rest(&self) -> BrokerError {
        match self {
            BrokerError::Amqp(e) => BrokerError::Amqp(e.clone()),
            _ => BrokerError::Withdrawn,
        }
    }
}

/// `call` bounded by [`CONNECT_TIMEOUT`]; `what` names it in the error.
pub async fn bounded<T, E: Into<BrokerError>>(
    what: &'static str,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, BrokerError> {
    match tokio::time::timeout(CONNECT_TIMEOUT, call).await {
        Ok(answer) => answer.map_err(Into::into),
        Err(_) => Err(BrokerError::Timeout { what }),
    }
}

/// The reply code of the broker's channel or connection close behind `e`, if it was one.
pub fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

/// The reason behind a failed connection, as a person reads it: the socket's error without
/// lapin's `IO error:` prefix or the OS error number (`Connection refused`).
pub fn connect_reason(e: &lapin::Error) -> String {
    let text = match e.kind() {
        lapin::ErrorKind::IOError(io) => io.to_string(),
        _ => e.to_string(),
    };
    match text.find(" (os error ") {
        Some(at) if text.ends_with(')') => text[..at].to_owned(),
        _ => text,
    }
}

/// A lapin error for a failure lapin does not name (a bad URL, a TLS set-up, a settle not sent).
fn io_error(e: impl std::fmt::Display) -> lapin::Error {
    std::io::Error::other(e.to_string()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_connection_reads_as_the_socket_says_it() {
        let refused: lapin::Error = std::io::Error::from_raw_os_error(111).into();
        assert_eq!(connect_reason(&refused), "Connection refused");
        let e = BrokerError::Unreachable {
            nodes: "amqp://guest:***@127.0.0.1:1/".into(),
            reason: connect_reason(&refused),
        };
        assert_eq!(
            e.to_string(),
            "cannot connect to the broker at amqp://guest:***@127.0.0.1:1/: Connection refused"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_does_not_answer_is_abandoned_after_the_connect_timeout() {
        let started = tokio::time::Instant::now();
        let hung = std::future::pending::<Result<(), lapin::Error>>();
        let e = bounded("queue.bind", hung).await.unwrap_err();
        assert!(
            matches!(e, BrokerError::Timeout { what: "queue.bind" }),
            "{e}"
        );
        assert_eq!(started.elapsed(), CONNECT_TIMEOUT);
        assert_eq!(e.reply_code(), None);
        assert_eq!(
            e.to_string(),
            "the broker did not answer queue.bind within 5s"
        );
        let answered = bounded("queue.declare", async { Ok::<_, lapin::Error>(7) });
        assert_eq!(answered.await.unwrap(), 7);
    }
}
