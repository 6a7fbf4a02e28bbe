//! drumline-beat: computes when jobs are due and publishes each instance to RabbitMQ.
//!
//! - [`scheduler`] — the beat loop: while this beat leads, takes due jobs in batches,
//!   publishes, records progress.
//! - [`leader`]    — the leader lease: seeks or renews it, and says whether this beat may publish.
//! - [`misfire`]   — the misfire decision ([`misfire::plan`], pure): what to publish or drop.
//! - [`progress`]  — each job's `{ns}:beat:last:{job}` (and the rule it was recorded under):
//!   loaded at start, saved after confirms.
//! - [`stats`]     — the beat's counters (Prometheus), health, and the report of drops.
//! - [`publisher`] — the beat's broker session: batches published with confirms, topology on
//!   (re)connect.
//! - [`reload`]    — SIGHUP: which jobs of a reloaded config keep their progress, and how a new
//!   term resumes each job from the rule its progress was recorded under (pure).
//! - [`next`]      — `drumline-beat next`: upcoming instants with DST annotations.
//! - [`adhoc`]     — `drumline-beat publish`: one ad-hoc task, same envelope and guarantees.
//! - [`operate`]   — `pause`, `resume`, `trigger`, `backfill`: operating a running schedule.
//! - [`status`]    — `drumline-beat status`: per-job health from Redis, with a stale warning.
//! - [`page`]      — the read-only status page (`/`, `/api/status`) on `--metrics-addr`.
//! - [`dead_letters`] — the page's dead-letter count: one broker connection, cached 5 s.
//! - [`commands`]  — the bodies of the binary's commands: output and exit-code-carrying failures.
//!
//! Redis is reached only through [`drumline_shared::store::Store`]; schedule math lives in
//! [`drumline_shared::schedule`].

pub mod adhoc;
pub mod commands;
pub mod dead_letters;
pub mod leader;
pub mod misfire;
pub mod next;
pub mod operate;
pub mod page;
pub mod progress;
pub mod publisher;
pub mod reload;
pub mod scheduler;
pub mod stats;
pub mod status;
