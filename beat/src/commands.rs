//! The bodies of `drumline-beat`'s commands: each takes a loaded config, prints its output and
//! returns `Ok` or a [`Failure`] that carries the exit code. `main.rs` only parses and dispatches.

use crate::publisher::PublishError;
use crate::{adhoc, next, scheduler, status};
use chrono::{DateTime, Utc};
use drumline_shared::config::{Config, Job};
use drumline_shared::exit::Failure;
use drumline_shared::topology::TopologyError;
use serde::Serialize;
use std::net::SocketAddr;
use std::path::Path;

/// No command: run the beat until SIGTERM or SIGINT, serving metrics on `metrics_addr`.
pub async fn run(config: Config, metrics_addr: Option<SocketAddr>) -> Result<(), Failure> {
    let stats = scheduler::BeatStats::default();
    if let Some(addr) = metrics_addr {
        let mut registry = prometheus_client::registry::Registry::default();
        stats.register(&mut registry);
        let health_stats = stats.clone();
        let health = std::sync::Arc::new(move || health_stats.health());
        drumline_shared::metrics::serve(addr, registry, health)
            .await
            .map_err(|e| Failure::usage(format!("--metrics-addr {addr}: {e}")))?;
    }
    let stopping = drumline_shared::signals::shutdown("finishing the batch in hand");
    match scheduler::run(config, stats, stopping).await {
        Ok(_) => Ok(()),
        // A queue declared with other arguments (say a changed dead_ttl) is a config problem.
        Err(e @ PublishError::Topology(TopologyError::Mismatch { .. })) => Err(Failure::usage(e)),
        Err(e) => Err(Failure::other(e)),
    }
}

/// `check`: the config at `path` loaded; say so.
pub fn check(path: &Path, config: &Config) -> Result<(), Failure> {
    println!(
        "{}: ok ({} jobs, {} tasks, namespace {:?})",
        path.display(),
        config.jobs.len(),
        config.tasks.len(),
        config.namespace
    );
    Ok(())
}

/// `next`: the next `count` instants of `job` (or of every job) after `from` (default now).
pub fn show_next(
    config: &Config,
    job: Option<&str>,
    count: usize,
    from: Option<&str>,
    json: bool,
) -> Result<(), Failure> {
    let from: DateTime<Utc> = match from {
        None => Utc::now(),
        Some(text) => DateTime::parse_from_rfc3339(text)
            .map_err(|e| {
                Failure::usage(format!("--from {text:?} is not an RFC 3339 instant ({e})"))
            })?
            .with_timezone(&Utc),
    };
    let jobs: Vec<&Job> = match job {
        Some(name) => vec![find_job(config, name)?],
        None => config.jobs.iter().collect(),
    };
    let lines: Vec<_> = jobs
        .iter()
        .flat_map(|j| next::upcoming(j, from, count))
        .collect();
    print_output(&lines, json, |l| next::table(l));
    Ok(())
}

/// `publish --args TEXT`: the task's arguments, which must be JSON.
pub fn json_args(text: &str) -> Result<serde_json::Value, Failure> {
    serde_json::from_str(text).map_err(|e| Failure::usage(format!("--args is not JSON: {e}")))
}

/// `publish`: one ad-hoc task.
pub async fn publish(config: &Config, request: &adhoc::Request) -> Result<(), Failure> {
    let env = adhoc::envelope(config, request, Utc::now()).map_err(Failure::usage)?;
    match adhoc::publish(config, &env, request.delay).await {
        Ok(()) => {
            println!(
                "published {} key={} queue={} due={}",
                env.task,
                env.key,
                env.queue,
                drumline_shared::envelope::format_instant(env.scheduled_for)
            );
            Ok(())
        }
        Err(e @ adhoc::PublishFailed::Topology(TopologyError::Mismatch { .. })) => {
            Err(Failure::usage(e))
        }
        Err(e) => Err(Failure::other(e)),
    }
}

/// `status`: per-job health read from Redis, for `job` or for every job.
pub async fn show_status(config: &Config, job: Option<&str>, json: bool) -> Result<(), Failure> {
    let only = job.map(|name| find_job(config, name)).transpose()?;
    let report = status::read(config, only, Utc::now())
        .await
        .map_err(|e| Failure::other(format!("redis: {e}")))?;
    print_output(&report, json, status::table);
    Ok(())
}

/// A command's output on stdout: pretty JSON with `--json`, else the human table.
fn print_output<T: Serialize + ?Sized>(value: &T, json: bool, table: impl Fn(&T) -> String) {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(value).expect("serialisable")
        );
    } else {
        print!("{}", table(value));
    }
}

/// The job named `name`, or a usage failure naming a few of the jobs there are (a config can
/// hold 100,000: name ten, not all).
fn find_job<'c>(config: &'c Config, name: &str) -> Result<&'c Job, Failure> {
    if let Some(job) = config.job(name) {
        return Ok(job);
    }
    const SHOWN: usize = 10;
    let mut known: Vec<String> = config
        .jobs
        .iter()
        .take(SHOWN)
        .map(|j| j.name.clone())
        .collect();
    if config.jobs.len() > SHOWN {
        known.push(format!("… {} more", config.jobs.len() - SHOWN));
    }
    let known = if known.is_empty() {
        "the config has none".to_owned()
    } else {
        format!("jobs: {}", known.join(", "))
    };
    Err(Failure::Usage(format!(
        "{}: no job named {name:?} ({known})",
        config.path.display()
    )))
}
