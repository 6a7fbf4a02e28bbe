//! Redis state (DESIGN §4–5). Every read-modify-write is one Lua script, so two workers (or two
//! beats) can never interleave inside it. A claim carries a random token (only its holder may
//! renew, complete or release it) and a fencing token from a monotonic counter (handlers pass it
//! to the systems they write, which reject writes with an older fence).

use crate::envelope::parse_instant;
use crate::names::Names;
use chrono::{DateTime, SecondsFormat, Utc};
use redis::aio::ConnectionManager;
use redis::{AsyncCommands, Script, ToRedisArgs};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use std::sync::LazyLock;
use std::time::Duration;

mod leader;
mod operate;
pub use leader::{Candidate, LeaseMode, LeaseOutcome, LeaseReply, ProgressError};

/// Store errors are connection-level: the worker fails closed on them.
pub type StoreError = redis::RedisError;

/// The `state` field of `{ns}:run:{key}` (DESIGN §5, §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    /// Claimed under a live (or expired, if its holder died) lease.
    Running,
    /// A run failed and attempt `attempt` waits in a delay queue; older copies are duplicates.
    Retrying,
    /// Succeeded.
    Done,
    /// Dead-lettered (permanent failure or retries exhausted).
    Dead,
    /// Not run: the job's previous instance still ran (`overlap = "skip"`).
    Skipped,
}

impl RunState {
    /// The text stored in Redis.
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Running => "running",
            RunState::Retrying => "retrying",
            RunState::Done => "done",
            RunState::Dead => "dead",
            RunState::Skipped => "skipped",
        }
    }

    /// Parses the text stored in Redis.
    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "running" => RunState::Running,
            "retrying" => RunState::Retrying,
            "done" => RunState::Done,
            "dead" => RunState::Dead,
            "skipped" => RunState::Skipped,
            _ => return None,
        })
    }
}

impl std::fmt::Display for RunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A final state a run ends in (what [`Store::finish`] writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Final {
    /// Succeeded.
    Done,
    /// Dead-lettered.
    Dead,
}

impl Final {
    fn as_str(self) -> &'static str {
        match self {
            Final::Done => RunState::Done.as_str(),
            Final::Dead => RunState::Dead.as_str(),
        }
    }
}

/// How a run's claim ends (what [`Store::finish`] writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// In a final state.
    Final(Final),
    /// Handed to the retry carrying `next_attempt`: older copies become duplicates.
    Retry {
        /// The attempt that may claim the instance next.
        next_attempt: u32,
    },
}

/// Outcome of a claim attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// We hold the lease now.
    Claimed {
        /// Fencing token: strictly greater than any earlier claim's in this namespace.
        fence: u64,
    },
    /// A duplicate copy: the instance already finished (`done`, `skipped` or `dead`), or a
    /// later attempt has been recorded (`retrying`, or `running` an attempt after this copy's).
    Duplicate {
        /// The recorded state.
        state: RunState,
    },
    /// Another worker holds a live lease; look again after `retry_in`.
    Busy {
        /// The lease's remaining time.
        retry_in: Duration,
    },
    /// `overlap = "skip"` and the job's previous instance still runs: recorded `skipped`.
    Skipped {
        /// Key of the instance that still runs.
        running: String,
    },
    /// `overlap = "queue"` and the job's previous instance still runs; look again after
    /// `retry_in`.
    Waiting {
        /// The running instance's remaining lease.
        retry_in: Duration,
        /// Key of the instance that still runs.
        running: String,
    },
    /// The copy's `expires_at` has passed and no run of it is recorded or live: nothing was
    /// taken; the caller dead-letters it as `expired`.
    Expired,
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
}

/// What a claim does about the job's other instances (DESIGN §4 step 4).
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
}

/// Most run records kept per job.
pub const HISTORY_LEN: isize = 1000;

// KEYS[1] run key, KEYS[2] fence counter, KEYS[3] job overlap lock (a hash {key, token});
// ARGV token, worker, attempt, lease_ms, overlap (skip | queue | allow), retention_ms, run key
// name as the lock records it, expired (1 | 0). For ad-hoc tasks overlap is `allow` and KEYS[3]
// is unused. Dedupe comes first, so an expired copy of a finished instance is a duplicate; a
// copy older than the recorded attempt is a duplicate, so copies never fork a retry chain.
static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'done' or state == 'skipped' or state == 'dead' then
  return {'duplicate', state}
end
if state == 'running' or state == 'retrying' then
  local recorded = tonumber(redis.call('HGET', KEYS[1], 'attempt')) or 0
  if tonumber(ARGV[3]) < recorded then return {'duplicate', state} end
end
if state == 'running' then
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 then return {'busy', tostring(ttl)} end
end
if ARGV[8] == '1' then return {'expired'} end
if ARGV[5] ~= 'allow' then
  local holder = redis.call('HGET', KEYS[3], 'key')
  if holder and holder ~= ARGV[7] then
    if ARGV[5] == 'skip' then
      redis.call('DEL', KEYS[1])
      redis.call('HSET', KEYS[1], 'state', 'skipped', 'worker', ARGV[2], 'attempt', ARGV[3],
        'overlapped', holder)
      redis.call('PEXPIRE', KEYS[1], ARGV[6])
      return {'skipped', holder}
    end
    local ttl = redis.call('PTTL', KEYS[3])
    if ttl < 1 then ttl = 1 end
    return {'waiting', tostring(ttl), holder}
  end
end
local fence = redis.call('INCR', KEYS[2])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'state', 'running', 'token', ARGV[1], 'worker', ARGV[2],
  'fence', fence, 'attempt', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if ARGV[5] ~= 'allow' then
  redis.call('DEL', KEYS[3])
  redis.call('HSET', KEYS[3], 'key', ARGV[7], 'token', ARGV[1])
  redis.call('PEXPIRE', KEYS[3], ARGV[4])
end
return {'claimed', tostring(fence)}
"#,
    )
});

// KEYS[1] run key, KEYS[2] job lock; ARGV token, lease_ms.
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('HGET', KEYS[1], 'token') == ARGV[1]
   and redis.call('HGET', KEYS[1], 'state') == 'running' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if redis.call('HGET', KEYS[2], 'token') == ARGV[1] then
    redis.call('PEXPIRE', KEYS[2], ARGV[2])
  end
  return 1
end
return 0
"#,
    )
});

// The start every script that ends a claim shares (KEYS[1] run key, KEYS[2] job lock, ARGV[1]
// token): the job lock is released if it is ours, whatever happens to the run key; `ours` says
// whether the run key carries our token, `holds` whether it is still our running claim.
const END_CLAIM: &str = r#"
if redis.call('HGET', KEYS[2], 'token') == ARGV[1] then
  redis.call('DEL', KEYS[2])
end
local ours = redis.call('HGET', KEYS[1], 'token') == ARGV[1]
local holds = ours and redis.call('HGET', KEYS[1], 'state') == 'running'
"#;

/// A script that starts with [`END_CLAIM`] and goes on with `body`.
fn ending_claim(body: &str) -> Script {
    Script::new(&format!("{END_CLAIM}{body}"))
}

// ARGV[2] final state, ARGV[3] retention_ms. Also applies when the key is gone (our lease
// expired and nobody claimed it since): the run did finish, and recording it is what stops it
// from running again.
static FINISH: LazyLock<Script> = LazyLock::new(|| {
    ending_claim(
        r#"
if holds or redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'state', ARGV[2], 'token', ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
"#,
    )
});

// ARGV[2] next attempt, ARGV[3] retention_ms. A failed run hands the instance to its retry: the
// state stays, marked `retrying` with the attempt that may claim it next, so older copies are
// duplicates instead of a second chain.
static RETRY: LazyLock<Script> = LazyLock::new(|| {
    ending_claim(
        r#"
if not holds then return 0 end
redis.call('HSET', KEYS[1], 'state', 'retrying', 'attempt', ARGV[2])
redis.call('HDEL', KEYS[1], 'token')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"#,
    )
});

// No further ARGV: the run key is deleted if the claim is ours, in any state.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    ending_claim(
        r#"
if ours then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#,
    )
});

// KEYS[1] run key.
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
    conn: ConnectionManager,
    names: Names,
}

impl Store {
    /// Connects (and keeps reconnecting in the background) to `url`. With `ca_file`, a
    /// `rediss://` server must present a certificate issued by a CA in that file (the system
    /// roots are then not consulted); without, by a system root. Unused by `redis://`.
    pub async fn connect(
        url: &str,
        ca_file: Option<&Path>,
        names: Names,
    ) -> Result<Self, StoreError> {
        let client = match ca_file {
            Some(path) => {
                // Checked at config load already; this only fails if the file changed since.
                let ca = crate::tls::read_ca_file(path).map_err(|e| {
                    StoreError::from((
                        redis::ErrorKind::InvalidClientConfig,
                        "ca_file",
                        e.to_string(),
                    ))
                })?;
                let certs = redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(ca.pem),
                };
                redis::Client::build_with_tls(url, certs)?
            }
            None => redis::Client::open(url)?,
        };
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(5)))
            .set_number_of_retries(1);
        let conn = ConnectionManager::new_with_config(client, config).await?;
        Ok(Self { conn, names })
    }

    /// The names this store uses.
    pub fn names(&self) -> &Names {
        &self.names
    }

    /// A raw connection, for callers that need a command not wrapped here.
    pub fn connection(&self) -> ConnectionManager {
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

    /// Tries to claim instance `key` for `lease`. With an overlap mode other than `Allow` the
    /// claim also takes the job's overlap lock; a `skipped` state is kept for `retention`.
    pub async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let ClaimRequest {
            key,
            token,
            worker,
            attempt,
            lease,
            overlap,
            retention,
            expired,
        } = *req;
        let mut conn = self.conn.clone();
        let (mode, job) = overlap.parts();
        let reply: Vec<String> = CLAIM
            .key(self.names.run_key(key))
            .key(self.names.fence())
            .key(self.job_lock(job))
            .arg(token)
            .arg(worker)
            .arg(attempt)
            .arg(lease.as_millis() as u64)
            .arg(mode)
            .arg(retention.as_millis() as u64)
            .arg(key)
            .arg(if expired { "1" } else { "0" })
            .invoke_async(&mut conn)
            .await?;
        parse_claim(&reply).ok_or_else(|| {
            StoreError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "unexpected reply from the claim script",
                format!("{reply:?}"),
            ))
        })
    }

    /// The overlap lock key for `job`; ad-hoc claims pass a key no script writes to.
    fn job_lock(&self, job: Option<&str>) -> String {
        match job {
            Some(job) => self.names.job_running(job),
            None => self.names.job_running(""),
        }
    }

    /// Extends our lease; `false` means it is no longer ours.
    pub async fn renew(
        &self,
        key: &str,
        job: Option<&str>,
        token: &str,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let args = (token, lease.as_millis() as u64);
        self.as_holder(&RENEW, key, job, args).await
    }

    /// Ends our claim as `ending` says, the record kept for `retention`, job lock released.
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
    ) -> Result<bool, StoreError> {
        let retention = retention.as_millis() as u64;
        match ending {
            Ending::Final(state) => {
                let args = (token, state.as_str(), retention);
                self.as_holder(&FINISH, key, job, args).await
            }
            Ending::Retry { next_attempt } => {
                let args = (token, next_attempt, retention);
                self.as_holder(&RETRY, key, job, args).await
            }
        }
    }

    /// Runs one of the scripts only the claim's holder may run (RENEW, FINISH, RETRY,
    /// RELEASE); they share their call: KEYS run key and job lock, ARGV `args`, token first.
    async fn as_holder(
        &self,
        script: &Script,
        key: &str,
        job: Option<&str>,
        args: impl ToRedisArgs,
    ) -> Result<bool, StoreError> {
        let mut conn = self.conn.clone();
        script
            .key(self.names.run_key(key))
            .key(self.job_lock(job))
            .arg(args)
            .invoke_async(&mut conn)
            .await
    }

    /// Gives the claim up (a retry will claim again); `false` if it was not ours.
    pub async fn release(
        &self,
        key: &str,
        job: Option<&str>,
        token: &str,
    ) -> Result<bool, StoreError> {
        self.as_holder(&RELEASE, key, job, token).await
    }

    /// Forgets a `dead` run state so a replayed copy can be claimed; any other state is kept
    /// (a `done` instance stays done: its replayed copy is then a duplicate).
    pub async fn clear_dead(&self, key: &str) -> Result<bool, StoreError> {
        let mut conn = self.conn.clone();
        CLEAR_DEAD
            .key(self.names.run_key(key))
            .invoke_async(&mut conn)
            .await
    }

    /// The `state` field of an instance, if any.
    pub async fn run_state(&self, key: &str) -> Result<Option<String>, StoreError> {
        let mut conn = self.conn.clone();
        conn.hget(self.names.run_key(key), "state").await
    }

    /// Appends a run record to the job's capped history; on `done` also sets `last_success`.
    pub async fn record(&self, job: &str, record: &RunRecord) -> Result<(), StoreError> {
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
        }
        pipe.query_async::<()>(&mut conn).await
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
        let mut conn = self.conn.clone();
        let per_mget = per_mget.max(1);
        let mut out = Vec::with_capacity(jobs.len());
        for group in jobs.chunks(per_mget * per_trip.max(1)) {
            let mut pipe = redis::pipe();
            for batch in group.chunks(per_mget) {
                let keys: Vec<String> = batch.iter().map(|j| self.names.beat_last(j)).collect();
                pipe.cmd("MGET").arg(keys);
            }
            let replies: Vec<Vec<Option<String>>> = pipe.query_async(&mut conn).await?;
            out.extend(
                replies
                    .into_iter()
                    .flatten()
                    .map(|value| value.map(|text| parse_last_instant(&text).ok_or(text))),
            );
        }
        if out.len() != jobs.len() {
            // MGET answers one value per key; anything else is a broken server or proxy.
            return Err(StoreError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "MGET returned fewer values than keys",
            )));
        }
        Ok(out)
    }

    /// The leader lease `{ns}:beat:leader`, if a beat holds it (an unreadable value: `None`).
    pub async fn leader(&self) -> Result<Option<Leader>, StoreError> {
        let mut conn = self.conn.clone();
        let text: Option<String> = conn.get(self.names.beat_leader()).await?;
        Ok(text.and_then(|l| serde_json::from_str(&l).ok()))
    }

    /// Per job, in `jobs` order: its progress, last success, newest `lookback` run records and
    /// oldest record (unreadable records are left out), [`HISTORY_TRIP`] jobs per round trip.
    pub async fn job_histories(
        &self,
        jobs: &[&str],
        lookback: usize,
    ) -> Result<Vec<JobHistory>, StoreError> {
        let mut conn = self.conn.clone();
        let record = |text: &str| serde_json::from_str::<RunRecord>(text).ok();
        let mut out = Vec::with_capacity(jobs.len());
        for chunk in jobs.chunks(HISTORY_TRIP) {
            let mut pipe = redis::pipe();
            for job in chunk {
                let history = self.names.history(job);
                pipe.get(self.names.beat_last(job))
                    .get(self.names.last_success(job))
                    .lrange(&history, 0, lookback as isize - 1)
                    .lindex(&history, -1);
            }
            type Row = (Option<String>, Option<String>, Vec<String>, Option<String>);
            let rows: Vec<Row> = pipe.query_async(&mut conn).await?;
            out.extend(rows.into_iter().map(|(last, success, recent, oldest)| {
                let instant = |t: Option<String>| t.as_deref().and_then(parse_instant);
                JobHistory {
                    last_published: instant(last),
                    last_success: instant(success),
                    recent: recent.iter().filter_map(|h| record(h)).collect(),
                    oldest: oldest.as_deref().and_then(record),
                }
            }));
        }
        Ok(out)
    }

    /// How many instances of each job are `running` now: one `SCAN` over `{ns}:run:*`, then
    /// their states pipelined. Ad-hoc runs (keys without `@`) belong to no job.
    pub async fn running_counts(&self) -> Result<HashMap<String, u64>, StoreError> {
        let mut conn = self.conn.clone();
        let prefix = self.names.run_key("");
        let mut keys = Vec::new();
        {
            let mut iter: redis::AsyncIter<String> = conn.scan_match(format!("{prefix}*")).await?;
            while let Some(key) = iter.next_item().await {
                keys.push(key?);
            }
        }
        let mut counts = HashMap::new();
        for chunk in keys.chunks(1000) {
            let mut pipe = redis::pipe();
            for key in chunk {
                pipe.hget(key, "state");
            }
            let states: Vec<Option<String>> = pipe.query_async(&mut conn).await?;
            for (key, state) in chunk.iter().zip(states) {
                if state.as_deref() != Some(RunState::Running.as_str()) {
                    continue;
                }
                // {ns}:run:{job}@{instant}
                if let Some((job, _)) = key[prefix.len()..].rsplit_once('@') {
                    *counts.entry(job.to_owned()).or_insert(0) += 1;
                }
            }
        }
        Ok(counts)
    }

    /// [`connect`](Self::connect), tried until Redis answers: between tries it waits `min`,
    /// doubling up to `max`, and hands each failure to `failed` (to log it as the caller sees
    /// it: the beat waits, the worker fails closed).
    pub async fn connect_retrying(
        url: &str,
        ca_file: Option<&Path>,
        names: Names,
        (min, max): (Duration, Duration),
        mut failed: impl FnMut(&StoreError),
    ) -> Self {
        let mut backoff = min;
        loop {
            match Self::connect(url, ca_file, names.clone()).await {
                Ok(store) => return store,
                Err(e) => {
                    failed(&e);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(max);
                }
            }
        }
    }
}

/// Jobs per round trip in [`Store::job_histories`].
pub const HISTORY_TRIP: usize = 500;

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
    /// The newest run records, newest first.
    pub recent: Vec<RunRecord>,
    /// The oldest run record kept.
    pub oldest: Option<RunRecord>,
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
        },
        "skipped" => Claim::Skipped { running: text(1)? },
        "waiting" => Claim::Waiting {
            retry_in: millis(1)?,
            running: text(2)?,
        },
        "expired" => Claim::Expired,
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
