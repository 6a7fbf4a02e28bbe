//! The worker's operator commands as a clap [`Command`] enum and their dispatch
//! ([`Command::run`]) (feature `cli`): `drumline-worker` and the one `drumline` command both
//! flatten this enum (docs/design.md#one-command-for-operators).

use crate::commands::{self, DlqCommand};
use clap::Subcommand;
use drumline_shared::config::Config;
use drumline_shared::exit::Failure;

/// The worker's operator commands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// The dead letters in {ns}.dead.
    Dlq {
        /// What to do with them.
        #[command(subcommand)]
        action: DlqAction,
    },
}

/// `dlq list | replay | purge`.
#[derive(Subcommand, Debug)]
pub enum DlqAction {
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
    /// Delete every dead letter (asks for `--yes`).
    Purge {
        /// Yes, delete every dead letter: they cannot be replayed afterwards.
        #[arg(long)]
        yes: bool,
    },
}

impl Command {
    /// Runs the command on `config`.
    pub async fn run(self, config: Config) -> Result<(), Failure> {
        let Command::Dlq { action } = self;
        let command = match action {
            DlqAction::List { json } => DlqCommand::List { json },
            DlqAction::Replay { keys, all: _ } => DlqCommand::Replay { keys },
            DlqAction::Purge { yes } => {
                confirm_purge(yes)?;
                DlqCommand::Purge
            }
        };
        commands::dead_letters(&config, command).await
    }
}

/// `dlq purge` deletes for good: without `--yes` it refuses (exit 2), naming the flag.
pub fn confirm_purge(yes: bool) -> Result<(), Failure> {
    if yes {
        Ok(())
    } else {
        Err(Failure::usage(
            "dlq purge deletes every dead letter for good: add --yes to confirm",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn purge_asks_for_yes() {
        let refused = confirm_purge(false).unwrap_err();
        assert_eq!(refused.code(), 2);
        assert!(matches!(&refused, Failure::Usage(m) if m.contains("--yes")));
        assert_eq!(confirm_purge(true), Ok(()));
    }
}
