//! `drumline-beat publish` and `POST /api/v1/tasks`: one ad-hoc task, same envelope and same
//! guarantees as a scheduled instance (docs/design.md). Its key is `--key` or a fresh UUID; it
//! is due at publish time + `--delay`, or at `not_before` (waiting in a delay queue meanwhile);
//! `--expires` counts from the due instant, `expires_at` is one. Both doors build the envelope
//! here ([`envelope`]) and publish it here ([`publish`]).

use chrono::{DateTime, Utc};
use drumline_shared::client::{ClientError, Message, Producer};
use drumline_shared::config::Config;
use drumline_shared::envelope::{parse_instant, Envelope};
use drumline_shared::spans::{self, Span};
use drumline_shared::trace::TraceParent;
use serde_json::Value;
use std::time::{Duration, SystemTime};

/// What the command line or the API asked for.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Request {
    /// Task name (must be a `[tasks.*]` entry).
    pub task: String,
    /// JSON arguments.
    pub args: serde_json::Value,
    /// Idempotency key; a fresh UUID when `None`.
    pub key: Option<String>,
    /// Due this long after publishing.
    pub delay: Duration,
    /// Due at this instant (`not_before`) instead of after `delay`.
    pub not_before: Option<DateTime<Utc>>,
    /// Deadline, counted from the due instant.
    pub expires: Option<Duration>,
    /// Deadline, an instant, instead of `expires`.
    pub expires_at: Option<DateTime<Utc>>,
    /// Logical queue; default `default`.
    pub queue: Option<String>,
}

impl Request {
    /// The producer client's message for this request.
    pub fn message(&self) -> Message {
        let mut message = Message::new(&self.task)
            .args(&self.args)
            .queue(self.queue.as_deref().unwrap_or("default"))
            .delay(self.delay);
        if let Some(at) = self.not_before {
            message = message.not_before(at);
        }
        if let Some(key) = &self.key {
            message = message.key(key);
        }
        if let Some(expires) = self.expires {
            message = message.expires(expires);
        }
        if let Some(at) = self.expires_at {
            message = message.expires_at(at);
        }
        message
    }
}

/// Why a request is refused (exit code 2, HTTP 400).
#[derive(Debug, thiserror::Error)]
pub enum BadRequest {
    /// The task is not one of the config's `[tasks.*]`.
    #[error("{path}: no task named {task:?} (tasks: {known})")]
    UnknownTask {
        /// The config file.
        path: String,
        /// The task asked for.
        task: String,
        /// The config's tasks, comma-separated (`none`).
        known: String,
    },
    /// The producer client refused the message.
    #[error(transparent)]
    Message(#[from] ClientError),
    /// An API request's key is missing, of the wrong type, unknown, or clashes with another.
    #[error("{field}: {message}")]
    Field {
        /// The key.
        field: String,
        /// What is wrong with it.
        message: String,
    },
}

impl BadRequest {
    /// The request key it is about, if one.
    pub fn field(&self) -> Option<&str> {
        match self {
            BadRequest::UnknownTask { .. } => Some("task"),
            BadRequest::Message(e) => e.field(),
            BadRequest::Field { field, .. } => Some(field),
        }
    }

    /// As the command line says it: a message error names its option (`--queue: …`,
    /// `--expires-at: …`).
    pub fn for_cli(&self) -> String {
        let text = self.to_string();
        match self {
            BadRequest::Message(e) => match e.field() {
                Some(field) => text.replacen(field, &format!("--{}", field.replace('_', "-")), 1),
                None => text,
            },
            _ => text,
        }
    }
}

/// Builds the envelope for `req` at `now`, checked against `config` (the task must be one of
/// its `[tasks.*]`) and by the producer client ([`Message::envelope`]).
pub fn envelope(
    config: &Config,
    req: &Request,
    now: DateTime<Utc>,
) -> Result<Envelope, BadRequest> {
    if !config.tasks.contains_key(&req.task) {
        let known: Vec<&str> = config.tasks.keys().map(String::as_str).collect();
        return Err(BadRequest::UnknownTask {
            path: config.path.display().to_string(),
            task: req.task.clone(),
            known: match known.is_empty() {
                true => "none".to_owned(),
                false => known.join(", "),
            },
        });
    }
    Ok(req.message().envelope(now)?)
}

/// The request a `POST /api/v1/tasks` body makes: `task` (required), `args` (an object),
/// `key`, `queue`, `delay` or `not_before`, `expires` or `expires_at` (docs/api.md#tasks).
pub fn from_json(body: &Value) -> Result<Request, BadRequest> {
    let bad = |field: &str, message: &str| BadRequest::Field {
        field: field.to_owned(),
        message: message.to_owned(),
    };
    let fields = body
        .as_object()
        .ok_or_else(|| bad("body", "must be a JSON object"))?;
    const KNOWN: [&str; 8] = [
        "task",
        "args",
        "key",
        "queue",
        "delay",
        "not_before",
        "expires",
        "expires_at",
    ];
    if let Some(unknown) = fields.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(bad(unknown, "unknown key"));
    }
    for (one, other) in [("delay", "not_before"), ("expires", "expires_at")] {
        if fields.contains_key(one) && fields.contains_key(other) {
            return Err(bad(other, &format!("give {one} or {other}, not both")));
        }
    }
    let text = |field: &str| match fields.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(field, "must be a string")),
    };
    let duration = |field: &str| match text(field)? {
        Some(s) => drumline_shared::duration::parse(&s)
            .map(Some)
            .map_err(|e| bad(field, &e)),
        None => Ok(None),
    };
    let instant = |field: &str| match text(field)? {
        Some(s) => (parse_instant(&s).map(Some))
            .ok_or_else(|| bad(field, &format!("{s:?} is not an RFC 3339 instant"))),
        None => Ok(None),
    };
    Ok(Request {
        task: text("task")?.ok_or_else(|| bad("task", "is required"))?,
        args: fields
            .get("args")
            .cloned()
            .unwrap_or_else(|| serde_json::json!({})),
        key: text("key")?,
        queue: text("queue")?,
        delay: duration("delay")?.unwrap_or_default(),
        not_before: instant("not_before")?,
        expires: duration("expires")?,
        expires_at: instant("expires_at")?,
    })
}

/// A producer for `config`'s broker that declares the queue's topology before its first
/// publish, as `config` says.
pub async fn producer(config: &Config) -> Result<Producer, ClientError> {
    let mut builder = Producer::builder(config.namespace.clone())
        .declare(config.broker.queue_type, config.worker.dead_ttl);
    for url in &config.broker.urls {
        builder = builder.url(url);
    }
    if let Some(ca_file) = &config.broker_ca_file {
        builder = builder.ca_file(ca_file);
    }
    builder.connect().await
}

/// Publishes `env` with confirms through `producer`: through a delay queue for the time left
/// before its `not_before`, if any (the fast path: workers keep `not_before` anyway). Without
/// a trace of its own, it is published in a child span of `parent` (the producer's context),
/// else in a new trace (docs/envelope.md#trace-context); with `[telemetry]`, that span is
/// exported as `publish`.
pub async fn publish_with(
    producer: &Producer,
    env: &Envelope,
    parent: Option<TraceParent>,
) -> Result<(), ClientError> {
    let start = SystemTime::now();
    let trace = env.trace.unwrap_or_else(|| match parent {
        Some(parent) => parent.child(),
        None => TraceParent::root(),
    });
    let env = Envelope {
        trace: Some(trace),
        ..env.clone()
    };
    let delay = env.early_by(Utc::now()).unwrap_or_default();
    let sent = producer.publish_envelope(&env, delay).await;
    if let Some(span) = Span::publish(&env, parent.as_ref(), start) {
        spans::record(span.failed_if(sent.is_err()));
    }
    sent
}

/// Publishes `env` as [`publish_with`] does, through a producer of its own, continuing the
/// process's `TRACEPARENT`.
pub async fn publish(config: &Config, env: &Envelope) -> Result<(), ClientError> {
    let producer = producer(config).await?;
    let published = publish_with(&producer, env, TraceParent::env_parent()).await;
    producer.close().await;
    published
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use serde_json::json;
    use std::path::Path;

    fn config() -> Config {
        Config::parse(
            "[tasks.report]\ncommand = [\"/bin/true\"]\n",
            Path::new("d.toml"),
            |_| None,
        )
        .unwrap()
    }

    fn req() -> Request {
        Request {
            task: "report".into(),
            args: serde_json::json!({"a": 1}),
            key: Some("k1".into()),
            delay: Duration::from_secs(60),
            expires: Some(Duration::from_secs(30)),
            ..Request::default()
        }
    }

    #[test]
    fn due_is_now_plus_delay_and_expiry_counts_from_due() {
        let now = Utc.with_ymd_and_hms(2026, 3, 8, 7, 0, 0).unwrap();
        let env = envelope(&config(), &req(), now).unwrap();
        assert_eq!(env.key, "k1");
        assert_eq!(env.job, None);
        assert_eq!(env.queue, "default");
        let due = Utc.with_ymd_and_hms(2026, 3, 8, 7, 1, 0).unwrap();
        assert_eq!((env.scheduled_for, env.not_before), (due, Some(due)));
        assert_eq!(
            env.expires_at,
            Some(Utc.with_ymd_and_hms(2026, 3, 8, 7, 1, 30).unwrap())
        );
    }

    #[test]
    fn without_a_key_each_publish_is_a_new_instance() {
        let mut r = req();
        r.key = None;
        let now = Utc::now();
        let a = envelope(&config(), &r, now).unwrap();
        let b = envelope(&config(), &r, now).unwrap();
        assert_ne!(a.key, b.key);
    }

    #[test]
    fn unknown_task_and_bad_queue_are_refused() {
        let mut r = req();
        r.task = "nope".into();
        let refused = envelope(&config(), &r, Utc::now()).unwrap_err();
        assert!(refused
            .to_string()
            .contains("no task named \"nope\" (tasks: report)"));
        assert_eq!(refused.field(), Some("task"));
        let mut r = req();
        r.queue = Some("a b".into());
        let refused = envelope(&config(), &r, Utc::now()).unwrap_err();
        assert!(refused.for_cli().starts_with("--queue"), "{refused}");
        assert_eq!(refused.field(), Some("queue"));
    }

    #[test]
    fn an_api_body_is_the_same_request() {
        let body = json!({"task": "report", "args": {"a": 1}, "key": "k1",
            "not_before": "2026-03-08T07:01:00Z", "expires_at": "2026-03-08T07:01:30Z"});
        let request = from_json(&body).unwrap();
        let now = Utc.with_ymd_and_hms(2026, 3, 8, 7, 0, 0).unwrap();
        let env = envelope(&config(), &request, now).unwrap();
        let mut cli = req();
        cli.expires = None;
        cli.expires_at = env.expires_at;
        assert_eq!(
            envelope(&config(), &cli, now).unwrap().not_before,
            env.not_before
        );
        assert_eq!(request.not_before, Some(env.scheduled_for));
    }

    #[test]
    fn a_bad_api_body_names_its_key() {
        let field = |body: Value| {
            let refused =
                from_json(&body).and_then(|r| envelope(&config(), &r, Utc::now()).map(|_| r));
            refused.unwrap_err().field().map(str::to_owned)
        };
        let named = |key: &str| Some(key.to_owned());
        assert_eq!(field(json!({"args": {}})), named("task"));
        assert_eq!(field(json!({"task": "nope"})), named("task"));
        assert_eq!(field(json!({"task": "report", "args": [1]})), named("args"));
        let soon = json!({"task": "report", "not_before": "soon"});
        assert_eq!(field(soon), named("not_before"));
        let both = json!({"task": "report", "delay": "1s", "not_before": "2026-03-08T07:01:00Z"});
        assert_eq!(field(both), named("not_before"));
        let never = json!({"task": "report", "not_before": "2030-01-01T00:00:00Z",
            "expires_at": "2029-01-01T00:00:00Z"});
        assert_eq!(field(never), named("expires_at"));
        assert_eq!(
            field(json!({"task": "report", "priority": 9})),
            named("priority")
        );
        assert_eq!(field(json!([])), named("body"));
    }
}
