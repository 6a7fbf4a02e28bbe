//! drumline-shared: the binaries' plumbing (flags, logging, the metrics server, signals,
//! systemd), and under one name the crates by role: `drumline-core` (config, message, names,
//! schedule math), `drumline-store` (the one door to Redis), `drumline-broker` (the one door to
//! RabbitMQ) and `drumline-client` (the producer client), re-exported under their old paths.
//!
//! Which module does what, and what each may touch, is the map below.
//!
//! The feature `bin-support` (off by default) adds what only the binaries need: clap, axum,
//! tracing-subscriber and prometheus-client stay out of a library user's build.
//!
//! # Map
//!
//! The binaries' plumbing; it re-exports the crates by role under their old paths
//! (`drumline_shared::store`, `::broker`, `::client`, `::config`, …).
//!
//! - `systemd.rs`: `Type=notify`: `READY=1` at start, `WATCHDOG=1` every half `WATCHDOG_USEC`
//!   (sd-notify; feature `bin-support`). Touches: the systemd notify socket.
//! - `signals.rs`: first SIGTERM/SIGINT stops in order, a second exits 1. Touches: OS signals.
//! - `logging.rs`: tracing subscriber, `--log-format` (feature `bin-support`). Touches: stderr,
//!   global logger.
//! - `dlq.rs`: `dlq list / replay / purge` (the worker's commands and the status page's
//!   buttons). Touches: broker (`{ns}.dead`, via `broker`), Redis (clears `dead` on replay).
//! - `cli.rs`: `Common`: `--config` and `--log-format`, flattened into every binary's parser,
//!   and `Common::load` (the config they name); `run_to_exit`: logging, one tokio runtime, the
//!   command's `Failure` as the exit code (feature `bin-support`).
//! - `metrics.rs`: `/metrics` and `/healthz` HTTP server (feature `bin-support`); `serve_with`
//!   adds a binary's own routes, which is how only the beat serves the status page. Touches: a
//!   TCP listener.
//! - `process_metrics.rs`: `drumline_build_info` and the `process_*` metrics from `/proc/self`
//!   (feature `bin-support`). Touches: reads `/proc/self`.
//! - `spans.rs`: drumline's own spans (`publish`, `claim`, `run`, `finish`) and the one place
//!   they go: the exporter installed, else nowhere. Touches: a process-wide exporter.
//! - `telemetry.rs`: `[telemetry] otlp_endpoint`: the spans by OTLP/HTTP with the
//!   `opentelemetry` crates, flushed at exit (feature `bin-support`). Touches: the network.
//! - `exit.rs`: `Failure` (`Usage` → 2, `Other`/`Reported` → 1) and `report`: both binaries map
//!   a command's outcome to the exit code the same way (feature `bin-support`). Touches:
//!   stderr.

#[cfg(feature = "bin-support")]
pub mod cli;
pub mod dlq;
#[cfg(feature = "bin-support")]
pub mod exit;
#[cfg(feature = "bin-support")]
pub mod logging;
#[cfg(feature = "bin-support")]
pub mod metrics;
#[cfg(feature = "bin-support")]
pub mod process_metrics;
pub mod signals;
pub mod spans;
#[cfg(feature = "bin-support")]
pub mod systemd;
#[cfg(feature = "bin-support")]
pub mod telemetry;

pub use drumline_broker as broker;
pub use drumline_client as client;
pub use drumline_core::{
    backoff, calendar, config, duration, envelope, jitter, limit, names, planted, run, schedule,
    table, tls, trace, url,
};
pub use drumline_store as store;
