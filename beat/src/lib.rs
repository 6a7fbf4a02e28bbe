//! drumline-beat: computes when jobs are due and publishes each instance to RabbitMQ.
//!
//! The loop is [`scheduler`], driving the state machine `machine`; what to publish or drop is
//! `misfire::plan` (pure); leadership is `leader`. Which module does what is the map below.
//!
//! Redis is reached only through [`drumline_shared::store::Store`]; schedule math lives in
//! [`drumline_shared::schedule`].
//!
//! # Map
//!
//! - `main.rs`: parse the command line, set up logging, load the config, dispatch on one tokio
//!   runtime; `exit::report` turns the `Failure` into the exit code. Touches: process.
//! - `cli.rs`: the operator commands as a clap `Command` enum and its `run` (flattened by
//!   `drumline-beat` and `drumline`: see docs/design.md#one-command-for-operators).
//! - `commands.rs`: the commands' bodies (`check`, `next`, `publish`, `status`, `pause`,
//!   `resume`, `trigger`, `backfill`, the beat itself): output, and a `Failure` carrying the
//!   exit code. Touches: stdout, stderr (via the modules it calls).
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
//! - `adhoc.rs`: `publish`: one ad-hoc task, same envelope and guarantees, published through
//!   the producer client (`client/src/lib.rs`) with the topology declared. Touches: broker
//!   (through the client).
//! - `operate.rs`: `trigger` and `backfill`: the envelopes to publish, and the refusals
//!   (reversed, future or oversized range). Pure.
//! - `reload.rs`: SIGHUP: which jobs of a reloaded config keep their progress, and which of a
//!   kept job's instants a lowered jitter holds (`held`); a job's rule, and how a new term
//!   resumes a job from the rule its progress was recorded under. Pure.
//! - `api.rs`: the HTTP API at `--api-addr` (bearer token): schedules put, get, list, delete
//!   as JSON; its OpenAPI document (`docs/api.openapi.json`). Touches: HTTP, Redis (through the
//!   store).
//! - `dynamic.rs`: what changes the running jobs: SIGHUP and the schedules and calendars
//!   applied at run time, read whole at start and then followed through the change feed by a
//!   task of its own; a change is a new config run as a reload. Touches: Redis (through the
//!   store), signals.
//! - `schedules.rs`: `schedules apply|get|list|delete`: the objects of an apply checked all
//!   or nothing, a stored schedule as shown (source, times, next instants); stored through the
//!   store. Touches: Redis (through the store).
//! - `next.rs`: `next`: upcoming instants with DST notes. Pure.
//! - `status.rs`: `status`: per-job health, paused, the stale warning, the recent runs, dead
//!   letters, the total, the workers announced, each queue's depth and consumers, written row
//!   by row as read (`stream`: 500 jobs a round trip, four in flight, the table's widths from
//!   the config; `--json` one job a line); `read_window` builds the same document on a window
//!   of the jobs for the status page. Touches: Redis (read only, through the `Store`), broker
//!   (one passive declare).
//! - `recent.rs`: each job's recent runs as shown (`RecentRun` from a run record: duration, the
//!   error on one bounded line) and their text table; see docs/design.md#recent-runs.
//! - `page.rs`: the read-only status page on `--metrics-addr`: `/` (HTML from a pure
//!   `render(Status, Window)`, refreshing itself, no JavaScript, everything escaped, `Jobs a–b
//!   of N` with links) and `/api/status` (the `status --json` document), built per request
//!   through `status::read_window` within 4 s, else 503 with the reason; at most 4 at once
//!   (else 503 `Retry-After: 1`), at most `limit` jobs (docs/design.md#bounded-work); follows
//!   SIGHUP for the reloaded `[[jobs]]`. Touches: Redis (read only, through `status`), SIGHUP.
//! - `queues.rs`: `drumline_queue_depth` / `drumline_queue_consumers` per queue the config
//!   names, refreshed every 5 s (docs/design.md#queues-and-workers). Touches: broker (passive
//!   declares).
//! - `journal.rs`: what the leader journals: each published instance, each dropped one with its
//!   reason, under its epoch (docs/design.md#journal). Touches: Redis (through the `Store`).
//! - `audit.rs`: `audit`: a job's expected instants (its schedule) classified from journal
//!   entries, run records and states. Pure.
//! - `verify.rs`: `verify`: the promise's rules over one key's entries, a job's runs (overlap)
//!   and an audit's rows. Pure.
//! - `prove.rs`: the bodies of `audit` and `verify`: read through the `Store`, print, exit 1 on
//!   a violation. Touches: Redis (read only, through the `Store`), stdout.
//! - `follower.rs`: `after` jobs: for each follower's instants, the upstream's run record →
//!   publish, skip or wait (`decide`, pure, with `candidates`, `settled_up_to` and a step's
//!   `Followers::pending`/`verdicts`/`moved`), carried out by `step` when the machine says
//!   follow (docs/design.md#job-dependencies). Touches: Redis (through the `Store`), broker
//!   (via `publisher`).
//! - `dead_letters.rs`: the broker counts the status page and the queue gauges show
//!   (`BrokerCounts`: the dead letters and the queues `queues_of` names): one broker connection
//!   kept between requests, one read at a time, cached 5 s. Touches: broker (passive declares).

pub(crate) mod adhoc;
pub mod api;
pub(crate) mod audit;
pub mod cli;
pub mod commands;
pub(crate) mod dead_letters;
pub(crate) mod dynamic;
pub(crate) mod follower;
pub(crate) mod journal;
pub(crate) mod leader;
pub(crate) mod machine;
pub(crate) mod misfire;
pub(crate) mod next;
pub(crate) mod operate;
pub(crate) mod page;
pub mod progress;
pub(crate) mod prove;
pub mod publisher;
pub(crate) mod queues;
pub(crate) mod recent;
pub(crate) mod reload;
pub mod scheduler;
pub(crate) mod schedules;
pub(crate) mod stats;
pub(crate) mod status;
pub(crate) mod verify;
