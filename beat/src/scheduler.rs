//! The beat loop (docs/design.md): wakes when jobs come due, asks [`plan`] what to publish,
//! publishes through the [`Publisher`], and moves each job's [`progress`] once the broker
//! confirmed. Touches Redis only through the [`Store`] (via [`progress`]), the broker only
//! through the [`Publisher`]. What a batch takes (`take_due`) and what a stall means
//! (`isolated_backoff`, `Beat::after_batch`) are decided apart from the effects (`advance`).
//!
//! Only the leader publishes ([`leader`](crate::leader)): a beat stands by until it holds the
//! lease, then loads every job's progress and leads a [`Term`] — checked before each batch and
//! before each message is handed to the broker — until the term ends; then it drops what it
//! knew and stands by again. Its progress writes are fenced by the lease's token. It plans with
//! its own clock capped at Redis `TIME` + `misfire_threshold` ([`Term::now`]).
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

use crate::follower::{self, Followers};
use crate::journal;
use crate::leader::{Leadership, Term};
use crate::misfire::{self, plan_held, Plan};
use crate::progress::{self, progress_after};
use crate::publisher::Publisher;
use crate::reload::{self, Held, Resume};
pub use crate::stats::BeatStats;
use crate::stats::{report_dropped, RedisContact};
use chrono::{DateTime, Utc};
use drumline_shared::backoff::Backoff;
use drumline_shared::broker::{BrokerError, Sending};
use drumline_shared::config::{Config, Job};
use drumline_shared::envelope::Envelope;
use drumline_shared::names::Names;
use drumline_shared::signals::Hangups;
use drumline_shared::store::LeaderEntry;
use drumline_shared::store::{
    last_instant_text, parse_last_instant, ProgressError, Store, StoreError,
};
use drumline_shared::url::Redacted;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet, VecDeque};
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{error, info, warn};

/// `read()` until it answers, a second apart, logging each failure as "cannot read `what`
/// from redis"; `None` when `shutdown` comes first.
async fn until_read<T, E, Fut, F>(
    what: &str,
    shutdown: &mut Pin<&mut F>,
    mut read: impl FnMut() -> Fut,
) -> Option<T>
where
    E: std::fmt::Display,
    Fut: Future<Output = Result<T, E>>,
    F: Future<Output = ()>,
{
    loop {
        match read().await {
            Ok(value) => return Some(value),
            Err(e) => {
                error!(error = %e, "cannot read {what} from redis; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = shutdown.as_mut() => return None,
                }
            }
        }
    }
}

/// Most jobs planned and published together (see the module doc).
pub const BATCH_JOBS: usize = 1000;

/// Most messages published together; a job with more to publish (a long catch-up) goes on in
/// the next batch.
pub const BATCH_MESSAGES: usize = 5000;
/// The most batches sent whose confirms are not read yet (the beat's `run_due`).
pub const IN_FLIGHT: usize = 8;

/// New jobs' starts persisted per Redis round trip ([`Beat::persist_new_starts`]).
const NEW_STARTS_PER_TRIP: usize = 10_000;

/// The least time until the next due instant in which a term writes a slice of its new jobs'
/// starts ([`Beat::persist_starts_in_gaps`]): a slice is one round trip of a few tens of ms.
const STARTS_GAP: Duration = Duration::from_millis(100);

/// Stalled jobs logged one by one per batch; the rest are counted in one line.
pub const STALLS_LISTED: usize = 10;

/// First wait before a job whose own message failed is tried again (alone); doubled per
/// consecutive failure up to [`ISOLATED_BACKOFF_MAX`].
pub const ISOLATED_BACKOFF: Duration = Duration::from_millis(200);

/// Longest wait between two tries of a job whose own message keeps failing.
pub const ISOLATED_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// A job whose own message failed: [`ISOLATED_BACKOFF`] doubled per consecutive failure up to
/// [`ISOLATED_BACKOFF_MAX`], without jitter.
const ISOLATED: Backoff = Backoff::constant(ISOLATED_BACKOFF, ISOLATED_BACKOFF_MAX, 0.0);

/// The wait when the broker or Redis stalled a batch: 200 ms, doubled per such batch up to
/// 5 s, back to 200 ms after a batch without one.
const SHARED: Backoff = Backoff::constant(Duration::from_millis(200), Duration::from_secs(5), 0.0);

/// Between tries to reach Redis at start: 200 ms, doubled up to 5 s.
const REDIS_CONNECT: Backoff =
    Backoff::constant(Duration::from_millis(200), Duration::from_secs(5), 0.0);

/// Longest sleep: the loop looks at the clock at least once a second to notice wall-clock jumps.
const MAX_WAIT: Duration = Duration::from_secs(1);

/// How long before the next instant the beat wakes. tokio's timer ticks in whole milliseconds
/// and wakes up to about one tick late, and a wake first reads the paused set (a Redis round
/// trip): both fit in this margin, and the rest of the way to the instant is slept with the OS
/// timer ([`sleep_precisely`]), so a job's messages leave within a fraction of a millisecond of
/// its instant rather than one to two milliseconds after it.
const WAKE_EARLY: Duration = Duration::from_millis(3);

/// How often the leader looks at the upstream instances its `after` jobs wait for
/// ([`follower`]), at most.
const FOLLOW_POLL: Duration = Duration::from_millis(200);

/// The followers are looked at only when the next due instant is at least this far off, so
/// that their Redis read and publish never delay it.
const FOLLOW_ROOM: Duration = Duration::from_millis(20);

/// Why a job could not move forward now; it is planned again after a backoff. Shared (`Arc`)
/// because one failure — the broker or Redis unreachable — stalls every job of a batch.
#[derive(Debug, Clone, thiserror::Error)]
enum Stall {
    /// One of the job's messages was sent and failed (refused, unroutable, or lost with a
    /// channel that some message of the batch closed). The job is tried again alone, so that
    /// whatever is wrong with its message cannot fail the others' again.
    #[error(transparent)]
    Publish(Arc<BrokerError>),
    /// Nothing of the batch could be sent (no connection): every job waits for the broker.
    #[error(transparent)]
    Unsent(Arc<BrokerError>),
    /// The term stopped holding mid-batch (a renewal late), so the job's messages were not
    /// sent. Not the job's fault: it is planned again, at its due instant, once the term holds.
    #[error("not sent: this beat stopped leading mid-batch")]
    NotLeading,
    /// Redis did not take the job's progress (unreachable, or the lease is not ours).
    #[error("cannot persist the job's progress to redis: {0}")]
    Persist(Arc<ProgressError>),
}

/// Per-job progress.
#[derive(Clone)]
struct JobState {
    /// Newest instant decided (published or dropped); never moves back.
    last: DateTime<Utc>,
    /// The first instant after `last`, if any.
    next: Option<DateTime<Utc>>,
    /// `last` is ahead of what Redis holds (not written yet, or a write failed): written
    /// before anything is published for the job.
    unsaved: bool,
    /// The job's rule ([`reload::rule`]) is not recorded with its progress yet (a start, or
    /// progress from a release before rules): written with the next write of its progress,
    /// before anything is published for the job.
    rule_unsaved: bool,
    /// Consecutive attempts that stalled; 0 when the last one moved.
    failures: u32,
    /// One of its messages failed in a batch: it is published in a batch of its own until
    /// one succeeds (docs/design.md: a job that cannot be published never holds up the others).
    alone: bool,
    /// The instants a reload that lowered the job's jitter held: due no earlier than the
    /// reload ([`reload::held`], docs/design.md#jitter).
    held: Option<Held>,
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
    /// Its held instants ([`JobState::held`]): their `expires` counts from the reload.
    held: Option<Held>,
}

/// Min-heap of (next instant, job index): a wake looks only at the jobs due, never at all.
type Queue = BinaryHeap<Reverse<(DateTime<Utc>, usize)>>;

impl JobState {
    /// A job's state from its persisted progress `last`; without one (a first start, or a job
    /// added or rescheduled by a reload) it starts at `start`, unsaved, its rule with it.
    fn from(job: &Job, last: Option<DateTime<Utc>>, start: DateTime<Utc>) -> Self {
        JobState {
            last: last.unwrap_or(start),
            // An `after` job is never due on its own: the followers' step publishes it.
            next: job
                .after
                .is_none()
                .then(|| job.schedule.next_after(last.unwrap_or(start)))
                .flatten(),
            unsaved: last.is_none(),
            rule_unsaved: last.is_none(),
            failures: 0,
            alone: false,
            held: None,
        }
    }

    /// Something of the job is not in Redis yet: written before anything is published for it.
    fn to_write(&self) -> bool {
        self.unsaved || self.rule_unsaved
    }
}

/// The state of a job a reload at `now` keeps, its jitter changed from `old`'s to `new`'s: its
/// instants not yet due under a higher old offset are held ([`reload::held`]).
fn kept(state: &JobState, old: &Job, new: &Job, now: DateTime<Utc>) -> JobState {
    JobState {
        held: reload::held(old, new, now, state.held),
        ..state.clone()
    }
}

/// Where a job starts on its first start: `now` as a restart would read it back (whole
/// milliseconds), so nothing before it counts as missed.
fn first_start(now: DateTime<Utc>) -> DateTime<Utc> {
    parse_last_instant(&last_instant_text(now)).unwrap_or(now)
}

/// What a new term leaves each follower rescheduled since its progress was recorded to decide,
/// as a reload does ([`follower::carried_over`]): its old rule's instants after its progress up
/// to `at` (a chain in flight when the last leader died still decides them). One read of the
/// old rules, only when such a follower exists.
async fn carried_at_gain(
    store: &Store,
    jobs: &[Job],
    (lasts, resumes): (&[Option<DateTime<Utc>>], &[Resume]),
    at: DateTime<Utc>,
) -> Result<Vec<(usize, Vec<DateTime<Utc>>)>, StoreError> {
    let restarted: Vec<usize> = (0..jobs.len())
        .filter(|&i| resumes[i] == Resume::Restart && jobs[i].after.is_some())
        .collect();
    if restarted.is_empty() {
        return Ok(Vec::new());
    }
    let old = progress::load_recorded_schedules(store, jobs, &restarted).await?;
    Ok(restarted
        .into_iter()
        .zip(old)
        .filter_map(|(i, old)| {
            let instants = follower::old_rule_instants(&old?, lasts[i]?, at);
            Some((i, instants))
        })
        .collect())
}

/// How a new term resumes each job ([`reload::resume`]), logging the jobs rescheduled since
/// their progress was recorded (those start from the new term).
fn resumes(
    jobs: &[Job],
    lasts: &[Option<DateTime<Utc>>],
    same_rules: &[Option<bool>],
) -> Vec<Resume> {
    let resumes: Vec<Resume> = lasts
        .iter()
        .zip(same_rules)
        .map(|(last, same)| reload::resume_from(last.is_some(), *same))
        .collect();
    let restarted: Vec<&str> = jobs
        .iter()
        .zip(&resumes)
        .filter(|(_, r)| **r == Resume::Restart)
        .map(|(job, _)| job.name.as_str())
        .collect();
    for job in restarted.iter().take(STALLS_LISTED) {
        info!(job = %job, "rescheduled since its progress was recorded: starts now, as on a reload");
    }
    if restarted.len() > STALLS_LISTED {
        info!(
            more = restarted.len() - STALLS_LISTED,
            "more jobs rescheduled since their progress was recorded start now"
        );
    }
    resumes
}

/// The due queue of `states`: each job at its next instant, plus its jitter.
fn due_queue(jobs: &[Job], states: &[JobState]) -> Queue {
    states
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.next.map(|n| Reverse((n + jobs[i].jitter_offset(), i))))
        .collect()
}

/// The loop's state: the config it runs (replaced on SIGHUP), every job's progress, the due
/// queue, and the stall bookkeeping.
struct Beat {
    config: Arc<Config>,
    states: Vec<JobState>,
    queue: Queue,
    /// `beat.misfire_threshold`.
    threshold: Duration,
    /// Jobs whose last attempt stalled (`failures > 0`), for the gauge.
    stuck: i64,
    /// The waits when the broker or Redis stalls batches in a row.
    backoff: Backoff,
    /// Jobs paused (`{ns}:paused`), as last read: their instants are dropped, not published.
    paused: HashSet<String>,
    /// The `after` jobs and what this term decided of them ([`follower`]).
    followers: Followers,
    /// Jobs before this index have had their start persisted this term, if it was new
    /// ([`Beat::persist_starts_in_gaps`]).
    starts_from: usize,
    /// Starts persisted that way this term, for the log line once all are.
    starts_persisted: usize,
}

/// Runs the beat until `shutdown` completes: stands by, leads while it holds the lease, stands
/// by again when it loses it; on the way out releases the lease.
///
/// Shutdown is observed between batches and while waiting, never inside a batch's publish
/// and persist, so an instance confirmed by the broker always has its progress written before
/// exit (the next leader then publishes no instant twice).
pub async fn run(
    config: impl Into<Arc<Config>>,
    stats: BeatStats,
    shutdown: impl Future<Output = ()>,
) -> Result<BeatStats, BrokerError> {
    tokio::pin!(shutdown);
    // Listen for SIGHUP from the start: its default action would end the process.
    let mut hangups = Hangups::new();
    // Shared, never cloned: the status page reads the same one.
    let mut config: Arc<Config> = config.into();
    let store = tokio::select! {
        s = connect_redis(&config, &stats) => s,
        _ = &mut shutdown => return Ok(stats),
    };
    let mut publisher = Publisher::new(&config);
    let (lease, threshold) = (config.beat.leader_lease, config.beat.misfire_threshold);
    let mut leadership = Leadership::start(store.clone(), lease, threshold, stats.clone());
    let served = serve(
        &mut config,
        &store,
        (&mut publisher, &mut leadership, &mut hangups),
        &stats,
        &mut shutdown,
    )
    .await;
    leadership.resign().await;
    publisher.close().await;
    info!(
        published = stats.published_total(),
        dropped = stats.dropped_total(),
        publish_failures = stats.publish_failures.get(),
        persist_failures = stats.persist_failures.get(),
        "beat stopped"
    );
    served.map(|()| stats)
}

/// How a term of leadership ended.
enum Ended {
    /// `shutdown` completed.
    Shutdown,
    /// The lease was lost or taken: stand by.
    Lost,
}

/// What [`Beat::run_due`] found when it stopped publishing.
enum Next {
    /// Nothing is due for this long.
    Wait(Duration),
    /// Jobs stalled (the broker or Redis failed them): wait this long before trying again.
    Backoff(Duration),
    /// The term does not hold now (a renewal is late, or the lease is lost).
    NotHolding,
    /// `shutdown` completed.
    Shutdown,
}

/// Term after term until `shutdown`: wait to lead, load progress, lead. SIGHUP replaces
/// `config` (a standby's takes effect at its next term, where the reload rules are applied to
/// the progress recorded by whoever led, [`reload::resume`]; a leader's at once,
/// [`Beat::reload`]).
async fn serve<F: Future<Output = ()>>(
    config: &mut Arc<Config>,
    store: &Store,
    (publisher, leadership, hangups): (&mut Publisher, &mut Leadership, &mut Hangups),
    stats: &BeatStats,
    shutdown: &mut Pin<&mut F>,
) -> Result<(), BrokerError> {
    connect_broker(config, publisher).await?;
    loop {
        let mut term = loop {
            tokio::select! {
                term = leadership.next_term() => break term,
                _ = hangups.recv() => {
                    if let Some(new) = reload(config) {
                        publisher.reconfigure(&new);
                        *config = new;
                    }
                }
                _ = shutdown.as_mut() => return Ok(()),
            }
        };
        let Some(mut beat) = Beat::start(config, store, &term, shutdown).await else {
            return Ok(());
        };
        let ended = beat
            .lead(
                store,
                publisher,
                stats,
                (&mut term, &mut *hangups),
                shutdown,
            )
            .await?;
        *config = beat.config.clone();
        match ended {
            Ended::Shutdown => return Ok(()),
            Ended::Lost => info!(epoch = term.epoch, "stopped publishing; standing by"),
        }
    }
}

/// Re-reads the config file on SIGHUP: the running config with the file's `[[jobs]]` and
/// `[tasks.*]` (everything else takes a restart, and is named), or `None` (logged) when the
/// file does not load and the running one stays.
fn reload(config: &Config) -> Option<Arc<Config>> {
    match config.reload() {
        Ok((new, restart)) => {
            if !restart.is_empty() {
                warn!(changed = ?restart, "reloaded [[jobs]]; these changes take a restart of the beat");
            }
            // Field by field: `..config.clone()` would copy every running job only to drop it.
            Some(Arc::new(Config {
                jobs: new.jobs,
                tasks: new.tasks,
                limits: new.limits,
                calendars: new.calendars,
                path: config.path.clone(),
                namespace: config.namespace.clone(),
                broker_url: config.broker_url.clone(),
                broker: config.broker.clone(),
                redis_url: config.redis_url.clone(),
                broker_ca_file: config.broker_ca_file.clone(),
                redis_ca_file: config.redis_ca_file.clone(),
                redis_wait: config.redis_wait,
                beat: config.beat.clone(),
                worker: config.worker.clone(),
                journal: config.journal,
                api: config.api.clone(),
            }))
        }
        Err(e) => {
            error!(error = %e, "reload refused: the file does not load; the running config stays");
            None
        }
    }
}

impl Beat {
    /// Loads every job's progress and the rule it was recorded under (retrying while Redis
    /// fails; `None` on shutdown), restarts from now the jobs rescheduled since
    /// ([`reload::resume`]), and persists every new job's start, for `term`.
    async fn start<F: Future<Output = ()>>(
        config: &Arc<Config>,
        store: &Store,
        term: &Term,
        shutdown: &mut Pin<&mut F>,
    ) -> Option<Beat> {
        let loading = Instant::now();
        let (lasts, rules) = until_read("the jobs' progress", shutdown, || async {
            tokio::try_join!(
                progress::load_last(store, &config.jobs),
                progress::load_rules(store, &config.jobs)
            )
        })
        .await?;
        let resumes = resumes(&config.jobs, &lasts, &rules);
        let carried = until_read("the followers' old rules", shutdown, || {
            carried_at_gain(store, &config.jobs, (&lasts, &resumes), term.now())
        })
        .await?;
        // A job rescheduled since its progress was recorded starts now, as a reload starts it.
        let lasts = lasts
            .into_iter()
            .zip(&resumes)
            .map(|(last, r)| last.filter(|_| *r != Resume::Restart))
            .collect();
        let resumed = resumes
            .iter()
            .filter(|r| matches!(r, Resume::Continue | Resume::Adopt))
            .count();
        let mut beat = Beat::new(config.clone(), lasts, term.now());
        for (state, r) in beat.states.iter_mut().zip(&resumes) {
            state.rule_unsaved |= *r == Resume::Adopt;
        }
        for (job, instants) in carried {
            beat.followers.carry(job, instants);
        }
        // Paused jobs are known before anything is published for this term. The new jobs'
        // starts are written while nothing is due ([`Beat::persist_starts_in_gaps`]).
        beat.paused = until_read("the paused jobs", shutdown, || store.paused()).await?;
        info!(
            jobs = config.jobs.len(),
            resumed,
            load_ms = loading.elapsed().as_millis() as u64,
            namespace = %config.namespace,
            epoch = term.epoch,
            "beat leading"
        );
        Some(beat)
    }

    /// The state at start, from each job's loaded progress. On a job's very first start nothing
    /// before `now` counts as missed: it starts from `now`, as a restart would read it back
    /// (whole milliseconds).
    fn new(config: Arc<Config>, lasts: Vec<Option<DateTime<Utc>>>, now: DateTime<Utc>) -> Self {
        let start = first_start(now);
        let states: Vec<JobState> = config
            .jobs
            .iter()
            .zip(lasts)
            .map(|(job, last)| JobState::from(job, last, start))
            .collect();
        let threshold = config.beat.misfire_threshold;
        Beat {
            queue: due_queue(&config.jobs, &states),
            followers: Followers::new(&config),
            config,
            states,
            threshold,
            stuck: 0,
            backoff: SHARED,
            paused: HashSet::new(),
            starts_from: 0,
            starts_persisted: 0,
        }
    }

    /// Runs `config` from now on (SIGHUP while leading): a job kept with the same schedule
    /// keeps its progress; an added job, or one whose schedule changed, starts from now as on
    /// a first start (nothing before the reload is caught up); a removed job stops. Persists
    /// the new starts.
    async fn reload(&mut self, config: Arc<Config>, store: &Store, term: &Term) {
        let carried = reload::carried(&self.config.jobs, &config.jobs);
        let now = term.now();
        let start = first_start(now);
        let old = std::mem::take(&mut self.states);
        self.states = config
            .jobs
            .iter()
            .zip(&carried)
            .map(|(job, from)| match from {
                Some(i) => kept(&old[*i], &self.config.jobs[*i], job, now),
                None => JobState::from(job, None, start),
            })
            .collect();
        self.queue = due_queue(&config.jobs, &self.states);
        self.stuck = self.states.iter().filter(|s| s.failures > 0).count() as i64;
        let summary = reload::Summary::of(&carried, old.len());
        info!(
            jobs = config.jobs.len(),
            kept = summary.kept,
            started = summary.started,
            removed = summary.removed,
            "reloaded the jobs (SIGHUP)"
        );
        self.followers = Followers::new(&config);
        let old_last = |o: usize| old[o].last;
        let at = term.now();
        let carried_over =
            follower::carried_over((&self.config.jobs, &old_last), &config.jobs, &carried, at);
        for (job, instants) in carried_over {
            self.followers.carry(job, instants);
        }
        self.config = config;
        self.persist_new_starts(store, term).await;
    }

    /// Persists the next [`NEW_STARTS_PER_TRIP`] new jobs' starts (and rules not recorded yet)
    /// of a term's start, in the gaps while nothing is due: a term leads at once, a million
    /// new jobs' starts (seconds of Redis's time) follow, and a due job never waits for them
    /// (its start is written before its first publish, as always). Returns whether any start
    /// is left to persist. Once all are, a beat that dies before a job's first instant and
    /// stays down reports those misses when it comes back (docs/design.md#one-scheduled-instance-through-the-beat).
    async fn persist_starts_in_gaps(&mut self, store: &Store, term: &Term) -> bool {
        let total = self.states.len();
        if self.starts_from >= total {
            return false;
        }
        let mut slice = Vec::with_capacity(NEW_STARTS_PER_TRIP);
        let mut end = self.starts_from;
        while end < total && slice.len() < NEW_STARTS_PER_TRIP {
            if self.states[end].to_write() {
                slice.push(end);
            }
            end += 1;
        }
        self.starts_from = end;
        let saved = save(store, term, &self.config.jobs, &mut self.states, &slice).await;
        let failed = saved.iter().flatten().count();
        self.starts_persisted += slice.len() - failed;
        if let Some(e) = saved.into_iter().flatten().next() {
            warn!(jobs = failed, error = %e,
                "cannot persist new jobs' start yet; it is written before their first publish");
        }
        if end == total && self.starts_persisted > 0 {
            info!(
                jobs = self.starts_persisted,
                "the new jobs' starts are persisted"
            );
        }
        end < total
    }

    /// Persists every new job's start (and every rule not recorded yet), so that a beat that
    /// dies before a job's first instant and stays down reports those misses when it comes
    /// back. A job whose write fails keeps it unsaved: written before anything is published
    /// for it.
    async fn persist_new_starts(&mut self, store: &Store, term: &Term) {
        // The gaps' slices, one after another.
        (self.starts_from, self.starts_persisted) = (0, 0);
        while self.persist_starts_in_gaps(store, term).await {}
    }

    /// Leads until the term ends or `shutdown` completes. `Err` only when the broker refused
    /// the topology.
    async fn lead<F: Future<Output = ()>>(
        &mut self,
        store: &Store,
        publisher: &mut Publisher,
        stats: &BeatStats,
        (term, hangups): (&mut Term, &mut Hangups),
        shutdown: &mut Pin<&mut F>,
    ) -> Result<Ended, BrokerError> {
        loop {
            match self
                .run_due(store, publisher, stats, term, shutdown)
                .await?
            {
                Next::Shutdown => return Ok(Ended::Shutdown),
                // Nothing due for a while: a slice of the new starts, then look again.
                Next::Wait(wait)
                    if wait >= STARTS_GAP && self.persist_starts_in_gaps(store, term).await => {}
                Next::Wait(wait) | Next::Backoff(wait) => tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = hangups.recv() => {
                        if let Some(new) = reload(&self.config) {
                            publisher.reconfigure(&new);
                            self.reload(new, store, term).await;
                        }
                    }
                    _ = shutdown.as_mut() => return Ok(Ended::Shutdown),
                },
                Next::NotHolding if term.ended() => return Ok(Ended::Lost),
                // A renewal is late: publish nothing until it lands or the term ends.
                Next::NotHolding => tokio::select! {
                    _ = term.changed() => {}
                    _ = shutdown.as_mut() => return Ok(Ended::Shutdown),
                },
            }
        }
    }

    /// Publishes batch after batch while jobs are due and the term holds; says why it stopped.
    /// `Err` only when the broker refused the topology.
    ///
    /// Up to [`IN_FLIGHT`] batches are in flight: the next ones are sent before the confirms
    /// of the oldest are read, so the broker's confirms (its disk writes) overlap the sending;
    /// each batch's progress is still written only after its own confirms ([`finish_due`]),
    /// oldest first. Before it waits, follows `after` jobs, backs off or returns, it finishes
    /// every batch in flight.
    async fn run_due<F: Future<Output = ()>>(
        &mut self,
        store: &Store,
        publisher: &mut Publisher,
        stats: &BeatStats,
        term: &Term,
        shutdown: &mut Pin<&mut F>,
    ) -> Result<Next, BrokerError> {
        self.read_paused(store).await;
        let mut flight = Flight::default();
        let mut stopping = false;
        loop {
            // Leadership is checked before each batch (and before each message is sent).
            let holds = term.holds();
            // Re-read per batch: lateness is judged against the clock when a job is planned.
            let now = term.now();
            let due_now = holds && self.wait(now).is_none() && self.until_next(now).is_none();
            // A completed shutdown future must not be polled again: remembered.
            stopping = stopping || stop_asked(shutdown).await;
            if !flight.batches.is_empty() && (!due_now || stopping || self.isolated(&flight)) {
                let wait = self
                    .finish_all(&mut flight, store, publisher, stats, term)
                    .await;
                match (stopping, wait) {
                    (true, _) => return Ok(Next::Shutdown),
                    (false, Some(wait)) => return Ok(Next::Backoff(wait)),
                    // Settling put the batches' jobs back: look again with nothing in flight.
                    (false, None) => continue,
                }
            }
            if stopping {
                return Ok(Next::Shutdown);
            }
            if !holds {
                return Ok(Next::NotHolding);
            }
            match self.not_due(now, store, publisher, stats, term).await? {
                Step::Again => continue,
                Step::Done(next) => return Ok(next),
                Step::Send => {}
            }
            let sent = self.send_next(now, &mut flight, store, publisher, stats, term);
            if let Some(next) = sent.await? {
                return Ok(next);
            }
        }
    }

    /// A job retried alone after its own message failed is never in flight beside another
    /// batch: a failure that closes the channel would take that one too.
    fn isolated(&self, flight: &Flight) -> bool {
        let alone = |job: usize| self.states[job].alone;
        flight
            .batches
            .iter()
            .any(|f| f.batch.iter().any(|d| alone(d.job)))
            || self
                .queue
                .peek()
                .is_some_and(|Reverse((_, job))| alone(*job))
    }

    /// When nothing is due at `now`: the wait until the next instant (the chains followed
    /// meanwhile when there is room), or the rest of an early wake-up slept precisely.
    async fn not_due(
        &mut self,
        now: DateTime<Utc>,
        store: &Store,
        publisher: &mut Publisher,
        stats: &BeatStats,
        term: &Term,
    ) -> Result<Step, BrokerError> {
        if let Some(wait) = self.wait(now) {
            if !self.followers.any() || wait < FOLLOW_ROOM {
                return Ok(Step::Done(Next::Wait(wait)));
            }
            self.follow(store, publisher, stats, term).await?;
            let wait = self.wait(term.now()).unwrap_or_default();
            return Ok(Step::Done(Next::Wait(wait.min(FOLLOW_POLL))));
        }
        // Woken early on purpose (at most `WAKE_EARLY`): the rest of the way, precisely,
        // then round again, so a clock that moved meanwhile is looked at with the lease.
        if let Some(early) = self.until_next(now) {
            sleep_precisely(early).await;
            return Ok(Step::Again);
        }
        Ok(Step::Send)
    }

    /// Sends the batch due at `now` and keeps it in flight: the oldest batch is finished when
    /// [`IN_FLIGHT`] are, all of them when nothing could be sent. `Some` ends the round.
    async fn send_next(
        &mut self,
        now: DateTime<Utc>,
        flight: &mut Flight,
        store: &Store,
        publisher: &mut Publisher,
        stats: &BeatStats,
        term: &Term,
    ) -> Result<Option<Next>, BrokerError> {
        let batch = self.take_batch(now);
        let jobs = &self.config.jobs;
        let sending = send_due(
            jobs,
            &mut self.states,
            batch,
            now,
            store,
            publisher,
            stats,
            term,
        );
        let sent = match sending.await {
            Ok(sent) => sent,
            Err(refused) => {
                // The batches in flight were sent: their progress is written first.
                self.finish_all(flight, store, publisher, stats, term).await;
                return Err(refused);
            }
        };
        // Nothing could be sent (no connection): finish what is in flight and back off now,
        // rather than let each next batch wait for a connect of its own.
        let unsent = sent
            .stalls
            .iter()
            .any(|s| matches!(s, Some(Stall::Unsent(_))));
        flight.batches.push_back(sent);
        if unsent {
            let wait = self.finish_all(flight, store, publisher, stats, term).await;
            return Ok(wait.map(Next::Backoff));
        }
        if flight.batches.len() < IN_FLIGHT {
            return Ok(None);
        }
        let oldest = flight.batches.pop_front().expect("in flight");
        let later = (&mut flight.returned, &mut flight.batches);
        let (batch, planned, stalls) = self
            .finish(oldest, store, publisher, stats, term, later)
            .await;
        let Some(wait) = self.settle(&batch, stalls, planned, stats) else {
            return Ok(None);
        };
        // Backing off: the batches sent meanwhile are finished first.
        let also = self.finish_all(flight, store, publisher, stats, term).await;
        Ok(Some(Next::Backoff(also.map_or(wait, |w| w.max(wait)))))
    }

    /// The next batch due at `now` ([`take_due`]). The upstream instants it drops are noted for
    /// their followers, which are then skipped at once (docs/design.md#job-dependencies).
    fn take_batch(&mut self, now: DateTime<Utc>) -> Vec<Due> {
        let jobs = &self.config.jobs;
        let at = (now, self.threshold);
        let batch = take_due(&mut self.queue, jobs, &self.states, at, &self.paused);
        if self.followers.any() {
            for due in &batch {
                self.followers.upstream_dropped(due.job, &due.plan);
            }
        }
        batch
    }

    /// Finishes and settles every batch in flight, oldest first; the longest backoff any
    /// settling asked for.
    async fn finish_all(
        &mut self,
        flight: &mut Flight,
        store: &Store,
        publisher: &mut Publisher,
        stats: &BeatStats,
        term: &Term,
    ) -> Option<Duration> {
        let mut wait: Option<Duration> = None;
        while let Some(oldest) = flight.batches.pop_front() {
            let later = (&mut flight.returned, &mut flight.batches);
            let (batch, planned, stalls) = self
                .finish(oldest, store, publisher, stats, term, later)
                .await;
            if let Some(w) = self.settle(&batch, stalls, planned, stats) {
                wait = Some(wait.map_or(w, |v| v.max(w)));
            }
        }
        flight.returned.clear();
        wait
    }

    /// [`finish_due`] on this loop's jobs and states.
    async fn finish(
        &mut self,
        in_flight: InFlight,
        store: &Store,
        publisher: &mut Publisher,
        stats: &BeatStats,
        term: &Term,
        later: (&mut HashSet<String>, &mut VecDeque<InFlight>),
    ) -> (Vec<Due>, DateTime<Utc>, Vec<Option<Stall>>) {
        let jobs = &self.config.jobs;
        finish_due(
            jobs,
            &mut self.states,
            in_flight,
            store,
            publisher,
            stats,
            term,
            later,
        )
        .await
    }

    /// Publishes or skips what it can of the `after` jobs' instances ([`follower::step`]) and
    /// persists their progress (fenced, only past what was confirmed or recorded). `Err` only
    /// when the broker refused the topology.
    async fn follow(
        &mut self,
        store: &Store,
        publisher: &mut Publisher,
        stats: &BeatStats,
        term: &Term,
    ) -> Result<(), BrokerError> {
        let ctx = follower::Ctx {
            store,
            publisher,
            stats,
            term,
            paused: &self.paused,
            retention: self.config.worker.done_ttl,
        };
        let states = &self.states;
        let moved = follower::step(
            &self.config.jobs,
            &mut self.followers,
            |i| states[i].last,
            ctx,
        )
        .await?;
        for (i, to) in moved {
            self.states[i].last = to;
            self.states[i].unsaved = true;
        }
        let which: Vec<usize> = self
            .followers
            .jobs()
            .filter(|i| self.states[*i].to_write())
            .collect();
        if which.is_empty() {
            return Ok(());
        }
        let saved = save(store, term, &self.config.jobs, &mut self.states, &which).await;
        if let Some(e) = saved.into_iter().flatten().next() {
            warn!(error = %e, "cannot persist the progress of `after` jobs yet; trying again");
        }
        Ok(())
    }

    /// Reads which jobs are paused (at every wake, so a pause is honoured within a second). When
    /// Redis does not answer, the last known set stays.
    async fn read_paused(&mut self, store: &Store) {
        match store.paused().await {
            Ok(paused) => {
                if paused != self.paused {
                    info!(paused = paused.len(), "paused jobs changed");
                }
                self.paused = paused;
            }
            Err(e) => warn!(error = %e, "cannot read the paused jobs; keeping the last known set"),
        }
    }

    /// How long to sleep before the next job is due, waking [`WAKE_EARLY`] before it, at most
    /// [`MAX_WAIT`]; `None` when one is due now or within `WAKE_EARLY`.
    fn wait(&self, now: DateTime<Utc>) -> Option<Duration> {
        match self.queue.peek() {
            Some(Reverse((due, _))) => {
                let until = (*due - now).to_std().unwrap_or_default();
                (until > WAKE_EARLY).then(|| MAX_WAIT.min(until - WAKE_EARLY))
            }
            None => Some(MAX_WAIT),
        }
    }

    /// How long until the next job is due; `None` when it is due now (or nothing is queued).
    fn until_next(&self, now: DateTime<Utc>) -> Option<Duration> {
        let Reverse((due, _)) = self.queue.peek()?;
        (*due - now).to_std().ok().filter(|d| !d.is_zero())
    }

    /// Puts every job of the batch back in the queue — at its next instant when it moved on,
    /// for a retry when it stalled — and sets the stall gauge. Returns the shared backoff when
    /// the broker or Redis stalled some job.
    fn settle(
        &mut self,
        batch: &[Due],
        stalls: Vec<Option<Stall>>,
        now: DateTime<Utc>,
        stats: &BeatStats,
    ) -> Option<Duration> {
        let (mut stalled, mut shared) = (0, 0);
        for (due, stall) in batch.iter().zip(stalls) {
            let state = &mut self.states[due.job];
            let Some(stall) = stall else {
                if state.failures > 0 {
                    self.stuck -= 1;
                }
                state.failures = 0;
                state.alone = false;
                if let Some(next) = state.next {
                    let offset = self.config.jobs[due.job].jitter_offset();
                    self.queue.push(Reverse((next + offset, due.job)));
                }
                continue;
            };
            if matches!(stall, Stall::NotLeading) {
                self.queue.push(Reverse((due.due, due.job)));
                continue;
            }
            if state.failures == 0 {
                self.stuck += 1;
            }
            state.failures = state.failures.saturating_add(1);
            match &stall {
                Stall::Publish(_) | Stall::Unsent(_) => stats.publish_failures.inc(),
                Stall::Persist(_) => stats.persist_failures.inc(),
                Stall::NotLeading => 0,
            };
            let listed = stalled < STALLS_LISTED;
            shared += usize::from(!self.stalled(due, &stall, now, listed));
            stalled += 1;
        }
        stats.stalled_jobs.set(self.stuck);
        self.after_batch(stalled, shared)
    }

    /// Requeues a stalled job, planned again from the progress made so far (instances the stall
    /// made late become misses and follow the policy). Its own message failed: tried again
    /// alone after its own backoff, while the other jobs go on now (returns `true`); otherwise
    /// at its due instant, after the shared backoff.
    fn stalled(&mut self, due: &Due, stall: &Stall, now: DateTime<Utc>, listed: bool) -> bool {
        let job = &self.config.jobs[due.job];
        let state = &mut self.states[due.job];
        let own = matches!(stall, Stall::Publish(_));
        let retry_at = if own {
            state.alone = true;
            let backoff = isolated_backoff(state.failures);
            if listed {
                warn!(job = %job.name, error = %stall, retry_in_ms = backoff.as_millis() as u64,
                    "job stalled; will retry it alone");
            }
            due.due.max(now + backoff)
        } else {
            if listed {
                warn!(job = %job.name, error = %stall,
                    retry_in_ms = self.backoff.peek().as_millis() as u64, "job stalled; will retry");
            }
            due.due
        };
        self.queue.push(Reverse((retry_at, due.job)));
        own
    }

    /// After a batch with `stalled` stalls, `shared` of them the broker's or Redis's: logs the
    /// ones not listed, and moves the shared backoff — reset when nothing shared stalled (the
    /// loop goes on now), else its next delay returned as the wait ([`SHARED`]).
    fn after_batch(&mut self, stalled: usize, shared: usize) -> Option<Duration> {
        let more = stalled.saturating_sub(STALLS_LISTED);
        if shared == 0 {
            self.backoff.reset();
            if more > 0 {
                warn!(more, "more jobs stalled; will retry them alone");
            }
            return None;
        }
        if more > 0 {
            warn!(
                more,
                retry_in_ms = self.backoff.peek().as_millis() as u64,
                "more jobs stalled; will retry"
            );
        }
        Some(self.backoff.next_delay())
    }
}

/// Connects eagerly so topology exists before the first instant. A refused topology needs a
/// human (`Err`); any other failure is logged and retried by the first batch's publish.
async fn connect_broker(config: &Config, publisher: &mut Publisher) -> Result<(), BrokerError> {
    match publisher.connect().await {
        Err(e @ BrokerError::Mismatch { .. }) => Err(e),
        Err(e) => {
            warn!(error = %e, broker = %Redacted(&config.broker_url), "broker not reachable yet; will retry");
            Ok(())
        }
        Ok(_) => Ok(()),
    }
}

/// Takes the jobs due at `now` off the queue, oldest first, and plans each (a paused job's
/// plan publishes nothing: [`misfire::paused`]), up to [`BATCH_JOBS`] jobs or
/// [`BATCH_MESSAGES`] messages (the last job taken may publish only the first part of its plan;
/// it stays due for the next batch).
fn take_due(
    queue: &mut Queue,
    jobs: &[Job],
    states: &[JobState],
    (now, threshold): (DateTime<Utc>, Duration),
    paused: &HashSet<String>,
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
        // A jittered job lives `offset` behind the clock: instant `t` is due at `t + offset`,
        // and is late (a misfire) by as much as `now` is past that (docs/design.md#jitter).
        // Instants a reload held are late only from the reload.
        let held = states[job].held;
        let mut plan = plan_held(
            &jobs[job],
            states[job].last,
            now - jobs[job].jitter_offset(),
            threshold,
            held,
        );
        if paused.contains(&jobs[job].name) {
            plan = misfire::paused(plan);
        }
        let take = plan.publish.len().min(BATCH_MESSAGES - messages);
        messages += take;
        batch.push(Due {
            job,
            due,
            plan,
            take,
            held,
        });
        if alone {
            break;
        }
    }
    batch
}

/// Sleeps `d` (at most [`WAKE_EARLY`]) with the OS timer on a blocking thread: it wakes within
/// tens of microseconds, where tokio's timer rounds up to its next millisecond tick.
async fn sleep_precisely(d: Duration) {
    let d = d.min(WAKE_EARLY);
    if tokio::task::spawn_blocking(move || std::thread::sleep(d))
        .await
        .is_err()
    {
        // No blocking thread (the runtime is shutting down): the coarse timer will do.
        tokio::time::sleep(d).await;
    }
}

/// Wait before the `failures`-th consecutive try of a job whose own message failed.
fn isolated_backoff(failures: u32) -> Duration {
    ISOLATED.nth(failures.saturating_sub(1), 0.0)
}

/// The messages of a batch: `envelopes` in send order, and for each job position with something
/// to send, its run of them (`spans`, in batch order).
struct Sent {
    envelopes: Vec<Envelope>,
    spans: Vec<(usize, Range<usize>)>,
}

/// A batch sent whose confirms are not read yet ([`send_due`], then [`finish_due`]).
/// The batches sent and not yet finished, oldest first.
#[derive(Default)]
struct Flight {
    batches: VecDeque<InFlight>,
    /// Returned messages matched across the batches in flight (cleared when none is).
    returned: HashSet<String>,
}

/// What [`Beat::run_due`]'s loop does next.
enum Step {
    /// Look again.
    Again,
    /// Send the batch due.
    Send,
    /// End the round.
    Done(Next),
}

/// Whether `shutdown` has completed, without waiting: between batches, never inside one
/// (between a confirm and its progress write), since many can be due at once (100,000 jobs on
/// the minute).
async fn stop_asked<F: Future<Output = ()>>(shutdown: &mut Pin<&mut F>) -> bool {
    tokio::select! {
        biased;
        _ = shutdown.as_mut() => true,
        _ = std::future::ready(()) => false,
    }
}

struct InFlight {
    batch: Vec<Due>,
    /// The clock when the batch was planned (its lateness is judged against it).
    now: DateTime<Utc>,
    sent: Sent,
    stalls: Vec<Option<Stall>>,
    /// `None` when nothing was sent (nothing to send, or no connection: the jobs stalled).
    sending: Option<Sending>,
    /// The publisher's session it was sent on.
    session: u64,
}

/// The first half of moving a batch forward: report the drops and persist the progress they
/// make (with any progress a failed write left unsaved) — a job whose write fails publishes
/// nothing now — then send every message of the batch without awaiting a confirm. `Err` only
/// when the broker refused the topology, which needs a human.
#[allow(clippy::too_many_arguments)]
async fn send_due(
    jobs: &[Job],
    states: &mut [JobState],
    batch: Vec<Due>,
    now: DateTime<Utc>,
    store: &Store,
    publisher: &mut Publisher,
    stats: &BeatStats,
    term: &Term,
) -> Result<InFlight, BrokerError> {
    let mut stalls: Vec<Option<Stall>> = vec![None; batch.len()];
    let drops: Vec<_> = batch
        .iter()
        .flat_map(|due| journal::dropped(&jobs[due.job], &due.plan))
        .collect();
    journal::write(store, term, &drops).await;
    settle_drops(jobs, states, &batch, stats);
    let unsaved: Vec<usize> = (0..batch.len())
        .filter(|p| states[batch[*p].job].to_write())
        .collect();
    save_batch(store, term, jobs, states, &batch, &unsaved, &mut stalls).await;

    let sent = envelopes(jobs, &batch, &stalls);
    let sending = send(publisher, &sent, &mut stalls, term).await?;
    Ok(InFlight {
        batch,
        now,
        sent,
        stalls,
        sending,
        session: publisher.session(),
    })
}

/// The second half: await the batch's confirms (`later`, the batches sent after it, and
/// `returned` match the broker's returns across them, [`Publisher::confirms`]); move each
/// job to the newest instant of its contiguous confirmed prefix ([`progress_after`]); persist
/// all of it in one round trip. Progress is written only after the broker confirmed
/// (docs/design.md). A failed write stalls the job, like a broker failure: this beat remembers
/// the progress (it never republishes an instant it recorded), writes it first when it
/// retries, and instances that come due meanwhile are misses — the beat could not reach Redis.
/// Returns, per job of the batch, why it stalled (`None`: it moved on).
#[allow(clippy::too_many_arguments)]
async fn finish_due(
    jobs: &[Job],
    states: &mut [JobState],
    in_flight: InFlight,
    store: &Store,
    publisher: &mut Publisher,
    stats: &BeatStats,
    term: &Term,
    (returned, later): (&mut HashSet<String>, &mut VecDeque<InFlight>),
) -> (Vec<Due>, DateTime<Utc>, Vec<Option<Stall>>) {
    let InFlight {
        batch,
        now,
        sent,
        mut stalls,
        sending,
        session,
    } = in_flight;
    let outcomes = match sending {
        Some(sending) => {
            let later = later.iter_mut().filter_map(|f| f.sending.as_mut());
            publisher
                .confirms((sending, session), returned, later)
                .await
        }
        None => Vec::new(),
    };
    let published = record_outcomes(jobs, states, (&batch, &sent), outcomes, &mut stalls, stats);
    journal::write(store, term, &published).await;

    // One round trip for the whole batch's progress, including jobs that stalled on a publish
    // after some of their instants were confirmed.
    let unsaved: Vec<usize> = (0..batch.len())
        .filter(|p| {
            let persist_failed = matches!(stalls[*p], Some(Stall::Persist(_)));
            !persist_failed && states[batch[*p].job].to_write()
        })
        .collect();
    save_batch(store, term, jobs, states, &batch, &unsaved, &mut stalls).await;

    for (p, due) in batch.iter().enumerate() {
        if stalls[p].is_none() {
            let state = &mut states[due.job];
            state.next = jobs[due.job].schedule.next_after(state.last);
        }
    }
    (batch, now, stalls)
}

/// Records each job's confirmed instants and returns their journal entries; a job whose
/// publish failed gets its stall. `outcomes` is in `sent.envelopes` order: each job's run of
/// them, in `spans` order.
fn record_outcomes(
    jobs: &[Job],
    states: &mut [JobState],
    (batch, sent): (&[Due], &Sent),
    outcomes: Vec<Result<(), BrokerError>>,
    stalls: &mut [Option<Stall>],
    stats: &BeatStats,
) -> Vec<LeaderEntry> {
    let mut outcomes = outcomes.into_iter();
    let mut published = Vec::new();
    for (p, span) in &sent.spans {
        let results: Vec<Result<(), BrokerError>> = outcomes.by_ref().take(span.len()).collect();
        if stalls[*p].is_none() {
            let due = &batch[*p];
            let (job, state) = (&jobs[due.job], &mut states[due.job]);
            let envelopes = &sent.envelopes[span.clone()];
            let confirmed = record_confirmed(job, state, due, envelopes, results, stats);
            published.extend(
                envelopes[..confirmed.0]
                    .iter()
                    .map(|e| journal::published(&e.key)),
            );
            stalls[*p] = confirmed.1;
        }
    }
    published
}

/// Reports the batch's drops and moves each job's progress past them. The drops are all older
/// than the first instance to publish: settled first, so that if a publish fails, the next plan
/// starts after them and does not report them again.
fn settle_drops(jobs: &[Job], states: &mut [JobState], batch: &[Due], stats: &BeatStats) {
    for due in batch {
        report_dropped(&jobs[due.job], &due.plan, stats);
        let state = &mut states[due.job];
        if let Some(dropped) = due.plan.dropped_up_to.filter(|d| *d > state.last) {
            state.last = dropped;
            state.unsaved = true;
        }
    }
}

/// The envelopes of the batch's jobs that have not stalled: the first `take` of each plan.
fn envelopes(jobs: &[Job], batch: &[Due], stalls: &[Option<Stall>]) -> Sent {
    let mut envelopes = Vec::new();
    let mut spans = Vec::new();
    for (p, due) in batch.iter().enumerate() {
        if stalls[p].is_some() {
            continue;
        }
        let job = &jobs[due.job];
        let first = envelopes.len();
        for t in &due.plan.publish[..due.take] {
            // `expires` counts from when the instant is due: its jittered time (a held
            // instant's: the reload's).
            let due_at = due.held.map_or(*t, |h| h.due(*t)) + job.jitter_offset();
            let expires_at = job
                .spec
                .expires
                .and_then(|e| chrono::Duration::from_std(e).ok())
                .map(|e| due_at + e);
            envelopes.push(Envelope::scheduled(
                &job.name,
                &job.spec.task,
                &job.spec.queue,
                job.spec.args.clone(),
                *t,
                expires_at,
                Utc::now(),
            ));
        }
        spans.push((p, first..envelopes.len()));
    }
    Sent { envelopes, spans }
}

/// Sends every envelope without awaiting a confirm ([`Publisher::send_batch`]). When nothing
/// could be sent (no connection), every job with something to publish stalls and nothing is in
/// flight. `Err` only for a refused topology.
async fn send(
    publisher: &mut Publisher,
    sent: &Sent,
    stalls: &mut [Option<Stall>],
    term: &Term,
) -> Result<Option<Sending>, BrokerError> {
    if sent.envelopes.is_empty() {
        return Ok(None);
    }
    let sending = publisher.send_batch(&sent.envelopes, term.epoch, || term.holds());
    match sending.await {
        Ok(sending) => Ok(Some(sending)),
        Err(e @ BrokerError::Mismatch { .. }) => Err(e),
        Err(e) => {
            let e = Arc::new(e);
            for (p, span) in &sent.spans {
                if !span.is_empty() {
                    stalls[*p] = Some(Stall::Unsent(e.clone()));
                }
            }
            Ok(None)
        }
    }
}

/// Moves one job's progress to the newest instant of its contiguous confirmed prefix
/// ([`progress_after`]) and counts and logs what that records as published. Returns how many
/// of `envelopes` that records, and the job's stall when one of its messages failed.
fn record_confirmed(
    job: &Job,
    state: &mut JobState,
    due: &Due,
    envelopes: &[Envelope],
    results: Vec<Result<(), BrokerError>>,
    stats: &BeatStats,
) -> (usize, Option<Stall>) {
    let confirmed: Vec<bool> = results.iter().map(Result::is_ok).collect();
    let whole = due.take == due.plan.publish.len();
    let (to, recorded) = progress_after(
        state.last,
        &due.plan.publish[..due.take],
        &confirmed,
        due.plan.decided_up_to.filter(|_| whole),
    );
    for env in &envelopes[..recorded] {
        stats.published(&job.name);
        info!(job = %job.name, key = %env.key, "published");
    }
    if to > state.last {
        state.last = to;
        state.unsaved = true;
    }
    let stall = match results.into_iter().find_map(Result::err) {
        None => None,
        Some(BrokerError::Withdrawn) => Some(Stall::NotLeading),
        Some(failed) => Some(Stall::Publish(Arc::new(failed))),
    };
    (recorded, stall)
}

/// Writes the progress of the batch's jobs at positions `which`; a job whose write fails
/// stalls (unless it already stalled on a publish, the first reason).
async fn save_batch(
    store: &Store,
    term: &Term,
    jobs: &[Job],
    states: &mut [JobState],
    batch: &[Due],
    which: &[usize],
    stalls: &mut [Option<Stall>],
) {
    let indexes: Vec<usize> = which.iter().map(|p| batch[*p].job).collect();
    for (failed, p) in save(store, term, jobs, states, &indexes)
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
/// in `which` ([`progress::save`], fenced by `term`), with the job's rule where it is not
/// recorded yet ([`progress::start`]); clears `unsaved` and `rule_unsaved` where that worked.
/// Ends the term when Redis says the lease is not ours. Returns each one's failure, if any, in
/// `which` order.
async fn save(
    store: &Store,
    term: &Term,
    jobs: &[Job],
    states: &mut [JobState],
    which: &[usize],
) -> Vec<Option<Arc<ProgressError>>> {
    let (starting, moving): (Vec<usize>, Vec<usize>) =
        which.iter().partition(|i| states[**i].rule_unsaved);
    let progress: Vec<(&str, DateTime<Utc>)> = moving
        .iter()
        .map(|i| (jobs[*i].name.as_str(), states[*i].last))
        .collect();
    let rules: Vec<String> = starting
        .iter()
        .map(|i| reload::rule(&jobs[*i].schedule))
        .collect();
    let starts: Vec<(&str, DateTime<Utc>, &str)> = starting
        .iter()
        .zip(&rules)
        .map(|(i, rule)| (jobs[*i].name.as_str(), states[*i].last, rule.as_str()))
        .collect();
    let (token, max_ahead) = (term.token(), term.max_ahead());
    let mut moved = progress::save(store, token, max_ahead, &progress)
        .await
        .into_iter();
    let mut started = progress::start(store, token, max_ahead, &starts)
        .await
        .into_iter();
    // Back in `which` order.
    let outcomes: Vec<Option<Arc<ProgressError>>> = which
        .iter()
        .map(|i| {
            let outcome = if states[*i].rule_unsaved {
                started.next()
            } else {
                moved.next()
            };
            outcome.flatten()
        })
        .collect();
    if outcomes
        .iter()
        .flatten()
        .any(|e| matches!(**e, ProgressError::Deposed))
    {
        term.deposed();
    }
    journal_starts(store, term, jobs, states, (which, &outcomes)).await;
    for (i, failed) in which.iter().zip(&outcomes) {
        if failed.is_none() {
            states[*i].unsaved = false;
            states[*i].rule_unsaved = false;
        }
    }
    outcomes
}

/// Journals each job of `which` whose start was just written (a first start, an added or
/// rescheduled job; not an adopted one), so that `audit` plans no instant of its rule before
/// it (docs/audit.md).
async fn journal_starts(
    store: &Store,
    term: &Term,
    jobs: &[Job],
    states: &[JobState],
    (which, outcomes): (&[usize], &[Option<Arc<ProgressError>>]),
) {
    let started: Vec<LeaderEntry> = which
        .iter()
        .zip(outcomes)
        .filter(|(i, failed)| failed.is_none() && states[**i].unsaved && states[**i].rule_unsaved)
        .map(|(i, _)| journal::started(&jobs[*i], states[*i].last))
        .collect();
    journal::write(store, term, &started).await;
}

/// Connects to Redis, retrying until it answers (it holds each job's progress); each failure is
/// the health check's reason meanwhile.
async fn connect_redis(config: &Config, stats: &BeatStats) -> Store {
    let names = Names::new(config.namespace.clone());
    let ca_file = config.redis_ca_file.as_deref();
    let store = Store::connect_retrying(&config.redis_url, ca_file, names, REDIS_CONNECT, |e| {
        error!(error = %e, redis = %Redacted(&config.redis_url),
            "redis unreachable; the beat waits for it (it holds each job's progress)");
        stats.redis(RedisContact::Failed(e.to_string()));
    })
    .await
    .with_wait(config.redis_wait)
    .with_journal(config.journal);
    if let Some(advice) = store
        .replica_advice(config.redis_wait, &config.redis_url)
        .await
    {
        warn!(%advice, "redis replication");
    }
    stats.redis(RedisContact::Answered);
    store
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::misfire::tests::{at, job, EVERY_MINUTE, LAST, NOW, THRESHOLD};
    use chrono::TimeDelta;
    use drumline_shared::config::Misfire;

    #[test]
    fn a_job_whose_message_failed_is_batched_alone() {
        let jobs: Vec<Job> = (0..4).map(|_| job(EVERY_MINUTE)).collect();
        let mut states: Vec<JobState> = (0..4)
            .map(|_| JobState {
                last: at(LAST),
                next: None,
                unsaved: false,
                rule_unsaved: false,
                failures: 0,
                alone: false,
                held: None,
            })
            .collect();
        states[1].alone = true;
        let due = at("2026-03-02T12:01:00Z");
        let mut queue: BinaryHeap<Reverse<(DateTime<Utc>, usize)>> =
            (0..4).map(|i| Reverse((due, i))).collect();
        let mut batches = Vec::new();
        loop {
            let none = HashSet::new();
            let batch = take_due(&mut queue, &jobs, &states, (at(NOW), THRESHOLD), &none);
            if batch.is_empty() {
                break;
            }
            batches.push(batch.iter().map(|d| d.job).collect::<Vec<_>>());
        }
        assert_eq!(batches, vec![vec![0], vec![1], vec![2, 3]]);
    }

    /// A jittered job is queued `offset` after its instant and planned `offset` behind the
    /// clock: at `instant + offset` it publishes `instant` (the key's), on time.
    #[test]
    fn a_jittered_job_is_due_its_offset_late_and_publishes_the_instant() {
        let jobs = vec![job("every = \"1m\"\njitter = \"50s\"")];
        let offset = jobs[0].jitter_offset();
        assert!(offset > TimeDelta::zero() && offset < TimeDelta::seconds(50));
        let last = at("2026-03-02T12:00:00Z");
        let state = JobState::from(&jobs[0], Some(last), last);
        let instant = at("2026-03-02T12:01:00Z");
        assert_eq!(state.next, Some(instant));
        let mut queue = due_queue(&jobs, std::slice::from_ref(&state));
        assert_eq!(queue.peek(), Some(&Reverse((instant + offset, 0))));

        let none = HashSet::new();
        let states = [state];
        let just_before = instant + offset - TimeDelta::milliseconds(1);
        let batch = take_due(&mut queue, &jobs, &states, (just_before, THRESHOLD), &none);
        assert!(batch.is_empty(), "not due before instant + offset");
        let batch = take_due(
            &mut queue,
            &jobs,
            &states,
            (instant + offset, THRESHOLD),
            &none,
        );
        assert_eq!(batch[0].plan.publish, vec![instant]);
        assert!(batch[0].plan.dropped.is_empty(), "on time, not a misfire");
    }

    /// A reload that lowers a job's jitter (here to none) holds the instant not yet due under
    /// the old offset: at the reload it is published at once, on time, its `expires` counted
    /// from the reload, though its new jittered time is long past. Unheld, `skip` dropped it.
    /// See: issues/33
    #[test]
    fn a_reload_lowering_the_jitter_publishes_the_pending_instant_on_time() {
        let old = job("every = \"1m\"\njitter = \"50s\"\nmisfire = \"skip\"");
        let new = job("every = \"1m\"\nmisfire = \"skip\"\nexpires = \"2s\"");
        let offset = old.jitter_offset();
        let threshold = Duration::from_secs(1);
        assert!(offset > TimeDelta::seconds(2), "{offset}");
        let last = at("2026-03-02T12:00:00Z");
        let before = JobState::from(&old, Some(last), last);
        let instant = at("2026-03-02T12:01:00Z");
        // Just before the instant's old jittered time, long after its new one.
        let reload_at = instant + offset - TimeDelta::milliseconds(1);
        let after = kept(&before, &old, &new, reload_at);
        let jobs = [new];
        let now = reload_at + TimeDelta::milliseconds(500);
        let plan_of = |state: &JobState| {
            let mut queue = due_queue(&jobs, std::slice::from_ref(state));
            let states = [state.clone()];
            let none = HashSet::new();
            take_due(&mut queue, &jobs, &states, (now, threshold), &none).remove(0)
        };

        let due = plan_of(&after);
        assert_eq!(due.plan.publish, vec![instant]);
        assert_eq!(due.plan.dropped_count(), 0, "{:?}", due.plan.dropped);
        let sent = envelopes(&jobs, std::slice::from_ref(&due), &[None]);
        let expires = reload_at + TimeDelta::seconds(2);
        assert_eq!(sent.envelopes[0].expires_at, Some(expires));
        // Without the hold, the instant was missed and `skip` dropped it.
        let unheld = plan_of(&before);
        assert!(unheld.plan.publish.is_empty());
        assert_eq!(
            unheld.plan.dropped,
            vec![(instant, misfire::Dropped::Policy(Misfire::Skip))]
        );
    }

    #[test]
    fn isolated_backoff_doubles_up_to_its_cap() {
        let ms = |n| isolated_backoff(n).as_millis();
        assert_eq!((ms(1), ms(2), ms(3)), (200, 400, 800));
        assert_eq!(ms(8), 25_600);
        assert_eq!((ms(9), ms(u32::MAX)), (30_000, 30_000));
    }
}
