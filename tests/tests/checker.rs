//! The randomized checker (docs/soak.md#the-randomized-checker), three seeds briefly: each
//! draws jobs, operator actions and faults, runs them on the real binaries, and must find
//! the promise kept by its own oracle and `drumline verify` agreeing with it.
//! `scripts/soak --random --for D --seed N` runs it for longer.

use drumline_e2e::checker::run_round;
use std::time::Duration;

/// How long each seed's events go on.
const ROUND: Duration = Duration::from_secs(30);

fn holds(seed: u64) {
    let verdict = run_round(seed, ROUND, None);
    println!("{}", verdict.summary(verdict.took));
    assert!(verdict.holds(), "{}", verdict.summary(verdict.took));
}

#[test]
fn random_round_seed_1_keeps_the_promise() {
    holds(1);
}

#[test]
fn random_round_seed_2_keeps_the_promise() {
    holds(2);
}

#[test]
fn random_round_seed_3_keeps_the_promise() {
    holds(3);
}
