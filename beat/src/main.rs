//! `drumline-beat`: parse the command line, set up logging, dispatch; map the outcome to an
//! exit code (0 ok, 2 bad usage or config, 1 other).

use chrono::{DateTime, Utc};
use clap::{Parser, Subcommand};
use drumline_beat::publisher::PublishError;
use drumline_beat::{adhoc, next, scheduler, status};
use drumline_shared::config::{self, Config};
use drumline_shared::logging::{self, LogFormat};
use drumline_shared::topology::TopologyError;
use std::path::PathBuf;
use std::process::ExitCode;

/// The drumline beat: publishes every due instance of every job, once.
#[derive(Parser, Debug)]
#[command(name = "drumline-beat", version)]
struct Cli {
    /// Config file [default: $DRUMLINE_CONFIG, else ./drumline.toml].
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    log_format: LogFormat,
    /// Serve Prometheus metrics at /metrics and a health check at /healthz on HOST:PORT.
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Validate the config and exit (0 when valid, 2 with one clear message when not).
    Check,
    /// Show upcoming instants, UTC and local, with DST gap/fold annotations.
    Next {
        /// Only this job.
        job: Option<String>,
        /// How many instants per job.
        #[arg(long, default_value_t = 10)]
        count: usize,
        /// Start strictly after this instant (RFC 3339) [default: now].
        #[arg(long)]
        from: Option<String>,
        /// Machine-readable output: [{job, utc, local, offset, note}].
        #[arg(long)]
        json: bool,
    },
    /// Publish one ad-hoc task (same envelope and guarantees as a scheduled instance).
    Publish {
        /// Task name (a [tasks.NAME] entry).
        task: String,
        /// Arguments as a JSON value, handed to the task.
        #[arg(long, default_value = "{}")]
        args: String,
        /// Idempotency key [default: a fresh UUID]; publishing the same key twice runs it once.
        #[arg(long)]
        key: Option<String>,
        /// Due this long after now (e.g. "30s"); waits in a delay queue meanwhile.
        #[arg(long, value_parser = parse_duration, default_value = "0s")]
        delay: std::time::Duration,
        /// Not run after this long past the due instant (e.g. "10m").
        #[arg(long, value_parser = parse_duration)]
        expires: Option<std::time::Duration>,
        /// Logical queue [default: default].
        #[arg(long)]
        queue: Option<String>,
    },
    /// Per job: schedule, next due, last published, last success/failure, running now, stale.
    Status {
        /// Only this job.
        job: Option<String>,
        /// Machine-readable output: {leader, jobs: [...]}.
        #[arg(long)]
        json: bool,
    },
}

fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    drumline_shared::duration::parse(text)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::init(cli.log_format);
    let path = config::resolve_path(cli.config);
    let config = match Config::load(&path) {
        Ok(c) => c,
        Err(e) => return usage_error(e),
    };
    match cli.command {
        None => run(config, cli.metrics_addr),
        Some(Command::Check) => {
            println!(
                "{}: ok ({} jobs, {} tasks, namespace {:?})",
                path.display(),
                config.jobs.len(),
                config.tasks.len(),
                config.namespace
            );
            ExitCode::SUCCESS
        }
        Some(Command::Publish {
            task,
            args,
            key,
            delay,
            expires,
            queue,
        }) => {
            let args = match serde_json::from_str(&args) {
                Ok(a) => a,
                Err(e) => return usage_error(format!("--args is not JSON: {e}")),
            };
            let request = adhoc::Request {
                task,
                args,
                key,
                delay,
                expires,
                queue,
            };
            publish(&config, &request)
        }
        Some(Command::Status { job, json }) => show_status(&config, job, json),
        Some(Command::Next {
            job,
            count,
            from,
            json,
        }) => show_next(&config, job, count, from, json),
    }
}

fn run(config: Config, metrics_addr: Option<std::net::SocketAddr>) -> ExitCode {
    let runtime = tokio::runtime::Runtime::new().expect("cannot start the tokio runtime");
    let stats = scheduler::BeatStats::default();
    if let Some(addr) = metrics_addr {
        let mut registry = prometheus_client::registry::Registry::default();
        stats.register(&mut registry);
        let health_stats = stats.clone();
        let health = std::sync::Arc::new(move || health_stats.health());
        let served = runtime.block_on(drumline_shared::metrics::serve(addr, registry, health));
        if let Err(e) = served {
            return usage_error(format!("--metrics-addr {addr}: {e}"));
        }
    }
    match runtime.block_on(scheduler::run(
        config,
        stats,
        drumline_shared::signals::shutdown("finishing the batch in hand"),
    )) {
        Ok(_) => ExitCode::SUCCESS,
        // A queue declared with other arguments (say a changed dead_ttl) is a config problem.
        Err(e @ PublishError::Topology(TopologyError::Mismatch { .. })) => usage_error(e),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

fn show_next(
    config: &Config,
    job: Option<String>,
    count: usize,
    from: Option<String>,
    json: bool,
) -> ExitCode {
    let from: DateTime<Utc> = match from {
        None => Utc::now(),
        Some(text) => match DateTime::parse_from_rfc3339(&text) {
            Ok(t) => t.with_timezone(&Utc),
            Err(e) => {
                return usage_error(format!("--from {text:?} is not an RFC 3339 instant ({e})"))
            }
        },
    };
    let jobs: Vec<_> = match &job {
        Some(name) => match find_job(config, name) {
            Ok(j) => vec![j],
            Err(e) => return usage_error(e),
        },
        None => config.jobs.iter().collect(),
    };
    let lines: Vec<_> = jobs
        .iter()
        .flat_map(|j| next::upcoming(j, from, count))
        .collect();
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&lines).expect("serialisable")
        );
    } else {
        print!("{}", next::table(&lines));
    }
    ExitCode::SUCCESS
}

fn publish(config: &Config, request: &adhoc::Request) -> ExitCode {
    let env = match adhoc::envelope(config, request, Utc::now()) {
        Ok(env) => env,
        Err(e) => return usage_error(e),
    };
    let runtime = tokio::runtime::Runtime::new().expect("cannot start the tokio runtime");
    match runtime.block_on(adhoc::publish(config, &env, request.delay)) {
        Ok(()) => {
            println!(
                "published {} key={} queue={} due={}",
                env.task,
                env.key,
                env.queue,
                drumline_shared::envelope::format_instant(env.scheduled_for)
            );
            ExitCode::SUCCESS
        }
        Err(e @ adhoc::PublishFailed::Topology(TopologyError::Mismatch { .. })) => usage_error(e),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

fn show_status(config: &Config, job: Option<String>, json: bool) -> ExitCode {
    let only = match job
        .as_deref()
        .map(|name| find_job(config, name))
        .transpose()
    {
        Ok(only) => only,
        Err(e) => return usage_error(e),
    };
    let runtime = tokio::runtime::Runtime::new().expect("cannot start the tokio runtime");
    let report = match runtime.block_on(status::read(config, only, Utc::now())) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: redis: {e}");
            return ExitCode::from(1);
        }
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("serialisable")
        );
    } else {
        print!("{}", status::table(&report));
    }
    ExitCode::SUCCESS
}

/// The job named `name`, or a message naming a few of the jobs there are (a config can hold
/// 100,000: name ten, not all).
fn find_job<'c>(
    config: &'c Config,
    name: &str,
) -> Result<&'c drumline_shared::config::Job, String> {
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
    Err(format!(
        "{}: no job named {name:?} ({known})",
        config.path.display()
    ))
}

fn usage_error(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {e}");
    ExitCode::from(2)
}
