//! A "snoop" queue: a test-owned queue bound to `{ns}.tasks` like the work queue, so it
//! receives a copy of every message published there — what the beats publish, and the retries
//! and re-checks coming back from delay queues (marked [`Snooped::via_delay`]). Each copy is
//! recorded with its arrival time (the test's own clocks) and its `x-drumline-epoch`, which
//! shows who published what and when, without touching the work queue the workers consume.
//!
//! The queue is durable and every copy is acked only once recorded, and the snoop reconnects
//! when the broker goes away, so a broker restart loses no copy (a copy whose ack was lost in
//! the restart is recorded twice). [`Snoop::settle`] is a barrier: once the publishers have
//! stopped, it returns everything they published.

use crate::{TestEnv, AMQP_URL};
use chrono::{DateTime, Utc};
use drumline_shared::broker::header_int;
use drumline_shared::envelope::Envelope;
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use std::collections::BTreeSet;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Body prefix of the markers [`Snoop::settle`] sends through the queue.
const MARKER: &str = "drumline-snoop-marker:";

/// One message as the snoop queue received it.
#[derive(Debug, Clone)]
pub struct Snooped {
    /// When it arrived, by the test's wall clock.
    pub arrived: DateTime<Utc>,
    /// When it arrived, by the test's monotonic clock.
    pub arrived_at: Instant,
    /// Its `x-drumline-epoch` header, if any.
    pub epoch: Option<i64>,
    /// True when it came back from a delay queue (the broker's `x-death` header): a worker's
    /// retry or re-check, not something a publisher sent.
    pub via_delay: bool,
    /// Its envelope.
    pub envelope: Envelope,
    /// The body as published (checked against the wire contract, docs/envelope.schema.json).
    pub body: Vec<u8>,
}

/// What the snoop thread has seen: the copies and the markers.
#[derive(Default)]
struct Seen {
    messages: Vec<Snooped>,
    markers: BTreeSet<String>,
}

/// A running snoop queue (its own thread and connection); stops on drop. The queue itself is
/// deleted with the test's namespace.
pub struct Snoop {
    seen: Arc<Mutex<Seen>>,
    url: String,
    queue: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Snoop {
    /// Binds `{ns}.snoop` to `{ns}.tasks` with routing key `queue` on the shared broker and
    /// starts recording. Waits (up to 60 s) for the exchange to exist (a worker or beat declares
    /// it); every message published after this returns is recorded.
    pub fn start(env: &mut TestEnv, queue: &str) -> Self {
        Self::start_at(env, AMQP_URL, queue)
    }

    /// [`Snoop::start`] on the broker at `url` (e.g. a [`PrivateRabbit`](crate::PrivateRabbit)).
    pub fn start_at(env: &mut TestEnv, url: &str, queue: &str) -> Self {
        let names = env.names();
        let snoop_queue = format!("{}.snoop", names.namespace());
        env.forget_queue_later(snoop_queue.clone());
        let target = Target {
            url: url.to_owned(),
            queue: snoop_queue.clone(),
            exchange: names.tasks_exchange(),
            routing_key: queue.to_owned(),
        };
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let sink = seen.clone();
        let thread = std::thread::spawn(move || {
            runtime().block_on(record(target, sink, ready_tx, stop_rx));
        });
        match ready_rx.recv_timeout(Duration::from_secs(90)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("snoop queue: {e}"),
            Err(_) => panic!("snoop queue did not start"),
        }
        Self {
            seen,
            url: url.to_owned(),
            queue: snoop_queue,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    /// Everything received so far, in arrival order.
    pub fn messages(&self) -> Vec<Snooped> {
        self.seen.lock().expect("snoop lock").messages.clone()
    }

    /// Everything published before this call, in arrival order: sends a marker through the
    /// snoop queue and waits (up to 60 s) until it comes out, so every copy queued before it
    /// (a stopped beat's confirmed publishes included) has been recorded. Panics if the marker
    /// does not arrive.
    pub fn settle(&self) -> Vec<Snooped> {
        let marker = format!("{MARKER}{}", uuid::Uuid::new_v4().simple());
        let (url, queue, body) = (self.url.clone(), self.queue.clone(), marker.clone());
        std::thread::spawn(move || runtime().block_on(send_marker(&url, &queue, &body)))
            .join()
            .expect("marker thread")
            .unwrap_or_else(|e| panic!("snoop marker: {e}"));
        let arrived = crate::wait_until(Duration::from_secs(60), || {
            self.seen
                .lock()
                .expect("snoop lock")
                .markers
                .contains(&marker)
        });
        assert!(
            arrived,
            "the snoop marker never came through {}",
            self.queue
        );
        self.messages()
    }

    /// The keys publishers sent (copies from delay queues left out), in arrival order, once
    /// settled (see [`Snoop::settle`]); a key sent twice is listed twice.
    pub fn published_keys(&self) -> Vec<String> {
        self.settle()
            .into_iter()
            .filter(|m| !m.via_delay)
            .map(|m| m.envelope.key)
            .collect()
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Where the snoop queue lives and what it is bound to.
struct Target {
    url: String,
    queue: String,
    exchange: String,
    routing_key: String,
}

/// The snoop thread: binds, records, and after a lost connection binds again until stopped.
/// Reports the first bind's outcome on `ready`.
async fn record(
    target: Target,
    seen: Arc<Mutex<Seen>>,
    ready: mpsc::Sender<Result<(), String>>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let mut ready = Some(ready);
    loop {
        let (conn, mut consumer) = match bind(&target).await {
            Ok(bound) => bound,
            Err(e) => {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Err(e));
                    return;
                }
                // The broker is away (restarting): try again shortly.
                tokio::select! {
                    _ = &mut stop => return,
                    _ = tokio::time::sleep(Duration::from_millis(200)) => continue,
                }
            }
        };
        if let Some(ready) = ready.take() {
            let _ = ready.send(Ok(()));
        }
        loop {
            tokio::select! {
                _ = &mut stop => {
                    let _ = conn.close(200, "snoop done".into()).await;
                    return;
                }
                next = consumer.next() => {
                    let Some(Ok(delivery)) = next else { break };
                    note(&seen, &delivery);
                    // Acked once recorded; a lost ack means a redelivery, never a lost copy.
                    let _ = delivery.ack(BasicAckOptions::default()).await;
                }
            }
        }
        // The connection is gone (broker restart or close): bind again.
    }
}

/// Records one delivery: a marker, or a message with its arrival, epoch and whether it came
/// back through a delay queue.
fn note(seen: &Mutex<Seen>, delivery: &lapin::message::Delivery) {
    let arrived = Utc::now();
    let arrived_at = Instant::now();
    let headers = delivery.properties.headers().as_ref();
    let epoch = header_int(headers, "x-drumline-epoch");
    let via_delay = headers.is_some_and(|h| h.inner().contains_key("x-death"));
    let mut seen = seen.lock().expect("snoop lock");
    if let Some(marker) = std::str::from_utf8(&delivery.data)
        .ok()
        .filter(|b| b.starts_with(MARKER))
    {
        seen.markers.insert(marker.to_owned());
    } else if let Ok(envelope) = Envelope::decode(&delivery.data) {
        seen.messages.push(Snooped {
            arrived,
            arrived_at,
            epoch,
            via_delay,
            envelope,
            body: delivery.data.clone(),
        });
    }
}

async fn bind(target: &Target) -> Result<(Connection, lapin::Consumer), String> {
    let conn = Connection::connect(&target.url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("connect: {e}"))?;
    // Wait for the exchange (declared by the binaries, with their arguments).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        };
        if ch
            .exchange_declare(
                target.exchange.as_str().into(),
                ExchangeKind::Direct,
                passive,
                FieldTable::default(),
            )
            .await
            .is_ok()
        {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("exchange {} never appeared", target.exchange));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let queue = &target.queue;
    let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue.as_str().into(), durable, FieldTable::default())
        .await
        .map_err(|e| format!("declare {queue}: {e}"))?;
    ch.queue_bind(
        queue.as_str().into(),
        target.exchange.as_str().into(),
        target.routing_key.as_str().into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(|e| format!("bind {queue}: {e}"))?;
    let consumer = ch
        .basic_consume(
            queue.as_str().into(),
            "snoop".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| format!("consume {queue}: {e}"))?;
    Ok((conn, consumer))
}

/// Publishes `body` straight to `queue` (default exchange) and waits for the confirm.
async fn send_marker(url: &str, queue: &str, body: &str) -> Result<(), String> {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
    ch.confirm_select(Default::default())
        .await
        .map_err(|e| e.to_string())?;
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        body.as_bytes(),
        BasicProperties::default(),
    )
    .await
    .map_err(|e| e.to_string())?
    .await
    .map_err(|e| e.to_string())?;
    let _ = conn.close(200, "bye".into()).await;
    Ok(())
}

impl Drop for Snoop {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
