//! `drumline-worker`: parse the command line, set up logging, load the config, run the command
//! on one tokio runtime ([`commands`] holds the bodies); its [`Failure`] is the exit code.

use clap::Parser;
use drumline_shared::cli::{run_to_exit, Common};
use drumline_shared::exit::Failure;
use drumline_shared::logging;
use drumline_worker::cli::Command;
use drumline_worker::commands;
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
    #[arg(long, value_parser = drumline_shared::metrics::parse_addr)]
    metrics_addr: Option<std::net::SocketAddr>,
    #[command(subcommand)]
    command: Option<Command>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // JSON logs carry task output as events, not raw text between them.
    drumline_worker::output::output_as_events(cli.common.log_format == logging::LogFormat::Json);
    run_to_exit(cli.common.log_format, dispatch(cli))
}

/// Load the config, then run the command (no command: the worker itself).
async fn dispatch(cli: Cli) -> Result<(), Failure> {
    let (config, _) = cli.common.load()?;
    match cli.command {
        None => {
            let options = commands::Options {
                concurrency: cli.concurrency,
                queues: cli.queues,
                metrics_addr: cli.metrics_addr,
            };
            commands::run(config, options).await
        }
        Some(command) => command.run(config).await,
    }
}
