//! What the worker benches share (`throughput`, `lag`): the local broker and Redis, a config
//! with one no-op task, a confirm-mode channel, the bare lapin consumer's set-up (its own
//! connection, per-consumer prefetch) and the clean-up of a bench namespace.

use drumline_shared::broker;
use drumline_shared::config::Config;
use drumline_shared::names::Names;
use lapin::options::{
    BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions, ExchangeDeleteOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, Consumer};
use std::path::Path;

pub const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const REDIS: &str = "redis://127.0.0.1:6379/0";

pub fn short_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_string()
}

/// Whether the journal is on in the worker benches: `BENCH_JOURNAL=off` turns it off.
pub fn journal_from_env() -> bool {
    std::env::var("BENCH_JOURNAL").as_deref() != Ok("off")
}

/// A worker config for namespace `ns`: one task `noop`, run by `command` when given (else a
/// Rust handler must be registered), with the journal on or off.
pub fn config(ns: &str, concurrency: usize, command: Option<&str>, journal: bool) -> Config {
    let command = command.map_or(String::new(), |c| format!("command = [{c:?}]\n"));
    let journal = if journal {
        ""
    } else {
        "[journal]\nenabled = false\n"
    };
    Config::parse(
        &format!(
            "namespace = \"{ns}\"\n{journal}[worker]\nconcurrency = {concurrency}\n[tasks.noop]\n{command}"
        ),
        Path::new("bench.toml"),
        |name| match name {
            "DRUMLINE_AMQP_URL" => Some(AMQP.into()),
            "DRUMLINE_REDIS_URL" => Some(REDIS.into()),
            _ => None,
        },
    )
    .expect("config")
}

/// A fresh namespace `{prefix}_{id}` for one worker run: its config (see [`config`]), names,
/// and a confirm channel on `conn` with the namespace's topology declared.
pub async fn namespace(
    conn: &Connection,
    prefix: &str,
    concurrency: usize,
    command: Option<&str>,
    journal: bool,
) -> (Config, Names, Channel) {
    let ns = format!("{prefix}_{}", short_id());
    let config = config(&ns, concurrency, command, journal);
    let names = Names::new(ns);
    let ch = confirm_channel(conn).await;
    broker::declare(
        &ch,
        &names,
        &config.worker.queues,
        config.worker.dead_ttl,
        config.broker.queue_type,
    )
    .await
    .expect("declare");
    (config, names, ch)
}

/// The median of `xs` (the mean of the middle two for an even count).
pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    let m = xs.len() / 2;
    if xs.len() % 2 == 1 {
        xs[m]
    } else {
        (xs[m - 1] + xs[m]) / 2.0
    }
}

pub async fn confirm_channel(conn: &Connection) -> Channel {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch
}

/// Declares the durable queue `queue` on `ch`.
pub async fn durable_queue(ch: &Channel, queue: &str) {
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue.into(), durable, FieldTable::default())
        .await
        .unwrap();
}

/// The bare consumer's own connection (as the worker has, and as RabbitMQ advises: a
/// connection that also publishes is throttled by flow control, which would slow its acks)
/// and its consumer on `queue`, at most `prefetch` unacked.
pub async fn bare_consumer(queue: &str, prefetch: u16) -> (Connection, Consumer) {
    let conn = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .expect("broker");
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(prefetch, BasicQosOptions { global: false })
        .await
        .unwrap();
    let consumer = ch
        .basic_consume(
            queue.into(),
            "bench".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    (conn, consumer)
}

/// Deletes the bench namespace's work queue, dead letters, exchanges and Redis keys.
pub async fn cleanup(conn: &Connection, names: &Names) {
    let ch = conn.create_channel().await.unwrap();
    for q in [
        names.work_queue("default"),
        names.dead(),
        names.dead_watch(),
    ] {
        let _ = ch
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    for x in [names.tasks_exchange(), names.dead()] {
        let _ = ch
            .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
            .await;
    }
    let mut redis = redis::Client::open(REDIS)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{}:*", names.namespace()))
            .arg("COUNT")
            .arg(5000)
            .query_async(&mut redis)
            .await
            .unwrap();
        if !keys.is_empty() {
            let _: () = redis::cmd("UNLINK")
                .arg(&keys)
                .query_async(&mut redis)
                .await
                .unwrap();
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
}
