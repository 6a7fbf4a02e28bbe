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
//! the run. A delivery dropped without an outcome (its run aborted at shutdown) stays `taken`
//! for good: no `multiple` ack ever covers it, and the broker redelivers it when the channel
//! closes. A requeue is sent alone by its [`Ticket`], then marked done.

use drumline_shared::topology;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::Acker;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, oneshot};

/// The acks of one consumer channel; one per broker session. Taking and requeueing update the
/// table in place; only an ack wakes the batcher.
#[derive(Clone)]
pub(crate) struct Acks {
    table: Arc<Mutex<Table<Acker, Reply>>>,
    tx: mpsc::UnboundedSender<(u64, Acker, Reply)>,
}

/// A taken delivery's right to be settled once: [`Ticket::ack`] or [`Ticket::requeue`].
pub(crate) struct Ticket {
    tag: u64,
    acker: Acker,
    acks: Acks,
}

/// Who waits for an ack frame to be sent.
type Reply = oneshot::Sender<Result<(), lapin::Error>>;

/// What the table hears about a tag; `A` acks it (an [`Acker`]), `R` waits for that.
enum Request<A, R> {
    Taken(u64),
    Ack(u64, A, R),
    Requeued(u64),
}

enum Entry<A, R> {
    /// Taken; no outcome yet.
    Taken,
    /// Outcome recorded; the ack is asked for.
    Ready(A, R),
    /// Settled alone (acked out of order, or requeued).
    Done,
}

impl Acks {
    /// Starts the batcher; it ends when the last [`Acks`] and [`Ticket`] are gone.
    pub(crate) fn start() -> Acks {
        let (tx, rx) = mpsc::unbounded_channel();
        let table = Arc::new(Mutex::new(Table::default()));
        tokio::spawn(batch(table.clone(), rx));
        Acks { table, tx }
    }

    fn apply(&self, request: Request<Acker, Reply>) {
        self.table.lock().expect("ack table lock").apply(request);
    }

    /// Registers `delivery` as taken, before anything else can settle it.
    pub(crate) fn taken(&self, delivery: &Delivery) -> Ticket {
        self.apply(Request::Taken(delivery.delivery_tag));
        Ticket {
            tag: delivery.delivery_tag,
            acker: delivery.acker.clone(),
            acks: self.clone(),
        }
    }
}

impl Ticket {
    /// Acks the delivery, possibly together with others; returns once the frame is sent.
    pub(crate) async fn ack(self) -> Result<(), lapin::Error> {
        let (done, result) = oneshot::channel();
        if self
            .acks
            .tx
            .send((self.tag, self.acker.clone(), done))
            .is_err()
        {
            // The batcher is gone (it never is while a ticket lives); ack alone.
            return topology::settled(self.acker.ack(BasicAckOptions::default()).await);
        }
        // The batcher drops the reply only when it stops, with the channel.
        let gone = lapin::Error::from(lapin::ErrorKind::InvalidChannelState(
            lapin::ChannelState::Closed,
            "the ack batcher stopped with its channel",
        ));
        result.await.unwrap_or(Err(gone))
    }

    /// Hands the delivery back to the broker, alone.
    pub(crate) async fn requeue(self) -> Result<(), lapin::Error> {
        let requeue = BasicNackOptions {
            requeue: true,
            ..Default::default()
        };
        topology::settled(self.acker.nack(requeue).await)?;
        self.acks.apply(Request::Requeued(self.tag));
        Ok(())
    }
}

/// The batcher: waits for an ack request, takes every other one waiting, then acks.
async fn batch(
    table: Arc<Mutex<Table<Acker, Reply>>>,
    mut rx: mpsc::UnboundedReceiver<(u64, Acker, Reply)>,
) {
    let mut requests = Vec::new();
    while rx.recv_many(&mut requests, usize::MAX).await > 0 {
        let sends = {
            let mut table = table.lock().expect("ack table lock");
            for (tag, acker, done) in requests.drain(..) {
                table.apply(Request::Ack(tag, acker, done));
            }
            table.acks()
        };
        for (acker, options, waiting) in sends {
            let result = topology::settled(acker.ack(options).await);
            for done in waiting {
                let _ = done.send(result.clone());
            }
        }
    }
}

/// The tags above `floor` and what is known of each.
struct Table<A, R> {
    floor: u64,
    entries: BTreeMap<u64, Entry<A, R>>,
}

impl<A, R> Default for Table<A, R> {
    fn default() -> Self {
        Table {
            floor: 0,
            entries: BTreeMap::new(),
        }
    }
}

/// One ack frame to send: by `A`, with these options, answering these `R`s.
type Pending<A, R> = (A, BasicAckOptions, Vec<R>);

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
                self.entries.insert(tag, Entry::Done);
            }
        }
    }

    /// The acks to send now: one `multiple` ack for the ready run just above `floor` (which
    /// then moves up), and one ack for each other ready tag.
    fn acks(&mut self) -> Vec<Pending<A, R>> {
        let mut out = Vec::new();
        let (mut last, mut waiting) = (None, Vec::new());
        loop {
            let next = self.floor + 1;
            match self.entries.remove(&next) {
                Some(Entry::Ready(acker, done)) => {
                    last = Some(acker);
                    waiting.push(done);
                }
                Some(Entry::Done) => {}
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
            out.push((acker, BasicAckOptions { multiple }, waiting));
        }
        for entry in self.entries.values_mut() {
            if matches!(entry, Entry::Ready(..)) {
                let Entry::Ready(acker, done) = std::mem::replace(entry, Entry::Done) else {
                    unreachable!("just matched")
                };
                out.push((acker, BasicAckOptions::default(), vec![done]));
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
        table
            .acks()
            .into_iter()
            .map(|(tag, options, answered)| (tag, options.multiple, answered))
            .collect()
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
}
