//! drumline's own spans (docs/operations.md#traces): `publish`, `claim`, `run` and `finish`,
//! recorded where they happen and handed to the exporter `[telemetry] otlp_endpoint` installs
//! (`telemetry.rs`, feature `bin-support`). Without one, [`record`] does nothing and
//! [`enabled`] says so, so nothing is built for a span nobody exports.

use crate::envelope::Envelope;
use crate::trace::TraceParent;
use std::sync::OnceLock;
use std::time::SystemTime;

/// One finished span.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// `publish`, `claim`, `run` or `finish`.
    pub name: &'static str,
    /// Its trace and its own span id.
    pub context: TraceParent,
    /// The span id of its parent, if it has one.
    pub parent: Option<u64>,
    /// When it started.
    pub start: SystemTime,
    /// When it ended.
    pub end: SystemTime,
    /// `drumline.key`, `drumline.task`, … with their values.
    pub attributes: Vec<(&'static str, String)>,
    /// It ended in failure (a run that failed, a publish or write that did not go through).
    pub failed: bool,
}

impl Span {
    /// A span `name` of `context` under `parent`, from `start` to now, without attributes.
    pub fn ended_now(
        name: &'static str,
        context: TraceParent,
        parent: Option<&TraceParent>,
        start: SystemTime,
    ) -> Self {
        Span {
            name,
            context,
            parent: parent.map(|p| p.span_id),
            start,
            end: SystemTime::now(),
            attributes: Vec::new(),
            failed: false,
        }
    }

    /// Span `name` of `env`'s instance with id `context` under `parent` (when of the same
    /// trace), from `start` to now: `drumline.key`, `.task`, `.attempt`.
    pub fn of(
        name: &'static str,
        env: &Envelope,
        (context, parent): (TraceParent, Option<TraceParent>),
        start: SystemTime,
    ) -> Self {
        let parent = parent.filter(|p| p.trace_id == context.trace_id);
        Span::ended_now(name, context, parent.as_ref(), start)
            .with("drumline.key", &env.key)
            .with("drumline.task", &env.task)
            .with("drumline.attempt", env.attempt)
    }

    /// The `publish` span of `env` (its `trace`, under `parent` when that is of the same
    /// trace), from `start` to now; `None` when it has no trace.
    pub fn publish(
        env: &Envelope,
        parent: Option<&TraceParent>,
        start: SystemTime,
    ) -> Option<Self> {
        let context = env.trace?;
        let parent = parent.filter(|p| p.trace_id == context.trace_id);
        let span = Span::ended_now("publish", context, parent, start)
            .with("drumline.key", &env.key)
            .with("drumline.task", &env.task)
            .with("drumline.queue", &env.queue);
        Some(span)
    }

    /// With attribute `name` = `value`.
    pub fn with(mut self, name: &'static str, value: impl ToString) -> Self {
        self.attributes.push((name, value.to_string()));
        self
    }

    /// Marked failed when `failed`.
    pub fn failed_if(mut self, failed: bool) -> Self {
        self.failed = failed;
        self
    }
}

/// Where finished spans go.
pub trait Exporter: Send + Sync {
    /// Takes one span (queues it: never blocks on the network).
    fn export(&self, span: Span);
    /// Sends what is queued and stops; later spans are dropped.
    fn shutdown(&self);
}

static EXPORTER: OnceLock<Box<dyn Exporter>> = OnceLock::new();

/// Installs the process's exporter; `false` when one already was (the first stays).
pub fn install(exporter: Box<dyn Exporter>) -> bool {
    EXPORTER.set(exporter).is_ok()
}

/// Spans are exported: an exporter is installed.
pub fn enabled() -> bool {
    EXPORTER.get().is_some()
}

/// Exports `span`, or drops it when no exporter is installed.
pub fn record(span: Span) {
    if let Some(exporter) = EXPORTER.get() {
        exporter.export(span);
    }
}

/// Sends what is queued and stops the exporter, if any (at exit).
pub fn shutdown() {
    if let Some(exporter) = EXPORTER.get() {
        exporter.shutdown();
    }
}
