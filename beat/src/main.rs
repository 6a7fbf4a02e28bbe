//! `drumline-beat`: parse the command line, set up logging, load the config, run the command
//! on one tokio runtime ([`commands`] holds the bodies); its [`Failure`] is the exit code.

use clap::Parser;
use drumline_beat::cli::Command;
use drumline_beat::commands;
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
    #[arg(long, value_parser = drumline_shared::metrics::parse_addr)]
    metrics_addr: Option<std::net::SocketAddr>,
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
        Some(command) => command.run(config, &path).await,
    }
}
