//! Publishing with confirms: one message ([`publish_confirmed`]) or a whole batch sent before
//! its first confirm is awaited ([`publish_batch`], the beat's scheduled instances), with
//! `mandatory` returns charged to their own message; and an ack's answer as a `Result` ([`settled`]).

use super::{bounded, io_error, BrokerError};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation, Connection, PublisherConfirm};
use std::collections::HashSet;
use std::future::Future;
use std::time::Duration;

/// Longest wait for a batch's confirms: a broker that blocks publishers (a memory or disk
/// alarm) or hangs must not hold a publisher in one batch.
pub const CONFIRM_DEADLINE: Duration = Duration::from_secs(10);

/// Publishes on a confirm-mode channel and waits for the broker's confirm. With `mandatory`, an
/// unroutable message is an error. (On a channel shared by concurrent publishers lapin may
/// attach a returned message to another publish's confirm; callers that publish concurrently
/// either route to queues they just declared without `mandatory`, or match returns by message
/// id as the beat's batch publisher does.)
pub async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    mandatory: bool,
    body: &[u8],
    props: BasicProperties,
) -> Result<(), BrokerError> {
    let options = BasicPublishOptions {
        mandatory,
        ..Default::default()
    };
    let confirmation = channel
        .basic_publish(exchange.into(), routing_key.into(), options, body, props)
        .await?
        .await?;
    match confirmation {
        Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
        Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)) => {
            Err(BrokerError::Unroutable(routing_key.to_owned()))
        }
        Confirmation::Nack(None) => Err(BrokerError::Nacked),
    }
}

/// A confirm-mode channel on `conn`, every call bounded by the connect timeout.
pub async fn open_confirm_channel(conn: &Connection) -> Result<Channel, BrokerError> {
    let channel = bounded("channel.open", conn.create_channel()).await?;
    let select = channel.confirm_select(ConfirmSelectOptions::default());
    bounded("confirm.select", select).await?;
    Ok(channel)
}

/// One message of a batch: published `mandatory` by `routing_key`; its properties' message id
/// matches a returned message to it.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// The routing key (for the beat: the logical queue).
    pub routing_key: String,
    /// The body.
    pub body: Vec<u8>,
    /// Its properties, with a message id.
    pub properties: BasicProperties,
}

/// Publishes every message of `batch` to `exchange`, `mandatory`, all sent before the first
/// confirm is awaited (each message is made only when its turn comes, so none is built after
/// the sending stops), then awaits the confirms in order, for at most [`CONFIRM_DEADLINE`] in
/// all. Returns one outcome per message, in `batch` order; those after a failed send were not
/// sent and carry its error.
///
/// `may_send` is asked before each message is handed to the client: once it says no, the rest
/// fail with [`BrokerError::Withdrawn`] unsent.
pub async fn publish_batch(
    channel: &Channel,
    exchange: &str,
    batch: impl ExactSizeIterator<Item = Outgoing>,
    may_send: impl FnMut() -> bool,
) -> Vec<Result<(), BrokerError>> {
    let mut returned = HashSet::new();
    send_batch(channel, exchange, batch, may_send)
        .await
        .confirms(&mut returned, [])
        .await
}

/// A batch sent ([`send_batch`]) whose confirms have not all been read: the beat sends the
/// next batch before it reads them ([`Sending::confirms`]).
pub struct Sending {
    pending: Vec<Pending>,
    send_failure: Option<BrokerError>,
    total: usize,
}

/// Sends every message of `batch` (as [`publish_batch`] does) and returns without awaiting a
/// confirm.
pub async fn send_batch(
    channel: &Channel,
    exchange: &str,
    batch: impl ExactSizeIterator<Item = Outgoing>,
    mut may_send: impl FnMut() -> bool,
) -> Sending {
    let options = BasicPublishOptions {
        mandatory: true,
        ..Default::default()
    };
    let total = batch.len();
    let mut pending = Vec::with_capacity(total);
    let mut send_failure = None;
    for message in batch {
        if !may_send() {
            send_failure = Some(BrokerError::Withdrawn);
            break;
        }
        let id = message.properties.message_id().clone();
        let exchange = exchange.into();
        let routing_key = message.routing_key.as_str().into();
        let body = &message.body;
        match channel
            .basic_publish(exchange, routing_key, options, body, message.properties)
            .await
        {
            Ok(confirm) => pending.push(Pending {
                routing_key: message.routing_key,
                id,
                confirm: Confirm::Waiting(confirm),
            }),
            Err(e) => {
                // The channel is gone: nothing after this goes out either.
                send_failure = Some(BrokerError::Amqp(e));
                break;
            }
        }
    }
    Sending {
        pending,
        send_failure,
        total,
    }
}

impl Sending {
    /// Awaits this batch's confirms in order, for at most [`CONFIRM_DEADLINE`]: one outcome per
    /// message, in batch order (those after a failed send carry its error).
    ///
    /// The broker returns an unroutable (`mandatory`) message before it confirms it, but lapin
    /// hands the returned message to whichever confirm completes next — with a `multiple` ack,
    /// possibly another message's, and with `later` batches sent meanwhile, possibly one of
    /// theirs, or this batch's carrying one of an earlier batch's. So returns are matched by
    /// message id through `returned`, shared by the batches in flight, and once every confirm
    /// of this batch is in, the confirms of `later` that are in too are read now (the carrier
    /// of a return of ours completed no later than our own confirm), their outcomes kept for
    /// their turn.
    pub async fn confirms<'a>(
        mut self,
        returned: &mut HashSet<String>,
        later: impl IntoIterator<Item = &'a mut Sending>,
    ) -> Vec<Result<(), BrokerError>> {
        let mut outcomes = Vec::with_capacity(self.total);
        let deadline = tokio::time::Instant::now() + CONFIRM_DEADLINE;
        for pending in &mut self.pending {
            let confirmation = match std::mem::replace(&mut pending.confirm, Confirm::Taken) {
                Confirm::Waiting(confirm) => tokio::time::timeout_at(deadline, confirm)
                    .await
                    .map_err(|_| BrokerError::Unconfirmed)
                    .and_then(|c| c.map_err(BrokerError::Amqp)),
                Confirm::Done(done) => *done,
                Confirm::Taken => Err(BrokerError::Unconfirmed),
            };
            outcomes.push(read_confirmation(
                confirmation,
                &pending.routing_key,
                returned,
            ));
        }
        for later in later {
            later.read_ready(returned);
        }
        for (pending, outcome) in self.pending.iter().zip(&mut outcomes) {
            if pending
                .id
                .as_ref()
                .is_some_and(|id| returned.contains(id.as_str()))
            {
                *outcome = Err(BrokerError::Unroutable(pending.routing_key.clone()));
            }
        }
        if let Some(e) = self.send_failure {
            // What stopped the sending stands for every message it kept back.
            outcomes.resize_with(self.total, || Err(e.for_the_rest()));
        }
        outcomes
    }

    /// Reads every confirm of this batch that is already in, noting the returns they carry.
    fn read_ready(&mut self, returned: &mut HashSet<String>) {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        for pending in &mut self.pending {
            if let Confirm::Waiting(confirm) = &mut pending.confirm {
                if let std::task::Poll::Ready(result) = std::pin::Pin::new(confirm).poll(&mut cx) {
                    let result = result.map_err(BrokerError::Amqp);
                    // Noted now; the outcome itself is read again in this batch's turn.
                    if let Ok(Confirmation::Ack(Some(m)) | Confirmation::Nack(Some(m))) = &result {
                        if let Some(id) = m.properties.message_id() {
                            returned.insert(id.to_string());
                        }
                    }
                    pending.confirm = Confirm::Done(Box::new(result));
                }
            }
        }
    }
}

/// One confirm's outcome for its own message, noting the return it carried in `returned`.
fn read_confirmation(
    confirmation: Result<Confirmation, BrokerError>,
    routing_key: &str,
    returned: &mut HashSet<String>,
) -> Result<(), BrokerError> {
    match carried_return(confirmation?) {
        Carried::Nothing(outcome) => outcome,
        Carried::Return(id, outcome) => {
            returned.insert(id);
            outcome
        }
        // No id to match: charged to the message that carried it.
        Carried::Anonymous => Err(BrokerError::Unroutable(routing_key.to_owned())),
    }
}

/// A message sent and not confirmed yet: its routing key, its message id, its confirm.
struct Pending {
    routing_key: String,
    id: Option<ShortString>,
    confirm: Confirm,
}

/// A confirm not read yet, or read ahead of its batch's turn ([`Sending::read_ready`]).
enum Confirm {
    Waiting(PublisherConfirm),
    Done(Box<Result<Confirmation, BrokerError>>),
    Taken,
}

/// What one confirm said, and the returned message it carried, if any.
enum Carried {
    /// No returned message: the confirm's own outcome.
    Nothing(Result<(), BrokerError>),
    /// A returned message with this id; the confirm's own outcome.
    Return(String, Result<(), BrokerError>),
    /// A returned message without an id.
    Anonymous,
}

fn carried_return(confirmation: Confirmation) -> Carried {
    match confirmation {
        Confirmation::Ack(None) | Confirmation::NotRequested => Carried::Nothing(Ok(())),
        Confirmation::Nack(None) => Carried::Nothing(Err(BrokerError::Nacked)),
        carrier @ (Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_))) => {
            let own = if carrier.is_ack() {
                Ok(())
            } else {
                Err(BrokerError::Nacked)
            };
            match carrier
                .take_message()
                .and_then(|m| m.properties.message_id().clone())
            {
                Some(id) => Carried::Return(id.to_string(), own),
                None => Carried::Anonymous,
            }
        }
    }
}

/// An ack, nack or reject's answer from lapin as a `Result`: lapin 4 answers `Ok(false)`, not
/// an error, when it did not send it (the delivery's channel is closed, or the delivery was
/// already settled); the broker then redelivers the message, so for the caller it failed.
pub(crate) fn settled(sent: Result<bool, lapin::Error>) -> Result<(), lapin::Error> {
    match sent {
        Ok(true) => Ok(()),
        Ok(false) => Err(io_error(
            "not sent: the delivery's channel is closed or the delivery was already settled",
        )),
        Err(e) => Err(e),
    }
}
