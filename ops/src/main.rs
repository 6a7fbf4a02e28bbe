//! `drumline-beat`: parse the command line, set up logging, load the config, run the command
//! on one tokio runtime ([`commands`] holds the bodies); its [`Failure`] is the exit code.

use clap::Parser;
use drumline_ops::cli::Command;
use drumline_ops::commands;
use drumline_shared::cli::{run_to_exit, Common};
use drumline_shared::exit::Failure;
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
    /// Serve the HTTP API (schedules at run time; docs/api.md) on HOST:PORT; every request
    /// needs the bearer token in the variable `[api] token_env` names (default
    /// DRUMLINE_API_TOKEN). Overrides `[api] addr`.
    #[arg(long, value_parser = drumline_shared::metrics::parse_addr)]
    api_addr: Option<std::net::SocketAddr>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    run_to_exit(cli.common.log_format, dispatch(cli))
}

/// Load the config, then run the command (no command: the beat itself).
async fn dispatch(cli: Cli) -> Result<(), Failure> {
    let (config, path) = cli.common.load()?;
    match cli.command {
        None => commands::run(config, cli.metrics_addr, cli.api_addr).await,
        Some(command) => command.run(config, &path).await,
    }
}
