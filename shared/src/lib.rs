//! drumline-shared: the binaries' plumbing (flags, logging, the metrics server, signals,
//! systemd), and under one name the crates by role: `drumline-core` (config, message, names,
//! schedule math), `drumline-store` (the one door to Redis), `drumline-broker` (the one door to
//! RabbitMQ) and `drumline-client` (the producer client), re-exported under their old paths.
//!
//! Which module does what, and what each may touch, is the module map in the repository's
//! `docs/design.md` ("Module map"): the one place it is kept.
//!
//! The feature `bin-support` (off by default) adds what only the binaries need: clap, axum,
//! tracing-subscriber and prometheus-client stay out of a library user's build.

#[cfg(feature = "bin-support")]
pub mod cli;
#[cfg(feature = "bin-support")]
pub mod exit;
#[cfg(feature = "bin-support")]
pub mod logging;
#[cfg(feature = "bin-support")]
pub mod metrics;
#[cfg(feature = "bin-support")]
pub mod process_metrics;
pub mod signals;
#[cfg(feature = "bin-support")]
pub mod systemd;

pub use drumline_broker as broker;
pub use drumline_client as client;
pub use drumline_core::{
    backoff, config, duration, envelope, jitter, limit, names, planted, run, schedule, table, tls,
    url,
};
pub use drumline_store as store;
