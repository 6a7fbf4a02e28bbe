//! `jitter = "D"` end to end (docs/design.md#jitter): every instant of a job is published the
//! same offset in `[0, D)` late, from a hash of the namespace and the job's name. The offset is
//! the same in `next` from any config that holds the job, on every beat, and after a restart;
//! the key and `scheduled_for` keep the instant, so dedupe is unchanged.

use chrono::TimeDelta;
use drumline_e2e::cfg::{every, Cfg};
use drumline_e2e::scenario::{appends, parse_instant as instant, stop, Scenario};
use drumline_e2e::snoop::{Snoop, Snooped};
use drumline_e2e::{counts, setup, TestEnv};
use drumline_shared::envelope::format_instant;
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);
const JITTER: Duration = Duration::from_millis(1500);

/// The job `spread` (every 2 s, jitter 1.5 s) writing its key to `effects`; with `other`, a
/// job of another name before it (which must not move `spread`'s offset).
fn config(env: &TestEnv, other: bool) -> Cfg {
    let mut cfg = Cfg::new().task("spread", appends(env, "effects"));
    if other {
        cfg = cfg.job(
            "other",
            every("1h")
                .with("task", "\"spread\"")
                .with("jitter", "\"59m\""),
        );
    }
    cfg.job("spread", every("2s").with("jitter", "\"1500ms\""))
}

fn beat_cmd(env: &TestEnv, cfg: &Path, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["--config", cfg.to_str().expect("utf-8 path")];
    all.extend_from_slice(args);
    let (status, out, err) = env.run("drumline-beat", &all);
    (status.code().unwrap_or(-1), out, err)
}

/// The offset this test's job gets: what every beat must apply.
fn expected_offset(env: &TestEnv) -> TimeDelta {
    let ns = env.names();
    let offset = drumline_shared::jitter::offset(ns.namespace(), "spread", JITTER);
    TimeDelta::from_std(offset).unwrap()
}

/// `next spread`: four instants from 2026-05-01 midnight.
const NEXT: [&str; 6] = [
    "next",
    "spread",
    "--count",
    "4",
    "--from",
    "2026-05-01T00:00:00Z",
];

/// `drumline-beat --config CFG next … --json`, which must succeed: its rows.
fn next_json(env: &TestEnv, cfg: &Path) -> Vec<Value> {
    let (code, out, err) = beat_cmd(env, cfg, &[&NEXT[..], &["--json"]].concat());
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

#[test]
fn next_shows_the_instant_and_the_same_jittered_time_from_any_config() {
    let env = setup("jitter_next");
    let plain = env.write_config("a.toml", &config(&env, false));
    let other = env.write_config("b.toml", &config(&env, true));
    let json = |cfg: &Path| next_json(&env, cfg);
    let first = json(&plain);
    assert_eq!(json(&plain), first, "a second invocation");
    assert_eq!(json(&other), first, "a config with another job before it");
    let offset = expected_offset(&env);
    assert!(offset >= TimeDelta::zero() && offset < TimeDelta::from_std(JITTER).unwrap());
    let mut want_utc = instant("2026-05-01T00:00:02Z");
    for line in &first {
        let utc = instant(line["utc"].as_str().unwrap());
        let runs_at = instant(line["runs_at"].as_str().unwrap());
        assert_eq!(utc, want_utc, "`utc` is the un-jittered instant: {line}");
        assert_eq!(runs_at - utc, offset, "{line}");
        want_utc += TimeDelta::seconds(2);
    }
    // The table shows both columns.
    let (code, out, err) = beat_cmd(&env, &plain, &NEXT);
    assert_eq!(code, 0, "{err}");
    let header = out.lines().next().unwrap_or_default();
    let both = header.contains("UTC") && header.contains("RUNS AT");
    assert!(both, "{out}");
    let row = out.lines().nth(1).unwrap_or_default();
    assert!(row.contains("2026-05-01T00:00:02Z"), "{out}");
    let runs_at = format_instant(instant("2026-05-01T00:00:02Z") + offset);
    assert!(row.contains(&runs_at), "{runs_at} in {out}");
}

#[test]
fn check_refuses_a_jitter_not_below_the_period() {
    let env = setup("jitter_check");
    let task = drumline_e2e::cfg::shell("true");
    let cfg = Cfg::new()
        .task("t", task)
        .job("t", every("30s").with("jitter", "\"30s\""));
    let path = env.write_config("drumline.toml", &cfg);
    let (code, _, err) = beat_cmd(&env, &path, &["check"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(
            "job \"t\": key `jitter`: \"30s\" must be less than the period (every = \"30s\")"
        ),
        "{err}"
    );
}

/// Waits until the effect file has `n` more runs than now.
fn grows_by(sc: &Scenario, n: usize) {
    let ran = || sc.lines("effects").len();
    let from = ran();
    sc.wait(WAIT, format!("fewer than {n} more runs"), || {
        ran() >= from + n
    });
}

/// Copy `m` of `spread` carries its un-jittered instant in its key and `scheduled_for`, and
/// was neither published nor arrived before that instant + `offset`.
fn assert_published_late(m: &Snooped, offset: TimeDelta) {
    let e = &m.envelope;
    let at = e.scheduled_for;
    let (key, due) = (&e.key, at + offset);
    let instant = format!("spread@{}", format_instant(at));
    assert_eq!(*key, instant, "key is the instant");
    let on_grid = at.timestamp() % 2 == 0 && at.timestamp_subsec_nanos() == 0;
    assert!(on_grid, "scheduled_for is on the un-jittered grid: {key}");
    assert!(
        e.published_at >= due,
        "{key} published at {}",
        e.published_at
    );
    assert!(m.arrived >= due, "{key} arrived at {}", m.arrived);
}

/// A beat, a second beat standing by that takes over when the first stops, then the first
/// started again: every published copy carries the instant in its key and `scheduled_for`,
/// and none left before instant + offset; each instant ran once.
#[tokio::test(flavor = "multi_thread")]
async fn two_beats_and_a_restart_publish_each_instant_its_offset_late() {
    let mut sc = Scenario::start("jitter_beats", 0, 1, |env| config(env, false)).await;
    let snoop = Snoop::start(&mut sc, "default");
    // Each beat in turn (the second standing by until the first stops) adds runs.
    sc.start_beat();
    grows_by(&sc, 2);
    sc.start_beat();
    stop(&mut [&mut sc.beats[0]]);
    grows_by(&sc, 3);
    stop(&mut [&mut sc.beats[1]]);
    sc.start_beat();
    grows_by(&sc, 3);
    stop(&mut [sc.last_beat()]);
    let offset = expected_offset(&sc);
    let settled = snoop.settle().into_iter();
    let published: Vec<_> = settled.filter(|m| !m.via_delay).collect();
    let epochs: std::collections::BTreeSet<_> = published.iter().map(|m| m.epoch).collect();
    assert!(epochs.len() >= 3, "three terms published: {epochs:?}");
    for m in &published {
        assert_published_late(m, offset);
    }
    // Dedupe is unchanged: every instant ran exactly once.
    sc.stop();
    let effects = sc.lines("effects");
    assert!(effects.len() >= 8, "{effects:?}");
    for (key, n) in counts(&effects) {
        assert_eq!(n, 1, "{key} ran {n} times");
    }
}
