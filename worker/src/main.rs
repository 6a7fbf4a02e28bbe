//! `drumline-worker`: parse the command line, set up logging, load the config, run the command
//! on one tokio runtime ([`commands`] holds the bodies); its [`Failure`] is the exit code.

use clap::Parser;
use drumline_shared::cli::Common;
use drumline_shared::config::{self, Config};
use drumline_shared::exit::{self, Failure};
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
        Some(command) => command.run(config).await,
    }
}
