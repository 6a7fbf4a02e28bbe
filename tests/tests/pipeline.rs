//! The core promise end to end: real beat and worker binaries, real RabbitMQ and Redis, one
//! namespace per test; effects are lines the shell task appends (one per execution, keyed by
//! `$DRUMLINE_KEY`), asserted by exact count.

use chrono::DateTime;
use drumline_e2e::cfg::{every, Cfg};
use drumline_e2e::probe::{expect, expect_async, stop, total};
use drumline_e2e::{
    adhoc, assert_contiguous_exactly_once, counts, instant_of, metric, setup, snoop::Snoop,
    toml_string, wait_until, Proc, TestEnv,
};
use lapin::options::{BasicAckOptions, BasicGetOptions};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn every_second_config() -> Cfg {
    Cfg::new()
        .set("worker", "concurrency", "2")
        .set("worker", "lease", "\"3s\"")
        .set("worker", "shutdown_grace", "\"10s\"")
        .job("tick", every("1s").task("append"))
}

#[tokio::test(flavor = "multi_thread")]
async fn one_beat_three_workers_run_every_instant_exactly_once() {
    let mut env = setup("e2e_once");
    let cfg = every_second_config().task("append", env.appender("effects", 0.0));
    let mut scene = env.start(&cfg, 0, 3).await;
    let snoop = Snoop::start(&mut env, "default");
    scene.beats.push(env.beat_on("beat", &scene.config));
    scene.expect(WAIT, "16 executions", || env.lines("effects").len() >= 16);
    stop(&mut [&mut scene.beats[0]]);
    // What the beat published, as the broker routed it (the copies the workers received).
    let published = snoop.published_keys().len();
    scene.expect(WAIT, format!("{published} published, all executed"), || {
        env.lines("effects").len() >= published
    });
    scene.stop();

    let lines = env.lines("effects");
    assert_eq!(lines.len(), published, "every published instance runs once");
    assert_contiguous_exactly_once(&lines, 16);
    // Every instance is recorded done, and the beat persisted its progress.
    for key in &lines {
        assert_eq!(env.run_state(key).await.as_deref(), Some("done"), "{key}");
    }
    let last = env.get(&env.names().beat_last("tick")).await.unwrap();
    let newest = lines.iter().map(|k| instant_of(k)).max().unwrap();
    assert_eq!(DateTime::parse_from_rfc3339(&last).unwrap(), newest);
    assert_eq!(env.default_queue_len().await, Some(0));
}

/// Two beats: one leads and publishes, the other stands by, so each instance is published once.
#[tokio::test(flavor = "multi_thread")]
async fn two_beats_publish_each_instance_once() {
    let mut env = setup("e2e_twobeats");
    let cfg = every_second_config().task("append", env.appender("effects", 0.0));
    let config = env.config_file(&cfg);
    let started = (1..=3).map(|i| env.worker_serving(&format!("worker-{i}"), &config));
    let (mut workers, ports): (Vec<_>, Vec<_>) = started.unzip();
    env.wait_for_topology(&workers[0]).await;
    let snoop = Snoop::start(&mut env, "default");
    let mut beats = [
        env.beat_on("beat-1", &config),
        env.beat_on("beat-2", &config),
    ];
    let procs = [&beats[0], &beats[1], &workers[0]];
    expect(WAIT, &procs, "too few executions", || {
        env.lines("effects").len() >= 12
    });
    // Only the leader publishes: one copy per instance. Stopping the beats one after the other
    // hands leadership over once (if the first one stopped led), which must neither skip nor
    // repeat an instance.
    stop(&mut beats.iter_mut().collect::<Vec<_>>());
    // Every copy the two beats published, as the broker routed it.
    let keys = snoop.published_keys();
    let published = keys.len() as f64;
    let distinct = counts(&keys);
    let repeated: Vec<_> = distinct.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        repeated.is_empty(),
        "published more than once: {repeated:?}"
    );
    let (dups, ok) = (
        "drumline_worker_duplicates_total",
        "drumline_worker_succeeded_total",
    );
    let settled = || total(&ports, dups) + total(&ports, ok);
    let held = wait_until(WAIT, || settled() >= published);
    assert!(held, "published {published}, settled {}", settled());
    let duplicates = total(&ports, dups);
    stop(&mut workers.iter_mut().collect::<Vec<_>>());

    let lines = env.lines("effects");
    assert_contiguous_exactly_once(&lines, 12);
    assert_eq!(duplicates, 0.0, "only the leader publishes: no copies");
    assert_eq!(
        lines.len(),
        keys.len(),
        "every instance published once and run once"
    );
    assert_eq!(env.default_queue_len().await, Some(0));
}

/// A worker config whose task records its start (with the shell's pid and the pid of its
/// child, which sleeps), waits for the child, then appends the key.
fn slow_task_config(env: &TestEnv, sleep: u32) -> String {
    let starts = env.path("starts").display().to_string();
    let script = format!(
        "sleep {sleep} & echo \"$DRUMLINE_KEY $$ $!\" >> {starts}; wait; echo \"$DRUMLINE_KEY\" >> {{effects}}"
    );
    env.config_file(&slow_worker("3s", "20s").task("slow", env.script(&script)))
}

/// One slot, `lease` and `shutdown_grace`.
fn slow_worker(lease: &str, grace: &str) -> Cfg {
    Cfg::new()
        .set("worker", "concurrency", "1")
        .set("worker", "lease", &toml_string(lease))
        .set("worker", "shutdown_grace", &toml_string(grace))
}

/// Publishes `key` for the slow task to `worker` (once its topology exists) and returns the
/// pids the task wrote on its `starts` line (its shell's, and its `sleep` child's if any).
async fn start_slow_task(env: &TestEnv, worker: &Proc, key: &str) -> Vec<i32> {
    env.wait_for_topology(worker).await;
    env.publish(&adhoc(key, "slow")).await;
    expect(WAIT, &[worker], "the task started", || {
        env.lines("starts").len() == 1
    });
    let start = env.lines("starts")[0].clone();
    start
        .split(' ')
        .skip(1)
        .map(|p| p.parse().unwrap())
        .collect()
}

fn pid_alive(pid: i32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.contains(") Z "))
            .unwrap_or(true)
}

/// Every one of `pids` is gone within 2 s (`what` outlived: its worker, its group).
fn assert_die_soon(pids: Vec<i32>, what: &str) {
    for pid in pids {
        let gone = wait_until(Duration::from_secs(2), || !pid_alive(pid));
        assert!(gone, "process {pid} of the task outlived {what}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_killed_mid_task_is_taken_over_after_its_lease() {
    let env = setup("e2e_kill9");
    let config = slow_task_config(&env, 5);
    let mut first = env.worker_on("worker-1", &config);
    let pids = start_slow_task(&env, &first, "k-kill").await;
    assert_eq!(pids.len(), 2, "{pids:?}");
    first.kill9();
    // The task and its child die with their worker: no orphan finishes the instance. (The
    // child's own 5 s sleep has more than 2 s left, so only the kill can end it this soon.)
    assert_die_soon(pids, "its worker");
    let mut second = env.worker_on("worker-2", &config);
    expect(WAIT, &[&second], "not taken over", || {
        env.lines("effects").len() == 1
    });
    stop(&mut [&mut second]);
    assert_eq!(
        env.lines("effects"),
        vec!["k-kill"],
        "completed exactly once"
    );
    let starts = env.lines("starts").len();
    assert_eq!(starts, 2, "started by the dead worker, then by the other");
    assert_eq!(env.run_state("k-kill").await.as_deref(), Some("done"));
}

/// `kill -9` of the worker's whole process group (a shell's job, a container's init killing
/// its group) takes every task down with it, the task's own children included: the supervisor
/// is not in that group, sees the worker's end of its socket close and kills every task's
/// group (issue 22's third defect: the withdrawn design's sentinel died with the group and
/// orphaned its tasks).
#[tokio::test(flavor = "multi_thread")]
async fn a_kill_of_the_workers_whole_process_group_kills_every_task() {
    let env = setup("e2e_kill9_group");
    let config = slow_task_config(&env, 5);
    let mut worker = env.worker_leading_its_group("worker", &["--config", &config]);
    let pids = start_slow_task(&env, &worker, "k-group").await;
    assert_eq!(pids.len(), 2, "{pids:?}");
    assert!(pids.iter().all(|&p| pid_alive(p)), "{pids:?}");
    worker.kill9_group();
    // The child's own 5 s sleep has more than 2 s left: only the kill can end it this soon.
    assert_die_soon(pids, "its worker's process group");
    assert!(env.lines("effects").is_empty(), "the killed task finished");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_the_running_task_finish_then_exits_zero() {
    let env = setup("e2e_sigterm");
    let mut worker = env.worker_on("worker", &slow_task_config(&env, 2));
    start_slow_task(&env, &worker, "k-term").await;
    stop(&mut [&mut worker]);
    assert_eq!(
        env.lines("effects"),
        vec!["k-term"],
        "the in-flight task finished"
    );
    assert_eq!(env.run_state("k-term").await.as_deref(), Some("done"));
    assert_eq!(env.default_queue_len().await, Some(0), "acked before exit");
}

#[tokio::test(flavor = "multi_thread")]
async fn poison_messages_are_dead_lettered_and_duplicates_run_once() {
    let env = setup("e2e_poison");
    let cfg = Cfg::new().set("worker", "concurrency", "2");
    let config = env.config_file(&cfg.task("append", env.appender("effects", 0.0)));
    let (mut worker, port) = env.worker_serving("worker", &config);
    let dead = env.names().dead();
    env.wait_for_topology(&worker).await;

    env.publish_raw("default", b"{not json", Default::default())
        .await;
    env.publish(&adhoc("k-unknown", "no-such-task")).await;
    let valid = adhoc("k-dup", "append");
    env.publish(&valid).await;
    env.publish(&valid).await;
    expect_async(WAIT, &[&worker], "two dead letters", || async {
        env.queue_len(&dead).await == Some(2)
    })
    .await;
    expect(WAIT, &[&worker], "k-dup ran", || {
        env.lines("effects").len() == 1
    });
    // The first copy of k-dup ran, the second is settled as a duplicate (read while the
    // worker serves).
    let duplicates = || metric(port, "drumline_worker_duplicates_total");
    let succeeded = || metric(port, "drumline_worker_succeeded_total");
    expect(
        WAIT,
        &[&worker],
        "a duplicate and a success counted",
        || duplicates().is_some_and(|n| n >= 1.0) && succeeded().is_some_and(|n| n >= 1.0),
    );
    assert!(worker.is_running(), "the worker keeps serving after poison");

    // The dead letters carry their reasons.
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    let mut reasons = Vec::new();
    let get = || ch.basic_get(dead.as_str().into(), BasicGetOptions::default());
    while let Some(msg) = get().await.unwrap() {
        let headers = msg.delivery.properties.headers().clone();
        let header = |name| drumline_shared::broker::header_str(headers.as_ref(), name).unwrap();
        assert!(!header("x-drumline-error").is_empty());
        reasons.push(header("x-drumline-reason"));
        msg.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    reasons.sort();
    assert_eq!(reasons, vec!["malformed", "unknown_task"]);
    let _ = conn.close(200, "bye".into()).await;

    let (duplicates_seen, succeeded_seen) = (duplicates(), succeeded());
    stop(&mut [&mut worker]);
    assert_eq!(
        env.lines("effects"),
        vec!["k-dup"],
        "the duplicate ran once"
    );
    assert_eq!(duplicates_seen, Some(1.0), "one duplicate");
    assert_eq!(succeeded_seen, Some(1.0), "one run");
    assert_eq!(env.default_queue_len().await, Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn when_the_shutdown_grace_runs_out_the_task_is_abandoned_for_redelivery() {
    let env = setup("e2e_grace");
    let starts = env.path("starts").display().to_string();
    let script = format!(
        "echo \"$DRUMLINE_KEY $$\" >> {starts}; sleep 30; echo \"$DRUMLINE_KEY\" >> {{effects}}"
    );
    let cfg = slow_worker("10s", "1s").task("slow", env.script(&script));
    let mut worker = env.worker_on("worker", &env.config_file(&cfg));
    let task_pid = start_slow_task(&env, &worker, "k-grace").await[0];
    stop(&mut [&mut worker]);
    assert!(!pid_alive(task_pid), "the abandoned task was killed");
    assert!(env.lines("effects").is_empty());
    // The claim is released (the record keeps its attempt, its lease lapsed and its token
    // gone: docs/design.md#attempts-outlive-the-lease) and the message is back for another
    // worker.
    assert_eq!(
        env.run_field("k-grace", "token").await,
        None,
        "claim released"
    );
    assert!(env.lease_lapsed("k-grace").await, "claim released");
    let queue = env.names().work_queue("default");
    // Polled: the broker counts a message handed back by a closing connection a moment later.
    expect_async(
        Duration::from_secs(10),
        &[&worker],
        "left for redelivery",
        || async { env.queue_len(&queue).await == Some(1) },
    )
    .await;
    // The one message left is k-grace, handed back by the worker (the abandoned run), not
    // one that was never delivered.
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    let left = ch
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await;
    let left = left.unwrap().expect("the message left for redelivery");
    let envelope = drumline_shared::envelope::Envelope::decode(&left.delivery.data).unwrap();
    assert_eq!(envelope.key, "k-grace");
    assert!(left.delivery.redelivered, "handed back by the worker");
    let _ = conn.close(200, "bye".into()).await;
}

/// Deliveries that arrive together are claimed and finished together (docs/design.md#batched-writes):
/// a queue filled before the worker starts reaches it in bursts of its prefetch, and the
/// claims and endings of a burst go to Redis in fewer script calls than there are writes —
/// with every task still run exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_deliveries_is_claimed_and_finished_in_batches_each_run_once() {
    const TASKS: usize = 200;
    let env = setup("e2e_batches");
    let cfg = Cfg::new().set("worker", "concurrency", "64");
    let config = env.config_file(&cfg.task("append", env.appender("effects", 0.0)));
    // A first worker declares the topology and goes; the queue then fills with nobody taking.
    let mut first = env.worker("declare", &["--config", &config]);
    env.wait_for_topology(&first).await;
    stop(&mut [&mut first]);
    let keys: Vec<String> = (0..TASKS).map(|i| format!("burst-{i:03}")).collect();
    for key in &keys {
        env.publish(&adhoc(key, "append")).await;
    }
    let (mut worker, port) = env.worker_serving("worker", &config);
    expect(WAIT, &[&worker], "every task ran", || {
        env.lines("effects").len() >= TASKS
    });
    // A task's effect is written before its ending is: the last endings may still be on
    // their way to Redis when the last line appears.
    let written = || metric(port, "drumline_worker_redis_writes_total").unwrap_or(0.0);
    expect(WAIT, &[&worker], "every claim and ending written", || {
        written() >= (2 * TASKS) as f64
    });
    let writes = written();
    let batches = metric(port, "drumline_worker_redis_batches_total").unwrap_or(0.0);
    stop(&mut [&mut worker]);

    let mut ran = env.lines("effects");
    ran.sort();
    assert_eq!(ran, keys, "each task ran exactly once");
    assert!(
        writes >= (2 * TASKS) as f64,
        "a claim and an ending per task went to Redis: {writes} writes"
    );
    assert!(
        batches < writes,
        "writes that arrived together shared script calls: {writes} writes in {batches} calls"
    );
}
