//! A holder's writes that arrive together go to Redis as one script call
//! (docs/design.md#batched-writes): the claim, renewal and ending scripts (CLAIM, RENEW,
//! FINISH, RETRY, RELEASE) are each also a Lua function of one script, BATCH, which runs a list
//! of calls in order and answers each on its own. A store made with
//! [`Store::batching`] hands its holder's calls to one task, which takes every call waiting
//! when it is free (never waiting for a late one), sends them as one call (or alone, as their
//! own script, when only one waits) and answers each caller. Each call does exactly what it
//! does alone — the same keys, checks, fences and journal entries, in arrival order — and an
//! error in one (Redis refused a command) is that call's, not its neighbours'.

use super::{
    standalone, Store, StoreError, CLAIM_LUA, FINISH_LUA, RELEASE_LUA, RENEW_LUA, RETRY_LUA,
};
use redis::{Script, ScriptInvocation, ToRedisArgs, Value};
use std::sync::{Arc, LazyLock};
use tokio::sync::{mpsc, oneshot};

/// Most calls in one batch; more waiting go in the next.
pub const MOST_CALLS: usize = 128;

/// The holder's scripts, which one batch may mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Claim,
    Renew,
    Finish,
    Retry,
    Release,
}

impl Kind {
    const ALL: [Kind; 5] = [
        Kind::Claim,
        Kind::Renew,
        Kind::Finish,
        Kind::Retry,
        Kind::Release,
    ];

    /// The kind's number in BATCH's table of functions (from 1, as Lua counts).
    fn number(self) -> usize {
        Kind::ALL.iter().position(|k| *k == self).unwrap_or(0) + 1
    }

    fn text(self) -> &'static str {
        match self {
            Kind::Claim => &CLAIM_LUA,
            Kind::Renew => &RENEW_LUA,
            Kind::Finish => &FINISH_LUA,
            Kind::Retry => &RETRY_LUA,
            Kind::Release => &RELEASE_LUA,
        }
    }

    /// The kind's own script, sent when a call goes alone.
    pub(crate) fn script(self) -> &'static Script {
        static SCRIPTS: LazyLock<Vec<Script>> = LazyLock::new(|| {
            Kind::ALL
                .iter()
                .map(|k| Script::new(&standalone(k.text())))
                .collect()
        });
        &SCRIPTS[self.number() - 1]
    }
}

// BATCH
// KEYS   -> every call's KEYS, one call after another
// ARGV[1] -> how many calls; then per call: its kind's number (Kind::number), how many KEYS and
//            how many ARGV it has, and its ARGV
// Output: per call {1, its reply} or {0, the error Redis raised in it}.
// Each kind's script is the body of a function whose parameters are named KEYS and ARGV, so the
// script (and the helpers it defines, which see them as upvalues) reads that call's own; `NOW`
// (the clock, CLOCK in lib.rs) is the batch's, read by the first call that asks.
static BATCH: LazyLock<Script> = LazyLock::new(|| {
    let mut text = String::from("local NOW = false\nlocal run = {}\n");
    for kind in Kind::ALL {
        text.push_str(&format!(
            "run[{}] = function(KEYS, ARGV)\n{}\nend\n",
            kind.number(),
            kind.text()
        ));
    }
    text.push_str(
        r#"
local out, k, a = {}, 0, 1
for i = 1, tonumber(ARGV[1]) do
  local kind, nk, na = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  a = a + 3
  local keys, argv = {}, {}
  for j = 1, nk do keys[j] = KEYS[k + j] end
  for j = 1, na do argv[j] = ARGV[a + j] end
  k, a = k + nk, a + na
  local ok, reply = pcall(run[kind], keys, argv)
  if ok then
    out[i] = {1, reply}
  elseif type(reply) == 'table' and reply.err then
    out[i] = {0, reply.err}
  else
    out[i] = {0, tostring(reply)}
  end
end
return out
"#,
    );
    Script::new(&text)
});

/// One call of a holder's script: its KEYS and ARGV as [`ScriptInvocation`] would send them.
#[derive(Debug)]
pub(crate) struct Call {
    pub(crate) kind: Kind,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Call {
    pub(crate) fn new(kind: Kind) -> Self {
        Call {
            kind,
            keys: Vec::new(),
            args: Vec::new(),
        }
    }

    /// The call alone, as its kind's own script.
    pub(crate) fn invocation(&self) -> ScriptInvocation<'static> {
        let mut call = self.kind.script().prepare_invoke();
        for key in &self.keys {
            call.key(key.as_slice());
        }
        for arg in &self.args {
            call.arg(arg.as_slice());
        }
        call
    }
}

/// What a script call is built of: KEYS and ARGV, in order. Both [`ScriptInvocation`] and a
/// batched [`Call`] are, so the parts every script shares (the journal's tail) are added once.
pub(crate) trait Args {
    fn key(&mut self, key: impl ToRedisArgs) -> &mut Self;
    fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self;
}

impl Args for Call {
    fn key(&mut self, key: impl ToRedisArgs) -> &mut Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }
}

impl Args for ScriptInvocation<'_> {
    fn key(&mut self, key: impl ToRedisArgs) -> &mut Self {
        ScriptInvocation::key(self, key)
    }

    fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        ScriptInvocation::arg(self, arg)
    }
}

/// BATCH's call for `calls`.
fn batch_invocation(calls: &[Call]) -> ScriptInvocation<'static> {
    let mut call = BATCH.prepare_invoke();
    call.arg(calls.len());
    for one in calls {
        for key in &one.keys {
            call.key(key.as_slice());
        }
        call.arg((one.kind.number(), one.keys.len(), one.args.len()));
        for arg in &one.args {
            call.arg(arg.as_slice());
        }
    }
    call
}

/// Who waits for a call's reply.
type Reply = oneshot::Sender<Result<Value, StoreError>>;

/// Called with each batch's size as it is sent (the worker counts them for `/metrics`).
pub type Observe = Arc<dyn Fn(usize) + Send + Sync>;

/// The door a batching store's holder calls go through: one task sends them.
#[derive(Clone)]
pub(crate) struct Batcher {
    tx: mpsc::UnboundedSender<(Call, Reply)>,
}

impl Batcher {
    /// Starts the task sending `store`'s batches (it stops when the last batcher is dropped).
    pub(crate) fn start(store: Store, observe: Observe) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(send_batches(store, rx, observe));
        Batcher { tx }
    }

    /// Sends `call` with whatever else is waiting, and waits for its own reply.
    pub(crate) async fn call(&self, call: Call) -> Result<Value, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send((call, reply))
            .map_err(|_| StoreError::Stopped)?;
        answer.await.map_err(|_| StoreError::Stopped)?
    }
}

/// The batching task: takes every call waiting (at most [`MOST_CALLS`]) once the batch before
/// is answered, drops those whose caller stopped waiting, sends the rest, answers each.
async fn send_batches(
    store: Store,
    mut rx: mpsc::UnboundedReceiver<(Call, Reply)>,
    observe: Observe,
) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < MOST_CALLS {
            match rx.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        // A caller that stopped waiting (its renewal timed out, its run was dropped) wants
        // nothing sent any more: a renewal sent after its holder gave the lease up would
        // only hold the instance from the next claim.
        batch.retain(|(_, reply)| !reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        observe(batch.len());
        let (calls, replies): (Vec<Call>, Vec<Reply>) = batch.into_iter().unzip();
        let answers = store.send_batch(&calls).await;
        for (reply, answer) in replies.into_iter().zip(answers) {
            // A caller that gave up waiting has dropped its receiver: nothing to tell.
            let _ = reply.send(answer);
        }
    }
}

impl Store {
    /// `calls` as one durable write ([`Store::with_wait`]): alone as its own script, or as
    /// BATCH; one answer per call, in order.
    async fn send_batch(&self, calls: &[Call]) -> Vec<Result<Value, StoreError>> {
        if let [one] = calls {
            return vec![self.durable(one.kind.script(), &one.invocation()).await];
        }
        let replies: Result<Vec<(i64, Value)>, StoreError> =
            self.durable(&BATCH, &batch_invocation(calls)).await;
        match replies {
            Ok(replies) if replies.len() == calls.len() => {
                replies.into_iter().map(batch_answer).collect()
            }
            Ok(replies) => {
                let bad = format!("{} replies to a batch of {}", replies.len(), calls.len());
                calls
                    .iter()
                    .map(|_| Err(StoreError::bad_reply(&bad)))
                    .collect()
            }
            Err(e) => calls.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// Runs a holder's `call`: through the batcher when this store batches, else alone.
    pub(crate) async fn hold<T: redis::FromRedisValue>(&self, call: Call) -> Result<T, StoreError> {
        let value = match &self.batch {
            Some(batcher) => batcher.call(call).await?,
            None => self.durable(call.kind.script(), &call.invocation()).await?,
        };
        Ok(redis::from_redis_value(value)?)
    }

    /// This store, with its holder's writes (claim, renew, finish, retry, release) batched
    /// with those of its clones that arrive together (docs/design.md#batched-writes);
    /// `observe` hears each batch's size. Needs a Tokio runtime.
    pub fn batching(self, observe: Observe) -> Store {
        let batcher = Batcher::start(self.clone(), observe);
        Store {
            batch: Some(batcher),
            ..self
        }
    }
}

/// One call's answer out of BATCH's `{ok, reply}`.
fn batch_answer((ok, reply): (i64, Value)) -> Result<Value, StoreError> {
    if ok == 1 {
        return Ok(reply);
    }
    let text: String = redis::from_redis_value(reply).unwrap_or_default();
    Err(StoreError::Script(text))
}
