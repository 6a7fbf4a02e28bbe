//! The dead-letter watch (docs/design.md#expired-in-the-queue). Every dead letter is also
//! routed to `{ns}.dead.watch`; the workers consume it as competing consumers, so each letter
//! is looked at once, and journal each message the broker expired in its work queue (its AMQP
//! `expiration`, from the job's `expires`) the way a claim of an expired copy does: `expired`
//! under its key, a run record, the job's turn passed on (docs/audit.md#the-journal). Dead
//! letters a worker wrote itself carry `x-drumline-reason` and were recorded when they were
//! written: they are only acked. `{ns}.dead` keeps its own copy for `dlq`.
//!
//! A connection of its own, so that trouble here never touches the work consumers: it
//! reconnects with backoff, waits while Redis is down (the worker's gate), hands a letter back
//! when its write fails, and stops with the worker's `stop`.

use crate::decision::{self, Outcome};
use crate::processor::{self, Processor};
use crate::reload::Current;
use crate::stats::RunOutcome;
use drumline_shared::backoff::Backoff;
use drumline_shared::broker::{self, BrokerError, Channel, Connection, Consumer, Delivery};
use drumline_shared::envelope::Envelope;
use drumline_shared::run::Claim;
use drumline_shared::store::{ClaimRequest, OverlapMode, StoreError};
use futures_util::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Between tries to reach the broker: 200 ms, doubled up to 5 s.
const RECONNECT: Backoff =
    Backoff::constant(Duration::from_millis(200), Duration::from_secs(5), 0.0);

/// Letters the broker sends ahead of the one in hand.
const PREFETCH: u16 = 32;

/// Why a watch session ended.
#[derive(Debug, thiserror::Error)]
enum WatchError {
    #[error(transparent)]
    Broker(#[from] BrokerError),
    #[error("the broker ended the watch consumer")]
    Ended,
}

/// Watches `{ns}.dead.watch` until `stop`, through the processor `current` serves (its config,
/// store, counters and gate), reconnecting after any broker failure.
pub(crate) async fn run(current: Arc<Current>, stop: CancellationToken) {
    let mut backoff = RECONNECT;
    while !stop.is_cancelled() {
        let processor = current.get();
        let opened = tokio::select! {
            opened = open(&processor) => opened,
            _ = stop.cancelled() => return,
        };
        let ended = match opened {
            Ok((conn, channel, consumer)) => {
                backoff.reset();
                let Err(ended) = watch(&current, &channel, consumer, &stop).await else {
                    let close = conn.close(200, "worker shutting down".into());
                    let _ = broker::bounded("connection.close", close).await;
                    return;
                };
                broker::close_later(conn, "dead-letter watch interrupted");
                ended
            }
            Err(e) => e,
        };
        let delay = backoff.next_delay();
        warn!(error = %ended, retry_in_ms = delay.as_millis() as u64, "dead-letter watch interrupted; reconnecting");
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// A connection (the topology declared as the worker's), and a consumer of the watch queue.
async fn open(p: &Processor) -> Result<(Connection, Channel, Consumer), WatchError> {
    let config = &p.config;
    let what = broker::Declaration {
        names: &p.names,
        queues: &config.worker.queues,
        dead_ttl: config.worker.dead_ttl,
        queue_type: config.broker.queue_type,
    };
    let (conn, channel) = broker::Nodes::new(config).open_session(&what).await?;
    let consumer = async {
        broker::qos(&channel, PREFETCH).await?;
        let (queue, tag) = (p.names.dead_watch(), format!("{}/dead.watch", p.worker_id));
        let consume = broker::consume(&channel, &queue, &tag);
        broker::bounded("basic.consume", consume).await
    };
    match consumer.await {
        Ok(consumer) => Ok((conn, channel, consumer)),
        Err(e) => {
            broker::close_later(conn, "dead-letter watch not opened");
            Err(e.into())
        }
    }
}

/// Handles the watch's letters one at a time until `stop` (`Ok`) or a broker failure. Each
/// waits for the Redis gate; a letter whose write fails goes back to the queue, and the gate
/// closes until the worker's probe finds Redis again.
async fn watch(
    current: &Current,
    channel: &Channel,
    mut consumer: Consumer,
    stop: &CancellationToken,
) -> Result<(), WatchError> {
    info!("watching the dead letters for expired instances");
    loop {
        let delivery = tokio::select! {
            next = consumer.next() => next.ok_or(WatchError::Ended)??,
            _ = stop.cancelled() => return Ok(()),
        };
        let processor = current.get();
        tokio::select! {
            _ = processor.gate.wait_open() => {}
            _ = stop.cancelled() => return Ok(()),
        }
        match letter(&processor, channel, &delivery).await {
            Ok(()) => delivery.acker.ack(false).await?,
            Err(e) => {
                warn!(error = %e, "redis: could not journal an expired instance; handing it back");
                processor.gate.close();
                delivery.acker.requeue().await?;
            }
        }
    }
}

/// One letter: when the broker expired it and it holds an envelope we would admit, its
/// instance is judged as a claim of an expired copy judges it (dedupe first: a finished
/// instance stays a duplicate) and, when the claim answers expired, recorded.
async fn letter(p: &Processor, publisher: &Channel, delivery: &Delivery) -> Result<(), StoreError> {
    if !delivery.expired_by_broker {
        return Ok(());
    }
    let arrival = processor::arrival(&p.names, delivery);
    let max = p.config.worker.max_message_bytes;
    let is_job = |job: &str| p.overlap.contains_key(job);
    let Ok(env) = decision::admit(&delivery.body, &arrival, max, is_job) else {
        debug!("an expired letter that is not an envelope we run; left to dlq");
        return Ok(());
    };
    let token = uuid::Uuid::new_v4().to_string();
    let claim = p
        .store
        .claim(&ClaimRequest {
            key: &env.key,
            token: &token,
            worker: &p.worker_id,
            job: env.job.as_deref(),
            attempt: env.attempt,
            lease: p.config.worker.lease,
            overlap: OverlapMode::Allow,
            retention: p.config.worker.done_ttl,
            expired: true,
            limit: None,
            epoch: delivery.epoch,
        })
        .await?;
    if claim == Claim::Expired {
        expired(p, publisher, &env).await;
    } else {
        debug!(key = %env.key, ?claim, "expired in the queue, but its instance was decided");
    }
    Ok(())
}

/// Records an instance the broker expired in its queue, like a worker that finds a copy
/// expired ([`Processor::pass_the_turn`] included: the copy may have been a woken waiter).
async fn expired(p: &Processor, publisher: &Channel, env: &Envelope) {
    info!(key = %env.key, "expired in its queue before a worker could take it");
    p.stats.expired.inc();
    p.stats
        .outcome(p.task_label(&env.task), RunOutcome::Expired);
    p.record(env, Outcome::Expired, None, None).await;
    p.pass_the_turn(publisher, env).await;
}
