//! `trigger` on a job running under `overlap = "skip"` (docs/design.md#manual-runs): the worker
//! skips the copy (unlike Temporal's trigger, which ignores the overlap policy), and `trigger`
//! now says so on stderr, still exiting 0. Once the run is over, a trigger runs without a
//! warning.

use chrono::{DurationRound, TimeDelta, Utc};
use drumline_e2e::cfg::{every, Cfg};
use drumline_e2e::probe::stop;
use drumline_e2e::{counts, setup, TestEnv};

const WARNING: &str = "is running: this trigger will be skipped";

/// `slow`: hourly (never due during the test), `skip`, its task takes 4 s and then writes its
/// key to `effects`.
fn config(env: &TestEnv) -> String {
    let anchor = (Utc::now() + TimeDelta::minutes(30))
        .duration_trunc(TimeDelta::seconds(1))
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let slow = every("1h").texts(&[("anchor", &anchor), ("overlap", "skip")]);
    let cfg = Cfg::new()
        .worker_slots(4, "5s")
        .job("slow", slow.task("slow"));
    env.config_file(&cfg.task("slow", env.appender("effects", 4.0)))
}

/// `drumline-beat --config CFG trigger slow`, asserted to exit 0: (the key, stderr).
fn trigger(env: &TestEnv, cfg: &str) -> (String, String) {
    let (code, out, err) = env.beat_cmd(cfg, &["trigger", "slow"]);
    assert_eq!(code, 0, "{err}");
    let key = out.split_whitespace().find_map(|w| w.strip_prefix("key="));
    let key = key.unwrap_or_else(|| panic!("no key in {out:?} (stderr: {err})"));
    (key.to_owned(), err)
}

#[tokio::test(flavor = "multi_thread")]
async fn trigger_on_a_running_skip_job_warns_and_runs_nothing_more() {
    let env = setup("trigger_skip_warns");
    let cfg = config(&env);
    let mut worker = env.worker_ready("worker", &cfg).await;

    let (first, err) = trigger(&env, &cfg);
    assert!(!err.contains(WARNING), "nothing runs yet: {err}");
    env.expect_state(&first, "running", &[&worker]).await;

    // While `first` runs: warned, exit 0, and the copy is skipped.
    let (second, err) = trigger(&env, &cfg);
    assert!(err.contains(WARNING), "stderr: {err}");
    assert!(err.contains(&first), "names the running instance: {err}");
    env.expect_state(&second, "skipped", &[&worker]).await;
    env.expect_state(&first, "done", &[&worker]).await;
    let ran = env.lines("effects");
    assert_eq!(ran, [first.as_str()], "the skipped copy never ran");

    // Nothing runs now: no warning, and the trigger runs.
    let (third, err) = trigger(&env, &cfg);
    assert!(!err.contains(WARNING), "nothing runs any more: {err}");
    env.expect_lines("effects", 2, &[&worker]);
    stop(&mut [&mut worker]);
    let effects = counts(&env.lines("effects"));
    let want = [(first, 1), (third, 1)].into_iter().collect();
    assert_eq!(effects, want, "each run once, the skipped copy never");
}
