//! The soak that ships with drumline (docs/soak.md), run for 60 s with seed 1: two beats and
//! three workers on a private RabbitMQ node and a private Redis Sentinel set under seeded random faults;
//! the promise must hold (effect check, and `drumline verify` when the build has it).

use drumline_e2e::soak::{run, Options};
use std::time::Duration;

#[test]
fn a_sixty_second_soak_keeps_the_promise() {
    let verdict = run(&Options {
        duration: Duration::from_secs(60),
        seed: 1,
    });
    let injected: usize = verdict.faults.values().sum();
    assert!(injected >= 10, "too few faults: {:?}", verdict.faults);
    assert!(
        verdict.checked >= 40,
        "too few keys checked: {}",
        verdict.checked
    );
    assert!(
        verdict.holds(),
        "violations: {:#?}\nverify: {:?}",
        verdict.findings.violations,
        verdict.verify
    );
}
