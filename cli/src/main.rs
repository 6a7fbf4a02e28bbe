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

/// drumline for the person on call: check, inspect and operate the beat, the workers and the
/// dead letters.
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
    #[command(flatten)]
    Beat(drumline_ops::cli::Command),
    #[command(flatten)]
    Worker(drumline_worker::cli::Command),
    /// Print a shell completion script for `drumline` on stdout.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Completions { shell } = cli.command {
        return completions(shell);
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
        Command::Beat(command) => command.run(config, &path).await,
        Command::Worker(command) => command.run(config).await,
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
