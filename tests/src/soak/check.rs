//! The soak's verdict from effects: every task appends `KEY ATTEMPT FENCE` when it runs; the
//! expected keys' run records are read from Redis. Pure functions over what was read, so the
//! rules are unit-tested.

use std::collections::{BTreeMap, BTreeSet};

/// One execution of a task, as its effect line says.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Effect {
    /// The idempotency key.
    pub key: String,
    /// `DRUMLINE_ATTEMPT`.
    pub attempt: u32,
    /// `DRUMLINE_FENCING_TOKEN`.
    pub fence: u64,
}

/// Parses effect lines (unreadable lines are kept as violations by [`check`]).
pub fn parse(lines: &[String]) -> (Vec<Effect>, Vec<String>) {
    let mut effects = Vec::new();
    let mut bad = Vec::new();
    for line in lines {
        let mut parts = line.split(' ');
        let parsed = (|| {
            Some(Effect {
                key: parts.next()?.to_owned(),
                attempt: parts.next()?.parse().ok()?,
                fence: parts.next()?.parse().ok()?,
            })
        })();
        match parsed {
            Some(e) => effects.push(e),
            None => bad.push(format!("unreadable effect line {line:?}")),
        }
    }
    (effects, bad)
}

/// What the check was given.
#[derive(Debug, Default)]
pub struct Observed {
    /// Executions of the succeeding tasks (`ok`, `slow`).
    pub successes: Vec<Effect>,
    /// Executions of the failing task.
    pub failures: Vec<Effect>,
    /// Keys that must have succeeded (or be visibly dead): due instants, confirmed ad-hoc keys.
    pub must_succeed: BTreeSet<String>,
    /// Confirmed ad-hoc keys of the failing task: must be dead.
    pub must_die: BTreeSet<String>,
    /// The run record's `state` of every key above (absent: no record).
    pub states: BTreeMap<String, String>,
    /// `max_retries` of the failing task.
    pub fail_retries: u32,
}

/// What the check found.
#[derive(Debug, Default)]
pub struct Findings {
    /// Broken promises: `key: rule: evidence`.
    pub violations: Vec<String>,
    /// Keys that ran again under a newer fencing token after a success whose record could not
    /// land first (a frozen or partitioned worker): the documented limit, not a violation.
    pub superseded: Vec<String>,
    /// Due keys that ended dead (visible, allowed).
    pub dead: Vec<String>,
}

/// Applies the rules (see docs/soak.md).
pub fn check(seen: &Observed) -> Findings {
    let mut out = Findings::default();
    let by_key = group(&seen.successes);
    for (key, runs) in &by_key {
        let fences: BTreeSet<u64> = runs.iter().map(|e| e.fence).collect();
        if fences.len() < runs.len() {
            out.violations
                .push(format!("{key}: succeeded twice under one claim: {runs:?}"));
        } else if runs.len() > 1 {
            out.superseded.push(format!("{key}: fences {fences:?}"));
        }
    }
    for key in &seen.must_succeed {
        let state = seen.states.get(key).map(String::as_str);
        match (state, by_key.contains_key(key)) {
            (Some("done"), true) => {}
            (Some("dead"), _) => out.dead.push(key.clone()),
            (state, ran) => out.violations.push(format!(
                "{key}: missed: run record state {state:?}, effect written: {ran}"
            )),
        }
    }
    let failing = group(&seen.failures);
    for key in &seen.must_die {
        let state = seen.states.get(key).map(String::as_str);
        if state != Some("dead") {
            out.violations.push(format!(
                "{key}: not dead after its retries: state {state:?}"
            ));
        }
    }
    for (key, runs) in &failing {
        let pairs: BTreeSet<(u32, u64)> = runs.iter().map(|e| (e.attempt, e.fence)).collect();
        if pairs.len() < runs.len() {
            out.violations.push(format!(
                "{key}: one attempt ran twice under one claim: {runs:?}"
            ));
        }
        if let Some(e) = runs.iter().find(|e| e.attempt > seen.fail_retries) {
            out.violations.push(format!(
                "{key}: attempt {} beyond max_retries {}: {runs:?}",
                e.attempt, seen.fail_retries
            ));
        }
        if runs.windows(2).any(|w| w[1].attempt < w[0].attempt) {
            out.violations
                .push(format!("{key}: attempts went backwards: {runs:?}"));
        }
    }
    out
}

/// Effects by key, in the order they were written.
fn group(effects: &[Effect]) -> BTreeMap<String, Vec<Effect>> {
    let mut map: BTreeMap<String, Vec<Effect>> = BTreeMap::new();
    for e in effects {
        map.entry(e.key.clone()).or_default().push(e.clone());
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(key: &str, attempt: u32, fence: u64) -> Effect {
        Effect {
            key: key.into(),
            attempt,
            fence,
        }
    }

    fn observed() -> Observed {
        Observed {
            fail_retries: 2,
            ..Default::default()
        }
    }

    #[test]
    fn a_second_success_under_one_claim_is_a_violation_a_newer_fence_is_not() {
        let mut seen = observed();
        seen.successes = vec![e("a", 0, 1), e("a", 0, 1), e("b", 0, 1), e("b", 0, 2)];
        let found = check(&seen);
        assert_eq!(found.violations.len(), 1, "{found:?}");
        assert!(found.violations[0].starts_with("a: succeeded twice"));
        assert_eq!(found.superseded.len(), 1);
    }

    #[test]
    fn a_due_key_without_success_is_missed_unless_dead() {
        let mut seen = observed();
        seen.successes = vec![e("ran", 0, 1)];
        for k in ["ran", "never", "dead", "done-no-effect"] {
            seen.must_succeed.insert(k.into());
        }
        seen.states.insert("ran".into(), "done".into());
        seen.states.insert("dead".into(), "dead".into());
        seen.states.insert("done-no-effect".into(), "done".into());
        let found = check(&seen);
        assert_eq!(found.dead, vec!["dead".to_owned()]);
        let missed: Vec<&str> = found
            .violations
            .iter()
            .map(|v| v.split(':').next().unwrap())
            .collect();
        assert_eq!(missed, vec!["done-no-effect", "never"]);
    }

    #[test]
    fn failing_keys_die_within_their_attempts_never_going_backwards() {
        let mut seen = observed();
        seen.must_die.insert("f".into());
        seen.states.insert("f".into(), "dead".into());
        seen.failures = vec![e("f", 0, 1), e("f", 1, 2), e("f", 1, 3), e("f", 2, 4)];
        assert!(check(&seen).violations.is_empty());
        seen.must_die.insert("g".into());
        seen.failures.push(e("g", 1, 2));
        seen.failures.push(e("g", 0, 3));
        seen.failures.push(e("g", 3, 4));
        let found = check(&seen).violations;
        assert_eq!(found.len(), 3, "{found:?}");
    }

    #[test]
    fn lines_parse() {
        let (effects, bad) = parse(&["k 1 7".into(), "junk".into()]);
        assert_eq!(effects, vec![e("k", 1, 7)]);
        assert_eq!(bad.len(), 1);
    }
}
