//! The soak harness behind `scripts/soak --for D --seed N` (docs/soak.md): exits 0 when the
//! promise held, 1 on any violation, 2 on bad arguments.

use drumline_e2e::soak::{run, Options};
use std::process::ExitCode;
use std::time::Duration;

fn main() -> ExitCode {
    match parse(std::env::args().skip(1)) {
        Ok(opts) => {
            if run(&opts).holds() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("soak: {e}\nusage: scripts/soak [--for 60s] [--seed N]");
            ExitCode::from(2)
        }
    }
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Options, String> {
    let mut opts = Options {
        duration: Duration::from_secs(60),
        seed: 1,
    };
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--for" => opts.duration = drumline_shared::duration::parse(&value)?,
            "--seed" => opts.seed = value.parse().map_err(|e| format!("--seed: {e}"))?,
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    Ok(opts)
}
