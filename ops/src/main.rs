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
    #[command(flatten)]
    options: commands::Options,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    run_to_exit(cli.common.log_format, dispatch(cli))
}

/// Load the config, then run the command (no command: the beat itself).
async fn dispatch(cli: Cli) -> Result<(), Failure> {
    let (config, path) = cli.common.load()?;
    match cli.command {
        None => commands::run(config, cli.options).await,
        Some(command) => command.run(config, &path).await,
    }
}
