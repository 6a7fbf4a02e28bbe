//! `drumline-worker`: parse the command line, set up logging, load the config, run the command
//! on one tokio runtime ([`commands`] holds the bodies); its [`Failure`] is the exit code.

use clap::{Parser, Subcommand};
use drumline_shared::cli::Common;
use drumline_shared::config::{self, Config};
use drumline_shared::exit::{self, Failure};
use drumline_shared::logging;
use drumline_worker::commands::{self, DlqCommand};
use std::process::ExitCode;

/// Run a drumline worker: consume task messages, run each scheduled instance once.
#[derive(Parser, Debug)]
#[command(name = "drumline-worker", version)]
struct Cli {
    #[command(flatten)]
    common: Common,
    /// Tasks run at once across all queues (overrides [worker] concurrency).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Comma-separated logical queues to consume (overrides [worker] queues).
    #[arg(long, value_delimiter = ',')]
    queues: Option<Vec<String>>,
    /// Serve Prometheus metrics at /metrics and a health check at /healthz on HOST:PORT.
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The dead letters in {ns}.dead.
    Dlq {
        #[command(subcommand)]
        action: DlqAction,
    },
}

#[derive(Subcommand, Debug)]
enum DlqAction {
    /// List them: key, task, reason, runs made, when, last error.
    List {
        /// Machine-readable: [{key, task, job, reason, attempts, error, dead_at}].
        #[arg(long)]
        json: bool,
    },
    /// Publish fresh copies (attempt 0, no deadline) of the given keys, or of all.
    Replay {
        /// Keys to replay.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        keys: Vec<String>,
        /// Replay every dead letter.
        #[arg(long)]
        all: bool,
    },
    /// Delete every dead letter.
    Purge,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::init(cli.common.log_format);
    // JSON logs carry task output as events, not raw text between them.
    drumline_worker::output::output_as_events(cli.common.log_format == logging::LogFormat::Json);
    let runtime = tokio::runtime::Runtime::new().expect("cannot start the tokio runtime");
    let result = runtime.block_on(dispatch(cli));
    // Dropping a runtime waits for its blocking tasks without limit; the worker has stopped in
    // order by now, so nothing left there may delay the exit.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    exit::report(result)
}

/// Load the config, then run the command (no command: the worker itself).
async fn dispatch(cli: Cli) -> Result<(), Failure> {
    let path = config::resolve_path(cli.common.config);
    let config = Config::load(&path).map_err(Failure::usage)?;
    match cli.command {
        None => {
            let options = commands::Options {
                concurrency: cli.concurrency,
                queues: cli.queues,
                metrics_addr: cli.metrics_addr,
            };
            commands::run(config, options).await
        }
        Some(Command::Dlq { action }) => {
            let command = match action {
                DlqAction::List { json } => DlqCommand::List { json },
                DlqAction::Replay { keys, all: _ } => DlqCommand::Replay { keys },
                DlqAction::Purge => DlqCommand::Purge,
            };
            commands::dead_letters(&config, command).await
        }
    }
}
