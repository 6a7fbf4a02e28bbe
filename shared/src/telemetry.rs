//! `[telemetry] otlp_endpoint`: drumline's spans ([`crate::spans`]) exported by OTLP/HTTP
//! (JSON) with the `opentelemetry` crates, through a batch processor on a thread of its own,
//! sent on shutdown (docs/operations.md#traces). Feature `bin-support`: the library users and
//! the producer client do without these crates; without the key none of it starts.

use crate::config::TelemetryConfig;
use crate::spans::{self, Span};
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::{
    BatchSpanProcessor, SpanData, SpanEvents, SpanLinks, SpanProcessor,
};
use opentelemetry_sdk::Resource;

/// Why the exporter could not be built.
#[derive(Debug, thiserror::Error)]
#[error("[telemetry] otlp_endpoint {endpoint}: {source}")]
pub struct TelemetryError {
    endpoint: String,
    source: opentelemetry_otlp::ExporterBuildError,
}

/// Starts exporting spans to `config`'s endpoint as service `drumline` (once per process; a
/// second call does nothing). Without an endpoint, nothing starts.
pub fn start(config: &TelemetryConfig) -> Result<(), TelemetryError> {
    let Some(base) = &config.otlp_endpoint else {
        return Ok(());
    };
    if spans::enabled() {
        return Ok(());
    }
    let endpoint = format!("{}/v1/traces", base.trim_end_matches('/'));
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpJson)
        .with_endpoint(&endpoint)
        .build()
        .map_err(|source| TelemetryError { endpoint, source })?;
    let mut processor = BatchSpanProcessor::builder(exporter).build();
    processor.set_resource(&Resource::builder().with_service_name("drumline").build());
    let scope = InstrumentationScope::builder("drumline")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    spans::install(Box::new(Otlp { processor, scope }));
    Ok(())
}

/// The installed exporter: spans become `SpanData` for the batch processor.
struct Otlp {
    processor: BatchSpanProcessor,
    scope: InstrumentationScope,
}

impl spans::Exporter for Otlp {
    fn export(&self, span: Span) {
        self.processor.on_end(span_data(span, &self.scope));
    }

    fn shutdown(&self) {
        if let Err(e) = self.processor.shutdown() {
            tracing::warn!(error = %e, "could not send the last spans");
        }
    }
}

/// `span` as the SDK's exportable span.
fn span_data(span: Span, scope: &InstrumentationScope) -> SpanData {
    let context = SpanContext::new(
        TraceId::from_bytes(span.context.trace_id.to_be_bytes()),
        SpanId::from_bytes(span.context.span_id.to_be_bytes()),
        TraceFlags::new(span.context.flags),
        false,
        TraceState::default(),
    );
    let kind = match span.name {
        "publish" => SpanKind::Producer,
        "run" => SpanKind::Consumer,
        _ => SpanKind::Internal,
    };
    SpanData {
        span_context: context,
        parent_span_id: span
            .parent
            .map_or(SpanId::INVALID, |p| SpanId::from_bytes(p.to_be_bytes())),
        parent_span_is_remote: span.parent.is_some(),
        span_kind: kind,
        name: span.name.into(),
        start_time: span.start,
        end_time: span.end,
        attributes: (span.attributes.into_iter())
            .map(|(k, v)| KeyValue::new(k, v))
            .collect(),
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status: match span.failed {
            true => Status::error("failed"),
            false => Status::Unset,
        },
        instrumentation_scope: scope.clone(),
    }
}
