//! drumline-ops: the operator's side of drumline: the commands (`check`, `next`, `publish`,
//! `status`, `pause`, `resume`, `trigger`, `backfill`, `audit`, `verify`, `schedules`,
//! `calendars`), the status page, the HTTP API, and the `drumline-beat` binary, which runs
//! the beat daemon ([`drumline_beat`]) with the page and the API beside it.
//!
//! Redis is reached only through [`drumline_shared::store::Store`], RabbitMQ only through
//! [`drumline_shared::broker`] and the producer client.
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
//! - `adhoc.rs`: `publish`: one ad-hoc task, same envelope and guarantees, published through
//!   the producer client (`client/src/lib.rs`) with the topology declared. Touches: broker
//!   (through the client).
//! - `operate.rs`: `trigger` and `backfill`: the envelopes to publish, and the refusals
//!   (reversed, future or oversized range). Pure.
//! - `api.rs`: the HTTP API at `--api-addr` (bearer token): schedules put, get, list, delete
//!   as JSON; its OpenAPI document (`docs/api.openapi.json`). Touches: HTTP, Redis (through the
//!   store).
//! - `schedules.rs`: `schedules apply|get|list|delete`: the objects of an apply checked all
//!   or nothing, a stored schedule as shown (source, times, next instants); stored through the
//!   store. Touches: Redis (through the store).
//! - `inspect.rs`: `inspect KEY` and `GET /api/v1/keys/{key}`: what became of one key (run
//!   record, journal entries, the job's run record), decided in `report` (pure). Touches: Redis
//!   (through the store).
//! - `next.rs`: `next`: upcoming instants with DST notes. Pure.
//! - `status.rs`: `status`: per-job health, paused, the stale warning, the recent runs, dead
//!   letters, the total, the workers announced, each queue's depth and consumers, written row
//!   by row as read (`stream`: 500 jobs a round trip, four in flight, the table's widths from
//!   the config; `--json` one job a line); `read_window` builds the same document on a window
//!   of the jobs for the status page. Touches: Redis (read only, through the `Store`), broker
//!   (one passive declare).
//! - `recent.rs`: each job's recent runs as shown (`RecentRun` from a run record: duration, the
//!   error on one bounded line) and their text table; see docs/design.md#recent-runs.
//! - `page.rs`: the status page on `--metrics-addr`: `/` (HTML from a pure
//!   `render(Status, Window)`, refreshing itself, JavaScript only for the actions, everything escaped, `Jobs a–b
//!   of N` with links) and `/api/status` (the `status --json` document), built per request
//!   through `status::read_window` within 4 s, else 503 with the reason; at most 4 at once
//!   (else 503 `Retry-After: 1`), at most `limit` jobs (docs/design.md#bounded-work); follows
//!   SIGHUP for the reloaded `[[jobs]]`; `/keys/{key}`, a key's `inspect` report as HTML.
//!   Touches: Redis (read only, through `status`, `inspect` and the store), SIGHUP.
//! - `strip.rs`: the status page's strip of each job's recent instants, classified by the
//!   audit's code from one capped journal read, `unknown` where the read may not reach; its
//!   HTML. Pure.
//! - `queues.rs`: `drumline_queue_depth` / `drumline_queue_consumers` per queue the config
//!   names, refreshed every 5 s (docs/design.md#queues-and-workers). Touches: broker (passive
//!   declares).
//! - `audit.rs`: `audit`: a job's expected instants (its schedule) classified from journal
//!   entries, run records and states. Pure.
//! - `verify.rs`: `verify`: the promise's rules over one key's entries, a job's runs (overlap)
//!   and an audit's rows. Pure.
//! - `prove.rs`: the bodies of `audit` and `verify`: read through the `Store`, print, exit 1 on
//!   a violation. Touches: Redis (read only, through the `Store`), stdout.
//! - `actions.rs`: the status page's actions: `POST /actions/{pause|resume|trigger}/{job}`
//!   behind the API token and the page's own origin, the token field and its script. Touches:
//!   Redis (pause), broker (trigger).
//! - `dead_letters.rs`: the broker counts the status page and the queue gauges show
//!   (`BrokerCounts`: the dead letters and the queues `queues_of` names): one broker connection
//!   kept between requests, one read at a time, cached 5 s. Touches: broker (passive declares).

pub(crate) mod actions;
pub(crate) mod adhoc;
pub mod api;
pub(crate) mod audit;
pub mod cli;
pub mod commands;
pub(crate) mod dead_letters;
pub(crate) mod inspect;
pub(crate) mod next;
pub(crate) mod operate;
pub(crate) mod page;
pub(crate) mod prove;
pub(crate) mod queues;
pub(crate) mod recent;
pub(crate) mod schedules;
pub(crate) mod status;
pub(crate) mod strip;
pub(crate) mod verify;

/// Fixtures the modules' tests share.
#[cfg(test)]
pub(crate) mod fixtures {
    use chrono::{DateTime, Utc};
    use drumline_shared::config::{Config, Job};
    use std::path::Path;

    /// Job `j` with the given TOML keys (schedule, policies).
    pub(crate) fn job(keys: &str) -> Job {
        let text = format!(
            "[[jobs]]\nname = \"j\"\ntask = \"t\"\n{keys}\n[tasks.t]\ncommand = [\"/bin/true\"]\n"
        );
        let mut config = Config::parse(&text, Path::new("test.toml"), |_| None)
            .unwrap_or_else(|e| panic!("bad test config: {e}"));
        config.jobs.remove(0)
    }

    /// An RFC 3339 instant.
    pub(crate) fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .expect("test instant")
            .with_timezone(&Utc)
    }
}
