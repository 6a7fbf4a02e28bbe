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
    #[command(flatten)]
    options: commands::Options,
    #[command(subcommand)]
    command: Option<Command>,
}

fn main() -> ExitCode {
    // The shell-task supervisor is this binary too (docs/design.md#the-task-supervisor).
    if let Some(code) = drumline_worker::supervisor::builtin() {
        return ExitCode::from(u8::try_from(code).unwrap_or(u8::MAX));
    }
    drumline_worker::executor::use_builtin_supervisor();
    let cli = Cli::parse();
    // JSON logs carry task output as events, not raw text between them.
    drumline_worker::output::output_as_events(cli.common.log_format == logging::LogFormat::Json);
    run_to_exit(cli.common.log_format, dispatch(cli))
}

/// Load the config, then run the command (no command: the worker itself).
async fn dispatch(cli: Cli) -> Result<(), Failure> {
    let (config, _) = cli.common.load()?;
    match cli.command {
        None => commands::run(config, cli.options).await,
        Some(command) => command.run(config).await,
    }
}
