//! When to publish what (DESIGN §2). The decision is pure — [`plan`] takes the job, the last
//! decided instant and `now` — so misfire policies are tested on fixed instants; [`run`] is the
//! loop that feeds it the wall clock, publishes, and persists progress once the broker confirmed.
//!
//! Progress is one instant per job, `{ns}:beat:last:{job}`: everything up to it has been
//! decided (published, or dropped and reported). Because it is persisted and only moves
//! forward, the same planning covers every way of missing instances — a beat restart, a broker
//! or Redis outage, a forward wall-clock jump — and a backward jump finds nothing to do.
//!
//! Jobs due together (100,000 on the minute is a supported size) are handled in batches of up
//! to [`BATCH_JOBS`] jobs or [`BATCH_MESSAGES`] messages: every message of a batch is sent
//! before the first confirm is awaited, and the batch's progress is written in one Redis round
//! trip, so a batch costs a few round trips rather than two per message.

use crate::publisher::{PublishError, Publisher};
use chrono::{DateTime, TimeDelta, Utc};
use drumline_shared::config::{Config, Job, Misfire};
use drumline_shared::envelope::{instance_key, Envelope};
use drumline_shared::names::Names;
use drumline_shared::schedule::Schedule;
use drumline_shared::store::{last_instant_text, Store, StoreError};
use drumline_shared::url::Redacted;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{error, info, warn};

/// Dropped instances listed one by one (each logged with its key) per planning step; the rest
/// are counted and logged as one range (a 1-second job down for a day misses 86,400).
pub const MAX_LISTED: usize = 1000;

/// Cron instances missed by more than `misfire_grace` that one planning step counts by walking
/// the schedule beyond the listed ones; past that the count is a lower bound and the walk jumps
/// to the grace edge. (`every` instances are counted exactly, by arithmetic, at no cost.)
pub const MAX_COUNTED: u64 = 1_000_000;

/// Keys per `MGET` when the beat loads every job's last instant at start.
pub const LOAD_BATCH: usize = 1000;

/// `MGET`s sent per round trip (pipelined) at start.
pub const LOAD_PIPELINE: usize = 10;

/// Most jobs planned and published together (see the module doc).
pub const BATCH_JOBS: usize = 1000;

/// Most messages published together; a job with more to publish (a long catch-up) goes on in
/// the next batch.
pub const BATCH_MESSAGES: usize = 5000;

/// Progress writes per Redis round trip (at start, every new job's first start).
pub const SAVE_PIPELINE: usize = 10_000;

/// Stalled jobs logged one by one per batch; the rest are counted in one line.
pub const STALLS_LISTED: usize = 10;

/// First wait before a job whose own message failed is tried again (alone); doubled per
/// consecutive failure up to [`ISOLATED_BACKOFF_MAX`].
pub const ISOLATED_BACKOFF: Duration = Duration::from_millis(200);

/// Longest wait between two tries of a job whose own message keeps failing.
pub const ISOLATED_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Why an instance was not published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// Missed by more than `misfire_grace`.
    PastGrace,
    /// Missed, and the policy (`run_once`, `skip`, `catch_up` beyond `max_catch_up`) drops it.
    Policy(Misfire),
    /// `expires` had already passed when it came due.
    Expired,
}

impl Dropped {
    /// Short text for logs.
    pub fn reason(self) -> &'static str {
        match self {
            Dropped::PastGrace => "missed by more than misfire_grace",
            Dropped::Policy(Misfire::RunOnce) => {
                "missed; misfire = run_once publishes only the latest"
            }
            Dropped::Policy(Misfire::CatchUp) => "missed; beyond max_catch_up",
            Dropped::Policy(Misfire::Skip) => "missed; misfire = skip",
            Dropped::Expired => "expired before it could be published",
        }
    }
}

/// Dropped instances beyond the [`MAX_LISTED`] listed ones: counted, not listed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unlisted {
    /// How many.
    pub count: u64,
    /// The oldest of them.
    pub first: Option<DateTime<Utc>>,
    /// The newest of them that was counted.
    pub last: Option<DateTime<Utc>>,
    /// True when a cron walk stopped counting at [`MAX_COUNTED`]: `count` is a lower bound.
    pub lower_bound: bool,
}

/// What to do with the instants in `(last, now]`.
///
/// Every dropped instant is older than every instant to publish (drops are the oldest missed
/// ones, past grace or beyond the policy, and expiry takes the oldest first), so the drops can be
/// settled before the first publish: a publish that fails does not make them count twice.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Publish these, oldest first.
    pub publish: Vec<DateTime<Utc>>,
    /// Do not publish these, oldest first (each is logged with its key and counted); at most
    /// [`MAX_LISTED`].
    pub dropped: Vec<(DateTime<Utc>, Dropped)>,
    /// Further dropped instances, newer than the listed ones, counted but not listed.
    pub unlisted: Unlisted,
    /// Everything up to here is dropped or older than `last`; older than every `publish`.
    pub dropped_up_to: Option<DateTime<Utc>>,
    /// The newest instant decided: persisted once everything before it is published.
    pub decided_up_to: Option<DateTime<Utc>>,
}

impl Plan {
    /// Instances not published (listed and unlisted).
    pub fn dropped_count(&self) -> u64 {
        self.dropped.len() as u64 + self.unlisted.count
    }
}

/// The dropped instants of a plan being built.
#[derive(Default)]
struct Drops {
    listed: Vec<(DateTime<Utc>, Dropped)>,
    unlisted: Unlisted,
    up_to: Option<DateTime<Utc>>,
}

impl Drops {
    fn push(&mut self, t: DateTime<Utc>, why: Dropped) {
        if self.listed.len() < MAX_LISTED {
            self.listed.push((t, why));
            self.up_to = Some(t);
        } else {
            self.add_unlisted(1, t, t);
        }
    }

    fn listing_full(&self) -> bool {
        self.listed.len() >= MAX_LISTED
    }

    fn add_unlisted(&mut self, count: u64, first: DateTime<Utc>, last: DateTime<Utc>) {
        self.unlisted.count += count;
        self.unlisted.first.get_or_insert(first);
        self.unlisted.last = Some(last);
        self.up_to = Some(last);
    }
}

/// Decides the instants of `job` in `(last, now]`. An instant is *missed* when `now` is more than
/// `threshold` past it; missed ones follow the job's `misfire` policy (`run_once` keeps the
/// latest missed, `catch_up` the `max_catch_up` latest, `skip` none), and those more than
/// `misfire_grace` old are never published. Instants within `threshold` are on time and always
/// published. Instants whose `expires` has passed are dropped whatever the policy.
pub fn plan(job: &Job, last: DateTime<Utc>, now: DateTime<Utc>, threshold: Duration) -> Plan {
    // `None`: the duration reaches before the start of time, so nothing is that old.
    let older_than = |d: Duration| {
        chrono::Duration::from_std(d)
            .ok()
            .and_then(|d| now.checked_sub_signed(d))
    };
    let missed_before = older_than(threshold);
    let stale_before = older_than(job.misfire_grace);
    let keep = match job.misfire {
        Misfire::RunOnce => 1,
        Misfire::CatchUp => job.max_catch_up,
        Misfire::Skip => 0,
    };

    let mut drops = Drops::default();
    // Missed within grace: only the newest `keep` are kept, the older ones dropped on the way.
    let mut missed: VecDeque<DateTime<Utc>> = VecDeque::new();
    let mut on_time = Vec::new();
    let mut cursor = last;
    while let Some(t) = job.schedule.next_after(cursor) {
        if t > now {
            break;
        }
        cursor = t;
        if let Some(stale) = stale_before.filter(|s| t < *s) {
            drops.push(t, Dropped::PastGrace);
            if drops.listing_full() {
                if let Some(jump) = count_stale(&job.schedule, t, stale, &mut drops) {
                    cursor = jump;
                }
            }
        } else if missed_before.is_some_and(|m| t < m) {
            missed.push_back(t);
            if missed.len() > keep {
                let oldest = missed.pop_front().expect("longer than keep");
                drops.push(oldest, Dropped::Policy(job.misfire));
            }
        } else {
            on_time.push(t);
        }
    }

    let mut publish: Vec<_> = missed.into_iter().chain(on_time).collect();
    if let Some(expires) = job.expires.and_then(|e| chrono::Duration::from_std(e).ok()) {
        // Expiry is monotone in the instant: the expired ones are a prefix.
        let live = publish.partition_point(|t| {
            t.checked_add_signed(expires)
                .is_some_and(|deadline| deadline <= now)
        });
        for t in publish.drain(..live) {
            drops.push(t, Dropped::Expired);
        }
    }
    Plan {
        publish,
        dropped: drops.listed,
        unlisted: drops.unlisted,
        dropped_up_to: drops.up_to,
        decided_up_to: (cursor > last).then_some(cursor),
    }
}

/// Counts the instants after `t` and before `stale` (all past grace) without listing them;
/// returns where the walk continues when it could skip ahead.
fn count_stale(
    schedule: &Schedule,
    t: DateTime<Utc>,
    stale: DateTime<Utc>,
    drops: &mut Drops,
) -> Option<DateTime<Utc>> {
    match schedule {
        Schedule::Every { every, anchor } => {
            let (count, first, last) = every_between(*every, *anchor, t, stale)?;
            drops.add_unlisted(count, first, last);
            Some(last)
        }
        Schedule::Cron { .. } => {
            if drops.unlisted.count < MAX_COUNTED {
                return None;
            }
            // Walked far enough: jump to just before the grace edge.
            drops.unlisted.lower_bound = true;
            let edge = stale.checked_sub_signed(TimeDelta::nanoseconds(1))?.max(t);
            drops.up_to = Some(edge);
            Some(edge)
        }
    }
}

fn nanos(t: DateTime<Utc>) -> i128 {
    i128::from(t.timestamp()) * 1_000_000_000 + i128::from(t.timestamp_subsec_nanos())
}

fn from_nanos(n: i128) -> Option<DateTime<Utc>> {
    let secs = i64::try_from(n.div_euclid(1_000_000_000)).ok()?;
    DateTime::from_timestamp(secs, n.rem_euclid(1_000_000_000) as u32)
}

/// The instants `anchor + k·every` strictly between `after` and `before`: how many, the first
/// and the last; `None` when there are none.
fn every_between(
    every: TimeDelta,
    anchor: DateTime<Utc>,
    after: DateTime<Utc>,
    before: DateTime<Utc>,
) -> Option<(u64, DateTime<Utc>, DateTime<Utc>)> {
    let step = i128::from(every.num_seconds()) * 1_000_000_000 + i128::from(every.subsec_nanos());
    if step <= 0 {
        return None;
    }
    let a = nanos(anchor);
    let k_lo = (nanos(after) - a).div_euclid(step) + 1;
    let k_hi = (nanos(before) - a - 1).div_euclid(step);
    if k_hi < k_lo {
        return None;
    }
    let count = u64::try_from(k_hi - k_lo + 1).ok()?;
    Some((
        count,
        from_nanos(a + k_lo * step)?,
        from_nanos(a + k_hi * step)?,
    ))
}

/// Reads a persisted last instant. The beat writes it truncated to whole milliseconds
/// (`store::last_instant_text`), so a value on a millisecond boundary covers that whole
/// millisecond: an instant with sub-millisecond digits is then not decided a second time.
pub fn parse_last(text: &str) -> Option<DateTime<Utc>> {
    let t = DateTime::parse_from_rfc3339(text).ok()?.with_timezone(&Utc);
    if t.timestamp_subsec_nanos() % 1_000_000 == 0 {
        t.checked_add_signed(TimeDelta::nanoseconds(999_999))
    } else {
        Some(t)
    }
}

/// Every job's persisted last instant (`None`: the job never ran, or the value is unreadable,
/// which is logged), in `jobs` order: one pipelined round trip per
/// [`LOAD_BATCH`]·[`LOAD_PIPELINE`] jobs rather than one per job.
pub async fn load_last(
    store: &Store,
    jobs: &[Job],
) -> Result<Vec<Option<DateTime<Utc>>>, StoreError> {
    let names = store.names();
    let mut conn = store.connection();
    let mut out = Vec::with_capacity(jobs.len());
    for group in jobs.chunks(LOAD_BATCH * LOAD_PIPELINE) {
        let mut pipe = redis::pipe();
        for batch in group.chunks(LOAD_BATCH) {
            let keys: Vec<String> = batch.iter().map(|j| names.beat_last(&j.name)).collect();
            pipe.cmd("MGET").arg(keys);
        }
        let replies: Vec<Vec<Option<String>>> = pipe.query_async(&mut conn).await?;
        for (job, value) in group.iter().zip(replies.into_iter().flatten()) {
            out.push(value.and_then(|text| {
                let last = parse_last(&text);
                if last.is_none() {
                    warn!(job = %job.name, key = %names.beat_last(&job.name), value = %text,
                        "unreadable last instant; treating the job as never run");
                }
                last
            }));
        }
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

/// Where a job's progress stands after one batch: `sent` are the instants published for it
/// (oldest first), `confirmed[i]` whether the broker confirmed `sent[i]`, and `decided_up_to`
/// the plan's newest decided instant when `sent` was the whole of its plan (`None` when the
/// batch took only part of it).
///
/// Progress moves to the newest instant of the *contiguous confirmed prefix*: an instant
/// confirmed after a failed one is not recorded, since that would skip the failed one. It is
/// planned again on the retry and, if the policy keeps it, published again — a duplicate
/// message with the same key, which workers deduplicate — rather than lost. Only when
/// everything sent was confirmed does progress move on to `decided_up_to`. Never before `last`.
///
/// Returns the new progress and the length of that prefix (the instants it records as
/// published).
pub fn progress_after(
    last: DateTime<Utc>,
    sent: &[DateTime<Utc>],
    confirmed: &[bool],
    decided_up_to: Option<DateTime<Utc>>,
) -> (DateTime<Utc>, usize) {
    let prefix = confirmed
        .iter()
        .take_while(|ok| **ok)
        .count()
        .min(sent.len());
    let mut to = sent[..prefix].iter().copied().fold(last, DateTime::max);
    if prefix == sent.len() {
        to = decided_up_to.map_or(to, |d| to.max(d));
    }
    (to, prefix)
}

/// Moves each `(job, instant)`'s persisted progress forward (never back), pipelined; one
/// outcome per entry (see [`Store::advance_last_published_many`]).
pub async fn save_progress(
    store: &Store,
    progress: &[(&str, DateTime<Utc>)],
) -> Result<Vec<Result<(), StoreError>>, StoreError> {
    store
        .advance_last_published_many(progress, SAVE_PIPELINE)
        .await
}

/// Counters the beat keeps; Prometheus metrics under `--metrics-addr`. Clones share them.
#[derive(Debug, Default, Clone)]
pub struct BeatStats {
    /// Instances published and confirmed.
    pub published: Counter,
    /// Instances decided not to publish (each logged with its key, or in a counted range).
    pub dropped: Counter,
    /// Publish attempts that failed, per job (retried).
    pub publish_failures: Counter,
    /// Progress writes to Redis that failed, per job (the job waits until one succeeds).
    pub persist_failures: Counter,
    /// Jobs whose last attempt stalled (broker or Redis unreachable, or the broker refused
    /// the job's message); 0 when all move.
    pub stalled_jobs: Gauge,
}

impl BeatStats {
    /// Registers every metric under `drumline_beat_*`.
    pub fn register(&self, registry: &mut Registry) {
        let counters: [(&str, &str, &Counter); 4] = [
            (
                "published",
                "Instances published and confirmed by the broker",
                &self.published,
            ),
            (
                "dropped",
                "Instances not published (misfire policy, grace, expiry)",
                &self.dropped,
            ),
            (
                "publish_failures",
                "Job publish attempts that failed (retried)",
                &self.publish_failures,
            ),
            (
                "persist_failures",
                "Job progress writes to Redis that failed (retried)",
                &self.persist_failures,
            ),
        ];
        for (name, help, counter) in counters {
            registry.register(format!("drumline_beat_{name}"), help, counter.clone());
        }
        registry.register(
            "drumline_beat_stalled_jobs",
            "Jobs whose last attempt stalled on the broker or Redis",
            self.stalled_jobs.clone(),
        );
    }

    /// `Ok` unless jobs are stalled.
    pub fn health(&self) -> Result<(), String> {
        match self.stalled_jobs.get() {
            0 => Ok(()),
            n => Err(format!(
                "{n} jobs stalled: the broker or Redis is unreachable"
            )),
        }
    }
}

/// Why a job could not move forward now; it is planned again after a backoff. Shared (`Arc`)
/// because one failure — the broker or Redis unreachable — stalls every job of a batch.
#[derive(Debug, Clone, thiserror::Error)]
enum Stall {
    /// One of the job's messages was sent and failed (refused, unroutable, or lost with a
    /// channel that some message of the batch closed). The job is tried again alone, so that
    /// whatever is wrong with its message cannot fail the others' again.
    #[error(transparent)]
    Publish(Arc<PublishError>),
    /// Nothing of the batch could be sent (no connection): every job waits for the broker.
    #[error(transparent)]
    Unsent(Arc<PublishError>),
    /// Redis did not take the job's progress.
    #[error("cannot persist the job's progress to redis: {0}")]
    Persist(Arc<StoreError>),
}

/// Per-job progress.
struct JobState {
    /// Newest instant decided (published or dropped); never moves back.
    last: DateTime<Utc>,
    /// The first instant after `last`, if any.
    next: Option<DateTime<Utc>>,
    /// `last` is ahead of what Redis holds (not written yet, or a write failed): written
    /// before anything is published for the job.
    unsaved: bool,
    /// Consecutive attempts that stalled; 0 when the last one moved.
    failures: u32,
    /// One of its messages failed in a batch: it is published in a batch of its own until
    /// one succeeds (DESIGN §9: a job that cannot be published never holds up the others).
    alone: bool,
}

/// A due job taken into a batch.
struct Due {
    /// Index in `config.jobs`.
    job: usize,
    /// Its instant in the due queue (where it goes back when it stalls).
    due: DateTime<Utc>,
    plan: Plan,
    /// How many of `plan.publish` (the oldest) this batch publishes.
    take: usize,
}

/// Runs the beat until `shutdown` completes.
///
/// Shutdown is observed between batches and while waiting, never inside a batch's publish
/// and persist, so an instance confirmed by the broker always has its progress written before
/// exit (a restarted beat then publishes no instant twice).
pub async fn run(
    config: Config,
    stats: BeatStats,
    shutdown: impl Future<Output = ()>,
) -> Result<BeatStats, PublishError> {
    tokio::pin!(shutdown);
    let names = Names::new(config.namespace.clone());
    let store = tokio::select! {
        s = connect_redis(&config, &names) => s,
        _ = &mut shutdown => return Ok(stats),
    };
    let mut publisher = Publisher::new(&config);
    let epoch = 0;

    // Load progress. On a job's very first start nothing before now counts as missed.
    let loading = Instant::now();
    let lasts = loop {
        match load_last(&store, &config.jobs).await {
            Ok(lasts) => break lasts,
            Err(e) => {
                error!(error = %e, "cannot read the jobs' progress from redis; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = &mut shutdown => return Ok(stats),
                }
            }
        }
    };
    // A new job starts from now, as a restart would read it back (whole milliseconds).
    let now = Utc::now();
    let start = parse_last(&last_instant_text(now)).unwrap_or(now);
    let resumed = lasts.iter().filter(|l| l.is_some()).count();
    let mut states: Vec<JobState> = config
        .jobs
        .iter()
        .zip(lasts)
        .map(|(job, last)| {
            let unsaved = last.is_none();
            let last = last.unwrap_or(start);
            JobState {
                last,
                next: job.schedule.next_after(last),
                unsaved,
                failures: 0,
                alone: false,
            }
        })
        .collect();
    // Persist every new job's start, so that a beat that dies before a job's first instant and
    // stays down reports those misses when it comes back. A job whose write fails keeps it
    // unsaved: written before anything is published for it.
    let new: Vec<usize> = (0..states.len()).filter(|i| states[*i].unsaved).collect();
    let failures: Vec<(usize, Arc<StoreError>)> = new
        .iter()
        .zip(save(&store, &config.jobs, &mut states, &new).await)
        .filter_map(|(i, failed)| Some((*i, failed?)))
        .collect();
    if let Some((i, e)) = failures.first() {
        warn!(jobs = failures.len(), first = %config.jobs[*i].name, error = %e,
            "cannot persist new jobs' start yet; it is written before their first publish");
    }
    // Min-heap of (next instant, job index): a wake looks only at the jobs due, never at all.
    let mut queue: BinaryHeap<Reverse<(DateTime<Utc>, usize)>> = states
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.next.map(|n| Reverse((n, i))))
        .collect();
    info!(
        jobs = config.jobs.len(),
        resumed,
        load_ms = loading.elapsed().as_millis() as u64,
        namespace = %config.namespace,
        "beat started"
    );

    // Connect eagerly so topology exists before the first instant; failures are retried below.
    if let Err(e) = publisher.connect().await {
        if let PublishError::Topology(
            t @ drumline_shared::topology::TopologyError::Mismatch { .. },
        ) = e
        {
            return Err(PublishError::Topology(t));
        }
        warn!(error = %e, broker = %Redacted(&config.broker_url), "broker not reachable yet; will retry");
    }

    let threshold = config.beat.misfire_threshold;
    let mut retry_backoff = Duration::from_millis(200);
    // Jobs whose last attempt stalled (`failures > 0`), for the gauge.
    let mut stuck: i64 = 0;
    'beat: loop {
        // Wake at the next due instant, but at least once a second to notice wall-clock jumps.
        let mut wait = Duration::from_secs(1);
        loop {
            // Re-read per batch: lateness is judged against the clock when a job is planned.
            let now = Utc::now();
            match queue.peek() {
                Some(Reverse((due, _))) if *due <= now => {}
                Some(Reverse((due, _))) => {
                    wait = wait.min((*due - now).to_std().unwrap_or_default());
                    break;
                }
                None => break,
            }
            // Many batches can be due at once (100,000 jobs on the minute): let a signal in
            // between them — never inside one, between a confirm and its progress write.
            tokio::select! {
                biased;
                _ = &mut shutdown => break 'beat,
                _ = std::future::ready(()) => {}
            }
            let batch = take_due(&mut queue, &config.jobs, &states, now, threshold);
            let stalls = advance(
                &config.jobs,
                &mut states,
                &batch,
                &store,
                &mut publisher,
                &stats,
                epoch,
            )
            .await?;
            let mut stalled = 0;
            // Stalls that are not one job's own: the broker or Redis is away, and every job
            // waits for the shared backoff.
            let mut shared = 0;
            for (due, stall) in batch.iter().zip(stalls) {
                let job = &config.jobs[due.job];
                let state = &mut states[due.job];
                let Some(stall) = stall else {
                    if state.failures > 0 {
                        stuck -= 1;
                    }
                    state.failures = 0;
                    state.alone = false;
                    if let Some(next) = state.next {
                        queue.push(Reverse((next, due.job)));
                    }
                    continue;
                };
                if state.failures == 0 {
                    stuck += 1;
                }
                state.failures = state.failures.saturating_add(1);
                match &stall {
                    Stall::Publish(_) | Stall::Unsent(_) => stats.publish_failures.inc(),
                    Stall::Persist(_) => stats.persist_failures.inc(),
                };
                // Planned again from the progress made so far: instances the stall made late
                // become misses and follow the policy.
                let retry_at = if let Stall::Publish(_) = stall {
                    // Its own message failed: tried again alone after its own backoff, while
                    // the other jobs go on now.
                    state.alone = true;
                    let backoff = isolated_backoff(state.failures);
                    if stalled < STALLS_LISTED {
                        warn!(job = %job.name, error = %stall, retry_in_ms = backoff.as_millis() as u64,
                            "job stalled; will retry it alone");
                    }
                    due.due.max(now + backoff)
                } else {
                    shared += 1;
                    if stalled < STALLS_LISTED {
                        warn!(job = %job.name, error = %stall,
                            retry_in_ms = retry_backoff.as_millis() as u64, "job stalled; will retry");
                    }
                    due.due
                };
                stalled += 1;
                queue.push(Reverse((retry_at, due.job)));
            }
            stats.stalled_jobs.set(stuck);
            if shared == 0 {
                retry_backoff = Duration::from_millis(200);
                if stalled > STALLS_LISTED {
                    warn!(
                        more = stalled - STALLS_LISTED,
                        "more jobs stalled; will retry them alone"
                    );
                }
                continue;
            }
            if stalled > STALLS_LISTED {
                warn!(
                    more = stalled - STALLS_LISTED,
                    retry_in_ms = retry_backoff.as_millis() as u64,
                    "more jobs stalled; will retry"
                );
            }
            wait = retry_backoff;
            retry_backoff = (retry_backoff * 2).min(Duration::from_secs(5));
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = &mut shutdown => break,
        }
    }
    publisher.close().await;
    info!(
        published = stats.published.get(),
        dropped = stats.dropped.get(),
        publish_failures = stats.publish_failures.get(),
        persist_failures = stats.persist_failures.get(),
        "beat stopped"
    );
    Ok(stats)
}

/// Takes the jobs due at `now` off the queue, oldest first, and plans each, up to
/// [`BATCH_JOBS`] jobs or [`BATCH_MESSAGES`] messages (the last job taken may publish only the
/// first part of its plan; it stays due for the next batch).
fn take_due(
    queue: &mut BinaryHeap<Reverse<(DateTime<Utc>, usize)>>,
    jobs: &[Job],
    states: &[JobState],
    now: DateTime<Utc>,
    threshold: Duration,
) -> Vec<Due> {
    let mut batch = Vec::new();
    let mut messages = 0;
    while batch.len() < BATCH_JOBS && messages < BATCH_MESSAGES {
        let Some(Reverse((due, job))) = queue.peek().copied() else {
            break;
        };
        if due > now {
            break;
        }
        // A job whose message failed goes in a batch of its own, so that a failure that
        // closes the channel cannot take the others' messages with it.
        let alone = states[job].alone;
        if alone && !batch.is_empty() {
            break;
        }
        queue.pop();
        let plan = plan(&jobs[job], states[job].last, now, threshold);
        let take = plan.publish.len().min(BATCH_MESSAGES - messages);
        messages += take;
        batch.push(Due {
            job,
            due,
            plan,
            take,
        });
        if alone {
            break;
        }
    }
    batch
}

/// Wait before the `failures`-th consecutive try of a job whose own message failed.
fn isolated_backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    (ISOLATED_BACKOFF * 2u32.pow(doublings)).min(ISOLATED_BACKOFF_MAX)
}

/// Publishes what `batch` plans and moves each job's progress forward; returns, per job of the
/// batch, why it stalled (`None`: it moved on). `Err` only when the broker refused the topology,
/// which needs a human.
///
/// In order: report the drops and persist the progress they make (with any progress a
/// failed write left unsaved) — a job whose write fails publishes nothing now; publish every
/// message of the batch, then await the confirms; move each job to the newest instant of its
/// contiguous confirmed prefix ([`progress_after`]); persist all of it in one round trip. Progress
/// is written only after the broker confirmed (DESIGN §2). A failed write stalls the job, like
/// a broker failure: this beat remembers the progress (it never republishes an instant it
/// recorded), writes it first when it retries, and instances that come due meanwhile are
/// misses — the beat could not reach Redis.
async fn advance(
    jobs: &[Job],
    states: &mut [JobState],
    batch: &[Due],
    store: &Store,
    publisher: &mut Publisher,
    stats: &BeatStats,
    epoch: u64,
) -> Result<Vec<Option<Stall>>, PublishError> {
    let mut stalls: Vec<Option<Stall>> = vec![None; batch.len()];

    // The drops are all older than the first instance to publish: settle them now, so that if
    // a publish below fails, the next plan starts after them and does not report them again.
    for due in batch {
        report_dropped(&jobs[due.job], &due.plan, stats);
        let state = &mut states[due.job];
        if let Some(dropped) = due.plan.dropped_up_to.filter(|d| *d > state.last) {
            state.last = dropped;
            state.unsaved = true;
        }
    }
    let unsaved: Vec<usize> = (0..batch.len())
        .filter(|p| states[batch[*p].job].unsaved)
        .collect();
    save_batch(store, jobs, states, batch, &unsaved, &mut stalls).await;

    let mut envelopes = Vec::new();
    let mut spans = Vec::new();
    for (p, due) in batch.iter().enumerate() {
        if stalls[p].is_some() {
            continue;
        }
        let job = &jobs[due.job];
        let first = envelopes.len();
        for t in &due.plan.publish[..due.take] {
            let expires_at = job
                .expires
                .and_then(|e| chrono::Duration::from_std(e).ok())
                .map(|e| *t + e);
            envelopes.push(Envelope::scheduled(
                &job.name,
                &job.task,
                &job.queue,
                job.args.clone(),
                *t,
                expires_at,
                Utc::now(),
            ));
        }
        spans.push((p, first..envelopes.len()));
    }
    let outcomes = if envelopes.is_empty() {
        Vec::new()
    } else {
        match publisher.publish_batch(&envelopes, epoch).await {
            Ok(outcomes) => outcomes,
            Err(e @ PublishError::Topology(_)) => return Err(e),
            Err(e) => {
                // Nothing was sent: every job with something to publish stalls.
                let e = Arc::new(e);
                for (p, span) in &spans {
                    if !span.is_empty() {
                        stalls[*p] = Some(Stall::Unsent(e.clone()));
                    }
                }
                Vec::new()
            }
        }
    };

    // `outcomes` is in `envelopes` order: each job's run of them, in `spans` order.
    let mut outcomes = outcomes.into_iter();
    for (p, span) in spans {
        let results: Vec<Result<(), PublishError>> = outcomes.by_ref().take(span.len()).collect();
        if stalls[p].is_some() {
            continue;
        }
        let due = &batch[p];
        let job = &jobs[due.job];
        let state = &mut states[due.job];
        let confirmed: Vec<bool> = results.iter().map(Result::is_ok).collect();
        let whole = due.take == due.plan.publish.len();
        let (to, recorded) = progress_after(
            state.last,
            &due.plan.publish[..due.take],
            &confirmed,
            due.plan.decided_up_to.filter(|_| whole),
        );
        for env in &envelopes[span][..recorded] {
            stats.published.inc();
            info!(job = %job.name, key = %env.key, "published");
        }
        if to > state.last {
            state.last = to;
            state.unsaved = true;
        }
        if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
            stalls[p] = Some(Stall::Publish(Arc::new(e)));
        }
    }

    // One round trip for the whole batch's progress, including jobs that stalled on a publish
    // after some of their instants were confirmed.
    let unsaved: Vec<usize> = (0..batch.len())
        .filter(|p| {
            let persist_failed = matches!(stalls[*p], Some(Stall::Persist(_)));
            !persist_failed && states[batch[*p].job].unsaved
        })
        .collect();
    save_batch(store, jobs, states, batch, &unsaved, &mut stalls).await;

    for (p, due) in batch.iter().enumerate() {
        if stalls[p].is_none() {
            let state = &mut states[due.job];
            state.next = jobs[due.job].schedule.next_after(state.last);
        }
    }
    Ok(stalls)
}

/// Writes the progress of the batch's jobs at positions `which`; a job whose write fails
/// stalls (unless it already stalled on a publish, the first reason).
async fn save_batch(
    store: &Store,
    jobs: &[Job],
    states: &mut [JobState],
    batch: &[Due],
    which: &[usize],
    stalls: &mut [Option<Stall>],
) {
    let indexes: Vec<usize> = which.iter().map(|p| batch[*p].job).collect();
    for (failed, p) in save(store, jobs, states, &indexes)
        .await
        .into_iter()
        .zip(which)
    {
        if let Some(e) = failed {
            stalls[*p].get_or_insert(Stall::Persist(e));
        }
    }
}

/// Writes `states[i].last` as job `i`'s persisted progress (never moving it back) for each `i`
/// in `which`, in one round trip per [`SAVE_PIPELINE`]; clears `unsaved` where that worked.
/// Returns each one's failure, if any, in `which` order.
async fn save(
    store: &Store,
    jobs: &[Job],
    states: &mut [JobState],
    which: &[usize],
) -> Vec<Option<Arc<StoreError>>> {
    if which.is_empty() {
        return Vec::new();
    }
    let progress: Vec<(&str, DateTime<Utc>)> = which
        .iter()
        .map(|i| (jobs[*i].name.as_str(), states[*i].last))
        .collect();
    let outcomes: Vec<Option<Arc<StoreError>>> = match save_progress(store, &progress).await {
        Ok(outcomes) => outcomes
            .into_iter()
            .map(|r| r.err().map(Arc::new))
            .collect(),
        Err(e) => vec![Some(Arc::new(e)); which.len()],
    };
    for (i, failed) in which.iter().zip(&outcomes) {
        if failed.is_none() {
            states[*i].unsaved = false;
        }
    }
    outcomes
}

/// Logs every dropped instance with its key (beyond [`MAX_LISTED`]: one line with the count and
/// the first and last key) and counts them.
fn report_dropped(job: &Job, plan: &Plan, stats: &BeatStats) {
    for (t, why) in &plan.dropped {
        warn!(job = %job.name, key = %instance_key(&job.name, *t), reason = why.reason(), "instance not published");
    }
    let more = &plan.unlisted;
    if more.count > 0 {
        let key =
            |t: Option<DateTime<Utc>>| t.map(|t| instance_key(&job.name, t)).unwrap_or_default();
        warn!(
            job = %job.name,
            count = more.count,
            at_least = more.lower_bound,
            first_key = %key(more.first),
            last_key = %key(more.last),
            "more instances not published (missed; too many to list one by one)"
        );
    }
    stats.dropped.inc_by(plan.dropped_count());
}

async fn connect_redis(config: &Config, names: &Names) -> Store {
    let mut backoff = Duration::from_millis(200);
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
                error!(error = %e, redis = %Redacted(&config.redis_url),
                    "redis unreachable; the beat waits for it (it holds each job's progress)");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use drumline_shared::config::Config;
    use std::path::Path;

    const THRESHOLD: Duration = Duration::from_secs(5);

    /// Job `j` with the given TOML keys (schedule, policies).
    fn job(keys: &str) -> Job {
        let text = format!(
            "[[jobs]]\nname = \"j\"\ntask = \"t\"\n{keys}\n[tasks.t]\ncommand = [\"/bin/true\"]\n"
        );
        let mut config = Config::parse(&text, Path::new("test.toml"), |_| None)
            .unwrap_or_else(|e| panic!("bad test config: {e}"));
        config.jobs.remove(0)
    }

    pub(super) fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .expect("test instant")
            .with_timezone(&Utc)
    }

    /// `12:MM:00Z` on 2026-03-02 for each minute.
    fn minutes(range: std::ops::RangeInclusive<u32>) -> Vec<DateTime<Utc>> {
        range
            .map(|m| at(&format!("2026-03-02T12:{m:02}:00Z")))
            .collect()
    }

    fn dropped(plan: &Plan) -> Vec<DateTime<Utc>> {
        plan.dropped.iter().map(|(t, _)| *t).collect()
    }

    fn reasons(plan: &Plan) -> Vec<Dropped> {
        plan.dropped.iter().map(|(_, why)| *why).collect()
    }

    // The beat was down from 12:00 to 12:10:30: 12:01 … 12:10 were all missed.
    const LAST: &str = "2026-03-02T12:00:00Z";
    const NOW: &str = "2026-03-02T12:10:30Z";
    const EVERY_MINUTE: &str = "every = \"1m\"";
    const CRON_MINUTE: &str = "cron = \"* * * * *\"";

    #[test]
    fn a_job_whose_message_failed_is_batched_alone() {
        let jobs: Vec<Job> = (0..4).map(|_| job(EVERY_MINUTE)).collect();
        let mut states: Vec<JobState> = (0..4)
            .map(|_| JobState {
                last: at(LAST),
                next: None,
                unsaved: false,
                failures: 0,
                alone: false,
            })
            .collect();
        states[1].alone = true;
        let due = at("2026-03-02T12:01:00Z");
        let mut queue: BinaryHeap<Reverse<(DateTime<Utc>, usize)>> =
            (0..4).map(|i| Reverse((due, i))).collect();
        let mut batches = Vec::new();
        loop {
            let batch = take_due(&mut queue, &jobs, &states, at(NOW), THRESHOLD);
            if batch.is_empty() {
                break;
            }
            batches.push(batch.iter().map(|d| d.job).collect::<Vec<_>>());
        }
        assert_eq!(batches, vec![vec![0], vec![1], vec![2, 3]]);
    }

    #[test]
    fn isolated_backoff_doubles_up_to_its_cap() {
        let ms = |n| isolated_backoff(n).as_millis();
        assert_eq!((ms(1), ms(2), ms(3)), (200, 400, 800));
        assert_eq!(ms(8), 25_600);
        assert_eq!((ms(9), ms(u32::MAX)), (30_000, 30_000));
    }

    #[test]
    fn ten_minute_gap_run_once_publishes_only_the_latest() {
        for schedule in [EVERY_MINUTE, CRON_MINUTE] {
            let p = plan(&job(schedule), at(LAST), at(NOW), THRESHOLD);
            assert_eq!(p.publish, minutes(10..=10), "{schedule}");
            assert_eq!(dropped(&p), minutes(1..=9), "{schedule}");
            assert!(reasons(&p)
                .iter()
                .all(|r| *r == Dropped::Policy(Misfire::RunOnce)));
            assert_eq!(p.dropped_count(), 9);
            assert_eq!(p.decided_up_to, Some(at("2026-03-02T12:10:00Z")));
            assert_eq!(p.dropped_up_to, Some(at("2026-03-02T12:09:00Z")));
        }
    }

    #[test]
    fn ten_minute_gap_catch_up_publishes_all_ten_oldest_first() {
        for schedule in [EVERY_MINUTE, CRON_MINUTE] {
            let j = job(&format!(
                "{schedule}\nmisfire = \"catch_up\"\noverlap = \"queue\""
            ));
            let p = plan(&j, at(LAST), at(NOW), THRESHOLD);
            assert_eq!(p.publish, minutes(1..=10), "{schedule}");
            assert_eq!(p.dropped_count(), 0);
            assert_eq!(p.dropped_up_to, None);
            assert_eq!(p.decided_up_to, Some(at("2026-03-02T12:10:00Z")));
        }
    }

    #[test]
    fn ten_minute_gap_skip_publishes_none() {
        for schedule in [EVERY_MINUTE, CRON_MINUTE] {
            let j = job(&format!("{schedule}\nmisfire = \"skip\""));
            let p = plan(&j, at(LAST), at(NOW), THRESHOLD);
            assert!(p.publish.is_empty(), "{schedule}: {:?}", p.publish);
            assert_eq!(dropped(&p), minutes(1..=10));
            assert!(reasons(&p)
                .iter()
                .all(|r| *r == Dropped::Policy(Misfire::Skip)));
            // Decided all the same: a restart does not look at them again.
            assert_eq!(p.decided_up_to, Some(at("2026-03-02T12:10:00Z")));
            assert_eq!(p.dropped_up_to, p.decided_up_to);
        }
    }

    #[test]
    fn an_on_time_instant_is_published_whatever_the_policy() {
        // 12:10 is 3 s old (within the 5 s threshold): on time, not missed.
        let now = at("2026-03-02T12:10:03Z");
        let run_once = plan(&job(EVERY_MINUTE), at(LAST), now, THRESHOLD);
        assert_eq!(run_once.publish, minutes(9..=10));
        assert_eq!(dropped(&run_once), minutes(1..=8));
        let catch_up = job("every = \"1m\"\nmisfire = \"catch_up\"\noverlap = \"queue\"");
        assert_eq!(
            plan(&catch_up, at(LAST), now, THRESHOLD).publish,
            minutes(1..=10)
        );
        let skip = plan(
            &job("every = \"1m\"\nmisfire = \"skip\""),
            at(LAST),
            now,
            THRESHOLD,
        );
        assert_eq!(skip.publish, minutes(10..=10));
        assert_eq!(dropped(&skip), minutes(1..=9));
    }

    #[test]
    fn threshold_boundary_is_on_time_and_one_millisecond_later_is_missed() {
        let skip = job("every = \"1m\"\nmisfire = \"skip\"");
        let last = at(LAST);
        // Exactly `misfire_threshold` late: still on time.
        let p = plan(&skip, last, at("2026-03-02T12:01:05Z"), THRESHOLD);
        assert_eq!(p.publish, minutes(1..=1));
        assert_eq!(p.dropped_count(), 0);
        // A millisecond more: missed, and `skip` drops it.
        let p = plan(&skip, last, at("2026-03-02T12:01:05.001Z"), THRESHOLD);
        assert!(p.publish.is_empty());
        assert_eq!(
            p.dropped,
            vec![(minutes(1..=1)[0], Dropped::Policy(Misfire::Skip))]
        );
        // Due exactly now: on time.
        let p = plan(&skip, last, at("2026-03-02T12:01:00Z"), THRESHOLD);
        assert_eq!(p.publish, minutes(1..=1));
        // Not yet due: nothing decided.
        let p = plan(&skip, last, at("2026-03-02T12:00:59.999Z"), THRESHOLD);
        assert_eq!(p, Plan::default());
    }

    #[test]
    fn misfire_grace_drops_older_missed_instances_under_every_policy() {
        // Grace 5 min at 12:10:30: 12:01 … 12:05 are more than 5 min old.
        let grace = "every = \"1m\"\nmisfire_grace = \"5m\"";
        let run_once = plan(&job(grace), at(LAST), at(NOW), THRESHOLD);
        assert_eq!(run_once.publish, minutes(10..=10));
        assert_eq!(dropped(&run_once), minutes(1..=9));
        assert_eq!(
            reasons(&run_once)[..5],
            [Dropped::PastGrace; 5],
            "{:?}",
            run_once.dropped
        );
        assert_eq!(
            reasons(&run_once)[5..],
            [Dropped::Policy(Misfire::RunOnce); 4]
        );

        let catch_up = job(&format!(
            "{grace}\nmisfire = \"catch_up\"\noverlap = \"queue\""
        ));
        let p = plan(&catch_up, at(LAST), at(NOW), THRESHOLD);
        assert_eq!(p.publish, minutes(6..=10));
        assert_eq!(
            p.dropped,
            minutes(1..=5)
                .into_iter()
                .map(|t| (t, Dropped::PastGrace))
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn run_once_publishes_nothing_when_the_latest_missed_is_past_grace() {
        // Every 10 min, down from 12:00 to 12:18: 12:10 is 8 min old, grace is 5 min.
        let j = job("every = \"10m\"\nmisfire_grace = \"5m\"");
        let p = plan(&j, at(LAST), at("2026-03-02T12:18:00Z"), THRESHOLD);
        assert!(p.publish.is_empty());
        assert_eq!(
            p.dropped,
            vec![(at("2026-03-02T12:10:00Z"), Dropped::PastGrace)]
        );
    }

    #[test]
    fn grace_boundary_is_inclusive() {
        // Exactly `misfire_grace` (1 h) old: published; a millisecond older: not.
        let j = job("every = \"1h\"");
        let last = at("2026-03-02T10:30:00Z");
        // (12:00 itself is on time, and published either way.)
        let p = plan(&j, last, at("2026-03-02T12:00:00Z"), THRESHOLD);
        assert_eq!(
            p.publish,
            vec![at("2026-03-02T11:00:00Z"), at("2026-03-02T12:00:00Z")]
        );
        let p = plan(&j, last, at("2026-03-02T12:00:00.001Z"), THRESHOLD);
        assert_eq!(p.publish, vec![at("2026-03-02T12:00:00Z")]);
        assert_eq!(
            p.dropped,
            vec![(at("2026-03-02T11:00:00Z"), Dropped::PastGrace)]
        );
    }

    #[test]
    fn catch_up_keeps_only_the_most_recent_max_catch_up() {
        let j = job(
            "cron = \"* * * * *\"\nmisfire = \"catch_up\"\noverlap = \"allow\"\nmax_catch_up = 3",
        );
        let p = plan(&j, at(LAST), at(NOW), THRESHOLD);
        assert_eq!(p.publish, minutes(8..=10));
        assert_eq!(dropped(&p), minutes(1..=7));
        assert!(reasons(&p)
            .iter()
            .all(|r| *r == Dropped::Policy(Misfire::CatchUp)));
    }

    #[test]
    fn expired_instances_are_dropped_oldest_first() {
        // expires 3 min: at 12:10:30 everything up to 12:07:30 has expired.
        let j =
            job("every = \"1m\"\nmisfire = \"catch_up\"\noverlap = \"queue\"\nexpires = \"3m\"");
        let p = plan(&j, at(LAST), at(NOW), THRESHOLD);
        assert_eq!(p.publish, minutes(8..=10));
        assert_eq!(
            p.dropped,
            minutes(1..=7)
                .into_iter()
                .map(|t| (t, Dropped::Expired))
                .collect::<Vec<_>>()
        );
        // Expiry is judged on the instants the policy kept.
        let with_cap = job("every = \"1m\"\nmisfire = \"catch_up\"\noverlap = \"queue\"\nexpires = \"150s\"\nmax_catch_up = 5");
        let p = plan(&with_cap, at(LAST), at(NOW), THRESHOLD);
        assert_eq!(p.publish, minutes(9..=10));
        assert_eq!(reasons(&p)[..5], [Dropped::Policy(Misfire::CatchUp); 5]);
        assert_eq!(reasons(&p)[5..], [Dropped::Expired; 3]);
        // An on-time instance past its (tiny) deadline is not published either.
        let tiny = job("every = \"1m\"\nexpires = \"1s\"");
        let p = plan(&tiny, at(LAST), at("2026-03-02T12:01:02Z"), THRESHOLD);
        assert!(p.publish.is_empty());
        assert_eq!(p.dropped, vec![(minutes(1..=1)[0], Dropped::Expired)]);
    }

    #[test]
    fn every_drop_is_older_than_every_publish() {
        let jobs = [
            job("every = \"1m\""),
            job("every = \"1m\"\nmisfire = \"skip\"\nexpires = \"4m\""),
            job("every = \"1m\"\nmisfire = \"catch_up\"\noverlap = \"queue\"\nmax_catch_up = 4\nexpires = \"6m\"\nmisfire_grace = \"8m\""),
            job("cron = \"*/2 * * * *\"\nmisfire_grace = \"3m\""),
        ];
        for j in &jobs {
            for now in ["2026-03-02T12:10:03Z", NOW, "2026-03-02T12:30:00Z"] {
                let p = plan(j, at(LAST), at(now), THRESHOLD);
                if let (Some(d), Some(first)) = (p.dropped_up_to, p.publish.first()) {
                    assert!(d < *first, "{}: {p:?}", j.schedule);
                }
                let listed_newest = p.dropped.last().map(|(t, _)| *t);
                assert_eq!(p.dropped_up_to, listed_newest);
            }
        }
    }

    #[test]
    fn replanning_after_a_failed_publish_reports_no_drop_twice() {
        // The loop settles drops, then publishes; when the first publish fails it plans again
        // from `dropped_up_to`. Same `now`: same publishes, no drops.
        let j =
            job("every = \"1m\"\nmisfire = \"catch_up\"\noverlap = \"queue\"\nmax_catch_up = 4");
        let first = plan(&j, at(LAST), at(NOW), THRESHOLD);
        assert_eq!(first.dropped_count(), 6);
        let again = plan(&j, first.dropped_up_to.unwrap(), at(NOW), THRESHOLD);
        assert_eq!(again.dropped_count(), 0);
        assert_eq!(again.publish, first.publish);
        // A minute later (the broker still down) the misses roll forward; only the newly
        // dropped instant is reported.
        let later = plan(
            &j,
            first.dropped_up_to.unwrap(),
            at("2026-03-02T12:11:30Z"),
            THRESHOLD,
        );
        assert_eq!(later.publish, minutes(8..=11));
        assert_eq!(dropped(&later), minutes(7..=7));
    }

    #[test]
    fn a_backward_clock_jump_republishes_nothing() {
        let j = job(EVERY_MINUTE);
        // Decided up to 12:10; the clock now reads 12:02.
        let p = plan(
            &j,
            at("2026-03-02T12:10:00Z"),
            at("2026-03-02T12:02:00Z"),
            THRESHOLD,
        );
        assert_eq!(p, Plan::default());
    }

    #[test]
    fn a_forward_clock_jump_is_a_misfire() {
        // On time at 12:00; the clock jumps to 12:10:30 — the same as a 10-minute outage.
        let j = job(EVERY_MINUTE);
        let p = plan(&j, at(LAST), at(NOW), THRESHOLD);
        assert_eq!(p.publish, minutes(10..=10));
        assert_eq!(p.dropped_count(), 9);
    }

    #[test]
    fn first_start_misses_nothing_before_it() {
        // With no persisted instant the beat plans from its start.
        let start = at("2026-03-02T12:00:30Z");
        let p = plan(&job(EVERY_MINUTE), start, start, THRESHOLD);
        assert_eq!(p, Plan::default());
        let p = plan(
            &job(EVERY_MINUTE),
            start,
            at("2026-03-02T12:01:00Z"),
            THRESHOLD,
        );
        assert_eq!(p.publish, minutes(1..=1));
    }

    #[test]
    fn cron_in_a_dst_zone_catches_up_the_shifted_instant() {
        // Daily 02:30 New York; down from Saturday to Monday across spring-forward
        // (2026-03-08: 02:30 does not exist, shifted to 03:00 EDT = 07:00Z).
        let last = at("2026-03-07T12:00:00Z");
        let now = at("2026-03-09T12:00:00Z");
        let keys = "cron = \"30 2 * * *\"\ntimezone = \"America/New_York\"\nmisfire = \"catch_up\"\noverlap = \"queue\"\nmisfire_grace = \"3d\"";
        let shift = job(keys);
        assert_eq!(
            plan(&shift, last, now, THRESHOLD).publish,
            vec![at("2026-03-08T07:00:00Z"), at("2026-03-09T06:30:00Z")]
        );
        let skip = job(&format!("{keys}\ndst_gap = \"skip\""));
        assert_eq!(
            plan(&skip, last, now, THRESHOLD).publish,
            vec![at("2026-03-09T06:30:00Z")]
        );
        // run_once: only Monday's.
        let run_once =
            job("cron = \"30 2 * * *\"\ntimezone = \"America/New_York\"\nmisfire_grace = \"3d\"");
        let p = plan(&run_once, last, now, THRESHOLD);
        assert_eq!(p.publish, vec![at("2026-03-09T06:30:00Z")]);
        assert_eq!(
            p.dropped,
            vec![(
                at("2026-03-08T07:00:00Z"),
                Dropped::Policy(Misfire::RunOnce)
            )]
        );
    }

    #[test]
    fn cron_fold_both_catches_up_both_instants() {
        // 01:30 New York on 2026-11-01 happens at 05:30Z (EDT) and 06:30Z (EST).
        let j = job("cron = \"30 1 * * *\"\ntimezone = \"America/New_York\"\ndst_fold = \"both\"\nmisfire = \"catch_up\"\noverlap = \"queue\"\nmisfire_grace = \"2h\"");
        let p = plan(
            &j,
            at("2026-11-01T05:00:00Z"),
            at("2026-11-01T06:40:00Z"),
            THRESHOLD,
        );
        assert_eq!(
            p.publish,
            vec![at("2026-11-01T05:30:00Z"), at("2026-11-01T06:30:00Z")]
        );
    }

    #[test]
    fn a_long_outage_is_counted_exactly_but_listed_only_in_part() {
        // Every second, down 30 days, grace 1 h: 2,592,000 instants due. (No threshold, so
        // that only the latest is published.)
        let j = job("every = \"1s\"");
        let last = at("2026-03-01T00:00:00Z");
        let now = at("2026-03-31T00:00:00.500Z");
        let p = plan(&j, last, now, Duration::ZERO);
        let due = 30 * 86_400;
        assert_eq!(p.publish, vec![at("2026-03-31T00:00:00Z")]);
        assert_eq!(p.dropped_count(), due - 1);
        assert_eq!(p.dropped.len(), MAX_LISTED);
        assert_eq!(p.dropped[0].0, at("2026-03-01T00:00:01Z"));
        assert!(!p.unlisted.lower_bound);
        assert_eq!(p.unlisted.last, Some(at("2026-03-30T23:59:59Z")));
        assert_eq!(p.dropped_up_to, p.unlisted.last);
        assert_eq!(p.decided_up_to, Some(at("2026-03-31T00:00:00Z")));
        // The unlisted range follows the listed one without a gap.
        assert_eq!(
            p.unlisted.first,
            Some(p.dropped[MAX_LISTED - 1].0 + TimeDelta::seconds(1))
        );
    }

    #[test]
    fn a_cron_walk_past_max_counted_jumps_to_the_grace_edge() {
        // Walking a per-second cron through a year-long outage would take seconds of CPU.
        let j = job("cron = \"* * * * * *\"");
        let mut drops = Drops::default();
        drops.unlisted.count = MAX_COUNTED;
        let t = at("2026-03-01T00:00:00Z");
        let stale = at("2026-03-30T00:00:00Z");
        let jump = count_stale(&j.schedule, t, stale, &mut drops).unwrap();
        assert!(drops.unlisted.lower_bound);
        assert_eq!(drops.up_to, Some(jump));
        // The walk goes on with the first instant inside the grace window.
        assert_eq!(j.schedule.next_after(jump), Some(stale));
        // Below the limit it keeps walking.
        let mut drops = Drops::default();
        assert_eq!(count_stale(&j.schedule, t, stale, &mut drops), None);
    }

    #[test]
    fn every_between_counts_like_a_walk() {
        let anchor = at("2026-03-02T12:00:00.250Z");
        let every = TimeDelta::milliseconds(1500);
        let after = at("2026-03-02T11:59:00Z");
        let before = at("2026-03-02T12:03:00.250Z");
        let schedule = Schedule::Every { every, anchor };
        let walked: Vec<_> = schedule
            .occurrences_after(after)
            .map(|o| o.at)
            .take_while(|t| *t < before)
            .collect();
        let (n, first, last) = every_between(every, anchor, after, before).unwrap();
        assert_eq!(n as usize, walked.len());
        assert_eq!(first, walked[0]);
        assert_eq!(last, *walked.last().unwrap());
        // An instant exactly at `after` or `before` is excluded.
        assert_eq!(every_between(every, anchor, anchor, anchor + every), None);
    }

    #[test]
    fn a_persisted_instant_covers_its_whole_millisecond() {
        let last = parse_last("2026-03-02T12:00:00.000Z").unwrap();
        assert_eq!(last, at("2026-03-02T12:00:00.000999999Z"));
        // An `every` with a sub-millisecond anchor is not republished after a restart.
        let j = job("every = \"1s\"\nanchor = \"2026-01-01T00:00:00.0005Z\"");
        let published = at("2026-03-02T12:00:00.0005Z");
        let persisted = drumline_shared::store::last_instant_text(published);
        assert_eq!(persisted, "2026-03-02T12:00:00.000Z");
        let p = plan(
            &j,
            parse_last(&persisted).unwrap(),
            at("2026-03-02T12:00:00.9Z"),
            THRESHOLD,
        );
        assert!(p.publish.is_empty(), "{p:?}");
        assert_eq!(parse_last("garbage"), None);
        // A value written by hand with sub-millisecond digits is taken as is.
        assert_eq!(
            parse_last("2026-03-02T12:00:00.0000005Z"),
            Some(at("2026-03-02T12:00:00.0000005Z"))
        );
    }

    #[test]
    fn progress_moves_to_the_newest_of_the_contiguous_confirmed_prefix() {
        let last = at(LAST);
        let sent = minutes(1..=4);
        let decided = at("2026-03-02T12:04:30Z");
        // All confirmed: on to what the plan decided (beyond its last publish).
        assert_eq!(
            progress_after(last, &sent, &[true; 4], Some(decided)),
            (decided, 4)
        );
        // The third failed: the fourth, confirmed, is not recorded — that would skip the third.
        assert_eq!(
            progress_after(last, &sent, &[true, true, false, true], Some(decided)),
            (sent[1], 2)
        );
        // The first failed: nothing moves.
        assert_eq!(
            progress_after(last, &sent, &[false, true, true, true], Some(decided)),
            (last, 0)
        );
        // Part of the plan sent (a full batch): the newest sent, not the plan's decided edge.
        assert_eq!(
            progress_after(last, &sent[..2], &[true, true], None),
            (sent[1], 2)
        );
        // Nothing to publish (drops only): the decided edge.
        assert_eq!(progress_after(last, &[], &[], Some(decided)), (decided, 0));
        // Never back, even if the instants sent were older than `last`.
        let ahead = at("2026-03-02T13:00:00Z");
        assert_eq!(
            progress_after(ahead, &sent, &[true; 4], Some(decided)),
            (ahead, 4)
        );
    }
}

/// Against the real Redis and RabbitMQ (as `scripts/test` starts them), each test in a
/// namespace of its own whose keys, queues and exchanges are deleted at the end.
#[cfg(test)]
pub(crate) mod live {
    use super::tests::at;
    use super::*;
    use chrono::{DurationRound, SecondsFormat};
    use drumline_shared::config::Config;
    use lapin::options::{
        BasicGetOptions, ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use lapin::types::FieldTable;
    use lapin::{Connection, ConnectionProperties};
    use std::path::Path;

    const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

    /// A namespace; everything in it is deleted on drop.
    pub(crate) struct Ns(pub(crate) String);

    impl Ns {
        pub(crate) fn new(test: &str) -> Self {
            let id = uuid::Uuid::new_v4().simple().to_string();
            Ns(format!("t_beat_{test}_{}", &id[..8]))
        }

        /// A config in this namespace: `body` plus task `t`.
        pub(crate) fn config(&self, body: &str) -> Config {
            let text = format!(
                "namespace = \"{}\"\n{body}\n[tasks.t]\ncommand = [\"/bin/true\"]\n",
                self.0
            );
            Config::parse(&text, Path::new("test.toml"), |_| None)
                .unwrap_or_else(|e| panic!("bad test config: {e}"))
        }

        async fn store(&self) -> Store {
            Store::connect("redis://127.0.0.1:6379/0", None, Names::new(self.0.clone()))
                .await
                .expect("redis")
        }
    }

    impl Drop for Ns {
        fn drop(&mut self) {
            let ns = self.0.clone();
            let _ = std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime")
                    .block_on(cleanup(ns));
            })
            .join();
        }
    }

    async fn cleanup(ns: String) {
        let names = Names::new(ns.clone());
        if let Ok(client) = redis::Client::open("redis://127.0.0.1:6379/0") {
            if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                let keys: Vec<String> = redis::cmd("KEYS")
                    .arg(format!("{ns}:*"))
                    .query_async(&mut conn)
                    .await
                    .unwrap_or_default();
                if !keys.is_empty() {
                    let _: Result<(), _> = redis::cmd("DEL").arg(keys).query_async(&mut conn).await;
                }
            }
        }
        if let Ok(amqp) = Connection::connect(AMQP, ConnectionProperties::default()).await {
            // A channel per deletion: one that fails (never declared) closes its channel.
            let queues = ["default", "a", "b"].map(|q| names.work_queue(q));
            for queue in queues.into_iter().chain([names.dead()]) {
                if let Ok(ch) = amqp.create_channel().await {
                    let _ = ch.queue_delete(&queue, QueueDeleteOptions::default()).await;
                }
            }
            for exchange in [names.tasks_exchange(), names.dead()] {
                if let Ok(ch) = amqp.create_channel().await {
                    let _ = ch
                        .exchange_delete(&exchange, ExchangeDeleteOptions::default())
                        .await;
                }
            }
            let _ = amqp.close(200, "bye").await;
        }
    }

    /// `{ns}:beat:last:{job}` for each job.
    async fn lasts(store: &Store, jobs: &[&str]) -> Vec<Option<String>> {
        let keys: Vec<String> = jobs.iter().map(|j| store.names().beat_last(j)).collect();
        redis::cmd("MGET")
            .arg(keys)
            .query_async(&mut store.connection())
            .await
            .expect("MGET")
    }

    /// Runs the beat on `config` until `done` holds (polled every 50 ms, at most 60 s).
    async fn run_until<F, Fut>(config: Config, mut done: F) -> BeatStats
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let watch = async {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !done().await {
                assert!(Instant::now() < deadline, "the beat never got there");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let _ = stop.send(());
        };
        let beat = run(config, BeatStats::default(), async {
            let _ = stopped.await;
        });
        let (stats, ()) = tokio::join!(beat, watch);
        stats.expect("the beat failed")
    }

    fn rfc3339(t: DateTime<Utc>) -> String {
        t.to_rfc3339_opts(SecondsFormat::AutoSi, true)
    }

    #[tokio::test]
    async fn progress_writes_only_move_forward_and_fail_job_by_job() {
        let ns = Ns::new("save");
        let store = ns.store().await;
        let (t1, t2) = (at("2026-03-02T12:00:00Z"), at("2026-03-02T12:01:00Z"));
        let mut conn = store.connection();
        // `c` holds a hash: its write fails, the others' do not.
        let () = redis::cmd("HSET")
            .arg(store.names().beat_last("c"))
            .arg("f")
            .arg("v")
            .query_async(&mut conn)
            .await
            .unwrap();
        let out = save_progress(&store, &[("a", t2), ("c", t2), ("b", t1)])
            .await
            .unwrap();
        assert!(
            out[0].is_ok() && out[1].is_err() && out[2].is_ok(),
            "{out:?}"
        );
        // `a` does not move back; `b` moves forward.
        let out = save_progress(&store, &[("a", t1), ("b", t2)])
            .await
            .unwrap();
        assert!(out.iter().all(Result::is_ok), "{out:?}");
        let text = |t| Some(last_instant_text(t));
        assert_eq!(lasts(&store, &["a", "b"]).await, vec![text(t2), text(t2)]);
    }

    #[tokio::test]
    async fn a_new_jobs_start_is_persisted_so_misses_before_its_first_instant_are_reported() {
        let ns = Ns::new("first_start");
        let store = ns.store().await;
        let started = Utc::now();
        // First instant 2-3 s after the start; missed 1 s after it.
        let first = started.duration_trunc(TimeDelta::seconds(1)).unwrap() + TimeDelta::seconds(3);
        let config = ns.config(&format!(
            "[beat]\nmisfire_threshold = \"1s\"\n[[jobs]]\nname = \"j\"\ntask = \"t\"\n\
             every = \"1h\"\nanchor = \"{}\"\nmisfire = \"skip\"",
            rfc3339(first)
        ));

        // A first start that stops before the first instant still leaves its start behind.
        let stats = run_until(config.clone(), || async {
            lasts(&store, &["j"]).await[0].is_some()
        })
        .await;
        assert_eq!(stats.published.get(), 0);
        let persisted = lasts(&store, &["j"]).await[0].clone().unwrap();
        let persisted = parse_last(&persisted).unwrap();
        assert!(persisted >= started && persisted < first, "{persisted}");

        // Down past the first instant and its threshold: the next start reports it missed.
        while Utc::now() < first + TimeDelta::milliseconds(1500) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let want = last_instant_text(first);
        let stats = run_until(config, || async {
            lasts(&store, &["j"]).await[0].as_ref() == Some(&want)
        })
        .await;
        assert_eq!(
            (stats.published.get(), stats.dropped.get()),
            (0, 1),
            "{stats:?}"
        );
    }

    #[tokio::test]
    async fn jobs_due_together_are_published_in_batches_each_instant_once() {
        let ns = Ns::new("batches");
        let store = ns.store().await;
        let now = Utc::now().duration_trunc(TimeDelta::seconds(1)).unwrap();
        // More jobs than one batch takes, all due at `due`; and one job catching up more
        // messages than one batch holds.
        let jobs = BATCH_JOBS + 200;
        let catch_up = BATCH_MESSAGES + 200;
        let due = now + TimeDelta::seconds(3);
        let anchor = now + TimeDelta::seconds(30);
        let mut body = format!(
            "[[jobs]]\nname = \"catch\"\ntask = \"t\"\nevery = \"1m\"\nanchor = \"{}\"\n\
             misfire = \"catch_up\"\noverlap = \"queue\"\nmax_catch_up = {catch_up}\n\
             misfire_grace = \"30d\"\n",
            rfc3339(anchor)
        );
        let names: Vec<String> = (0..jobs).map(|i| format!("j{i:05}")).collect();
        for name in &names {
            body.push_str(&format!(
                "[[jobs]]\nname = \"{name}\"\ntask = \"t\"\nevery = \"1h\"\nanchor = \"{}\"\n",
                rfc3339(due)
            ));
        }
        let config = ns.config(&body);
        let missed_from = anchor - TimeDelta::minutes(catch_up as i64);
        let newest_missed = anchor - TimeDelta::minutes(1);
        let out = save_progress(&store, &[("catch", missed_from - TimeDelta::minutes(1))])
            .await
            .unwrap();
        assert!(out[0].is_ok());

        let (want_catch, want_due) = (last_instant_text(newest_missed), last_instant_text(due));
        let all: Vec<&str> = names.iter().map(String::as_str).collect();
        let stats = run_until(config, || async {
            lasts(&store, &["catch"]).await[0].as_ref() == Some(&want_catch)
                && lasts(&store, &all)
                    .await
                    .iter()
                    .all(|l| l.as_ref() == Some(&want_due))
        })
        .await;
        assert_eq!(stats.published.get() as usize, jobs + catch_up, "{stats:?}");
        assert_eq!((stats.dropped.get(), stats.publish_failures.get()), (0, 0));

        // What the queue holds: each instant once, the catch-up oldest first.
        let amqp = Connection::connect(AMQP, ConnectionProperties::default())
            .await
            .unwrap();
        let ch = amqp.create_channel().await.unwrap();
        let queue = Names::new(ns.0.clone()).work_queue("default");
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let declared = ch
            .queue_declare(&queue, passive, FieldTable::default())
            .await
            .unwrap();
        assert_eq!(declared.message_count() as usize, jobs + catch_up);
        let mut catch = Vec::new();
        let mut others = Vec::new();
        while let Some(msg) = ch
            .basic_get(&queue, BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let env = Envelope::decode(&msg.delivery.data).unwrap();
            match env.job.as_deref() {
                Some("catch") => catch.push(env.scheduled_for),
                _ => others.push(env.key),
            }
        }
        let _ = amqp.close(200, "bye").await;
        let want: Vec<_> = (0..catch_up as i64)
            .map(|k| missed_from + TimeDelta::minutes(k))
            .collect();
        assert!(catch == want, "catch-up out of order, doubled or missing");
        others.sort();
        let want: Vec<_> = names.iter().map(|n| instance_key(n, due)).collect();
        assert!(others == want, "on-time instances doubled or missing");
    }
}
