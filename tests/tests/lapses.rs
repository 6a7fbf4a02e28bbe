//! Attempts outlive the lease (docs/design.md#attempts-outlive-the-lease): the run record is
//! kept after its lease lapses, so a late copy of an earlier attempt is a duplicate, and the
//! retry hand-over rides out a Redis blip instead of leaving the claim to lapse.

use drumline_e2e::cfg::{shell, Cfg};
use drumline_e2e::proxy::{Fault, Proxy};
use drumline_e2e::scenario::{run_field, Scenario};
use drumline_e2e::{adhoc, counts, metric, wait_until_async, TestEnv};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(40);

/// A task that appends `attempt=N` to `runs`; attempt 0 fails once the file `go` exists (at
/// once when `go` is made up front), writing its key to `failed` as it exits; a later attempt
/// hangs while the file `hang` exists.
fn config(env: &TestEnv, lease: &str) -> Cfg {
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
    let t = shell(&script)
        .with("max_retries", "1")
        .with("retry_base", "\"1s\"");
    Cfg::new()
        .set("worker", "concurrency", "2")
        .set("worker", "lease", &format!("\"{lease}\""))
        .task("t", t)
}

/// How many times each attempt of `key` ran, from the task's own lines.
fn attempts(env: &TestEnv, key: &str) -> std::collections::BTreeMap<String, usize> {
    let prefix = format!("{key} ");
    let ran = env.lines("runs");
    let lines: Vec<String> = ran
        .iter()
        .filter_map(|l| l.strip_prefix(&prefix).map(str::to_owned))
        .collect();
    counts(&lines)
}

/// Starts `worker-late`, which consumes only queue `late` and serves `/metrics`, and waits
/// until it consumes (the queue declared and bound: a copy published now is routed): its
/// metrics port.
async fn start_late_worker(sc: &mut Scenario) -> u16 {
    let late_queue = sc.names().work_queue("late");
    sc.forget_queue_later(late_queue.clone());
    let (args, port) = drumline_e2e::with_metrics(&["--config", sc.cfg(), "--queues", "late"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let late = sc.env.worker("worker-late", &args);
    sc.workers.push(late);
    let consumed = || async { sc.queue_consumers(&late_queue).await.is_some_and(|n| n > 0) };
    sc.wait_async(WAIT, "nobody consumes the late queue", consumed)
        .await;
    port
}

/// A copy of ad-hoc instance `key` of `task` routed to queue `late`.
fn late_copy(key: &str, task: &str) -> drumline_shared::envelope::Envelope {
    let mut copy = adhoc(key, task);
    copy.queue = "late".into();
    copy
}

/// See: issues/16 "A lapsed lease forgets the attempt". Attempt 0 fails, attempt 1 is killed
/// with its worker and its lease lapses; then a copy of attempt 0 arrives (a second beat's, a
/// re-published key: here on queue `late`, so it is decided before attempt 1's redelivery).
/// It must be a duplicate: attempt 0 never runs twice, and the instance runs at most
/// max_retries + 1 plus the one repeat the crash cost.
#[tokio::test(flavor = "multi_thread")]
async fn a_lapsed_lease_does_not_let_an_earlier_attempt_run_again() {
    let mut sc = Scenario::new("e2e_lapsed_attempt", |env| config(env, "3s"));
    std::fs::write(sc.path("go"), "").unwrap();
    std::fs::write(sc.path("hang"), "").unwrap();
    sc.start_workers(1).await;
    sc.publish(&adhoc("k-lapse", "t")).await;
    let second = || attempts(&sc, "k-lapse").contains_key("attempt=1");
    sc.wait(WAIT, "attempt 1 never started", second);
    sc.workers[0].kill9();
    std::fs::remove_file(sc.path("hang")).unwrap();
    let lapsed = wait_until_async(WAIT, || sc.lease_lapsed("k-lapse")).await;
    assert!(lapsed, "the lease never lapsed");
    // The late copy of attempt 0, alone on its queue.
    let port = start_late_worker(&mut sc).await;
    sc.publish(&late_copy("k-lapse", "t")).await;
    let duplicate = r#"drumline_worker_runs_total{task="t",outcome="duplicate"}"#;
    sc.wait(WAIT, "the late copy was not decided", || {
        metric(port, duplicate) == Some(1.0)
            || attempts(&sc, "k-lapse").get("attempt=0") == Some(&2)
    });
    // Attempt 1's redelivery takes over and finishes the instance.
    sc.start_workers(1).await;
    sc.wait_state("k-lapse", "done").await;
    let ran = attempts(&sc, "k-lapse");
    sc.check(ran.get("attempt=0") == Some(&1), format!("{ran:?}"));
    assert_eq!(ran.get("attempt=1"), Some(&2), "{ran:?}");
    let fence = run_field(&sc, "k-lapse", "fence").await;
    let what = "attempt 0, attempt 1, attempt 1's takeover";
    assert_eq!(fence.as_deref(), Some("3"), "{what}");
}

/// See: issues/16 "The retry hand-over is one try". Redis goes away (connections reset) just
/// as attempt 0 fails, after its retry copy is published: the hand-over to attempt 1 is retried
/// until Redis is back, so attempt 1 runs after its backoff, not a lease later, and attempt 0
/// never runs again.
#[tokio::test(flavor = "multi_thread")]
async fn the_retry_hand_over_rides_out_a_redis_blip() {
    // A long lease: a hand-over left undone would hold the instance for 30 s.
    let mut sc = Scenario::new("e2e_handover_blip", |env| config(env, "30s"));
    let proxy = Proxy::start("127.0.0.1:6379".parse().unwrap());
    sc.start_worker_env(&[("DRUMLINE_REDIS_URL", &proxy.redis_url())])
        .await;
    sc.publish(&adhoc("k-blip", "t")).await;
    let first = || attempts(&sc, "k-blip").contains_key("attempt=0");
    sc.wait(WAIT, "attempt 0 never started", first);
    // Redis resets every connection from now; attempt 0 fails at once.
    proxy.set(Fault::Reset);
    std::fs::write(sc.path("go"), "").unwrap();
    sc.wait(WAIT, "attempt 0 never failed", || {
        !sc.lines("failed").is_empty()
    });
    // The outage outlasts the retry copy's publish and the hand-over's first tries.
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.set(Fault::Pass);

    let finished = || async { sc.run_state("k-blip").await.as_deref() == Some("done") };
    let done = wait_until_async(Duration::from_secs(15), finished).await;
    let ran = attempts(&sc, "k-blip");
    let what = format!("attempt 1 did not run within 15 s of Redis coming back: {ran:?}");
    sc.check(done, what);
    assert_eq!(ran.get("attempt=0"), Some(&1), "{ran:?}");
    assert_eq!(ran.get("attempt=1"), Some(&1), "{ran:?}");
}
