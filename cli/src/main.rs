//! `drumline`: one command for every operator action. It flattens the beat's and the worker's
//! command enums (`drumline_ops::cli::Command`, `drumline_worker::cli::Command`), so a command
//! added to either appears here with no code of its own
//! (docs/design.md#one-command-for-operators); `completions SHELL` prints a completion script.
//!
//! # Map
//!
//! - `main.rs`: the one command for operators: flattens `drumline_ops::cli::Command` and
//!   `drumline_worker::cli::Command` (every command of either is a `drumline` command),
//!   `completions SHELL` (clap_complete); loads the config and runs the command like the other
//!   binaries. Touches: process.

use clap::{CommandFactory, Parser, Subcommand};
use drumline_shared::cli::{run_to_exit, Common};
use drumline_shared::exit::Failure;
use std::process::ExitCode;

/// drumline: run the beat and the workers (`drumline beat`, `drumline worker`), and check,
/// inspect and operate them.
#[derive(Parser, Debug)]
#[command(name = "drumline", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    common: Common,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the beat: publish every due instance of every job, once (also `drumline-beat`).
    Beat(drumline_ops::commands::Options),
    /// Run a worker: consume task messages, run each instance once (also `drumline-worker`).
    Worker(drumline_worker::commands::Options),
    #[command(flatten)]
    Operate(drumline_ops::cli::Command),
    #[command(flatten)]
    Dead(drumline_worker::cli::Command),
    /// Print a shell completion script for `drumline` on stdout.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

fn main() -> ExitCode {
    // The worker's shell-task supervisor is this binary too (docs/design.md#the-task-supervisor).
    if let Some(code) = drumline_worker::supervisor::builtin() {
        return ExitCode::from(u8::try_from(code).unwrap_or(u8::MAX));
    }
    let cli = Cli::parse();
    match &cli.command {
        Command::Completions { shell } => return completions(*shell),
        Command::Worker(_) => {
            drumline_worker::executor::use_builtin_supervisor();
            // JSON logs carry task output as events, not raw text between them.
            let json = cli.common.log_format == drumline_shared::logging::LogFormat::Json;
            drumline_worker::output::output_as_events(json);
        }
        _ => {}
    }
    run_to_exit(cli.common.log_format, dispatch(cli))
}

/// Prints the completion script for `shell`. A reader that stops early (`| head -1`) ends the
/// command quietly: the script is made first, then written, and a closed pipe is no error.
fn completions(shell: clap_complete::Shell) -> ExitCode {
    use std::io::Write;
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "drumline", &mut script);
    match std::io::stdout().lock().write_all(&script) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: cannot write the script: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Load the config, then run the command.
async fn dispatch(cli: Cli) -> Result<(), Failure> {
    let (config, path) = cli.common.load()?;
    match cli.command {
        Command::Beat(options) => drumline_ops::commands::run(config, options).await,
        Command::Worker(options) => drumline_worker::commands::run(config, options).await,
        Command::Operate(command) => command.run(config, &path).await,
        Command::Dead(command) => command.run(config).await,
        Command::Completions { .. } => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_beat_and_worker_command_is_a_drumline_command() {
        let drumline = Cli::command();
        let ours: Vec<&str> = drumline.get_subcommands().map(|c| c.get_name()).collect();
        let beat = drumline_ops::cli::Command::augment_subcommands(clap::Command::new("b"));
        let worker = drumline_worker::cli::Command::augment_subcommands(clap::Command::new("w"));
        for command in beat.get_subcommands().chain(worker.get_subcommands()) {
            assert!(ours.contains(&command.get_name()), "{}", command.get_name());
        }
        drumline.debug_assert();
    }
}
