//! `drumline-beat publish`: one ad-hoc task, same envelope and same guarantees as a scheduled
//! instance (docs/design.md). Its key is `--key` or a fresh UUID; it is due at publish time +
//! `--delay` (waiting in a delay queue meanwhile); `--expires` counts from the due instant.

use chrono::{DateTime, Utc};
use drumline_shared::broker::{self, BrokerError};
use drumline_shared::config::{check_name, Config};
use drumline_shared::envelope::Envelope;
use drumline_shared::names::{check_key, Names};
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

/// Why the request is refused (exit code 2).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct BadRequest(pub String);

/// Builds the envelope for `req` at `now`, checked against `config`.
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
    let queue = req.queue.clone().unwrap_or_else(|| "default".to_owned());
    check_name(&queue).map_err(|e| BadRequest(format!("--queue: {e}")))?;
    if let Some(key) = &req.key {
        check_key(key).map_err(|e| BadRequest(format!("--key: {e}")))?;
    }
    let delay = chrono::Duration::from_std(req.delay)
        .map_err(|_| BadRequest("--delay: too large".into()))?;
    let due = now + delay;
    let expires_at = match req.expires {
        Some(e) if e.is_zero() => {
            return Err(BadRequest("--expires: must be greater than zero".into()))
        }
        Some(e) => Some(
            due + chrono::Duration::from_std(e)
                .map_err(|_| BadRequest("--expires: too large".into()))?,
        ),
        None => None,
    };
    Ok(Envelope {
        v: 1,
        id: uuid::Uuid::new_v4(),
        key: req
            .key
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
        task: req.task.clone(),
        job: None,
        args: req.args.clone(),
        scheduled_for: due,
        published_at: now,
        expires_at,
        attempt: 0,
        queue,
        backfill: false,
    })
}

/// Publishes `env` (through a delay queue when `delay` > 0) with confirms.
pub async fn publish(config: &Config, env: &Envelope, delay: Duration) -> Result<(), BrokerError> {
    let names = Names::new(config.namespace.clone());
    let (conn, channel) = broker::open_channel(
        config,
        &names,
        std::slice::from_ref(&env.queue),
        config.worker.dead_ttl,
    )
    .await?;
    let (exchange, routing_key) = if delay.is_zero() {
        (names.tasks_exchange(), env.queue.clone())
    } else {
        let queue = broker::declare_delay_queue(&channel, &names, &env.queue, delay).await?;
        (String::new(), queue)
    };
    let published = broker::publish_confirmed(
        &channel,
        &exchange,
        &routing_key,
        true,
        &env.encode(),
        env.properties(Utc::now(), 0),
    )
    .await;
    let _ = conn.close(200, "published".into()).await;
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
