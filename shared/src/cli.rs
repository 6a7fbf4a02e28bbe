//! The flags every drumline binary takes, flattened into each one's `clap` parser (feature
//! `bin-support`).

use crate::logging::LogFormat;
use clap::Args;
use std::path::PathBuf;

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
