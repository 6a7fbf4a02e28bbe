//! drumline-shared: the one door to RabbitMQ ([`broker`]), the one door to Redis ([`store`]),
//! the producer client and the binaries' plumbing; the config, the message, names and schedule
//! math are `drumline-core`'s, re-exported here under their old paths.
//!
//! Which module does what, and what each may touch, is the module map in the repository's
//! `docs/design.md` ("Module map"): the one place it is kept.
//!
//! The feature `bin-support` (off by default) adds what only the binaries need: clap, axum,
//! tracing-subscriber and prometheus-client stay out of a library user's build.

pub mod broker;
#[cfg(feature = "bin-support")]
pub mod cli;
pub mod client;
#[cfg(feature = "bin-support")]
pub mod exit;
#[cfg(feature = "bin-support")]
pub mod logging;
#[cfg(feature = "bin-support")]
pub mod metrics;
#[cfg(feature = "bin-support")]
pub mod process_metrics;
pub mod signals;
pub mod store;
#[cfg(feature = "bin-support")]
pub mod systemd;

pub use drumline_core::{
    backoff, config, duration, envelope, jitter, limit, names, planted, run, schedule, table, tls,
    url,
};
