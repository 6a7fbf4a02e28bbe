//! drumline-core: what every part of drumline agrees on, with no network and no async runtime —
//! the config (parsed and checked), the message, every name, schedule math, jitter, limits,
//! backoff, and what a run is. The doors to Redis and RabbitMQ are
//! `drumline-store` and `drumline-broker`.
//!
//! Feature `config` (on by default): the config file and schedules (`config`, `schedule`,
//! `calendar`, with `toml` and `chrono-tz`). The producer client turns it off: the message side
//! (envelope, names, policies, URLs) needs neither.
//!
//! Which module does what, and what each may touch, is the map below.
//!
//! # Map
//!
//! - `backoff.rs`: the one exponential backoff: `Backoff::new(min, max, jitter)` checked once
//!   (a zero `min`, a `max` below it, a jitter outside `[0, 1]` are a typed `BackoffError`;
//!   `Backoff::constant` makes a bad constant a build error), then `next_delay` doubles from
//!   `min` up to `max`, `reset` starts again, `nth(n)` is the same delay statelessly; jitter
//!   only lengthens a delay (by up to `jitter` of it), so a delay is never below the
//!   un-jittered one nor above `max · (1 + jitter)`. Every reconnect, pacing and retry path
//!   uses it. Touches: pure (draws the jitter from `rand`).
//! - `config.rs`: `drumline.toml`: raw form, checked form, one error per bad key.
//!   `config/after.rs` resolves `after` chains to their root (unknown upstreams and cycles
//!   refused). `config/chunks.rs` cuts a large file before its `[[jobs]]` headers (by the
//!   file's tokens) so it parses and checks 1,000 jobs at a time; a file it cannot cut, or a
//!   piece that does not parse, is parsed whole, so errors are the whole file's. Touches: reads
//!   the config file.
//! - `duration.rs`: humantime durations in config and flags. Pure.
//! - `envelope.rs`: the v1 message: body, key, header names, decode limits; a producer's
//!   minimal message completed from its `Arrival` (routing key, publish time), unknown fields
//!   ignored (docs/design.md#the-message). Pure.
//! - `names.rs`: every exchange, queue and Redis key name; name and key limits. Pure.
//! - `policy.rs`: the policies config and message share: `Overlap`, `QueueType`. Pure.
//! - `planted.rs`: defects planted on purpose for the randomized checker, switched on by
//!   `DRUMLINE_PLANTED_DEFECT` in debug builds only (docs/soak.md#planted-defects). Pure.
//! - `limit.rs`: `[limits.NAME]` checked (`Limit`, `Rate`), `N/PERIOD` parsing, the rate's
//!   window and `next_start`, the rule the claim script applies (docs/design.md#limits). Pure.
//! - `run.rs`: what a run is: the claim's answer (`Claim`), the run record's `RunState`, how a
//!   claim ends (`Final`, `Ending`), `WaitReplicas`; the store returns them, `decision.rs` and
//!   `config.rs` use them without the store. Pure.
//! - `schedule.rs`: cron in a time zone with DST policies (day extensions `L`, `W`, `#`
//!   included), fixed-rate `every`. Pure.
//! - `jitter.rs`: a job's fixed jitter offset from SHA-256 of namespace and name
//!   (docs/design.md#jitter). Pure.
//! - `tls.rs`: `ca_file` PEM loading for `amqps://` and `rediss://`. Touches: reads the CA
//!   file.
//! - `url.rs`: URL checks at load, `redis+sentinel://` read into its parts; passwords shown as
//!   `***`. Pure.
//! - `table.rs`: aligned text tables for human output. Pure.
//! - `trace.rs`: the W3C `traceparent` a message carries from producer to run: parsed and
//!   checked, a child span, a new trace, the producer's `TRACEPARENT`. Pure but for random ids
//!   and that variable.

// Every public item is documented (docs/design.md#module-map): `cargo doc` is the reference.
#![warn(missing_docs)]

pub mod backoff;
#[cfg(feature = "config")]
pub mod calendar;
#[cfg(feature = "config")]
pub mod config;
pub mod duration;
pub mod envelope;
pub mod jitter;
pub mod limit;
pub mod names;
pub mod planted;
pub mod policy;
pub mod run;
#[cfg(feature = "config")]
pub mod schedule;
pub mod table;
pub mod tls;
pub mod trace;
pub mod url;
