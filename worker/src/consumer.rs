//! The broker side of a worker: connect, declare, consume with manual ack and a channel-wide
//! prefetch of `concurrency`, dispatch each delivery to the [`Processor`], reconnect with
//! backoff when the connection drops, and shut down in order.
//!
//! Shutdown order (DESIGN §4 step 10): stop consuming (cancel the consumers) → let in-flight
//! handlers finish and ack, up to `shutdown_grace` → cancel what is left (its deliveries are
//! requeued, its claims released) → close the channels and the connection.

use crate::processor::Processor;
use crate::stats::Stats;
use crate::{Gate, Handler, WorkerError};
use drumline_shared::config::Config;
use drumline_shared::names::Names;
use drumline_shared::store::Store;
use drumline_shared::topology;
use futures_util::stream::{select_all, StreamExt};
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::Connection;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const REDIS_PROBE_EVERY: Duration = Duration::from_millis(500);
const REDIS_IDLE_CHECK_EVERY: Duration = Duration::from_secs(2);

/// Runs a worker until `shutdown` completes.
pub async fn run(
    config: Arc<Config>,
    handlers: HashMap<String, Arc<dyn Handler>>,
    stats: Arc<Stats>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<Arc<Stats>, WorkerError> {
    let stop = CancellationToken::new();
    let stopper = stop.clone();
    let shutdown = async move {
        shutdown.await;
        stopper.cancel();
    };
    tokio::pin!(shutdown);

    let names = Names::new(config.namespace.clone());
    let worker_id = worker_id();
    info!(worker = %worker_id, namespace = %config.namespace, queues = ?config.worker.queues,
          concurrency = config.worker.concurrency, "worker starting");

    // Fail closed from the very start: no Redis, no consuming.
    let store = tokio::select! {
        store = connect_redis(&config, &names) => store,
        _ = &mut shutdown => return Ok(stats),
    };
    stats.redis_up.set(1);

    let processor = Arc::new(Processor {
        config: config.clone(),
        names: names.clone(),
        store: store.clone(),
        handlers,
        worker_id: worker_id.clone(),
        stats: stats.clone(),
        gate: Gate::default(),
        abandon: CancellationToken::new(),
        overlap: config
            .jobs
            .iter()
            .map(|j| (j.name.clone(), j.overlap))
            .collect(),
    });
    let probe = tokio::spawn(probe_redis(store, processor.gate.clone(), stats.clone()));

    let mut in_flight = JoinSet::new();
    let mut backoff = BACKOFF_MIN;
    // Kept open through the drain: acks travel on the consumer channel, and lapin closes a
    // channel when its last handle is dropped.
    let mut connection: Option<(Connection, lapin::Channel, lapin::Channel)> = None;
    'connect: while !stop.is_cancelled() {
        let session = tokio::select! {
            s = open_session(&config, &names, &worker_id) => s,
            _ = &mut shutdown => break 'connect,
        };
        let (conn, publisher, consumer_channel, consumers) = match session {
            Ok(s) => s,
            Err(e) => {
                if let SessionError::Fatal(message) = e {
                    return Err(WorkerError::Config(message));
                }
                warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "cannot reach the broker; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = &mut shutdown => break 'connect,
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        backoff = BACKOFF_MIN;
        stats.broker_connected.set(1);
        info!("consuming");
        let tags: Vec<String> = consumers.iter().map(|c| c.tag().to_string()).collect();
        let mut deliveries = select_all(consumers);
        loop {
            tokio::select! {
                _ = &mut shutdown => {
                    for tag in &tags {
                        let _ = consumer_channel.basic_cancel(tag, BasicCancelOptions::default()).await;
                    }
                    connection = Some((conn, publisher, consumer_channel));
                    break 'connect;
                }
                next = deliveries.next() => match next {
                    Some(Ok(delivery)) => {
                        // Fail closed: while Redis is down the delivery waits here, unacked.
                        if !processor.gate.is_open() {
                            error!("redis unreachable: holding deliveries until it answers again");
                            tokio::select! {
                                _ = processor.gate.wait_open() => info!("redis is back; resuming"),
                                _ = &mut shutdown => {
                                    let _ = delivery.acker.nack(BasicNackOptions { requeue: true, ..Default::default() }).await;
                                    for tag in &tags {
                                        let _ = consumer_channel.basic_cancel(tag, BasicCancelOptions::default()).await;
                                    }
                                    connection = Some((conn, publisher, consumer_channel));
                                    break 'connect;
                                }
                            }
                        }
                        in_flight.spawn(processor.clone().process(publisher.clone(), delivery));
                    }
                    Some(Err(e)) => {
                        warn!(error = %e, "broker connection lost; reconnecting");
                        break;
                    }
                    None => {
                        warn!("consumer cancelled by the broker; reconnecting");
                        break;
                    }
                },
                Some(_) = in_flight.join_next(), if !in_flight.is_empty() => {}
            }
        }
        stats.broker_connected.set(0);
        let _ = conn.close(200, "reconnecting").await;
    }
    stats.broker_connected.set(0);

    drain(&config, &processor, &mut in_flight).await;
    if let Some((conn, _publisher, _consumer_channel)) = connection {
        let _ = conn.close(200, "worker shutting down").await;
    }
    probe.abort();
    info!(worker = %worker_id, stats = %processor.stats.summary(), "worker stopped");
    Ok(processor.stats.clone())
}

/// Lets in-flight runs finish for up to `shutdown_grace`, then cancels the rest.
async fn drain(config: &Config, processor: &Processor, in_flight: &mut JoinSet<()>) {
    if in_flight.is_empty() {
        return;
    }
    info!(in_flight = in_flight.len(), grace = %humantime::format_duration(config.worker.shutdown_grace),
          "stopped consuming; letting in-flight tasks finish");
    let all_done = async { while in_flight.join_next().await.is_some() {} };
    if tokio::time::timeout(config.worker.shutdown_grace, all_done)
        .await
        .is_err()
    {
        warn!(
            abandoned = in_flight.len(),
            "shutdown grace exhausted; cancelling what still runs"
        );
        processor.abandon.cancel();
        while in_flight.join_next().await.is_some() {}
    }
}

#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
    #[error("{0}")]
    Fatal(String),
}

type Session = (
    Connection,
    lapin::Channel,
    lapin::Channel,
    Vec<lapin::Consumer>,
);

async fn open_session(
    config: &Config,
    names: &Names,
    worker_id: &str,
) -> Result<Session, SessionError> {
    let conn = topology::connect(config).await?;
    let publisher = conn.create_channel().await?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    match topology::declare(
        &publisher,
        names,
        &config.worker.queues,
        config.worker.dead_ttl,
    )
    .await
    {
        Ok(()) => {}
        Err(topology::TopologyError::Amqp(e)) => return Err(e.into()),
        Err(e @ topology::TopologyError::Mismatch { .. }) => {
            return Err(SessionError::Fatal(e.to_string()))
        }
    }
    let channel = conn.create_channel().await?;
    // global = true: RabbitMQ applies the limit to the whole channel, so `concurrency` bounds
    // unacked deliveries across all queues together.
    channel
        .basic_qos(
            config.worker.concurrency.min(u16::MAX as usize) as u16,
            BasicQosOptions { global: true },
        )
        .await?;
    let mut consumers = Vec::new();
    for queue in &config.worker.queues {
        let consumer = channel
            .basic_consume(
                &names.work_queue(queue),
                &format!("{worker_id}/{queue}"),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        consumers.push(consumer);
    }
    Ok((conn, publisher, channel, consumers))
}

async fn connect_redis(config: &Config, names: &Names) -> Store {
    let mut backoff = BACKOFF_MIN;
    loop {
        match Store::connect(
            &config.redis_url,
            config.redis_ca_file.as_deref(),
            names.clone(),
        )
        .await
        {
            Ok(store) => return store,
            Err(e) => {
                error!(error = %e, "redis unreachable at start; not consuming until it answers (fail closed)");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

/// Closes the gate when Redis stops answering, reopens it once Redis answers again, and mirrors
/// it in the `redis_up` gauge.
async fn probe_redis(store: Store, gate: Gate, stats: Arc<Stats>) {
    loop {
        // While open, still look now and then: an idle worker should not report healthy (or
        // take the next delivery) with Redis gone.
        tokio::select! {
            _ = gate.wait_closed() => {}
            _ = tokio::time::sleep(REDIS_IDLE_CHECK_EVERY) => {
                if !store.ping().await {
                    error!("redis unreachable: failing closed until it answers");
                    gate.close();
                }
                continue;
            }
        }
        stats.redis_up.set(0);
        loop {
            tokio::time::sleep(REDIS_PROBE_EVERY).await;
            if store.ping().await {
                gate.open();
                stats.redis_up.set(1);
                break;
            }
        }
    }
}

/// `host:pid:random` — unique per process, readable in Redis and logs.
fn worker_id() -> String {
    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "unknown".into());
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..6];
    format!("{host}:{}:{suffix}", std::process::id())
}
