//! When to publish what (DESIGN §2). The decision is pure — [`plan`] takes the job, the last
//! decided instant and `now` — so misfire policies are tested on fixed instants; [`run`] is the
//! loop that feeds it the wall clock, publishes, and persists progress after each confirm.
//!
//! Progress is one instant per job, `{ns}:beat:last:{job}`: everything up to it has been
//! decided (published, or dropped and reported). Because it is persisted and only moves
//! forward, the same planning covers every way of missing instances — a beat restart, a broker
//! or Redis outage, a forward wall-clock jump — and a backward jump finds nothing to do.

use crate::publisher::{PublishError, Publisher};
use chrono::{DateTime, TimeDelta, Utc};
use drumline_shared::config::{Config, Job, Misfire};
use drumline_shared::envelope::{instance_key, Envelope};
use drumline_shared::names::Names;
use drumline_shared::schedule::Schedule;
use drumline_shared::store::{Store, StoreError};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::future::Future;
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

/// Counters the beat keeps.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BeatStats {
    /// Instances published and confirmed.
    pub published: u64,
    /// Instances decided not to publish (each logged with its key, or in a counted range).
    pub dropped: u64,
    /// Publish attempts that failed (retried).
    pub publish_failures: u64,
    /// Progress writes to Redis that failed (the job waits until one succeeds).
    pub persist_failures: u64,
}

/// Why a job could not move forward now; it is planned again after a backoff.
#[derive(Debug, thiserror::Error)]
enum Stall {
    /// The broker did not take an instance.
    #[error(transparent)]
    Publish(#[from] PublishError),
    /// Redis did not take the job's progress.
    #[error("cannot persist the job's progress to redis: {0}")]
    Persist(#[from] StoreError),
}

/// Per-job progress.
struct JobState {
    /// Newest instant decided (published or dropped); never moves back.
    last: DateTime<Utc>,
    /// The first instant after `last`, if any.
    next: Option<DateTime<Utc>>,
    /// `last` is ahead of what Redis holds (a write failed): written before anything else.
    unsaved: bool,
}

/// Runs the beat until `shutdown` completes.
///
/// Shutdown is observed between jobs and while waiting, never inside one job's publish and
/// persist, so an instance confirmed by the broker always has its progress written before exit
/// (a restarted beat then publishes no instant twice).
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<BeatStats, PublishError> {
    tokio::pin!(shutdown);
    let names = Names::new(config.namespace.clone());
    let store = tokio::select! {
        s = connect_redis(&config, &names) => s,
        _ = &mut shutdown => return Ok(BeatStats::default()),
    };
    let mut publisher = Publisher::new(&config);
    let mut stats = BeatStats::default();
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
    let start = Utc::now();
    let resumed = lasts.iter().filter(|l| l.is_some()).count();
    let mut states: Vec<JobState> = config
        .jobs
        .iter()
        .zip(lasts)
        .map(|(job, last)| {
            let last = last.unwrap_or(start);
            JobState {
                last,
                next: job.schedule.next_after(last),
                unsaved: false,
            }
        })
        .collect();
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
        warn!(error = %e, "broker not reachable yet; will retry");
    }

    let threshold = config.beat.misfire_threshold;
    let mut retry_backoff = Duration::from_millis(200);
    'beat: loop {
        // Wake at the next due instant, but at least once a second to notice wall-clock jumps.
        let mut wait = Duration::from_secs(1);
        while let Some(Reverse((due, i))) = queue.peek().copied() {
            // Re-read per job: publishing many due jobs takes time, and lateness is judged
            // against the clock when each job is planned.
            let now = Utc::now();
            if due > now {
                wait = wait.min((due - now).to_std().unwrap_or_default());
                break;
            }
            // Many jobs can be due at once (100,000 on the minute): let a signal in between.
            tokio::select! {
                biased;
                _ = &mut shutdown => break 'beat,
                _ = std::future::ready(()) => {}
            }
            queue.pop();
            let job = &config.jobs[i];
            let state = &mut states[i];
            let result = advance(
                job,
                state,
                now,
                threshold,
                &store,
                &mut publisher,
                &mut stats,
                epoch,
            )
            .await;
            match result {
                Ok(()) => {
                    retry_backoff = Duration::from_millis(200);
                    if let Some(next) = state.next {
                        queue.push(Reverse((next, i)));
                    }
                }
                Err(e) => {
                    match &e {
                        Stall::Publish(_) => stats.publish_failures += 1,
                        Stall::Persist(_) => stats.persist_failures += 1,
                    }
                    warn!(job = %job.name, error = %e, retry_in_ms = retry_backoff.as_millis() as u64, "job stalled; will retry");
                    if let Stall::Publish(e @ PublishError::Topology(_)) = e {
                        return Err(e);
                    }
                    // Planned again at the next wake from the progress made so far: instances
                    // the outage made late become misses and follow the policy.
                    queue.push(Reverse((due, i)));
                    wait = retry_backoff;
                    retry_backoff = (retry_backoff * 2).min(Duration::from_secs(5));
                    break;
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = &mut shutdown => break,
        }
    }
    publisher.close().await;
    info!(
        published = stats.published,
        dropped = stats.dropped,
        publish_failures = stats.publish_failures,
        persist_failures = stats.persist_failures,
        "beat stopped"
    );
    Ok(stats)
}

/// Publishes what is due for one job and moves its progress forward.
///
/// Progress is written to Redis after each confirm (DESIGN §2). A write that fails stalls the
/// job, like a broker failure: this beat remembers the progress (it never republishes), writes
/// it first when it retries, and instances that come due meanwhile are misses — the beat could
/// not reach Redis.
#[allow(clippy::too_many_arguments)]
async fn advance(
    job: &Job,
    state: &mut JobState,
    now: DateTime<Utc>,
    threshold: Duration,
    store: &Store,
    publisher: &mut Publisher,
    stats: &mut BeatStats,
    epoch: u64,
) -> Result<(), Stall> {
    if state.unsaved {
        save(store, job, state).await?;
    }
    let plan = plan(job, state.last, now, threshold);
    report_dropped(job, &plan, stats);
    // The drops are all older than the first instance to publish: settle them now, so that if
    // a publish below fails, the next plan starts after them and does not report them again.
    if let Some(dropped) = plan.dropped_up_to.filter(|d| *d > state.last) {
        state.last = dropped;
        save(store, job, state).await?;
    }
    for t in &plan.publish {
        let expires_at = job
            .expires
            .and_then(|e| chrono::Duration::from_std(e).ok())
            .map(|e| *t + e);
        let env = Envelope::scheduled(
            &job.name,
            &job.task,
            &job.queue,
            job.args.clone(),
            *t,
            expires_at,
            Utc::now(),
        );
        publisher.publish(&env, Utc::now(), epoch).await?;
        stats.published += 1;
        info!(job = %job.name, key = %env.key, "published");
        state.last = state.last.max(*t);
        save(store, job, state).await?;
    }
    if let Some(decided) = plan.decided_up_to.filter(|d| *d > state.last) {
        state.last = decided;
        save(store, job, state).await?;
    }
    state.next = job.schedule.next_after(state.last);
    Ok(())
}

/// Writes `state.last` as the job's persisted progress (never moving it back); on failure the
/// state stays marked unsaved.
async fn save(store: &Store, job: &Job, state: &mut JobState) -> Result<(), StoreError> {
    state.unsaved = true;
    store.advance_last_published(&job.name, state.last).await?;
    state.unsaved = false;
    Ok(())
}

/// Logs every dropped instance with its key (beyond [`MAX_LISTED`]: one line with the count and
/// the first and last key) and counts them.
fn report_dropped(job: &Job, plan: &Plan, stats: &mut BeatStats) {
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
    stats.dropped += plan.dropped_count();
}

async fn connect_redis(config: &Config, names: &Names) -> Store {
    let mut backoff = Duration::from_millis(200);
    loop {
        match Store::connect(&config.redis_url, names.clone()).await {
            Ok(store) => return store,
            Err(e) => {
                error!(error = %e, "redis unreachable; the beat waits for it (it holds each job's progress)");
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

    fn at(text: &str) -> DateTime<Utc> {
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
}
