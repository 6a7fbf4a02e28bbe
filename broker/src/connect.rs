//! Connecting: the nodes of `[broker] urls` tried in failover order, each within the connect
//! timeout, TLS with `[broker] ca_file`, and a session (a connection, the topology declared, a
//! confirm-mode channel to publish on).

use super::declare::{declare_with, Bindings};
use super::{bounded, io_error, BrokerError, Declaration, CONNECT_TIMEOUT};
#[cfg(feature = "config")]
use crate::config::Config;
#[cfg(feature = "config")]
use crate::names::Names;
use crate::tls::read_ca_file;
use crate::url::Redacted;
use async_rs::TokioRuntime;
use lapin::options::ConfirmSelectOptions;
use lapin::tcp::{AsyncTcpStream, RustlsConnectorConfig};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Channel, Connection, ConnectionProperties};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{info, warn};

/// Connects to `config`'s broker: the first of `[broker] urls` (or the one `url`) that answers,
/// with `[broker] ca_file` for `amqps://` (the system roots when unset). Every broker connection
/// drumline makes goes through here or through [`Nodes::connect`].
#[cfg(feature = "config")]
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
    #[cfg(feature = "config")]
    pub fn new(config: &Config) -> Self {
        Self::from_urls(config.broker.urls.clone(), config.broker_ca_file.clone())
    }

    /// The nodes at `urls` (tried in this order first), with `ca_file`'s roots for `amqps://`
    /// (the system roots when `None`): for a program that has no config file, like the
    /// producer client (`drumline-client`).
    pub fn from_urls(urls: Vec<String>, ca_file: Option<PathBuf>) -> Self {
        Self {
            urls,
            ca_file,
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
    ) -> Result<(Connection, Channel), BrokerError> {
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
    ) -> Result<Channel, BrokerError> {
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
            Err(e @ BrokerError::Timeout { .. }) if again => {
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

/// Connects to `config`'s broker for a one-shot command (ad-hoc publish, dlq): one confirm-mode
/// channel, the topology for `queues` declared (see [`Nodes::open_session`]). Close the
/// connection when done.
#[cfg(feature = "config")]
pub async fn open_channel(
    config: &Config,
    names: &Names,
    queues: &[String],
    dead_ttl: Duration,
) -> Result<(Connection, Channel), BrokerError> {
    let what = Declaration {
        names,
        queues,
        dead_ttl,
        queue_type: config.broker.queue_type,
    };
    let nodes = Nodes::new(config);
    let conn = connect_or_name(config, &nodes).await?;
    match nodes.declare_and_open(&conn, &what).await {
        Ok(channel) => Ok((conn, channel)),
        Err(e) => {
            close_later(conn, "session not opened");
            Err(e)
        }
    }
}

/// A connection to one of `nodes` for a one-shot command; a failure names the broker's nodes
/// (redacted) and the reason ([`BrokerError::Unreachable`]).
#[cfg(feature = "config")]
pub async fn connect_or_name(config: &Config, nodes: &Nodes) -> Result<Connection, BrokerError> {
    nodes.connect().await.map_err(|e| BrokerError::Unreachable {
        nodes: config
            .broker
            .urls
            .iter()
            .map(|u| Redacted(u).to_string())
            .collect::<Vec<_>>()
            .join(", "),
        reason: super::connect_reason(&e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
