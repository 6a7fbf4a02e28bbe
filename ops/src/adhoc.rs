//! `drumline-beat publish`: one ad-hoc task, same envelope and same guarantees as a scheduled
//! instance (docs/design.md). Its key is `--key` or a fresh UUID; it is due at publish time +
//! `--delay` (waiting in a delay queue meanwhile); `--expires` counts from the due instant.

use chrono::{DateTime, Utc};
use drumline_shared::client::{ClientError, Message, Producer};
use drumline_shared::config::Config;
use drumline_shared::envelope::Envelope;
use std::time::Duration;

/// What the command line asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Task name (must be a `[tasks.*]` entry).
    pub task: String,
    /// JSON arguments.
    pub args: serde_json::Value,
    /// Idempotency key; a fresh UUID when `None`.
    pub key: Option<String>,
    /// Due this long after publishing.
    pub delay: Duration,
    /// Deadline, counted from the due instant.
    pub expires: Option<Duration>,
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
        if let Some(key) = &self.key {
            message = message.key(key);
        }
        if let Some(expires) = self.expires {
            message = message.expires(expires);
        }
        message
    }
}

/// Why the request is refused (exit code 2).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct BadRequest(pub String);

/// Builds the envelope for `req` at `now`, checked against `config` (the task must be one of
/// its `[tasks.*]`) and by the producer client ([`Message::envelope`]).
pub fn envelope(
    config: &Config,
    req: &Request,
    now: DateTime<Utc>,
) -> Result<Envelope, BadRequest> {
    if !config.tasks.contains_key(&req.task) {
        let known: Vec<&str> = config.tasks.keys().map(String::as_str).collect();
        return Err(BadRequest(format!(
            "{}: no task named {:?} (tasks: {})",
            config.path.display(),
            req.task,
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        )));
    }
    req.message()
        .envelope(now)
        .map_err(|e| BadRequest(format!("--{e}")))
}

/// Publishes `env` (through a delay queue when `delay` > 0) with confirms, through the
/// producer client; the queue's topology is declared first, as `config` says.
pub async fn publish(config: &Config, env: &Envelope, delay: Duration) -> Result<(), ClientError> {
    let mut builder = Producer::builder(config.namespace.clone())
        .declare(config.broker.queue_type, config.worker.dead_ttl);
    for url in &config.broker.urls {
        builder = builder.url(url);
    }
    if let Some(ca_file) = &config.broker_ca_file {
        builder = builder.ca_file(ca_file);
    }
    let producer = builder.connect().await?;
    let published = producer.publish_envelope(env, delay).await;
    producer.close().await;
    published
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
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
            queue: None,
        }
    }

    #[test]
    fn due_is_now_plus_delay_and_expiry_counts_from_due() {
        let now = Utc.with_ymd_and_hms(2026, 3, 8, 7, 0, 0).unwrap();
        let env = envelope(&config(), &req(), now).unwrap();
        assert_eq!(env.key, "k1");
        assert_eq!(env.job, None);
        assert_eq!(env.queue, "default");
        assert_eq!(
            env.scheduled_for,
            Utc.with_ymd_and_hms(2026, 3, 8, 7, 1, 0).unwrap()
        );
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
        assert!(envelope(&config(), &r, Utc::now())
            .unwrap_err()
            .0
            .contains("no task named \"nope\" (tasks: report)"));
        let mut r = req();
        r.queue = Some("a b".into());
        assert!(envelope(&config(), &r, Utc::now())
            .unwrap_err()
            .0
            .starts_with("--queue"));
    }
}
