//! W3C trace context (docs/envelope.md#trace-context): the `traceparent` a message carries from its
//! producer to its run, `00-{trace id}-{span id}-{flags}` in lowercase hex. Pure, but for the
//! random ids and [`TraceParent::from_env`].

use uuid::Uuid;

/// The AMQP header (and HTTP header) that carries it.
pub const H_TRACEPARENT: &str = "traceparent";

/// The environment variable a producer's own context comes in, and a shell task's goes out in.
pub const TRACEPARENT_VAR: &str = "TRACEPARENT";

/// A span's place in a trace: the trace, the span, and the sampled flag, as `traceparent`
/// writes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    /// The trace: 16 bytes, never all zero.
    pub trace_id: u128,
    /// The span: 8 bytes, never all zero.
    pub span_id: u64,
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

/// Why a `traceparent` text was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>, ids not all zero): {0:?}")]
pub struct InvalidTraceParent(pub String);

impl TraceParent {
    /// The first span of a new trace, sampled.
    pub fn root() -> Self {
        TraceParent {
            trace_id: nonzero_u128(),
            span_id: nonzero_u64(),
            flags: 1,
        }
    }

    /// A span of the same trace whose parent is this one: a new span id, the same flags.
    pub fn child(&self) -> Self {
        TraceParent {
            span_id: nonzero_u64(),
            ..*self
        }
    }

    /// A producer's span: a child of the context in `TRACEPARENT` when it holds a valid one,
    /// else the root of a new trace (docs/envelope.md#trace-context).
    pub fn from_env() -> Self {
        TraceParent::env_parent().map_or_else(TraceParent::root, |parent| parent.child())
    }

    /// The valid context in `TRACEPARENT`, if any: the parent of [`TraceParent::from_env`].
    pub fn env_parent() -> Option<Self> {
        std::env::var(TRACEPARENT_VAR).ok()?.parse().ok()
    }

    /// A child of `parent` when it is a valid `traceparent`, else the root of a new trace.
    pub fn continuing(parent: Option<&str>) -> Self {
        parent
            .and_then(|text| text.parse::<TraceParent>().ok())
            .map_or_else(TraceParent::root, |parent| parent.child())
    }

    /// The trace id as 32 lowercase hex digits.
    pub fn trace_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The span id as 16 lowercase hex digits.
    pub fn span_hex(&self) -> String {
        format!("{:016x}", self.span_id)
    }
}

impl std::fmt::Display for TraceParent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.span_id, self.flags
        )
    }
}

impl std::str::FromStr for TraceParent {
    type Err = InvalidTraceParent;

    /// Version `00` exactly; a later version's first four fields (what follows them is that
    /// version's own); never version `ff`, uppercase hex or an all-zero id (W3C trace context).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let invalid = || InvalidTraceParent(text.chars().take(80).collect());
        let fields: Vec<&str> = text.splitn(5, '-').collect();
        let [version, trace, span, flags, rest @ ..] = fields.as_slice() else {
            return Err(invalid());
        };
        let future = match *version {
            "00" => false,
            "ff" => return Err(invalid()),
            v if is_hex(v, 2) => true,
            _ => return Err(invalid()),
        };
        let flags = flags.get(..2).filter(|_| future).unwrap_or(flags);
        if (!future && !rest.is_empty()) || !is_hex(trace, 32) || !is_hex(span, 16) {
            return Err(invalid());
        }
        if !is_hex(flags, 2) {
            return Err(invalid());
        }
        let parsed = TraceParent {
            trace_id: u128::from_str_radix(trace, 16).map_err(|_| invalid())?,
            span_id: u64::from_str_radix(span, 16).map_err(|_| invalid())?,
            flags: u8::from_str_radix(flags, 16).map_err(|_| invalid())?,
        };
        if parsed.trace_id == 0 || parsed.span_id == 0 {
            return Err(invalid());
        }
        Ok(parsed)
    }
}

/// `len` lowercase hex digits.
fn is_hex(text: &str, len: usize) -> bool {
    text.len() == len && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn nonzero_u128() -> u128 {
    loop {
        let id = Uuid::new_v4().as_u128();
        if id != 0 {
            return id;
        }
    }
}

fn nonzero_u64() -> u64 {
    loop {
        let id = rand::random::<u64>();
        if id != 0 {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIVEN: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_round_trips() {
        let t: TraceParent = GIVEN.parse().unwrap();
        assert_eq!(t.trace_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.span_hex(), "00f067aa0ba902b7");
        assert_eq!(t.flags, 1);
        assert_eq!(t.to_string(), GIVEN);
    }

    #[test]
    fn a_child_keeps_the_trace_and_flags_with_a_new_span() {
        let t: TraceParent = GIVEN.parse().unwrap();
        let c = t.child();
        assert_eq!((c.trace_id, c.flags), (t.trace_id, t.flags));
        assert_ne!(c.span_id, t.span_id);
        assert_eq!(c.to_string().parse::<TraceParent>().unwrap(), c);
        let r = TraceParent::root();
        assert_ne!(r.trace_id, t.trace_id);
        assert_eq!(r.to_string().len(), 55);
    }

    #[test]
    fn bad_ones_are_refused() {
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(bad.parse::<TraceParent>().is_err(), "{bad:?}");
        }
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-whatever";
        assert!(later.parse::<TraceParent>().is_ok());
    }

    #[test]
    fn continuing_takes_a_valid_parent_or_starts_a_trace() {
        let t: TraceParent = GIVEN.parse().unwrap();
        assert_eq!(TraceParent::continuing(Some(GIVEN)).trace_id, t.trace_id);
        assert_ne!(TraceParent::continuing(Some("junk")).trace_id, t.trace_id);
        assert_ne!(TraceParent::continuing(None).trace_id, t.trace_id);
    }
}
