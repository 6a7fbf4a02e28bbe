//! `drumline-beat`: parse the command line, set up logging, load the config, run the command
//! on one tokio runtime ([`commands`] holds the bodies); its [`Failure`] is the exit code.

use clap::{Parser, Subcommand};
use drumline_beat::{adhoc, commands};
use drumline_shared::cli::Common;
use drumline_shared::config::{self, Config};
use drumline_shared::exit::{self, Failure};
use drumline_shared::logging;
use std::process::ExitCode;

/// The drumline beat: publishes every due instance of every job, once.
#[derive(Parser, Debug)]
#[command(name = "drumline-beat", version)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    common: Common,
    /// Serve Prometheus metrics at /metrics, a health check at /healthz and the status page at
    /// / (JSON: /api/status) on HOST:PORT.
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
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
    /// Pause jobs: the leader publishes none of their instants (dropped, counted, never caught
    /// up) until `resume`.
    Pause {
        /// Jobs to pause.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        jobs: Vec<String>,
        /// Every job of the config.
        #[arg(long)]
        all: bool,
    },
    /// Resume paused jobs: their next instants are published; the paused ones never are.
    Resume {
        /// Jobs to resume.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        jobs: Vec<String>,
        /// Every job of the config.
        #[arg(long)]
        all: bool,
    },
    /// Publish one instance of a job now, as the job (task, queue, args, overlap, history).
    Trigger {
        /// The job.
        job: String,
        /// Arguments as a JSON value, instead of the job's.
        #[arg(long)]
        args: Option<String>,
    },
    /// Publish every instant of a job's schedule in [--from, --to), oldest first.
    Backfill {
        /// The job.
        job: String,
        /// First instant considered (RFC 3339), included.
        #[arg(long)]
        from: String,
        /// End of the range (RFC 3339), excluded; not in the future.
        #[arg(long)]
        to: String,
        /// List the instants without publishing.
        #[arg(long)]
        dry_run: bool,
        /// Then print `N/M done` as the instants finish, and exit when all have.
        #[arg(long, conflicts_with = "dry_run")]
        wait: bool,
        /// Refuse a range with more instants than this.
        #[arg(long, default_value_t = drumline_beat::operate::DEFAULT_BACKFILL_MAX)]
        max: usize,
    },
    /// Per job: schedule, next due, last published, last success/failure, running now, paused,
    /// stale.
    Status {
        /// Only this job.
        job: Option<String>,
        /// Machine-readable output: {leader, dead_letters, jobs: [...]}.
        #[arg(long)]
        json: bool,
    },
}

fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    drumline_shared::duration::parse(text)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::init(cli.common.log_format);
    let runtime = tokio::runtime::Runtime::new().expect("cannot start the tokio runtime");
    exit::report(runtime.block_on(dispatch(cli)))
}

/// Load the config, then run the command (no command: the beat itself).
async fn dispatch(cli: Cli) -> Result<(), Failure> {
    let path = config::resolve_path(cli.common.config);
    let config = Config::load(&path).map_err(Failure::usage)?;
    match cli.command {
        None => commands::run(config, cli.metrics_addr).await,
        Some(Command::Check) => commands::check(&path, &config),
        Some(Command::Next {
            job,
            count,
            from,
            json,
        }) => commands::show_next(&config, job.as_deref(), count, from.as_deref(), json),
        Some(Command::Publish {
            task,
            args,
            key,
            delay,
            expires,
            queue,
        }) => {
            let request = adhoc::Request {
                task,
                args: commands::json_args(&args)?,
                key,
                delay,
                expires,
                queue,
            };
            commands::publish(&config, &request).await
        }
        Some(Command::Pause { jobs, all }) => commands::pause(&config, &jobs, all, true).await,
        Some(Command::Resume { jobs, all }) => commands::pause(&config, &jobs, all, false).await,
        Some(Command::Trigger { job, args }) => {
            let args = args.as_deref().map(commands::json_args).transpose()?;
            commands::trigger(&config, &job, args).await
        }
        Some(Command::Backfill {
            job,
            from,
            to,
            dry_run,
            wait,
            max,
        }) => commands::backfill(&config, &job, (&from, &to), max, (dry_run, wait)).await,
        Some(Command::Status { job, json }) => {
            commands::show_status(&config, job.as_deref(), json).await
        }
    }
}
