//! Labelled metrics (docs/design.md "Metrics with labels"): after a known workload, a worker's and a
//! beat's `/metrics` hold exactly that workload, series by series; and the example alert rules
//! (`examples/alerts.yml`) pass `promtool`.
//!
//! The beat's workload is made deterministic the way tests/tests/misfire.rs does it: each job's
//! persisted last instant is written in the past, the jobs run every minute on a timeline whose
//! next instant is 30 s away, so the beat publishes and drops a known set of instants at start
//! and nothing more while the test runs.

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use drumline_e2e::cfg::{every, shell, Cfg};
use drumline_e2e::probe::{expect, expect_async, rows, series, stop, total as total_over};
use drumline_e2e::{adhoc, setup, Proc, TestEnv};
use drumline_shared::envelope::instance_key;
use lapin::options::BasicGetOptions;
use lapin::types::ShortString;
use lapin::BasicProperties;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// Empties `{ns}.dead` (the workload dead-letters three messages; they are not under test here).
async fn drain_dead_letters(env: &TestEnv) -> usize {
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    let options = BasicGetOptions { no_ack: true };
    let mut n = 0;
    while ch
        .basic_get(env.names().dead().as_str().into(), options)
        .await
        .unwrap()
        .is_some()
    {
        n += 1;
    }
    let _ = conn.close(200, "bye".into()).await;
    n
}

/// Two minute jobs whose next instant is `anchor`, 30 s away: `catchup` has 9 instants due at
/// start (4 past misfire_grace, 5 missed of which catch_up keeps 3), `skipper` 2, both missed
/// and skipped by policy. Tasks: `ok` and `tock` append, `fails` appends and fails.
fn workload(env: &TestEnv, anchor: DateTime<Utc>) -> Cfg {
    let anchor = anchor.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true);
    let catchup = [
        ("misfire", "catch_up"),
        ("misfire_grace", "5m"),
        ("overlap", "allow"),
    ];
    let catchup = every("1m").texts(&catchup).with("max_catch_up", "3");
    let skipper = every("1m").text("misfire", "skip");
    let fails = format!(
        "echo \"$DRUMLINE_KEY\" >> {}; exit 1",
        env.path("fails").display()
    );
    let retries = [("retry_base", "200ms"), ("retry_max", "400ms")];
    Cfg::new()
        .worker_slots(4, "5s")
        .job("catchup", catchup.text("anchor", &anchor).task("tock"))
        .job("skipper", skipper.text("anchor", &anchor).task("tock"))
        .task("ok", env.appender("ok", 0.0))
        .task("tock", env.appender("tock", 0.0))
        .task(
            "fails",
            shell(&fails).with("max_retries", "2").texts(&retries),
        )
}

/// The worker's workload: three successes, one failure through its two retries into dead,
/// one unknown task, one undecodable message, one envelope of a known task that breaks a
/// limit (an ad-hoc key impersonating a job's instance), then a duplicate of a success.
async fn publish_workload(env: &TestEnv, worker: &Proc, anchor: DateTime<Utc>) {
    for key in ["ok-1", "ok-2", "ok-3"] {
        env.publish(&adhoc(key, "ok")).await;
    }
    env.publish(&adhoc("fail-1", "fails")).await;
    env.publish(&adhoc("nope-1", "nope")).await;
    let raw = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type(ShortString::from("application/json"));
    env.publish_raw("default", b"{not json", raw.clone()).await;
    let impostor = instance_key("catchup", anchor - TimeDelta::hours(1));
    let impostor = adhoc(&impostor, "ok").encode();
    env.publish_raw("default", &impostor, raw).await;
    expect_async(WAIT, &[worker], "ok-1 never ran", || async {
        env.run_state("ok-1").await.as_deref() == Some("done")
    })
    .await;
    env.publish(&adhoc("ok-1", "ok")).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_after_a_known_workload_equal_it_per_label() {
    let env = setup("e2e_metrics");
    // Minute jobs whose next instant is 30 s away: the newest missed one is ~30 s old.
    let now = Utc::now();
    let anchor = now.duration_trunc(TimeDelta::seconds(1)).unwrap() + TimeDelta::seconds(30);
    let config = env.config_file(&workload(&env, anchor));
    env.set_beat_last("catchup", anchor - TimeDelta::minutes(10))
        .await;
    env.set_beat_last("skipper", anchor - TimeDelta::minutes(3))
        .await;
    let (mut worker, worker_port) = env.worker_serving("worker", &config);
    env.wait_for_topology(&worker).await;
    let (mut beat, beat_port) = env.beat_serving("beat", &config);
    publish_workload(&env, &worker, anchor).await;

    let runs = rows(&[
        (r#"{task="ok",outcome="success"}"#, 3.0),
        (r#"{task="ok",outcome="duplicate"}"#, 1.0),
        (r#"{task="ok",outcome="malformed"}"#, 1.0),
        (r#"{task="fails",outcome="retry"}"#, 2.0),
        (r#"{task="fails",outcome="dead"}"#, 1.0),
        (r#"{task="unknown",outcome="dead"}"#, 1.0),
        (r#"{task="unknown",outcome="malformed"}"#, 1.0),
        (r#"{task="tock",outcome="success"}"#, 3.0),
    ]);
    let published = rows(&[(r#"{job="catchup"}"#, 3.0)]);
    let dropped = rows(&[
        (r#"{job="catchup",reason="past_grace"}"#, 4.0),
        (r#"{job="catchup",reason="misfire_catch_up"}"#, 2.0),
        (r#"{job="skipper",reason="misfire_skip"}"#, 2.0),
    ]);
    let worker_series = |name: &str| series(worker_port, name);
    let (runs_total, published_total) = (
        "drumline_worker_runs_total",
        "drumline_beat_published_total",
    );
    let total: f64 = runs.values().sum();
    expect(WAIT, &[&worker, &beat], "the workload settled", || {
        worker_series(runs_total).values().sum::<f64>() >= total
            && series(beat_port, published_total) == published
    });

    // Per label, exactly the workload.
    assert_eq!(worker_series(runs_total), runs);
    assert_eq!(series(beat_port, published_total), published);
    assert_eq!(series(beat_port, "drumline_beat_dropped_total"), dropped);
    // One observation per run: three runs of `ok`, three of `fails`, three of `tock`.
    let tasks = [r#"{task="fails"}"#, r#"{task="ok"}"#, r#"{task="tock"}"#];
    let counts = rows(&tasks.map(|t| (t, 3.0)));
    assert_eq!(worker_series("drumline_worker_run_seconds_count"), counts);
    assert_eq!(worker_series("drumline_worker_lag_seconds_count"), counts);
    // Lag is run start − scheduled_for: the caught-up instants were 30 s, 90 s and 150 s late
    // when the beat started.
    let tock_lag = worker_series("drumline_worker_lag_seconds_sum")[tasks[2]];
    assert!((270.0..400.0).contains(&tock_lag), "{tock_lag}");
    // A success sets the task's last-success time; a task that never succeeded has none.
    let last = worker_series("drumline_worker_last_success_timestamp_seconds");
    assert_eq!(last.keys().collect::<Vec<_>>(), [tasks[1], tasks[2]]);
    let started = now.timestamp() as f64;
    assert!(last.values().all(|t| *t >= started), "{last:?}");
    // The unlabelled totals agree with the labelled series.
    let total_of =
        |name: &str| total_over(&[worker_port], &format!("drumline_worker_{name}_total"));
    let totals = ["succeeded", "retried", "duplicates", "dead_lettered"].map(total_of);
    assert_eq!(totals, [6.0, 2.0, 1.0, 4.0]);
    // What the handlers did: the effects match the counts.
    let effects = ["ok", "fails", "tock"].map(|f| env.lines(f).len());
    assert_eq!(effects, [3, 3, 3]);
    assert_eq!(drain_dead_letters(&env).await, 4);
    stop(&mut [&mut beat, &mut worker]);
}

/// `examples/alerts.yml` is valid (`promtool check rules`) and its alerts fire when they say
/// (`promtool test rules tests/promtool/alerts_test.yml`). promtool comes with Debian's
/// `prometheus` package; `scripts/services promtool` installs it, and scripts/test does first.
#[test]
fn example_alerts_pass_promtool() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    for args in [
        ["check", "rules", "examples/alerts.yml"],
        ["test", "rules", "tests/promtool/alerts_test.yml"],
    ] {
        let out = Command::new("promtool")
            .args(args)
            .current_dir(root)
            .output()
            .unwrap_or_else(|e| {
                panic!("promtool: {e}: install it with `scripts/services promtool`")
            });
        assert!(
            out.status.success(),
            "promtool {}:\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
