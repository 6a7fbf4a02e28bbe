//! The randomized checker (docs/soak.md#the-randomized-checker): rounds drawn from a seed
//! ([`draw`]) run on the real binaries against the real RabbitMQ and Redis, each judged by an
//! oracle that reads only the round, the harness's timeline and the tasks' effect log
//! ([`oracle`]), and `drumline verify` checked against that oracle: every violation the oracle
//! sees must be one `verify` reports, and `verify` must report none the oracle does not.

pub mod draw;
pub mod oracle;
mod round;
pub mod schedules;

pub use round::{run_round, RoundVerdict};
use std::time::{Duration, Instant};

/// How the checker runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Rounds are run until this much time has passed (at least one round).
    pub duration: Duration,
    /// The first round's seed; each next round's is one more.
    pub seed: u64,
    /// How long each round's faults and actions go on.
    pub round: Duration,
    /// A planted defect to switch on in every process (`DRUMLINE_PLANTED_DEFECT`).
    pub defect: Option<String>,
}

/// Runs rounds until `opts.duration` has passed or one fails; returns every round's verdict.
pub fn run(opts: &Options) -> Vec<RoundVerdict> {
    let began = Instant::now();
    let mut verdicts = Vec::new();
    let mut seed = opts.seed;
    loop {
        let verdict = run_round(seed, opts.round, opts.defect.as_deref());
        println!("{}", verdict.summary(began.elapsed()));
        let failed = !verdict.holds();
        verdicts.push(verdict);
        if failed || began.elapsed() >= opts.duration {
            return verdicts;
        }
        seed += 1;
    }
}
