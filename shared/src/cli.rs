//! The flags every drumline binary takes, flattened into each one's `clap` parser, and how a
//! binary runs its command (feature `bin-support`).

use crate::config::{self, Config};
use crate::exit::{self, Failure};
use crate::logging::LogFormat;
use clap::Args;
use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// `--config` and `--log-format`, for every subcommand.
#[derive(Args, Debug)]
pub struct Common {
    /// Config file [default: $DRUMLINE_CONFIG, else ./drumline.toml].
    #[arg(long, global = true)]
    pub config: Option<PathBuf>,
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    pub log_format: LogFormat,
}

impl Common {
    /// The config file these flags name (`--config`, else `$DRUMLINE_CONFIG`, else
    /// `./drumline.toml`) and its path; a file that does not load is a usage failure. Its
    /// `[telemetry] otlp_endpoint`, if any, starts the span exporter ([`run_to_exit`] flushes
    /// it).
    pub fn load(&self) -> Result<(Config, PathBuf), Failure> {
        let path = config::resolve_path(self.config.clone());
        let config = Config::load(&path).map_err(Failure::usage)?;
        crate::telemetry::start(&config.telemetry).map_err(Failure::usage)?;
        Ok((config, path))
    }
}

/// Sets up logging in `format`, runs a binary's `command` on one tokio runtime and makes its
/// result the exit code, after sending the spans still queued. Dropping a runtime waits for its blocking tasks without limit; the
/// command has stopped in order by then, so nothing left there may delay the exit by more than
/// a second.
pub fn run_to_exit(
    format: LogFormat,
    command: impl Future<Output = Result<(), Failure>>,
) -> ExitCode {
    crate::logging::init(format);
    let runtime = tokio::runtime::Runtime::new().expect("cannot start the tokio runtime");
    let result = runtime.block_on(command);
    runtime.shutdown_timeout(Duration::from_secs(1));
    crate::spans::shutdown();
    exit::report(result)
}
