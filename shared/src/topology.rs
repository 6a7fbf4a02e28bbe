//! Declaring drumline's exchanges and queues (DESIGN §3). Declarations are idempotent, so the
//! beat and every worker declare what they use at start and after every reconnect.

use crate::config::Config;
use crate::names::Names;
use crate::tls::read_ca_file;
use lapin::options::BasicPublishOptions;
use lapin::options::ConfirmSelectOptions;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::protocol::AMQPSoftError;
use lapin::publisher_confirm::Confirmation;
use lapin::tcp::{RustlsConnector, RustlsConnectorConfig, TcpStream};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How long an idle delay queue outlives its last message's TTL before the broker deletes it.
const DELAY_QUEUE_IDLE: Duration = Duration::from_secs(60);

/// Why declaring failed, with the fix where we know it.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// The broker refused a queue whose arguments differ from an existing one.
    #[error("queue {queue} exists with different arguments ({source}); delete it in the management UI or with `rabbitmqadmin delete queue name={queue}` (it holds the messages listed there), then start again")]
    Mismatch {
        /// The queue.
        queue: String,
        /// The broker's answer.
        source: lapin::Error,
    },
    /// Anything else from the broker.
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
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

/// Declares the work exchange, the dead-letter exchange and queue (`dead_ttl`), and the work
/// queues `{ns}.q.{queue}` for `queues`, bound by routing key.
///
/// A changed argument (say `dead_ttl`) closes the channel with PRECONDITION_FAILED; callers must
/// then use a fresh channel. The error says how to fix it.
pub async fn declare(
    channel: &Channel,
    names: &Names,
    queues: &[String],
    dead_ttl: Duration,
) -> Result<(), TopologyError> {
    channel
        .exchange_declare(
            &names.tasks_exchange(),
            ExchangeKind::Direct,
            exchange_options(),
            FieldTable::default(),
        )
        .await?;
    channel
        .exchange_declare(
            &names.dead(),
            ExchangeKind::Fanout,
            exchange_options(),
            FieldTable::default(),
        )
        .await?;
    let mut dead_args = FieldTable::default();
    dead_args.insert(
        "x-message-ttl".into(),
        AMQPValue::LongLongInt(dead_ttl.as_millis() as i64),
    );
    let dead = names.dead();
    declare_bound(channel, &dead, dead_args, &dead, "").await?;
    for queue in queues {
        let mut args = FieldTable::default();
        args.insert("x-dead-letter-exchange".into(), string(&dead));
        let name = names.work_queue(queue);
        declare_bound(channel, &name, args, &names.tasks_exchange(), queue).await?;
    }
    Ok(())
}

/// Declares the durable queue `queue` with `args` and binds it to `exchange` by `routing_key`.
async fn declare_bound(
    channel: &Channel,
    queue: &str,
    args: FieldTable,
    exchange: &str,
    routing_key: &str,
) -> Result<(), TopologyError> {
    channel
        .queue_declare(queue, durable(), args)
        .await
        .map_err(|source| mismatch(queue, source))?;
    channel
        .queue_bind(
            queue,
            exchange,
            routing_key,
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(())
}

/// The reply code of the broker's channel or connection close behind `e`, if it was one.
pub fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e {
        lapin::Error::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

impl TopologyError {
    /// The AMQP reply code the broker closed the channel with, if it did (406 for a mismatch).
    pub fn reply_code(&self) -> Option<u16> {
        match self {
            TopologyError::Mismatch { source, .. } | TopologyError::Amqp(source) => {
                reply_code(source)
            }
        }
    }
}

/// A declare refused with 406 PRECONDITION_FAILED is a queue redeclared with other arguments.
fn mismatch(queue: &str, source: lapin::Error) -> TopologyError {
    if reply_code(&source) == Some(AMQPSoftError::PRECONDITIONFAILED.get_id()) {
        TopologyError::Mismatch {
            queue: queue.to_owned(),
            source,
        }
    } else {
        TopologyError::Amqp(source)
    }
}

/// Connects to `config`'s broker: `[broker] url`, and for `amqps://` the `[broker] ca_file`
/// roots (the system roots when unset). Every broker connection drumline makes goes through here.
pub async fn connect(config: &Config) -> Result<Connection, lapin::Error> {
    connect_to(&config.broker_url, config.broker_ca_file.as_deref()).await
}

/// Connects to `url`; with `ca_file` an `amqps://` server must present a certificate issued by a
/// CA in that file (and only then: the system roots are not consulted). `ca_file` is unused by
/// plain `amqp://`.
// The closure's error type is lapin's (`HandshakeResult`), large but not ours to choose.
#[allow(clippy::result_large_err)]
pub async fn connect_to(url: &str, ca_file: Option<&Path>) -> Result<Connection, lapin::Error> {
    let Some(ca_file) = ca_file else {
        return Connection::connect(url, ConnectionProperties::default()).await;
    };
    let uri: AMQPUri = url.parse().map_err(|e: String| io_error(e))?;
    if uri.scheme == AMQPScheme::AMQP {
        return Connection::connect_uri(uri, ConnectionProperties::default()).await;
    }
    let ca = read_ca_file(ca_file).map_err(io_error)?;
    let mut roots = RustlsConnectorConfig::default();
    roots.add_parsable_certificates(ca.certs);
    let connector: RustlsConnector = roots.connector_with_no_client_auth();
    // What lapin's own connector does (amq-protocol-tcp), with our roots instead of the system's.
    let connect = Box::new(move |uri: &AMQPUri| {
        let addr = format!("{}:{}", uri.authority.host, uri.authority.port);
        let stream = match uri.query.connection_timeout {
            Some(ms) => TcpStream::connect_timeout(addr, Duration::from_millis(ms)),
            None => TcpStream::connect(addr),
        }?;
        let stream = stream.into_rustls(&connector, &uri.authority.host)?;
        stream.set_nonblocking(true)?;
        Ok(stream)
    });
    Connection::connector(uri, connect, ConnectionProperties::default()).await
}

fn io_error(e: impl std::fmt::Display) -> lapin::Error {
    lapin::Error::IOError(Arc::new(std::io::Error::other(e.to_string())))
}

/// Connects to `config`'s broker for a one-shot command (ad-hoc publish, dlq): one confirm-mode
/// channel, the topology for `queues` declared. Close the connection when done.
pub async fn open_channel(
    config: &Config,
    names: &Names,
    queues: &[String],
    dead_ttl: Duration,
) -> Result<(Connection, Channel), TopologyError> {
    let conn = connect(config).await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    declare(&channel, names, queues, dead_ttl).await?;
    Ok((conn, channel))
}

/// How many messages wait in the dead-letter queue `{ns}.dead` (for `status`), asked with a
/// passive declare: nothing is created or changed. A namespace whose dead-letter queue was
/// never declared holds none (0). Opens a connection of its own and closes it.
pub async fn dead_letter_count(config: &Config, names: &Names) -> Result<u64, lapin::Error> {
    let conn = connect(config).await?;
    let count = async {
        let channel = conn.create_channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        match channel
            .queue_declare(&names.dead(), passive, FieldTable::default())
            .await
        {
            Ok(queue) => Ok(u64::from(queue.message_count())),
            Err(e) if reply_code(&e) == Some(AMQPSoftError::NOTFOUND.get_id()) => Ok(0),
            Err(e) => Err(e),
        }
    }
    .await;
    let _ = conn.close(200, "status read").await;
    count
}

/// Declares (or refreshes) the delay queue for `delay` on `queue` and returns its name. Every
/// message in it waits exactly `delay`, then dead-letters to `{ns}.tasks` with routing key
/// `queue`. The queue deletes itself once idle for `delay` + 60 s.
pub async fn declare_delay_queue(
    channel: &Channel,
    names: &Names,
    queue: &str,
    delay: Duration,
) -> Result<String, TopologyError> {
    let name = names.delay_queue(queue, delay);
    let ms = delay.as_millis().max(1) as i64;
    let mut args = FieldTable::default();
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
        .queue_declare(&name, durable(), args)
        .await
        .map_err(|source| mismatch(&name, source))?;
    Ok(name)
}

/// Why a publish was not confirmed.
#[derive(Debug, thiserror::Error)]
pub enum ConfirmError {
    /// Connection or channel failure.
    #[error("broker: {0}")]
    Amqp(#[from] lapin::Error),
    /// The broker nacked the message.
    #[error("the broker refused the message (nack)")]
    Nacked,
    /// `mandatory` and no queue was bound for the routing key.
    #[error("the message could not be routed (no queue bound for {0:?})")]
    Unroutable(String),
}

/// Publishes on a confirm-mode channel and waits for the broker's confirm. With `mandatory`, an
/// unroutable message is an error. (On a channel shared by concurrent publishers lapin may
/// attach a returned message to another publish's confirm; callers that publish concurrently
/// either route to queues they just declared without `mandatory`, or match returns by message
/// id as the beat's batch publisher does.)
pub async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    mandatory: bool,
    body: &[u8],
    props: BasicProperties,
) -> Result<(), ConfirmError> {
    let options = BasicPublishOptions {
        mandatory,
        ..Default::default()
    };
    let confirmation = channel
        .basic_publish(exchange, routing_key, options, body, props)
        .await?
        .await?;
    match confirmation {
        Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
        Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)) => {
            Err(ConfirmError::Unroutable(routing_key.to_owned()))
        }
        Confirmation::Nack(None) => Err(ConfirmError::Nacked),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::{AMQPError, AMQPErrorKind};

    fn closed(kind: AMQPSoftError) -> lapin::Error {
        lapin::Error::ProtocolError(AMQPError::new(AMQPErrorKind::Soft(kind), "closed".into()))
    }

    #[test]
    fn only_precondition_failed_is_a_mismatch() {
        let e = mismatch("q", closed(AMQPSoftError::PRECONDITIONFAILED));
        assert!(matches!(e, TopologyError::Mismatch { .. }), "{e}");
        assert_eq!(e.reply_code(), Some(406));
        let e = mismatch("q", closed(AMQPSoftError::ACCESSREFUSED));
        assert!(matches!(e, TopologyError::Amqp(_)), "{e}");
        assert_eq!(e.reply_code(), Some(403));
        let e = mismatch("q", lapin::Error::ChannelsLimitReached);
        assert!(matches!(e, TopologyError::Amqp(_)) && e.reply_code().is_none());
    }
}
