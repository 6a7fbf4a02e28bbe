//! Overlap policies (docs/design.md step 4), end to end: a 1 s job whose task takes longer than a
//! second. `skip` records the overlapping instances `skipped` and never runs two at once;
//! `queue` runs every instance, one after another.

use drumline_e2e::cfg::{every, shell, Cfg};
use drumline_e2e::probe::stop;
use drumline_e2e::snoop::Snoop;
use drumline_e2e::{counts, setup, TestEnv};
use std::collections::BTreeMap;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn config(env: &TestEnv, overlap: &str) -> Cfg {
    let log = env.path("spans");
    let script = format!(
        "echo \"start $DRUMLINE_KEY $(date +%s%N)\" >> {log}; sleep 1.6; echo \"end $DRUMLINE_KEY $(date +%s%N)\" >> {log}",
        log = log.display()
    );
    Cfg::new()
        .worker_slots(4, "3s")
        .task("slow", shell(&script))
        .job("slow", every("1s").text("overlap", overlap))
}

/// (start, end) in ns per key, from the spans file.
fn spans(env: &TestEnv) -> BTreeMap<String, (u128, Option<u128>)> {
    let mut out: BTreeMap<String, (u128, Option<u128>)> = BTreeMap::new();
    for line in env.lines("spans") {
        let parts: Vec<&str> = line.split(' ').collect();
        let at: u128 = parts[2].parse().unwrap();
        match parts[0] {
            "start" => {
                assert!(
                    out.insert(parts[1].to_owned(), (at, None)).is_none(),
                    "{} started twice",
                    parts[1]
                );
            }
            _ => out.get_mut(parts[1]).expect("end after start").1 = Some(at),
        }
    }
    out
}

fn assert_never_two_at_once(spans: &BTreeMap<String, (u128, Option<u128>)>) {
    let mut intervals: Vec<(u128, u128, &String)> = spans
        .iter()
        .map(|(k, (s, e))| (*s, e.expect("finished"), k))
        .collect();
    intervals.sort();
    for pair in intervals.windows(2) {
        assert!(
            pair[0].1 <= pair[1].0,
            "{} and {} overlapped",
            pair[0].2,
            pair[1].2
        );
    }
}

/// Runs one beat and two workers until `runs` instances have started; returns the published
/// keys (as the snoop queue received them from the beat).
async fn run_until(env: &mut TestEnv, overlap: &str, runs: usize) -> Vec<String> {
    let mut scene = env.start(&config(env, overlap), 0, 2).await;
    let snoop = Snoop::start(env, "default");
    scene.beats.push(env.beat_on("beat", &scene.config));
    scene.expect(WAIT, "enough runs started", || spans(env).len() >= runs);
    stop(&mut [&mut scene.beats[0]]);
    let keys = snoop.published_keys();
    // Let every published instance reach a final state.
    for key in &keys {
        let settled = || async {
            let state = env.run_state(key).await;
            matches!(state.as_deref(), Some("done") | Some("skipped"))
        };
        scene
            .expect_async(WAIT, format!("{key} settled"), settled)
            .await;
    }
    scene.stop();
    keys
}

#[tokio::test(flavor = "multi_thread")]
async fn overlap_skip_never_runs_two_at_once_and_records_skips() {
    let mut env = setup("e2e_overlap_skip");
    let keys = run_until(&mut env, "skip", 3).await;
    let spans = spans(&env);
    assert_never_two_at_once(&spans);
    let mut skipped = 0;
    for key in &keys {
        match env.run_state(key).await.as_deref() {
            Some("done") => assert!(spans.contains_key(key), "{key} done but never ran"),
            Some("skipped") => {
                skipped += 1;
                assert!(!spans.contains_key(key), "{key} skipped but ran");
            }
            other => panic!("{key}: {other:?}"),
        }
    }
    assert!(
        skipped >= 1,
        "a 1.6 s task every second must overlap: {keys:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn overlap_queue_runs_every_instance_one_after_another() {
    let mut env = setup("e2e_overlap_queue");
    let keys = run_until(&mut env, "queue", 3).await;
    let spans = spans(&env);
    assert_never_two_at_once(&spans);
    for key in &keys {
        assert_eq!(env.run_state(key).await.as_deref(), Some("done"), "{key}");
        assert!(spans.contains_key(key), "{key} never ran");
    }
    assert_eq!(spans.len(), keys.len());
}

/// Issue 33: a job whose run plus retry delay passes its next instant. Under the default
/// `overlap = "skip"` the failed instance keeps the job through its retry delay, so its retry
/// runs (and succeeds) and the newer instant is the one skipped (docs/guarantees.md).
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_attempts_retry_runs_under_overlap_skip() {
    let env = setup("e2e_overlap_retry_skip");
    let log = env.path("runs").display().to_string();
    let script = format!(
        "echo \"$DRUMLINE_KEY $DRUMLINE_ATTEMPT\" >> {log}; sleep 1.5; [ \"$DRUMLINE_ATTEMPT\" != 0 ]"
    );
    let retries = [("retry_base", "1s"), ("retry_max", "1s")];
    let slowfail = shell(&script).with("max_retries", "3").texts(&retries);
    let cfg = Cfg::new()
        .set("worker", "concurrency", "4")
        .task("slowfail", slowfail);
    let mut scene = env.start(&cfg.job("slowfail", every("2s")), 1, 1).await;
    // Three instances have run their attempt 0.
    let first_attempts = || -> Vec<String> {
        let lines = env.lines("runs").into_iter();
        lines
            .filter_map(|l| l.strip_suffix(" 0").map(str::to_owned))
            .collect()
    };
    scene.expect(WAIT, "three first attempts", || first_attempts().len() >= 3);
    stop(&mut [&mut scene.beats[0]]);
    // Every instance that ran its attempt 0 runs its attempt 1 and ends `done`.
    let started = first_attempts();
    for key in &started {
        env.expect_state(key, "done", &[&scene.workers[0]]).await;
    }
    let runs = counts(&env.lines("runs"));
    for key in &started {
        assert_eq!(runs.get(&format!("{key} 1")), Some(&1), "{key}: {runs:?}");
    }
    scene.stop();
}
