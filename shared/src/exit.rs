//! The binaries' edge: how a command failed, and the exit code that carries (docs/design.md: 0 ok,
//! 2 bad usage or config, 1 anything else). Both mains end in [`report`].

use std::fmt::Display;
use std::process::ExitCode;

/// Why a command failed; each variant carries its exit code.
#[derive(Debug, PartialEq, Eq)]
pub enum Failure {
    /// Bad usage or config (exit code 2): the message says what to fix.
    Usage(String),
    /// Anything else (exit code 1).
    Other(String),
    /// Already told on stderr, line by line (exit code 1).
    Reported,
}

impl Failure {
    /// Bad usage or config, described by `e`.
    pub fn usage(e: impl Display) -> Self {
        Failure::Usage(e.to_string())
    }

    /// Any other failure, described by `e`.
    pub fn other(e: impl Display) -> Self {
        Failure::Other(e.to_string())
    }

    /// The process exit code.
    pub fn code(&self) -> u8 {
        match self {
            Failure::Usage(_) => 2,
            Failure::Other(_) | Failure::Reported => 1,
        }
    }
}

/// A command's outcome as the process exit code; a failure's message goes to stderr first as
/// `error: …`.
pub fn report(result: Result<(), Failure>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            if let Failure::Usage(message) | Failure::Other(message) = &failure {
                eprintln!("error: {message}");
            }
            ExitCode::from(failure.code())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_failure_carries_its_exit_code() {
        assert_eq!(Failure::usage("bad").code(), 2);
        assert_eq!(Failure::other("down").code(), 1);
        assert_eq!(Failure::Reported.code(), 1);
    }
}
