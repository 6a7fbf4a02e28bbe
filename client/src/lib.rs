//! The producer client: publish ad-hoc tasks from application code with a broker URL and a
//! namespace alone, no drumline config file (docs/envelope.md#from-rust). Every message is a
//! complete v1 envelope, published persistent with publisher confirms through the one broker
//! door (`drumline-broker`); `drumline-beat publish` and `trigger` publish through it too.
//!
//! ```no_run
//! # async fn demo() -> Result<(), drumline_client::ClientError> {
//! use drumline_client::{Message, Producer};
//! use std::time::Duration;
//!
//! let producer = Producer::connect("amqp://guest:guest@127.0.0.1:5672/%2f", "drumline").await?;
//! let published = producer
//!     .publish(
//!         &Message::new("resize")
//!             .args(serde_json::json!({ "image": "cat.png", "width": 640 }))
//!             .key("resize-cat-640")
//!             .delay(Duration::from_secs(30))
//!             .expires(Duration::from_secs(3600)),
//!     )
//!     .await?;
//! println!("published {}", published.key);
//! producer.close().await;
//! # Ok(()) }
//! ```
//!
//! A message is routed `mandatory`: when no queue is bound for its `queue` (no worker or beat
//! of the namespace ever declared it) the publish fails with [`BrokerError::Unroutable`]
//! rather than the message being dropped. [`ProducerBuilder::declare`] declares the topology
//! first instead, as the CLI does.
//!
//! # Map
//!
//! The feature `bin-support` (off by default) keeps clap, axum, tracing-subscriber and
//! prometheus-client's server side out of programs that embed the worker library. The beat
//! enables it; the worker enables it through its default feature `cli`, which also gates its
//! binary.
//!
//! - `lib.rs`: `Message`, `Producer`: ad-hoc tasks through the broker door. Touches: broker.
//! - `schedules.rs`: `Schedules`: schedules applied at run time through a beat's HTTP API
//!   (apply, get, list, delete). Touches: HTTP.

// Every public item is documented (docs/design.md#module-map): `cargo doc` is the reference.
#![warn(missing_docs)]

// The core's modules and the broker door, under the paths this crate's code names them by.
use drumline_broker as broker;
use drumline_core::{envelope, names};

use crate::broker::{BrokerError, Declaration, Nodes};
use crate::broker::{Channel, Connection};
use crate::envelope::Envelope;
use crate::names::{check_key, check_name, InvalidName, Names};
use chrono::{DateTime, Utc};
use drumline_core::policy::QueueType;
use serde::Serialize;
use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;
use tokio::sync::Mutex;

mod schedules;
pub use drumline_core::trace::TraceParent;
pub use schedules::{Applied, ScheduleError, Schedules};

/// Why a message was not published. [`ClientError::is_request`] tells a message that can
/// never be published (fix the call) from a broker failure (try again).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The task name breaks the name rule.
    #[error("task: {0}")]
    Task(InvalidName),
    /// The queue name breaks the name rule.
    #[error("queue: {0}")]
    Queue(InvalidName),
    /// The key breaks the key rule.
    #[error("key: {0}")]
    Key(InvalidName),
    /// The arguments did not serialise to JSON.
    #[error("args: {0}")]
    Args(#[source] serde_json::Error),
    /// The arguments are JSON but not an object (docs/envelope.schema.json).
    #[error("args: must be a JSON object, not {0}")]
    ArgsNotAnObject(&'static str),
    /// The delay or the expiry is too large to be an instant.
    #[error("{0}: too large")]
    TooLarge(&'static str),
    /// An expiry of zero: the message would be expired when published.
    #[error("expires: must be greater than zero")]
    ZeroExpiry,
    /// An `expires_at` not after the due instant: the message could never run.
    #[error("expires_at: must be after the instant the task is due (not_before)")]
    NeverDue,
    /// The producer was built without a broker URL.
    #[error("no broker URL given")]
    NoUrl,
    /// The broker could not be reached, refused the message, or did not confirm it.
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

impl ClientError {
    /// True when the message itself is wrong: publishing it again cannot succeed.
    pub fn is_request(&self) -> bool {
        !matches!(self, ClientError::Broker(_) | ClientError::NoUrl)
    }

    /// The message field a request error is about (`task`, `queue`, `key`, `args`, `delay`,
    /// `expires`, `expires_at`); `None` for a broker failure.
    pub fn field(&self) -> Option<&'static str> {
        Some(match self {
            ClientError::Task(_) => "task",
            ClientError::Queue(_) => "queue",
            ClientError::Key(_) => "key",
            ClientError::Args(_) | ClientError::ArgsNotAnObject(_) => "args",
            ClientError::TooLarge(what) => what,
            ClientError::ZeroExpiry => "expires",
            ClientError::NeverDue => "expires_at",
            ClientError::NoUrl | ClientError::Broker(_) => return None,
        })
    }
}

/// When a message is due: this long after publishing, or at an instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Due {
    In(Duration),
    At(DateTime<Utc>),
}

/// When a message expires: this long after it is due, or at an instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Deadline {
    After(Duration),
    At(DateTime<Utc>),
}

/// One ad-hoc task to publish: the task, its arguments, and when and where it runs.
/// Defaults: args `{}`, a fresh UUID key, queue `default`, due now, no expiry.
///
/// ```
/// use drumline_client::{ClientError, Message};
/// use std::time::Duration;
///
/// #[derive(serde::Serialize)]
/// struct Resize { image: &'static str, width: u32 }
///
/// let now = chrono::Utc::now();
/// let message = Message::new("resize")
///     .args(Resize { image: "cat.png", width: 640 })
///     .key("resize-cat-640")
///     .delay(Duration::from_secs(60));
/// let envelope = message.envelope(now)?;
/// assert_eq!(envelope.args["width"], 640);
/// assert_eq!(envelope.scheduled_for, now + chrono::Duration::seconds(60));
///
/// let refused = Message::new("resize").args([1, 2]).envelope(now).unwrap_err();
/// assert!(matches!(refused, ClientError::ArgsNotAnObject(_)) && refused.is_request());
/// # Ok::<(), ClientError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Message {
    task: String,
    args: Result<serde_json::Value, std::sync::Arc<serde_json::Error>>,
    key: Option<String>,
    queue: String,
    due: Due,
    expires: Option<Deadline>,
    trace: Option<TraceParent>,
}

impl Message {
    /// A message for `task` (a `[tasks.NAME]` of the workers that consume its queue).
    pub fn new(task: impl Into<String>) -> Self {
        Self {
            task: task.into(),
            args: Ok(serde_json::json!({})),
            key: None,
            queue: "default".to_owned(),
            due: Due::In(Duration::ZERO),
            expires: None,
            trace: None,
        }
    }

    /// The arguments: anything that serialises to a JSON object (a typed handler decodes
    /// them into its own type). Checked when the message is built or published.
    pub fn args(mut self, args: impl Serialize) -> Self {
        self.args = serde_json::to_value(args).map_err(std::sync::Arc::new);
        self
    }

    /// The idempotency key: at most one run succeeds per key. Default: a fresh UUID.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// The logical queue. Default `default`.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = queue.into();
        self
    }

    /// Due this long after publishing: it waits in a delay queue meanwhile, and carries the
    /// instant as `not_before`, so that no copy runs sooner. Default 0. Replaces
    /// [`Message::not_before`].
    pub fn delay(mut self, delay: Duration) -> Self {
        self.due = Due::In(delay);
        self
    }

    /// Not started before `at` (`not_before`; an instant past runs at once). Replaces
    /// [`Message::delay`].
    pub fn not_before(mut self, at: DateTime<Utc>) -> Self {
        self.due = Due::At(at);
        self
    }

    /// Must not run later than this long after it is due. Default: no deadline. Replaces
    /// [`Message::expires_at`].
    pub fn expires(mut self, expires: Duration) -> Self {
        self.expires = Some(Deadline::After(expires));
        self
    }

    /// Must not run after `at`, which must be later than the due instant. Replaces
    /// [`Message::expires`].
    pub fn expires_at(mut self, at: DateTime<Utc>) -> Self {
        self.expires = Some(Deadline::At(at));
        self
    }

    /// The publish's span (docs/envelope.md#trace-context): its `traceparent` header. Default:
    /// a child of the `TRACEPARENT` environment variable's context, when it holds a valid
    /// one, else the root of a new trace, chosen when published.
    pub fn trace(mut self, trace: TraceParent) -> Self {
        self.trace = Some(trace);
        self
    }

    /// The envelope this message is published as at `now` (pure): checked names and key,
    /// `scheduled_for` = `not_before` = now + delay (or the instant given; no `not_before`
    /// without either), `expires_at` counted from it.
    pub fn envelope(&self, now: DateTime<Utc>) -> Result<Envelope, ClientError> {
        check_name(&self.task).map_err(ClientError::Task)?;
        check_name(&self.queue).map_err(ClientError::Queue)?;
        if let Some(key) = &self.key {
            check_key(key).map_err(ClientError::Key)?;
        }
        let args = match &self.args {
            Ok(args @ serde_json::Value::Object(_)) => args.clone(),
            Ok(other) => return Err(ClientError::ArgsNotAnObject(envelope::json_type(other))),
            Err(e) => return Err(ClientError::Args(clone_json_error(e))),
        };
        let (due, not_before) = match self.due {
            Due::In(delay) if delay.is_zero() => (now, None),
            Due::In(delay) => {
                let due = now + chrono_duration(delay, "delay")?;
                (due, Some(due))
            }
            Due::At(at) => (at, Some(at)),
        };
        let expires_at = match self.expires {
            Some(Deadline::After(e)) if e.is_zero() => return Err(ClientError::ZeroExpiry),
            Some(Deadline::After(e)) => Some(due + chrono_duration(e, "expires")?),
            Some(Deadline::At(at)) if at <= due => return Err(ClientError::NeverDue),
            Some(Deadline::At(at)) => Some(at),
            None => None,
        };
        Ok(Envelope {
            v: 1,
            id: uuid::Uuid::new_v4(),
            key: (self.key.clone()).unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
            task: self.task.clone(),
            job: None,
            args,
            scheduled_for: due,
            published_at: now,
            expires_at,
            not_before,
            attempt: 0,
            queue: self.queue.clone(),
            backfill: false,
            overlap: None,
            trace: self.trace,
        })
    }
}

/// What was published.
#[derive(Debug, Clone, PartialEq)]
pub struct Published {
    /// The idempotency key (the given one or the fresh UUID).
    pub key: String,
    /// The envelope as sent.
    pub envelope: Envelope,
}

/// How a [`Producer`] connects. Start with [`Producer::builder`].
#[derive(Debug, Clone)]
pub struct ProducerBuilder {
    namespace: String,
    urls: Vec<String>,
    ca_file: Option<PathBuf>,
    declare: Option<(QueueType, Duration)>,
}

impl ProducerBuilder {
    /// Adds a broker node URL (`amqp://` or `amqps://`); several are tried in order.
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.urls.push(url.into());
        self
    }

    /// Trusts the CA certificates in this PEM file for `amqps://` instead of the system roots.
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self
    }

    /// Declares the namespace's topology for each queue before its first publish (work queue
    /// as `queue_type`, dead-letter queue with `dead_ttl`), so that a message waits for workers
    /// that have not started yet. Both must be the workers' `[broker] queue_type` and
    /// `[worker] dead_ttl`: the broker refuses a queue declared with other arguments
    /// ([`BrokerError::Mismatch`]), and so would the workers after it. Without it nothing is
    /// declared and a message no queue is bound for is an error.
    pub fn declare(mut self, queue_type: QueueType, dead_ttl: Duration) -> Self {
        self.declare = Some((queue_type, dead_ttl));
        self
    }

    /// Connects: the first node that answers, a confirm-mode channel.
    pub async fn connect(self) -> Result<Producer, ClientError> {
        if self.urls.is_empty() {
            return Err(ClientError::NoUrl);
        }
        let producer = Producer {
            names: Names::new(self.namespace),
            nodes: Nodes::from_urls(self.urls, self.ca_file),
            declare: self.declare,
            session: Mutex::new(None),
        };
        *producer.session.lock().await = Some(producer.open(None).await?);
        Ok(producer)
    }
}

/// A connection to the broker that publishes task messages with confirms. Publishes are
/// serialised on one channel (so that an unroutable message's return is never charged to
/// another); a lost connection is opened again by the next publish.
#[derive(Debug)]
pub struct Producer {
    names: Names,
    nodes: Nodes,
    declare: Option<(QueueType, Duration)>,
    session: Mutex<Option<Session>>,
}

/// A connection, its confirm channel and the queues declared on it.
#[derive(Debug)]
struct Session {
    conn: Connection,
    channel: Channel,
    declared: HashSet<String>,
}

impl Producer {
    /// A producer for `namespace` on the broker at `url`.
    pub async fn connect(url: &str, namespace: &str) -> Result<Self, ClientError> {
        Self::builder(namespace).url(url).connect().await
    }

    /// A producer for `namespace`, to be configured.
    pub fn builder(namespace: impl Into<String>) -> ProducerBuilder {
        ProducerBuilder {
            namespace: namespace.into(),
            urls: Vec::new(),
            ca_file: None,
            declare: None,
        }
    }

    /// Publishes `message` and waits for the broker's confirm: through a delay queue for the
    /// time left before its `not_before`, if any.
    pub async fn publish(&self, message: &Message) -> Result<Published, ClientError> {
        let now = Utc::now();
        let mut envelope = message.envelope(now)?;
        envelope.trace.get_or_insert_with(TraceParent::from_env);
        let delay = envelope.early_by(now).unwrap_or_default();
        self.publish_envelope(&envelope, delay).await?;
        Ok(Published {
            key: envelope.key.clone(),
            envelope,
        })
    }

    /// Publishes a complete envelope (a trigger of a job, a replay) with confirms, through a
    /// delay queue when `delay` > 0. Its epoch header is 0: no beat published it. The delay
    /// queue is the fast path only: a copy meant to wait carries `not_before`, which workers
    /// keep to whatever way it reaches them. One without a `trace` gets
    /// [`TraceParent::from_env`]'s.
    pub async fn publish_envelope(
        &self,
        envelope: &Envelope,
        delay: Duration,
    ) -> Result<(), ClientError> {
        let mut guard = self.session.lock().await;
        let session = match guard.take() {
            Some(session) if session.conn.status().connected() => session,
            stale => self.open(stale).await?,
        };
        let session = guard.insert(session);
        let sent = self.send(session, envelope, delay).await;
        if matches!(
            sent,
            Err(BrokerError::Amqp(_) | BrokerError::Timeout { .. })
        ) {
            // The channel (or the connection) is gone: the next publish opens a new one.
            if let Some(session) = guard.take() {
                broker::close_later(session.conn, "publish failed");
            }
        }
        Ok(sent?)
    }

    /// Closes the connection.
    pub async fn close(self) {
        if let Some(session) = self.session.into_inner() {
            let _ = session.conn.close(200, "producer closed".into()).await;
        }
    }

    async fn open(&self, stale: Option<Session>) -> Result<Session, BrokerError> {
        if let Some(stale) = stale {
            broker::close_later(stale.conn, "reconnecting");
        }
        let (conn, channel) = match self.declare {
            Some((queue_type, dead_ttl)) => {
                let what = Declaration {
                    names: &self.names,
                    queues: &[],
                    dead_ttl,
                    queue_type,
                };
                self.nodes.open_session(&what).await?
            }
            None => {
                let conn = self.nodes.connect().await?;
                let channel = broker::open_confirm_channel(&conn).await?;
                (conn, channel)
            }
        };
        Ok(Session {
            conn,
            channel,
            declared: HashSet::new(),
        })
    }

    async fn send(
        &self,
        session: &mut Session,
        envelope: &Envelope,
        delay: Duration,
    ) -> Result<(), BrokerError> {
        let (channel, queue) = (&session.channel, &envelope.queue);
        if let Some((queue_type, dead_ttl)) = self.declare {
            if !session.declared.contains(queue) {
                let queues = std::slice::from_ref(queue);
                broker::declare(channel, &self.names, queues, dead_ttl, queue_type).await?;
                session.declared.insert(queue.clone());
            }
        }
        let (exchange, routing_key) = if delay.is_zero() {
            (self.names.tasks_exchange(), queue.clone())
        } else {
            let delayed = broker::declare_delay_queue(channel, &self.names, queue, delay).await;
            (String::new(), delayed?)
        };
        let traced;
        let envelope = match envelope.trace {
            Some(_) => envelope,
            None => {
                let trace = Some(TraceParent::from_env());
                traced = Envelope {
                    trace,
                    ..envelope.clone()
                };
                &traced
            }
        };
        let props = crate::broker::properties(envelope, Utc::now(), 0);
        let body = envelope.encode();
        broker::publish_confirmed(channel, &exchange, &routing_key, true, &body, props).await
    }
}

/// `d` as a chrono duration; `what` names it when it is too large.
fn chrono_duration(d: Duration, what: &'static str) -> Result<chrono::Duration, ClientError> {
    chrono::Duration::from_std(d).map_err(|_| ClientError::TooLarge(what))
}

/// serde_json's errors are not `Clone`; a message keeps one behind an `Arc`.
fn clone_json_error(e: &serde_json::Error) -> serde_json::Error {
    <serde_json::Error as serde::de::Error>::custom(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 3, 8, 7, 0, 0).unwrap()
    }

    #[test]
    fn defaults_give_a_fresh_key_on_the_default_queue_due_now() {
        let a = Message::new("report").envelope(now()).unwrap();
        let b = Message::new("report").envelope(now()).unwrap();
        assert_ne!(a.key, b.key);
        assert_eq!(a.queue, "default");
        assert_eq!(a.scheduled_for, now());
        assert_eq!(a.published_at, now());
        assert_eq!(a.args, serde_json::json!({}));
        assert_eq!((a.job.clone(), a.expires_at, a.attempt), (None, None, 0));
    }

    #[test]
    fn a_trace_given_is_the_envelopes_else_it_is_chosen_when_published() {
        assert_eq!(Message::new("report").envelope(now()).unwrap().trace, None);
        let trace = TraceParent::root();
        let env = Message::new("report").trace(trace).envelope(now()).unwrap();
        assert_eq!(env.trace, Some(trace));
    }

    #[test]
    fn due_is_now_plus_delay_and_expiry_counts_from_due() {
        #[derive(Serialize)]
        struct Resize {
            width: u32,
        }
        let env = Message::new("resize")
            .args(Resize { width: 640 })
            .key("k1")
            .queue("images")
            .delay(Duration::from_secs(60))
            .expires(Duration::from_secs(30))
            .envelope(now())
            .unwrap();
        assert_eq!(env.key, "k1");
        assert_eq!(env.queue, "images");
        assert_eq!(env.args, serde_json::json!({"width": 640}));
        assert_eq!(env.scheduled_for, now() + chrono::Duration::seconds(60));
        assert_eq!(env.not_before, Some(env.scheduled_for));
        assert_eq!(env.expires_at, Some(now() + chrono::Duration::seconds(90)));
    }

    #[test]
    fn not_before_and_expires_at_are_instants_and_must_leave_room_to_run() {
        let at = now() + chrono::Duration::minutes(5);
        let env = Message::new("t").not_before(at).envelope(now()).unwrap();
        assert_eq!((env.not_before, env.scheduled_for), (Some(at), at));
        assert_eq!(env.early_by(now()), Some(Duration::from_secs(300)));
        let until = at + chrono::Duration::minutes(1);
        let env = Message::new("t").not_before(at).expires_at(until);
        assert_eq!(env.envelope(now()).unwrap().expires_at, Some(until));
        let never = Message::new("t").not_before(at).expires_at(at);
        let refused = never.envelope(now()).unwrap_err();
        assert!(matches!(refused, ClientError::NeverDue));
        assert_eq!(refused.field(), Some("expires_at"));
        let now_only = Message::new("t").envelope(now()).unwrap();
        assert_eq!(now_only.not_before, None, "no delay: no not_before");
    }

    #[test]
    fn bad_messages_are_refused_before_any_broker() {
        let refused = |m: Message| m.envelope(now()).unwrap_err();
        assert!(matches!(refused(Message::new("a b")), ClientError::Task(_)));
        assert!(matches!(
            refused(Message::new("t").queue("")),
            ClientError::Queue(_)
        ));
        assert!(matches!(
            refused(Message::new("t").key("two words")),
            ClientError::Key(_)
        ));
        assert!(matches!(
            refused(Message::new("t").args([1, 2])),
            ClientError::ArgsNotAnObject("an array")
        ));
        assert!(matches!(
            refused(Message::new("t").expires(Duration::ZERO)),
            ClientError::ZeroExpiry
        ));
        assert!(matches!(
            refused(Message::new("t").delay(Duration::MAX)),
            ClientError::TooLarge("delay")
        ));
        assert!(refused(Message::new("a b")).is_request());
    }
}
