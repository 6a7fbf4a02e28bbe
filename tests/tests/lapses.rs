//! Attempts outlive the lease (docs/design.md#attempts-outlive-the-lease): the run record is
//! kept after its lease lapses, so a late copy of an earlier attempt is a duplicate, and the
//! retry hand-over rides out a Redis blip instead of leaving the claim to lapse.

use drumline_e2e::proxy::{Fault, Proxy};
use drumline_e2e::{
    adhoc, counts, metric, setup, toml_string, wait_until, wait_until_async, with_metrics, TestEnv,
};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(40);

/// A task that appends `attempt=N` to `runs`; attempt 0 fails once the file `go` exists (at
/// once when `go` is made up front), writing its key to `failed` as it exits; a later attempt
/// hangs while the file `hang` exists.
fn config(env: &TestEnv, lease: &str) -> String {
    let (runs, go, hang) = (env.path("runs"), env.path("go"), env.path("hang"));
    let failed = env.path("failed");
    let script = format!(
        "echo \"$DRUMLINE_KEY attempt=$DRUMLINE_ATTEMPT\" >> {runs}; \
         if [ \"$DRUMLINE_ATTEMPT\" = 0 ]; then \
           while [ ! -e {go} ]; do sleep 0.05; done; echo $DRUMLINE_KEY >> {failed}; exit 1; fi; \
         while [ -e {hang} ]; do sleep 0.05; done",
        runs = runs.display(),
        failed = failed.display(),
        go = go.display(),
        hang = hang.display()
    );
    let cfg = env.config(
        "drumline.toml",
        &format!(
            "[worker]\nconcurrency = 2\nlease = \"{lease}\"\n\n[tasks.t]\n\
             command = [\"/bin/sh\", \"-c\", {}]\nmax_retries = 1\nretry_base = \"1s\"\n",
            toml_string(&script)
        ),
    );
    cfg.to_str().unwrap().to_owned()
}

/// How many times each attempt of `key` ran, from the task's own lines.
fn attempts(env: &TestEnv, key: &str) -> std::collections::BTreeMap<String, usize> {
    let lines: Vec<String> = env
        .lines("runs")
        .into_iter()
        .filter_map(|l| l.strip_prefix(&format!("{key} ")).map(str::to_owned))
        .collect();
    counts(&lines)
}

/// See: issues/16 "A lapsed lease forgets the attempt". Attempt 0 fails, attempt 1 is killed
/// with its worker and its lease lapses; then a copy of attempt 0 arrives (a second beat's, a
/// re-published key: here on queue `late`, so it is decided before attempt 1's redelivery).
/// It must be a duplicate: attempt 0 never runs twice, and the instance runs at most
/// max_retries + 1 plus the one repeat the crash cost.
#[tokio::test(flavor = "multi_thread")]
async fn a_lapsed_lease_does_not_let_an_earlier_attempt_run_again() {
    let mut env = setup("e2e_lapsed_attempt");
    env.forget_queue_later(env.names().work_queue("late"));
    let cfg = config(&env, "3s");
    std::fs::write(env.path("go"), "").unwrap();
    std::fs::write(env.path("hang"), "").unwrap();
    let mut a = env.worker("worker-a", &["--config", &cfg]);
    env.wait_for_topology(&a).await;
    env.publish(&adhoc("k-lapse", "t")).await;
    assert!(
        wait_until(WAIT, || attempts(&env, "k-lapse").contains_key("attempt=1")),
        "attempt 1 never started\n{}",
        a.log_tail(30)
    );
    a.kill9();
    std::fs::remove_file(env.path("hang")).unwrap();
    assert!(
        wait_until_async(WAIT, || env.lease_lapsed("k-lapse")).await,
        "the lease never lapsed"
    );

    // The late copy of attempt 0, alone on its queue.
    let (args, port) = with_metrics(&["--config", &cfg, "--queues", "late"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let late = env.worker("worker-late", &args);
    let late_queue = env.names().work_queue("late");
    // Consumed, so declared and bound: a copy published now is routed.
    let consumed = wait_until_async(WAIT, || async {
        env.queue_consumers(&late_queue)
            .await
            .is_some_and(|n| n > 0)
    })
    .await;
    assert!(consumed, "{}", late.log_tail(20));
    let mut copy = adhoc("k-lapse", "t");
    copy.queue = "late".into();
    env.publish(&copy).await;
    let decided = wait_until(WAIT, || {
        let duplicate = r#"drumline_worker_runs_total{task="t",outcome="duplicate"}"#;
        metric(port, duplicate) == Some(1.0)
            || attempts(&env, "k-lapse").get("attempt=0") == Some(&2)
    });
    assert!(
        decided,
        "the late copy was not decided\n{}",
        late.log_tail(30)
    );

    // Attempt 1's redelivery takes over and finishes the instance.
    let b = env.worker("worker-b", &["--config", &cfg]);
    let done = wait_until_async(WAIT, || async {
        env.run_state("k-lapse").await.as_deref() == Some("done")
    })
    .await;
    assert!(done, "never done\n{}", b.log_tail(30));
    let ran = attempts(&env, "k-lapse");
    assert_eq!(
        ran.get("attempt=0"),
        Some(&1),
        "{ran:?}\n{}",
        late.log_tail(30)
    );
    assert_eq!(ran.get("attempt=1"), Some(&2), "{ran:?}");
    let fence: u64 = redis::cmd("HGET")
        .arg(env.names().run_key("k-lapse"))
        .arg("fence")
        .query_async(&mut env.redis().await)
        .await
        .expect("the record keeps its fence");
    assert_eq!(fence, 3, "attempt 0, attempt 1, attempt 1's takeover");
}

/// See: issues/16 "The retry hand-over is one try". Redis goes away (connections reset) just
/// as attempt 0 fails, after its retry copy is published: the hand-over to attempt 1 is retried
/// until Redis is back, so attempt 1 runs after its backoff, not a lease later, and attempt 0
/// never runs again.
#[tokio::test(flavor = "multi_thread")]
async fn the_retry_hand_over_rides_out_a_redis_blip() {
    let env = setup("e2e_handover_blip");
    // A long lease: a hand-over left undone would hold the instance for 30 s.
    let cfg = config(&env, "30s");
    let proxy = Proxy::start("127.0.0.1:6379".parse().unwrap());
    let worker = env.worker_with_env(
        "worker",
        &["--config", &cfg],
        &[("DRUMLINE_REDIS_URL", &proxy.redis_url())],
    );
    env.wait_for_topology(&worker).await;
    env.publish(&adhoc("k-blip", "t")).await;
    assert!(
        wait_until(WAIT, || attempts(&env, "k-blip").contains_key("attempt=0")),
        "attempt 0 never started\n{}",
        worker.log_tail(30)
    );
    // Redis resets every connection from now; attempt 0 fails at once.
    proxy.set(Fault::Reset);
    std::fs::write(env.path("go"), "").unwrap();
    assert!(
        wait_until(WAIT, || !env.lines("failed").is_empty()),
        "attempt 0 never failed\n{}",
        worker.log_tail(30)
    );
    // The outage outlasts the retry copy's publish and the hand-over's first tries.
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.set(Fault::Pass);

    let done = wait_until_async(Duration::from_secs(15), || async {
        env.run_state("k-blip").await.as_deref() == Some("done")
    })
    .await;
    let ran = attempts(&env, "k-blip");
    assert!(
        done,
        "attempt 1 did not run within 15 s of Redis coming back: {ran:?}\n{}",
        worker.log_tail(30)
    );
    assert_eq!(ran.get("attempt=0"), Some(&1), "{ran:?}");
    assert_eq!(ran.get("attempt=1"), Some(&1), "{ran:?}");
}
