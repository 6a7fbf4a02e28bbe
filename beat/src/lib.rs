//! drumline-beat: computes when jobs are due and publishes each instance to RabbitMQ.
//!
//! - [`scheduler`] — the misfire decision ([`scheduler::plan`], pure) and the beat loop.
//! - [`publisher`] — confirm-mode publishing, topology on (re)connect.
//! - [`next`]      — `drumline-beat next`: upcoming instants with DST annotations.
//! - [`adhoc`]     — `drumline-beat publish`: one ad-hoc task, same envelope and guarantees.
//! - [`status`]    — `drumline-beat status`: per-job health from Redis, with a stale warning.

pub mod adhoc;
pub mod next;
pub mod publisher;
pub mod scheduler;
pub mod status;
