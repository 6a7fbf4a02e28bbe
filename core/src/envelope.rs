//! The v1 task message (docs/design.md): the JSON body, the idempotency key, and the AMQP
//! properties and headers every publisher sets.

use crate::names::{check_key, check_name, InvalidName};
use chrono::{DateTime, SecondsFormat, Timelike, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Header: task name.
pub const H_TASK: &str = "x-drumline-task";
/// Header: attempt number (0 for the first run).
pub const H_ATTEMPT: &str = "x-drumline-attempt";
/// Header: scheduled instant.
pub const H_SCHEDULED_FOR: &str = "x-drumline-scheduled-for";
/// Header: the publishing beat's leadership epoch.
pub const H_EPOCH: &str = "x-drumline-epoch";
/// Header on dead letters: why.
pub const H_REASON: &str = "x-drumline-reason";
/// Header on dead letters: the last error.
pub const H_ERROR: &str = "x-drumline-error";
/// Header on dead letters: runs made.
pub const H_ATTEMPTS: &str = "x-drumline-attempts";

/// Why a message was dead-lettered: the value of the [`H_REASON`] header (docs/design.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeadReason {
    /// The handler said not to try again.
    Permanent,
    /// It failed more than the task's `max_retries` allows.
    RetriesExhausted,
    /// Its `expires_at` passed before it could run.
    Expired,
    /// This worker's config has no task by that name.
    UnknownTask,
    /// Not a valid v1 envelope, or breaking its limits.
    Malformed,
    /// Longer than `max_message_bytes`.
    Oversize,
}

impl DeadReason {
    /// The header text.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadReason::Permanent => "permanent",
            DeadReason::RetriesExhausted => "retries_exhausted",
            DeadReason::Expired => "expired",
            DeadReason::UnknownTask => "unknown_task",
            DeadReason::Malformed => "malformed",
            DeadReason::Oversize => "oversize",
        }
    }
}

impl std::fmt::Display for DeadReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The envelope, version 1 (docs/envelope.md; the wire contract is `docs/envelope.schema.json`).
///
/// What drumline writes always has every field. What it reads may omit the optional ones
/// ([`Envelope::decode_delivered`] fills them in) and may carry fields it does not know, which
/// are ignored (docs/design.md#the-message).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Envelope {
    /// Format version; always 1.
    pub v: u32,
    /// Unique id of this message (not of the instance).
    pub id: Uuid,
    /// Idempotency key: `{job}@{scheduled_for}` or the ad-hoc key.
    pub key: String,
    /// Task name, resolved by the worker's config.
    pub task: String,
    /// Job name; `None` for ad-hoc tasks.
    pub job: Option<String>,
    /// Arguments, handed to the handler (shell: on stdin).
    pub args: serde_json::Value,
    /// The instant the instance is due.
    #[serde(with = "rfc3339")]
    pub scheduled_for: DateTime<Utc>,
    /// When this copy was published.
    #[serde(with = "rfc3339")]
    pub published_at: DateTime<Utc>,
    /// Deadline after which the instance must not run.
    #[serde(with = "rfc3339_opt")]
    pub expires_at: Option<DateTime<Utc>>,
    /// The run does not start before this instant: a worker given the message earlier sends
    /// it to a delay queue for the time left (docs/envelope.md#not-before). Written only when
    /// set, so other messages keep the first v1 shape.
    #[serde(default, with = "rfc3339_opt", skip_serializing_if = "Option::is_none")]
    pub not_before: Option<DateTime<Utc>>,
    /// 0 for the first run, +1 per retry.
    pub attempt: u32,
    /// Logical queue (routing key).
    pub queue: String,
    /// Published by `drumline-beat backfill`: a job with `overlap = "skip"` is run as `queue`
    /// (a backfill asks every instant to run). Written only when true, so other messages keep
    /// the first v1 shape.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub backfill: bool,
    /// The job's `overlap` as the beat published it: how a worker treats the instance when
    /// its own config does not list the job (a schedule applied at run time). Written on
    /// scheduled instances only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlap: Option<crate::policy::Overlap>,
    /// The producer's span, carried in the `traceparent` AMQP header, not in the body
    /// (docs/envelope.md#trace-context): the beat's, the publishing command's or client's, or
    /// the delivery's as read (a retry keeps it). `None`: the message has no trace context.
    #[serde(skip)]
    pub trace: Option<crate::trace::TraceParent>,
}

/// What a delivery says about a message besides its body: the defaults of the fields a
/// producer may omit (docs/envelope.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival<'a> {
    /// The routing key it was published with: the default `queue`.
    pub routing_key: &'a str,
    /// When it was published (the AMQP `timestamp`, else when it arrived): the default
    /// `published_at`, and through it the default `scheduled_for`.
    pub published_at: DateTime<Utc>,
    /// Its valid `traceparent` header, if any: the envelope's `trace`.
    pub trace: Option<crate::trace::TraceParent>,
}

/// The envelope as a producer may write it: only `key` and `task` required, unknown fields
/// ignored (no `deny_unknown_fields`: a producer's new field must not dead-letter it).
#[derive(Deserialize)]
struct Wire {
    #[serde(default)]
    id: Option<Uuid>,
    key: String,
    task: String,
    #[serde(default)]
    job: Option<String>,
    #[serde(default)]
    args: Option<serde_json::Value>,
    #[serde(default, with = "rfc3339_opt")]
    scheduled_for: Option<DateTime<Utc>>,
    #[serde(default, with = "rfc3339_opt")]
    published_at: Option<DateTime<Utc>>,
    #[serde(default, with = "rfc3339_opt")]
    expires_at: Option<DateTime<Utc>>,
    #[serde(default, with = "rfc3339_opt")]
    not_before: Option<DateTime<Utc>>,
    #[serde(default)]
    attempt: u32,
    #[serde(default)]
    queue: Option<String>,
    #[serde(default)]
    backfill: bool,
    #[serde(default)]
    overlap: Option<crate::policy::Overlap>,
}

impl Wire {
    /// The envelope, with `arrival`'s defaults for what the producer left out; `None` when
    /// `queue` is missing and there is no routing key to take it from.
    fn complete(self, arrival: Option<&Arrival<'_>>) -> Option<Envelope> {
        let published_at = self
            .published_at
            .or(arrival.map(|a| a.published_at))
            .unwrap_or_else(Utc::now);
        let queue = self
            .queue
            .or_else(|| arrival.map(|a| a.routing_key.to_owned()))?;
        Some(Envelope {
            v: 1,
            id: self.id.unwrap_or_else(Uuid::new_v4),
            key: self.key,
            task: self.task,
            job: self.job,
            args: self.args.unwrap_or_else(|| serde_json::json!({})),
            scheduled_for: (self.scheduled_for.or(self.not_before)).unwrap_or(published_at),
            published_at,
            expires_at: self.expires_at,
            not_before: self.not_before,
            attempt: self.attempt,
            queue,
            backfill: self.backfill,
            overlap: self.overlap,
            trace: arrival.and_then(|a| a.trace),
        })
    }
}

/// Why a body is not a valid envelope.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Not JSON, or not the v1 shape.
    #[error("malformed envelope: {0}")]
    Malformed(#[from] serde_json::Error),
    /// A version this worker does not speak.
    #[error("unsupported envelope version {0}")]
    Version(u32),
    /// No `queue`, and no routing key to take it from ([`Envelope::decode`] alone).
    #[error("malformed envelope: missing field `queue`")]
    NoQueue,
    /// An instant field that is not an RFC 3339 instant (or null).
    #[error("malformed envelope: {field} {value} is not an RFC 3339 instant")]
    Instant {
        /// `scheduled_for`, `published_at`, `expires_at` or `not_before`.
        field: &'static str,
        /// The value given, as JSON.
        value: String,
    },
}

/// The envelope's instant fields: each is checked by name before the rest is decoded, so that
/// a bad one is refused naming it.
const INSTANT_FIELDS: [&str; 4] = ["scheduled_for", "published_at", "expires_at", "not_before"];

/// The first of [`INSTANT_FIELDS`] in `raw` that is neither null nor an RFC 3339 instant.
fn bad_instant(raw: &serde_json::Value) -> Option<DecodeError> {
    INSTANT_FIELDS.into_iter().find_map(|field| {
        let value = raw.get(field).filter(|v| !v.is_null())?;
        match value.as_str().and_then(parse_instant) {
            Some(_) => None,
            None => Some(DecodeError::Instant {
                field,
                value: value.to_string(),
            }),
        }
    })
}

/// Formats an instant the way every drumline message and key writes it (docs/design.md, the one
/// codec): RFC 3339 UTC with `Z`, whole seconds when the instant has no fraction, else exactly
/// milliseconds (`2026-03-08T07:30:00Z`, `2026-03-08T07:30:00.250Z`). Sub-millisecond parts
/// are dropped.
pub fn format_instant(t: DateTime<Utc>) -> String {
    let t = t
        .with_nanosecond(t.nanosecond() / 1_000_000 * 1_000_000)
        .unwrap_or(t);
    let format = if t.nanosecond() == 0 {
        SecondsFormat::Secs
    } else {
        SecondsFormat::Millis
    };
    t.to_rfc3339_opts(format, true)
}

/// Parses an instant written by [`format_instant`] (or any RFC 3339 text).
pub fn parse_instant(text: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// Why a decoded envelope is refused (dead-lettered `malformed`, docs/design.md).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    /// The idempotency key breaks the key rule.
    #[error("key {0}")]
    Key(InvalidName),
    /// A name field breaks the name rule.
    #[error("{field} {error}")]
    Name {
        /// `task`, `job` or `queue`.
        field: &'static str,
        /// What is wrong with it.
        error: InvalidName,
    },
    /// `job` is set but the key is not `{job}@{scheduled_for}`.
    #[error("key does not name this instance: expected {expected:?}")]
    NotTheInstance {
        /// The key the job and instant give.
        expected: String,
    },
    /// An ad-hoc message whose key has the form of an instance of a known job.
    #[error("an ad-hoc key must not name an instance of job {0:?}")]
    Impersonates(String),
    /// `args` is not a JSON object (`{}` when there are none).
    #[error("args must be a JSON object, not {0}")]
    Args(&'static str),
    /// `expires_at` is not after `not_before`: the instance could never run.
    #[error("not_before {not_before} is not before expires_at {expires_at}: it could never run")]
    NeverDue {
        /// `not_before`, as written.
        not_before: String,
        /// `expires_at`, as written.
        expires_at: String,
    },
}

/// The JSON type of `value`, for an error (`an array`).
pub fn json_type(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The idempotency key of a scheduled instance.
pub fn instance_key(job: &str, scheduled_for: DateTime<Utc>) -> String {
    format!("{job}@{}", format_instant(scheduled_for))
}

impl Envelope {
    /// A scheduled instance of `job`, the first span of a trace of its own (the beat's
    /// publish: docs/envelope.md#trace-context).
    #[allow(clippy::too_many_arguments)]
    pub fn scheduled(
        job: &str,
        task: &str,
        queue: &str,
        args: serde_json::Value,
        scheduled_for: DateTime<Utc>,
        expires_at: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Self {
        Self {
            v: 1,
            id: Uuid::new_v4(),
            key: instance_key(job, scheduled_for),
            task: task.to_owned(),
            job: Some(job.to_owned()),
            args,
            scheduled_for,
            published_at: now,
            expires_at,
            attempt: 0,
            queue: queue.to_owned(),
            not_before: None,
            backfill: false,
            overlap: None,
            trace: Some(crate::trace::TraceParent::root()),
        }
    }

    /// Instance `scheduled_for` of `job`, as the job: its task, queue, args and overlap.
    #[cfg(feature = "config")]
    pub fn of_job(
        job: &crate::config::Job,
        scheduled_for: DateTime<Utc>,
        expires_at: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Self {
        let spec = &job.spec;
        let args = spec.args.value();
        let mut env = Self::scheduled(
            &job.name,
            &spec.task,
            &spec.queue,
            args,
            scheduled_for,
            expires_at,
            now,
        );
        env.overlap = Some(spec.overlap);
        env
    }

    /// Decodes a message body as drumline wrote it (a retry copy, a dead letter, a waiting
    /// copy): the optional fields are defaulted as by [`Envelope::decode_delivered`], except
    /// `queue`, which must be there, and `published_at`, which defaults to now.
    pub fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        Self::decode_with(body, None)
    }

    /// Decodes a delivered message body, whoever produced it (docs/envelope.md): `key` and
    /// `task` are required; `queue` defaults to the routing key, `published_at` to the publish
    /// time, `scheduled_for` to `not_before`, else `published_at`, `args` to `{}`, `attempt` to
    /// 0, `id` to a fresh one, `expires_at`, `not_before` and `job` to none; fields it does not
    /// know are ignored. An instant field that is not RFC 3339 is refused naming the field.
    pub fn decode_delivered(body: &[u8], arrival: &Arrival<'_>) -> Result<Self, DecodeError> {
        Self::decode_with(body, Some(arrival))
    }

    fn decode_with(body: &[u8], arrival: Option<&Arrival<'_>>) -> Result<Self, DecodeError> {
        // Look at the version first so a v2 message gets a precise reason.
        let raw: serde_json::Value = serde_json::from_slice(body)?;
        if let Some(v) = raw.get("v").filter(|v| !v.is_null()) {
            match v.as_u64() {
                Some(1) => {}
                Some(v) => return Err(DecodeError::Version(v.min(u32::MAX as u64) as u32)),
                None => return Err(DecodeError::Version(0)),
            }
        }
        if let Some(bad) = bad_instant(&raw) {
            return Err(bad);
        }
        let wire: Wire = serde_json::from_value(raw)?;
        wire.complete(arrival).ok_or(DecodeError::NoQueue)
    }

    /// Encodes the body.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("an envelope always serialises")
    }

    /// Checks a delivered envelope before anything else is done with it (docs/design.md): field
    /// lengths and characters; a scheduled instance's key is `{job}@{scheduled_for}`
    /// (compared as instants); an ad-hoc key does not look like an instance of a job for which
    /// `is_job` is true.
    pub fn check(&self, is_job: impl Fn(&str) -> bool) -> Result<(), Malformed> {
        check_key(&self.key).map_err(Malformed::Key)?;
        if !self.args.is_object() {
            return Err(Malformed::Args(json_type(&self.args)));
        }
        if let (Some(not_before), Some(expires_at)) = (self.not_before, self.expires_at) {
            if expires_at <= not_before {
                return Err(Malformed::NeverDue {
                    not_before: format_instant(not_before),
                    expires_at: format_instant(expires_at),
                });
            }
        }
        let name = |field, value: &str| {
            check_name(value).map_err(|error| Malformed::Name { field, error })
        };
        name("task", &self.task)?;
        name("queue", &self.queue)?;
        let instance = self
            .key
            .split_once('@')
            .and_then(|(job, at)| Some((job, parse_instant(at)?)));
        match &self.job {
            Some(job) => {
                name("job", job)?;
                if instance != Some((job.as_str(), self.scheduled_for)) {
                    return Err(Malformed::NotTheInstance {
                        expected: instance_key(job, self.scheduled_for),
                    });
                }
            }
            None => {
                if let Some((job, _)) = instance.filter(|(job, _)| is_job(job)) {
                    return Err(Malformed::Impersonates(job.to_owned()));
                }
            }
        }
        Ok(())
    }

    /// How long before `not_before` it is at `now`; `None` when due (no `not_before`, or it
    /// has come). Sub-millisecond remainders count as a whole millisecond.
    pub fn early_by(&self, now: DateTime<Utc>) -> Option<std::time::Duration> {
        let left = (self.not_before? - now).to_std().ok()?;
        (!left.is_zero())
            .then(|| std::time::Duration::from_millis(left.as_nanos().div_ceil(1_000_000) as u64))
    }

    /// True when the deadline has passed at `now`.
    pub fn is_expired(&self, now: DateTime<Utc>) -> bool {
        self.expires_at.is_some_and(|at| at <= now)
    }
}

/// `text` cut to an AMQP short string's 255 bytes (at a character boundary). Keys are at most
/// 200 bytes once checked; this keeps an unchecked one from failing a whole publish.
pub fn bounded_short(text: &str) -> String {
    let mut end = text.len().min(255);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

mod rfc3339 {
    use chrono::{DateTime, Utc};
    use serde::Serializer;

    pub fn serialize<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_instant(*t))
    }
}

mod rfc3339_opt {
    use chrono::{DateTime, Utc};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &Option<DateTime<Utc>>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.serialize_str(&super::format_instant(*t)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DateTime<Utc>>, D::Error> {
        let text = Option::<String>::deserialize(d)?;
        text.map(|text| {
            DateTime::parse_from_rfc3339(&text)
                .map(|t| t.with_timezone(&Utc))
                .map_err(serde::de::Error::custom)
        })
        .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(h: u32, m: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 3, 8, h, m, 0).unwrap()
    }

    #[test]
    fn key_is_job_at_rfc3339_utc() {
        assert_eq!(
            instance_key("nightly-report", at(7, 30)),
            "nightly-report@2026-03-08T07:30:00Z"
        );
    }

    #[test]
    fn round_trips_through_json() {
        let env = Envelope::scheduled(
            "j",
            "t",
            "default",
            serde_json::json!({"region": "eu"}),
            at(7, 30),
            Some(at(8, 30)),
            at(7, 30),
        );
        let body = env.encode();
        let text = String::from_utf8(body.clone()).unwrap();
        assert!(
            text.contains("\"scheduled_for\":\"2026-03-08T07:30:00Z\""),
            "{text}"
        );
        assert!(!text.contains("trace"), "the trace is a header: {text}");
        let env = Envelope { trace: None, ..env };
        assert_eq!(Envelope::decode(&body).unwrap(), env);
    }

    #[test]
    fn design_example_decodes() {
        let body = br#"{"v":1,"id":"6f1c1c1e-7c1a-4c1a-9c1a-1c1a1c1a1c1a","key":"nightly-report@2026-03-08T07:30:00Z","task":"report",
 "job":"nightly-report","args":{},"scheduled_for":"2026-03-08T07:30:00Z",
 "published_at":"2026-03-08T07:30:00.012Z","expires_at":null,"attempt":0,"queue":"default"}"#;
        let env = Envelope::decode(body).unwrap();
        assert_eq!(env.job.as_deref(), Some("nightly-report"));
        assert_eq!(env.expires_at, None);
        assert!(!env.is_expired(at(23, 0)));
    }

    #[test]
    fn one_codec_whole_seconds_or_exactly_milliseconds() {
        let t = at(7, 30);
        assert_eq!(format_instant(t), "2026-03-08T07:30:00Z");
        let ms = t + chrono::Duration::milliseconds(250);
        assert_eq!(format_instant(ms), "2026-03-08T07:30:00.250Z");
        let us = ms + chrono::Duration::microseconds(999);
        assert_eq!(format_instant(us), "2026-03-08T07:30:00.250Z");
        let tiny = t + chrono::Duration::microseconds(5);
        assert_eq!(format_instant(tiny), "2026-03-08T07:30:00Z");
    }

    fn scheduled(job: &str) -> Envelope {
        Envelope::scheduled(
            job,
            "t",
            "default",
            serde_json::json!({}),
            at(7, 30),
            None,
            at(7, 30),
        )
    }

    #[test]
    fn a_scheduled_key_must_name_its_instance() {
        let no_jobs = |_: &str| false;
        assert_eq!(scheduled("j").check(no_jobs), Ok(()));
        // The same instant written another way is the same instance.
        let mut env = scheduled("j");
        env.key = "j@2026-03-08T07:30:00.000+00:00".into();
        assert_eq!(env.check(no_jobs), Ok(()));
        env.scheduled_for = at(7, 31);
        assert!(matches!(
            env.check(no_jobs),
            Err(Malformed::NotTheInstance { .. })
        ));
        let mut other = scheduled("j");
        other.key = "k@2026-03-08T07:30:00Z".into();
        assert!(matches!(
            other.check(no_jobs),
            Err(Malformed::NotTheInstance { .. })
        ));
        other.key = "no-at-sign".into();
        assert!(matches!(
            other.check(no_jobs),
            Err(Malformed::NotTheInstance { .. })
        ));
    }

    #[test]
    fn an_adhoc_key_must_not_impersonate_a_known_job() {
        let mut env = scheduled("j");
        env.job = None;
        let known = |job: &str| job == "j";
        assert_eq!(env.check(known), Err(Malformed::Impersonates("j".into())));
        assert_eq!(env.check(|_: &str| false), Ok(()));
        env.key = "j@not-an-instant".into();
        assert_eq!(env.check(known), Ok(()));
    }

    #[test]
    fn args_are_an_object_everywhere() {
        let mut env = scheduled("j");
        for (args, kind) in [
            (serde_json::json!([1, 2]), "an array"),
            (serde_json::json!("x"), "a string"),
        ] {
            env.args = args;
            assert_eq!(env.check(|_: &str| false), Err(Malformed::Args(kind)));
            assert!(env
                .check(|_: &str| false)
                .unwrap_err()
                .to_string()
                .contains("args"));
        }
        env.args = serde_json::json!({"a": [1, 2]});
        assert_eq!(env.check(|_: &str| false), Ok(()));
    }

    #[test]
    fn lengths_and_characters_are_bounded() {
        let mut env = scheduled("j");
        env.job = None;
        env.key = "k".repeat(201);
        assert!(matches!(env.check(|_: &str| false), Err(Malformed::Key(_))));
        env.key = "a b".into();
        assert!(matches!(env.check(|_: &str| false), Err(Malformed::Key(_))));
        env.key = "ok".into();
        env.task = "x".repeat(101);
        assert!(matches!(
            env.check(|_: &str| false),
            Err(Malformed::Name { field: "task", .. })
        ));
        env.task = "t".into();
        env.queue = "a/b".into();
        assert!(matches!(
            env.check(|_: &str| false),
            Err(Malformed::Name { field: "queue", .. })
        ));
    }

    #[test]
    fn garbage_and_future_versions_are_refused() {
        assert!(matches!(
            Envelope::decode(b"not json"),
            Err(DecodeError::Malformed(_))
        ));
        assert!(matches!(
            Envelope::decode(b"{\"v\":1}"),
            Err(DecodeError::Malformed(_))
        ));
        assert!(matches!(
            Envelope::decode(b"{\"v\":2}"),
            Err(DecodeError::Version(2))
        ));
    }

    fn arrival() -> Arrival<'static> {
        Arrival {
            routing_key: "reports",
            published_at: at(9, 15),
            trace: None,
        }
    }

    #[test]
    fn a_minimal_producer_message_gets_the_defaults() {
        let body = br#"{"key":"k1","task":"report"}"#;
        let env = Envelope::decode_delivered(body, &arrival()).unwrap();
        assert_eq!(env.v, 1);
        assert_eq!((env.key.as_str(), env.task.as_str()), ("k1", "report"));
        assert_eq!(env.queue, "reports", "queue: the routing key it arrived on");
        assert_eq!(env.published_at, at(9, 15));
        assert_eq!(
            env.scheduled_for,
            at(9, 15),
            "scheduled_for: the publish time"
        );
        assert_eq!(env.expires_at, None);
        assert_eq!(env.job, None);
        assert_eq!(env.attempt, 0);
        assert_eq!(env.args, serde_json::json!({}));
        assert!(!env.backfill);
        assert!(env.check(|_: &str| false).is_ok());
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let body = br#"{"key":"k1","task":"report","priority":9,"trace":{"id":"x"}}"#;
        let env = Envelope::decode_delivered(body, &arrival()).unwrap();
        assert_eq!(env.key, "k1");
    }

    #[test]
    fn given_fields_win_over_the_defaults() {
        let body = br#"{"key":"k1","task":"report","queue":"q2","args":{"a":1},
            "scheduled_for":"2026-03-08T07:30:00Z","published_at":"2026-03-08T07:00:00Z",
            "expires_at":"2026-03-08T08:00:00Z","attempt":2}"#;
        let env = Envelope::decode_delivered(body, &arrival()).unwrap();
        assert_eq!(env.queue, "q2");
        assert_eq!(env.args, serde_json::json!({"a": 1}));
        assert_eq!(env.scheduled_for, at(7, 30));
        assert_eq!(env.published_at, at(7, 0));
        assert_eq!(env.expires_at, Some(at(8, 0)));
        assert_eq!(env.attempt, 2);
    }

    #[test]
    fn not_before_is_read_written_when_set_and_makes_the_default_due_instant() {
        let body = br#"{"key":"k1","task":"report","not_before":"2026-03-08T09:20:00Z"}"#;
        let env = Envelope::decode_delivered(body, &arrival()).unwrap();
        assert_eq!(env.not_before, Some(at(9, 20)));
        assert_eq!(env.scheduled_for, at(9, 20), "scheduled_for: not_before");
        let text = String::from_utf8(env.encode()).unwrap();
        assert!(
            text.contains("\"not_before\":\"2026-03-08T09:20:00Z\""),
            "{text}"
        );
        assert_eq!(Envelope::decode(&env.encode()).unwrap(), env);
        assert!(!String::from_utf8(scheduled("j").encode())
            .unwrap()
            .contains("not_before"));
    }

    #[test]
    fn early_by_is_the_time_left_before_not_before() {
        let mut env = scheduled("j");
        assert_eq!(env.early_by(at(7, 0)), None, "no not_before: due");
        env.not_before = Some(at(7, 30));
        let ms = std::time::Duration::from_millis;
        assert_eq!(env.early_by(at(7, 29)), Some(ms(60_000)));
        assert_eq!(env.early_by(at(7, 30)), None);
        assert_eq!(env.early_by(at(7, 31)), None, "late: due at once");
        let tiny = at(7, 30) - chrono::Duration::microseconds(5);
        assert_eq!(env.early_by(tiny), Some(ms(1)));
    }

    #[test]
    fn a_bad_instant_is_refused_naming_its_field() {
        for field in INSTANT_FIELDS {
            for value in ["\"soon\"", "12", "{}"] {
                let body = format!(r#"{{"key":"k1","task":"t","{field}":{value}}}"#);
                let err = Envelope::decode_delivered(body.as_bytes(), &arrival()).unwrap_err();
                assert!(matches!(err, DecodeError::Instant { field: f, .. } if f == field));
                assert!(err.to_string().contains(field), "{err}");
            }
        }
        let null = br#"{"key":"k1","task":"t","not_before":null}"#;
        assert!(Envelope::decode_delivered(null, &arrival()).is_ok());
    }

    #[test]
    fn an_expiry_not_after_not_before_is_malformed() {
        let mut env = scheduled("j");
        env.not_before = Some(at(8, 0));
        env.expires_at = Some(at(8, 0));
        let refused = env.check(|_: &str| false).unwrap_err();
        assert!(matches!(refused, Malformed::NeverDue { .. }));
        assert!(refused.to_string().contains("not_before"), "{refused}");
        env.expires_at = Some(at(8, 1));
        assert_eq!(env.check(|_: &str| false), Ok(()));
    }

    #[test]
    fn key_and_task_are_required() {
        for body in [&br#"{"task":"report"}"#[..], br#"{"key":"k1"}"#] {
            assert!(matches!(
                Envelope::decode_delivered(body, &arrival()),
                Err(DecodeError::Malformed(_))
            ));
        }
    }

    #[test]
    fn a_message_drumline_wrote_decodes_alone_and_the_same() {
        let env = scheduled("j");
        let traced = Arrival {
            trace: env.trace,
            ..arrival()
        };
        assert_eq!(
            Envelope::decode_delivered(&env.encode(), &traced).unwrap(),
            env
        );
        let env = Envelope { trace: None, ..env };
        assert_eq!(Envelope::decode(&env.encode()).unwrap(), env);
    }
}
