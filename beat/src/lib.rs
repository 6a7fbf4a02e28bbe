//! drumline-beat: computes when jobs are due and publishes each instance to RabbitMQ.
//!
//! The loop is [`scheduler`]; what to publish or drop is [`misfire::plan`] (pure); leadership is
//! [`leader`]. Which module does what is the module map in the repository's `docs/design.md`
//! ("Module map"): the one place it is kept.
//!
//! Redis is reached only through [`drumline_shared::store::Store`]; schedule math lives in
//! [`drumline_shared::schedule`].

pub mod adhoc;
pub mod audit;
pub mod cli;
pub mod commands;
pub mod dead_letters;
pub mod follower;
pub mod journal;
pub mod leader;
pub mod misfire;
pub mod next;
pub mod operate;
pub mod page;
pub mod progress;
pub mod prove;
pub mod publisher;
pub mod queues;
pub mod recent;
pub mod reload;
pub mod scheduler;
pub mod stats;
pub mod status;
pub mod verify;
