//! The core promise end to end: real beat and worker binaries, real RabbitMQ and Redis, one
//! namespace per test; effects are lines the shell task appends (one per execution, keyed by
//! `$DRUMLINE_KEY`), asserted by exact count.

use chrono::DateTime;
use drumline_e2e::cfg::{every, shell, Cfg, Keys};
use drumline_e2e::{
    adhoc, assert_contiguous_exactly_once, counts, instant_of, metric, setup, snoop::Snoop,
    wait_until, wait_until_async, with_metrics, TestEnv,
};
use lapin::options::{BasicAckOptions, BasicGetOptions};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn every_second_config(env: &TestEnv, file: &str) -> std::path::PathBuf {
    let cfg = Cfg::new()
        .set("worker", "concurrency", "2")
        .set("worker", "lease", "\"3s\"")
        .set("worker", "shutdown_grace", "\"10s\"")
        .task(
            "append",
            Keys::default().with("command", &env.append_key_command(file, 0.0)),
        )
        .job("tick", every("1s").with("task", "\"append\""));
    env.write_config("drumline.toml", &cfg)
}

#[tokio::test(flavor = "multi_thread")]
async fn one_beat_three_workers_run_every_instant_exactly_once() {
    let mut env = setup("e2e_once");
    let config = every_second_config(&env, "effects");
    let cfg = config.to_str().unwrap();
    let mut workers: Vec<_> = (1..=3)
        .map(|i| env.worker(&format!("worker-{i}"), &["--config", cfg]))
        .collect();
    env.wait_for_topology(&workers[0]).await;
    let snoop = Snoop::start(&mut env, "default");
    let mut beat = env.beat("beat", &["--config", cfg]);

    assert!(
        wait_until(WAIT, || env.lines("effects").len() >= 16),
        "fewer than 16 executions in {WAIT:?}\n{}\n{}",
        beat.log_tail(20),
        workers[0].log_tail(20)
    );
    assert!(
        beat.terminate(Duration::from_secs(10)).success(),
        "{}",
        beat.log_tail(20)
    );
    // What the beat published, as the broker routed it (the copies the workers received).
    let published = snoop.published_keys().len() as u64;
    assert!(
        wait_until(WAIT, || env.lines("effects").len() as u64 >= published),
        "published {published}, executed {}",
        env.lines("effects").len()
    );
    for w in &mut workers {
        assert!(
            w.terminate(Duration::from_secs(20)).success(),
            "{}",
            w.log_tail(20)
        );
    }

    let lines = env.lines("effects");
    assert_eq!(
        lines.len() as u64,
        published,
        "every published instance runs once"
    );
    assert_contiguous_exactly_once(&lines, 16);
    // Every instance is recorded done, and the beat persisted its progress.
    let mut redis = env.redis().await;
    for key in &lines {
        let state: Option<String> = redis::cmd("HGET")
            .arg(env.names().run_key(key))
            .arg("state")
            .query_async(&mut redis)
            .await
            .unwrap();
        assert_eq!(state.as_deref(), Some("done"), "{key}");
    }
    let last: String = redis::cmd("GET")
        .arg(env.names().beat_last("tick"))
        .query_async(&mut redis)
        .await
        .unwrap();
    let newest = lines.iter().map(|k| instant_of(k)).max().unwrap();
    assert_eq!(DateTime::parse_from_rfc3339(&last).unwrap(), newest);
    assert_eq!(
        env.queue_len(&env.names().work_queue("default")).await,
        Some(0)
    );
}

/// Two beats: one leads and publishes, the other stands by, so each instance is published once.
#[tokio::test(flavor = "multi_thread")]
async fn two_beats_publish_each_instance_once() {
    let mut env = setup("e2e_twobeats");
    let config = every_second_config(&env, "effects");
    let cfg = config.to_str().unwrap();
    let mut workers = Vec::new();
    let mut ports = Vec::new();
    for i in 1..=3 {
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

    assert!(
        wait_until(WAIT, || env.lines("effects").len() >= 12),
        "too few executions\n{}\n{}\n{}",
        beats[0].log_tail(20),
        beats[1].log_tail(20),
        workers[0].log_tail(20)
    );
    // Only the leader publishes: one copy per instance. Stopping the beats one after the other
    // hands leadership over once (if the first one stopped led), which must neither skip nor
    // repeat an instance.
    for b in &mut beats {
        assert!(
            b.terminate(Duration::from_secs(10)).success(),
            "{}",
            b.log_tail(20)
        );
    }
    // Every copy the two beats published, as the broker routed it.
    let keys = snoop.published_keys();
    let published = keys.len() as u64;
    let distinct = counts(&keys);
    let repeated: Vec<_> = distinct.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        repeated.is_empty(),
        "published more than once: {repeated:?}"
    );
    let total =
        |name: &str| -> u64 { ports.iter().filter_map(|p| metric(*p, name)).sum::<f64>() as u64 };
    let settled =
        || total("drumline_worker_duplicates_total") + total("drumline_worker_succeeded_total");
    assert!(
        wait_until(WAIT, || settled() >= published),
        "published {published}, settled {}",
        settled()
    );
    let duplicates = total("drumline_worker_duplicates_total");
    for w in &mut workers {
        assert!(
            w.terminate(Duration::from_secs(20)).success(),
            "{}",
            w.log_tail(20)
        );
    }

    let lines = env.lines("effects");
    assert_contiguous_exactly_once(&lines, 12);
    assert_eq!(duplicates, 0, "only the leader publishes: no copies");
    assert_eq!(
        lines.len() as u64,
        published,
        "every instance published once and run once"
    );
    assert_eq!(
        env.queue_len(&env.names().work_queue("default")).await,
        Some(0)
    );
}

/// A worker config whose task records its start (with the shell's pid and the pid of its
/// child, which sleeps), waits for the child, then appends the key.
fn slow_task_config(env: &TestEnv, sleep: u32) -> std::path::PathBuf {
    let script = format!(
        "sleep {sleep} & echo \"$DRUMLINE_KEY $$ $!\" >> {starts}; wait; echo \"$DRUMLINE_KEY\" >> {effects}",
        starts = env.path("starts").display(),
        effects = env.path("effects").display()
    );
    let cfg = Cfg::new()
        .set("worker", "concurrency", "1")
        .set("worker", "lease", "\"3s\"")
        .set("worker", "shutdown_grace", "\"20s\"")
        .task("slow", shell(&script));
    env.write_config("drumline.toml", &cfg)
}

/// Publishes `key` for the slow task to `worker` (once its topology exists) and returns the
/// pids of the task's shell and its `sleep` child, as the task wrote them.
async fn start_slow_task(env: &TestEnv, worker: &drumline_e2e::Proc, key: &str) -> Vec<i32> {
    env.wait_for_topology(worker).await;
    env.publish(&adhoc(key, "slow")).await;
    assert!(
        wait_until(WAIT, || env.lines("starts").len() == 1),
        "{}",
        worker.log_tail(20)
    );
    let start = env.lines("starts")[0].clone();
    let pids: Vec<i32> = start
        .split(' ')
        .skip(1)
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2, "{start}");
    pids
}

fn pid_alive(pid: i32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.contains(") Z "))
            .unwrap_or(true)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_killed_mid_task_is_taken_over_after_its_lease() {
    let env = setup("e2e_kill9");
    let config = slow_task_config(&env, 5);
    let cfg = config.to_str().unwrap();
    let mut first = env.worker("worker-1", &["--config", cfg]);
    let pids = start_slow_task(&env, &first, "k-kill").await;

    first.kill9();
    // The task and its child die with their worker: no orphan finishes the instance. (The
    // child's own 5 s sleep has more than 2 s left, so only the kill can end it this soon.)
    for pid in pids {
        assert!(
            wait_until(Duration::from_secs(2), || !pid_alive(pid)),
            "process {pid} of the task outlived its worker"
        );
    }

    let mut second = env.worker("worker-2", &["--config", cfg]);
    assert!(
        wait_until(WAIT, || env.lines("effects").len() == 1),
        "not taken over\n{}",
        second.log_tail(30)
    );
    assert!(second.terminate(Duration::from_secs(30)).success());
    assert_eq!(
        env.lines("effects"),
        vec!["k-kill"],
        "completed exactly once"
    );
    assert_eq!(
        env.lines("starts").len(),
        2,
        "started by the dead worker, then by the other"
    );
    let mut redis = env.redis().await;
    let state: Option<String> = redis::cmd("HGET")
        .arg(env.names().run_key("k-kill"))
        .arg("state")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(state.as_deref(), Some("done"));
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
    let cfg = config.to_str().unwrap();
    let mut worker = env.worker_leading_its_group("worker", &["--config", cfg]);
    let pids = start_slow_task(&env, &worker, "k-group").await;
    assert!(pids.iter().all(|&p| pid_alive(p)), "{pids:?}");

    worker.kill9_group();
    // The child's own 5 s sleep has more than 2 s left: only the kill can end it this soon.
    for pid in pids {
        assert!(
            wait_until(Duration::from_secs(2), || !pid_alive(pid)),
            "process {pid} of the task outlived its worker's process group"
        );
    }
    assert!(env.lines("effects").is_empty(), "the killed task finished");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_the_running_task_finish_then_exits_zero() {
    let env = setup("e2e_sigterm");
    let config = slow_task_config(&env, 2);
    let cfg = config.to_str().unwrap();
    let mut worker = env.worker("worker", &["--config", cfg]);
    env.wait_for_topology(&worker).await;
    env.publish(&adhoc("k-term", "slow")).await;
    assert!(
        wait_until(WAIT, || env.lines("starts").len() == 1),
        "{}",
        worker.log_tail(20)
    );

    let status = worker.terminate(Duration::from_secs(30));
    assert!(status.success(), "exit {status:?}\n{}", worker.log_tail(20));
    assert_eq!(
        env.lines("effects"),
        vec!["k-term"],
        "the in-flight task finished"
    );
    let mut redis = env.redis().await;
    let state: Option<String> = redis::cmd("HGET")
        .arg(env.names().run_key("k-term"))
        .arg("state")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(state.as_deref(), Some("done"));
    assert_eq!(
        env.queue_len(&env.names().work_queue("default")).await,
        Some(0),
        "acked before exit"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn poison_messages_are_dead_lettered_and_duplicates_run_once() {
    let env = setup("e2e_poison");
    let append = Keys::default().with("command", &env.append_key_command("effects", 0.0));
    let cfg = Cfg::new()
        .set("worker", "concurrency", "2")
        .task("append", append);
    let config = env.write_config("drumline.toml", &cfg);
    let (args, port) = with_metrics(&["--config", config.to_str().unwrap()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut worker = env.worker("worker", &args);
    let dead = env.names().dead();
    env.wait_for_topology(&worker).await;

    env.publish_raw("default", b"{not json", Default::default())
        .await;
    env.publish(&adhoc("k-unknown", "no-such-task")).await;
    let valid = adhoc("k-dup", "append");
    env.publish(&valid).await;
    env.publish(&valid).await;

    assert!(
        wait_until_async(WAIT, || async { env.queue_len(&dead).await == Some(2) }).await,
        "dead letters: {:?}\n{}",
        env.queue_len(&dead).await,
        worker.log_tail(30)
    );
    assert!(wait_until(WAIT, || env.lines("effects").len() == 1));
    // The first copy of k-dup ran, the second is settled as a duplicate (read while the
    // worker serves).
    let duplicates = || metric(port, "drumline_worker_duplicates_total");
    let succeeded = || metric(port, "drumline_worker_succeeded_total");
    assert!(
        wait_until(WAIT, || duplicates().is_some_and(|n| n >= 1.0)
            && succeeded().is_some_and(|n| n >= 1.0)),
        "duplicates: {:?}, succeeded: {:?}\n{}",
        duplicates(),
        succeeded(),
        worker.log_tail(30)
    );
    assert!(worker.is_running(), "the worker keeps serving after poison");

    // The dead letters carry their reasons.
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    let mut reasons = Vec::new();
    while let Some(msg) = ch
        .basic_get(dead.as_str().into(), BasicGetOptions::default())
        .await
        .unwrap()
    {
        let headers = msg.delivery.properties.headers().clone();
        let reason =
            drumline_shared::broker::header_str(headers.as_ref(), "x-drumline-reason").unwrap();
        let error =
            drumline_shared::broker::header_str(headers.as_ref(), "x-drumline-error").unwrap();
        assert!(!error.is_empty());
        reasons.push(reason);
        msg.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    reasons.sort();
    assert_eq!(reasons, vec!["malformed", "unknown_task"]);
    let _ = conn.close(200, "bye".into()).await;

    let (duplicates_seen, succeeded_seen) = (duplicates(), succeeded());
    assert!(worker.terminate(Duration::from_secs(20)).success());
    assert_eq!(
        env.lines("effects"),
        vec!["k-dup"],
        "the duplicate ran once"
    );
    assert_eq!(duplicates_seen, Some(1.0), "one duplicate");
    assert_eq!(succeeded_seen, Some(1.0), "one run");
    assert_eq!(
        env.queue_len(&env.names().work_queue("default")).await,
        Some(0)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn when_the_shutdown_grace_runs_out_the_task_is_abandoned_for_redelivery() {
    let env = setup("e2e_grace");
    let script = format!(
        "echo \"$DRUMLINE_KEY $$\" >> {starts}; sleep 30; echo \"$DRUMLINE_KEY\" >> {effects}",
        starts = env.path("starts").display(),
        effects = env.path("effects").display()
    );
    let cfg = Cfg::new()
        .set("worker", "concurrency", "1")
        .set("worker", "lease", "\"10s\"")
        .set("worker", "shutdown_grace", "\"1s\"")
        .task("slow", shell(&script));
    let config = env.write_config("drumline.toml", &cfg);
    let mut worker = env.worker("worker", &["--config", config.to_str().unwrap()]);
    env.wait_for_topology(&worker).await;
    env.publish(&adhoc("k-grace", "slow")).await;
    assert!(
        wait_until(WAIT, || env.lines("starts").len() == 1),
        "{}",
        worker.log_tail(20)
    );
    let task_pid: i32 = env.lines("starts")[0]
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();

    let status = worker.terminate(Duration::from_secs(20));
    assert!(
        status.success(),
        "still exits 0: {status:?}\n{}",
        worker.log_tail(20)
    );
    assert!(!pid_alive(task_pid), "the abandoned task was killed");
    assert!(env.lines("effects").is_empty());
    // The claim is released (the record keeps its attempt, its lease lapsed and its token
    // gone: docs/design.md#attempts-outlive-the-lease) and the message is back for another
    // worker.
    let mut redis = env.redis().await;
    let token: Option<String> = redis::cmd("HGET")
        .arg(env.names().run_key("k-grace"))
        .arg("token")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(token, None, "claim released");
    assert!(env.lease_lapsed("k-grace").await, "claim released");
    let queue = env.names().work_queue("default");
    // Polled: the broker counts a message handed back by a closing connection a moment later.
    let back = wait_until_async(Duration::from_secs(10), || async {
        env.queue_len(&queue).await == Some(1)
    })
    .await;
    assert!(
        back,
        "left for redelivery: {:?}",
        env.queue_len(&queue).await
    );
    // The one message left is k-grace, handed back by the worker (the abandoned run), not
    // one that was never delivered.
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    let left = ch
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("the message left for redelivery");
    let envelope = drumline_shared::envelope::Envelope::decode(&left.delivery.data).unwrap();
    assert_eq!(envelope.key, "k-grace");
    assert!(left.delivery.redelivered, "handed back by the worker");
    let _ = conn.close(200, "bye".into()).await;
}
