//! A "snoop" queue: a test-owned queue bound to `{ns}.tasks` like the work queue, so it
//! receives a copy of every message the beats publish. Each copy is recorded with its arrival
//! time (the test's own clocks) and its `x-drumline-epoch`, which shows who published what and
//! when, without touching the work queue the workers consume.

use crate::{TestEnv, AMQP_URL};
use chrono::{DateTime, Utc};
use drumline_shared::envelope::{header_int, Envelope};
use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One message as the snoop queue received it.
#[derive(Debug, Clone)]
pub struct Snooped {
    /// When it arrived, by the test's wall clock.
    pub arrived: DateTime<Utc>,
    /// When it arrived, by the test's monotonic clock.
    pub arrived_at: Instant,
    /// Its `x-drumline-epoch` header, if any.
    pub epoch: Option<i64>,
    /// Its envelope.
    pub envelope: Envelope,
}

/// A running snoop queue (its own thread and connection); stops on drop. The queue itself is
/// deleted with the test's namespace.
pub struct Snoop {
    messages: Arc<Mutex<Vec<Snooped>>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Snoop {
    /// Binds `{ns}.snoop` to `{ns}.tasks` with routing key `queue` and starts recording. Waits
    /// (up to 60 s) for the exchange to exist (a worker or beat declares it); every message
    /// published after this returns is recorded.
    pub fn start(env: &mut TestEnv, queue: &str) -> Self {
        let names = env.names();
        let snoop_queue = format!("{}.snoop", names.namespace());
        env.forget_queue_later(snoop_queue.clone());
        let exchange = names.tasks_exchange();
        let routing_key = queue.to_owned();
        let messages = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let sink = messages.clone();
        let thread = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(async move {
                    let consumer =
                        match bind(&snoop_queue, &exchange, &routing_key).await {
                            Ok(c) => c,
                            Err(e) => {
                                let _ = ready_tx.send(Err(e));
                                return;
                            }
                        };
                    let (conn, mut consumer) = consumer;
                    let _ = ready_tx.send(Ok(()));
                    let mut stop_rx = stop_rx;
                    loop {
                        tokio::select! {
                            _ = &mut stop_rx => break,
                            next = consumer.next() => {
                                let Some(Ok(delivery)) = next else { break };
                                let arrived = Utc::now();
                                let arrived_at = Instant::now();
                                let epoch =
                                    header_int(delivery.properties.headers().as_ref(), "x-drumline-epoch");
                                if let Ok(envelope) = Envelope::decode(&delivery.data) {
                                    sink.lock().expect("snoop lock").push(Snooped {
                                        arrived,
                                        arrived_at,
                                        epoch,
                                        envelope,
                                    });
                                }
                            }
                        }
                    }
                    let _ = conn.close(200, "snoop done").await;
                });
        });
        match ready_rx.recv_timeout(Duration::from_secs(90)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("snoop queue: {e}"),
            Err(_) => panic!("snoop queue did not start"),
        }
        Self {
            messages,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    /// Everything received so far, in arrival order.
    pub fn messages(&self) -> Vec<Snooped> {
        self.messages.lock().expect("snoop lock").clone()
    }
}

async fn bind(
    queue: &str,
    exchange: &str,
    routing_key: &str,
) -> Result<(Connection, lapin::Consumer), String> {
    let conn = Connection::connect(AMQP_URL, ConnectionProperties::default())
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
                exchange,
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
            return Err(format!("exchange {exchange} never appeared"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
    ch.queue_declare(queue, QueueDeclareOptions::default(), FieldTable::default())
        .await
        .map_err(|e| format!("declare {queue}: {e}"))?;
    ch.queue_bind(
        queue,
        exchange,
        routing_key,
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(|e| format!("bind {queue}: {e}"))?;
    let consumer = ch
        .basic_consume(
            queue,
            "snoop",
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|e| format!("consume {queue}: {e}"))?;
    Ok((conn, consumer))
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
