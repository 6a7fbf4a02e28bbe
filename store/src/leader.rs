//! The beat's leader lease and the progress only its holder may write
//! (docs/design.md#leadership). `{ns}:beat:leader` holds `{host, pid, epoch, since, token}` with a TTL of one
//! lease; each acquisition takes the next `{ns}:beat:epoch`. Every script compares the caller's
//! token with the lease's, so a beat that lost the lease (a pause, a partition) can neither
//! renew it, release another's, nor move any job's progress. Each reply carries Redis `TIME`:
//! the one clock every beat shares, against which progress is capped.

use super::{last_instant_text, Store, StoreError};
use chrono::{DateTime, Utc};
use redis::{Script, ScriptInvocation};
use std::sync::LazyLock;
use std::time::Duration;

/// Who asks for the lease.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// Random, per process: only its holder may renew or release the lease, or write progress.
    pub token: String,
    /// Host name, for people.
    pub host: String,
    /// Process id, for people.
    pub pid: u32,
}

/// What a lease try may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseMode {
    /// A standby's try: take the lease if it is free.
    Acquire,
    /// A leader's try: extend the lease it holds, never take a free one.
    Renew,
}

/// What a lease try found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseOutcome {
    /// The lease was free: we hold it now, under a new epoch.
    Acquired {
        /// The new epoch.
        epoch: u64,
    },
    /// We held the lease and extended it by one lease.
    Renewed {
        /// Our epoch.
        epoch: u64,
    },
    /// Another beat holds it (on acquire), or we do not hold it any more (on renew).
    Refused {
        /// The holder's epoch; 0 when no beat holds the lease (a lapsed renew).
        holder: u64,
    },
}

/// A lease try's outcome and Redis's clock when the script ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseReply {
    /// What the try found.
    pub outcome: LeaseOutcome,
    /// Redis `TIME`, to the millisecond.
    pub redis_time: DateTime<Utc>,
}

/// Why a fenced progress write was not applied.
#[derive(Debug, thiserror::Error)]
pub enum ProgressError {
    /// Redis did not answer, or answered something else than the script returns.
    #[error(transparent)]
    Redis(#[from] StoreError),
    /// The caller's token does not hold the leader lease: a deposed leader moves nothing.
    #[error("this beat does not hold the leader lease")]
    Deposed,
    /// The instant is further ahead of Redis `TIME` than allowed (a beat whose clock runs
    /// ahead); nothing was written for this job.
    #[error("{at} is more than the misfire threshold ahead of redis TIME")]
    Ahead {
        /// The refused instant.
        at: DateTime<Utc>,
    },
}

impl From<redis::RedisError> for ProgressError {
    fn from(e: redis::RedisError) -> Self {
        ProgressError::Redis(e.into())
    }
}

/// The lease's JSON is written by the script (so `since` and `epoch` come from Redis), and a
/// token is compared by decoding it: a value that is not our JSON is someone else's.
pub(super) const HELD_BY: &str = r#"
local function held_by(key, token)
  local cur = redis.call('GET', key)
  if not cur then return nil end
  local ok, lease = pcall(cjson.decode, cur)
  if ok and type(lease) == 'table' and lease.token == token then return lease end
  return nil
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"#;

/// One job's progress write, shared by the fenced scripts: `advance(key, text, ms, limit)` sets
/// `key` to the instant `text` (fixed-width RFC 3339, so string order is time order) unless it
/// already holds a later one, and returns 1; 0 (nothing written) when `ms` is past `limit`; -1
/// (nothing written) when `key` holds a value that is not a string.
pub(super) const ADVANCE: &str = r#"
local function advance(key, text, ms, limit)
  if ms > limit then return 0 end
  local cur = redis.pcall('GET', key)
  if type(cur) == 'table' and cur.err then return -1 end
  if cur == false or cur < text then redis.call('SET', key, text) end
  return 1
end
"#;

/// A fenced progress script: `body` runs only while `ARGV[1]` holds the lease `KEYS[1]` (else
/// the reply is `{0}`), with `limit` (Redis `TIME` plus `ARGV[2]` ms), `advance` and `out =
/// {1}`, which it fills with one code per job and returns.
pub(super) fn fenced_script(body: &str) -> Script {
    Script::new(&format!(
        "{HELD_BY}{ADVANCE}{}{body}",
        r#"
if not held_by(KEYS[1], ARGV[1]) then return {0} end
local limit = now_ms() + tonumber(ARGV[2])
local out = {1}
"#
    ))
}

/// RFC 3339 (UTC, milliseconds) of a Unix time in ms: days to civil date after H. Hinnant's
/// `civil_from_days`.
pub const RFC3339: &str = r#"
local function rfc3339(ms)
  local s = math.floor(ms / 1000)
  local days = math.floor(s / 86400)
  local rem = s - days * 86400
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400 + (m <= 2 and 1 or 0)
  return string.format('%04d-%02d-%02dT%02d:%02d:%02d.%03dZ', y, m, d,
    math.floor(rem / 3600), math.floor(rem % 3600 / 60), rem % 60, ms % 1000)
end
"#;

// LEAD
// KEYS[1] -> {ns}:beat:leader        the lease (JSON: host, pid, epoch, since, token)
// KEYS[2] -> {ns}:beat:epoch         the epoch counter
// ARGV[1] -> token    ARGV[2] -> lease in ms    ARGV[3] -> host    ARGV[4] -> pid
// ARGV[5] -> acquire | renew
// Output: {code, epoch, redis_ms}: 1 acquired | 2 renewed | 0 refused (epoch: the holder's, 0
// for none). `renew` never acquires: a leader whose lease lapsed has to come back through
// `acquire`, under a new epoch.
static LEAD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{HELD_BY}{RFC3339}{}",
        r#"
local now = now_ms()
local mine = held_by(KEYS[1], ARGV[1])
if mine then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {2, tonumber(mine.epoch), now}
end
local cur = redis.call('GET', KEYS[1])
if ARGV[5] == 'renew' or cur then
  local ok, lease = pcall(cjson.decode, cur or '')
  local holder = ok and type(lease) == 'table' and tonumber(lease.epoch) or 0
  return {0, holder, now}
end
local epoch = redis.call('INCR', KEYS[2])
local lease = cjson.encode({host = ARGV[3], pid = tonumber(ARGV[4]), epoch = epoch,
  since = rfc3339(now), token = ARGV[1]})
redis.call('SET', KEYS[1], lease, 'PX', ARGV[2])
return {1, epoch, now}
"#
    ))
});

// RESIGN
// KEYS[1] -> {ns}:beat:leader        ARGV[1] -> token
// Output: 1 deleted (it was ours) | 0 left alone
static RESIGN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{HELD_BY}{}",
        r#"
if held_by(KEYS[1], ARGV[1]) then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#
    ))
});

// ADVANCE_FENCED
// KEYS[1]     -> {ns}:beat:leader            the lease that fences the write
// KEYS[2..n]  -> {ns}:beat:last:{job}        progress keys
// ARGV[1]     -> token                       ARGV[2] -> most ms ahead of Redis TIME
// ARGV[2i-1], ARGV[2i] (i = 2..n) -> KEYS[i]'s instant as fixed-width RFC 3339 text (string
//                order is time order) and as Unix ms
// Output: {0} the token does not hold the lease (nothing written) | {1, per key: 1 written
// or already further, 0 refused as ahead, -1 its value is not a string}. One job's broken key
// fails that job alone.
static ADVANCE_FENCED: LazyLock<Script> = LazyLock::new(|| {
    fenced_script(
        r#"
for i = 2, #KEYS do
  out[i] = advance(KEYS[i], ARGV[2 * i - 1], tonumber(ARGV[2 * i]), limit)
end
return out
"#,
    )
});

impl Store {
    /// One lease try for `lease`: [`LeaseMode::Acquire`] takes the lease when no beat holds it
    /// (a new epoch) or extends it when `who` holds it already; [`LeaseMode::Renew`] only
    /// extends it, and is [`LeaseOutcome::Refused`] when `who` does not hold it any more (it
    /// lapsed, or another beat took it). With `wait_replicas` ([`Store::with_wait`]), an error
    /// unless that many replicas have the lease.
    pub async fn lead(
        &self,
        who: &Candidate,
        lease: Duration,
        mode: LeaseMode,
    ) -> Result<LeaseReply, StoreError> {
        let mode = match mode {
            LeaseMode::Acquire => "acquire",
            LeaseMode::Renew => "renew",
        };
        let mut call = LEAD.prepare_invoke();
        call.key(self.names.beat_leader())
            .key(self.names.beat_epoch())
            .arg(&who.token)
            .arg(lease.as_millis().max(1) as u64)
            .arg(&who.host)
            .arg(who.pid)
            .arg(mode);
        // A durable write: with `wait_replicas`, a lease too few replicas have is no lease, so
        // a primary cut off from its replicas keeps no leader (docs/design.md#leadership).
        let (code, epoch, ms): (i64, u64, i64) = self.durable(&LEAD, &call).await?;
        let outcome = match code {
            1 => LeaseOutcome::Acquired { epoch },
            2 => LeaseOutcome::Renewed { epoch },
            0 => LeaseOutcome::Refused { holder: epoch },
            _ => return Err(unexpected("the lease script returned an unknown code")),
        };
        let redis_time = DateTime::from_timestamp_millis(ms)
            .ok_or_else(|| unexpected("redis TIME is out of range"))?;
        Ok(LeaseReply {
            outcome,
            redis_time,
        })
    }

    /// Releases the lease if `token` holds it (a clean stop, so a standby leads at its next
    /// try); `false` when it did not.
    pub async fn resign_lead(&self, token: &str) -> Result<bool, StoreError> {
        let mut conn = self.conn.clone();
        RESIGN
            .key(self.names.beat_leader())
            .arg(token)
            .invoke_async(&mut conn)
            .await
            .map_err(StoreError::from)
    }

    /// Moves each `(job, instant)`'s progress forward (never back) while `token` holds the
    /// leader lease, refusing an instant more than `max_ahead` after Redis `TIME`: `per_call`
    /// jobs per script call, every call of one write pipelined. One outcome per entry, in order;
    /// `Err` when Redis failed or the lease is not `token`'s (then calls before the loss may
    /// have been applied, which is harmless: each moved progress only forward, to instants the
    /// holder had published).
    pub async fn advance_progress(
        &self,
        token: &str,
        progress: &[(&str, DateTime<Utc>)],
        max_ahead: Duration,
        per_call: usize,
    ) -> Result<Vec<Result<(), ProgressError>>, ProgressError> {
        let call = FencedCall::new(&ADVANCE_FENCED, "progress", token, max_ahead, per_call);
        let add = |call: &mut ScriptInvocation, (job, at): &(&str, DateTime<Utc>)| {
            call.key(self.names.beat_last(job))
                .arg(last_instant_text(*at))
                .arg(at.timestamp_millis());
        };
        self.fenced_write(call, progress, add, |(_, at)| *at).await
    }

    /// Writes `entries` through `call.script`, `call.per_call` entries per script call (`add`
    /// puts one entry's keys and arguments), in one round trip as a durable write, and reads
    /// each call's reply: `1` and one code per entry (`1` written, `0` ahead of Redis `TIME`:
    /// the entry's instant is `at` of it), or `0` when the lease is not the caller's.
    pub(super) async fn fenced_write<E>(
        &self,
        call: FencedCall<'_>,
        entries: &[E],
        add: impl Fn(&mut ScriptInvocation, &E),
        at: impl Fn(&E) -> DateTime<Utc>,
    ) -> Result<Vec<Result<(), ProgressError>>, ProgressError> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let chunks: Vec<&[E]> = entries.chunks(call.per_call.max(1)).collect();
        let mut pipe = redis::pipe();
        // EVALSHA needs the script cached (a restarted Redis forgot it): load it in the same
        // round trip.
        pipe.load_script(call.script).ignore();
        for chunk in &chunks {
            let mut invocation = call.script.prepare_invoke();
            invocation
                .key(self.names.beat_leader())
                .arg(call.token)
                .arg(call.max_ahead.as_millis() as u64);
            for entry in *chunk {
                add(&mut invocation, entry);
            }
            pipe.invoke_script(&invocation);
        }
        let what = call.what;
        let mut conn = self.conn.clone();
        self.push_wait(&mut pipe);
        let mut replies: Vec<redis::Value> = pipe.query_async(&mut conn).await?;
        self.check_wait(&mut replies)?;
        let replies: Vec<Vec<i64>> =
            redis::from_redis_value(redis::Value::Array(replies)).map_err(StoreError::from)?;
        if replies.len() != chunks.len() {
            return Err(unexpected("a pipeline returned fewer replies than calls").into());
        }
        let mut out = Vec::with_capacity(chunks.iter().map(|c| c.len()).sum());
        for (chunk, reply) in chunks.iter().zip(replies) {
            match reply.split_first() {
                Some((1, codes)) if codes.len() == chunk.len() => {
                    out.extend(chunk.iter().zip(codes).map(|(entry, code)| match code {
                        1 => Ok(()),
                        0 => Err(ProgressError::Ahead { at: at(entry) }),
                        _ => Err(
                            unexpected("the job's progress key holds a non-string value").into(),
                        ),
                    }))
                }
                Some((0, _)) => return Err(ProgressError::Deposed),
                _ => {
                    let e = format!("the {what} script returned an unknown reply");
                    return Err(StoreError::bad_reply(e).into());
                }
            }
        }
        Ok(out)
    }

    /// Redis `TIME`.
    pub async fn redis_time(&self) -> Result<DateTime<Utc>, StoreError> {
        let mut conn = self.conn.clone();
        let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await?;
        DateTime::from_timestamp(secs, (micros * 1000) as u32)
            .ok_or_else(|| unexpected("redis TIME is out of range"))
    }
}

/// The fenced script a [`Store::fenced_write`] calls and what every call of it carries.
pub(super) struct FencedCall<'a> {
    /// `ADVANCE_FENCED` or `START_FENCED`.
    script: &'a Script,
    /// The script's name in an error about its reply.
    what: &'static str,
    /// The caller's leader token.
    token: &'a str,
    /// Most an instant may be ahead of Redis `TIME`.
    max_ahead: Duration,
    /// Entries per script call.
    per_call: usize,
}

impl<'a> FencedCall<'a> {
    pub(super) fn new(
        script: &'a Script,
        what: &'static str,
        token: &'a str,
        max_ahead: Duration,
        per_call: usize,
    ) -> Self {
        FencedCall {
            script,
            what,
            token,
            max_ahead,
            per_call,
        }
    }
}

fn unexpected(what: &'static str) -> StoreError {
    StoreError::bad_reply(what)
}
