//! Edits to schedules applied at run time race the instants they change
//! (docs/design.md#schedules-as-data): an edit neither publishes an instant twice nor loses
//! one, also when the leader is killed right after it and a standby takes over. Effects are
//! lines the tasks append, one per run.

use drumline_e2e::cfg::{Cfg, Keys};
use drumline_e2e::{assert_contiguous_exactly_once, setup, wait_until, Proc, TestEnv};
use std::time::Duration;

/// The config: task `mark` appends its key to `effects`.
fn start(env: &TestEnv, beats: usize) -> (String, Proc, Vec<Proc>) {
    let mark = Keys::default().with("command", &env.append_key_command("effects", 0.0));
    let cfg = Cfg::new()
        .set("beat", "leader_lease", "\"2s\"")
        .task("mark", mark);
    let path = env.write_config("drumline.toml", &cfg);
    let path = path.to_str().expect("utf-8").to_owned();
    let worker = env.worker("worker", &["--config", &path]);
    let beats = (0..beats)
        .map(|i| env.beat(&format!("beat{i}"), &["--config", &path]))
        .collect();
    (path, worker, beats)
}

/// Applies schedule `s` (every second, missed instants caught up after a takeover) with
/// `args` `{"n": n}`.
fn apply(env: &TestEnv, path: &str, n: usize) {
    let file = env.path(&format!("s{n}.json"));
    let object = format!(
        r#"{{"name": "s", "task": "mark", "every": "1s", "misfire": "catch_up", "overlap": "allow", "args": {{"n": {n}}}}}"#
    );
    std::fs::write(&file, object).expect("write");
    let args = [
        "--config",
        path,
        "schedules",
        "apply",
        file.to_str().expect("utf-8"),
    ];
    let (status, _, err) = env.run("drumline", &args);
    assert!(status.success(), "{err}");
}

fn lines_of(env: &TestEnv) -> Vec<String> {
    env.lines("effects")
        .into_iter()
        .filter(|l| l.starts_with("s@"))
        .collect()
}

/// An edit every 300 ms for 6 s, across the instants it changes: every instant from the
/// first to the last runs exactly once.
#[test]
fn edits_racing_the_instants_neither_double_nor_drop_one() {
    let env = setup("edits_race");
    let (path, _worker, beats) = start(&env, 1);
    apply(&env, &path, 0);
    let running = wait_until(Duration::from_secs(30), || lines_of(&env).len() >= 2);
    assert!(running, "never ran\n{}", beats[0].log_tail(20));
    // Pacing the edits (a load, not a wait for something): 20 of them over about 6 s.
    for n in 1..=20 {
        apply(&env, &path, n);
        std::thread::sleep(Duration::from_millis(300));
    }
    let settled = lines_of(&env).len() + 2;
    assert!(wait_until(Duration::from_secs(10), || lines_of(&env).len() >= settled));
    assert_contiguous_exactly_once(&lines_of(&env), 8);
}

/// The leader is killed right after an edit: the standby, which read the edit from the feed
/// too, takes over; no instant runs twice and none goes missing across the handover.
#[test]
fn a_leader_killed_during_an_edit_hands_over_without_a_double_or_a_gap() {
    let env = setup("edits_kill");
    let (path, _worker, mut beats) = start(&env, 2);
    apply(&env, &path, 0);
    let running = wait_until(Duration::from_secs(30), || lines_of(&env).len() >= 3);
    assert!(running, "never ran\n{}", beats[0].log_tail(20));
    let leader = drumline_e2e::scenario::leader(&env).expect("a leader").pid;
    let (dead, alive) = match beats[0].pid() as u64 == leader {
        true => (0, 1),
        false => (1, 0),
    };
    apply(&env, &path, 1);
    beats[dead].kill9();
    let before = lines_of(&env).len();
    let resumed = wait_until(Duration::from_secs(30), || {
        lines_of(&env).len() >= before + 4
    });
    assert!(
        resumed,
        "the standby did not take over\n{}",
        beats[alive].log_tail(20)
    );
    assert_contiguous_exactly_once(&lines_of(&env), before + 4);
}

/// A schedule's `overlap` reaches workers whose config does not list it (its messages carry
/// it): with `allow`, instances of a task longer than the period all run, none is skipped.
#[test]
fn a_schedules_overlap_is_honoured_by_workers_that_never_saw_it() {
    let env = setup("edits_overlap");
    let slow = Keys::default().with("command", &env.append_key_command("effects", 2.5));
    let path = env.write_config("drumline.toml", &Cfg::new().task("slow", slow));
    let path = path.to_str().expect("utf-8");
    let _worker = env.worker("worker", &["--config", path, "--concurrency", "8"]);
    let beat = env.beat("beat", &["--config", path]);
    let file = env.path("s.json");
    let object = r#"{"name": "s", "task": "slow", "every": "1s", "overlap": "allow"}"#;
    std::fs::write(&file, object).expect("write");
    let (status, _, err) = env.run(
        "drumline",
        &[
            "--config",
            path,
            "schedules",
            "apply",
            file.to_str().expect("utf-8"),
        ],
    );
    assert!(status.success(), "{err}");
    let ran = wait_until(Duration::from_secs(30), || lines_of(&env).len() >= 5);
    assert!(ran, "too few runs\n{}", beat.log_tail(20));
    assert_contiguous_exactly_once(&lines_of(&env), 5);
}
