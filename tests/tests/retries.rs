//! Retries keep their place (docs/design.md): however many copies of an instance exist (two beats, a
//! re-check copy, a redelivery, a publisher that sent it three times), the instance runs at most
//! `max_retries + 1` times and is dead-lettered once.

use drumline_e2e::cfg::{every, shell, Cfg};
use drumline_e2e::probe::{expect, stop, tails, total};
use drumline_e2e::snoop::Snoop;
use drumline_e2e::{adhoc, metric, setup, wait_until, TestEnv};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(90);

/// A task that logs `KEY ATTEMPT` to `runs`, works for `seconds`, and fails; retries wait
/// `retry_base`, then twice that.
fn failing_task(env: &TestEnv, max_retries: u32, seconds: f64, retry_base: &str) -> Cfg {
    let script = format!(
        "echo \"$DRUMLINE_KEY $DRUMLINE_ATTEMPT\" >> {}; sleep {seconds}; exit 1",
        env.path("runs").display()
    );
    let retries = [("retry_base", retry_base), ("retry_max", "10s")];
    let fails = shell(&script).with("max_retries", &max_retries.to_string());
    Cfg::new()
        .worker_slots(4, "3s")
        .task("fails", fails.texts(&retries))
}

/// The attempts each key ran, from the `KEY ATTEMPT` lines of `runs`, in order.
fn attempts(env: &TestEnv) -> BTreeMap<String, Vec<String>> {
    let mut per_key = BTreeMap::<String, Vec<String>>::new();
    let mut lines = env.lines("runs");
    lines.sort();
    for line in lines {
        let (key, attempt) = line.rsplit_once(' ').unwrap();
        per_key
            .entry(key.to_owned())
            .or_default()
            .push(attempt.to_owned());
    }
    per_key
}

#[tokio::test(flavor = "multi_thread")]
async fn two_beats_two_workers_a_failing_task_runs_max_retries_plus_one_times() {
    let mut env = setup("e2e_retry_chain");
    // With leadership only one of the two beats publishes, so copies come from a handover at
    // the end (the second beat resumes from the fenced progress); the publisher-sent copies
    // are `the_same_envelope_three_times_...` below. Before leadership, the second beat's copy
    // met the first run's live lease and came back one lease (3 s) later, between the first
    // retry's failure (~2 s) and the second retry (~4 s): these timings still hold for any copy.
    let cfg = failing_task(&env, 2, 0.5, "1s")
        .job("tick", every("1s").task("fails").text("overlap", "allow"));
    let config = env.config_file(&cfg);
    let (w1, p1) = env.worker_serving("worker-1", &config);
    let (w2, p2) = env.worker_serving("worker-2", &config);
    let (mut workers, ports) = ([w1, w2], [p1, p2]);
    env.wait_for_topology(&workers[0]).await;
    let snoop = Snoop::start(&mut env, "default");
    let mut beats = [
        env.beat_on("beat-1", &config),
        env.beat_on("beat-2", &config),
    ];

    // A 30 s window of instants, each started at least once.
    let first_runs = |env: &TestEnv| {
        env.lines("runs")
            .iter()
            .filter(|l| l.ends_with(" 0"))
            .count()
    };
    expect(WAIT, &[&workers[0], &beats[0]], "30 first runs", || {
        first_runs(&env) >= 30
    });
    stop(&mut beats.iter_mut().collect::<Vec<_>>());
    // Every copy the beats published, as the broker routed it (retries and re-checks coming
    // back from delay queues left out).
    let published = snoop.published_keys();
    let copies = published.len();
    let keys: BTreeSet<String> = published.into_iter().collect();
    // Every copy ends either as the head of the one retry chain (dead-lettered at its end) or
    // as a counted duplicate.
    let (dups, dead) = (
        "drumline_worker_duplicates_total",
        "drumline_worker_dead_lettered_total",
    );
    let settled = wait_until(WAIT, || {
        total(&ports, dups) + total(&ports, dead) >= copies as f64
    });
    let (dead_lettered, duplicates) = (total(&ports, dead), total(&ports, dups));
    stop(&mut workers.iter_mut().collect::<Vec<_>>());

    let per_key = attempts(&env);
    let wrong: Vec<_> = keys
        .iter()
        .filter(|k| per_key.get(*k).is_none_or(|a| *a != ["0", "1", "2"]))
        .map(|k| (k, per_key.get(k)))
        .collect();
    assert!(
        wrong.is_empty(),
        "instances that did not run exactly attempts 0, 1, 2: {wrong:?}"
    );
    assert!(keys.len() >= 30, "{} instances", keys.len());
    assert!(
        settled,
        "{copies} copies, {duplicates} duplicates, {dead_lettered} dead letters"
    );
    assert_eq!(dead_lettered as usize, keys.len(), "one dead letter each");
    assert_eq!(duplicates as usize + keys.len(), copies);
    let dead_queue = env.queue_len(&env.names().dead()).await;
    assert_eq!(dead_queue, Some(keys.len() as u32));
    for key in &keys {
        assert_eq!(env.run_state(key).await.as_deref(), Some("dead"), "{key}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_same_envelope_three_times_runs_max_retries_plus_one_times() {
    let env = setup("e2e_retry_copies");
    let config = env.config_file(&failing_task(&env, 1, 0.0, "200ms"));
    let (mut worker, port) = env.worker_serving("worker", &config);
    env.wait_for_topology(&worker).await;

    let envelope = adhoc("k-thrice", "fails");
    for _ in 0..3 {
        env.publish(&envelope).await;
    }
    let settled = wait_until(WAIT, || {
        metric(port, "drumline_worker_dead_lettered_total") == Some(1.0)
            && metric(port, "drumline_worker_duplicates_total") == Some(2.0)
    });
    let exposition = drumline_e2e::http_get(port, "/metrics").map(|r| r.1);
    let log = tails(&[&worker]);
    stop(&mut [&mut worker]);
    assert_eq!(env.lines("runs"), vec!["k-thrice 0", "k-thrice 1"]);
    assert!(settled, "{exposition:?}\n{log}");
    assert_eq!(env.queue_len(&env.names().dead()).await, Some(1));
    assert_eq!(env.run_state("k-thrice").await.as_deref(), Some("dead"));
}
