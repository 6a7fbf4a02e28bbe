//! Acks for one consumer channel, coalesced into `basic.ack` with `multiple` (issue 11).
//!
//! Delivery tags on a channel start at 1 and grow by one per delivery, whichever of the
//! channel's consumers gets it. An ack with `multiple` on tag T settles *every* unacked
//! delivery up to T, so one may only be sent when each of those has an outcome that is
//! already recorded. The batcher keeps `floor`, the highest tag below which every delivery is
//! settled, and a table of the tags above it:
//!
//! ```text
//!   floor ─┐  taken (running)   ready (recorded, ack asked)   done (acked or requeued alone)
//!          ▼
//!   …  7 │ 8 ready │ 9 ready │ 10 taken │ 11 ready │ (12 not taken yet: still in a consumer's buffer)
//!          └─ one ack, tag 9, multiple ─┘             └─ acked alone
//! ```
//!
//! Each pass takes every request waiting, acks the run of ready tags just above `floor` with
//! one frame and acks any other ready tag alone, so an ack never waits for a slower delivery.
//! A tag the batcher has not seen taken (a delivery still buffered for another consumer) stops
//! the run. A requeue is sent alone by its [`Ticket`], then marked done.
//!
//! The bookkeeping is bounded (docs/design.md#acks). Done tags are kept as runs (`from..=to`),
//! so behind a delivery that runs for hours the table holds about one entry per delivery in
//! flight or buffered, not one per delivery acked since. And a delivery is never left unsettled
//! for the rest of the session: a [`Ticket`] dropped before its ack or requeue went out (its
//! settle cut off by the settle timeout, refused, or its run dropped) stalls the channel: the
//! batcher closes it, so the broker redelivers every delivery not acked on it (dedupe absorbs
//! the ones whose outcome is recorded), and `Acks::stalled` tells the consumer to start a new
//! session.

use drumline_shared::broker::{Acker, BrokerError, Channel, Delivery};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// How long one ack or requeue may take before the delivery is left to the broker.
pub(crate) const SETTLE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a broker call on the shutdown or reconnect path may take (cancel the consumers,
/// reopen a channel, close the connection); a dead connection does not always answer.
pub(crate) const BROKER_CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// How `Processor::process` settled a delivery; the consumer paces itself by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// Acked.
    Acked,
    /// Requeued for a reason that is not the broker's (Redis, a lost lease, shutdown).
    Requeued,
    /// Requeued because the broker side failed: a publish, a declare, a closed channel.
    BrokerTrouble,
    /// Not settled (the channel is gone, or did not answer in time); the broker redelivers.
    Unsettled,
}

/// The acks of one consumer channel; one per broker session. Taking and requeueing update the
/// table in place; only an ack wakes the batcher.
#[derive(Clone)]
pub struct Acks {
    table: Arc<Mutex<Table<Acker, Reply>>>,
    tx: mpsc::UnboundedSender<(u64, Acker, Reply)>,
    /// Cancelled when a delivery could not be settled: the channel is closed.
    stalled: CancellationToken,
}

/// A taken delivery's right to be settled once: [`Ticket::ack`] or [`Ticket::requeue`].
/// Dropped without either having gone out, it stalls the channel (`Acks::stalled`).
pub struct Ticket {
    tag: u64,
    acker: Acker,
    acks: Acks,
    settled: bool,
}

/// Who waits for an ack frame to be sent.
type Reply = oneshot::Sender<Result<(), BrokerError>>;

/// What the table hears about a tag; `A` acks it (an [`Acker`]), `R` waits for that.
enum Request<A, R> {
    Taken(u64),
    Ack(u64, A, R),
    Requeued(u64),
}

/// A tag above the floor that is not settled yet.
enum Entry<A, R> {
    /// Taken; no outcome yet.
    Taken,
    /// Outcome recorded; the ack is asked for.
    Ready(A, R),
}

impl Acks {
    /// Starts the batcher of `channel`'s acks; it ends when the last [`Acks`] and [`Ticket`]
    /// are gone, or once it closed the stalled channel.
    pub fn start(channel: Channel) -> Acks {
        let (tx, rx) = mpsc::unbounded_channel();
        let table = Arc::new(Mutex::new(Table::default()));
        let stalled = CancellationToken::new();
        tokio::spawn(batch(table.clone(), rx, (channel, stalled.clone())));
        Acks { table, tx, stalled }
    }

    fn apply(&self, request: Request<Acker, Reply>) {
        self.table.lock().expect("ack table lock").apply(request);
    }

    /// Registers `delivery` as taken, before anything else can settle it.
    pub fn taken(&self, delivery: &Delivery) -> Ticket {
        self.apply(Request::Taken(delivery.tag));
        Ticket {
            tag: delivery.tag,
            acker: delivery.acker.clone(),
            acks: self.clone(),
            settled: false,
        }
    }

    /// Completes once a delivery of the channel could not be settled; the channel is then
    /// being closed, and its session must be replaced.
    pub(crate) async fn stalled(&self) {
        self.stalled.cancelled().await
    }
}

impl Ticket {
    /// Acks the delivery, possibly together with others; returns once the frame is sent.
    pub async fn ack(mut self) -> Result<(), BrokerError> {
        let (done, result) = oneshot::channel();
        let result = if self
            .acks
            .tx
            .send((self.tag, self.acker.clone(), done))
            .is_err()
        {
            // The batcher is gone (the channel stalled); ack alone.
            self.acker.ack(false).await
        } else {
            // The batcher drops the reply only when it stops, with the channel.
            let gone = BrokerError::channel_closed("the ack batcher stopped with its channel");
            result.await.unwrap_or(Err(gone))
        };
        self.settled = result.is_ok();
        result
    }

    /// Hands the delivery back to the broker, alone.
    pub async fn requeue(mut self) -> Result<(), BrokerError> {
        self.acker.requeue().await?;
        self.acks.apply(Request::Requeued(self.tag));
        self.settled = true;
        Ok(())
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.settled {
            self.acks.stalled.cancel();
        }
    }
}

/// The batcher: waits for an ack request, takes every other one waiting, then acks; closes
/// the channel once it stalled.
async fn batch(
    table: Arc<Mutex<Table<Acker, Reply>>>,
    mut rx: mpsc::UnboundedReceiver<(u64, Acker, Reply)>,
    (channel, stalled): (Channel, CancellationToken),
) {
    let mut requests = Vec::new();
    loop {
        let received = tokio::select! {
            biased;
            _ = stalled.cancelled() => break,
            n = rx.recv_many(&mut requests, usize::MAX) => n,
        };
        if received == 0 {
            return;
        }
        let sends = {
            let mut table = table.lock().expect("ack table lock");
            for (tag, acker, done) in requests.drain(..) {
                table.apply(Request::Ack(tag, acker, done));
            }
            table.acks()
        };
        for (acker, multiple, waiting) in sends {
            let result = acker.ack(multiple).await;
            for done in waiting {
                let _ = done.send(result.clone());
            }
        }
    }
    // A channel the broker or a reconnect already closed has given its deliveries back.
    if channel.status().connected() {
        warn!(
            channel = channel.id(),
            "a delivery could not be settled in time: closing its channel, so that the broker \
             redelivers every delivery not acked on it"
        );
        let close = channel.close(200, "a delivery could not be settled".into());
        let _ = tokio::time::timeout(BROKER_CALL_TIMEOUT, close).await;
    }
}

/// The tags above `floor` and what is known of each: the unsettled ones in `entries`, the
/// ones settled alone as runs in `done` (first tag → last tag).
struct Table<A, R> {
    floor: u64,
    entries: BTreeMap<u64, Entry<A, R>>,
    done: BTreeMap<u64, u64>,
}

impl<A, R> Default for Table<A, R> {
    fn default() -> Self {
        Table {
            floor: 0,
            entries: BTreeMap::new(),
            done: BTreeMap::new(),
        }
    }
}

/// One ack frame to send: by `A`, `multiple` or not, answering these `R`s.
type Pending<A, R> = (A, bool, Vec<R>);

impl<A, R> Table<A, R> {
    fn apply(&mut self, request: Request<A, R>) {
        match request {
            Request::Taken(tag) => {
                self.entries.insert(tag, Entry::Taken);
            }
            Request::Ack(tag, acker, done) => {
                self.entries.insert(tag, Entry::Ready(acker, done));
            }
            Request::Requeued(tag) => {
                self.entries.remove(&tag);
                self.settled_alone(tag);
            }
        }
    }

    /// Adds `tag` to the done runs, joining the run that ends just below it and the one that
    /// starts just above it.
    fn settled_alone(&mut self, tag: u64) {
        let mut from = tag;
        if let Some((&start, &end)) = self.done.range(..tag).next_back() {
            if end + 1 == tag {
                from = start;
            }
        }
        let to = self.done.remove(&(tag + 1)).unwrap_or(tag);
        self.done.insert(from, to);
    }

    /// The acks to send now: one `multiple` ack for the ready run just above `floor` (which
    /// then moves up, over the done runs too), and one ack for each other ready tag.
    fn acks(&mut self) -> Vec<Pending<A, R>> {
        let mut out = Vec::new();
        let (mut last, mut waiting) = (None, Vec::new());
        loop {
            let next = self.floor + 1;
            if let Some(to) = self.done.remove(&next) {
                self.floor = to;
                continue;
            }
            match self.entries.remove(&next) {
                Some(Entry::Ready(acker, done)) => {
                    last = Some(acker);
                    waiting.push(done);
                }
                Some(taken @ Entry::Taken) => {
                    self.entries.insert(next, taken);
                    break;
                }
                None => break,
            }
            self.floor = next;
        }
        if let Some(acker) = last {
            // The run is acked by its last ready tag; `multiple` once it holds more than one.
            let multiple = waiting.len() > 1;
            out.push((acker, multiple, waiting));
        }
        let ready: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, entry)| matches!(entry, Entry::Ready(..)))
            .map(|(&tag, _)| tag)
            .collect();
        for tag in ready {
            if let Some(Entry::Ready(acker, done)) = self.entries.remove(&tag) {
                self.settled_alone(tag);
                out.push((acker, false, vec![done]));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table fed `requests` (acks by their own tag, answering their own tag), then asked
    /// what to send: (ack tag, multiple, tags answered).
    fn sends(
        table: &mut Table<u64, u64>,
        requests: Vec<Request<u64, u64>>,
    ) -> Vec<(u64, bool, Vec<u64>)> {
        for r in requests {
            table.apply(r);
        }
        table.acks()
    }

    fn ack(tag: u64) -> Request<u64, u64> {
        Request::Ack(tag, tag, tag)
    }

    #[test]
    fn a_ready_run_from_the_floor_is_one_multiple_ack() {
        let mut t = Table::default();
        let taken = (1..=4).map(Request::Taken).collect();
        assert_eq!(sends(&mut t, taken), vec![]);
        assert_eq!(
            sends(&mut t, vec![ack(2), ack(1), ack(3)]),
            vec![(3, true, vec![1, 2, 3])]
        );
        assert_eq!(t.floor, 3);
        assert_eq!(sends(&mut t, vec![ack(4)]), vec![(4, false, vec![4])]);
    }

    #[test]
    fn a_running_delivery_is_never_covered_and_does_not_hold_back_others() {
        let mut t = Table::default();
        let mut requests: Vec<_> = (1..=4).map(Request::Taken).collect();
        requests.extend([ack(1), ack(3), ack(4)]);
        // 2 still runs: 1 alone as the run, 3 and 4 each alone, never `multiple` over 2.
        assert_eq!(
            sends(&mut t, requests),
            vec![
                (1, false, vec![1]),
                (3, false, vec![3]),
                (4, false, vec![4])
            ]
        );
        // 2 finishes: the floor moves past the ones already acked.
        assert_eq!(sends(&mut t, vec![ack(2)]), vec![(2, false, vec![2])]);
        assert_eq!(t.floor, 4);
        assert!(t.entries.is_empty());
    }

    #[test]
    fn a_tag_not_taken_yet_stops_the_run() {
        // 2 is still buffered for another consumer on the channel: `multiple` on 3 would ack it.
        let mut t = Table::default();
        let requests = vec![Request::Taken(1), Request::Taken(3), ack(1), ack(3)];
        assert_eq!(
            sends(&mut t, requests),
            vec![(1, false, vec![1]), (3, false, vec![3])]
        );
        assert_eq!(t.floor, 1);
    }

    #[test]
    fn requeued_tags_are_passed_over_and_an_abandoned_one_is_a_barrier() {
        let mut t = Table::default();
        let mut requests: Vec<_> = (1..=6).map(Request::Taken).collect();
        // 2 requeued; 4 dropped without an outcome (stays taken).
        requests.extend([ack(1), Request::Requeued(2), ack(3), ack(5), ack(6)]);
        assert_eq!(
            sends(&mut t, requests),
            vec![
                (3, true, vec![1, 3]),
                (5, false, vec![5]),
                (6, false, vec![6])
            ]
        );
        assert_eq!(t.floor, 3);
        t.apply(Request::Taken(7));
        assert_eq!(sends(&mut t, vec![ack(7)]), vec![(7, false, vec![7])]);
        assert_eq!(t.floor, 3, "nothing is ever acked with `multiple` past 4");
    }
    /// Entries the table holds (its bookkeeping).
    fn held(t: &Table<u64, u64>) -> usize {
        t.entries.len() + t.done.len()
    }

    #[test]
    fn the_table_stays_small_behind_a_delivery_that_runs_long() {
        // 1 runs for as long as 10,000 others are taken and acked alone behind it.
        let mut t = Table::default();
        t.apply(Request::Taken(1));
        for tag in 2..=10_001 {
            t.apply(Request::Taken(tag));
            assert_eq!(sends(&mut t, vec![ack(tag)]), vec![(tag, false, vec![tag])]);
        }
        assert!(
            held(&t) <= 2,
            "{} tags held behind one running delivery",
            held(&t)
        );
        // 1 ends: the floor moves past every tag acked alone, with one frame for 1 alone.
        assert_eq!(sends(&mut t, vec![ack(1)]), vec![(1, false, vec![1])]);
        assert_eq!((t.floor, held(&t)), (10_001, 0));
        t.apply(Request::Taken(10_002));
        t.apply(Request::Taken(10_003));
        assert_eq!(
            sends(&mut t, vec![ack(10_002), ack(10_003)]),
            vec![(10_003, true, vec![10_002, 10_003])],
            "coalescing resumes from the floor"
        );
    }

    #[test]
    fn requeued_tags_merge_into_runs_the_floor_passes() {
        let mut t = Table::default();
        let mut requests: Vec<_> = (1..=6).map(Request::Taken).collect();
        requests.extend([
            Request::Requeued(3),
            Request::Requeued(5),
            Request::Requeued(4),
        ]);
        assert_eq!(sends(&mut t, requests), vec![]);
        assert!(held(&t) <= 4, "3, 4 and 5 are one run: {} held", held(&t));
        assert_eq!(
            sends(&mut t, vec![ack(2), ack(1), ack(6)]),
            vec![(6, true, vec![1, 2, 6])]
        );
        assert_eq!((t.floor, held(&t)), (6, 0));
    }
}
