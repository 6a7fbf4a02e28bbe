//! Labelled metrics (docs/design.md "Metrics with labels"): after a known workload, a worker's and a
//! beat's `/metrics` hold exactly that workload, series by series; and the example alert rules
//! (`examples/alerts.yml`) pass `promtool`.
//!
//! The beat's workload is made deterministic the way tests/tests/misfire.rs does it: each job's
//! persisted last instant is written in the past, the jobs run every minute on a timeline whose
//! next instant is 30 s away, so the beat publishes and drops a known set of instants at start
//! and nothing more while the test runs.

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use drumline_e2e::{
    adhoc, http_get, setup, toml_string, unused_port, wait_until, wait_until_async, with_metrics,
    TestEnv,
};
use drumline_shared::envelope::instance_key;
use drumline_shared::store::last_instant_text;
use lapin::options::BasicGetOptions;
use lapin::types::ShortString;
use lapin::BasicProperties;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// Every series of metric `name` served on `port`: label set (`{a="x",b="y"}`) → value.
fn series(port: u16, name: &str) -> BTreeMap<String, f64> {
    let Some((_, body)) = http_get(port, "/metrics") else {
        return BTreeMap::new();
    };
    body.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
        .filter_map(|l| {
            let (labels, value) = l.split_once("} ")?;
            Some((format!("{{{labels}}}"), value.trim().parse().ok()?))
        })
        .collect()
}

/// `{k="v",…}` → value, for the expected side.
fn expect(rows: &[(&str, f64)]) -> BTreeMap<String, f64> {
    rows.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
}

/// Sets `{ns}:beat:last:{job}` as the beat writes it.
async fn set_last(env: &TestEnv, job: &str, at: DateTime<Utc>) {
    let mut conn = env.redis().await;
    let () = redis::cmd("SET")
        .arg(env.names().beat_last(job))
        .arg(last_instant_text(at))
        .query_async(&mut conn)
        .await
        .expect("SET");
}

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

#[tokio::test(flavor = "multi_thread")]
async fn metrics_after_a_known_workload_equal_it_per_label() {
    let env = setup("e2e_metrics");
    // Minute jobs whose next instant is 30 s away: the newest missed one is ~30 s old.
    let now = Utc::now();
    let anchor = now.duration_trunc(TimeDelta::seconds(1)).unwrap() + TimeDelta::seconds(30);
    let fails = format!(
        "echo \"$DRUMLINE_KEY\" >> {}; exit 1",
        env.path("fails").display()
    );
    let cfg = env.config(
        "drumline.toml",
        &format!(
            r#"
[worker]
concurrency = 4
lease = "5s"

# 9 instants due at start: 4 past misfire_grace, 5 missed of which catch_up keeps 3.
[[jobs]]
name = "catchup"
task = "tock"
every = "1m"
anchor = "{anchor}"
misfire = "catch_up"
max_catch_up = 3
misfire_grace = "5m"
overlap = "allow"

# 2 instants due at start, both missed: skipped by policy.
[[jobs]]
name = "skipper"
task = "tock"
every = "1m"
anchor = "{anchor}"
misfire = "skip"

[tasks.ok]
command = {ok}

[tasks.tock]
command = {tock}

[tasks.fails]
command = ["/bin/sh", "-c", {fails}]
max_retries = 2
retry_base = "200ms"
retry_max = "400ms"
"#,
            anchor = rfc3339(anchor),
            ok = env.append_key_command("ok", 0.0),
            tock = env.append_key_command("tock", 0.0),
            fails = toml_string(&fails),
        ),
    );
    let cfg = cfg.to_str().unwrap();
    set_last(&env, "catchup", anchor - TimeDelta::minutes(10)).await;
    set_last(&env, "skipper", anchor - TimeDelta::minutes(3)).await;

    let (args, worker_port) = with_metrics(&["--config", cfg]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let worker = env.worker("worker", &args);
    env.wait_for_topology(&worker).await;
    let beat_port = unused_port();
    let beat_addr = format!("127.0.0.1:{beat_port}");
    let mut beat = env.beat("beat", &["--config", cfg, "--metrics-addr", &beat_addr]);

    // The worker's workload: three successes, one failure through its two retries into dead,
    // one unknown task, one undecodable message, one envelope of a known task that breaks a
    // limit (an ad-hoc key impersonating a job's instance), then a duplicate of a success.
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
    env.publish_raw("default", &adhoc(&impostor, "ok").encode(), raw)
        .await;
    let done = wait_until_async(WAIT, || async {
        env.run_state("ok-1").await.as_deref() == Some("done")
    })
    .await;
    assert!(done, "ok-1 never ran\n{}", worker.log_tail(30));
    env.publish(&adhoc("ok-1", "ok")).await;

    let runs = expect(&[
        (r#"{task="ok",outcome="success"}"#, 3.0),
        (r#"{task="ok",outcome="duplicate"}"#, 1.0),
        (r#"{task="ok",outcome="malformed"}"#, 1.0),
        (r#"{task="fails",outcome="retry"}"#, 2.0),
        (r#"{task="fails",outcome="dead"}"#, 1.0),
        (r#"{task="unknown",outcome="dead"}"#, 1.0),
        (r#"{task="unknown",outcome="malformed"}"#, 1.0),
        (r#"{task="tock",outcome="success"}"#, 3.0),
    ]);
    let published = expect(&[(r#"{job="catchup"}"#, 3.0)]);
    let dropped = expect(&[
        (r#"{job="catchup",reason="past_grace"}"#, 4.0),
        (r#"{job="catchup",reason="misfire_catch_up"}"#, 2.0),
        (r#"{job="skipper",reason="misfire_skip"}"#, 2.0),
    ]);
    let total: f64 = runs.values().sum();
    let settled = wait_until(WAIT, || {
        series(worker_port, "drumline_worker_runs_total")
            .values()
            .sum::<f64>()
            >= total
            && series(beat_port, "drumline_beat_published_total") == published
    });
    assert!(
        settled,
        "runs {:?}\npublished {:?}\n{}\n{}",
        series(worker_port, "drumline_worker_runs_total"),
        series(beat_port, "drumline_beat_published_total"),
        worker.log_tail(40),
        beat.log_tail(40)
    );

    // Per label, exactly the workload.
    assert_eq!(series(worker_port, "drumline_worker_runs_total"), runs);
    assert_eq!(
        series(beat_port, "drumline_beat_published_total"),
        published
    );
    assert_eq!(series(beat_port, "drumline_beat_dropped_total"), dropped);
    // One observation per run: three runs of `ok`, three of `fails`, three of `tock`.
    let counts = expect(&[
        (r#"{task="fails"}"#, 3.0),
        (r#"{task="ok"}"#, 3.0),
        (r#"{task="tock"}"#, 3.0),
    ]);
    assert_eq!(
        series(worker_port, "drumline_worker_run_seconds_count"),
        counts
    );
    assert_eq!(
        series(worker_port, "drumline_worker_lag_seconds_count"),
        counts
    );
    // Lag is run start − scheduled_for: the caught-up instants were 30 s, 90 s and 150 s late
    // when the beat started.
    let tock_lag = series(worker_port, "drumline_worker_lag_seconds_sum")[r#"{task="tock"}"#];
    assert!((270.0..400.0).contains(&tock_lag), "{tock_lag}");
    // A success sets the task's last-success time; a task that never succeeded has none.
    let last = series(
        worker_port,
        "drumline_worker_last_success_timestamp_seconds",
    );
    assert_eq!(
        last.keys().collect::<Vec<_>>(),
        [r#"{task="ok"}"#, r#"{task="tock"}"#]
    );
    let started = now.timestamp() as f64;
    assert!(last.values().all(|t| *t >= started), "{last:?}");
    // The unlabelled totals agree with the labelled series.
    let total_of = |name: &str| drumline_e2e::metric(worker_port, name).unwrap_or(-1.0);
    assert_eq!(total_of("drumline_worker_succeeded_total"), 6.0);
    assert_eq!(total_of("drumline_worker_retried_total"), 2.0);
    assert_eq!(total_of("drumline_worker_duplicates_total"), 1.0);
    assert_eq!(total_of("drumline_worker_dead_lettered_total"), 4.0);
    // What the handlers did: the effects match the counts.
    assert_eq!(env.lines("ok").len(), 3);
    assert_eq!(env.lines("fails").len(), 3);
    assert_eq!(env.lines("tock").len(), 3);
    assert_eq!(drain_dead_letters(&env).await, 4);

    let status = beat.terminate(Duration::from_secs(15));
    assert!(status.success(), "beat exited with {status}");
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
