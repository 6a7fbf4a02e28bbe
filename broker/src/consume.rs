//! Taking messages: a [`Delivery`] decoded once (its body, the AMQP facts and the drumline
//! headers a worker reads, its [`Acker`]), a queue's [`Consumer`] ([`consume`], [`qos`],
//! [`cancel`]), one message at a time ([`get`]), and [`purge`].

use super::amqp::{header_int, header_str, header_trace};
use super::publish::settled;
use super::{BrokerError, Channel};
use drumline_core::envelope::{H_ATTEMPTS, H_EPOCH, H_ERROR, H_REASON, H_TASK};
use futures_util::Stream;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions,
    BasicQosOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use std::pin::Pin;
use std::task::{Context, Poll};

/// One message as the broker delivered it, its headers read once.
#[derive(Debug)]
pub struct Delivery {
    /// The body, as published.
    pub body: Vec<u8>,
    /// The delivery tag: consecutive on its channel, from 1.
    pub tag: u64,
    /// The routing key it was published with (a work queue's name for copies sent straight to
    /// it).
    pub routing_key: String,
    /// Delivered before and not acked (the broker's `redelivered` flag).
    pub redelivered: bool,
    /// The AMQP `message_id` (drumline's: the instance's key).
    pub message_id: Option<String>,
    /// The AMQP timestamp, in whole seconds since the epoch.
    pub timestamp: Option<u64>,
    /// The leadership epoch it was published under (`x-drumline-epoch`; 0 when absent).
    pub epoch: u64,
    /// `x-drumline-task`.
    pub task: Option<String>,
    /// `traceparent`, when valid (docs/envelope.md#trace-context).
    pub trace: Option<drumline_core::trace::TraceParent>,
    /// `x-drumline-reason`: set on the dead letters a worker writes.
    pub reason: Option<String>,
    /// `x-drumline-error`: a dead letter's last error.
    pub error: Option<String>,
    /// `x-drumline-attempts`: a dead letter's runs made.
    pub attempts: Option<i64>,
    /// The broker's latest dead-lettering (`x-death`), if it dead-lettered the message.
    pub death: Option<Death>,
    /// The broker dead-lettered it because it expired in a queue, and no worker wrote it
    /// ([`expired_by_broker`]).
    pub expired_by_broker: bool,
    /// Settles it.
    pub acker: Acker,
    /// Kept whole for its dead letter ([`Delivery::properties`]).
    properties: BasicProperties,
}

/// The broker's latest dead-lettering of a message: its first `x-death` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Death {
    /// `expired`, `rejected`, `delivery_limit`, …
    pub reason: Option<String>,
    /// When, in whole seconds since the epoch.
    pub time: Option<u64>,
}

impl Delivery {
    /// Its AMQP properties as they came: a dead letter of it keeps them
    /// ([`dead_letter_properties`](crate::dead_letter_properties)).
    pub fn properties(&self) -> &BasicProperties {
        &self.properties
    }
}

impl From<lapin::message::Delivery> for Delivery {
    fn from(d: lapin::message::Delivery) -> Self {
        let props = d.properties;
        let headers = props.headers().as_ref();
        Delivery {
            tag: d.delivery_tag,
            routing_key: d.routing_key.to_string(),
            redelivered: d.redelivered,
            message_id: props.message_id().as_ref().map(|m| m.to_string()),
            timestamp: *props.timestamp(),
            epoch: header_int(headers, H_EPOCH).map_or(0, |e| e.max(0) as u64),
            task: header_str(headers, H_TASK),
            trace: header_trace(headers),
            reason: header_str(headers, H_REASON),
            error: header_str(headers, H_ERROR),
            attempts: header_int(headers, H_ATTEMPTS),
            death: first_death(headers),
            expired_by_broker: expired_by_broker(headers),
            acker: Acker(d.acker),
            body: d.data,
            properties: props,
        }
    }
}

/// The right to settle one delivery; cloned, each clone settles the same one.
#[derive(Debug, Clone)]
pub struct Acker(lapin::Acker);

impl Acker {
    /// Acks the delivery; with `multiple`, every unacked delivery of its channel up to it.
    /// Sent, or an error: lapin's "not sent" (a closed channel, settled already) is one.
    pub async fn ack(&self, multiple: bool) -> Result<(), BrokerError> {
        Ok(settled(self.0.ack(BasicAckOptions { multiple }).await)?)
    }

    /// Hands the delivery back to its queue (`basic.nack`, requeue).
    pub async fn requeue(&self) -> Result<(), BrokerError> {
        let requeue = BasicNackOptions {
            requeue: true,
            ..Default::default()
        };
        Ok(settled(self.0.nack(requeue).await)?)
    }
}

/// The deliveries of one consumer, decoded; it ends when the broker cancels the consumer or
/// its channel closes.
pub struct Consumer(lapin::Consumer);

impl Stream for Consumer {
    type Item = Result<Delivery, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.0)
            .poll_next(cx)
            .map(|next| next.map(|d| d.map(Delivery::from).map_err(BrokerError::from)))
    }
}

/// Consumes `queue` on `channel` with manual acks, as consumer `tag`.
pub async fn consume(channel: &Channel, queue: &str, tag: &str) -> Result<Consumer, BrokerError> {
    let consumer = channel
        .basic_consume(
            queue.into(),
            tag.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(Consumer(consumer))
}

/// At most `prefetch` unacked deliveries per consumer of `channel` (`global = false`: quorum
/// queues refuse a channel-wide prefetch), bounded by the connect timeout.
pub async fn qos(channel: &Channel, prefetch: u16) -> Result<(), BrokerError> {
    let qos = channel.basic_qos(prefetch, BasicQosOptions { global: false });
    super::bounded("basic.qos", qos).await
}

/// Cancels consumer `tag` on `channel`.
pub async fn cancel(channel: &Channel, tag: &str) -> Result<(), BrokerError> {
    let options = BasicCancelOptions::default();
    Ok(channel.basic_cancel(tag.into(), options).await?)
}

/// The next message of `queue`, left unacked on `channel` (`basic.get`), if any.
pub async fn get(channel: &Channel, queue: &str) -> Result<Option<Delivery>, BrokerError> {
    let options = BasicGetOptions { no_ack: false };
    let got = channel.basic_get(queue.into(), options).await?;
    Ok(got.map(|m| Delivery::from(m.delivery)))
}

/// Empties `queue`; how many messages it removed.
pub async fn purge(channel: &Channel, queue: &str) -> Result<u32, BrokerError> {
    let options = QueuePurgeOptions::default();
    Ok(channel.queue_purge(queue.into(), options).await?)
}

/// The first table of the `x-death` array, if any.
fn first_death(headers: Option<&FieldTable>) -> Option<Death> {
    let AMQPValue::FieldArray(deaths) = headers?.inner().get("x-death")? else {
        return None;
    };
    deaths.as_slice().iter().find_map(|d| match d {
        AMQPValue::FieldTable(t) => Some(Death {
            reason: header_str(Some(t), "reason"),
            time: match t.inner().get("time") {
                Some(AMQPValue::Timestamp(t)) => Some(*t),
                _ => None,
            },
        }),
        _ => None,
    })
}

/// Whether the broker dead-lettered this message because it expired: its latest death (the
/// first `x-death` entry) says `expired`, and no worker put it in `{ns}.dead` itself (those
/// carry `x-drumline-reason`).
pub fn expired_by_broker(headers: Option<&FieldTable>) -> bool {
    if header_str(headers, H_REASON).is_some() {
        return false;
    }
    let Some(AMQPValue::FieldArray(deaths)) = headers.and_then(|h| h.inner().get("x-death")) else {
        return false;
    };
    match deaths.as_slice().first() {
        Some(AMQPValue::FieldTable(death)) => {
            header_str(Some(death), "reason").as_deref() == Some("expired")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::long_string;
    use lapin::types::FieldArray;

    fn death(reason: &str) -> AMQPValue {
        let mut table = FieldTable::default();
        table.insert("reason".into(), long_string(reason));
        table.insert("queue".into(), long_string("ns.q.default"));
        table.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
        AMQPValue::FieldTable(table)
    }

    fn headers(deaths: Vec<AMQPValue>) -> FieldTable {
        let mut headers = FieldTable::default();
        headers.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(deaths)),
        );
        headers
    }

    #[test]
    fn only_the_brokers_latest_expiry_counts() {
        assert!(expired_by_broker(Some(&headers(vec![death("expired")]))));
        // A retry copy expired in its delay queue first, then died otherwise.
        let later = headers(vec![death("delivery_limit"), death("expired")]);
        assert!(!expired_by_broker(Some(&later)));
        assert!(!expired_by_broker(Some(&headers(vec![]))));
        assert!(!expired_by_broker(Some(&FieldTable::default())));
        assert!(!expired_by_broker(None));
        // Written by a worker (whatever it carried before): recorded already.
        let mut ours = headers(vec![death("expired")]);
        ours.insert(H_REASON.into(), long_string("expired"));
        assert!(!expired_by_broker(Some(&ours)));
    }

    #[test]
    fn a_delivery_is_decoded_once() {
        let mut table = headers(vec![AMQPValue::LongLongInt(1), death("expired")]);
        table.insert(H_EPOCH.into(), AMQPValue::LongLongInt(4));
        table.insert(H_ATTEMPTS.into(), AMQPValue::LongInt(3));
        table.insert(H_TASK.into(), long_string("t"));
        let mut raw = lapin::message::Delivery::mock(9, "".into(), "ns.q.a".into(), true, vec![1]);
        raw.properties = BasicProperties::default()
            .with_message_id("k".into())
            .with_timestamp(17)
            .with_headers(table);
        let d = Delivery::from(raw);
        assert_eq!((d.tag, d.redelivered, d.body), (9, true, vec![1]));
        assert_eq!(d.routing_key, "ns.q.a");
        assert_eq!(
            (d.message_id.as_deref(), d.timestamp),
            (Some("k"), Some(17))
        );
        assert_eq!(
            (d.epoch, d.attempts, d.task.as_deref()),
            (4, Some(3), Some("t"))
        );
        assert_eq!((d.reason, d.error), (None, None));
        let death = d.death.expect("the first table of x-death");
        assert_eq!(death.reason.as_deref(), Some("expired"));
        assert_eq!(death.time, Some(1_700_000_000));
        // Its first entry is not the broker's expiry.
        assert!(!d.expired_by_broker);
        let plain = Delivery::from(lapin::message::Delivery::mock(
            1,
            "".into(),
            "q".into(),
            false,
            vec![],
        ));
        assert_eq!(
            (plain.epoch, plain.death, plain.expired_by_broker),
            (0, None, false)
        );
    }
}
