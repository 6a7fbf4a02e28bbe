//! The message on the wire, AMQP side: an envelope's properties and headers, and the headers
//! read back (the body and its rules are `drumline_core::envelope`).

use chrono::{DateTime, Utc};
use drumline_core::envelope::{
    bounded_short, format_instant, Envelope, H_ATTEMPT, H_ATTEMPTS, H_EPOCH, H_ERROR, H_REASON,
    H_SCHEDULED_FOR, H_TASK,
};
use drumline_core::trace::{TraceParent, H_TRACEPARENT};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::BasicProperties;

/// `env`'s AMQP properties: persistent, JSON, `message_id` = key, timestamp, expiration and the
/// drumline headers, `x-drumline-epoch` included: the leader's epoch on what the beat
/// publishes, 0 on ad-hoc tasks and replays, the original's on retries (docs/design.md); and
/// `traceparent` when the envelope has a trace.
pub fn properties(env: &Envelope, now: DateTime<Utc>, epoch: u64) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(H_TASK.into(), long_string(&env.task));
    headers.insert(H_ATTEMPT.into(), AMQPValue::LongLongInt(env.attempt as i64));
    headers.insert(
        H_SCHEDULED_FOR.into(),
        long_string(&format_instant(env.scheduled_for)),
    );
    headers.insert(H_EPOCH.into(), AMQPValue::LongLongInt(epoch as i64));
    if let Some(trace) = env.trace {
        headers.insert(H_TRACEPARENT.into(), long_string(&trace.to_string()));
    }
    let mut props = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type(ShortString::from("application/json"))
        .with_message_id(ShortString::from(bounded_short(&env.key)))
        .with_timestamp(now.timestamp().max(0) as u64)
        .with_headers(headers);
    if let Some(at) = env.expires_at {
        let left = (at - now).num_milliseconds().max(1);
        props = props.with_expiration(ShortString::from(left.to_string()));
    }
    props
}

/// Why a message is dead-lettered, as its dead letter's headers say.
#[derive(Debug, Clone, Copy)]
pub struct DeadHeaders<'a> {
    /// `x-drumline-reason`.
    pub reason: &'a str,
    /// `x-drumline-error`.
    pub error: &'a str,
    /// `x-drumline-attempts`: the runs made.
    pub attempts: u32,
}

/// The properties of a dead letter of a message with properties `from`: its headers with the
/// reason headers added, its message id and content type, persistent, stamped `now`, without
/// any per-message expiration (docs/design.md).
pub fn dead_letter_properties(
    from: &BasicProperties,
    why: DeadHeaders<'_>,
    now: DateTime<Utc>,
) -> BasicProperties {
    let mut headers = from.headers().clone().unwrap_or_default();
    headers.insert(H_REASON.into(), long_string(why.reason));
    headers.insert(H_ERROR.into(), long_string(why.error));
    headers.insert(
        H_ATTEMPTS.into(),
        AMQPValue::LongLongInt(why.attempts as i64),
    );
    let mut out = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers)
        .with_timestamp(now.timestamp().max(0) as u64);
    if let Some(id) = from.message_id() {
        out = out.with_message_id(id.clone());
    }
    if let Some(ct) = from.content_type() {
        out = out.with_content_type(ct.clone());
    }
    out
}

/// A header value as an AMQP long string.
pub fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// Reads a string header, if present.
pub fn header_str(headers: Option<&FieldTable>, name: &str) -> Option<String> {
    let value = headers?.inner().get(name)?;
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// Reads the `traceparent` header: `None` when absent or not a valid W3C one (a bad one is
/// ignored, never a reason to refuse the message).
pub fn header_trace(headers: Option<&FieldTable>) -> Option<TraceParent> {
    header_str(headers, H_TRACEPARENT)?.parse().ok()
}

/// Reads an integer header, if present.
pub fn header_int(headers: Option<&FieldTable>, name: &str) -> Option<i64> {
    match headers?.inner().get(name)? {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(*n as i64),
        AMQPValue::ShortInt(n) => Some(*n as i64),
        AMQPValue::LongUInt(n) => Some(*n as i64),
        _ => None,
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
    fn properties_carry_key_headers_and_expiration() {
        let env = Envelope::scheduled(
            "j",
            "t",
            "q",
            serde_json::json!({}),
            at(7, 30),
            Some(at(7, 31)),
            at(7, 30),
        );
        let untraced = Envelope {
            trace: None,
            ..env.clone()
        };
        let untraced = properties(&untraced, at(7, 30), 3);
        assert_eq!(header_trace(untraced.headers().as_ref()), None);
        let props = properties(&env, at(7, 30), 3);
        assert!(env.trace.is_some(), "a scheduled instance starts a trace");
        assert_eq!(header_trace(props.headers().as_ref()), env.trace);
        assert_eq!(props.message_id().as_ref().unwrap().as_str(), env.key);
        assert_eq!(*props.delivery_mode(), Some(2));
        assert_eq!(props.expiration().as_ref().unwrap().as_str(), "60000");
        let headers = props.headers().as_ref();
        assert_eq!(header_str(headers, H_TASK).as_deref(), Some("t"));
        assert_eq!(header_int(headers, H_ATTEMPT), Some(0));
        assert_eq!(header_int(headers, H_EPOCH), Some(3));
        assert_eq!(
            header_str(headers, H_SCHEDULED_FOR).as_deref(),
            Some("2026-03-08T07:30:00Z")
        );
    }

    #[test]
    fn a_dead_letter_keeps_the_headers_and_drops_the_expiration() {
        let env = Envelope::scheduled(
            "j",
            "t",
            "q",
            serde_json::json!({}),
            at(7, 30),
            Some(at(7, 31)),
            at(7, 30),
        );
        let why = DeadHeaders {
            reason: "expired",
            error: "late",
            attempts: 2,
        };
        let dead = dead_letter_properties(&properties(&env, at(7, 30), 3), why, at(8, 0));
        assert_eq!(dead.message_id().as_ref().unwrap().as_str(), env.key);
        assert_eq!(*dead.expiration(), None);
        assert_eq!(*dead.timestamp(), Some(at(8, 0).timestamp() as u64));
        let headers = dead.headers().as_ref();
        assert_eq!(header_int(headers, H_EPOCH), Some(3));
        assert_eq!(header_str(headers, H_REASON).as_deref(), Some("expired"));
        assert_eq!(header_str(headers, H_ERROR).as_deref(), Some("late"));
        assert_eq!(header_int(headers, H_ATTEMPTS), Some(2));
    }
}
