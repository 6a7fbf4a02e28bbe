//! `jitter = "D"` end to end (docs/design.md#jitter): every instant of a job is published the
//! same offset in `[0, D)` late, from a hash of the namespace and the job's name. The offset is
//! the same in `next` from any config that holds the job, on every beat, and after a restart;
//! the key and `scheduled_for` keep the instant, so dedupe is unchanged.

use chrono::{DateTime, TimeDelta, Utc};
use drumline_e2e::cfg::{every, Cfg, Keys};
use drumline_e2e::snoop::Snoop;
use drumline_e2e::{counts, setup, wait_until, TestEnv};
use drumline_shared::envelope::format_instant;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);
const JITTER: Duration = Duration::from_millis(1500);

/// The job `spread` (every 2 s, jitter 1.5 s) writing its key to `effects`; with `other`, a
/// job of another name before it (which must not move `spread`'s offset).
fn config(env: &TestEnv, name: &str, other: bool) -> PathBuf {
    let task = Keys::default().with("command", &env.append_key_command("effects", 0.0));
    let mut cfg = Cfg::new().task("spread", task);
    if other {
        cfg = cfg.job(
            "other",
            every("1h")
                .with("task", "\"spread\"")
                .with("jitter", "\"59m\""),
        );
    }
    cfg = cfg.job("spread", every("2s").with("jitter", "\"1500ms\""));
    env.write_config(name, &cfg)
}

fn beat_cmd(env: &TestEnv, cfg: &Path, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["--config", cfg.to_str().expect("utf-8 path")];
    all.extend_from_slice(args);
    let (status, out, err) = env.run("drumline-beat", &all);
    (status.code().unwrap_or(-1), out, err)
}

fn instant(text: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(text)
        .unwrap_or_else(|e| panic!("{text:?}: {e}"))
        .with_timezone(&Utc)
}

/// The offset this test's job gets: what every beat must apply.
fn expected_offset(env: &TestEnv) -> TimeDelta {
    let ns = env.names();
    let offset = drumline_shared::jitter::offset(ns.namespace(), "spread", JITTER);
    TimeDelta::from_std(offset).unwrap()
}

#[test]
fn next_shows_the_instant_and_the_same_jittered_time_from_any_config() {
    let env = setup("jitter_next");
    let plain = config(&env, "a.toml", false);
    let other = config(&env, "b.toml", true);
    let args = [
        "next",
        "spread",
        "--json",
        "--count",
        "4",
        "--from",
        "2026-05-01T00:00:00Z",
    ];
    let json = |cfg: &Path| -> Vec<Value> {
        let (code, out, err) = beat_cmd(&env, cfg, &args);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
    };
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
    let table = [
        "next",
        "spread",
        "--count",
        "4",
        "--from",
        "2026-05-01T00:00:00Z",
    ];
    let (code, out, err) = beat_cmd(&env, &plain, &table);
    assert_eq!(code, 0, "{err}");
    let header = out.lines().next().unwrap_or_default();
    assert!(
        header.contains("UTC") && header.contains("RUNS AT"),
        "{out}"
    );
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

/// A beat, a second beat standing by that takes over when the first stops, then the first
/// started again: every published copy carries the instant in its key and `scheduled_for`,
/// and none left before instant + offset; each instant ran once.
#[tokio::test(flavor = "multi_thread")]
async fn two_beats_and_a_restart_publish_each_instant_its_offset_late() {
    let mut env = setup("jitter_beats");
    let cfg = config(&env, "drumline.toml", false);
    let cfg = cfg.to_str().unwrap().to_owned();
    let mut worker = env.worker("worker", &["--config", &cfg]);
    env.wait_for_topology(&worker).await;
    let snoop = Snoop::start(&mut env, "default");
    let ran = |env: &TestEnv| env.lines("effects").len();
    let grows_by = |env: &TestEnv, n: usize| {
        let from = ran(env);
        wait_until(WAIT, || ran(env) >= from + n)
    };

    let mut first = env.beat("beat-a", &["--config", &cfg]);
    assert!(grows_by(&env, 2), "{}", first.log_tail(20));
    let mut second = env.beat("beat-b", &["--config", &cfg]);
    assert!(first.terminate(Duration::from_secs(10)).success());
    assert!(grows_by(&env, 3), "{}", second.log_tail(20));
    assert!(second.terminate(Duration::from_secs(10)).success());
    let mut again = env.beat("beat-a-again", &["--config", &cfg]);
    assert!(grows_by(&env, 3), "{}", again.log_tail(20));
    assert!(again.terminate(Duration::from_secs(10)).success());

    let offset = expected_offset(&env);
    let published: Vec<_> = snoop
        .settle()
        .into_iter()
        .filter(|m| !m.via_delay)
        .collect();
    let epochs: std::collections::BTreeSet<_> = published.iter().map(|m| m.epoch).collect();
    assert!(epochs.len() >= 3, "three terms published: {epochs:?}");
    for m in &published {
        let e = &m.envelope;
        let at = e.scheduled_for;
        assert_eq!(
            e.key,
            format!("spread@{}", format_instant(at)),
            "key is the instant"
        );
        assert!(
            at.timestamp() % 2 == 0 && at.timestamp_subsec_nanos() == 0,
            "scheduled_for is on the un-jittered grid: {}",
            e.key
        );
        assert!(
            e.published_at >= at + offset,
            "{} published at {}",
            e.key,
            e.published_at
        );
        assert!(
            m.arrived >= at + offset,
            "{} arrived at {}",
            e.key,
            m.arrived
        );
    }

    // Dedupe is unchanged: every instant ran exactly once.
    assert!(worker.terminate(Duration::from_secs(20)).success());
    let effects = env.lines("effects");
    assert!(effects.len() >= 8, "{effects:?}");
    for (key, n) in counts(&effects) {
        assert_eq!(n, 1, "{key} ran {n} times");
    }
}
