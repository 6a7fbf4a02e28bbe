//! Every exchange, queue and Redis key name, derived from the namespace in one place
//! (docs/design.md), so a grep finds them all and tests isolate by namespace.

use std::time::Duration;

/// Most bytes in a namespace, job, task or queue name (docs/design.md "Limits and validation").
/// With the fixed parts around them, every derived AMQP name stays below the 255-byte
/// short-string limit.
pub const MAX_NAME_BYTES: usize = 100;

/// Most bytes in an idempotency key (`{job}@{instant}`, or an ad-hoc `--key`).
pub const MAX_KEY_BYTES: usize = 200;

/// Why a name or an idempotency key is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidName {
    /// Nothing at all.
    #[error("must not be empty")]
    Empty,
    /// Longer than the limit.
    #[error("is {len} bytes long; at most {max} are allowed")]
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A name character outside `[A-Za-z0-9._-]`.
    #[error("contains {found:?}; use only letters, digits, '.', '-' and '_'")]
    BadChar {
        /// The first offending character.
        found: char,
    },
    /// A key character that is whitespace or not printable.
    #[error("contains {found:?}; whitespace and control characters are not allowed")]
    Unprintable {
        /// The first offending character.
        found: char,
    },
}

/// Checks a namespace, job, task or queue name: 1 to [`MAX_NAME_BYTES`] bytes of
/// `[A-Za-z0-9._-]`. These names become parts of AMQP names and Redis keys, and a job name is
/// the first half of every idempotency key, so `@`, `:` and whitespace never appear in them.
pub fn check_name(name: &str) -> Result<(), InvalidName> {
    check_len(name, MAX_NAME_BYTES)?;
    match name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')))
    {
        Some(found) => Err(InvalidName::BadChar { found }),
        None => Ok(()),
    }
}

/// The length rule names and keys share: 1 to `max` bytes.
fn check_len(text: &str, max: usize) -> Result<(), InvalidName> {
    match text.len() {
        0 => Err(InvalidName::Empty),
        len if len > max => Err(InvalidName::TooLong { len, max }),
        _ => Ok(()),
    }
}

/// Checks an idempotency key: 1 to [`MAX_KEY_BYTES`] bytes, printable, no whitespace.
pub fn check_key(key: &str) -> Result<(), InvalidName> {
    check_len(key, MAX_KEY_BYTES)?;
    match key.chars().find(|c| c.is_whitespace() || c.is_control()) {
        Some(found) => Err(InvalidName::Unprintable { found }),
        None => Ok(()),
    }
}

/// Name builder for one namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    ns: String,
}

impl Names {
    /// Names for namespace `ns`.
    pub fn new(ns: impl Into<String>) -> Self {
        Self { ns: ns.into() }
    }

    /// The namespace itself.
    pub fn namespace(&self) -> &str {
        &self.ns
    }

    // ---- RabbitMQ ----

    /// Work exchange `{ns}.tasks` (direct, durable).
    pub fn tasks_exchange(&self) -> String {
        format!("{}.tasks", self.ns)
    }

    /// Work queue `{ns}.q.{queue}`; bound to the work exchange with routing key `{queue}`.
    pub fn work_queue(&self, queue: &str) -> String {
        format!("{}.q.{queue}", self.ns)
    }

    /// The logical queue a message published with `routing_key` is for: the key itself
    /// (published to `{ns}.tasks`), or `{queue}` when it names the work queue `{ns}.q.{queue}`
    /// (published to it straight, through the default exchange). The default of a producer's
    /// missing `queue` (docs/envelope.md).
    pub fn logical_queue<'a>(&self, routing_key: &'a str) -> &'a str {
        routing_key
            .strip_prefix(self.ns.as_str())
            .and_then(|rest| rest.strip_prefix(".q."))
            .filter(|queue| !queue.is_empty())
            .unwrap_or(routing_key)
    }

    /// Delay queue `{ns}.delay.{queue}.{ms}`: every message in it waits exactly `delay`, then
    /// dead-letters back to the work exchange with routing key `{queue}`. One queue per
    /// (queue, delay) pair keeps expiry FIFO, so there is no head-of-line blocking.
    pub fn delay_queue(&self, queue: &str, delay: Duration) -> String {
        format!("{}.delay.{queue}.{}", self.ns, delay.as_millis())
    }

    /// Dead-letter exchange (fanout) and queue, both `{ns}.dead`.
    pub fn dead(&self) -> String {
        format!("{}.dead", self.ns)
    }

    /// `{ns}.dead.watch`: a second queue bound to the dead-letter exchange, which workers
    /// consume to journal what the broker expired (docs/design.md#rabbitmq).
    pub fn dead_watch(&self) -> String {
        format!("{}.dead.watch", self.ns)
    }

    // ---- Redis ----

    /// `{ns}:run:{key}` — claim/result state of one instance (hash).
    pub fn run_key(&self, key: &str) -> String {
        format!("{}:run:{key}", self.ns)
    }

    /// `{ns}:fence` — the fencing counter.
    pub fn fence(&self) -> String {
        format!("{}:fence", self.ns)
    }

    /// `{ns}:job:{job}:running` — the overlap lock.
    pub fn job_running(&self, job: &str) -> String {
        format!("{}:job:{job}:running", self.ns)
    }

    /// `{ns}:journal` — the stream of fate decisions: claims, outcomes, what the leader
    /// published or dropped (docs/design.md#journal).
    pub fn journal(&self) -> String {
        format!("{}:journal", self.ns)
    }

    /// `{ns}:waiters:{job}` — copies of the job's instances waiting for its overlap lock, in
    /// arrival order; the worker that releases the lock publishes the first again
    /// (docs/design.md#waiting-copies-wake-up).
    pub fn waiters(&self, job: &str) -> String {
        format!("{}:waiters:{job}", self.ns)
    }

    /// `{ns}:beat:leader` — the leader lease.
    pub fn beat_leader(&self) -> String {
        format!("{}:beat:leader", self.ns)
    }

    /// `{ns}:beat:epoch` — the leadership epoch counter (one increment per acquisition).
    pub fn beat_epoch(&self) -> String {
        format!("{}:beat:epoch", self.ns)
    }

    /// `{ns}:beat:last:{job}` — last published instant (RFC 3339 UTC).
    pub fn beat_last(&self, job: &str) -> String {
        format!("{}:beat:last:{job}", self.ns)
    }

    /// `{ns}:beat:rule:{job}` — the rule (schedule) the job's progress was recorded under.
    pub fn beat_rule(&self, job: &str) -> String {
        format!("{}:beat:rule:{job}", self.ns)
    }

    /// `{ns}:paused` — the set of paused jobs.
    pub fn paused(&self) -> String {
        format!("{}:paused", self.ns)
    }

    /// `{ns}:history:{job}` — capped list of run records.
    pub fn history(&self, job: &str) -> String {
        format!("{}:history:{job}", self.ns)
    }

    /// `{ns}:last_success:{job}` — RFC 3339 UTC of the last success.
    pub fn last_success(&self, job: &str) -> String {
        format!("{}:last_success:{job}", self.ns)
    }

    /// `{ns}:last_failure:{job}` — RFC 3339 UTC of the last failed, dead or expired run.
    pub fn last_failure(&self, job: &str) -> String {
        format!("{}:last_failure:{job}", self.ns)
    }

    /// `{ns}:running:{job}` — the job's instances running now: a sorted set of idempotency
    /// keys scored by lease expiry (ms since the epoch, Redis `TIME`), so the entry of a killed
    /// worker ages out (docs/design.md "`status` costs O(jobs)").
    pub fn running(&self, job: &str) -> String {
        format!("{}:running:{job}", self.ns)
    }

    /// `{ns}:limit:{name}:slots` — a concurrency group's slots: a sorted set of the claim
    /// tokens holding one, scored by lease expiry (ms, Redis `TIME`), moved by each renewal, so
    /// a killed worker's slot frees when its lease lapses (docs/design.md#limits).
    pub fn limit_slots(&self, limit: &str) -> String {
        format!("{}:limit:{limit}:slots", self.ns)
    }

    /// `{ns}:limit:{name}:starts` — a rate limit's sliding window: a sorted set of claim
    /// tokens scored by their start stamp (ms, Redis `TIME`; one ahead of now is a reserved
    /// start) (docs/design.md#limits).
    pub fn limit_starts(&self, limit: &str) -> String {
        format!("{}:limit:{limit}:starts", self.ns)
    }

    /// `{ns}:worker:{id}` — a live worker's announcement: a hash (host, pid, version, queues,
    /// concurrency, running, started) with a TTL, refreshed while the worker runs
    /// (docs/design.md#queues-and-workers).
    pub fn worker(&self, id: &str) -> String {
        format!("{}:worker:{id}", self.ns)
    }

    /// `{ns}:objects:{kind}` — the objects applied at run time of one kind (`schedules`,
    /// `calendars`): a hash, name → the object's canonical JSON
    /// (docs/design.md#schedules-as-data).
    pub fn objects(&self, kind: &str) -> String {
        format!("{}:objects:{kind}", self.ns)
    }

    /// `{ns}:objects:{kind}:times` — when each object was created and last changed: a hash,
    /// name → `"CREATED_MS UPDATED_MS"`.
    pub fn object_times(&self, kind: &str) -> String {
        format!("{}:objects:{kind}:times", self.ns)
    }

    /// `{ns}:objects:feed` — the change feed: a stream with one entry (`kind`, `name`, `op`)
    /// per object put or deleted, which the leader follows (docs/design.md#schedules-as-data).
    pub fn object_feed(&self) -> String {
        format!("{}:objects:feed", self.ns)
    }

    /// The set of the ids of the workers that announced themselves ([`worker`](Self::worker)
    /// keys), so that reading them never scans the keyspace.
    pub fn workers(&self) -> String {
        format!("{}:workers", self.ns)
    }
}

/// This machine's host name (`unknown` if it has none readable), as recorded in worker ids and
/// the leader lease.
pub fn host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The length rule every check shares: each of `ok` passes, so does `max` bytes of `fill`;
    /// one byte more is `TooLong` and "" is `Empty`.
    fn assert_length_rule(
        check: fn(&str) -> Result<(), InvalidName>,
        ok: &[&str],
        fill: &str,
        max: usize,
    ) {
        for text in ok {
            assert_eq!(check(text), Ok(()), "{text:?}");
        }
        assert_eq!(check(&fill.repeat(max)), Ok(()));
        let len = max + 1;
        assert_eq!(
            check(&fill.repeat(len)),
            Err(InvalidName::TooLong { len, max })
        );
        assert_eq!(check(""), Err(InvalidName::Empty));
    }

    #[test]
    fn name_rule() {
        assert_eq!(MAX_NAME_BYTES, 100);
        assert_length_rule(check_name, &["nightly-report_2.v1"], "a", MAX_NAME_BYTES);
        for (bad, found) in [
            ("a b", ' '),
            ("a@b", '@'),
            ("a:b", ':'),
            ("é", 'é'),
            ("a/b", '/'),
        ] {
            assert_eq!(
                check_name(bad),
                Err(InvalidName::BadChar { found }),
                "{bad}"
            );
        }
    }

    #[test]
    fn key_rule() {
        assert_eq!(MAX_KEY_BYTES, 200);
        let ok = ["nightly@2026-03-08T07:30:00Z", "ünïcode/ok:1"];
        assert_length_rule(check_key, &ok, "k", MAX_KEY_BYTES);
        let unprintable = [' ', '\t', '\n', '\u{7f}', '\u{a0}'];
        for found in unprintable {
            let bad = format!("a{found}b");
            assert_eq!(
                check_key(&bad),
                Err(InvalidName::Unprintable { found }),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn names_follow_the_design_table() {
        let n = Names::new("acme");
        assert_eq!(n.tasks_exchange(), "acme.tasks");
        assert_eq!(n.work_queue("default"), "acme.q.default");
        assert_eq!(n.logical_queue("default"), "default");
        assert_eq!(n.logical_queue("acme.q.default"), "default");
        assert_eq!(n.logical_queue("other.q.default"), "other.q.default");
        assert_eq!(
            n.delay_queue("default", Duration::from_millis(1500)),
            "acme.delay.default.1500"
        );
        assert_eq!(n.dead(), "acme.dead");
        assert_eq!(n.dead_watch(), "acme.dead.watch");
        assert_eq!(
            n.run_key("j@2026-03-08T07:30:00Z"),
            "acme:run:j@2026-03-08T07:30:00Z"
        );
        assert_eq!(n.fence(), "acme:fence");
        assert_eq!(n.job_running("j"), "acme:job:j:running");
        assert_eq!(n.beat_leader(), "acme:beat:leader");
        assert_eq!(n.beat_last("j"), "acme:beat:last:j");
        assert_eq!(n.beat_rule("j"), "acme:beat:rule:j");
        assert_eq!(n.history("j"), "acme:history:j");
        assert_eq!(n.last_success("j"), "acme:last_success:j");
        assert_eq!(n.last_failure("j"), "acme:last_failure:j");
        assert_eq!(n.running("j"), "acme:running:j");
    }
}
