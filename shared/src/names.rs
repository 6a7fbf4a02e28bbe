//! Every exchange, queue and Redis key name, derived from the namespace in one place
//! (DESIGN §3, §5), so a grep finds them all and tests isolate by namespace.

use std::time::Duration;

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

    /// `{ns}:beat:leader` — the leader lease.
    pub fn beat_leader(&self) -> String {
        format!("{}:beat:leader", self.ns)
    }

    /// `{ns}:beat:last:{job}` — last published instant (RFC 3339 UTC).
    pub fn beat_last(&self, job: &str) -> String {
        format!("{}:beat:last:{job}", self.ns)
    }

    /// `{ns}:history:{job}` — capped list of run records.
    pub fn history(&self, job: &str) -> String {
        format!("{}:history:{job}", self.ns)
    }

    /// `{ns}:last_success:{job}` — RFC 3339 UTC of the last success.
    pub fn last_success(&self, job: &str) -> String {
        format!("{}:last_success:{job}", self.ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_design_table() {
        let n = Names::new("acme");
        assert_eq!(n.tasks_exchange(), "acme.tasks");
        assert_eq!(n.work_queue("default"), "acme.q.default");
        assert_eq!(
            n.delay_queue("default", Duration::from_millis(1500)),
            "acme.delay.default.1500"
        );
        assert_eq!(n.dead(), "acme.dead");
        assert_eq!(
            n.run_key("j@2026-03-08T07:30:00Z"),
            "acme:run:j@2026-03-08T07:30:00Z"
        );
        assert_eq!(n.fence(), "acme:fence");
        assert_eq!(n.job_running("j"), "acme:job:j:running");
        assert_eq!(n.beat_leader(), "acme:beat:leader");
        assert_eq!(n.beat_last("j"), "acme:beat:last:j");
        assert_eq!(n.history("j"), "acme:history:j");
        assert_eq!(n.last_success("j"), "acme:last_success:j");
    }
}
