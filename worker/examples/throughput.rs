//! Worker throughput against a baseline measured in the same run: bare RabbitMQ
//! publish-with-confirms + consume-with-manual-ack of the same bodies, versus drumline's full
//! path per message (decode → claim in Redis → run → mark done → history → ack) with a no-op
//! Rust handler, and with the shell executor running `/bin/true` (fork/exec bound).
//!
//! `cargo run --release -p drumline-worker --example throughput -- [N] [SHELL_N] [CONCURRENCY]`
//! Uses its own namespace on 127.0.0.1 and deletes what it declared. Prints a table; asserts
//! nothing (a benchmark, not a test).

use chrono::Utc;
use drumline_shared::config::Config;
use drumline_shared::envelope::Envelope;
use drumline_worker::{HandlerError, TaskContext, Worker};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const REDIS: &str = "redis://127.0.0.1:6379/0";

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
        attempt: 0,
        queue: "default".into(),
        backfill: false,
    }
}

/// Publishes all, then awaits all confirms (pipelined, as a producer would).
async fn publish_all(
    ch: &Channel,
    exchange: &str,
    key: &str,
    bodies: &[(Vec<u8>, BasicProperties)],
) {
    let mut pending = Vec::with_capacity(bodies.len());
    for (body, props) in bodies {
        pending.push(
            ch.basic_publish(
                exchange,
                key,
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

async fn baseline(
    conn: &Connection,
    n: usize,
    prefetch: u16,
    bodies: &[(Vec<u8>, BasicProperties)],
) -> Duration {
    let queue = format!(
        "bench_base_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(&queue, durable, FieldTable::default())
        .await
        .unwrap();
    // Consume while publishing, as the workers do.
    let consumer_ch = conn.create_channel().await.unwrap();
    consumer_ch
        .basic_qos(prefetch, BasicQosOptions { global: true })
        .await
        .unwrap();
    let mut consumer = consumer_ch
        .basic_consume(
            &queue,
            "bench",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let start = Instant::now();
    let consuming = tokio::spawn(async move {
        let mut seen = 0;
        while seen < n {
            let d = consumer.next().await.unwrap().unwrap();
            // Decode like a worker would, so the baseline is not free of JSON.
            let _ = Envelope::decode(&d.data).unwrap();
            d.ack(BasicAckOptions::default()).await.unwrap();
            seen += 1;
        }
    });
    publish_all(&ch, "", &queue, &bodies[..n]).await;
    consuming.await.unwrap();
    let elapsed = start.elapsed();
    ch.queue_delete(&queue, QueueDeleteOptions::default())
        .await
        .unwrap();
    elapsed
}

async fn drumline(conn: &Connection, n: usize, concurrency: usize, shell: bool) -> Duration {
    let ns = format!("bench_{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let command = if shell {
        "command = [\"/bin/true\"]\n"
    } else {
        ""
    };
    let config = Config::parse(
        &format!(
            "namespace = \"{ns}\"\n[worker]\nconcurrency = {concurrency}\n[tasks.noop]\n{command}"
        ),
        Path::new("bench.toml"),
        |name| match name {
            "DRUMLINE_AMQP_URL" => Some(AMQP.into()),
            "DRUMLINE_REDIS_URL" => Some(REDIS.into()),
            _ => None,
        },
    )
    .expect("config");
    let done = Arc::new(AtomicUsize::new(0));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut worker = Worker::new(config);
    if !shell {
        // The counter proves the handler itself ran (not only the bookkeeping around it).
        let counter = done.clone();
        worker = worker.handler("noop", move |_ctx: TaskContext| {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::Relaxed);
                Ok::<(), HandlerError>(())
            }
        });
    }
    // Declare topology first by starting the worker; then publish and time.
    let handle = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let queue = format!("{ns}.q.default");
    loop {
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        if conn
            .create_channel()
            .await
            .unwrap()
            .queue_declare(&queue, passive, FieldTable::default())
            .await
            .is_ok()
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let bodies: Vec<_> = (0..n)
        .map(|i| {
            let e = envelope(i);
            (e.encode(), e.properties(Utc::now(), 0))
        })
        .collect();
    let start = Instant::now();
    publish_all(&ch, &format!("{ns}.tasks"), "default", &bodies).await;
    // Finished = the queue drained and every key recorded `done`.
    let mut redis = redis::Client::open(REDIS)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    loop {
        let q = conn
            .create_channel()
            .await
            .unwrap()
            .queue_declare(
                &queue,
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        if q.message_count() == 0 {
            let last_done: Option<String> = redis::cmd("HGET")
                .arg(format!("{ns}:run:bench-{}", n - 1))
                .arg("state")
                .query_async(&mut redis)
                .await
                .unwrap();
            let finished = stats_done(&mut redis, &ns, n).await;
            if last_done.as_deref() == Some("done") && finished {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = start.elapsed();
    assert!(
        shell || done.load(Ordering::Relaxed) >= n,
        "the no-op handler ran for every message"
    );
    let _ = stop_tx.send(());
    let _ = handle.await;
    cleanup(conn, &ns, &mut redis).await;
    elapsed
}

/// True when all `n` keys are `done` (checked with one pipelined round trip).
async fn stats_done(redis: &mut redis::aio::MultiplexedConnection, ns: &str, n: usize) -> bool {
    let mut pipe = redis::pipe();
    for i in 0..n {
        pipe.hget(format!("{ns}:run:bench-{i}"), "state");
    }
    let states: Vec<Option<String>> = pipe.query_async(redis).await.unwrap();
    states.iter().all(|s| s.as_deref() == Some("done"))
}

async fn cleanup(conn: &Connection, ns: &str, redis: &mut redis::aio::MultiplexedConnection) {
    let ch = conn.create_channel().await.unwrap();
    for q in [format!("{ns}.q.default"), format!("{ns}.dead")] {
        let _ = ch.queue_delete(&q, QueueDeleteOptions::default()).await;
    }
    for x in [format!("{ns}.tasks"), format!("{ns}.dead")] {
        let _ = ch
            .exchange_delete(&x, ExchangeDeleteOptions::default())
            .await;
    }
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{ns}:*"))
        .query_async(redis)
        .await
        .unwrap();
    for chunk in keys.chunks(1000) {
        let _: () = redis::cmd("DEL")
            .arg(chunk)
            .query_async(redis)
            .await
            .unwrap();
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a number"))
        .collect();
    let n = args.first().copied().unwrap_or(5000);
    let shell_n = args.get(1).copied().unwrap_or(500);
    let concurrency = args.get(2).copied().unwrap_or(32);
    let conn = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .expect("broker");
    let bodies: Vec<_> = (0..n.max(shell_n))
        .map(|i| {
            let e = envelope(i);
            (e.encode(), e.properties(Utc::now(), 0))
        })
        .collect();
    let rate = |count: usize, d: Duration| count as f64 / d.as_secs_f64();

    let base = baseline(&conn, n, concurrency as u16, &bodies).await;
    let noop = drumline(&conn, n, concurrency, false).await;
    let shell = drumline(&conn, shell_n, concurrency, true).await;
    let base_shell = baseline(&conn, shell_n, concurrency as u16, &bodies).await;

    println!(
        "concurrency/prefetch {concurrency}, {} cores",
        std::thread::available_parallelism()
            .map(|p| p.get())
            .unwrap_or(0)
    );
    println!(
        "{:<44} {:>8} {:>10} {:>12}",
        "path", "msgs", "msgs/s", "vs baseline"
    );
    println!(
        "{:<44} {:>8} {:>10.0} {:>12}",
        "bare publish(confirm)+consume+ack",
        n,
        rate(n, base),
        "1.00"
    );
    println!(
        "{:<44} {:>8} {:>10.0} {:>12.2}",
        "drumline, no-op Rust handler",
        n,
        rate(n, noop),
        rate(n, noop) / rate(n, base)
    );
    println!(
        "{:<44} {:>8} {:>10.0} {:>12.2}",
        "drumline, shell executor (/bin/true)",
        shell_n,
        rate(shell_n, shell),
        rate(shell_n, shell) / rate(shell_n, base_shell)
    );
    let _ = conn.close(200, "bye").await;
}
