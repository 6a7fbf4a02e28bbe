//! Retries keep their place (docs/design.md): however many copies of an instance exist (two beats, a
//! re-check copy, a redelivery, a publisher that sent it three times), the instance runs at most
//! `max_retries + 1` times and is dead-lettered once.

use drumline_e2e::snoop::Snoop;
use drumline_e2e::{adhoc, counts, metric, setup, toml_string, wait_until, with_metrics, TestEnv};
use std::collections::BTreeSet;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(90);

/// A task that logs `KEY ATTEMPT` to `runs`, works for `seconds`, and fails; retries wait
/// `retry_base`, then twice that.
fn failing_task(env: &TestEnv, max_retries: u32, seconds: f64, retry_base: &str) -> String {
    let script = format!(
        "echo \"$DRUMLINE_KEY $DRUMLINE_ATTEMPT\" >> {}; sleep {seconds}; exit 1",
        env.path("runs").display()
    );
    format!(
        "[tasks.fails]\ncommand = [\"/bin/sh\", \"-c\", {}]\nmax_retries = {max_retries}\nretry_base = \"{retry_base}\"\nretry_max = \"10s\"\n",
        toml_string(&script)
    )
}

/// Sum of a worker counter over several workers' `/metrics`.
fn total(ports: &[u16], name: &str) -> f64 {
    ports.iter().filter_map(|p| metric(*p, name)).sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn two_beats_two_workers_a_failing_task_runs_max_retries_plus_one_times() {
    let mut env = setup("e2e_retry_chain");
    let cfg = env.config(
        "drumline.toml",
        &format!(
            r#"
[worker]
concurrency = 4
lease = "3s"

[[jobs]]
name = "tick"
task = "fails"
every = "1s"
overlap = "allow"

{}"#,
            // With leadership only one of the two beats publishes, so copies come from a
            // handover at the end (the second beat resumes from the fenced progress); the
            // publisher-sent copies are `the_same_envelope_three_times_...` below. Before
            // leadership, the second beat's copy met the first run's live lease and came back
            // one lease (3 s) later, between the first retry's failure (~2 s) and the second
            // retry (~4 s): these timings still hold for any copy.
            failing_task(&env, 2, 0.5, "1s")
        ),
    );
    let cfg = cfg.to_str().unwrap();
    let mut workers = Vec::new();
    let mut ports = Vec::new();
    for i in 1..=2 {
        let (args, port) = with_metrics(&["--config", cfg]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        workers.push(env.worker(&format!("worker-{i}"), &args));
        ports.push(port);
    }
    env.wait_for_topology(&workers[0]).await;
    let snoop = Snoop::start(&mut env, "default");
    let mut beats = [
        env.beat("beat-1", &["--config", cfg]),
        env.beat("beat-2", &["--config", cfg]),
    ];

    // A 30 s window of instants, each started at least once.
    let first_runs = |env: &TestEnv| {
        env.lines("runs")
            .iter()
            .filter(|l| l.ends_with(" 0"))
            .count()
    };
    assert!(
        wait_until(WAIT, || first_runs(&env) >= 30),
        "too few runs\n{}",
        workers[0].log_tail(20)
    );
    for b in &mut beats {
        assert!(b.terminate(Duration::from_secs(10)).success());
    }
    // Every copy the beats published, as the broker routed it (retries and re-checks coming
    // back from delay queues left out).
    let published = snoop.published_keys();
    let copies = published.len();
    let keys: BTreeSet<String> = published.into_iter().collect();
    // Every copy ends either as the head of the one retry chain (dead-lettered at its end) or
    // as a counted duplicate.
    let settled = wait_until(WAIT, || {
        total(&ports, "drumline_worker_duplicates_total")
            + total(&ports, "drumline_worker_dead_lettered_total")
            >= copies as f64
    });
    let dead_lettered = total(&ports, "drumline_worker_dead_lettered_total");
    let duplicates = total(&ports, "drumline_worker_duplicates_total");
    for w in &mut workers {
        assert!(w.terminate(Duration::from_secs(20)).success());
    }

    let runs = counts(&env.lines("runs"));
    let mut per_key = std::collections::BTreeMap::<String, Vec<String>>::new();
    for (line, n) in &runs {
        let (key, attempt) = line.rsplit_once(' ').unwrap();
        for _ in 0..*n {
            per_key
                .entry(key.to_owned())
                .or_default()
                .push(attempt.to_owned());
        }
    }
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
    assert_eq!(
        env.queue_len(&env.names().dead()).await,
        Some(keys.len() as u32)
    );
    for key in &keys {
        assert_eq!(env.run_state(key).await.as_deref(), Some("dead"), "{key}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_same_envelope_three_times_runs_max_retries_plus_one_times() {
    let env = setup("e2e_retry_copies");
    let cfg = env.config(
        "drumline.toml",
        &format!(
            "[worker]\nconcurrency = 4\nlease = \"3s\"\n\n{}",
            failing_task(&env, 1, 0.0, "200ms")
        ),
    );
    let (args, port) = with_metrics(&["--config", cfg.to_str().unwrap()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut worker = env.worker("worker", &args);
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
    assert!(worker.terminate(Duration::from_secs(20)).success());
    assert_eq!(env.lines("runs"), vec!["k-thrice 0", "k-thrice 1"]);
    assert!(settled, "{exposition:?}\n{}", worker.log_tail(30));
    assert_eq!(env.queue_len(&env.names().dead()).await, Some(1));
    assert_eq!(env.run_state("k-thrice").await.as_deref(), Some("dead"));
}
