//! Logging for both binaries: `tracing` to stderr, human by default, `--log-format json` for
//! machines; `RUST_LOG` filters (default `info,lapin=off`: lapin logs an error on every clean
//! close, and we log connection trouble ourselves).

use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Readable lines.
    #[default]
    Human,
    /// One JSON object per line.
    Json,
}

/// Installs the global subscriber.
pub fn init(format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,lapin=off"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
