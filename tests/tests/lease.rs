//! Lease loss under a partition (docs/design.md "Lease loss stops the run in time"): a worker that
//! cannot reach Redis while the others can must have killed its task before its lease could
//! be taken, so two copies of one instance never run at once.

use drumline_e2e::cfg::{shell, Cfg, Keys};
use drumline_e2e::proxy::{Fault, Proxy};
use drumline_e2e::scenario::{parsed, Scenario};
use drumline_e2e::{adhoc, wait_until, wait_until_async, TestEnv, REDIS_URL};
use drumline_worker::{HandlerError, TaskContext, Worker};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const WAIT: Duration = Duration::from_secs(40);

/// Wall-clock milliseconds since the epoch (what the task's `date` writes, too).
fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// Process group of `pid` (field 5 of /proc/PID/stat).
fn pgid_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_comm = &stat[stat.rfind(')')? + 2..];
    after_comm.split(' ').nth(2)?.parse().ok()
}

/// True while a live (non-zombie) process belongs to process group `pgid`.
fn group_alive(pgid: i32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return true;
    };
    dir.filter_map(Result::ok).any(|entry| {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            return false;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return false;
        };
        let Some(close) = stat.rfind(')') else {
            return false;
        };
        let mut fields = stat[close + 2..].split(' ');
        let state = fields.next();
        let group = fields.nth(1).and_then(|g| g.parse::<i32>().ok());
        state != Some("Z") && group == Some(pgid)
    })
}

async fn consumers(env: &TestEnv) -> u32 {
    let queue = env.names().work_queue("default");
    env.queue_consumers(&queue).await.unwrap_or(0)
}

/// Watches process group `group` at a 5 ms grain until it is gone (the moment recorded is
/// when it was seen gone, never earlier than its death) or 15 s pass (`None`).
async fn death_of(group: i32) -> Option<u128> {
    let watch = move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        while group_alive(group) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        (!group_alive(group)).then(now_ms)
    };
    tokio::task::spawn_blocking(watch).await.expect("the watch")
}

/// Waits until the task started: the fields of the first line of `events`.
fn first_event(sc: &Scenario) -> Vec<String> {
    sc.wait(WAIT, "the task never started", || {
        !sc.lines("events").is_empty()
    });
    sc.lines("events")[0]
        .split(' ')
        .map(str::to_owned)
        .collect()
}

/// A task `name` run by `/bin/sh -c script`, one at a time, under `lease`.
fn one_task(name: &str, lease: &str, script: &str) -> Cfg {
    Cfg::new()
        .set("worker", "concurrency", "1")
        .set("worker", "lease", &format!("\"{lease}\""))
        .task(name, shell(script))
}

/// A worker running `handler` for task `task` in this process (lease `lease`, Redis at
/// `redis_url`), once it consumes: its shutdown trigger and its run.
async fn in_process(
    env: &TestEnv,
    lease: &str,
    redis_url: &str,
    task: &str,
    handler: impl drumline_worker::Handler,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let cfg = Cfg::new()
        .set("worker", "concurrency", "1")
        .set("worker", "lease", &format!("\"{lease}\""))
        .task(task, Keys::default());
    let worker = Worker::new(parsed(env, &cfg, redis_url)).handler(task, handler);
    let (stop, shutdown) = shutdown_trigger();
    let running = tokio::spawn(async move {
        let _ = worker.run(shutdown).await;
    });
    let up = wait_until_async(WAIT, || async { consumers(env).await == 1 }).await;
    assert!(up, "the in-process worker never consumed");
    (stop, running)
}

/// Watches the lease of instance `key` (held now) from outside, until another token holds it
/// or it lapses. The returned value ends as the latest instant (ms since the epoch, Redis
/// `TIME` on this machine's clock) the lease could lapse at: the record's `lease_until`, over
/// every answer naming the first holder's token (docs/design.md#attempts-outlive-the-lease).
async fn watch_lease_end(
    env: &drumline_e2e::TestEnv,
    key: &str,
) -> (tokio::task::JoinHandle<()>, Arc<Mutex<u128>>) {
    let lease_ends_ms = Arc::new(Mutex::new(0u128));
    let key = env.names().run_key(key);
    let mut redis = env.redis().await;
    let holder: String = redis::cmd("HGET")
        .arg(&key)
        .arg("token")
        .query_async(&mut redis)
        .await
        .expect("the instance is claimed");
    let ends = lease_ends_ms.clone();
    let sampler = tokio::spawn(async move {
        loop {
            let (token, until): (Option<String>, Option<u128>) = redis::pipe()
                .atomic()
                .cmd("HGET")
                .arg(&key)
                .arg("token")
                .cmd("HGET")
                .arg(&key)
                .arg("lease_until")
                .query_async(&mut redis)
                .await
                .expect("redis");
            let Some(until) = until.filter(|u| *u > now_ms()) else {
                return;
            };
            if token.as_deref() != Some(holder.as_str()) {
                return;
            }
            {
                let mut ends = ends.lock().unwrap();
                *ends = (*ends).max(until);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    (sampler, lease_ends_ms)
}

/// Task `long` (lease 3 s) writes `start KEY PID MS` to `events`, sleeps 10 s, then writes
/// `end KEY PID`. It ignores SIGTERM (and so does its `sleep`, which inherits the
/// disposition): only SIGKILL stops it, so the kill budget is what is measured.
fn killed_only_by_sigkill(env: &TestEnv) -> Cfg {
    let events = env.path("events").display().to_string();
    one_task("long", "3s", &format!(
        "trap '' TERM; echo \"start $DRUMLINE_KEY $$ $(date +%s%3N)\" >> {events}; sleep 10; echo \"end $DRUMLINE_KEY $$\" >> {events}"
    ))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_partitioned_workers_task_is_dead_before_another_worker_starts_it() {
    let mut sc = Scenario::new("e2e_partition", killed_only_by_sigkill);
    let proxy = Proxy::start("127.0.0.1:6379".parse().unwrap());
    sc.start_worker_env(&[("DRUMLINE_REDIS_URL", &proxy.redis_url())])
        .await;
    sc.publish(&adhoc("k-part", "long")).await;
    let first = first_event(&sc);
    let a_pid: i32 = first[2].parse().unwrap();
    let a_group = pgid_of(a_pid).expect("A's task is running");
    // B consumes the same queue, straight from Redis.
    sc.start_workers(1).await;
    let both = || async { consumers(&sc).await == 2 };
    sc.wait_async(WAIT, "B never consumed", both).await;
    let (sampler, lease_ends_ms) = watch_lease_end(&sc, "k-part").await;
    proxy.set(Fault::Blackhole);
    let partitioned_at = now_ms();
    let died_at = death_of(a_group).await;
    let died_at = died_at.expect("A's task group outlived the partition by 15 s");
    sampler.await.unwrap();
    let lease_ends = *lease_ends_ms.lock().unwrap();
    assert!(lease_ends > 0, "A's lease was never seen");
    assert!(
        died_at < lease_ends,
        "A's task group was still alive {} ms after its lease could be taken (partitioned at {partitioned_at}, lease ended at {lease_ends}, group gone at {died_at})",
        died_at - lease_ends
    );
    eprintln!(
        "A's task group gone {} ms after the partition, {} ms before its lease could be taken",
        died_at - partitioned_at,
        lease_ends - died_at
    );
    // A never heals; stop it so the requeued delivery cannot wait at its closed gate.
    sc.workers[0].kill9();
    let ended = || sc.lines("events").iter().any(|l| l.starts_with("end "));
    sc.wait(WAIT, "the instance never completed", ended);
    let lines = sc.lines("events");
    let starts: Vec<Vec<&str>> = lines
        .iter()
        .filter(|l| l.starts_with("start "))
        .map(|l| l.split(' ').collect())
        .collect();
    let ends: Vec<&String> = lines.iter().filter(|l| l.starts_with("end ")).collect();
    assert_eq!(starts.len(), 2, "started by A, then by B: {lines:?}");
    assert_eq!(ends.len(), 1, "completed exactly once: {lines:?}");
    let b_pid = starts[1][2];
    assert_ne!(b_pid, a_pid.to_string());
    assert_eq!(ends[0], &format!("end k-part {b_pid}"), "B finished it");
    let b_started: u128 = starts[1][3].parse().unwrap();
    let what = format!("A's task was alive when B started the instance ({died_at} vs {b_started})");
    assert!(died_at < b_started, "{what}");
    let done = || async { sc.run_state("k-part").await.as_deref() == Some("done") };
    sc.wait_async(Duration::from_secs(10), "k-part not done", done)
        .await;
}

/// Records when a stubborn handler's future is dropped.
struct DropClock(Stamp);

impl Drop for DropClock {
    fn drop(&mut self) {
        *self.0.lock().unwrap() = Some(now_ms());
    }
}

/// When something happened, in ms since the epoch, once it has.
type Stamp = Arc<Mutex<Option<u128>>>;

/// A handler that never looks at its cancellation token (it sleeps 60 s); it stamps `started`
/// when called and `dropped` when its future is dropped.
fn stubborn(started: &Stamp, dropped: &Stamp) -> impl drumline_worker::Handler {
    let (started, dropped) = (started.clone(), dropped.clone());
    move |_ctx: TaskContext| {
        let clock = DropClock(dropped.clone());
        *started.lock().unwrap() = Some(now_ms());
        async move {
            let _clock = clock;
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok::<(), HandlerError>(())
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rust_handler_that_ignores_cancellation_is_dropped_before_its_lease_ends() {
    let env = drumline_e2e::setup("e2e_partition_rust");
    let proxy = Proxy::start("127.0.0.1:6379".parse().unwrap());
    let (started, dropped) = (Stamp::default(), Stamp::default());
    let handler = stubborn(&started, &dropped);
    let (stop, running) = in_process(&env, "3s", &proxy.redis_url(), "stubborn", handler).await;
    env.publish(&adhoc("k-rust", "stubborn")).await;
    let began = wait_until_async(WAIT, || async { started.lock().unwrap().is_some() }).await;
    assert!(began, "the handler never ran");
    let (sampler, lease_ends_ms) = watch_lease_end(&env, "k-rust").await;
    proxy.set(Fault::Blackhole);
    let is_dropped = || async { dropped.lock().unwrap().is_some() };
    let gone = wait_until_async(Duration::from_secs(10), is_dropped).await;
    assert!(gone, "the handler's future was never dropped");
    sampler.await.unwrap();
    let dropped_at = dropped.lock().unwrap().unwrap();
    let lease_ends = *lease_ends_ms.lock().unwrap();
    assert!(lease_ends > 0, "the lease was never seen");
    let past = dropped_at.saturating_sub(lease_ends);
    assert!(
        dropped_at < lease_ends,
        "the handler ran {past} ms past its lease"
    );
    let margin = lease_ends - dropped_at;
    eprintln!("the Rust handler was dropped {margin} ms before its lease could be taken");
    let _ = stop.send(());
    running.abort();
}

/// A shutdown future for an in-process worker, and its trigger.
fn shutdown_trigger() -> (
    tokio::sync::oneshot::Sender<()>,
    impl std::future::Future<Output = ()> + Send,
) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    (tx, async move {
        let _ = rx.await;
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_success_whose_lease_lapsed_before_done_landed_is_recorded_not_rerun() {
    // Starts, waits for the test to say so, ends.
    let mut sc = Scenario::new("e2e_done_race", |env| {
        let (events, release) = (env.path("events"), env.path("release"));
        one_task("slow", "3s", &format!(
            "echo \"start $DRUMLINE_KEY\" >> {events}; while [ ! -e {release} ]; do sleep 0.05; done; echo \"end $DRUMLINE_KEY\" >> {events}",
            events = events.display(),
            release = release.display()
        ))
    });
    let proxy = Proxy::start("127.0.0.1:6379".parse().unwrap());
    sc.start_worker_env(&[("DRUMLINE_REDIS_URL", &proxy.redis_url())])
        .await;
    sc.publish(&adhoc("k-race", "slow")).await;
    let started = || sc.lines("events") == vec!["start k-race"];
    sc.wait(WAIT, "k-race started", started);
    // The task succeeds while the worker cannot reach Redis: its `done` write is held in the
    // proxy until the lease has run out (nobody took the instance over), then it lands.
    proxy.set(Fault::Blackhole);
    std::fs::write(sc.path("release"), "").unwrap();
    assert!(wait_until(WAIT, || sc.lines("events").len() == 2));
    let lapsed = wait_until_async(WAIT, || sc.lease_lapsed("k-race")).await;
    assert!(lapsed, "the lease never lapsed");
    proxy.set(Fault::Pass);
    sc.wait_state("k-race", "done").await;
    sc.wait_drained("default").await;
    sc.stop();
    let ran = sc.lines("events");
    assert_eq!(ran, vec!["start k-race", "end k-race"], "ran once");
}

/// Task `slow` (lease 6 s) writes `start KEY` to `starts`, sleeps 3 s, writes its key to
/// `effects`.
fn three_seconds_to_an_effect(env: &TestEnv) -> Cfg {
    one_task(
        "slow",
        "6s",
        &format!(
        "echo \"start $DRUMLINE_KEY\" >> {starts}; sleep 3; echo \"$DRUMLINE_KEY\" >> {effects}",
        starts = env.path("starts").display(),
        effects = env.path("effects").display()
    ),
    )
}

/// A worker frozen (SIGSTOP) mid-run while its task, under the supervisor, runs on and exits 0:
/// on SIGCONT both the finished task and the lapsed lease are news, and the success wins. Nobody
/// took the instance over, so `done` lands and the task is not run again (issue 33;
/// docs/guarantees.md "A success is not thrown away"). The lease (6 s) leaves the task time to
/// end before its stop point (4 s after the claim), where its supervisor would stop it (see
/// `a_frozen_workers_task_is_killed_by_its_supervisor_before_the_lease_ends`).
#[tokio::test(flavor = "multi_thread")]
async fn a_success_that_ended_while_its_worker_was_frozen_is_recorded_not_rerun() {
    let sc = Scenario::start("e2e_frozen_done", 0, 1, three_seconds_to_an_effect).await;
    sc.publish(&adhoc("k-frozen", "slow")).await;
    let started = || sc.lines("starts").len() == 1;
    sc.wait(WAIT, "the task never started", started);
    // Frozen 1 s into the run, before the first renewal (2 s); the task runs on under its
    // supervisor and exits 0 meanwhile, a second before its stop point.
    tokio::time::sleep(Duration::from_secs(1)).await;
    sc.workers[0].signal(libc::SIGSTOP);
    let frozen_at = std::time::Instant::now();
    let ended = wait_until(Duration::from_secs(10), || sc.lines("effects").len() == 1);
    let lapsed = wait_until_async(WAIT, || sc.lease_lapsed("k-frozen")).await;
    // Resumed 7 s after the stop: past the lease's end (6 s after the claim).
    tokio::time::sleep(Duration::from_secs(7).saturating_sub(frozen_at.elapsed())).await;
    sc.workers[0].signal(libc::SIGCONT);
    assert!(ended, "the task did not finish while the worker was frozen");
    assert!(lapsed, "the lease never lapsed while the worker was frozen");
    sc.wait_state("k-frozen", "done").await;
    // A dropped success is redelivered and run again at once: give it a lease and more.
    let rerun = wait_until(Duration::from_secs(5), || sc.lines("starts").len() > 1);
    let starts = sc.lines("starts");
    let what = format!("the finished run was dropped and run again: {starts:?}");
    sc.check(!rerun, what);
    assert_eq!(sc.lines("effects"), vec!["k-frozen"], "ran once");
}

/// Task `long` (lease 3 s) ignores SIGTERM, writes `start PID MS ATTEMPT` to `events`,
/// sleeps 10 s, then writes `end`.
fn deaf_to_sigterm(env: &TestEnv) -> Cfg {
    one_task("long", "3s", &format!(
        "trap '' TERM; echo \"start $$ $(date +%s%3N) $DRUMLINE_ATTEMPT\" >> {events}; sleep 10; echo end >> {events}",
        events = env.path("events").display()
    ))
}

/// A worker frozen (SIGSTOP) mid-run cannot stop its task, so its supervisor does: the task's
/// group (which ignores SIGTERM) is dead before the lease could be taken, though the worker
/// never woke, and never writes its end. Resumed, the worker goes the lease-loss way (the run's
/// result is not recorded, the delivery is requeued, no attempt is spent) and runs the same
/// attempt again to `done`
/// (issue 33; docs/guarantees.md "A partitioned or frozen worker stops its task before anyone
/// else may start it").
#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_workers_task_is_killed_by_its_supervisor_before_the_lease_ends() {
    let sc = Scenario::start("e2e_frozen_kill", 0, 1, deaf_to_sigterm).await;
    sc.publish(&adhoc("k-frozen-kill", "long")).await;
    let first = first_event(&sc);
    let (pid, started_ms): (i32, u128) = (first[1].parse().unwrap(), first[2].parse().unwrap());
    let group = pgid_of(pid).expect("the task is running");
    let (sampler, lease_ends_ms) = watch_lease_end(&sc, "k-frozen-kill").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    sc.workers[0].signal(libc::SIGSTOP);
    let died_at = death_of(group).await;
    sampler.await.unwrap();
    let lease_ends = *lease_ends_ms.lock().unwrap();
    assert!(lease_ends > 0, "the lease was never seen");
    let lines = sc.lines("events");
    let died_at = died_at.unwrap_or_else(|| {
        panic!("the frozen worker's task outlived its lease by 15 s: {lines:?}")
    });
    assert!(
        died_at < lease_ends,
        "the frozen worker's task group was alive {} ms after its lease could be taken (started \
         at {started_ms}, lease ended at {lease_ends}, group gone at {died_at}): {lines:?}",
        died_at - lease_ends
    );
    let ran_on = lines.iter().any(|l| l == "end");
    assert!(!ran_on, "the task ran on: {lines:?}");
    eprintln!(
        "the frozen worker's task group gone {} ms after its start, {} ms before its lease could \
         be taken",
        died_at - started_ms,
        lease_ends - died_at
    );
    sc.workers[0].signal(libc::SIGCONT);
    sc.wait_state("k-frozen-kill", "done").await;
    let lines = sc.lines("events");
    let starts: Vec<&String> = lines.iter().filter(|l| l.starts_with("start ")).collect();
    assert_eq!(starts.len(), 2, "killed, then run again: {lines:?}");
    let second: Vec<&str> = starts[1].split(' ').collect();
    assert!(died_at < second[2].parse::<u128>().unwrap(), "{lines:?}");
    // A lease loss, not a failed attempt: the same attempt runs again.
    assert_eq!(second[3], "0", "{lines:?}");
    assert_eq!(lines.last().map(String::as_str), Some("end"), "{lines:?}");
    assert_eq!(lines.iter().filter(|l| *l == "end").count(), 1, "{lines:?}");
}

/// A Rust handler that panics must not leave its lease renewed for ever: the instance's lease
/// lapses, so a redelivered copy can take it over (the run's watchdog stops with the run).
#[tokio::test(flavor = "multi_thread")]
async fn a_panicking_rust_handler_leaves_no_lease_renewed_behind() {
    let env = drumline_e2e::setup("e2e_panic_lease");
    let started = Arc::new(Mutex::new(false));
    let started_in = started.clone();
    let boom = move |_ctx: TaskContext| {
        let started = started_in.clone();
        async move {
            *started.lock().unwrap() = true;
            // Long enough for the watchdog to have renewed once.
            tokio::time::sleep(Duration::from_millis(900)).await;
            if *started.lock().unwrap() {
                panic!("the handler panics on purpose");
            }
            Ok::<(), HandlerError>(())
        }
    };
    let (stop, running) = in_process(&env, "2s", REDIS_URL, "boom", boom).await;
    env.publish(&adhoc("k-boom", "boom")).await;
    let began = wait_until_async(WAIT, || async { *started.lock().unwrap() }).await;
    assert!(began, "the handler never ran");
    // The lease (2 s) lapses a few seconds after the panic at the latest.
    let lapsed = wait_until_async(Duration::from_secs(8), || env.lease_lapsed("k-boom")).await;
    assert!(lapsed, "the lease of a panicked run is still renewed");
    let _ = stop.send(());
    running.abort();
}
