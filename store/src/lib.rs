//! Redis state (docs/design.md–5). Every read-modify-write is one Lua script, so two workers (or two
//! beats) can never interleave inside it. A claim carries a random token (only its holder may
//! renew, complete or release it) and a fencing token from a monotonic counter (handlers pass it
//! to the systems they write, which reject writes with an older fence).
//!
//! # Map
//!
//! - `objects.rs`: schedules and calendars applied at run time (`{ns}:objects:{kind}`, their
//!   times) and the change feed `{ns}:objects:feed` the leader follows: put (created,
//!   replaced, unchanged), delete, get, page, read the feed (docs/design.md#schedules-as-data).
//!   Touches: Redis.
//! - `operate.rs`: the paused set `{ns}:paused`; the holder of a job's overlap lock, for
//!   `trigger`. Touches: Redis.
//! - `journal.rs`: the journal `{ns}:journal`: the Lua `jot` every fate-deciding script shares,
//!   the leader's fenced append, reading it back (`journal_since`) and a job's whole history
//!   for `audit`/`verify` (docs/design.md#journal). Touches: Redis.
//! - `dead.rs`: `dead_unclaimed`: a message dead-lettered unrun recorded `dead` (state,
//!   journal, run record) when its key has no state yet (docs/design.md#expired-in-the-queue).
//!   Touches: Redis.
//! - `follow.rs`: `skip_follower`: an `after` job's instance recorded `skipped` (reason,
//!   history entry), fenced by the lease, only when unrecorded. Touches: Redis.
//! - `leader.rs`: the leader lease scripts (acquire, renew, resign) and the fenced progress
//!   write. Touches: Redis.
//! - `workers.rs`: the workers' announcements `{ns}:worker:{id}` and their set `{ns}:workers`
//!   (`WorkerInfo`): write with a TTL, delete, read all (docs/design.md#queues-and-workers).
//!   Touches: Redis.
//! - `rules.rs`: the rule each job's progress was recorded under: read at each gain, written
//!   with a job's start in one fenced script. Touches: Redis.
//! - `batch.rs`: a worker's claims, renewals and endings that arrive together sent as one
//!   script call, each answered alone (docs/design.md#batched-writes). Touches: Redis.
//! - `conn.rs`: the one connection every store call goes through; with `redis+sentinel://` it
//!   asks the Sentinels for the primary (at start, and after a connection error, a `READONLY`
//!   reply or a `WAIT` that fell short) and follows a failover. Touches: Redis, Sentinels.

// Every public item is documented (docs/design.md#module-map): `cargo doc` is the reference.
#![warn(missing_docs)]

// The core's modules, under the paths this crate's code names them by.
use drumline_core::trace::TraceParent;
use drumline_core::{backoff, config, envelope, limit, names, run, tls, url};

use crate::backoff::Backoff;
use crate::config::JournalConfig;
use crate::envelope::parse_instant;
use crate::names::Names;
use chrono::{DateTime, SecondsFormat, Utc};
use futures_util::{stream, StreamExt};
use redis::aio::ConnectionManager;
use redis::{AsyncCommands, Script, ScriptInvocation};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::LazyLock;
use std::time::Duration;

mod batch;
mod conn;
mod dead;
mod follow;
mod journal;
mod leader;
mod objects;
mod operate;
mod rules;
mod workers;

use crate::limit::Limit;
pub use crate::run::{Claim, Ending, Final, LimitedBy, RunState, WaitReplicas};
use batch::{Args, Batcher, Call, Kind};
pub use batch::{Observe, MOST_CALLS};
pub use conn::Conn;
pub use dead::Unclaimed;
pub use follow::Skipped;
use journal::JOURNAL;
pub use journal::{JournalEntry, LeaderEntry};
/// The Lua that formats Redis `TIME` as RFC 3339 for the leader lease's `since`: public only
/// so `store/tests/store.rs` can run it against chrono across the calendar.
#[doc(hidden)]
pub use leader::RFC3339 as LUA_RFC3339;
pub use leader::{Candidate, LeaseMode, LeaseOutcome, LeaseReply, ProgressError};
pub use objects::{Applied, Change, FeedRead, ObjectKind, Stored};
pub use workers::{WorkerInfo, WORKERS_SHOWN};

/// Why a store call failed. Every kind is connection-level for the caller: the worker fails
/// closed on it, the beat waits (docs/design.md#redis).
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// No connection to Redis at the start: names the URL (redacted) and the reason.
    #[error("cannot connect to Redis at {url}: {source}")]
    Unreachable {
        /// The URL, redacted.
        url: String,
        /// What the connection attempt got.
        source: redis::RedisError,
    },
    /// Redis could not be reached, or answered with an error.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    /// A durable write reached fewer replicas than `[redis] wait_replicas` asks within its
    /// timeout: it may be lost in a failover, so it does not count.
    #[error(
        "too few replicas acknowledged the write (wait_replicas): {acked} of {wanted} within \
         {timeout:?}"
    )]
    TooFewReplicas {
        /// Replicas that acknowledged (`-1`: no `WAIT` reply).
        acked: i64,
        /// `[redis] wait_replicas`.
        wanted: u32,
        /// `[redis] wait_timeout`.
        timeout: Duration,
    },
    /// A reply of a shape no script or command gives: a broken server or proxy.
    #[error("unexpected reply from redis: {0}")]
    BadReply(String),
    /// A setting checked at load no longer works when connecting (the CA file changed).
    #[error("{0}")]
    Setting(String),
    /// No Sentinel named a primary for the master name.
    #[error("no primary from the sentinels: {0}")]
    NoPrimary(String),
    /// Redis raised an error in one call of a batch ([`Store::batching`]); the others ran.
    #[error("redis: {0}")]
    Script(String),
    /// The task sending a batching store's calls is gone (its runtime is shutting down).
    #[error("the store's batching task stopped")]
    Stopped,
}

impl From<redis::ParsingError> for StoreError {
    fn from(e: redis::ParsingError) -> Self {
        StoreError::BadReply(e.to_string())
    }
}

impl StoreError {
    /// A [`StoreError::BadReply`] saying what was wrong.
    pub(crate) fn bad_reply(what: impl Into<String>) -> Self {
        StoreError::BadReply(what.into())
    }
}

/// What ending a claim did ([`Store::finish`], [`Store::release`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    /// The claim was ours (or its record gone) and the ending is recorded, now or by an
    /// earlier try of the same write; `false`: another claim holds the instance, nothing
    /// was written.
    pub ours: bool,
    /// The first copy that waited for the job's overlap lock, which this ending released: the
    /// caller publishes it again (docs/design.md#waiting-copies-wake-up).
    pub woken: Option<Waiter>,
}

impl Ended {
    /// Reads a script's `{code, woken}` reply.
    fn read((code, woken): (i64, Option<Vec<u8>>)) -> Result<Self, StoreError> {
        Ok(Ended {
            ours: code > 0,
            woken: woken.as_deref().and_then(Waiter::decode),
        })
    }
}

/// A copy waiting for its job's overlap lock, as `{ns}:waiters:{job}` keeps it: the encoded
/// envelope, the leadership epoch it was published under and its trace context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiter {
    /// `x-drumline-epoch` of the copy.
    pub epoch: u64,
    /// The envelope, encoded.
    pub body: Vec<u8>,
    /// Its `traceparent`, if any: the woken copy carries it on (docs/envelope.md#trace-context).
    pub trace: Option<TraceParent>,
}

impl Waiter {
    /// `{epoch} {body}`, or `{epoch}:{traceparent} {body}` with a trace.
    fn encode(&self) -> Vec<u8> {
        let mut out = match &self.trace {
            Some(trace) => format!("{}:{trace} ", self.epoch),
            None => format!("{} ", self.epoch),
        }
        .into_bytes();
        out.extend_from_slice(&self.body);
        out
    }

    /// Reads [`encode`](Self::encode)'s forms; `None` for anything else.
    fn decode(bytes: &[u8]) -> Option<Self> {
        let space = bytes.iter().position(|b| *b == b' ')?;
        let head = std::str::from_utf8(&bytes[..space]).ok()?;
        let (epoch, trace) = match head.split_once(':') {
            Some((epoch, trace)) => (epoch, Some(trace.parse().ok()?)),
            None => (head, None),
        };
        Some(Waiter {
            epoch: epoch.parse().ok()?,
            body: bytes[space + 1..].to_vec(),
            trace,
        })
    }
}

/// What a worker asks for when it claims an instance.
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// Idempotency key.
    pub key: &'a str,
    /// Our random token: only its holder may renew, finish or release.
    pub token: &'a str,
    /// Worker id, recorded for people.
    pub worker: &'a str,
    /// The instance's job (a scheduled instance); `None` for an ad-hoc task. While claimed, a
    /// job's instance is counted in `{ns}:running:{job}`.
    pub job: Option<&'a str>,
    /// The copy's attempt number: a copy older than the recorded attempt is a duplicate.
    pub attempt: u32,
    /// Lease length.
    pub lease: Duration,
    /// The job's overlap rule.
    pub overlap: OverlapMode<'a>,
    /// How long a `skipped` state is kept.
    pub retention: Duration,
    /// The copy's `expires_at` has passed: dedupe it, but do not claim it.
    pub expired: bool,
    /// The task's `[limits.NAME]`, if any: the claim also takes a slot and a start in it, or
    /// answers [`Claim::Limited`] and takes nothing (docs/design.md#limits).
    pub limit: Option<LimitClaim<'a>>,
    /// The epoch of the leader that published the copy (`x-drumline-epoch`; 0 for an ad-hoc
    /// task or when unknown), written on the claim's journal entry.
    pub epoch: u64,
}

/// What a claim asks of its task's limit.
#[derive(Debug, Clone, Copy)]
pub struct LimitClaim<'a> {
    /// The limit.
    pub limit: &'a Limit,
    /// How far ahead a start may be reserved for this claim's token when the rate's window is
    /// full: the caller means to wait that long and claim again with the same token. Zero:
    /// never reserve.
    pub reserve_within: Duration,
}

impl LimitClaim<'_> {
    /// ARGV 10..14 of the claim script: concurrency (0: none), rate count (0: none), the
    /// window, how late a reserved start may still be taken, the reservation horizon (ms).
    fn args(&self) -> [u64; 5] {
        let ms = |d: Duration| d.as_millis() as u64;
        let (count, window, late) = match self.limit.rate {
            Some(rate) => {
                let window = rate.window();
                (rate.count, ms(window), ms(window - rate.period) / 2)
            }
            None => (0, 0, 0),
        };
        let concurrency = self.limit.concurrency.unwrap_or(0);
        [
            u64::from(concurrency),
            u64::from(count),
            window,
            late,
            ms(self.reserve_within),
        ]
    }
}

/// What a claim does about the job's other instances (docs/design.md step 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverlapMode<'a> {
    /// No job (ad-hoc) or `overlap = "allow"`: no job lock.
    Allow,
    /// `overlap = "skip"` for job `.0`.
    Skip(&'a str),
    /// `overlap = "queue"` for job `.0`.
    Queue(&'a str),
}

impl OverlapMode<'_> {
    fn parts(&self) -> (&'static str, Option<&str>) {
        match self {
            OverlapMode::Allow => ("allow", None),
            OverlapMode::Skip(job) => ("skip", Some(job)),
            OverlapMode::Queue(job) => ("queue", Some(job)),
        }
    }
}

/// One entry of `{ns}:history:{job}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// Idempotency key.
    pub key: String,
    /// RFC 3339 UTC.
    pub scheduled_for: String,
    /// `done`, `failed`, `dead`, `expired`, `skipped`.
    pub status: String,
    /// Attempt number of this run.
    pub attempt: u32,
    /// Worker id.
    pub worker: String,
    /// RFC 3339 UTC.
    pub started_at: Option<String>,
    /// RFC 3339 UTC.
    pub finished_at: String,
    /// Error text, if any.
    pub error: Option<String>,
    /// Why a `skipped` instance did not run: `upstream` for an `after` job whose upstream did
    /// not succeed (docs/design.md#job-dependencies). Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl RunRecord {
    /// A failed, dead or expired run: what `status` shows as the job's last failure.
    pub fn is_failure(&self) -> bool {
        matches!(self.status.as_str(), "failed" | "dead" | "expired")
    }
}

/// Most run records kept per job.
pub const HISTORY_LEN: isize = 1000;

// CLOCK: `now_ms()` is Redis `TIME` in ms (one clock for every worker), read once per script
// call and kept in `NOW`, which the script declares before it (see [`standalone`]): one batch
// of calls shares one reading (docs/design.md#batched-writes), as Redis itself judges every key's
// expiry in a script by the time the script began.
const CLOCK: &str = r#"
local function now_ms()
  if not NOW then
    local t = redis.call('TIME')
    NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return NOW
end
"#;

/// `text` as a script of its own: `NOW` ([`CLOCK`]) declared, not yet read.
pub(crate) fn standalone(text: &str) -> String {
    format!("local NOW = false\n{text}")
}

// What the scripts that keep `{ns}:running:{job}` share: [`CLOCK`], and
// `mark_running(set, member, lease_ms)` scores `member` at now +
// lease, drops the entries whose lease has expired (their workers died) and keeps the set alive
// at least as long as its newest entry, so an idle job's set expires by itself.
const RUNNING_SET: &str = r#"
local function mark_running(set, member, lease_ms)
  local now = now_ms()
  redis.call('ZREMRANGEBYSCORE', set, '-inf', now)
  redis.call('ZADD', set, now + tonumber(lease_ms), member)
  if redis.call('PTTL', set) < tonumber(lease_ms) then
    redis.call('PEXPIRE', set, lease_ms)
  end
end
"#;

/// The text of a script that starts with [`RUNNING_SET`] and goes on with `body`.
fn keeping_running_set(body: &str) -> String {
    format!("{CLOCK}{RUNNING_SET}{body}")
}

// The run record `{ns}:run:{key}` outlives its lease (docs/design.md#attempts-outlive-the-lease):
// it is kept for the retention (`done_ttl`) after its last write, and the lease is its own
// field `lease_until` (ms, Redis `TIME`). `lease_left(run, now)` reads it; a record written
// before the field existed falls back to the key's TTL, which was its lease then.
const LEASE: &str = r#"
local function lease_left(run, now)
  local deadline = tonumber(redis.call('HGET', run, 'lease_until'))
  if deadline then return deadline - now end
  return redis.call('PTTL', run)
end
local function keep_for(retention_ms, lease_ms)
  return math.max(tonumber(retention_ms), tonumber(lease_ms))
end
"#;

// A claim's limit (docs/design.md#limits). `limit_take(slots, starts, token, now, lease_ms, a)`
// with `a` = {concurrency, rate count, window ms, late ms, horizon ms} (0: that part is off):
// - concurrency: slots whose lease lapsed are dropped (their holders died); when the rest fill
//   the group, nothing is taken, a start reserved for this token is given back, and the answer
//   is {'limited', ms until the first slot's lease lapses, 'concurrency'};
// - rate: stamps older than a window are dropped; this token's reserved start is used when it
//   has come (and is not more than `late` ms past: else it is given back and placed again);
//   otherwise the next start goes where `next_start` (core/src/limit.rs) puts it: now, or the
//   newest stamp plus a gap (window / count, rounded up). A start ahead of now is reserved for the token when it
//   is within the horizon, and the answer is {'limited', ms until it, 'rate'};
// - both passed: the slot is taken, scored by the lease's end, and `false` is returned.
const LIMIT: &str = r#"
local function limit_take(slots, starts, token, now, lease_ms, a)
  local conc, count, window, late, horizon = a[1], a[2], a[3], a[4], a[5]
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
    if redis.call('ZCARD', slots) >= conc then
      redis.call('ZREM', starts, token)
      local first = redis.call('ZRANGE', slots, 0, 0, 'WITHSCORES')
      return {'limited', tostring(math.max(1, tonumber(first[2]) - now)), 'concurrency'}
    end
  end
  if count > 0 then
    redis.call('ZREMRANGEBYSCORE', starts, '-inf', now - window)
    local mine = tonumber(redis.call('ZSCORE', starts, token))
    if mine and mine > now then return {'limited', tostring(mine - now), 'rate'} end
    if mine and now - mine > late then
      redis.call('ZREM', starts, token)
      mine = nil
    end
    if not mine then
      local at = now
      local newest = redis.call('ZREVRANGE', starts, 0, 0, 'WITHSCORES')
      if newest[2] then at = math.max(now, tonumber(newest[2]) + math.ceil(window / count)) end
      if at > now + horizon then return {'limited', tostring(at - now), 'rate'} end
      redis.call('ZADD', starts, at, token)
      if redis.call('PTTL', starts) < at - now + window then
        redis.call('PEXPIRE', starts, at - now + window)
      end
      if at > now then return {'limited', tostring(at - now), 'rate'} end
    end
  end
  if conc > 0 then
    redis.call('ZADD', slots, now + lease_ms, token)
    if redis.call('PTTL', slots) < lease_ms then redis.call('PEXPIRE', slots, lease_ms) end
  end
  return false
end
"#;

// CLAIM
// KEYS[1] -> {ns}:run:{key}          the run record (state, attempt, fence, token, lease_until)
// KEYS[2] -> {ns}:fence              the fencing counter
// KEYS[3] -> {ns}:job:{job}:running  the job's overlap lock, a hash {key, token} (unused with
//                                    overlap `allow`)
// KEYS[4] -> {ns}:running:{job}      the job's running set (unused when not counted)
// KEYS[5] -> {ns}:limit:{name}:slots  the task's concurrency group (unused without one)
// KEYS[6] -> {ns}:limit:{name}:starts the task's rate window (unused without one)
// ARGV[1] -> token                   ARGV[2] -> worker id
// ARGV[3] -> the copy's attempt      ARGV[4] -> lease in ms
// ARGV[5] -> overlap: skip | queue | allow
// ARGV[6] -> retention in ms (how long the record is kept after its last write)
// ARGV[7] -> the key, as the lock and the running set record it
// ARGV[8] -> 1 when the copy's expires_at has passed, else 0
// ARGV[9] -> 1 for a job's instance (counted in the running set), 0 for ad-hoc
// ARGV[10..14] -> the limit's concurrency, rate count, window ms, late ms, horizon ms (LIMIT)
// ARGV[15] -> the publishing leader's epoch, journaled as `ep` ('0': unknown, not written)
// Output: {'claimed', fence} | {'duplicate', state} | {'expired'}
//       | {'limited', ms to wait, 'concurrency' | 'rate'}
//       | {'busy', ms left, '1' when the copy's attempt is later than the running one's}
//       | {'skipped', holder} | {'waiting', ms left on the lock, holder}
// Dedupe comes first, so an expired copy of a finished instance is a duplicate. A copy older
// than the recorded attempt is a duplicate whether or not the lease lapsed, so attempts never
// go backwards and copies never fork a retry chain; a lapsed lease of the recorded attempt is
// taken over with a new fence. Only a granted claim enters the running set. The limit is judged
// last, so a duplicate never takes a slot or a start, and a limited copy leaves the record as
// it was: waiting is not an attempt. Only an instance never claimed is `skipped` under a lock
// held by another: one that started (a retry, a released or lapsed claim) waits for the lock,
// as under `queue`, so a retry is never skipped (docs/guarantees.md#overlap).
pub(crate) static CLAIM_LUA: LazyLock<String> = LazyLock::new(|| {
    keeping_running_set(&format!(
        "{LEASE}{JOURNAL}{LIMIT}{}",
        r#"
local now = now_ms()
local ep = {}
if ARGV[15] ~= '0' then ep = {'ep', ARGV[15]} end
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'done' or state == 'skipped' or state == 'dead' then
  jot('duplicate', ARGV[3], ARGV[1], ARGV[2], 'r', state, unpack(ep))
  return {'duplicate', state}
end
if state == 'running' or state == 'retrying' then
  local recorded = tonumber(redis.call('HGET', KEYS[1], 'attempt')) or 0
  if tonumber(ARGV[3]) < recorded then
    jot('duplicate', ARGV[3], ARGV[1], ARGV[2], 'r', state, unpack(ep))
    return {'duplicate', state}
  end
end
if state == 'running' then
  local left = lease_left(KEYS[1], now)
  if left > 0 then
    local recorded = tonumber(redis.call('HGET', KEYS[1], 'attempt')) or 0
    return {'busy', tostring(left), tonumber(ARGV[3]) > recorded and '1' or '0'}
  end
end
if ARGV[8] == '1' then
  jot('expired', ARGV[3], ARGV[1], ARGV[2], unpack(ep))
  -- A retry's hold on its job ends with it (the caller passes the turn on).
  if ARGV[5] ~= 'allow' and redis.call('HGET', KEYS[3], 'key') == ARGV[7] then
    redis.call('DEL', KEYS[3])
  end
  return {'expired'}
end
if ARGV[5] ~= 'allow' then
  local holder = redis.call('HGET', KEYS[3], 'key')
  if holder and holder ~= ARGV[7] then
    if ARGV[5] == 'skip' and not state then
      redis.call('DEL', KEYS[1])
      redis.call('HSET', KEYS[1], 'state', 'skipped', 'worker', ARGV[2], 'attempt', ARGV[3],
        'overlapped', holder, 'at', math.floor(now / 1000))
      redis.call('PEXPIRE', KEYS[1], ARGV[6])
      jot('skipped', ARGV[3], ARGV[1], ARGV[2], 'r', 'overlap', 'by', holder, unpack(ep))
      return {'skipped', holder}
    end
    local ttl = redis.call('PTTL', KEYS[3])
    if ttl < 1 then ttl = 1 end
    return {'waiting', tostring(ttl), holder}
  end
end
local limited = limit_take(KEYS[5], KEYS[6], ARGV[1], now, tonumber(ARGV[4]),
  {tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13]),
   tonumber(ARGV[14])})
if limited then return limited end
local fence = redis.call('INCR', KEYS[2])
if state then redis.call('DEL', KEYS[1]) end
redis.call('HSET', KEYS[1], 'state', 'running', 'token', ARGV[1], 'worker', ARGV[2],
  'fence', fence, 'attempt', ARGV[3], 'lease_until', now + tonumber(ARGV[4]),
  'at', math.floor(now / 1000))
redis.call('PEXPIRE', KEYS[1], keep_for(ARGV[6], ARGV[4]))
if ARGV[5] ~= 'allow' then
  redis.call('DEL', KEYS[3])
  redis.call('HSET', KEYS[3], 'key', ARGV[7], 'token', ARGV[1])
  redis.call('PEXPIRE', KEYS[3], ARGV[4])
end
if ARGV[9] == '1' then mark_running(KEYS[4], ARGV[7], ARGV[4]) end
jot(state == 'running' and 'takeover' or 'claim', ARGV[3], ARGV[1], ARGV[2], 'f', fence,
  unpack(ep))
return {'claimed', tostring(fence)}
"#
    ))
});

// The call every holder's script shares (RENEW, FINISH, RETRY, RELEASE):
// KEYS[1] -> {ns}:run:{key}          KEYS[2] -> {ns}:job:{job}:running (the job lock)
// KEYS[3] -> {ns}:running:{job}      (unused for an ad-hoc task)
// KEYS[4] -> {ns}:waiters:{job}      (unused by RENEW)
// KEYS[5] -> {ns}:limit:{name}:slots (KEYS[1] again without a concurrency group: not touched)
// ARGV[1] -> the claim's token       ARGV[2] -> the key as the running set records it ('' for
//                                               an ad-hoc task: not counted)
// then the script's own ARGV.
//
// RENEW: ARGV[3] -> lease in ms. The record's own TTL (the retention, set by the claim) is
// only lengthened when the new lease would outlive it.
// Output: 1 renewed | 0 not ours, not running, or the lease already lapsed (a lapsed lease may
// have been taken over; its holder must stop, as it would have had the record expired).
// The running entry, the job lock and the group slot move with the lease.
pub(crate) static RENEW_LUA: LazyLock<String> = LazyLock::new(|| {
    keeping_running_set(&format!(
        "{LEASE}{}",
        r#"
local now = now_ms()
if redis.call('HGET', KEYS[1], 'token') == ARGV[1]
   and redis.call('HGET', KEYS[1], 'state') == 'running'
   and lease_left(KEYS[1], now) > 0 then
  redis.call('HSET', KEYS[1], 'lease_until', now + tonumber(ARGV[3]))
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
  end
  if redis.call('HGET', KEYS[2], 'token') == ARGV[1] then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
  end
  if ARGV[2] ~= '' then mark_running(KEYS[3], ARGV[2], ARGV[3]) end
  if KEYS[5] ~= KEYS[1]
     and redis.call('ZADD', KEYS[5], 'XX', 'CH', now + tonumber(ARGV[3]), ARGV[1]) == 1
     and redis.call('PTTL', KEYS[5]) < tonumber(ARGV[3]) then
    redis.call('PEXPIRE', KEYS[5], ARGV[3])
  end
  return 1
end
return 0
"#
    ))
});

// The start every script that ends a claim shares: the job lock is released if it is ours,
// whatever happens to the run key (unless the script keeps it for `HOLD_MS`: a retry keeps its
// job until the retry's deadline, docs/guarantees.md#overlap), and then the first copy waiting for it (KEYS[4], the job's
// waiters) is taken off the registry as `woken`, for the caller to publish again
// (docs/design.md#waiting-copies-wake-up). `ours` says whether the run key carries our token,
// `holds` whether it is still our running claim. The running entry goes when the run key is
// ours or gone (with our lease lapsed, nobody else runs it); another claim's entry for the same
// key stays. The claim's group slot (KEYS[5]) is freed whatever the record says: the run has
// ended. Only a job's claim can hold a job lock, so an ad-hoc one (ARGV[2] '') does not look.
// `state`, `attempt` and `worker` are the record's as the call found it, read once (each
// `redis.call` costs Redis about half a microsecond beside the command: docs/performance.md).
// Each script returns {code, woken or false}.
const END_CLAIM: &str = r#"
if KEYS[5] ~= KEYS[1] then redis.call('ZREM', KEYS[5], ARGV[1]) end
local woken = false
if ARGV[2] ~= '' and redis.call('HGET', KEYS[2], 'token') == ARGV[1] then
  if HOLD_MS then
    redis.call('PEXPIRE', KEYS[2], HOLD_MS)
  else
    redis.call('DEL', KEYS[2])
    woken = redis.call('LPOP', KEYS[4])
  end
end
local rec = redis.call('HMGET', KEYS[1], 'token', 'state', 'attempt', 'worker')
local state, attempt, worker = rec[2], rec[3], rec[4]
local ours = rec[1] == ARGV[1]
local holds = ours and state == 'running'
if ARGV[2] ~= '' and (ours or redis.call('EXISTS', KEYS[1]) == 0) then
  redis.call('ZREM', KEYS[3], ARGV[2])
end
"#;

// ENDED: in a script that ends a claim, the ARGV just before the journal's is how many ms
// before the call the run ended ('' unknown); `ended(...)` puts it first among an entry's extra
// fields, as `ago`.
const ENDED: &str = r#"
local function ended(...)
  local ago = ARGV[#ARGV - 3]
  if ago == '' then return ... end
  return 'ago', ago, ...
end
"#;

/// The text of a script that starts with [`JOURNAL`], [`ENDED`] and [`END_CLAIM`] and goes on
/// with `body`; `hold` is the Lua expression for how many ms the job lock is kept instead of
/// released (`false`: released).
fn ending_claim(hold: &str, body: &str) -> String {
    format!("local HOLD_MS = {hold}\n{CLOCK}{JOURNAL}{ENDED}{END_CLAIM}{body}")
}

// FINISH (the shared KEYS[1..4] and ARGV[1..2] above, then:)
// KEYS[6] -> {ns}:history:{job}      the job's run records (only with ARGV[5])
// KEYS[7] -> {ns}:last_success:{job} or {ns}:last_failure:{job} (only with ARGV[5])
// ARGV[3] -> final state: done | dead        ARGV[4] -> retention in ms
// ARGV[5] -> the run record's JSON ('' for none)
// ARGV[6] -> history cap                     ARGV[7] -> the record's end (RFC 3339)
// ARGV[8] -> success | failure | '' (which "last" key ARGV[7] goes to)
// then (each of FINISH, RETRY, RELEASE) how many ms ago the run ended ('' unknown; see ENDED)
// Output: {code, woken}; code 1 written | 2 written before by this token (a repeat whose
// first reply was lost or whose WAIT fell short: docs/design.md#outcome-writes-are-idempotent)
// | 0 another claim holds the instance now, nothing written.
// Written while the claim is ours and running, lapsed or not (nobody took it over), or when
// the record is gone: the run did finish, and recording it is what stops it running again.
pub(crate) static FINISH_LUA: LazyLock<String> = LazyLock::new(|| {
    ending_claim(
        "false",
        r#"
if ours and state == ARGV[3] then return {2, woken} end
if holds or redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'state', ARGV[3], 'token', ARGV[1],
    'at', math.floor(now_ms() / 1000))
  redis.call('HDEL', KEYS[1], 'lease_until')
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  jot(ARGV[3] == 'done' and 'success' or 'dead', attempt, ARGV[1], worker, ended())
  if ARGV[5] ~= '' then
    redis.call('LPUSH', KEYS[6], ARGV[5])
    redis.call('LTRIM', KEYS[6], 0, tonumber(ARGV[6]) - 1)
    if ARGV[8] == 'success' then
      redis.call('SET', KEYS[7], ARGV[7])
    elseif ARGV[8] == 'failure' then
      redis.call('SET', KEYS[7], ARGV[7], 'PX', ARGV[4])
    end
  end
  return {1, woken}
end
return {0, woken}
"#,
    )
});

// RETRY (the shared KEYS[1..4] and ARGV[1..2] above, then:)
// ARGV[3] -> the next attempt        ARGV[4] -> retention in ms
// ARGV[5] -> how long the job lock stays with the instance, in ms (the retry's delay plus a
//            lease): the lock is kept, not released, and nobody waiting is woken
// Output: {code, woken}; code 1 handed over | 2 handed over before by this token (a repeat)
// | 0 not ours.
// A failed run hands the instance to its retry: the record stays, `retrying` with the attempt
// that may claim it next (older copies are duplicates, not a second chain) and our token (so
// a repeat recognises its own hand-over).
pub(crate) static RETRY_LUA: LazyLock<String> = LazyLock::new(|| {
    ending_claim(
        "ARGV[5]",
        r#"
if ours and state == 'retrying' and attempt == ARGV[3] then
  return {2, woken}
end
if not holds then return {0, woken} end
jot('retry', attempt, ARGV[1], worker, ended('next', ARGV[3]))
redis.call('HSET', KEYS[1], 'state', 'retrying', 'attempt', ARGV[3],
  'at', math.floor(now_ms() / 1000))
redis.call('HDEL', KEYS[1], 'lease_until')
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1, woken}
"#,
    )
});

// RELEASE (the shared KEYS[1..4] and ARGV[1..2] above, then only `ago`: see ENDED)
// Output: {1 released | 0 not ours, woken}.
// Gives the claim up (shutdown abandoned the run; its copy is requeued): the record stays,
// with its attempt, so older copies are still duplicates; its lease is marked lapsed and the
// token dropped, so the requeued copy takes it over at once with a new fence.
pub(crate) static RELEASE_LUA: LazyLock<String> = LazyLock::new(|| {
    ending_claim(
        "false",
        r#"
if ours then
  jot('release', attempt, ARGV[1], worker, ended())
  redis.call('HSET', KEYS[1], 'lease_until', 0)
  redis.call('HDEL', KEYS[1], 'token')
  return {1, woken}
end
return {0, woken}
"#,
    )
});

// PARK (docs/design.md#waiting-copies-wake-up)
// KEYS[1] -> {ns}:job:{job}:running  the job's overlap lock
// KEYS[2] -> {ns}:waiters:{job}      the copies waiting for it
// ARGV[1] -> the waiting copy (see `Waiter`), ARGV[2] -> how long the registry is kept, in ms
// Output: 1 parked | 0 the lock is free already (the copy should look again now)
// Checked against the lock in the same call, so a release can never slip between a copy
// finding the lock held and registering.
static PARK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[1])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return 1
"#,
    )
});

// WAKE
// KEYS[1] -> {ns}:job:{job}:running, KEYS[2] -> {ns}:waiters:{job}
// Output: the first waiting copy, when the lock is free and one waits; else nil.
static WAKE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
return redis.call('LPOP', KEYS[2])
"#,
    )
});

// RUNNING_COUNTS
// KEYS[1..n] -> {ns}:running:{job}   running sets, one per job asked about
// ARGV       -> none
// Output: per set, how many entries have a lease that has not expired by Redis `TIME`
// (read-only: expired entries are trimmed by the writers).
static RUNNING_COUNTS: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&standalone(&keeping_running_set(
        r#"
local now = now_ms()
local counts = {}
for i, set in ipairs(KEYS) do
  counts[i] = redis.call('ZCOUNT', set, '(' .. now, '+inf')
end
return counts
"#,
    )))
});

// CLEAR_DEAD (`dlq replay`: the replayed copy may run again)
// KEYS[1] -> {ns}:run:{key}
// ARGV    -> none
// Output: 1 the record was `dead` and is gone | 0 left alone (any other state, or none)
static CLEAR_DEAD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('HGET', KEYS[1], 'state') == 'dead' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#,
    )
});

/// Handle to one namespace's Redis state. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    conn: Conn,
    names: Names,
    /// `[redis] wait_replicas` and `wait_timeout`: durable writes wait for this many replicas.
    wait: Option<(u32, Duration)>,
    /// `[journal]`: whether and how long the fate-deciding scripts journal.
    journal: JournalConfig,
    /// The concurrency group whose slot the holder's scripts (renew, finish, release) move and
    /// free: see [`with_limit`](Self::with_limit).
    limit: Option<String>,
    /// When the holder's run ended, for the journal: see [`with_ended`](Self::with_ended).
    ended: Option<tokio::time::Instant>,
    /// Where the holder's writes go when they are batched ([`batching`](Self::batching)).
    batch: Option<Batcher>,
}

impl Store {
    /// Connects (and keeps reconnecting in the background) to `url`. With `ca_file`, a
    /// `rediss://` server must present a certificate issued by a CA in that file (the system
    /// roots are then not consulted); without, by a system root. Unused by `redis://`.
    ///
    /// A `redis+sentinel://` URL is read by drumline: the Sentinels are asked for the primary
    /// now and again whenever it may have moved ([`Conn`]).
    pub async fn connect(
        url: &str,
        ca_file: Option<&Path>,
        names: Names,
    ) -> Result<Self, StoreError> {
        if let Some(sentinel) = crate::url::parse_sentinel(url) {
            // Checked at config load already; the error never quotes the URL.
            let sentinel = sentinel.map_err(|e| StoreError::Setting(format!("redis url: {e}")))?;
            let conn = Conn::sentinel(sentinel).await?;
            return Ok(Self {
                conn,
                names,
                wait: None,
                journal: JournalConfig::default(),
                limit: None,
                ended: None,
                batch: None,
            });
        }
        let client = match ca_file {
            Some(path) => {
                // Checked at config load already; this only fails if the file changed since.
                let ca = crate::tls::read_ca_file(path)
                    .map_err(|e| StoreError::Setting(format!("ca_file: {e}")))?;
                let certs = redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(ca.pem),
                };
                redis::Client::build_with_tls(url, certs)?
            }
            None => redis::Client::open(url)?,
        };
        let conn = ConnectionManager::new_with_config(client, conn::manager_config())
            .await
            .map_err(|source| StoreError::Unreachable {
                url: crate::url::Redacted(url).to_string(),
                source,
            })?;
        Ok(Self {
            conn: Conn::plain(conn),
            names,
            wait: None,
            journal: JournalConfig::default(),
            limit: None,
            ended: None,
            batch: None,
        })
    }

    /// Makes the durable writes (`done`, `dead`, `retrying`, progress, the claim and its
    /// renewals, the leader lease) wait for `wait`'s replicas: `WAIT` is pipelined right after
    /// the write, and fewer acknowledgements than asked is an error, handled like any Redis
    /// error (the caller fails closed) — and a reason to ask the Sentinels for the primary
    /// again ([`Conn`]): a primary cut off from its replicas grants no lease and no claim.
    /// See `docs/design.md#leadership`.
    pub fn with_wait(mut self, wait: WaitReplicas) -> Self {
        self.wait = (wait.replicas > 0).then_some((wait.replicas, wait.timeout));
        self
    }

    /// Adds `WAIT` to `pipe` when the durable writes wait for replicas; `check_wait` reads its
    /// reply.
    fn push_wait(&self, pipe: &mut redis::Pipeline) {
        if let Some((replicas, timeout)) = self.wait {
            pipe.cmd("WAIT")
                .arg(replicas)
                .arg((timeout.as_millis() as u64).max(1));
        }
    }

    /// Takes `WAIT`'s reply off the end of `replies` (when [`push_wait`](Self::push_wait)
    /// added it): fewer replicas than asked is an error, and the Sentinels are asked whether
    /// the primary moved (one cut off from its replicas may have been replaced).
    fn check_wait(&self, replies: &mut Vec<redis::Value>) -> Result<(), StoreError> {
        let Some((wanted, timeout)) = self.wait else {
            return Ok(());
        };
        let acked: i64 = match replies.pop() {
            Some(value) => redis::from_redis_value(value)?,
            None => -1,
        };
        if acked < i64::from(wanted) {
            self.conn.primary_in_doubt();
            return Err(StoreError::TooFewReplicas {
                acked,
                wanted,
                timeout,
            });
        }
        Ok(())
    }

    /// Runs `call` of `script` as a durable write: alone without `wait_replicas`, else in one
    /// pipeline `SCRIPT LOAD`, the call, `WAIT` (the same connection, so `WAIT` covers it).
    async fn durable<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        call: &ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.clone();
        if self.wait.is_none() {
            return Ok(call.invoke_async(&mut conn).await?);
        }
        let mut pipe = redis::pipe();
        pipe.load_script(script).ignore().invoke_script(call);
        self.push_wait(&mut pipe);
        let mut replies: Vec<redis::Value> = pipe.query_async(&mut conn).await?;
        self.check_wait(&mut replies)?;
        match replies.pop() {
            Some(value) => Ok(redis::from_redis_value(value)?),
            None => Err(StoreError::bad_reply("no reply from the script")),
        }
    }

    /// This store for the holder of a claim of a task in `limit` (docs/design.md#limits): its
    /// renewals move the claim's group slot with the lease, and ending the claim (finish,
    /// release) frees the slot. Claims take the slot themselves ([`ClaimRequest::limit`]).
    pub fn with_limit(&self, limit: Option<&str>) -> Store {
        Store {
            limit: limit.map(str::to_owned),
            ..self.clone()
        }
    }

    /// This store for the holder of a claim whose run ended at `ended`: the entry its ending
    /// script journals (success, dead, retry, release) says how long before the write that
    /// was (`ago`), so that a write held up by a stopped worker or a failover does not
    /// stretch the run for `verify` (docs/design.md#journal).
    pub fn with_ended(&self, ended: Option<tokio::time::Instant>) -> Store {
        Store {
            ended,
            ..self.clone()
        }
    }

    /// The names this store uses.
    pub fn names(&self) -> &Names {
        &self.names
    }

    /// A raw connection, for callers that need a command not wrapped here.
    pub fn connection(&self) -> Conn {
        self.conn.clone()
    }

    /// `PING`: true when Redis answers.
    pub async fn ping(&self) -> bool {
        let mut conn = self.conn.clone();
        redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .is_ok()
    }

    /// How many replicas are connected to the primary now (`INFO replication`'s
    /// `connected_slaves`), for [`WaitReplicas::advice`](crate::run::WaitReplicas::advice).
    pub async fn connected_replicas(&self) -> Result<u32, StoreError> {
        let mut conn = self.conn.clone();
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut conn)
            .await?;
        info.lines()
            .find_map(|l| l.strip_prefix("connected_slaves:"))
            .and_then(|n| n.trim().parse().ok())
            .ok_or_else(|| StoreError::bad_reply("INFO replication without connected_slaves"))
    }

    /// [`WaitReplicas::advice`](crate::run::WaitReplicas::advice) for `wait` against the
    /// primary as it is now, the URL `url` telling whether Sentinel fails it over; `None` when
    /// there is nothing to say or Redis cannot tell within a second (a start never waits
    /// longer on it). The beat and the worker log it at start.
    pub async fn replica_advice(
        &self,
        wait: crate::run::WaitReplicas,
        url: &str,
    ) -> Option<crate::run::ReplicaAdvice> {
        let sentinel = crate::url::parse_sentinel(url).is_some();
        if wait.replicas == 0 && !sentinel {
            return None;
        }
        let connected = tokio::time::timeout(Duration::from_secs(1), self.connected_replicas());
        wait.advice(connected.await.ok()?.ok()?, sentinel)
    }

    /// Tries to claim instance `key` for `lease`. With an overlap mode other than `Allow` the
    /// claim also takes the job's overlap lock; a `skipped` state is kept for `retention`. A
    /// durable write ([`with_wait`](Self::with_wait)): with too few replicas it is an error,
    /// whatever the script answered.
    pub async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let ClaimRequest {
            key,
            token,
            worker,
            job,
            attempt,
            lease,
            overlap,
            retention,
            expired,
            limit,
            epoch,
        } = *req;
        let (mode, lock_job) = overlap.parts();
        let limit_name = limit.map(|l| l.limit.name.as_str());
        let limit_args = limit.map_or([0; 5], |l| l.args());
        let mut call = Call::new(Kind::Claim);
        call.key(self.names.run_key(key))
            .key(self.names.fence())
            .key(self.job_lock(lock_job))
            .key(self.running_set(job))
            .key(self.names.limit_slots(limit_name.unwrap_or("")))
            .key(self.names.limit_starts(limit_name.unwrap_or("")))
            .arg(token)
            .arg(worker)
            .arg(attempt)
            .arg(lease.as_millis() as u64)
            .arg(mode)
            .arg(retention.as_millis() as u64)
            .arg(key)
            .arg(if expired { "1" } else { "0" })
            .arg(if job.is_some() { "1" } else { "0" })
            .arg(&limit_args[..])
            .arg(epoch);
        self.journal_tail(&mut call, key);
        // Waited for like an outcome: a claim only a cut-off primary knows is no claim.
        let reply: Vec<String> = self.hold(call).await?;
        parse_claim(&reply)
            .ok_or_else(|| StoreError::bad_reply(format!("from the claim script: {reply:?}")))
    }

    /// The overlap lock key for `job`; ad-hoc claims pass a key no script writes to.
    fn job_lock(&self, job: Option<&str>) -> String {
        self.names.job_running(job.unwrap_or(""))
    }

    /// The running set of `job`; ad-hoc claims pass a key no script writes to.
    fn running_set(&self, job: Option<&str>) -> String {
        self.names.running(job.unwrap_or(""))
    }

    /// Extends our lease (and moves the instance's entry in its job's running set); `false`
    /// means it is no longer ours. `job` is the instance's job ([`ClaimRequest::job`]); the
    /// job's overlap lock is renewed only when this claim holds it. A durable write, like the
    /// claim ([`with_wait`](Self::with_wait)).
    pub async fn renew(
        &self,
        key: &str,
        job: Option<&str>,
        token: &str,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let mut call = self.holder_call(Kind::Renew, key, job, token);
        call.arg(lease.as_millis() as u64);
        self.hold(call).await
    }

    /// Ends our claim as `ending` says, the record kept for `retention`, job lock released (if
    /// this claim holds it) and the instance out of its job's running set.
    /// [`Ending::Final`] writes the final state when the claim is still ours or the key is gone
    /// (our lease lapsed and nobody claimed it); [`Ending::Retry`] hands the claim to the retry
    /// (state `retrying` with its attempt) only while it is still ours. `false` means another
    /// claim holds the instance now and nothing was written.
    pub async fn finish(
        &self,
        key: &str,
        job: Option<&str>,
        token: &str,
        ending: Ending,
        retention: Duration,
    ) -> Result<Ended, StoreError> {
        let retention_ms = retention.as_millis() as u64;
        match ending {
            Ending::Final(state) => {
                self.finish_recorded(key, job, token, state, retention, None)
                    .await
            }
            Ending::Retry { next_attempt, hold } => {
                let mut call = self.holder_call(Kind::Retry, key, job, token);
                call.arg((next_attempt, retention_ms, hold.as_millis() as u64));
                self.holder_tail(&mut call, key);
                Ended::read(self.hold(call).await?)
            }
        }
    }

    /// [`finish`](Self::finish) in a final `state`, and when the claim ended is ours (or
    /// gone), in the same call: `record` appended to `job`'s history, its end as the job's last
    /// success or failure (as [`record`](Self::record) does). One round trip where there were
    /// two; nothing of the record is written when `false` comes back.
    pub async fn finish_recorded(
        &self,
        key: &str,
        job: Option<&str>,
        token: &str,
        state: Final,
        retention: Duration,
        record: Option<&RunRecord>,
    ) -> Result<Ended, StoreError> {
        let retention_ms = retention.as_millis() as u64;
        let mut call = self.holder_call(Kind::Finish, key, job, token);
        call.arg((state.as_str(), retention_ms));
        match (job, record) {
            (Some(job), Some(record)) => {
                let (last, kind) = if record.status == RunState::Done.as_str() {
                    (self.names.last_success(job), "success")
                } else if record.is_failure() {
                    (self.names.last_failure(job), "failure")
                } else {
                    (self.names.last_success(job), "")
                };
                let json = serde_json::to_string(record).expect("a run record always serialises");
                call.key(self.names.history(job))
                    .key(last)
                    .arg(json)
                    .arg(HISTORY_LEN)
                    .arg(&record.finished_at)
                    .arg(kind);
            }
            _ => {
                call.arg("");
            }
        }
        self.holder_tail(&mut call, key);
        Ended::read(self.hold(call).await?)
    }

    /// The call every holder's script (RENEW, FINISH, RETRY, RELEASE) starts with: KEYS run
    /// key, job lock and running set, ARGV token and the running set's member (none for
    /// ad-hoc); the caller adds the script's own.
    fn holder_call(&self, kind: Kind, key: &str, job: Option<&str>, token: &str) -> Call {
        let run = self.names.run_key(key);
        // Without a concurrency group the run key stands in for the slots: the scripts skip it.
        let slots = match &self.limit {
            Some(name) => self.names.limit_slots(name),
            None => run.clone(),
        };
        let mut call = Call::new(kind);
        call.key(run)
            .key(self.job_lock(job))
            .key(self.running_set(job))
            .key(self.names.waiters(job.unwrap_or("")))
            .key(slots)
            .arg(token)
            .arg(if job.is_some() { key } else { "" });
        call
    }

    /// Gives the claim up (its copy is requeued and takes over at once), out of the running
    /// set; the record keeps its attempt. `ours` is `false` if it was not ours.
    pub async fn release(
        &self,
        key: &str,
        job: Option<&str>,
        token: &str,
    ) -> Result<Ended, StoreError> {
        let mut call = self.holder_call(Kind::Release, key, job, token);
        self.holder_tail(&mut call, key);
        Ended::read(self.hold(call).await?)
    }

    /// Registers `waiter`, a copy that found `job`'s overlap lock held, to be published again
    /// by the worker that releases the lock; the registry is kept for `keep`. `false` when the
    /// lock is free already: the copy should look again now.
    pub async fn park(
        &self,
        job: &str,
        waiter: &Waiter,
        keep: Duration,
    ) -> Result<bool, StoreError> {
        PARK.key(self.names.job_running(job))
            .key(self.names.waiters(job))
            .arg(waiter.encode())
            .arg((keep.as_millis() as u64).max(1))
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(StoreError::from)
    }

    /// The first copy waiting for `job`'s overlap lock, taken off the registry, when the lock
    /// is free (a copy that ended without releasing it, a duplicate say, passes the turn on).
    pub async fn wake(&self, job: &str) -> Result<Option<Waiter>, StoreError> {
        let entry: Option<Vec<u8>> = WAKE
            .key(self.names.job_running(job))
            .key(self.names.waiters(job))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(entry.as_deref().and_then(Waiter::decode))
    }

    /// Forgets a `dead` run state so a replayed copy can be claimed; any other state is kept
    /// (a `done` instance stays done: its replayed copy is then a duplicate).
    pub async fn clear_dead(&self, key: &str) -> Result<bool, StoreError> {
        let mut conn = self.conn.clone();
        CLEAR_DEAD
            .key(self.names.run_key(key))
            .invoke_async(&mut conn)
            .await
            .map_err(StoreError::from)
    }

    /// The `state` of each of `keys`, in order (`None`: no record), a few hundred per round
    /// trip.
    pub async fn run_states(&self, keys: &[String]) -> Result<Vec<Option<String>>, StoreError> {
        let mut conn = self.conn.clone();
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(HISTORY_TRIP) {
            let mut pipe = redis::pipe();
            for key in chunk {
                pipe.hget(self.names.run_key(key), "state");
            }
            let states: Vec<Option<String>> = pipe.query_async(&mut conn).await?;
            out.extend(states);
        }
        Ok(out)
    }

    /// The `state` of each of `keys` and whether a claim's lease on it is live now (its
    /// `lease_until` ahead of Redis `TIME`), in `keys` order: what `verify` judges an
    /// instance's end by (docs/audit.md#verify).
    pub async fn run_leases(
        &self,
        keys: &[String],
    ) -> Result<Vec<(Option<String>, bool)>, StoreError> {
        let mut conn = self.conn.clone();
        let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await?;
        let now_ms = secs * 1000 + micros / 1000;
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(HISTORY_TRIP) {
            let mut pipe = redis::pipe();
            for key in chunk {
                pipe.cmd("HMGET")
                    .arg(self.names.run_key(key))
                    .arg("state")
                    .arg("lease_until");
            }
            let read: Vec<(Option<String>, Option<i64>)> = pipe.query_async(&mut conn).await?;
            out.extend(read.into_iter().map(|(state, until)| {
                let live = state.as_deref() == Some("running") && until.is_some_and(|u| u > now_ms);
                (state, live)
            }));
        }
        Ok(out)
    }

    /// The `state` of an instance and when it was written (Unix seconds on Redis `TIME`; a
    /// record written before `at` was kept has none), if the instance is recorded.
    pub async fn run_stamp(&self, key: &str) -> Result<Option<(String, Option<i64>)>, StoreError> {
        let mut conn = self.conn.clone();
        let (state, at): (Option<String>, Option<i64>) = redis::cmd("HMGET")
            .arg(self.names.run_key(key))
            .arg("state")
            .arg("at")
            .query_async(&mut conn)
            .await?;
        Ok(state.map(|s| (s, at)))
    }

    /// Every field of an instance's run record (`state`, `attempt`, `fence`, `worker`, `at`,
    /// `reason`, …); empty when it has none.
    pub async fn run_fields(
        &self,
        key: &str,
    ) -> Result<std::collections::HashMap<String, String>, StoreError> {
        let mut conn = self.conn.clone();
        Ok(conn.hgetall(self.names.run_key(key)).await?)
    }

    /// The `state` field of an instance, if any.
    pub async fn run_state(&self, key: &str) -> Result<Option<String>, StoreError> {
        let mut conn = self.conn.clone();
        Ok(conn.hget(self.names.run_key(key), "state").await?)
    }

    /// Appends a run record to the job's capped history; on `done` also sets `last_success`,
    /// on a failure ([`RunRecord::is_failure`]) `last_failure`, kept for `retention` (the
    /// worker's `done_ttl`: as long as the failed instance's own state).
    pub async fn record(
        &self,
        job: &str,
        record: &RunRecord,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let history = self.names.history(job);
        let json = serde_json::to_string(record).expect("a run record always serialises");
        let mut pipe = redis::pipe();
        pipe.atomic()
            .lpush(&history, json)
            .ignore()
            .ltrim(&history, 0, HISTORY_LEN - 1)
            .ignore();
        if record.status == "done" {
            pipe.set(self.names.last_success(job), &record.finished_at)
                .ignore();
        } else if record.is_failure() {
            let ms = (retention.as_millis() as u64).max(1);
            pipe.pset_ex(self.names.last_failure(job), &record.finished_at, ms)
                .ignore();
        }
        Ok(pipe.query_async::<()>(&mut conn).await?)
    }

    /// The last published instant of `job`, if any.
    pub async fn last_published(&self, job: &str) -> Result<Option<DateTime<Utc>>, StoreError> {
        let mut conn = self.conn.clone();
        let text: Option<String> = conn.get(self.names.beat_last(job)).await?;
        Ok(text.as_deref().and_then(parse_instant))
    }

    /// Every job's persisted progress, in `jobs` order, read with [`parse_last_instant`]:
    /// `None` when the job never ran, `Some(Err(text))` when the value is unreadable. One
    /// pipelined round trip per `per_mget`·`per_trip` jobs (`per_mget` keys per `MGET`).
    pub async fn last_published_many(
        &self,
        jobs: &[&str],
        per_mget: usize,
        per_trip: usize,
    ) -> Result<Vec<Option<Result<DateTime<Utc>, String>>>, StoreError> {
        self.mget_per_job(
            jobs,
            |j| self.names.beat_last(j),
            |_, value| value.map(|text| parse_last_instant(&text).ok_or(text)),
            (per_mget, per_trip),
        )
        .await
    }

    /// One string key per job (`key(job)`), in `jobs` order, each value made into what the
    /// caller keeps by `read(index, value)` as its trip arrives (a million values are never
    /// held as text at once): `per_mget` keys per `MGET`, `per_trip` of those pipelined per
    /// round trip.
    pub(crate) async fn mget_per_job<T>(
        &self,
        jobs: &[&str],
        key: impl Fn(&str) -> String,
        mut read: impl FnMut(usize, Option<String>) -> T,
        (per_mget, per_trip): (usize, usize),
    ) -> Result<Vec<T>, StoreError> {
        let per_mget = per_mget.max(1);
        let mut out = Vec::with_capacity(jobs.len());
        // Two trips in flight: Redis answers one while this side reads the other.
        let mut trips = stream::iter(jobs.chunks(per_mget * per_trip.max(1)))
            .map(|group| {
                let mut pipe = redis::pipe();
                for batch in group.chunks(per_mget) {
                    let keys: Vec<String> = batch.iter().map(|j| key(j)).collect();
                    pipe.cmd("MGET").arg(keys);
                }
                let mut conn = self.conn.clone();
                async move {
                    pipe.query_async::<Vec<Vec<Option<String>>>>(&mut conn)
                        .await
                }
            })
            .buffered(TRIPS_IN_FLIGHT);
        while let Some(replies) = trips.next().await {
            for value in replies?.into_iter().flatten() {
                if out.len() == jobs.len() {
                    return Err(StoreError::bad_reply("MGET returned more values than keys"));
                }
                out.push(read(out.len(), value));
            }
        }
        if out.len() != jobs.len() {
            // MGET answers one value per key; anything else is a broken server or proxy.
            return Err(StoreError::bad_reply(
                "MGET returned fewer values than keys",
            ));
        }
        Ok(out)
    }

    /// The leader lease `{ns}:beat:leader`, if a beat holds it (an unreadable value: `None`).
    pub async fn leader(&self) -> Result<Option<Leader>, StoreError> {
        let mut conn = self.conn.clone();
        let text: Option<String> = conn.get(self.names.beat_leader()).await?;
        Ok(text.and_then(|l| serde_json::from_str(&l).ok()))
    }

    /// Per job, in `jobs` order, what `status` shows: progress, last success and failure,
    /// instances running now, the oldest and the [`RECENT_RUNS`] newest run records. O(jobs),
    /// whatever the number of run records: one pipelined round trip per [`HISTORY_TRIP`] jobs,
    /// no `SCAN`.
    pub async fn job_histories(&self, jobs: &[&str]) -> Result<Vec<JobHistory>, StoreError> {
        let mut conn = self.conn.clone();
        let mut out = Vec::with_capacity(jobs.len());
        for chunk in jobs.chunks(HISTORY_TRIP) {
            let replies: Vec<redis::Value> =
                self.history_trip(chunk).query_async(&mut conn).await?;
            out.extend(read_histories(chunk.len(), replies)?);
        }
        Ok(out)
    }

    /// One round trip of [`job_histories`](Self::job_histories): what Redis holds about the
    /// jobs of `chunk`.
    fn history_trip(&self, chunk: &[&str]) -> redis::Pipeline {
        // The three instants of every job in one MGET (a GET each was a third of Redis's
        // work for a million jobs), then each job's history ends, then the running counts
        // (the script's reply comes last). The ends stay commands: in a script, Redis
        // worked a third longer.
        let mut pipe = redis::pipe();
        let mut instants = redis::cmd("MGET");
        let mut count = RUNNING_COUNTS.prepare_invoke();
        for job in chunk {
            instants
                .arg(self.names.beat_last(job))
                .arg(self.names.last_success(job))
                .arg(self.names.last_failure(job));
            count.key(self.names.running(job));
        }
        pipe.add_command(instants);
        for job in chunk {
            pipe.lindex(self.names.history(job), -1).lrange(
                self.names.history(job),
                0,
                RECENT_RUNS as isize - 1,
            );
        }
        pipe.load_script(&RUNNING_COUNTS)
            .ignore()
            .invoke_script(&count);
        pipe
    }

    /// [`connect`](Self::connect), tried until Redis answers: between tries it waits as
    /// `backoff` says, and hands each failure to `failed` (to log it as the caller sees it: the
    /// beat waits, the worker fails closed).
    pub async fn connect_retrying(
        url: &str,
        ca_file: Option<&Path>,
        names: Names,
        mut backoff: Backoff,
        mut failed: impl FnMut(&StoreError),
    ) -> Self {
        loop {
            match Self::connect(url, ca_file, names.clone()).await {
                Ok(store) => return store,
                Err(e) => {
                    failed(&e);
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
    }
}

/// Jobs per round trip in [`Store::job_histories`].
pub const HISTORY_TRIP: usize = 500;

/// Pipelined round trips kept in flight when reading one key per job ([`Store::mget_per_job`]).
const TRIPS_IN_FLIGHT: usize = 2;

/// Run records per job that [`Store::job_histories`] reads: the newest, for `status` and the
/// status page (docs/design.md#recent-runs).
pub const RECENT_RUNS: usize = 5;

/// The leader lease, as the beat writes it (`{ns}:beat:leader`, JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leader {
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// Leadership epoch.
    pub epoch: u64,
    /// RFC 3339 UTC.
    pub since: String,
}

/// What Redis holds about one job (see [`Store::job_histories`]).
#[derive(Debug, Clone, PartialEq)]
pub struct JobHistory {
    /// The beat's progress `{ns}:beat:last:{job}`, as written.
    pub last_published: Option<DateTime<Utc>>,
    /// `{ns}:last_success:{job}`.
    pub last_success: Option<DateTime<Utc>>,
    /// `{ns}:last_failure:{job}`: when the newest failed, dead or expired run finished.
    pub last_failure: Option<DateTime<Utc>>,
    /// Instances running now: entries of `{ns}:running:{job}` whose lease has not expired.
    pub running: u64,
    /// The oldest run record kept (unreadable: `None`).
    pub oldest: Option<RunRecord>,
    /// The newest run record (unreadable: `None`): the job's last run, its error included.
    pub newest: Option<RunRecord>,
    /// The [`RECENT_RUNS`] newest run records, newest first (unreadable ones left out).
    pub recent: Vec<RunRecord>,
}

/// The histories of the `jobs` jobs of one [`Store::history_trip`], from its replies in order.
fn read_histories(
    jobs: usize,
    mut replies: Vec<redis::Value>,
) -> Result<Vec<JobHistory>, StoreError> {
    let running: Vec<u64> = match replies.pop() {
        Some(value) => redis::from_redis_value(value)?,
        None => Vec::new(),
    };
    if replies.len() != 1 + 2 * jobs || running.len() != jobs {
        return Err(StoreError::bad_reply("status: fewer replies than jobs"));
    }
    let mut replies = replies.into_iter();
    let instants: Vec<Option<String>> = redis::from_redis_value(replies.next().expect("counted"))?;
    if instants.len() != 3 * jobs {
        return Err(StoreError::bad_reply("status: fewer instants than jobs"));
    }
    let ends: Vec<redis::Value> = replies.collect();
    type Ends = (Option<String>, Vec<String>);
    let rows: Vec<Ends> = ends
        .chunks(2)
        .map(|row| redis::from_redis_value(redis::Value::Array(row.to_vec())))
        .collect::<Result<_, _>>()?;
    Ok(instants
        .chunks(3)
        .zip(rows)
        .zip(running)
        .map(|((three, ends), running)| job_history(three, ends, running))
        .collect())
}

/// One job's history from its three instants, its history's ends (the oldest record, the
/// newest few) and its running count; what does not read is `None` or left out.
fn job_history(
    three: &[Option<String>],
    (oldest, recent): (Option<String>, Vec<String>),
    running: u64,
) -> JobHistory {
    let instant = |t: &Option<String>| t.as_deref().and_then(parse_instant);
    let (last, success, failure) = (&three[0], &three[1], &three[2]);
    JobHistory {
        last_published: instant(last),
        last_success: instant(success),
        last_failure: instant(failure),
        running,
        oldest: oldest.and_then(|text| serde_json::from_str(&text).ok()),
        newest: recent
            .first()
            .and_then(|text| serde_json::from_str(text).ok()),
        recent: recent
            .iter()
            .filter_map(|text| serde_json::from_str(text).ok())
            .collect(),
    }
}

/// Reads the claim script's reply; `None` for anything it never returns.
fn parse_claim(reply: &[String]) -> Option<Claim> {
    let text = |i: usize| reply.get(i).cloned();
    let millis =
        |i: usize| -> Option<Duration> { Some(Duration::from_millis(reply.get(i)?.parse().ok()?)) };
    Some(match reply.first()?.as_str() {
        "claimed" => Claim::Claimed {
            fence: reply.get(1)?.parse().ok()?,
        },
        "duplicate" => Claim::Duplicate {
            state: RunState::parse(reply.get(1)?)?,
        },
        "busy" => Claim::Busy {
            retry_in: millis(1)?,
            handover: reply.get(2).is_some_and(|h| h == "1"),
        },
        "skipped" => Claim::Skipped { running: text(1)? },
        "waiting" => Claim::Waiting {
            retry_in: millis(1)?,
            running: text(2)?,
        },
        "expired" => Claim::Expired,
        "limited" => Claim::Limited {
            retry_in: millis(1)?,
            by: match reply.get(2)?.as_str() {
                "concurrency" => LimitedBy::Concurrency,
                "rate" => LimitedBy::Rate,
                _ => return None,
            },
        },
        _ => return None,
    })
}

/// Fixed-width RFC 3339 (milliseconds, `Z`), so Lua can compare instants as strings.
pub fn last_instant_text(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Reads a persisted progress instant (parsed by [`parse_instant`], the one instant codec).
/// [`last_instant_text`] truncates to whole milliseconds, so a value on a millisecond boundary
/// covers that whole millisecond: an instant with sub-millisecond digits is then not decided a
/// second time. A value with sub-millisecond digits (written by hand) is taken as is.
pub fn parse_last_instant(text: &str) -> Option<DateTime<Utc>> {
    let t = parse_instant(text)?;
    if t.timestamp_subsec_nanos() % 1_000_000 == 0 {
        t.checked_add_signed(chrono::TimeDelta::nanoseconds(999_999))
    } else {
        Some(t)
    }
}

/// RFC 3339 UTC, milliseconds, for run records.
pub fn now_text() -> String {
    Utc::now().to_rfc3339_opts(SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiter_reads_back_with_or_without_its_trace() {
        let trace = TraceParent::root();
        for trace in [None, Some(trace)] {
            let waiter = Waiter {
                epoch: 7,
                body: br#"{"key": "k 1"}"#.to_vec(),
                trace,
            };
            assert_eq!(Waiter::decode(&waiter.encode()), Some(waiter));
        }
        // Written before waiters had a trace.
        let old = Waiter::decode(b"3 {}").expect("the old form");
        assert_eq!((old.epoch, old.trace), (3, None));
        assert_eq!(Waiter::decode(b"3:junk {}"), None);
    }
}
