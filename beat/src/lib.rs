//! drumline-beat: the beat daemon: computes when jobs are due and publishes each instance to
//! RabbitMQ, once, under a fenced leader. The operator side (commands, status page, API) and
//! the `drumline-beat` binary are in `drumline-ops`.
//!
//! The loop is [`scheduler`], driving the state machine `machine`; what to publish or drop is
//! `misfire::plan` (pure); leadership is `leader`. Which module does what is the map below.
//!
//! Redis is reached only through [`drumline_shared::store::Store`]; schedule math lives in
//! [`drumline_shared::schedule`].
//!
//! # Map
//!
//! - `misfire.rs`: misfire planning: which instants to publish and which to drop (with
//!   reasons), from job, last recorded instant and now (`plan_held`: with the instants a reload
//!   held late only from the reload). Pure.
//! - `progress.rs`: load each job's last decided instant and its rule at each gain; save it
//!   fenced by the lease, with the rule on a start. Touches: Redis (through the `Store`), the
//!   host's clocks.
//! - `leader.rs`: the lease task (acquire or renew every `leader_lease/3`), `Term::holds` (may
//!   this beat publish now, on `CLOCK_BOOTTIME`), the planning clock capped at Redis `TIME` +
//!   threshold. Touches: Redis (through the `Store`).
//! - `stats.rs`: the beat's counters and gauges for `/metrics` (published per job, dropped per
//!   job and reason: `BeatStats::published`, `BeatStats::dropped`); logs each dropped instance.
//!   Touches: memory.
//! - `machine.rs`: the scheduling state machine, no I/O: events in (a look at the clock, the
//!   term holding or not, a stop asked, the paused jobs read, a batch's progress written, sent,
//!   confirmed, a reload, a term gained), actions out (wait, send this batch, journal and write
//!   this progress, follow, stop); what is due, missed, dropped, retried alone or backed off;
//!   batches of `BATCH_JOBS`/`BATCH_MESSAGES`, up to `IN_FLIGHT` (8) in flight, finished oldest
//!   first. Pure (its counters and logs aside).
//! - `scheduler.rs`: the thin driver: stand by until leading, load the progress, then carry out
//!   what the `machine` says and feed the answers back; back to standby when the term ends.
//!   Its tests against the real broker and Redis (and the publisher's) are `beat/tests/live.rs`.
//!   Touches: broker (via `publisher`), Redis (via `progress`, `journal`, `leader`).
//! - `publisher.rs`: the beat's publisher: one connection and one confirm channel, kept and
//!   reopened with the topology on every (re)connect; batches go through `broker::send_batch`
//!   and their confirms are read later (`broker::publish_batch` for one batch at a time); an
//!   unroutable message does not drop the channel. Touches: broker (through `broker`).
//! - `reload.rs`: SIGHUP: which jobs of a reloaded config keep their progress, and which of a
//!   kept job's instants a lowered jitter holds (`held`); a job's rule, and how a new term
//!   resumes a job from the rule its progress was recorded under. Pure.
//! - `dynamic.rs`: what changes the running jobs: SIGHUP and the schedules and calendars
//!   applied at run time, read whole at start and then followed through the change feed by a
//!   task of its own; a change is a new config run as a reload. Touches: Redis (through the
//!   store), signals.
//! - `journal.rs`: what the leader journals: each published instance, each dropped one with its
//!   reason, under its epoch (docs/design.md#journal). Touches: Redis (through the `Store`).
//! - `follower.rs`: `after` jobs: for each follower's instants, the upstream's run record →
//!   publish, skip or wait (`decide`, pure, with `candidates`, `settled_up_to` and a step's
//!   `Followers::pending`/`verdicts`/`moved`), carried out by `step` when the machine says
//!   follow (docs/design.md#job-dependencies). Touches: Redis (through the `Store`), broker
//!   (via `publisher`).

pub mod dynamic;
pub(crate) mod follower;
pub(crate) mod journal;
pub(crate) mod leader;
pub(crate) mod machine;
pub mod misfire;
pub mod progress;
pub mod publisher;
pub(crate) mod reload;
pub mod scheduler;
pub mod stats;
