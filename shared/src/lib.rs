//! drumline-shared: the pieces the beat and the workers agree on.
//!
//! - [`broker`]   — the one door to RabbitMQ: connect and fail over, declare, publish with
//!   confirms and returns, settle, count dead letters.
//! - [`backoff`]  — the one exponential backoff (min, max, jitter; checked once) every reconnect,
//!   pacing and retry path uses.
//! - [`config`]   — `drumline.toml`: raw form, checked form, one clear error per bad key (a
//!   large file parsed 1,000 `[[jobs]]` at a time).
//! - [`envelope`] — the v1 task message body and its AMQP properties/headers.
//! - `exit`       — the binaries' edge: a command's `Failure` carries its exit code
//!   (feature `bin-support`).
//! - `metrics`    — `--metrics-addr`: Prometheus `/metrics` and `/healthz` (feature `bin-support`).
//! - [`names`]    — every exchange, queue and Redis key name, derived from the namespace.
//! - [`schedule`] — pure schedule math: cron in a time zone with DST policies, fixed-rate intervals.
//! - [`signals`]  — SIGTERM/SIGINT: orderly stop, a second signal exits at once.
//! - [`store`]    — Redis state as atomic Lua scripts: claim, renew, complete, release, last instant.
//! - [`table`]    — aligned plain-text tables for the commands' human output.
//! - [`tls`]      — the CA files of `[broker] ca_file` / `[redis] ca_file`.
//! - [`duration`] — humantime durations in config and on the command line.
//! - [`url`]      — broker and Redis URLs: checked at load, printed with the password as `***`.
//! - `logging`    — tracing set-up shared by both binaries (`--log-format human|json`; feature
//!   `bin-support`).
//!
//! The feature `bin-support` (off by default) adds what only the binaries need: clap, axum,
//! tracing-subscriber and prometheus-client stay out of a library user's build.

pub mod backoff;
pub mod broker;
pub mod config;
pub mod duration;
pub mod envelope;
#[cfg(feature = "bin-support")]
pub mod exit;
#[cfg(feature = "bin-support")]
pub mod logging;
#[cfg(feature = "bin-support")]
pub mod metrics;
pub mod names;
pub mod schedule;
pub mod signals;
pub mod store;
pub mod table;
pub mod tls;
pub mod url;
