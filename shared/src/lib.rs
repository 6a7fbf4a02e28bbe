//! drumline-shared: the pieces the beat and the workers agree on — the config, the message,
//! every name, schedule math, the one door to RabbitMQ ([`broker`]) and the one door to Redis
//! ([`store`]).
//!
//! Which module does what, and what each may touch, is the module map in the repository's
//! `docs/design.md` ("Module map"): the one place it is kept.
//!
//! The feature `bin-support` (off by default) adds what only the binaries need: clap, axum,
//! tracing-subscriber and prometheus-client stay out of a library user's build.

pub mod backoff;
pub mod broker;
#[cfg(feature = "bin-support")]
pub mod cli;
pub mod client;
pub mod config;
pub mod duration;
pub mod envelope;
#[cfg(feature = "bin-support")]
pub mod exit;
pub mod jitter;
pub mod limit;
#[cfg(feature = "bin-support")]
pub mod logging;
#[cfg(feature = "bin-support")]
pub mod metrics;
pub mod names;
pub mod planted;
#[cfg(feature = "bin-support")]
pub mod process_metrics;
pub mod run;
pub mod schedule;
pub mod signals;
pub mod store;
#[cfg(feature = "bin-support")]
pub mod systemd;
pub mod table;
pub mod tls;
pub mod url;
