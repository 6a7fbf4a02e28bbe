//! The soak harness behind `scripts/soak` (docs/soak.md): exits 0 when the promise held, 1 on
//! any violation, 2 on bad arguments.
//!
//! - `scripts/soak --for D --seed N`: the fixed-config soak under faults.
//! - `scripts/soak --random --for D --seed N [--round R] [--defect NAME]`: the randomized
//!   checker, one drawn round after another (seeds N, N + 1, …) until D has passed or one
//!   fails; `--defect` plants a defect in every process (debug builds only).

use drumline_e2e::{checker, soak};
use std::process::ExitCode;
use std::time::Duration;

/// What the command line asked for.
enum Mode {
    Fixed(soak::Options),
    Random(checker::Options),
}

fn main() -> ExitCode {
    let held = match parse(std::env::args().skip(1)) {
        Ok(Mode::Fixed(opts)) => soak::run(&opts).holds(),
        Ok(Mode::Random(opts)) => checker::run(&opts).iter().all(|v| v.holds()),
        Err(e) => {
            eprintln!(
                "soak: {e}\nusage: scripts/soak [--for 60s] [--seed N]\n       \
                 scripts/soak --random [--for 10m] [--seed N] [--round 40s] [--defect NAME]"
            );
            return ExitCode::from(2);
        }
    };
    if held {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn parse(args: impl Iterator<Item = String>) -> Result<Mode, String> {
    let mut args: Vec<String> = args.collect();
    let random = args.iter().any(|a| a == "--random");
    args.retain(|a| a != "--random");
    let mut fixed = soak::Options {
        duration: Duration::from_secs(60),
        seed: 1,
    };
    let mut drawn = checker::Options {
        duration: Duration::from_secs(600),
        seed: 1,
        round: Duration::from_secs(40),
        defect: None,
    };
    let mut args = args.into_iter();
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        let duration = || drumline_shared::duration::parse(&value);
        match (flag.as_str(), random) {
            ("--for", false) => fixed.duration = duration()?,
            ("--for", true) => drawn.duration = duration()?,
            ("--seed", _) => {
                let seed = value.parse().map_err(|e| format!("--seed: {e}"))?;
                (fixed.seed, drawn.seed) = (seed, seed);
            }
            ("--round", true) => drawn.round = duration()?,
            ("--defect", true) => {
                let known = drumline_shared::planted::Defect::ALL.map(|d| d.name());
                if !known.contains(&value.as_str()) {
                    return Err(format!("--defect: {value} is none of {known:?}"));
                }
                drawn.defect = Some(value);
            }
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    Ok(if random {
        Mode::Random(drawn)
    } else {
        Mode::Fixed(fixed)
    })
}
