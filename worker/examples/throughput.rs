//! Worker throughput against an honest baseline measured in the same run (issue 11).
//!
//! The baseline is a well-written bare lapin consumer: prefetch = the worker's concurrency
//! (per consumer), each delivery its own tokio task that decodes the envelope and acks it.
//! drumline's path per message is decode → claim in Redis → run a no-op Rust handler → mark
//! done → history → ack. Both drain a pre-filled durable queue of the same persistent envelopes
//! (`drain`), and, in mode `together`, consume while the same bodies are published with
//! confirms; a second bare consumer coalesces its acks (one `multiple` ack per run of handled
//! tags, as the worker does). Each figure is `--runs` runs (bare, bare with coalesced acks,
//! worker and worker with the journal off interleaved); the table shows the median and the spread (min–max), and the journal's cost
//! as the worker's rate with it on over the rate with it off, per run. The shell executor
//! running `/bin/true` (a drain of `--shell N` messages at each of `--shell-concurrency K,…`)
//! is measured against its own ceiling: `/bin/true` spawned and awaited through
//! `tokio::process::Command`, K at once, N spawns, no broker or Redis (ceiling and executor
//! runs interleaved); and again with `--shell-background M` tasks (`sleep`) running under the
//! same supervisors throughout the run, so the cost per run with many tasks running shows
//! beside the cost with none. `--messages 0` skips the broker figures.
//!
//! `cargo run --release -p drumline-worker --example throughput -- [--messages N]
//!  [--shell N] [--shell-concurrency 8,32] [--shell-background 1000] [--concurrency 32,256]
//!  [--runs 3] [--mode drain|together|both] [--json] [--json-file PATH]`
//!
//! `--json` prints the report as JSON instead of the table; `--json-file PATH` writes the same
//! JSON to PATH as well, so `scripts/bench` can set a peer's figures beside these from one run.
//!
//! Uses its own namespaces on 127.0.0.1 and deletes what it declared. Asserts nothing about
//! speed (a benchmark, not a test); it does check that every message was handled.

use chrono::Utc;
use drumline_shared::envelope::Envelope;
use drumline_shared::names::Names;
use drumline_worker::{HandlerError, TaskContext, Worker};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;
use common::{
    bare_consumer, cleanup, confirm_channel, durable_queue, median, namespace, short_id, AMQP,
    REDIS,
};

type Bodies = [(Vec<u8>, BasicProperties)];

/// How long one drain may take before the bench gives up and says where it stuck.
const STUCK: Duration = Duration::from_secs(300);

fn envelope(i: usize) -> Envelope {
    let now = Utc::now();
    Envelope {
        v: 1,
        id: uuid::Uuid::new_v4(),
        key: format!("bench-{i}"),
        task: "noop".into(),
        job: None,
        args: serde_json::json!({"i": i}),
        scheduled_for: now,
        published_at: now,
        expires_at: None,
        not_before: None,
        attempt: 0,
        queue: "default".into(),
        backfill: false,
        overlap: None,
        trace: None,
    }
}

async fn publish_all(ch: &Channel, exchange: &str, key: &str, bodies: &Bodies) {
    let mut pending = Vec::with_capacity(bodies.len());
    for (body, props) in bodies {
        pending.push(
            ch.basic_publish(
                exchange.into(),
                key.into(),
                BasicPublishOptions::default(),
                body,
                props.clone(),
            )
            .await
            .expect("publish"),
        );
    }
    for p in pending {
        p.await.expect("confirm");
    }
}

/// The bare consumer: each delivery its own task (decode, ack), at most `prefetch` in flight.
/// With `coalesce`, the tasks hand their delivery tags to one acker, which sends one
/// `basic.ack` with `multiple` per run of handled tags it has seen (as the worker does), the
/// best a lapin consumer can do. Returns the time from connecting the consumer until the last
/// of `n` acks was sent.
async fn bare(
    conn: &Connection,
    bodies: &Bodies,
    prefetch: u16,
    together: bool,
    coalesce: bool,
) -> (Duration, [f64; 3]) {
    let n = bodies.len();
    let queue = format!("bench_bare_{}", short_id());
    let ch = confirm_channel(conn).await;
    durable_queue(&ch, &queue).await;
    if !together {
        publish_all(&ch, "", &queue, bodies).await;
    }
    let (start, cpu) = (Instant::now(), Cpu::now());
    let (consumer_conn, mut consumer) = bare_consumer(&queue, prefetch).await;
    let acked = Arc::new(AtomicUsize::new(0));
    let all_acked = Arc::new(tokio::sync::Notify::new());
    let (a, done) = (acked.clone(), all_acked.clone());
    let (handled, acker) = if coalesce {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (
            Some(tx),
            Some(tokio::spawn(coalesced_acks(rx, a.clone(), done.clone(), n))),
        )
    } else {
        (None, None)
    };
    let consuming = tokio::spawn(async move {
        for _ in 0..n {
            let d = consumer.next().await.unwrap().unwrap();
            let (a, done, handled) = (a.clone(), done.clone(), handled.clone());
            tokio::spawn(async move {
                // Decode like a worker would, so the baseline is not free of JSON.
                let env = Envelope::decode(&d.data).unwrap();
                std::hint::black_box(&env);
                if let Some(handled) = handled {
                    let _ = handled.send((d.delivery_tag, d.acker));
                    return;
                }
                d.ack(BasicAckOptions::default())
                    .await
                    .expect("the bare consumer's ack");
                if a.fetch_add(1, Ordering::AcqRel) + 1 == n {
                    done.notify_one();
                }
            });
        }
    });
    if together {
        publish_all(&ch, "", &queue, bodies).await;
    }
    // A lost delivery or a failed ack would otherwise leave the bench waiting for ever.
    if tokio::time::timeout(STUCK, all_acked.notified())
        .await
        .is_err()
    {
        panic!(
            "the bare consumer acked {} of {n} deliveries in {STUCK:?}",
            acked.load(Ordering::Acquire)
        );
    }
    let elapsed = start.elapsed();
    let used = Cpu::now().per_message(cpu, n);
    consuming.await.unwrap();
    if let Some(acker) = acker {
        acker.await.unwrap();
    }
    assert_eq!(acked.load(Ordering::Acquire), n);
    let _ = consumer_conn.close(200, "done".into()).await;
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    (elapsed, used)
}

/// The coalescing acker of the bare consumer: takes every handled delivery waiting, then acks
/// the run of consecutive tags just above what it acked before with one `multiple` ack.
async fn coalesced_acks(
    mut handled: tokio::sync::mpsc::UnboundedReceiver<(u64, lapin::Acker)>,
    acked: Arc<AtomicUsize>,
    done: Arc<tokio::sync::Notify>,
    n: usize,
) {
    let mut ready = std::collections::BTreeMap::new();
    let mut floor = 0u64;
    while let Some((tag, acker)) = handled.recv().await {
        ready.insert(tag, acker);
        while let Ok((tag, acker)) = handled.try_recv() {
            ready.insert(tag, acker);
        }
        let mut last = None;
        let mut run = 0;
        while let Some(acker) = ready.remove(&(floor + 1)) {
            floor += 1;
            run += 1;
            last = Some(acker);
        }
        if let Some(acker) = last {
            let multiple = run > 1;
            acker.ack(BasicAckOptions { multiple }).await.unwrap();
            if acked.fetch_add(run, Ordering::AcqRel) + run == n {
                done.notify_one();
                return;
            }
        }
    }
}

/// The drumline worker library with every guarantee on. Returns the time from starting the
/// worker until it has recorded all `n` runs `done` (counted by its own `succeeded` counter);
/// afterwards, untimed, checks that Redis holds every key `done` and the queue is empty.
async fn drumline(
    conn: &Connection,
    bodies: &Bodies,
    concurrency: usize,
    shell: bool,
    together: bool,
    journal: bool,
) -> (Duration, [f64; 3]) {
    let n = bodies.len();
    let command = shell.then_some("/bin/true");
    let (config, names, ch) = namespace(conn, "bench", concurrency, command, journal).await;
    let exchange = names.tasks_exchange();
    if !together {
        publish_all(&ch, &exchange, "default", bodies).await;
    }
    let ran = Arc::new(AtomicUsize::new(0));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut worker = Worker::new(config);
    if !shell {
        // The counter proves the handler itself ran (not only the bookkeeping around it).
        let counter = ran.clone();
        worker = worker.handler("noop", move |_ctx: TaskContext| {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::Relaxed);
                Ok::<(), HandlerError>(())
            }
        });
    }
    let stats = worker.stats();
    let (start, cpu) = (Instant::now(), Cpu::now());
    let handle = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    if together {
        publish_all(&ch, &exchange, "default", bodies).await;
    }
    while (stats.succeeded.get() as usize) < n {
        assert!(
            start.elapsed() < STUCK,
            "the worker finished {} of {n} tasks in {STUCK:?}",
            stats.succeeded.get()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = start.elapsed();
    let used = Cpu::now().per_message(cpu, n);
    assert!(
        shell || ran.load(Ordering::Relaxed) >= n,
        "the no-op handler ran for every message"
    );
    let calls = stats.redis_batches.get().max(1) as f64;
    eprintln!(
        "  worker: {:.1} Redis writes per script call (docs/design.md#batched-writes)",
        stats.redis_writes.get() as f64 / calls
    );
    let mut redis = redis::Client::open(REDIS)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !all_done(&mut redis, &names, n).await {
        assert!(Instant::now() < deadline, "every key recorded done");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop_tx.send(());
    let _ = handle.await;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let left = conn
        .create_channel()
        .await
        .unwrap()
        .queue_declare(
            names.work_queue("default").as_str().into(),
            passive,
            FieldTable::default(),
        )
        .await
        .unwrap()
        .message_count();
    assert_eq!(left, 0, "the queue drained");
    cleanup(conn, &names).await;
    (elapsed, used)
}

/// `m` shell tasks that sleep until they are dropped, started through the executor (so under
/// the worker's supervisors), returned once the supervisors hold them all.
async fn sleepers(m: usize) -> Vec<tokio::task::JoinHandle<Result<(), HandlerError>>> {
    use drumline_worker::executor::{supervised_tasks, ShellExecutor};
    use drumline_worker::Handler;
    let task = drumline_shared::config::Task {
        name: "sleeper".into(),
        command: Some(vec!["/bin/sleep".into(), "3600".into()]),
        timeout: None,
        max_retries: 0,
        retry_base: Duration::from_secs(1),
        retry_max: Duration::from_secs(1),
        permanent_exit_codes: vec![],
        env: Default::default(),
        http: None,
        limit: None,
    };
    let executor = ShellExecutor::for_task(&task, &[]).expect("a command");
    let before = supervised_tasks().await.unwrap_or(0);
    let runs = (0..m)
        .map(|i| {
            let ctx = TaskContext {
                task: "sleeper".into(),
                key: format!("sleeper-{i}"),
                job: None,
                scheduled_for: Utc::now(),
                attempt: 0,
                fencing_token: 1,
                args: serde_json::json!({}),
                cancel: tokio_util::sync::CancellationToken::new(),
                kill_grace: Duration::from_millis(100),
                trace: drumline_shared::trace::TraceParent::root(),
            };
            tokio::spawn(executor.call(ctx))
        })
        .collect();
    while supervised_tasks().await.unwrap_or(0) < before + m {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    runs
}

/// The fork/exec ceiling: `n` runs of `/bin/true`, each spawned and awaited through
/// `tokio::process::Command`, `k` at once. Returns the time until the last one was reaped.
async fn ceiling(n: usize, k: usize) -> Duration {
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut spawners = tokio::task::JoinSet::new();
    for _ in 0..k {
        let next = next.clone();
        spawners.spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < n {
                let status = tokio::process::Command::new("/bin/true")
                    .status()
                    .await
                    .expect("spawn /bin/true");
                assert!(status.success());
            }
        });
    }
    while let Some(done) = spawners.join_next().await {
        done.unwrap();
    }
    start.elapsed()
}

/// True when all `n` keys are `done` (pipelined in batches of 10,000).
async fn all_done(redis: &mut redis::aio::MultiplexedConnection, names: &Names, n: usize) -> bool {
    for lo in (0..n).step_by(10_000) {
        let mut pipe = redis::pipe();
        for i in lo..(lo + 10_000).min(n) {
            pipe.hget(names.run_key(&format!("bench-{i}")), "state");
        }
        let states: Vec<Option<String>> = pipe.query_async(redis).await.unwrap();
        if !states.iter().all(|s| s.as_deref() == Some("done")) {
            return false;
        }
    }
    true
}

/// CPU time used so far by this process, the broker and Redis (the processes listening on the
/// bench's ports 5672 and 6379), from `/proc` (clock ticks of 10 ms): where a run's work went.
/// The broker and Redis are shared, so their figures include whatever else uses them meanwhile.
#[derive(Clone, Copy, Default)]
struct Cpu([u64; 3]);

impl Cpu {
    fn now() -> Cpu {
        let pid = |port| listener(port).map_or(0, |pid| ticks(&pid));
        Cpu([ticks("self"), pid(5672), pid(6379)])
    }

    /// µs of CPU per message since `earlier`, over `n` messages: [this process, broker, Redis].
    fn per_message(&self, earlier: Cpu, n: usize) -> [f64; 3] {
        std::array::from_fn(|i| self.0[i].saturating_sub(earlier.0[i]) as f64 * 10_000.0 / n as f64)
    }
}

/// The process listening on TCP `port` of this host: the socket's inode from `/proc/net/tcp`
/// (and `tcp6`), then the process holding it among `/proc/*/fd`.
fn listener(port: u16) -> Option<String> {
    let inode = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .find_map(|table| {
            let text = std::fs::read_to_string(table).ok()?;
            text.lines().skip(1).find_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let local_port = f.get(1)?.rsplit_once(':')?.1;
                let listening = f.get(3) == Some(&"0A");
                (listening && u16::from_str_radix(local_port, 16).ok()? == port)
                    .then(|| f.get(9).map(|i| i.to_string()))?
            })
        })?;
    let socket = format!("socket:[{inode}]");
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid = entry.file_name().to_string_lossy().into_owned();
            let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
            fds.flatten()
                .any(|fd| {
                    std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == socket)
                })
                .then_some(pid)
        })
}

/// utime + stime of `/proc/PID/stat`, in clock ticks.
fn ticks(pid: &str) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces): state is the 3rd field overall.
    let rest = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(11) + field(12)
}

/// Median and spread of a few runs' rates (msg/s).
struct Figure {
    runs: Vec<f64>,
}

impl Figure {
    fn sorted(&self) -> Vec<f64> {
        let mut r = self.runs.clone();
        r.sort_by(|a, b| a.total_cmp(b));
        r
    }
    fn median(&self) -> f64 {
        median(self.runs.clone())
    }
    fn min(&self) -> f64 {
        self.sorted()[0]
    }
    fn max(&self) -> f64 {
        *self.sorted().last().unwrap()
    }
    /// "median (min–max)", whole numbers.
    fn spread(&self) -> String {
        format!("{:.0} ({:.0}–{:.0})", self.median(), self.min(), self.max())
    }
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "median": self.median().round(),
            "min": self.min().round(),
            "max": self.max().round(),
            "runs": self.runs.iter().map(|r| r.round()).collect::<Vec<_>>(),
        })
    }
}

/// A ratio of medians and the spread of the per-run ratios: "0.80 (0.68–0.87)".
fn ratio_text(of_medians: f64, runs: &Figure) -> String {
    format!("{of_medians:.2} ({:.2}–{:.2})", runs.min(), runs.max())
}

struct Row {
    mode: &'static str,
    concurrency: usize,
    bare: Figure,
    /// The bare consumer with coalesced acks.
    coalesced: Figure,
    worker: Figure,
    /// The worker with `[journal] enabled = false`.
    unjournaled: Figure,
    /// Per-run worker/bare ratios (runs interleaved, so each pair shares the machine's mood).
    ratios: Vec<f64>,
    /// Per-run worker/bare-with-coalesced-acks ratios.
    coalesced_ratios: Vec<f64>,
    /// Per-run worker (journal on) / worker (journal off) ratios.
    journal: Vec<f64>,
    /// Per run, µs of CPU per message [this process, broker, Redis]: bare, worker, the
    /// worker with the journal off, and bare with coalesced acks.
    cpu: Vec<[[f64; 3]; 4]>,
}

impl Row {
    /// Per process, the median over the runs of the CPU figures of side `side` (0 bare, 1
    /// worker, 2 worker with the journal off, 3 bare with coalesced acks).
    fn cpu_medians(&self, side: usize) -> [f64; 3] {
        std::array::from_fn(|i| {
            let runs = self.cpu.iter().map(|c| c[side][i]).collect();
            Figure { runs }.median()
        })
    }
}

/// The shell executor against the fork/exec ceiling at one concurrency.
struct ShellRow {
    concurrency: usize,
    ceiling: Figure,
    executor: Figure,
    /// Per-run executor/ceiling ratios (runs interleaved).
    ratios: Vec<f64>,
    /// The executor with `--shell-background` tasks running throughout.
    loaded: Figure,
}

struct Args {
    messages: usize,
    shell: usize,
    shell_concurrency: Vec<usize>,
    shell_background: usize,
    concurrency: Vec<usize>,
    runs: usize,
    modes: Vec<&'static str>,
    json: bool,
    json_file: Option<std::path::PathBuf>,
}

fn args() -> Args {
    let mut a = Args {
        messages: 50_000,
        shell: 2_000,
        shell_concurrency: vec![8, 32],
        shell_background: 1000,
        concurrency: vec![32, 256],
        runs: 3,
        modes: vec!["drain"],
        json: false,
        json_file: None,
    };
    let mut it = std::env::args().skip(1);
    let usage = "usage: throughput [--messages N] [--shell N] [--shell-concurrency 8,32] \
                 [--shell-background 1000] [--concurrency 32,256] [--runs 3] \
                 [--mode drain|together|both] [--json] [--json-file PATH]";
    let list =
        |v: String| -> Vec<usize> { v.split(',').map(|c| c.parse().expect(usage)).collect() };
    while let Some(flag) = it.next() {
        let mut value = || it.next().expect(usage);
        match flag.as_str() {
            "--messages" => a.messages = value().parse().expect(usage),
            "--shell" => a.shell = value().parse().expect(usage),
            "--runs" => a.runs = value().parse().expect(usage),
            "--concurrency" => a.concurrency = list(value()),
            "--shell-concurrency" => a.shell_concurrency = list(value()),
            "--shell-background" => a.shell_background = value().parse().expect(usage),
            "--mode" => {
                a.modes = match value().as_str() {
                    "drain" => vec!["drain"],
                    "together" => vec!["together"],
                    "both" => vec!["drain", "together"],
                    _ => panic!("{usage}"),
                }
            }
            "--json" => a.json = true,
            "--json-file" => a.json_file = Some(value().into()),
            _ => panic!("{usage}"),
        }
    }
    assert!(a.runs > 0 && (a.messages > 0 || a.shell > 0), "{usage}");
    a
}

#[tokio::main]
async fn main() {
    let args = args();
    // The shell executor's supervisor: cargo puts it in target/<profile>/, one level above
    // this example (target/<profile>/examples/).
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| Some(e.parent()?.parent()?.to_owned()))
    {
        drumline_worker::executor::use_supervisor(dir.join(drumline_worker::executor::SUPERVISOR));
    }
    let conn = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .expect("broker");
    let bodies: Vec<_> = (0..args.messages.max(args.shell))
        .map(|i| {
            let e = envelope(i);
            (
                e.encode(),
                drumline_shared::broker::properties(&e, Utc::now(), 0),
            )
        })
        .collect();
    let rate = |count: usize, d: Duration| count as f64 / d.as_secs_f64();
    let n = args.messages;

    let mut rows = Vec::new();
    // `--messages 0` skips the broker figures (the shell figures alone).
    let modes = if n > 0 { &args.modes[..] } else { &[] };
    for &mode in modes {
        let together = mode == "together";
        for &c in &args.concurrency {
            let mut row = Row {
                mode,
                concurrency: c,
                bare: Figure { runs: vec![] },
                coalesced: Figure { runs: vec![] },
                worker: Figure { runs: vec![] },
                unjournaled: Figure { runs: vec![] },
                ratios: vec![],
                coalesced_ratios: vec![],
                journal: vec![],
                cpu: vec![],
            };
            for run in 0..args.runs {
                let (b, bare_cpu) = bare(&conn, &bodies[..n], c as u16, together, false).await;
                let (k, coalesced_cpu) = bare(&conn, &bodies[..n], c as u16, together, true).await;
                let (w, worker_cpu) = drumline(&conn, &bodies[..n], c, false, together, true).await;
                let (u, unjournaled_cpu) =
                    drumline(&conn, &bodies[..n], c, false, together, false).await;
                let (b, k, w, u) = (rate(n, b), rate(n, k), rate(n, w), rate(n, u));
                let us = |[me, broker, redis]: [f64; 3]| {
                    format!("{me:.0} here + {broker:.0} broker + {redis:.0} redis µs CPU/msg")
                };
                eprintln!(
                    "{mode} c={c} run {}: bare {b:.0} msg/s ({}), coalesced acks {k:.0} msg/s ({}), \
                     worker {w:.0} msg/s ({}) ({:.2}), journal off {u:.0} msg/s ({}) (on/off {:.2})",
                    run + 1,
                    us(bare_cpu),
                    us(coalesced_cpu),
                    us(worker_cpu),
                    w / b,
                    us(unjournaled_cpu),
                    w / u
                );
                row.bare.runs.push(b);
                row.coalesced.runs.push(k);
                row.coalesced_ratios.push(w / k);
                row.worker.runs.push(w);
                row.unjournaled.runs.push(u);
                row.ratios.push(w / b);
                row.journal.push(w / u);
                row.cpu
                    .push([bare_cpu, worker_cpu, unjournaled_cpu, coalesced_cpu]);
            }
            rows.push(row);
        }
    }
    let mut shell_rows = Vec::new();
    if args.shell > 0 {
        for &k in &args.shell_concurrency {
            let mut row = ShellRow {
                concurrency: k,
                ceiling: Figure { runs: vec![] },
                executor: Figure { runs: vec![] },
                ratios: vec![],
                loaded: Figure { runs: vec![] },
            };
            for run in 0..args.runs {
                let c = rate(args.shell, ceiling(args.shell, k).await);
                let journal = common::journal_from_env();
                let (d, _) = drumline(&conn, &bodies[..args.shell], k, true, false, journal).await;
                let e = rate(args.shell, d);
                eprintln!(
                    "shell K={k} run {}: fork/exec {c:.0}/s, executor {e:.0}/s ({:.2})",
                    run + 1,
                    e / c
                );
                row.ceiling.runs.push(c);
                row.executor.runs.push(e);
                row.ratios.push(e / c);
                if args.shell_background > 0 {
                    let background = sleepers(args.shell_background).await;
                    let (d, _) =
                        drumline(&conn, &bodies[..args.shell], k, true, false, journal).await;
                    let l = rate(args.shell, d);
                    for run in &background {
                        run.abort();
                    }
                    // Gone before the next figure (its count starts from what is left).
                    while drumline_worker::executor::supervised_tasks()
                        .await
                        .unwrap_or(0)
                        > 0
                    {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    eprintln!(
                        "shell K={k} run {}: executor with {} tasks running {l:.0}/s ({:.2} of \
                         without)",
                        run + 1,
                        args.shell_background,
                        l / e
                    );
                    row.loaded.runs.push(l);
                }
            }
            shell_rows.push(row);
        }
    }
    let cores = std::thread::available_parallelism()
        .map(|p| p.get())
        .unwrap_or(0);

    let out = serde_json::json!({
        "cores": cores,
        "messages": n,
        "runs": args.runs,
        "throughput": rows.iter().map(|r| {
            let ratio = Figure { runs: r.ratios.clone() };
            serde_json::json!({
                "mode": r.mode,
                "concurrency": r.concurrency,
                "bare_msgs_per_s": r.bare.json(),
                "worker_msgs_per_s": r.worker.json(),
                "ratio": {
                    "of_medians": r.worker.median() / r.bare.median(),
                    "min": ratio.min(),
                    "max": ratio.max(),
                    "runs": r.ratios,
                },
                "bare_coalesced_acks_msgs_per_s": r.coalesced.json(),
                "ratio_to_coalesced": {
                    "of_medians": r.worker.median() / r.coalesced.median(),
                    "runs": r.coalesced_ratios,
                },
                "journal_off_msgs_per_s": r.unjournaled.json(),
                "journal_on_over_off": {
                    "median": Figure { runs: r.journal.clone() }.median(),
                    "runs": r.journal,
                },
                "cpu_us_per_msg": {
                    "bare": r.cpu_medians(0),
                    "worker": r.cpu_medians(1),
                    "worker_journal_off": r.cpu_medians(2),
                    "bare_coalesced_acks": r.cpu_medians(3),
                },
            })
        }).collect::<Vec<_>>(),
        "shell": (args.shell > 0).then(|| serde_json::json!({
            "messages": args.shell,
            "command": "/bin/true",
            "by_concurrency": shell_rows.iter().map(|r| {
                let ratio = Figure { runs: r.ratios.clone() };
                serde_json::json!({
                    "concurrency": r.concurrency,
                    "fork_exec_per_s": r.ceiling.json(),
                    "executor_per_s": r.executor.json(),
                    "ratio": {
                        "of_medians": r.executor.median() / r.ceiling.median(),
                        "min": ratio.min(),
                        "max": ratio.max(),
                        "runs": r.ratios,
                    },
                    "background_tasks": args.shell_background,
                    "executor_with_background_per_s":
                        (!r.loaded.runs.is_empty()).then(|| r.loaded.json()),
                })
            }).collect::<Vec<_>>(),
        })),
    });
    let json = serde_json::to_string_pretty(&out).unwrap();
    if let Some(path) = &args.json_file {
        std::fs::write(path, &json).expect("--json-file: cannot write");
    }
    if args.json {
        println!("{json}");
    } else {
        println!(
            "{n} messages per run, {} runs per figure (median, min–max), {cores} cores",
            args.runs
        );
        if !rows.is_empty() {
            println!(
                "{:<9} {:>5} {:>22} {:>22} {:>18}",
                "mode", "conc", "bare msg/s", "worker msg/s", "worker/bare"
            );
        }
        for r in &rows {
            let ratio = Figure {
                runs: r.ratios.clone(),
            };
            println!(
                "{:<9} {:>5} {:>22} {:>22} {:>18}",
                r.mode,
                r.concurrency,
                r.bare.spread(),
                r.worker.spread(),
                ratio_text(r.worker.median() / r.bare.median(), &ratio),
            );
        }
        if !rows.is_empty() {
            println!("the bare consumer with coalesced acks (one `multiple` ack per run of handled tags)");
        }
        for r in &rows {
            let ratio = Figure {
                runs: r.coalesced_ratios.clone(),
            };
            let [a, b, c] = r.cpu_medians(3);
            println!(
                "{:<9} {:>5} {:>22} {:>22} {:>18}   {a:.0} + {b:.0} + {c:.0} = {:.0} µs CPU/msg",
                r.mode,
                r.concurrency,
                r.coalesced.spread(),
                "worker/coalesced",
                ratio_text(r.worker.median() / r.coalesced.median(), &ratio),
                a + b + c
            );
        }
        println!("CPU per message, µs (median of the runs): this process + broker + Redis");
        for r in &rows {
            let [a, b, c] = r.cpu_medians(0);
            let [d, e, f] = r.cpu_medians(1);
            println!(
                "{:<9} {:>5}   bare {a:.0} + {b:.0} + {c:.0} = {:.0}   worker {d:.0} + {e:.0} + {f:.0} = {:.0}",
                r.mode,
                r.concurrency,
                a + b + c,
                d + e + f
            );
        }
        if !rows.is_empty() {
            println!(
                "the journal's cost: the worker with [journal] enabled = false, and on/off per run"
            );
        }
        for r in &rows {
            let ratio = Figure {
                runs: r.journal.clone(),
            };
            let [d, e, f] = r.cpu_medians(2);
            println!(
                "{:<9} {:>5}   journal off {} msg/s   on/off {}   \
                 off: {d:.0} + {e:.0} + {f:.0} = {:.0} µs CPU/msg",
                r.mode,
                r.concurrency,
                r.unjournaled.spread(),
                ratio_text(ratio.median(), &ratio),
                d + e + f
            );
        }
        if args.shell > 0 {
            println!(
                "shell executor running /bin/true, {} messages per run, against fork/exec of \
                 /bin/true through tokio::process, K at once",
                args.shell
            );
            println!(
                "{:<9} {:>5} {:>22} {:>22} {:>18}",
                "", "K", "fork/exec /s", "executor /s", "executor/ceiling"
            );
            for r in &shell_rows {
                let ratio = Figure {
                    runs: r.ratios.clone(),
                };
                println!(
                    "{:<9} {:>5} {:>22} {:>22} {:>18}",
                    "shell",
                    r.concurrency,
                    r.ceiling.spread(),
                    r.executor.spread(),
                    ratio_text(r.executor.median() / r.ceiling.median(), &ratio),
                );
            }
            if args.shell_background > 0 {
                println!(
                    "the same with {} shell tasks (sleep) running under the same supervisors \
                     throughout",
                    args.shell_background
                );
                for r in &shell_rows {
                    println!(
                        "{:<9} {:>5} {:>22} {:>22} {:>18}",
                        "loaded",
                        r.concurrency,
                        "",
                        r.loaded.spread(),
                        format!("{:.2} of unloaded", r.loaded.median() / r.executor.median()),
                    );
                }
            }
        }
    }
    let _ = conn.close(200, "bye".into()).await;
}
