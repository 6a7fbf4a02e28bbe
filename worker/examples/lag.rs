//! Lag from publish to handler start at a steady rate (issue 11), against a bare consumer's lag
//! from publish to delivery measured in the same run.
//!
//! A publisher sends envelopes at `--rate` messages/s for `--seconds` seconds (pipelined
//! confirms, its own connection), each carrying the wall-clock instant it was handed to the
//! client (`args.t`, ns since the epoch; this process is publisher and consumer, so one
//! clock). The worker library with every guarantee on runs a no-op Rust handler whose first act
//! is to note `now − t`: decode, claim in Redis and the broker's delivery are all inside the
//! lag. The baseline is a bare lapin consumer (its own connection, prefetch = the worker's
//! concurrency, each delivery its own task) noting `now − t` on receipt, after decoding: what
//! the broker alone costs. The first `--warmup` seconds of each run are sent but not counted
//! (connections, the claim script's first load). Each run does bare then worker; the table
//! shows p50/p99/max per run and the median of each over the runs.
//!
//! `cargo run --release -p drumline-worker --example lag -- [--rate 500] [--seconds 30]
//!  [--warmup 1] [--runs 3] [--concurrency 32] [--json] [--json-file PATH]` (`--json-file`: the
//!  JSON also written there, whatever is printed)
//!
//! Uses its own namespaces on 127.0.0.1 and deletes what it declared. Asserts nothing about
//! speed (a benchmark, not a test); it does check that every message was handled.

use chrono::Utc;
use drumline_shared::envelope::Envelope;
use drumline_worker::{HandlerError, TaskContext, Worker};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::PublisherConfirm;
use lapin::{Channel, Connection, ConnectionProperties};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::time::Instant;

mod common;
use common::{
    bare_consumer, cleanup, confirm_channel, durable_queue, journal_from_env, median, namespace,
    short_id, AMQP,
};

/// Wall-clock ns since the epoch (the same clock for the publisher and the consumer).
fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos() as u64
}

/// The lags (ns) of the counted messages; the warm-up ones are left out.
#[derive(Default)]
struct Samples {
    lags: Mutex<Vec<u64>>,
    seen: std::sync::atomic::AtomicUsize,
}

impl Samples {
    /// Notes the lag of a message whose args are `{"t": ns, "count": bool}`.
    fn note(&self, args: &serde_json::Value) {
        let now = now_ns();
        let t = args["t"].as_u64().expect("args.t");
        if args["count"].as_bool() == Some(true) {
            self.lags.lock().unwrap().push(now.saturating_sub(t));
        }
        self.seen.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }
    fn seen(&self) -> usize {
        self.seen.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Publishes `n` envelopes to `exchange`/`key` at `rate` per second, each stamped with the
/// instant it is handed to the client; confirms are awaited alongside, in order.
async fn publish_steady(
    ch: &Channel,
    (exchange, key): (&str, &str),
    n: usize,
    warmup: usize,
    rate: f64,
) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<PublisherConfirm>();
    let confirms = tokio::spawn(async move {
        while let Some(c) = rx.recv().await {
            c.await.expect("confirm");
        }
    });
    let period = Duration::from_secs_f64(1.0 / rate);
    let start = Instant::now();
    let prefix = short_id();
    for i in 0..n {
        tokio::time::sleep_until(start + period * i as u32).await;
        let now = Utc::now();
        let mut env = Envelope {
            v: 1,
            id: uuid::Uuid::new_v4(),
            key: format!("lag-{prefix}-{i}"),
            task: "noop".into(),
            job: None,
            args: serde_json::Value::Null,
            scheduled_for: now,
            published_at: now,
            expires_at: None,
            not_before: None,
            attempt: 0,
            queue: "default".into(),
            backfill: false,
            overlap: None,
            trace: None,
        };
        env.args = serde_json::json!({"t": now_ns(), "count": i >= warmup});
        let confirm = ch
            .basic_publish(
                exchange.into(),
                key.into(),
                BasicPublishOptions::default(),
                &env.encode(),
                drumline_shared::broker::properties(&env, now, 0),
            )
            .await
            .expect("publish");
        tx.send(confirm).expect("confirms task");
    }
    drop(tx);
    confirms.await.unwrap();
}

/// Waits (up to 30 s) until `samples` saw all `n` messages.
async fn all_seen(samples: &Samples, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while samples.seen() < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} handled",
            samples.seen()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The bare consumer: notes each delivery's lag after decoding it, acks it in its own task.
async fn bare(conn: &Connection, args: &Args) -> Vec<u64> {
    let queue = format!("bench_lag_bare_{}", short_id());
    let ch = confirm_channel(conn).await;
    durable_queue(&ch, &queue).await;
    let (consumer_conn, mut consumer) = bare_consumer(&queue, args.concurrency as u16).await;
    let samples = Arc::new(Samples::default());
    let s = samples.clone();
    let consuming = tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            let s = s.clone();
            tokio::spawn(async move {
                let env = Envelope::decode(&d.data).unwrap();
                s.note(&env.args);
                d.ack(BasicAckOptions::default()).await.unwrap();
            });
        }
    });
    let n = args.messages();
    publish_steady(&ch, ("", &queue), n, args.warmup(), args.rate).await;
    all_seen(&samples, n).await;
    let _ = consumer_conn.close(200, "done".into()).await;
    consuming.abort();
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let lags = std::mem::take(&mut *samples.lags.lock().unwrap());
    lags
}

/// The worker library, every guarantee on, a no-op handler that notes its lag first.
async fn drumline(conn: &Connection, args: &Args) -> Vec<u64> {
    let (config, names, ch) = namespace(
        conn,
        "bench_lag",
        args.concurrency,
        None,
        journal_from_env(),
    )
    .await;
    let samples = Arc::new(Samples::default());
    let s = samples.clone();
    let worker = Worker::new(config).handler("noop", move |ctx: TaskContext| {
        s.note(&ctx.args);
        async { Ok::<(), HandlerError>(()) }
    });
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    wait_for_consumer(conn, &names.work_queue("default")).await;
    let n = args.messages();
    let exchange = names.tasks_exchange();
    publish_steady(&ch, (&exchange, "default"), n, args.warmup(), args.rate).await;
    all_seen(&samples, n).await;
    let _ = stop_tx.send(());
    let _ = handle.await;
    cleanup(conn, &names).await;
    let lags = std::mem::take(&mut *samples.lags.lock().unwrap());
    lags
}

/// Waits (up to 30 s) until `queue` has a consumer: the worker is ready.
async fn wait_for_consumer(conn: &Connection, queue: &str) {
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ch = conn.create_channel().await.unwrap();
        let q = ch
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
            .unwrap();
        let _ = ch.close(200, "checked".into()).await;
        if q.consumer_count() > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "the worker never consumed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// p50, p99 and max of one run, in ms.
#[derive(Clone, Copy)]
struct Percentiles {
    p50: f64,
    p99: f64,
    max: f64,
}

impl Percentiles {
    fn of(mut lags: Vec<u64>) -> Self {
        assert!(!lags.is_empty(), "no samples");
        lags.sort_unstable();
        let at = |q: f64| {
            let i = ((lags.len() as f64 * q).ceil() as usize).clamp(1, lags.len()) - 1;
            lags[i] as f64 / 1e6
        };
        Percentiles {
            p50: at(0.50),
            p99: at(0.99),
            max: at(1.0),
        }
    }
    fn json(&self) -> serde_json::Value {
        serde_json::json!({"p50_ms": round3(self.p50), "p99_ms": round3(self.p99), "max_ms": round3(self.max)})
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Median and min–max over the runs of each percentile.
fn summary(runs: &[Percentiles]) -> serde_json::Value {
    let field = |f: fn(&Percentiles) -> f64| {
        let xs: Vec<f64> = runs.iter().map(f).collect();
        let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
        let max = xs.iter().copied().fold(0.0, f64::max);
        serde_json::json!({"median": round3(median(xs)), "min": round3(min), "max": round3(max)})
    };
    serde_json::json!({
        "p50_ms": field(|p| p.p50),
        "p99_ms": field(|p| p.p99),
        "max_ms": field(|p| p.max),
        "runs": runs.iter().map(Percentiles::json).collect::<Vec<_>>(),
    })
}

fn cell(runs: &[Percentiles], f: fn(&Percentiles) -> f64) -> String {
    let xs: Vec<f64> = runs.iter().map(f).collect();
    let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = xs.iter().copied().fold(0.0, f64::max);
    format!("{:.2} ({:.2}–{:.2})", median(xs), min, max)
}

struct Args {
    rate: f64,
    seconds: f64,
    warmup_seconds: f64,
    runs: usize,
    concurrency: usize,
    json: bool,
    json_file: Option<std::path::PathBuf>,
}

impl Args {
    fn messages(&self) -> usize {
        ((self.seconds + self.warmup_seconds) * self.rate).round() as usize
    }
    fn warmup(&self) -> usize {
        (self.warmup_seconds * self.rate).round() as usize
    }
}

fn args() -> Args {
    let mut a = Args {
        rate: 500.0,
        seconds: 30.0,
        warmup_seconds: 1.0,
        runs: 3,
        concurrency: 32,
        json: false,
        json_file: None,
    };
    let usage = "usage: lag [--rate 500] [--seconds 30] [--warmup 1] [--runs 3] \
                 [--concurrency 32] [--json] [--json-file PATH]";
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().expect(usage);
        match flag.as_str() {
            "--rate" => a.rate = value().parse().expect(usage),
            "--seconds" => a.seconds = value().parse().expect(usage),
            "--warmup" => a.warmup_seconds = value().parse().expect(usage),
            "--runs" => a.runs = value().parse().expect(usage),
            "--concurrency" => a.concurrency = value().parse().expect(usage),
            "--json" => a.json = true,
            "--json-file" => a.json_file = Some(value().into()),
            _ => panic!("{usage}"),
        }
    }
    assert!(
        a.rate > 0.0 && a.seconds > 0.0 && a.runs > 0 && a.concurrency > 0,
        "{usage}"
    );
    a
}

#[tokio::main]
async fn main() {
    let args = args();
    let conn = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .expect("broker");
    let (mut bare_runs, mut worker_runs) = (Vec::new(), Vec::new());
    for run in 0..args.runs {
        let b = Percentiles::of(bare(&conn, &args).await);
        let w = Percentiles::of(drumline(&conn, &args).await);
        eprintln!(
            "run {}: bare p50 {:.2} p99 {:.2} max {:.2} ms; worker p50 {:.2} p99 {:.2} max {:.2} ms",
            run + 1,
            b.p50,
            b.p99,
            b.max,
            w.p50,
            w.p99,
            w.max
        );
        bare_runs.push(b);
        worker_runs.push(w);
    }
    let counted = args.messages() - args.warmup();
    let out = serde_json::json!({
        "rate_per_s": args.rate,
        "seconds": args.seconds,
        "warmup_seconds": args.warmup_seconds,
        "messages_counted_per_run": counted,
        "concurrency": args.concurrency,
        "runs": args.runs,
        "bare_publish_to_delivery": summary(&bare_runs),
        "worker_publish_to_handler": summary(&worker_runs),
    });
    if let Some(path) = &args.json_file {
        std::fs::write(path, serde_json::to_string_pretty(&out).unwrap()).expect("--json-file");
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out).unwrap());
    } else {
        println!(
            "{} msg/s for {} s ({counted} counted per run), concurrency {}, {} runs \
             (median, min–max), ms",
            args.rate, args.seconds, args.concurrency, args.runs
        );
        println!("{:<34} {:>20} {:>20} {:>20}", "path", "p50", "p99", "max");
        for (name, runs) in [
            ("bare consumer: publish → delivery", &bare_runs),
            ("worker: publish → handler start", &worker_runs),
        ] {
            println!(
                "{:<34} {:>20} {:>20} {:>20}",
                name,
                cell(runs, |p| p.p50),
                cell(runs, |p| p.p99),
                cell(runs, |p| p.max)
            );
        }
    }
    let _ = conn.close(200, "bye".into()).await;
}
