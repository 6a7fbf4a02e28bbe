//! The broker side of a worker: connect, declare, consume with manual ack, dispatch each
//! delivery to the [`Processor`], reconnect with backoff when the connection drops, and shut
//! down in order.
//!
//! Concurrency is a semaphore that outlives connections: a delivery is taken only with a free
//! slot, and the slot is held until the run is settled. After a reconnect the runs still in
//! flight from the old connection keep their slots, so a reconnect never adds runs on top of
//! them (the per-consumer prefetch of `concurrency` only bounds what the broker sends ahead).
//! The publisher channel is reopened when the broker closed it, and while the broker side keeps
//! failing (a publish or declare refused, so a delivery had to be requeued) the consumer pauses
//! before it takes the next delivery, doubling the pause each time ([`Pacer`]): a failure that
//! repeats can neither spin nor reconnect at full speed.
//!
//! Every consumer of a session is listened to all the time, busy or not. One that the broker
//! cancels (its queue deleted, its leader moved, a consumer timeout) is logged, its queue is
//! declared again as at start and consumed again, retried every second at most, while the
//! other queues go on; meanwhile `drumline_worker_consumers{queue}` is 0 and `/healthz` 503
//! (docs/design.md#cancelled-consumers). A consumer that ends with its channel, and a delivery
//! that cannot be settled in time (docs/design.md#acks), start a new session.
//!
//! Shutdown order (docs/design.md step 10); every step is bounded, so whatever state the deliveries
//! and channels are in, SIGTERM ends the worker within `shutdown_grace` + the executor's kill
//! grace + a few seconds:
//! 1. stop consuming: cancel the consumers (bounded: the channel may be dead) and hand back
//!    the deliveries they already sent that no run has taken;
//! 2. drain: let in-flight runs finish and settle (ack or requeue), up to `shutdown_grace`;
//! 3. cancel what still runs (handlers are told; shell tasks get SIGTERM, then SIGKILL) and
//!    wait for those to settle, up to [`ABANDON_WAIT`];
//! 4. drop what is still stuck on a broker or Redis call that will not answer: its delivery
//!    was not acked, so the broker redelivers it;
//! 5. flush the acks and close the connection (bounded).
//!
//! Beside the sessions, [`dead_watch`] journals what the broker expired in the queues; it stops
//! taking letters at step 1.
//!
//! A topology mismatch found on a reconnect ends the worker with a config error, but only after
//! the same drain: runs in flight are never dropped mid-way.

use crate::acks::{Acks, Settled, Ticket, BROKER_CALL_TIMEOUT, SETTLE_TIMEOUT};
use crate::dead_watch;
use crate::lease::KILL_GRACE;
use crate::processor::{self, Processor};
use crate::reload::{reload_on_hangup, Current, Reload};
use crate::stats::Stats;
use crate::{Gate, Handler, WorkerError};
use drumline_shared::backoff::Backoff;
use drumline_shared::broker::{self, BrokerError, Channel, Connection, Consumer, Delivery};
use drumline_shared::config::Config;
use drumline_shared::names::Names;
use drumline_shared::signals::Hangups;
use drumline_shared::store::Store;
use futures_util::stream::{self, BoxStream, FuturesUnordered, SelectAll, StreamExt};
use futures_util::FutureExt;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Between tries to reach the broker (and Redis at start).
const RECONNECT: Backoff = Backoff::constant(BACKOFF_MIN, BACKOFF_MAX, 0.0);
/// The longest pause before the next delivery while the broker side keeps failing.
const PACE_MAX: Duration = Duration::from_secs(10);
/// The pause before the next delivery after `n` broker-side failures in a row.
const PACING: Backoff = Backoff::constant(BACKOFF_MIN, PACE_MAX, 0.0);
const REDIS_PROBE_EVERY: Duration = Duration::from_millis(500);
const REDIS_IDLE_CHECK_EVERY: Duration = Duration::from_secs(2);
/// How long declaring a queue again, or consuming it again, may take before it is retried.
const REDECLARE_TIMEOUT: Duration = Duration::from_secs(2);
/// Between two tries to declare a queue again (at most a second apart): its consumer comes
/// back within about a second of the queue becoming declarable.
const REDECLARE: Backoff = Backoff::constant(BACKOFF_MIN, Duration::from_secs(1), 0.0);
/// After the grace: the most that cancelled runs get to stop their tasks and settle.
pub const ABANDON_WAIT: Duration = KILL_GRACE.saturating_add(SETTLE_TIMEOUT);

/// Runs a worker until `shutdown` completes, then stops in order (see the module docs).
pub async fn run(
    config: Arc<Config>,
    (handlers, reload): (HashMap<String, Arc<dyn Handler>>, Option<Reload>),
    stats: Arc<Stats>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<Arc<Stats>, WorkerError> {
    let stop = CancellationToken::new();
    let work = work(config, (handlers, reload), stats, stop.clone());
    tokio::pin!(work);
    // Shutdown turns into `stop`; the work then stops taking deliveries and drains.
    tokio::select! {
        ended = &mut work => ended,
        _ = shutdown => {
            stop.cancel();
            work.await
        }
    }
}

/// The worker's life: Redis first (fail closed), then broker sessions until `stop` or a fatal
/// topology mismatch, then the drain and the close.
async fn work(
    config: Arc<Config>,
    (handlers, reload): (HashMap<String, Arc<dyn Handler>>, Option<Reload>),
    stats: Arc<Stats>,
    stop: CancellationToken,
) -> Result<Arc<Stats>, WorkerError> {
    // Listen for SIGHUP from the start (when reloading): its default action ends the process.
    let reload = reload.map(|r| (r, Hangups::new()));
    let names = Names::new(config.namespace.clone());
    let worker_id = worker_id();
    stats.expect_queues(&config.worker.queues);
    stats.expect_limits(config.limits.keys().map(String::as_str));
    info!(worker = %worker_id, namespace = %config.namespace, queues = ?config.worker.queues,
          concurrency = config.worker.concurrency, "worker starting");

    // Fail closed from the very start: no Redis, no consuming.
    let store = tokio::select! {
        store = connect_redis(&config, &names) => store.batching(stats.observe_batches()),
        _ = stop.cancelled() => return Ok(stats),
    };
    stats.redis_up.set(1);

    let processor = Arc::new(first_processor(
        &config, store, handlers, &worker_id, &stats,
    ));
    let current = Arc::new(Current::new(processor.clone()));
    let beside = Beside::start(&processor, &current, reload, &stop);

    let mut in_flight = JoinSet::new();
    let dispatch = Dispatch {
        slots: Arc::new(Semaphore::new(config.worker.concurrency.max(1))),
        nodes: broker::Nodes::new(&config),
        pacer: Arc::new(Pacer::default()),
        processor: processor.clone(),
        current,
        stop,
    };
    let served = dispatch.serve(&names, &mut in_flight).await;
    stats.broker_connected.set(0);
    beside.stop_watching();

    drain(&config, &processor, &mut in_flight).await;
    if let Some((conn, _publisher, _consumer_channel)) = served.connection {
        close(conn, "worker shutting down").await;
    }
    beside.end(&processor).await;
    info!(worker = %worker_id, stats = %processor.stats.summary(), "worker stopped");
    match served.fatal {
        Some(refused) => Err(WorkerError::Topology(refused)),
        None => Ok(processor.stats.clone()),
    }
}

/// What runs beside the broker sessions: the worker's announcement, the Redis probe, the
/// SIGHUP reloads and the dead-letter watch.
struct Beside {
    announce: JoinHandle<()>,
    probe: JoinHandle<()>,
    reloads: Option<JoinHandle<()>>,
    watching: JoinHandle<()>,
    /// Stops the watch with the consumers (a fatal topology too); nothing of it needs draining.
    watch_stop: CancellationToken,
}

impl Beside {
    /// Starts them for the worker of `processor`, the watch and the reloads on `current`.
    fn start(
        processor: &Processor,
        current: &Arc<Current>,
        reload: Option<(Reload, Hangups)>,
        stop: &CancellationToken,
    ) -> Self {
        let announcing = crate::announce::info(&processor.worker_id, &processor.config);
        let announce = tokio::spawn(crate::announce::run(
            processor.store.clone(),
            announcing,
            processor.stats.clone(),
        ));
        let probe = tokio::spawn(probe_redis(
            processor.store.clone(),
            processor.gate.clone(),
            processor.stats.clone(),
        ));
        let reloads =
            reload.map(|(r, hangups)| tokio::spawn(reload_on_hangup(current.clone(), r, hangups)));
        let watch_stop = stop.child_token();
        let watching = tokio::spawn(dead_watch::run(current.clone(), watch_stop.clone()));
        Beside {
            announce,
            probe,
            reloads,
            watching,
            watch_stop,
        }
    }

    /// Stops the dead-letter watch taking letters (shutdown step 1).
    fn stop_watching(&self) {
        self.watch_stop.cancel();
    }

    /// Ends them all once the runs are drained and the connection closed; the worker's
    /// announcement is removed, bounded.
    async fn end(self, processor: &Processor) {
        self.probe.abort();
        self.announce.abort();
        let _ = tokio::time::timeout(BROKER_CALL_TIMEOUT, self.watching).await;
        // Bounded: a Redis that does not answer must not hold up the stop (the TTL removes it).
        let forget = processor.store.forget_worker(&processor.worker_id);
        if !matches!(
            tokio::time::timeout(Duration::from_secs(2), forget).await,
            Ok(Ok(()))
        ) {
            tracing::debug!("worker announcement not removed; it expires");
        }
        if let Some(reloads) = self.reloads {
            reloads.abort();
        }
    }
}

/// Says once that Redis lets held deliveries go again.
fn resumed(held: &mut bool) {
    if std::mem::take(held) {
        info!("redis is back; resuming");
    }
}

/// Says that the worker cannot serve with the broker's queues as they are and finishes its
/// `in_flight` runs before it ends.
fn finishing_first(refused: BrokerError, in_flight: usize) -> BrokerError {
    error!(error = %refused, in_flight,
           "cannot serve with this topology; finishing the runs in flight first");
    refused
}

/// The processor of the worker's start (a reload makes the next from it).
fn first_processor(
    config: &Arc<Config>,
    store: Store,
    handlers: HashMap<String, Arc<dyn Handler>>,
    worker_id: &str,
    stats: &Arc<Stats>,
) -> Processor {
    Processor {
        config: config.clone(),
        names: Names::new(config.namespace.clone()),
        store,
        handlers,
        worker_id: worker_id.to_owned(),
        stats: stats.clone(),
        gate: Gate::default(),
        abandon: CancellationToken::new(),
        overlap: processor::overlaps(config),
    }
}

/// How the broker sessions ended.
#[derive(Default)]
struct Served {
    /// Kept open through the drain: acks travel on the consumer channel, and the client closes a
    /// channel when its last handle is dropped.
    connection: Option<(Connection, PublishChannel, Channel)>,
    /// A topology mismatch: the worker cannot serve with this config.
    fatal: Option<BrokerError>,
}

/// Hands deliveries to the [`Processor`] within the concurrency slots, paced by [`Pacer`].
/// The slots and the pacer outlive broker connections.
struct Dispatch {
    slots: Arc<Semaphore>,
    /// The broker's nodes; a reconnect tries the others first.
    nodes: broker::Nodes,
    pacer: Arc<Pacer>,
    /// The first processor: the session settings, counters and gate (shared by every
    /// reloaded one).
    processor: Arc<Processor>,
    /// The processor each new delivery goes to (replaced on SIGHUP).
    current: Arc<Current>,
    stop: CancellationToken,
}

/// Why a session's consume loop ended.
enum SessionEnd {
    /// Shutdown: keep the connection for the drain.
    Stopping,
    /// The connection or the consumer channel is gone, or a delivery could not be settled:
    /// reconnect.
    Lost,
    /// A queue declared again after the broker cancelled its consumer exists with other
    /// arguments: drain (keeping the connection), then end the worker.
    Fatal(BrokerError),
}

/// What one consumer event asks of the session ([`Dispatch::on_event`]).
enum Reaction {
    /// Nothing more: go on.
    Go,
    /// The broker cancelled this queue's consumer: declare it again and re-subscribe.
    Resubscribe(String),
    /// End the session.
    End(SessionEnd),
}

/// What a session's consumers yield: a delivery, a failure, or the end of a consumer (cancelled
/// by the broker, or with its channel).
// Nearly every event is a delivery, which moves once into the waiting line: boxing it would add
// an allocation to each.
#[allow(clippy::large_enum_variant)]
enum Event {
    Delivery(Delivery),
    Failed(String, BrokerError),
    Ended(String),
}

/// The deliveries of `consumer` (of logical queue `queue`), then its end as an event of its
/// own: a consumer that ends alone must be noticed, not dropped from a merged stream.
fn events(queue: String, consumer: Consumer) -> BoxStream<'static, Event> {
    let failed = queue.clone();
    consumer
        .map(move |next| match next {
            Ok(delivery) => Event::Delivery(delivery),
            Err(e) => Event::Failed(failed.clone(), e),
        })
        .chain(stream::once(async move { Event::Ended(queue) }))
        .boxed()
}

impl Dispatch {
    /// Opens broker sessions (reconnecting with backoff) and consumes from each until `stop`
    /// or a fatal topology mismatch.
    async fn serve(&self, names: &Names, in_flight: &mut JoinSet<()>) -> Served {
        let config = &self.processor.config;
        let stats = &self.processor.stats;
        let mut backoff = RECONNECT;
        while !self.stop.is_cancelled() {
            let session = tokio::select! {
                s = open_session(config, (names, &self.nodes), &self.processor.worker_id) => s,
                _ = self.stop.cancelled() => break,
            };
            let (conn, publisher, consumer_channel, consumers) = match session {
                Ok(s) => s,
                Err(SessionError::Fatal(refused)) => {
                    let fatal = Some(finishing_first(refused, in_flight.len()));
                    return Served {
                        connection: None,
                        fatal,
                    };
                }
                Err(e) => {
                    let delay = backoff.next_delay();
                    warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "cannot reach the broker; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = self.stop.cancelled() => break,
                    }
                    continue;
                }
            };
            backoff.reset();
            stats.broker_connected.set(1);
            info!("consuming");
            let mut publisher = PublishChannel(publisher);
            let end = self
                .consume(
                    (&conn, &consumer_channel),
                    &mut publisher,
                    consumers,
                    in_flight,
                )
                .await;
            for queue in &config.worker.queues {
                stats.consuming(queue, false);
            }
            let fatal = match end {
                SessionEnd::Lost => {
                    stats.broker_connected.set(0);
                    close(conn, "reconnecting").await;
                    continue;
                }
                SessionEnd::Stopping => None,
                SessionEnd::Fatal(refused) => Some(finishing_first(refused, in_flight.len())),
            };
            return Served {
                connection: Some((conn, publisher, consumer_channel)),
                fatal,
            };
        }
        Served::default()
    }

    /// Takes deliveries while the session lasts. Every consumer is always listened to, so the
    /// end of one is noticed at once whatever runs (docs/design.md#cancelled-consumers): its
    /// queue is declared again and re-subscribed while the others go on. A delivery is handed
    /// to the [`Processor`] once a slot is free (runs from an older connection still hold
    /// theirs), the pacer's pause is over and the Redis gate is open; until then it waits
    /// unacked, as it would in the consumer's buffer.
    async fn consume(
        &self,
        (conn, channel): (&Connection, &Channel),
        publisher: &mut PublishChannel,
        consumers: Vec<(String, Consumer)>,
        in_flight: &mut JoinSet<()>,
    ) -> SessionEnd {
        let acks = Acks::start(channel.clone());
        let mut merged = SelectAll::new();
        for (queue, consumer) in consumers {
            self.processor.stats.consuming(&queue, true);
            merged.push(events(queue, consumer));
        }
        let mut waiting: VecDeque<Delivery> = VecDeque::new();
        let mut resubscribing = FuturesUnordered::new();
        let mut held = false;
        let end = 'session: loop {
            let publishing = (conn, &mut *publisher);
            if let Err(end) = self
                .dispatch_waiting(publishing, &acks, (&mut waiting, &mut held), in_flight)
                .await
            {
                break 'session end;
            }
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => break SessionEnd::Stopping,
                _ = acks.stalled() => {
                    warn!("a delivery could not be settled within the settle timeout; starting a new session");
                    break SessionEnd::Lost;
                }
                Some(event) = merged.next(), if !merged.is_empty() => {
                    match self.on_event(event, channel, &mut waiting) {
                        Reaction::Go => {}
                        Reaction::Resubscribe(queue) => {
                            resubscribing.push(self.resubscribe((conn, channel), queue));
                        }
                        Reaction::End(end) => break end,
                    }
                }
                Some(resubscribed) = resubscribing.next() => {
                    if let Some(end) = self.on_resubscribed(resubscribed, &mut merged) {
                        break end;
                    }
                }
                slot = self.ready(), if !waiting.is_empty() => {
                    resumed(&mut held);
                    let delivery = waiting.pop_front().expect("a delivery waits");
                    if let Err(end) = self.dispatch((conn, &mut *publisher), &acks, (delivery, slot), in_flight).await {
                        break end;
                    }
                }
            }
        };
        if !matches!(end, SessionEnd::Lost) {
            self.hand_back(channel, &acks, merged, waiting).await;
        }
        end
    }

    /// The usual case without a wait: while a slot is free, no pause is on and Redis is up,
    /// the waiting deliveries go to the [`Processor`]. Says once when Redis holds them back
    /// (`held`), and once when it lets them go again.
    async fn dispatch_waiting(
        &self,
        (conn, publisher): (&Connection, &mut PublishChannel),
        acks: &Acks,
        (waiting, held): (&mut VecDeque<Delivery>, &mut bool),
        in_flight: &mut JoinSet<()>,
    ) -> Result<(), SessionEnd> {
        while in_flight.try_join_next().is_some() {}
        while !waiting.is_empty()
            && !self.stop.is_cancelled()
            && self.pacer.idle()
            && self.processor.gate.is_open()
        {
            let Ok(slot) = self.slots.clone().try_acquire_owned() else {
                break;
            };
            resumed(held);
            let delivery = waiting.pop_front().expect("a delivery waits");
            self.dispatch((conn, &mut *publisher), acks, (delivery, slot), in_flight)
                .await?;
        }
        if !*held && !waiting.is_empty() && !self.processor.gate.is_open() {
            error!("redis unreachable: holding deliveries until it answers again");
            *held = true;
        }
        Ok(())
    }

    /// What one consumer's event asks of the session: a delivery waits for its slot; a failed
    /// consumer or a closed channel ends the session; a consumer the broker cancelled on a
    /// live channel is re-subscribed while the others go on.
    fn on_event(
        &self,
        event: Event,
        channel: &Channel,
        waiting: &mut VecDeque<Delivery>,
    ) -> Reaction {
        match event {
            Event::Delivery(delivery) => {
                waiting.push_back(delivery);
                Reaction::Go
            }
            Event::Failed(queue, e) => {
                warn!(queue = %queue, error = %e, "consumer failed: broker connection or channel lost; reconnecting");
                Reaction::End(SessionEnd::Lost)
            }
            Event::Ended(queue) => {
                self.processor.stats.consuming(&queue, false);
                if !channel.status().connected() {
                    warn!(queue = %queue, "the consumer channel closed; reconnecting");
                    return Reaction::End(SessionEnd::Lost);
                }
                warn!(queue = %queue, "the broker cancelled this worker's consumer (queue deleted, leader moved or consumer timeout); declaring the queue again and re-subscribing");
                Reaction::Resubscribe(queue)
            }
        }
    }

    /// A queue declared again and consumed again joins the others; a queue that exists with
    /// other arguments ends the worker; any other failure, the session.
    fn on_resubscribed(
        &self,
        resubscribed: Result<(String, Consumer), SessionError>,
        merged: &mut SelectAll<BoxStream<'static, Event>>,
    ) -> Option<SessionEnd> {
        match resubscribed {
            Ok((queue, consumer)) => {
                info!(queue = %queue, "re-subscribed");
                self.processor.stats.consuming(&queue, true);
                merged.push(events(queue, consumer));
                None
            }
            Err(SessionError::Fatal(refused)) => Some(SessionEnd::Fatal(refused)),
            Err(e) => {
                warn!(error = %e, "cannot re-subscribe; reconnecting");
                Some(SessionEnd::Lost)
            }
        }
    }

    /// At the end of a session that keeps its connection (a stop, a fatal topology): stop
    /// consuming, then hand back what the consumers already sent (a reconnect would give it
    /// back anyway), bounded: other workers can take it during the drain.
    async fn hand_back(
        &self,
        channel: &Channel,
        acks: &Acks,
        mut merged: SelectAll<BoxStream<'static, Event>>,
        mut waiting: VecDeque<Delivery>,
    ) {
        let tags: Vec<String> = (self.processor.config.worker.queues.iter())
            .map(|queue| consumer_tag(&self.processor.worker_id, queue))
            .collect();
        cancel_consumers(channel, &tags).await;
        while let Some(Some(event)) = merged.next().now_or_never() {
            if let Event::Delivery(delivery) = event {
                waiting.push_back(delivery);
            }
        }
        let stats = &self.processor.stats;
        let handed_back = async {
            for delivery in waiting {
                requeue(acks.taken(&delivery), stats).await;
            }
        };
        let _ = tokio::time::timeout(SETTLE_TIMEOUT, handed_back).await;
    }

    /// Spawns the run of `delivery` to the [`Processor`], holding `slot` until it is settled;
    /// the session ends when no publisher channel can be had (the delivery requeued).
    async fn dispatch(
        &self,
        (conn, publisher): (&Connection, &mut PublishChannel),
        acks: &Acks,
        (delivery, slot): (Delivery, OwnedSemaphorePermit),
        in_flight: &mut JoinSet<()>,
    ) -> Result<(), SessionEnd> {
        let ticket = acks.taken(&delivery);
        let channel = match publisher.channel(conn).await {
            Ok(channel) => channel,
            Err(e) => {
                warn!(error = %e, "cannot reopen the publisher channel; reconnecting");
                requeue(ticket, &self.processor.stats).await;
                self.pacer.settled(Settled::BrokerTrouble);
                return Err(SessionEnd::Lost);
            }
        };
        let processor = self.current.get();
        let pacer = self.pacer.clone();
        in_flight.spawn(async move {
            let settled = processor.process(channel, delivery, ticket).await;
            pacer.settled(settled);
            drop(slot);
        });
        Ok(())
    }

    /// A free slot, once the pacer's pause is over and (fail closed) the Redis gate is open.
    /// Asked for only with a delivery in hand: a requeued delivery comes straight back, and
    /// must wait out the pause its own failure started.
    async fn ready(&self) -> OwnedSemaphorePermit {
        let slot = self.slots.clone().acquire_owned().await;
        self.pacer.wait().await;
        self.processor.gate.wait_open().await;
        slot.expect("the semaphore is never closed")
    }

    /// Declares `queue` again as at start (same arguments, on a channel of its own: a refused
    /// declare closes its channel) and consumes it again on `channel`, retrying every second
    /// at most while the declare fails; a declare refused for other arguments is fatal.
    async fn resubscribe(
        &self,
        (conn, channel): (&Connection, &Channel),
        queue: String,
    ) -> Result<(String, Consumer), SessionError> {
        let config = &self.processor.config;
        let mut backoff = REDECLARE;
        for attempt in 1u32.. {
            // With no other consumer left to tell of it, a lost connection shows here.
            if !conn.status().connected() || !channel.status().connected() {
                return Err(SessionError::Gone);
            }
            let declare = async {
                let side = conn.create_channel().await.map_err(BrokerError::from)?;
                broker::declare(
                    &side,
                    &self.processor.names,
                    std::slice::from_ref(&queue),
                    config.worker.dead_ttl,
                    config.broker.queue_type,
                )
                .await
                .map_err(|e| match e {
                    e @ BrokerError::Amqp(_) => SessionError::Amqp(e),
                    refused => SessionError::Fatal(refused),
                })
            };
            let declared = tokio::time::timeout(REDECLARE_TIMEOUT, declare)
                .await
                .unwrap_or(Err(SessionError::Timeout("declaring a queue again")));
            match declared {
                Ok(()) => break,
                Err(fatal @ SessionError::Fatal(_)) => return Err(fatal),
                // Once, then every tenth: the queue may stay locked (another connection's
                // exclusive queue) for long.
                Err(e) if attempt == 1 || attempt % 10 == 0 => {
                    warn!(queue = %queue, attempt, error = %e, "cannot declare the queue again; retrying");
                }
                Err(_) => {}
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
        let consumer = subscribe(
            channel,
            &self.processor.names,
            &queue,
            &self.processor.worker_id,
        );
        let consumer = tokio::time::timeout(REDECLARE_TIMEOUT, consumer)
            .await
            .map_err(|_| SessionError::Timeout("consuming a queue again"))??;
        Ok((queue, consumer))
    }
}

/// Cancels the session's consumers, bounded: the channel may be dead.
async fn cancel_consumers(channel: &Channel, tags: &[String]) {
    let cancel = async {
        for tag in tags {
            let _ = broker::cancel(channel, tag).await;
        }
    };
    if tokio::time::timeout(BROKER_CALL_TIMEOUT, cancel)
        .await
        .is_err()
    {
        warn!("the broker did not confirm the consumer cancel in time; stopping anyway");
    }
}

/// Hands a delivery back to the broker, bounded: on a dead channel it goes back anyway.
async fn requeue(ticket: Ticket, stats: &Stats) {
    if let Ok(Ok(())) = tokio::time::timeout(SETTLE_TIMEOUT, ticket.requeue()).await {
        stats.requeued.inc();
    }
}

/// Closes `conn`, bounded: a connection the broker dropped does not always answer.
async fn close(conn: Connection, why: &str) {
    if tokio::time::timeout(BROKER_CALL_TIMEOUT, conn.close(200, why.into()))
        .await
        .is_err()
    {
        warn!("the broker did not confirm the connection close in time");
    }
}

/// Lets in-flight runs finish for up to `shutdown_grace`, then cancels the rest and waits for
/// them to stop and settle; what is still stuck after that (a broker or Redis call that does
/// not answer) is dropped, its delivery unacked.
async fn drain(config: &Config, processor: &Processor, in_flight: &mut JoinSet<()>) {
    while in_flight.try_join_next().is_some() {}
    if in_flight.is_empty() {
        return;
    }
    info!(in_flight = in_flight.len(), grace = %humantime::format_duration(config.worker.shutdown_grace),
          "stopped consuming; letting in-flight tasks finish");
    if join_all(in_flight, config.worker.shutdown_grace).await {
        return;
    }
    warn!(
        abandoned = in_flight.len(),
        "shutdown grace exhausted; cancelling what still runs"
    );
    processor.abandon.cancel();
    let settled = async {
        // Cancelled handlers get up to ABANDON_WAIT to stop their tasks; once none runs, what
        // is left is settling, which gets SETTLE_TIMEOUT (it already had the whole grace).
        let mut idle_since: Option<Instant> = None;
        loop {
            if join_all(in_flight, Duration::from_millis(100)).await {
                return;
            }
            if processor.stats.running.get() > 0 {
                idle_since = None;
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= SETTLE_TIMEOUT {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(ABANDON_WAIT, settled).await;
    if in_flight.is_empty() {
        return;
    }
    warn!(
        stuck = in_flight.len(),
        "still not settled after cancellation; dropping them (the broker redelivers)"
    );
    in_flight.abort_all();
    let _ = join_all(in_flight, BROKER_CALL_TIMEOUT).await;
}

/// Joins every task in `set` within `within`; true when all ended.
async fn join_all(set: &mut JoinSet<()>, within: Duration) -> bool {
    let all = async { while set.join_next().await.is_some() {} };
    tokio::time::timeout(within, all).await.is_ok()
}

/// The session's confirm-mode publishing channel (retries, dead letters, woken waiters),
/// reopened when the broker closed it (a refused publish or declare closes the channel, not the
/// connection).
struct PublishChannel(Channel);

impl PublishChannel {
    /// A usable publishing channel on `conn`: the current one, or a fresh one if it was closed.
    async fn channel(&mut self, conn: &Connection) -> Result<Channel, SessionError> {
        if !self.0.status().connected() {
            warn!(status = ?self.0.status(), "the publisher channel was closed; reopening it");
            let open = broker::open_confirm_channel(conn);
            self.0 = tokio::time::timeout(BROKER_CALL_TIMEOUT, open)
                .await
                .map_err(|_| SessionError::Timeout("reopening the publisher channel"))??;
        }
        Ok(self.0.clone())
    }
}

/// Paces the consumer while the broker side keeps failing: each delivery requeued for a broker
/// error doubles the pause before the next delivery is taken (from [`BACKOFF_MIN`] up to
/// [`PACE_MAX`]); an ack resets it. Survives reconnects, so a failure that drops the connection
/// cannot turn into a reconnect loop either.
#[derive(Debug, Default)]
struct Pacer {
    state: Mutex<Pace>,
}

#[derive(Debug, Default)]
struct Pace {
    failures: u32,
    until: Option<Instant>,
}

impl Pacer {
    fn settled(&self, settled: Settled) {
        let mut pace = self.state.lock().expect("pacer lock poisoned");
        match settled {
            Settled::BrokerTrouble => {
                let pause = PACING.nth(pace.failures, 0.0);
                pace.failures = pace.failures.saturating_add(1);
                pace.until = Some(Instant::now() + pause);
                warn!(
                    failures = pace.failures,
                    pause_ms = pause.as_millis() as u64,
                    "the broker side keeps failing: pausing before the next delivery"
                );
            }
            Settled::Acked => *pace = Pace::default(),
            Settled::Requeued | Settled::Unsettled => {}
        }
    }

    /// True when no pause is in force.
    fn idle(&self) -> bool {
        let until = self.state.lock().expect("pacer lock poisoned").until;
        until.is_none_or(|t| t <= Instant::now())
    }

    /// Returns once no pause is in force.
    async fn wait(&self) {
        loop {
            let until = self.state.lock().expect("pacer lock poisoned").until;
            match until {
                Some(t) if t > Instant::now() => tokio::time::sleep_until(t).await,
                _ => return,
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum SessionError {
    /// The connection or a channel failed, or the broker refused a call: retried.
    #[error(transparent)]
    Amqp(BrokerError),
    #[error("the broker did not answer in time ({0})")]
    Timeout(&'static str),
    #[error("the connection or the consumer channel is gone")]
    Gone,
    /// A queue declared with other arguments: needs a human.
    #[error(transparent)]
    Fatal(BrokerError),
    /// A publish on the way (not produced by opening a session; retried like a lost channel).
    #[error(transparent)]
    Publish(BrokerError),
}

impl From<BrokerError> for SessionError {
    /// A refused declaration needs a human; anything else is retried.
    fn from(e: BrokerError) -> Self {
        match e {
            e @ BrokerError::Amqp(_) => SessionError::Amqp(e),
            BrokerError::Timeout { what } => SessionError::Timeout(what),
            e @ BrokerError::Mismatch { .. } => SessionError::Fatal(e),
            e => SessionError::Publish(e),
        }
    }
}

type Session = (Connection, Channel, Channel, Vec<(String, Consumer)>);

async fn open_session(
    config: &Config,
    (names, nodes): (&Names, &broker::Nodes),
    worker_id: &str,
) -> Result<Session, SessionError> {
    // After a lost connection, the other nodes first (`[broker] urls`); every call bounded, a
    // re-declaration not awaited (docs/design.md#reconnecting-past-a-hung-node).
    let what = broker::Declaration {
        names,
        queues: &config.worker.queues,
        dead_ttl: config.worker.dead_ttl,
        queue_type: config.broker.queue_type,
    };
    let (conn, publisher) = nodes.open_session(&what).await?;
    let channel = broker::bounded("channel.open", conn.create_channel()).await?;
    // Per consumer (global = false): quorum queues refuse a channel-wide prefetch (3.10 and 4.x
    // close the connection, 540 NOT_IMPLEMENTED, at basic.consume). Each queue's consumer may
    // hold `concurrency` unacked deliveries; the slots (the semaphore) bound what runs, so
    // with several queues the extra deliveries only wait, unacked, for a slot.
    let prefetch = config.worker.concurrency.min(u16::MAX as usize) as u16;
    broker::qos(&channel, prefetch).await?;
    let mut consumers = Vec::new();
    for queue in &config.worker.queues {
        let subscribed = subscribe(&channel, names, queue, worker_id);
        let consumer = broker::bounded("basic.consume", subscribed).await?;
        consumers.push((queue.clone(), consumer));
    }
    Ok((conn, publisher, channel, consumers))
}

/// This worker's consumer tag on `queue`: the same in every session and after a re-subscribe.
fn consumer_tag(worker_id: &str, queue: &str) -> String {
    format!("{worker_id}/{queue}")
}

/// Consumes `{ns}.q.{queue}` on `channel`.
async fn subscribe(
    channel: &Channel,
    names: &Names,
    queue: &str,
    worker_id: &str,
) -> Result<Consumer, BrokerError> {
    let tag = consumer_tag(worker_id, queue);
    broker::consume(channel, &names.work_queue(queue), &tag).await
}

async fn connect_redis(config: &Config, names: &Names) -> Store {
    let store = Store::connect_retrying(
        &config.redis_url,
        config.redis_ca_file.as_deref(),
        names.clone(),
        RECONNECT,
        |e| error!(error = %e, "redis unreachable at start; not consuming until it answers (fail closed)"),
    )
    .await
    .with_wait(config.redis_wait)
    .with_journal(config.journal);
    if let Some(advice) = store
        .replica_advice(config.redis_wait, &config.redis_url)
        .await
    {
        warn!(%advice, "redis replication");
    }
    store
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
    let host = drumline_shared::names::host_name();
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..6];
    format!("{host}:{}:{suffix}", std::process::id())
}
