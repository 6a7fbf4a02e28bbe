//! `drumline-beat`: parse the command line, set up logging, dispatch; map the outcome to an
//! exit code (0 ok, 2 bad usage or config, 1 other).

use chrono::{DateTime, Utc};
use clap::{Parser, Subcommand};
use drumline_beat::publisher::PublishError;
use drumline_beat::{next, scheduler};
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
        None => run(config),
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
        Some(Command::Next {
            job,
            count,
            from,
            json,
        }) => show_next(&config, job, count, from, json),
    }
}

fn run(config: Config) -> ExitCode {
    let runtime = tokio::runtime::Runtime::new().expect("cannot start the tokio runtime");
    match runtime.block_on(scheduler::run(config, shutdown_signal())) {
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
        Some(name) => match config.job(name) {
            Some(j) => vec![j],
            None => {
                // A config can hold 100,000 jobs: name a few, not all.
                const SHOWN: usize = 10;
                let mut known: Vec<&str> = config
                    .jobs
                    .iter()
                    .take(SHOWN)
                    .map(|j| j.name.as_str())
                    .collect();
                let more = format!("… {} more", config.jobs.len().saturating_sub(SHOWN));
                if config.jobs.len() > SHOWN {
                    known.push(&more);
                }
                let known = if known.is_empty() {
                    "the config has none".to_owned()
                } else {
                    format!("jobs: {}", known.join(", "))
                };
                return usage_error(format!(
                    "{}: no job named {name:?} ({known})",
                    config.path.display()
                ));
            }
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

fn usage_error(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {e}");
    ExitCode::from(2)
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("cannot install the SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("cannot install the SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down");
}
