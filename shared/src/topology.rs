//! Declaring drumline's exchanges and queues (docs/design.md). Declarations are idempotent, so the
//! beat and every worker declare what they use at start and after every reconnect.
//!
//! Every broker call on the way to a session (a node's connection, each channel's opening,
//! `confirm.select`, each declaration) is bounded by [`CONNECT_TIMEOUT`]: a hung node accepts
//! TCP and then answers nothing, and while a cluster has not given up on one of its nodes, a
//! binding (a write of the cluster's metadata) waits for it. A reconnect, which declares what
//! this process declared before, therefore sends its bindings without awaiting them and goes on
//! when a declaration does not answer in time (docs/design.md#reconnecting-past-a-hung-node).

use crate::config::{Config, QueueType};
use crate::names::Names;
use crate::tls::read_ca_file;
use crate::url::Redacted;
use async_rs::TokioRuntime;
use lapin::options::BasicPublishOptions;
use lapin::options::ConfirmSelectOptions;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::protocol::AMQPSoftError;
use lapin::tcp::{AsyncTcpStream, RustlsConnectorConfig};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::Confirmation;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{info, warn};

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

/// The connect timeout: how long one node may take to accept a connection (TCP, TLS, the AMQP
/// handshake) before the next node is tried, and how long any other broker call on the way to a
/// session may take (opening a channel, `confirm.select`, each declaration). A node that does
/// not answer must not hold up the failover.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why declaring failed, with the fix where we know it.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// The broker refused a queue whose arguments differ from an existing one (406).
    #[error("{}", mismatch_text(.queue, .source, *.queue_type))]
    Mismatch {
        /// The queue.
        queue: String,
        /// The broker's answer.
        source: lapin::Error,
        /// The `[broker] queue_type` it was declared with.
        queue_type: QueueType,
    },
    /// Anything else from the broker.
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
    /// The broker did not answer `what` within [`CONNECT_TIMEOUT`].
    #[error("the broker did not answer {what} within {}s", CONNECT_TIMEOUT.as_secs())]
    Timeout {
        /// The call: `connection`, `channel.open`, `confirm.select`, `queue.declare`, …
        what: &'static str,
    },
}

/// `call` bounded by [`CONNECT_TIMEOUT`]; `what` names it in the error.
pub async fn bounded<T, E: Into<TopologyError>>(
    what: &'static str,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, TopologyError> {
    match tokio::time::timeout(CONNECT_TIMEOUT, call).await {
        Ok(answer) => answer.map_err(Into::into),
        Err(_) => Err(TopologyError::Timeout { what }),
    }
}

/// What a process declares: the dead-letter queue and exchange, the work queues for `queues`
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
enum Bindings {
    /// Each awaited (bounded): the first declaration, after which the topology must exist.
    Awaited,
    /// Sent with `nowait`, not awaited: a re-declaration, where they exist already. The
    /// broker's channel may sit on them until the cluster gives up on a hung node, so the
    /// channel they were sent on is used for nothing else.
    Sent,
}

/// The fix for a refused declare: a changed `queue_type` has its own (the broker names
/// `x-queue-type` in its answer), any other changed argument the generic one.
fn mismatch_text(queue: &str, source: &lapin::Error, wanted: QueueType) -> String {
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
             `rabbitmqctl delete_queue {queue}`, then each work queue and the `.dead` queue \
             likewise), then start again; or set a new `namespace` for queue_type = \"{wanted}\" \
             and retire the old one once drained. Or set queue_type = \"{other}\" back"
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

/// Declares the dead-letter queue (`dead_ttl`) and the work queues `{ns}.q.{queue}` for
/// `queues`, as `queue_type`, then the work and dead-letter exchanges and the bindings.
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
) -> Result<(), TopologyError> {
    let what = Declaration {
        names,
        queues,
        dead_ttl,
        queue_type,
    };
    declare_with(channel, &what, Bindings::Awaited).await
}

/// [`declare`], every call bounded by [`CONNECT_TIMEOUT`], the bindings as `bindings` says.
async fn declare_with(
    channel: &Channel,
    what: &Declaration<'_>,
    bindings: Bindings,
) -> Result<(), TopologyError> {
    let (names, queue_type) = (what.names, what.queue_type);
    let dead = names.dead();
    let mut dead_args = typed(queue_type);
    dead_args.insert(
        "x-message-ttl".into(),
        AMQPValue::LongLongInt(what.dead_ttl.as_millis() as i64),
    );
    declare_queue(channel, &dead, dead_args, queue_type).await?;
    for queue in what.queues {
        let mut args = typed(queue_type);
        args.insert("x-dead-letter-exchange".into(), string(&dead));
        if queue_type == QueueType::Quorum {
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongInt(QUORUM_DELIVERY_LIMIT),
            );
        }
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

/// Declares the durable queue `queue` with `args` (`queue_type` names the type asked for, for
/// the error).
async fn declare_queue(
    channel: &Channel,
    queue: &str,
    args: FieldTable,
    queue_type: QueueType,
) -> Result<(), TopologyError> {
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
) -> Result<(), TopologyError> {
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

/// The reply code of the broker's channel or connection close behind `e`, if it was one.
pub fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
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
            TopologyError::Timeout { .. } => None,
        }
    }
}

/// A declare refused with 406 PRECONDITION_FAILED is a queue redeclared with other arguments.
fn mismatch(queue: &str, source: lapin::Error, queue_type: QueueType) -> TopologyError {
    if reply_code(&source) == Some(AMQPSoftError::PRECONDITIONFAILED.get_id()) {
        TopologyError::Mismatch {
            queue: queue.to_owned(),
            source,
            queue_type,
        }
    } else {
        TopologyError::Amqp(source)
    }
}

/// Connects to `config`'s broker: the first of `[broker] urls` (or the one `url`) that answers,
/// with `[broker] ca_file` for `amqps://` (the system roots when unset). Every broker connection
/// drumline makes goes through here or through [`Nodes::connect`].
pub async fn connect(config: &Config) -> Result<Connection, lapin::Error> {
    Nodes::new(config).connect().await
}

/// The broker's nodes (`[broker] urls`), which one the last connection went to, so that a
/// reconnect after a lost connection tries the other nodes first (see [`failover_order`]), and
/// the work queues this process declared, so that a reconnect knows what exists already.
#[derive(Debug)]
pub struct Nodes {
    urls: Vec<String>,
    ca_file: Option<PathBuf>,
    last: Mutex<Option<usize>>,
    /// `None` until the first declaration of this process went through.
    declared: Mutex<Option<Vec<String>>>,
}

impl Nodes {
    /// `config`'s nodes; none connected yet.
    pub fn new(config: &Config) -> Self {
        Self {
            urls: config.broker.urls.clone(),
            ca_file: config.broker_ca_file.clone(),
            last: Mutex::new(None),
            declared: Mutex::new(None),
        }
    }

    /// Connects to the first node that answers within [`CONNECT_TIMEOUT`], in
    /// [`failover_order`] after the node of the last connection; `Err` is the last node's
    /// error once every node failed (one pass: the caller's backoff spaces the passes).
    pub async fn connect(&self) -> Result<Connection, lapin::Error> {
        let last = *lock(&self.last);
        let several = self.urls.len() > 1;
        let mut error = None;
        for i in failover_order(self.urls.len(), last) {
            let url = &self.urls[i];
            let attempt = connect_to(url, self.ca_file.as_deref());
            let result = tokio::time::timeout(CONNECT_TIMEOUT, attempt)
                .await
                .unwrap_or_else(|_| Err(io_error("the node did not answer in time")));
            match result {
                Ok(conn) => {
                    *lock(&self.last) = Some(i);
                    if several {
                        info!(broker = %Redacted(url), node = i + 1, "connected to broker node");
                    }
                    return Ok(conn);
                }
                Err(e) => {
                    if several {
                        warn!(broker = %Redacted(url), node = i + 1, error = %e, "broker node unreachable; trying the next");
                    }
                    error = Some(e);
                }
            }
        }
        Err(error.unwrap_or_else(|| io_error("no broker URL configured")))
    }

    /// A session: a connection ([`connect`](Self::connect)), `what` declared on a channel of
    /// its own, and a confirm-mode channel to publish on; every call bounded by
    /// [`CONNECT_TIMEOUT`].
    ///
    /// The first declaration of `what`'s queues awaits each binding, and fails the session
    /// when anything does not answer. A re-declaration (every queue of `what` was declared by
    /// this process before: a reconnect) sends the bindings without awaiting them, and a
    /// declaration that does not answer in time is logged and the session goes on: what it
    /// declares exists, and a hung node in the cluster must not stop the publishing
    /// (docs/design.md#reconnecting-past-a-hung-node). A refused declaration (406) fails it
    /// either way.
    pub async fn open_session(
        &self,
        what: &Declaration<'_>,
    ) -> Result<(Connection, Channel), TopologyError> {
        let conn = self.connect().await?;
        match self.declare_and_open(&conn, what).await {
            Ok(channel) => Ok((conn, channel)),
            Err(e) => {
                close_later(conn, "session not opened");
                Err(e)
            }
        }
    }

    async fn declare_and_open(
        &self,
        conn: &Connection,
        what: &Declaration<'_>,
    ) -> Result<Channel, TopologyError> {
        let again = {
            let declared = lock(&self.declared);
            declared
                .as_ref()
                .is_some_and(|done| what.queues.iter().all(|q| done.contains(q)))
        };
        let bindings = if again {
            Bindings::Sent
        } else {
            Bindings::Awaited
        };
        let declaring = bounded("channel.open", conn.create_channel()).await?;
        let declared = declare_with(&declaring, what, bindings).await;
        close_channel_later(declaring);
        match declared {
            Err(e @ TopologyError::Timeout { .. }) if again => {
                warn!(namespace = %what.names.namespace(), error = %e,
                    "re-declaring the topology did not finish (a hung node in the cluster?); \
                     it was declared before, so the session goes on");
            }
            Err(e) => return Err(e),
            Ok(()) => {
                let mut declared = lock(&self.declared);
                let declared = declared.get_or_insert_with(Vec::new);
                for queue in what.queues {
                    if !declared.contains(queue) {
                        declared.push(queue.clone());
                    }
                }
            }
        }
        let channel = bounded("channel.open", conn.create_channel()).await?;
        bounded(
            "confirm.select",
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        Ok(channel)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Closes `conn` in the background, waiting at most [`CONNECT_TIMEOUT`] for the broker's
/// answer (a hung node never gives one), so that the caller can reconnect at once.
pub fn close_later(conn: Connection, why: &'static str) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(CONNECT_TIMEOUT, conn.close(200, why.into())).await;
    });
}

/// Closes a channel used only to declare, in the background (it may still wait on bindings
/// sent without awaiting them).
fn close_channel_later(channel: Channel) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(CONNECT_TIMEOUT, channel.close(200, "declared".into())).await;
    });
}

/// The order in which `n` nodes are tried when the last connection went to node `last`: the
/// nodes after it first (it was lost, most likely with its node), itself last; from the first
/// node when there was none. `[a, b, c]` lost on `b` tries `c, a, b`.
pub fn failover_order(n: usize, last: Option<usize>) -> impl Iterator<Item = usize> {
    let start = last.map_or(0, |i| (i + 1) % n.max(1));
    (0..n).map(move |k| (start + k) % n)
}

/// Connects to `url`; with `ca_file` an `amqps://` server must present a certificate issued by a
/// CA in that file (and only then: the system roots are not consulted). `ca_file` is unused by
/// plain `amqp://`.
pub async fn connect_to(url: &str, ca_file: Option<&Path>) -> Result<Connection, lapin::Error> {
    let Some(ca_file) = ca_file else {
        return Connection::connect(url, ConnectionProperties::default()).await;
    };
    let uri: AMQPUri = url.parse().map_err(|e: String| io_error(e))?;
    if uri.scheme == AMQPScheme::AMQP {
        return Connection::connect_uri(uri, ConnectionProperties::default()).await;
    }
    let ca = read_ca_file(ca_file).map_err(io_error)?;
    // Not lapin's `OwnedTLSConfig::cert_chain`: that adds the file's CAs to the system roots.
    let mut roots = RustlsConnectorConfig::default();
    roots.add_parsable_certificates(ca.certs);
    let connector = Arc::new(roots.connector_with_no_client_auth().map_err(io_error)?);
    // What lapin's own connector does (amq-protocol-tcp), with our roots instead of the system's.
    let connect = async move |uri: AMQPUri, runtime: TokioRuntime| {
        let host = uri.authority.host.clone();
        let tls = async {
            let addrs: Vec<_> = tokio::net::lookup_host((host.as_str(), uri.authority.port))
                .await?
                .collect();
            AsyncTcpStream::connect(&runtime, addrs)
                .await?
                .into_rustls(&connector, &host)
                .await
        };
        let stream = match uri.query.connection_timeout {
            Some(ms) => tokio::time::timeout(Duration::from_millis(ms), tls)
                .await
                .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into())),
            None => tls.await,
        };
        stream.map_err(lapin::Error::from)
    };
    Connection::connector(
        uri,
        TokioRuntime::tokio_current(),
        connect,
        ConnectionProperties::default(),
    )
    .await
}

fn io_error(e: impl std::fmt::Display) -> lapin::Error {
    std::io::Error::other(e.to_string()).into()
}

/// Connects to `config`'s broker for a one-shot command (ad-hoc publish, dlq): one confirm-mode
/// channel, the topology for `queues` declared (see [`Nodes::open_session`]). Close the
/// connection when done.
pub async fn open_channel(
    config: &Config,
    names: &Names,
    queues: &[String],
    dead_ttl: Duration,
) -> Result<(Connection, Channel), TopologyError> {
    let what = Declaration {
        names,
        queues,
        dead_ttl,
        queue_type: config.broker.queue_type,
    };
    Nodes::new(config).open_session(&what).await
}

/// How many messages wait in the dead-letter queue `{ns}.dead` (for `status`), asked with a
/// passive declare: nothing is created or changed. A namespace whose dead-letter queue was
/// never declared holds none (0). Opens a connection of its own and closes it.
pub async fn dead_letter_count(config: &Config, names: &Names) -> Result<u64, lapin::Error> {
    let conn = connect(config).await?;
    let count = dead_letter_count_on(&conn, names).await;
    let _ = conn.close(200, "status read".into()).await;
    count
}

/// [`dead_letter_count`] on a connection the caller keeps (the beat's status page), through a
/// channel of its own that is closed afterwards.
pub async fn dead_letter_count_on(conn: &Connection, names: &Names) -> Result<u64, lapin::Error> {
    let channel = conn.create_channel().await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match channel
        .queue_declare(names.dead().into(), passive, FieldTable::default())
        .await
    {
        Ok(queue) => {
            let _ = channel.close(200, "status read".into()).await;
            Ok(u64::from(queue.message_count()))
        }
        // The broker closed the channel with its answer.
        Err(e) if reply_code(&e) == Some(AMQPSoftError::NOTFOUND.get_id()) => Ok(0),
        Err(e) => Err(e),
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
) -> Result<String, TopologyError> {
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

/// An ack, nack or reject's answer from lapin as a `Result`: lapin 4 answers `Ok(false)`, not
/// an error, when it did not send it (the delivery's channel is closed, or the delivery was
/// already settled); the broker then redelivers the message, so for the caller it failed.
pub fn settled(sent: Result<bool, lapin::Error>) -> Result<(), lapin::Error> {
    match sent {
        Ok(true) => Ok(()),
        Ok(false) => Err(io_error(
            "not sent: the delivery's channel is closed or the delivery was already settled",
        )),
        Err(e) => Err(e),
    }
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
        .basic_publish(exchange.into(), routing_key.into(), options, body, props)
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
        lapin::ErrorKind::ProtocolError(AMQPError::new(AMQPErrorKind::Soft(kind), "closed".into()))
            .into()
    }

    #[test]
    fn only_precondition_failed_is_a_mismatch() {
        let classic = QueueType::Classic;
        let e = mismatch("q", closed(AMQPSoftError::PRECONDITIONFAILED), classic);
        assert!(matches!(e, TopologyError::Mismatch { .. }), "{e}");
        assert_eq!(e.reply_code(), Some(406));
        assert!(!e.to_string().contains("queue_type"), "{e}");
        let e = mismatch("q", closed(AMQPSoftError::ACCESSREFUSED), classic);
        assert!(matches!(e, TopologyError::Amqp(_)), "{e}");
        assert_eq!(e.reply_code(), Some(403));
        let e = mismatch("q", lapin::ErrorKind::ChannelsLimitReached.into(), classic);
        assert!(matches!(e, TopologyError::Amqp(_)) && e.reply_code().is_none());
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

    #[tokio::test(start_paused = true)]
    async fn a_call_that_does_not_answer_is_abandoned_after_the_connect_timeout() {
        let started = tokio::time::Instant::now();
        let hung = std::future::pending::<Result<(), lapin::Error>>();
        let e = bounded("queue.bind", hung).await.unwrap_err();
        assert!(
            matches!(e, TopologyError::Timeout { what: "queue.bind" }),
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

    #[test]
    fn failover_starts_after_the_lost_node_and_tries_it_last() {
        let order = |n, last| failover_order(n, last).collect::<Vec<_>>();
        assert_eq!(order(3, None), [0, 1, 2]);
        assert_eq!(order(3, Some(0)), [1, 2, 0]);
        assert_eq!(order(3, Some(1)), [2, 0, 1]);
        assert_eq!(order(3, Some(2)), [0, 1, 2]);
        assert_eq!(order(1, None), [0]);
        assert_eq!(order(1, Some(0)), [0]);
        assert!(order(0, None).is_empty());
    }
}
