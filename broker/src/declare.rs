//! Declaring drumline's exchanges and queues (docs/design.md#rabbitmq). Declarations are
//! idempotent, so the beat and every worker declare what they use at start and after every
//! reconnect; a reconnect sends its bindings without awaiting them
//! (docs/design.md#reconnecting-past-a-hung-node).

use super::{bounded, reply_code, BrokerError};
use crate::names::Names;
use drumline_core::policy::QueueType;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::protocol::AMQPSoftError;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, ExchangeKind};
use std::time::Duration;

/// How long an idle delay queue outlives its last message's TTL before the broker deletes it.
const DELAY_QUEUE_IDLE: Duration = Duration::from_secs(60);

/// `x-delivery-limit` of quorum work queues. Every return of a message to its queue counts as
/// a delivery, and the worker returns messages on purpose when it fails closed (Redis down, a
/// lost lease, shutdown): past the limit the broker would dead-letter a message that never ran.
/// RabbitMQ 4 defaults the limit to 20 when none is set (3.10 has none), which repeated lease
/// losses or a flapping Redis can reach; a million is beyond any outage. Not `-1`: 4.x reads it
/// as "no limit", but 3.10 takes it literally and drops the message at its first return
/// (checked on 3.10.8). Changing this value makes every existing quorum work queue refuse the
/// declare (406), so it never changes.
pub const QUORUM_DELIVERY_LIMIT: i32 = 1_000_000;

/// What a process declares: the dead-letter queue, its watch queue and the dead-letter
/// exchange, the work queues for `queues`
/// and the tasks exchange, with their bindings (see [`declare`]).
#[derive(Debug, Clone, Copy)]
pub struct Declaration<'a> {
    /// The namespace's names.
    pub names: &'a Names,
    /// The logical queues (`{ns}.q.{queue}`).
    pub queues: &'a [String],
    /// `x-message-ttl` of the dead-letter queue.
    pub dead_ttl: Duration,
    /// `[broker] queue_type`.
    pub queue_type: QueueType,
}

/// How a declaration sends its bindings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Bindings {
    /// Each awaited (bounded): the first declaration, after which the topology must exist.
    Awaited,
    /// Sent with `nowait`, not awaited: a re-declaration, where they exist already. The
    /// broker's channel may sit on them until the cluster gives up on a hung node, so the
    /// channel they were sent on is used for nothing else.
    Sent,
}

/// The fix for a refused declare: a changed `queue_type` has its own (the broker names
/// `x-queue-type` in its answer), any other changed argument the generic one.
pub(super) fn mismatch_text(queue: &str, source: &lapin::Error, wanted: QueueType) -> String {
    if source.to_string().contains("x-queue-type") {
        let other = match wanted {
            QueueType::Classic => QueueType::Quorum,
            QueueType::Quorum => QueueType::Classic,
        };
        return format!(
            "queue {queue} exists as a {other} queue but `[broker] queue_type` is \"{wanted}\" \
             ({source}); a queue cannot change type in place, and nothing past it was declared. To \
             migrate, either drain the namespace (stop the beats, let the workers empty its work \
             queues, stop them, deal with its dead letters) and delete its queues (this one with \
             `rabbitmqctl delete_queue {queue}`, then each work queue, the `.dead` and the \
             `.dead.watch` queues likewise), then start again; or set a new `namespace` for \
             queue_type = \"{wanted}\" and retire the old one once drained. Or set queue_type = \
             \"{other}\" back"
        );
    }
    format!(
        "queue {queue} exists with different arguments ({source}); delete it in the management \
         UI or with `rabbitmqadmin delete queue name={queue}` (it holds the messages listed \
         there), then start again"
    )
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

fn exchange_options() -> ExchangeDeclareOptions {
    ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

fn string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// Declares the dead-letter queue and its watch queue `{ns}.dead.watch` (both `dead_ttl`) and
/// the work queues `{ns}.q.{queue}` for `queues`, as `queue_type`, then the work and
/// dead-letter exchanges and the bindings.
///
/// Queues first, the dead-letter queue first of all: it exists in every namespace that ever
/// ran, with the type of the work queues, so a changed `queue_type` is refused (406) by the
/// very first declare, before anything is created. A changed argument (say `dead_ttl`) closes
/// the channel with PRECONDITION_FAILED; callers must then use a fresh channel. The error says
/// how to fix it.
pub async fn declare(
    channel: &Channel,
    names: &Names,
    queues: &[String],
    dead_ttl: Duration,
    queue_type: QueueType,
) -> Result<(), BrokerError> {
    let what = Declaration {
        names,
        queues,
        dead_ttl,
        queue_type,
    };
    declare_with(channel, &what, Bindings::Awaited).await
}

/// [`declare`], every call bounded by [`CONNECT_TIMEOUT`], the bindings as `bindings` says.
pub(super) async fn declare_with(
    channel: &Channel,
    what: &Declaration<'_>,
    bindings: Bindings,
) -> Result<(), BrokerError> {
    let (names, queue_type) = (what.names, what.queue_type);
    let dead = names.dead();
    let mut dead_args = typed(queue_type);
    dead_args.insert(
        "x-message-ttl".into(),
        AMQPValue::LongLongInt(what.dead_ttl.as_millis() as i64),
    );
    declare_queue(channel, &dead, dead_args.clone(), queue_type).await?;
    // The watch queue gets a copy of every dead letter, kept as long, so it never grows
    // without bound while no worker consumes it (docs/design.md#rabbitmq).
    let mut watch_args = dead_args;
    delivery_limit(&mut watch_args, queue_type);
    declare_queue(channel, &names.dead_watch(), watch_args, queue_type).await?;
    for queue in what.queues {
        let mut args = typed(queue_type);
        args.insert("x-dead-letter-exchange".into(), string(&dead));
        delivery_limit(&mut args, queue_type);
        declare_queue(channel, &names.work_queue(queue), args, queue_type).await?;
    }
    let exchanges = [
        (names.tasks_exchange(), ExchangeKind::Direct),
        (dead.clone(), ExchangeKind::Fanout),
    ];
    for (exchange, kind) in exchanges {
        let declared = channel.exchange_declare(
            exchange.as_str().into(),
            kind,
            exchange_options(),
            FieldTable::default(),
        );
        bounded("exchange.declare", declared).await?;
    }
    bind(channel, &dead, &dead, "", bindings).await?;
    bind(channel, &names.dead_watch(), &dead, "", bindings).await?;
    for queue in what.queues {
        let work = names.work_queue(queue);
        bind(channel, &work, &names.tasks_exchange(), queue, bindings).await?;
    }
    Ok(())
}

/// Queue arguments holding `x-queue-type`, always explicit: a classic queue declared without
/// it before is equivalent (3.10 and 4.x accept `classic` on it), and a quorum queue asked for
/// as classic is then refused on 4.x too, which accepts a declare without the argument for any
/// existing type.
fn typed(queue_type: QueueType) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), string(queue_type.as_str()));
    args
}

/// Adds [`QUORUM_DELIVERY_LIMIT`] to a quorum queue's `args`: a queue the worker returns
/// messages to on purpose.
fn delivery_limit(args: &mut FieldTable, queue_type: QueueType) {
    if queue_type == QueueType::Quorum {
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongInt(QUORUM_DELIVERY_LIMIT),
        );
    }
}

/// Declares the durable queue `queue` with `args` (`queue_type` names the type asked for, for
/// the error).
async fn declare_queue(
    channel: &Channel,
    queue: &str,
    args: FieldTable,
    queue_type: QueueType,
) -> Result<(), BrokerError> {
    let declared = async {
        channel
            .queue_declare(queue.into(), durable(), args)
            .await
            .map_err(|source| mismatch(queue, source, queue_type))
    };
    bounded("queue.declare", declared).await?;
    Ok(())
}

/// Binds `queue` to `exchange` by `routing_key`, as `bindings` says.
async fn bind(
    channel: &Channel,
    queue: &str,
    exchange: &str,
    routing_key: &str,
    bindings: Bindings,
) -> Result<(), BrokerError> {
    let options = QueueBindOptions {
        nowait: bindings == Bindings::Sent,
    };
    let bound = channel.queue_bind(
        queue.into(),
        exchange.into(),
        routing_key.into(),
        options,
        FieldTable::default(),
    );
    bounded("queue.bind", bound).await?;
    Ok(())
}

/// A declare refused with 406 PRECONDITION_FAILED is a queue redeclared with other arguments.
fn mismatch(queue: &str, source: lapin::Error, queue_type: QueueType) -> BrokerError {
    if reply_code(&source) == Some(AMQPSoftError::PRECONDITIONFAILED.get_id()) {
        BrokerError::Mismatch {
            queue: queue.to_owned(),
            source,
            queue_type,
        }
    } else {
        BrokerError::Amqp(source)
    }
}

/// Declares (or refreshes) the delay queue for `delay` on `queue` and returns its name. Every
/// message in it waits exactly `delay`, then dead-letters to `{ns}.tasks` with routing key
/// `queue`. The queue deletes itself once idle for `delay` + 60 s.
pub async fn declare_delay_queue(
    channel: &Channel,
    names: &Names,
    queue: &str,
    delay: Duration,
) -> Result<String, BrokerError> {
    let name = names.delay_queue(queue, delay);
    let ms = delay.as_millis().max(1) as i64;
    // Classic whatever `[broker] queue_type` says: quorum queues do not renew `x-expires` on
    // re-declaration, and a delay queue must expire once idle (docs/design.md).
    let mut args = typed(QueueType::Classic);
    args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ms));
    args.insert(
        "x-expires".into(),
        AMQPValue::LongLongInt(ms + DELAY_QUEUE_IDLE.as_millis() as i64),
    );
    args.insert(
        "x-dead-letter-exchange".into(),
        string(&names.tasks_exchange()),
    );
    args.insert("x-dead-letter-routing-key".into(), string(queue));
    channel
        .queue_declare(name.as_str().into(), durable(), args)
        .await
        .map_err(|source| mismatch(&name, source, QueueType::Classic))?;
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::{AMQPError, AMQPErrorKind};

    fn closed(kind: AMQPSoftError) -> lapin::Error {
        lapin::ErrorKind::ProtocolError(AMQPError::new(AMQPErrorKind::Soft(kind), "closed".into()))
            .into()
    }

    #[test]
    fn only_precondition_failed_is_a_mismatch() {
        let classic = QueueType::Classic;
        let e = mismatch("q", closed(AMQPSoftError::PRECONDITIONFAILED), classic);
        assert!(matches!(e, BrokerError::Mismatch { .. }), "{e}");
        assert_eq!(e.reply_code(), Some(406));
        assert!(!e.to_string().contains("queue_type"), "{e}");
        let e = mismatch("q", closed(AMQPSoftError::ACCESSREFUSED), classic);
        assert!(matches!(e, BrokerError::Amqp(_)), "{e}");
        assert_eq!(e.reply_code(), Some(403));
        let e = mismatch("q", lapin::ErrorKind::ChannelsLimitReached.into(), classic);
        assert!(matches!(e, BrokerError::Amqp(_)) && e.reply_code().is_none());
    }

    #[test]
    fn a_changed_queue_type_names_the_key_and_the_migration() {
        let refused = lapin::ErrorKind::ProtocolError(AMQPError::new(
            AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED),
            "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'n.dead'".into(),
        ))
        .into();
        let e = mismatch("n.dead", refused, QueueType::Quorum).to_string();
        for needle in [
            "exists as a classic queue",
            "`[broker] queue_type` is \"quorum\"",
            "drain",
            "rabbitmqctl delete_queue n.dead",
            "new `namespace`",
        ] {
            assert!(e.contains(needle), "{needle:?} not in {e}");
        }
    }
}
