//! drumline-core: what every part of drumline agrees on, with no network and no async runtime —
//! the config (parsed and checked), the message, every name, schedule math, jitter, limits,
//! backoff, and what a run is. The doors to Redis and RabbitMQ are `drumline-shared`'s `store`
//! and `broker`.
//!
//! Which module does what is the module map in the repository's `docs/design.md` ("Module
//! map"): the one place it is kept.

pub mod backoff;
pub mod config;
pub mod duration;
pub mod envelope;
pub mod jitter;
pub mod limit;
pub mod names;
pub mod planted;
pub mod run;
pub mod schedule;
pub mod table;
pub mod tls;
pub mod url;
