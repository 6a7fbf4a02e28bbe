//! The beat's scheduling as a state machine without I/O (the sans-I/O style of quinn-proto):
//! the driver, [`scheduler`](crate::scheduler), feeds it events — a look at the clock
//! ([`Machine::poll`]), the paused jobs read, a progress write answered, a batch sent or
//! confirmed, a reload, a term gained — and carries out what it answers: wait, send these
//! messages, journal these entries, write these jobs' progress, follow the `after` jobs, stop.
//! Time is an input; its only effects are the beat's counters and its logs.
//!
//! A batch goes through four steps: [`Machine::plan`] takes the jobs due and answers the drops
//! to journal and the progress to write first; [`Machine::planned_saved`] answers its messages;
//! [`Machine::sent`] puts it in flight; once its confirms are read, [`Machine::confirmed`]
//! answers the published entries and the progress to write, and [`Machine::finished`] puts its
//! jobs back in the due queue, at their next instant or for a retry. A progress write is asked
//! as job indexes: [`Machine::writes`] says what to write, [`Machine::saved`] takes Redis's
//! answers. What a batch takes ([`take_due`]) and what a stall means ([`isolated_backoff`],
//! `Machine::after_batch`) are decided here; how they are carried out, in the driver.

use crate::follower::Followers;
use crate::journal;
use crate::misfire::{self, plan_held, Plan};
use crate::progress::progress_after;
use crate::reload::{self, Held, Resume};
use crate::stats::{report_dropped, BeatStats};
use chrono::{DateTime, Utc};
use drumline_shared::backoff::Backoff;
use drumline_shared::broker::BrokerError;
use drumline_shared::calendar::{excluded_by, Calendar};
use drumline_shared::config::{Config, Job, Placed};
use drumline_shared::envelope::Envelope;
use drumline_shared::store::{last_instant_text, parse_last_instant, LeaderEntry, ProgressError};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// Most jobs planned and published together (see the scheduler's module doc).
pub const BATCH_JOBS: usize = 1000;

/// Most messages published together; a job with more to publish (a long catch-up) goes on in
/// the next batch.
pub const BATCH_MESSAGES: usize = 5000;

/// The most batches sent whose confirms are not read yet.
pub(crate) const IN_FLIGHT: usize = 8;

/// New jobs' starts persisted per Redis round trip ([`Machine::next_starts`]).
const NEW_STARTS_PER_TRIP: usize = 10_000;

/// The least time until the next due instant in which a term writes a slice of its new jobs'
/// starts: a slice is one round trip of a few tens of ms.
pub(crate) const STARTS_GAP: Duration = Duration::from_millis(100);

/// Stalled jobs logged one by one per batch; the rest are counted in one line.
const STALLS_LISTED: usize = 10;

/// First wait before a job whose own message failed is tried again (alone); doubled per
/// consecutive failure up to [`ISOLATED_BACKOFF_MAX`].
const ISOLATED_BACKOFF: Duration = Duration::from_millis(200);

/// Longest wait between two tries of a job whose own message keeps failing.
const ISOLATED_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// A job whose own message failed: [`ISOLATED_BACKOFF`] doubled per consecutive failure up to
/// [`ISOLATED_BACKOFF_MAX`], without jitter.
const ISOLATED: Backoff = Backoff::constant(ISOLATED_BACKOFF, ISOLATED_BACKOFF_MAX, 0.0);

/// The wait when the broker or Redis stalled a batch: 200 ms, doubled per such batch up to
/// 5 s, back to 200 ms after a batch without one.
const SHARED: Backoff = Backoff::constant(Duration::from_millis(200), Duration::from_secs(5), 0.0);

/// Longest sleep: the loop looks at the clock at least once a second to notice wall-clock jumps.
const MAX_WAIT: Duration = Duration::from_secs(1);

/// How long before the next instant the beat wakes. tokio's timer ticks in whole milliseconds
/// and wakes up to about one tick late, and a wake first reads the paused set (a Redis round
/// trip): both fit in this margin, and the rest of the way to the instant is slept with the OS
/// timer ([`Do::SleepPrecisely`]), so a job's messages leave within a fraction of a millisecond
/// of its instant rather than one to two milliseconds after it.
pub(crate) const WAKE_EARLY: Duration = Duration::from_millis(3);

/// How often the leader looks at the upstream instances its `after` jobs wait for
/// ([`follower`](crate::follower)), at most.
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

/// How a new term resumes each job ([`reload::resume`]), logging the jobs rescheduled since
/// their progress was recorded (those start from the new term).
pub(crate) fn resumes(
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

/// Why the driver's round ended ([`Machine::poll`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Nothing is due for this long.
    Wait(Duration),
    /// Jobs stalled (the broker or Redis failed them): wait this long before trying again.
    Backoff(Duration),
    /// The term does not hold now (a renewal is late, or the lease is lost).
    NotHolding,
    /// A stop was asked.
    Shutdown,
}

/// What the driver does next, from [`Machine::poll`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Do {
    /// Finish every batch in flight, oldest first ([`Machine::confirmed`],
    /// [`Machine::finished`]), then ask [`after_finishing`].
    FinishAll,
    /// End the round.
    Return(Next),
    /// Follow the `after` jobs ([`Machine::following`], [`Machine::followed`]), then wait
    /// [`Machine::wait_after_follow`].
    Follow,
    /// Woken early on purpose (at most [`WAKE_EARLY`]): sleep the rest precisely, then poll.
    SleepPrecisely(Duration),
    /// Plan and send the batch due ([`Machine::plan`]).
    Send,
}

/// What the driver does once a batch is in flight ([`Machine::sent`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterSend {
    /// Poll again: more batches may be sent before the oldest's confirms are read.
    More,
    /// [`IN_FLIGHT`] are: finish the oldest; if it asks for a backoff, finish all and back off.
    FinishOldest,
    /// Nothing could be sent (no connection): finish every batch and back off now, rather
    /// than let each next batch wait for a connect of its own.
    FinishAll,
}

/// After every batch in flight was finished, with `wait` the longest backoff asked: how the
/// round ends, or `None` to poll again (settling put the batches' jobs back).
pub(crate) fn after_finishing(stopping: bool, wait: Option<Duration>) -> Option<Next> {
    match (stopping, wait) {
        (true, _) => Some(Next::Shutdown),
        (false, Some(wait)) => Some(Next::Backoff(wait)),
        (false, None) => None,
    }
}

/// What a beat that gained the lease read of Redis, for [`Machine::gained`].
pub(crate) struct Gain {
    /// Each job's recorded progress (`None`: never recorded).
    pub(crate) lasts: Vec<Option<DateTime<Utc>>>,
    /// How each job resumes ([`resumes`]).
    pub(crate) resumes: Vec<Resume>,
    /// The old rule's instants each rescheduled follower still decides
    /// ([`follower::old_rule_instants`](crate::follower::old_rule_instants)).
    pub(crate) carried: Vec<(usize, Vec<DateTime<Utc>>)>,
    /// The paused jobs.
    pub(crate) paused: HashSet<String>,
}

/// What [`Machine::plan`] asks before the batch's messages go: journal the drops, write the
/// progress of these jobs ([`Machine::writes`]), then [`Machine::planned_saved`].
pub(crate) struct Planned {
    /// The batch's drops, to journal.
    pub(crate) drops: Vec<LeaderEntry>,
    /// The jobs whose progress to write before anything of theirs is published.
    pub(crate) save: Vec<usize>,
}

/// What [`Machine::confirmed`] asks: journal the published, write these jobs' progress, then
/// [`Machine::finished`].
pub(crate) struct Confirmed {
    /// The instances confirmed, to journal.
    pub(crate) published: Vec<LeaderEntry>,
    /// The jobs whose progress to write.
    pub(crate) save: Vec<usize>,
}

/// The progress writes of some jobs ([`Machine::writes`]): moves of recorded progress, and
/// starts (progress with the rule it is recorded under).
pub(crate) struct Writes<'a> {
    /// `(job, instant)`: [`progress::save`](crate::progress::save).
    pub(crate) progress: Vec<(&'a str, DateTime<Utc>)>,
    /// `(job, instant, rule)`: [`progress::start`](crate::progress::start).
    pub(crate) starts: Vec<(&'a str, DateTime<Utc>, String)>,
}

/// Redis's answers to [`Writes`] as the machine took them ([`Machine::saved`]).
pub(crate) struct Saved {
    /// Each job's failure, if any, in the order asked.
    pub(crate) outcomes: Vec<Option<Arc<ProgressError>>>,
    /// Redis said the lease is not ours: the term ends.
    pub(crate) deposed: bool,
    /// The starts just written, to journal, so that `audit` plans no instant before them.
    pub(crate) started: Vec<LeaderEntry>,
}

/// Each job's progress, for [`follower::step`](crate::follower::step).
#[derive(Clone, Copy)]
pub(crate) struct Lasts<'a>(&'a [JobState]);

impl Lasts<'_> {
    /// Job `job`'s progress.
    pub(crate) fn get(&self, job: usize) -> DateTime<Utc> {
        self.0[job].last
    }
}

/// What following the `after` jobs needs of the machine ([`Machine::following`]).
pub(crate) struct Following<'a> {
    /// The jobs.
    pub(crate) jobs: &'a [Job],
    /// The followers and what this term decided of them.
    pub(crate) followers: &'a mut Followers,
    /// Each job's progress.
    pub(crate) lasts: Lasts<'a>,
    /// The paused jobs.
    pub(crate) paused: &'a HashSet<String>,
    /// How long a skip is kept: the worker's `done_ttl`.
    pub(crate) retention: Duration,
}

/// The messages of a batch: `envelopes` in send order, and for each job position with something
/// to send, its run of them (`spans`, in batch order).
#[derive(Default)]
struct Sent {
    envelopes: Vec<Envelope>,
    spans: Vec<(usize, Range<usize>)>,
}

/// A batch of due jobs on its way: planned, sent, confirmed, finished.
struct Batch {
    dues: Vec<Due>,
    /// The clock when the batch was planned (its lateness is judged against it).
    now: DateTime<Utc>,
    sent: Sent,
    stalls: Vec<Option<Stall>>,
    /// The positions whose progress is being written.
    saving: Vec<usize>,
}

impl Batch {
    /// The jobs of the positions being written.
    fn saving_jobs(&self) -> Vec<usize> {
        self.saving.iter().map(|p| self.dues[*p].job).collect()
    }

    /// A position whose write failed stalls (unless it already stalled on a publish, the
    /// first reason).
    fn persist_failed(&mut self, saved: &[Option<Arc<ProgressError>>]) {
        for (p, failed) in self.saving.iter().zip(saved) {
            if let Some(e) = failed {
                self.stalls[*p].get_or_insert(Stall::Persist(e.clone()));
            }
        }
    }
}

/// The scheduling state of one term: the config it runs (replaced on a reload), every job's
/// progress, the due queue, the paused jobs, the followers, the batches on their way and the
/// stall bookkeeping.
pub(crate) struct Machine {
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
    /// The `after` jobs and what this term decided of them ([`follower`](crate::follower)).
    followers: Followers,
    /// Jobs before this index have had their start persisted this term, if it was new
    /// ([`Machine::next_starts`]).
    starts_from: usize,
    /// Starts persisted that way this term, for the log line once all are.
    starts_persisted: usize,
    /// The batch planned and not sent yet.
    planned: Option<Batch>,
    /// The batches sent whose confirms are not read yet, oldest first.
    flight: VecDeque<Batch>,
    stats: BeatStats,
}

impl Machine {
    /// A new term's machine from what it read ([`Gain`]): a job rescheduled since its progress
    /// was recorded starts at `now`, as a reload starts it. Also returns how many jobs resumed
    /// their recorded progress.
    pub(crate) fn gained(
        config: Arc<Config>,
        gain: Gain,
        now: DateTime<Utc>,
        stats: BeatStats,
    ) -> (Self, usize) {
        let Gain {
            lasts,
            resumes,
            carried,
            paused,
        } = gain;
        let lasts = lasts
            .into_iter()
            .zip(&resumes)
            .map(|(last, r)| last.filter(|_| *r != Resume::Restart))
            .collect();
        let resumed = resumes
            .iter()
            .filter(|r| matches!(r, Resume::Continue | Resume::Adopt))
            .count();
        let mut machine = Machine::new(config, lasts, now, stats);
        for (state, r) in machine.states.iter_mut().zip(&resumes) {
            state.rule_unsaved |= *r == Resume::Adopt;
        }
        for (job, instants) in carried {
            machine.followers.carry(job, instants);
        }
        // Paused jobs are known before anything is published for this term.
        machine.paused = paused;
        (machine, resumed)
    }

    /// The state at start, from each job's loaded progress. On a job's very first start nothing
    /// before `now` counts as missed: it starts from `now`, as a restart would read it back
    /// (whole milliseconds).
    fn new(
        config: Arc<Config>,
        lasts: Vec<Option<DateTime<Utc>>>,
        now: DateTime<Utc>,
        stats: BeatStats,
    ) -> Self {
        let start = first_start(now);
        let states: Vec<JobState> = config
            .jobs
            .iter()
            .zip(lasts)
            .map(|(job, last)| JobState::from(job, last, start))
            .collect();
        Machine {
            queue: due_queue(&config.jobs, &states),
            followers: Followers::new(&config),
            threshold: config.beat.misfire_threshold,
            config,
            states,
            stuck: 0,
            backoff: SHARED,
            paused: HashSet::new(),
            starts_from: 0,
            starts_persisted: 0,
            planned: None,
            flight: VecDeque::new(),
            stats,
        }
    }

    /// The config it runs.
    pub(crate) fn config(&self) -> &Arc<Config> {
        &self.config
    }

    /// The paused jobs as just read (at every wake, so a pause is honoured within a second).
    pub(crate) fn paused_seen(&mut self, paused: HashSet<String>) {
        if paused != self.paused {
            info!(paused = paused.len(), "paused jobs changed");
        }
        self.paused = paused;
    }

    /// Applies schedules changed at run time (docs/design.md#schedules-as-data) in place, each
    /// as a reload treats its one job: replaced with the same schedule, it keeps its progress;
    /// added, or rescheduled, it starts from `now` (its start and rule then persisted,
    /// [`Machine::next_starts`]); removed, it stops. Nothing else is rebuilt but the due queue:
    /// a change costs the same with ten schedules or a million. Never with a batch in flight
    /// (the driver calls it only while waiting, as [`Machine::reload`]).
    pub(crate) fn edit(
        &mut self,
        edits: Vec<(String, Option<Job>)>,
        file: &Config,
        now: DateTime<Utc>,
    ) {
        debug_assert!(self.flight.is_empty() && self.planned.is_none());
        let start = first_start(now);
        let config = Arc::make_mut(&mut self.config);
        let (mut kept_progress, mut started, mut removed) = (0, 0, 0);
        let states = &mut self.states;
        config.put_schedules(edits, file, |placed, jobs| match placed {
            Placed::Replaced(i, old) if old.schedule == jobs[i].schedule => {
                states[i] = kept(&states[i], &old, &jobs[i], now);
                kept_progress += 1;
            }
            Placed::Replaced(i, _) => {
                states[i] = JobState::from(&jobs[i], None, start);
                started += 1;
            }
            Placed::Added => {
                states.push(JobState::from(&jobs[jobs.len() - 1], None, start));
                started += 1;
            }
            Placed::Removed(i) => {
                states.swap_remove(i);
                removed += 1;
            }
        });
        self.queue = due_queue(&config.jobs, &self.states);
        self.stuck = self.states.iter().filter(|s| s.failures > 0).count() as i64;
        (self.starts_from, self.starts_persisted) = (0, 0);
        info!(
            jobs = config.jobs.len(),
            kept = kept_progress,
            started,
            removed,
            "schedules edited in place"
        );
    }

    /// Runs `config` from `now` on (SIGHUP while leading): a job kept with the same schedule
    /// keeps its progress; an added job, or one whose schedule changed, starts from now as on
    /// a first start (nothing before the reload is caught up); a removed job stops. The new
    /// starts are then to persist, all of them ([`Machine::next_starts`] until `None`).
    pub(crate) fn reload(&mut self, config: Arc<Config>, now: DateTime<Utc>) {
        let carried = reload::carried(&self.config.jobs, &config.jobs);
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
        let before = std::mem::replace(&mut self.followers, Followers::new(&config));
        self.followers
            .carry_on(&before, &self.config.jobs, &config.jobs);
        let old_last = |o: usize| old[o].last;
        let carried_over = crate::follower::carried_over(
            (&self.config.jobs, &old_last),
            &config.jobs,
            &carried,
            now,
        );
        for (job, instants) in carried_over {
            self.followers.carry(job, instants);
        }
        self.config = config;
        (self.starts_from, self.starts_persisted) = (0, 0);
    }

    /// The next [`NEW_STARTS_PER_TRIP`] new jobs whose start (or rule) is to be persisted, in
    /// the gaps while nothing is due: a term leads at once, a million new jobs' starts (seconds
    /// of Redis's time) follow, and a due job never waits for them (its start is written before
    /// its first publish, as always). `None` when every job was looked at. Once all are
    /// persisted, a beat that dies before a job's first instant and stays down reports those
    /// misses when it comes back (docs/design.md#one-scheduled-instance-through-the-beat).
    pub(crate) fn next_starts(&mut self) -> Option<Vec<usize>> {
        let total = self.states.len();
        if self.starts_from >= total {
            return None;
        }
        let mut slice = Vec::with_capacity(NEW_STARTS_PER_TRIP.min(total));
        let mut end = self.starts_from;
        while end < total && slice.len() < NEW_STARTS_PER_TRIP {
            if self.states[end].to_write() {
                slice.push(end);
            }
            end += 1;
        }
        self.starts_from = end;
        Some(slice)
    }

    /// A slice of starts written ([`Machine::next_starts`], `saved` in its order): logs, and
    /// returns whether any start is left to persist. A job whose write failed keeps it unsaved:
    /// written before anything is published for it.
    pub(crate) fn starts_saved(&mut self, saved: &[Option<Arc<ProgressError>>]) -> bool {
        let failed = saved.iter().flatten().count();
        self.starts_persisted += saved.len() - failed;
        if let Some(e) = saved.iter().flatten().next() {
            warn!(jobs = failed, error = %e,
                "cannot persist new jobs' start yet; it is written before their first publish");
        }
        let total = self.states.len();
        if self.starts_from == total && self.starts_persisted > 0 {
            info!(
                jobs = self.starts_persisted,
                "the new jobs' starts are persisted"
            );
        }
        self.starts_from < total
    }

    /// What to do at `now`, the term holding or not, a stop asked or not. Leadership is checked
    /// before each batch; a batch in flight is finished before anything else but sending the
    /// next one due.
    pub(crate) fn poll(&self, now: DateTime<Utc>, holds: bool, stopping: bool) -> Do {
        let due_now = holds && self.wait(now).is_none() && self.until_next(now).is_none();
        if !self.flight.is_empty() && (!due_now || stopping || self.isolated()) {
            return Do::FinishAll;
        }
        if stopping {
            return Do::Return(Next::Shutdown);
        }
        if !holds {
            return Do::Return(Next::NotHolding);
        }
        if let Some(wait) = self.wait(now) {
            if !self.followers.any() || wait < FOLLOW_ROOM {
                return Do::Return(Next::Wait(wait));
            }
            return Do::Follow;
        }
        match self.until_next(now) {
            Some(early) => Do::SleepPrecisely(early.min(WAKE_EARLY)),
            None => Do::Send,
        }
    }

    /// A job retried alone after its own message failed is never in flight beside another
    /// batch: a failure that closes the channel would take that one too.
    fn isolated(&self) -> bool {
        let alone = |job: usize| self.states[job].alone;
        self.flight
            .iter()
            .any(|f| f.dues.iter().any(|d| alone(d.job)))
            || self
                .queue
                .peek()
                .is_some_and(|Reverse((_, job))| alone(*job))
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

    /// The first step of a batch: takes the jobs due at `now` ([`take_due`]), notes the
    /// upstream instants it drops for their followers (which are then skipped at once,
    /// docs/design.md#job-dependencies), reports the drops and moves each job's progress past
    /// them. Asks to journal the drops and to write the progress they make (with any progress
    /// a failed write left unsaved): a job whose write fails publishes nothing now.
    pub(crate) fn plan(&mut self, now: DateTime<Utc>) -> Planned {
        let jobs = &self.config.jobs;
        let at = (now, self.threshold);
        let held = (&self.paused, &self.config.calendars);
        let dues = take_due(&mut self.queue, jobs, &self.states, at, held);
        if self.followers.any() {
            for due in &dues {
                self.followers.upstream_dropped(due.job, &due.plan);
            }
        }
        let drops = dues
            .iter()
            .flat_map(|due| journal::dropped(&jobs[due.job], &due.plan))
            .collect();
        settle_drops(jobs, &mut self.states, &dues, &self.stats);
        let saving = (0..dues.len())
            .filter(|p| self.states[dues[*p].job].to_write())
            .collect();
        let batch = Batch {
            stalls: vec![None; dues.len()],
            dues,
            now,
            sent: Sent::default(),
            saving,
        };
        let save = batch.saving_jobs();
        self.planned = Some(batch);
        Planned { drops, save }
    }

    /// The planned batch's progress written (`saved`, in [`Planned::save`]'s order): its
    /// messages to send, stamped `published_at` — those of the jobs whose write worked.
    pub(crate) fn planned_saved(
        &mut self,
        saved: &[Option<Arc<ProgressError>>],
        published_at: DateTime<Utc>,
    ) -> &[Envelope] {
        let batch = self.planned.as_mut().expect("a batch planned");
        batch.persist_failed(saved);
        batch.sent = envelopes(&self.config.jobs, batch, published_at);
        &batch.sent.envelopes
    }

    /// The planned batch's messages handed to the broker, or not one of them (`unsent`: no
    /// connection, every job with something to publish stalls): the batch is in flight.
    pub(crate) fn sent(&mut self, unsent: Option<BrokerError>) -> AfterSend {
        let mut batch = self.planned.take().expect("a batch planned");
        let unsent = unsent.map(Arc::new);
        if let Some(e) = &unsent {
            for (p, span) in &batch.sent.spans {
                if !span.is_empty() {
                    batch.stalls[*p] = Some(Stall::Unsent(e.clone()));
                }
            }
        }
        self.flight.push_back(batch);
        if unsent.is_some() {
            AfterSend::FinishAll
        } else if self.flight.len() < IN_FLIGHT {
            AfterSend::More
        } else {
            AfterSend::FinishOldest
        }
    }

    /// The oldest batch's confirms (`outcomes`, one per message sent in send order; none when
    /// nothing was): moves each job to the newest instant of its contiguous confirmed prefix
    /// ([`progress_after`]). Asks to journal what was published and to write the whole
    /// batch's progress in one round trip — including jobs that stalled on a publish after
    /// some of their instants were confirmed. Progress is written only after the broker
    /// confirmed (docs/design.md).
    pub(crate) fn confirmed(&mut self, outcomes: Vec<Result<(), BrokerError>>) -> Confirmed {
        let batch = self.flight.front_mut().expect("a batch in flight");
        let jobs = &self.config.jobs;
        let published = record_outcomes(jobs, &mut self.states, batch, outcomes, &self.stats);
        let states = &self.states;
        batch.saving = (0..batch.dues.len())
            .filter(|p| {
                let persist_failed = matches!(batch.stalls[*p], Some(Stall::Persist(_)));
                !persist_failed && states[batch.dues[*p].job].to_write()
            })
            .collect();
        Confirmed {
            published,
            save: batch.saving_jobs(),
        }
    }

    /// The oldest batch's progress written (`saved`, in [`Confirmed::save`]'s order): a failed
    /// write stalls the job, like a broker failure — this beat remembers the progress (it never
    /// republishes an instant it recorded), writes it first when it retries, and instances that
    /// come due meanwhile are misses. Puts the batch's jobs back in the due queue; returns the
    /// shared backoff when the broker or Redis stalled some job.
    pub(crate) fn finished(&mut self, saved: &[Option<Arc<ProgressError>>]) -> Option<Duration> {
        let mut batch = self.flight.pop_front().expect("a batch in flight");
        batch.persist_failed(saved);
        for (due, stall) in batch.dues.iter().zip(&batch.stalls) {
            if stall.is_none() {
                let state = &mut self.states[due.job];
                state.next = self.config.jobs[due.job].schedule.next_after(state.last);
            }
        }
        self.settle(&batch.dues, batch.stalls, batch.now)
    }

    /// What following the `after` jobs needs ([`follower::step`](crate::follower::step)).
    pub(crate) fn following(&mut self) -> Following<'_> {
        Following {
            jobs: &self.config.jobs,
            followers: &mut self.followers,
            lasts: Lasts(&self.states),
            paused: &self.paused,
            retention: self.config.worker.done_ttl,
        }
    }

    /// The followers' progress the step moved (`moved`: job, to): the followers whose progress
    /// to write (fenced, only past what was confirmed or recorded).
    pub(crate) fn followed(&mut self, moved: Vec<(usize, DateTime<Utc>)>) -> Vec<usize> {
        for (i, to) in moved {
            self.states[i].last = to;
            self.states[i].unsaved = true;
        }
        self.followers
            .jobs()
            .filter(|i| self.states[*i].to_write())
            .collect()
    }

    /// The wait after following at `now`: until the next instant, at most [`FOLLOW_POLL`].
    pub(crate) fn wait_after_follow(&self, now: DateTime<Utc>) -> Next {
        Next::Wait(self.wait(now).unwrap_or_default().min(FOLLOW_POLL))
    }

    /// The writes of jobs `which`'s progress (never moving it back), with the job's rule where
    /// it is not recorded yet.
    pub(crate) fn writes(&self, which: &[usize]) -> Writes<'_> {
        let (starting, moving): (Vec<usize>, Vec<usize>) =
            which.iter().partition(|i| self.states[**i].rule_unsaved);
        let jobs = &self.config.jobs;
        let name = |i: usize| (jobs[i].name.as_str(), self.states[i].last);
        Writes {
            progress: moving.into_iter().map(name).collect(),
            starts: starting
                .into_iter()
                .map(|i| (name(i).0, name(i).1, reload::rule(&jobs[i].schedule)))
                .collect(),
        }
    }

    /// Redis's answers to [`Machine::writes`] for `which` (`moved` for its progress, `started`
    /// for its starts, each in order): each job's failure back in `which` order; clears what
    /// was written. The starts just written (a first start, an added or rescheduled job; not
    /// an adopted one) are to journal, so that `audit` plans no instant of its rule before
    /// them (docs/audit.md).
    pub(crate) fn saved(
        &mut self,
        which: &[usize],
        moved: Vec<Option<Arc<ProgressError>>>,
        started: Vec<Option<Arc<ProgressError>>>,
    ) -> Saved {
        let (mut moved, mut started) = (moved.into_iter(), started.into_iter());
        let outcomes: Vec<Option<Arc<ProgressError>>> = which
            .iter()
            .map(|i| {
                let outcome = if self.states[*i].rule_unsaved {
                    started.next()
                } else {
                    moved.next()
                };
                outcome.flatten()
            })
            .collect();
        let deposed = outcomes
            .iter()
            .flatten()
            .any(|e| matches!(**e, ProgressError::Deposed));
        let states = &mut self.states;
        let started = which
            .iter()
            .zip(&outcomes)
            .filter(|(i, failed)| {
                failed.is_none() && states[**i].unsaved && states[**i].rule_unsaved
            })
            .map(|(i, _)| journal::started(&self.config.jobs[*i], states[*i].last))
            .collect();
        for (i, failed) in which.iter().zip(&outcomes) {
            if failed.is_none() {
                states[*i].unsaved = false;
                states[*i].rule_unsaved = false;
            }
        }
        Saved {
            outcomes,
            deposed,
            started,
        }
    }

    /// Puts every job of the batch back in the queue — at its next instant when it moved on,
    /// for a retry when it stalled — and sets the stall gauge. Returns the shared backoff when
    /// the broker or Redis stalled some job.
    fn settle(
        &mut self,
        batch: &[Due],
        stalls: Vec<Option<Stall>>,
        now: DateTime<Utc>,
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
                Stall::Publish(_) | Stall::Unsent(_) => self.stats.publish_failures.inc(),
                Stall::Persist(_) => self.stats.persist_failures.inc(),
                Stall::NotLeading => 0,
            };
            let listed = stalled < STALLS_LISTED;
            shared += usize::from(!self.stalled(due, &stall, now, listed));
            stalled += 1;
        }
        self.stats.stalled_jobs.set(self.stuck);
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

/// `plan` without the instants a calendar of `job`'s `exclude` holds ([`misfire::excluded`]).
fn skip_excluded(job: &Job, plan: Plan, calendars: &BTreeMap<String, Calendar>) -> Plan {
    if job.spec.exclude.is_empty() {
        return plan;
    }
    let exclude = &job.spec.exclude;
    misfire::excluded(plan, |t| {
        excluded_by(exclude, t, job.timezone, |name| calendars.get(name)).is_some()
    })
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
    (paused, calendars): (&HashSet<String>, &BTreeMap<String, Calendar>),
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
        plan = skip_excluded(&jobs[job], plan, calendars);
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

/// Wait before the `failures`-th consecutive try of a job whose own message failed.
fn isolated_backoff(failures: u32) -> Duration {
    ISOLATED.nth(failures.saturating_sub(1), 0.0)
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

/// The envelopes of the batch's jobs that have not stalled: the first `take` of each plan,
/// stamped `published_at`.
fn envelopes(jobs: &[Job], batch: &Batch, published_at: DateTime<Utc>) -> Sent {
    let mut envelopes = Vec::new();
    let mut spans = Vec::new();
    for (p, due) in batch.dues.iter().enumerate() {
        if batch.stalls[p].is_some() {
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
            envelopes.push(Envelope::of_job(job, *t, expires_at, published_at));
        }
        spans.push((p, first..envelopes.len()));
    }
    Sent { envelopes, spans }
}

/// Records each job's confirmed instants and returns their journal entries; a job whose
/// publish failed gets its stall. `outcomes` is in `sent.envelopes` order: each job's run of
/// them, in `spans` order.
fn record_outcomes(
    jobs: &[Job],
    states: &mut [JobState],
    batch: &mut Batch,
    outcomes: Vec<Result<(), BrokerError>>,
    stats: &BeatStats,
) -> Vec<LeaderEntry> {
    let mut outcomes = outcomes.into_iter();
    let mut published = Vec::new();
    for (p, span) in &batch.sent.spans {
        let results: Vec<Result<(), BrokerError>> = outcomes.by_ref().take(span.len()).collect();
        if batch.stalls[*p].is_none() {
            let due = &batch.dues[*p];
            let (job, state) = (&jobs[due.job], &mut states[due.job]);
            let envelopes = &batch.sent.envelopes[span.clone()];
            let confirmed = record_confirmed(job, state, due, envelopes, results, stats);
            published.extend(
                envelopes[..confirmed.0]
                    .iter()
                    .map(|e| journal::published(&e.key)),
            );
            batch.stalls[*p] = confirmed.1;
        }
    }
    published
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
            let batch = take_due(
                &mut queue,
                &jobs,
                &states,
                (at(NOW), THRESHOLD),
                (&none, &BTreeMap::new()),
            );
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
        let batch = take_due(
            &mut queue,
            &jobs,
            &states,
            (just_before, THRESHOLD),
            (&none, &BTreeMap::new()),
        );
        assert!(batch.is_empty(), "not due before instant + offset");
        let batch = take_due(
            &mut queue,
            &jobs,
            &states,
            (instant + offset, THRESHOLD),
            (&none, &BTreeMap::new()),
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
            take_due(
                &mut queue,
                &jobs,
                &states,
                (now, threshold),
                (&none, &BTreeMap::new()),
            )
            .remove(0)
        };

        let due = plan_of(&after);
        assert_eq!(due.plan.publish, vec![instant]);
        assert_eq!(due.plan.dropped_count(), 0, "{:?}", due.plan.dropped);
        let batch = Batch {
            dues: vec![due],
            now,
            sent: Sent::default(),
            stalls: vec![None],
            saving: Vec::new(),
        };
        let sent = envelopes(&jobs, &batch, now);
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

/// The machine driven through its cases with plain values: Redis and the broker are answers the
/// test chooses, time is the `now` it passes. See: issues/34
#[cfg(test)]
mod driven {
    use super::*;
    use crate::misfire::tests::at;
    use drumline_shared::envelope::instance_key;
    use std::collections::HashMap;
    use std::path::Path;

    /// A config of the jobs `(name, keys)`, each running task `t`.
    fn config(jobs: &[(&str, &str)]) -> Arc<Config> {
        let mut text = String::new();
        for (name, keys) in jobs {
            text += &format!("[[jobs]]\nname = \"{name}\"\ntask = \"t\"\n{keys}\n");
        }
        text += "[tasks.t]\ncommand = [\"/bin/true\"]\n";
        let config = Config::parse(&text, Path::new("test.toml"), |_| None);
        Arc::new(config.unwrap_or_else(|e| panic!("bad test config: {e}")))
    }

    const MINUTELY: &str = "every = \"1m\"";

    /// How Redis answers progress writes.
    #[derive(Clone, Copy, PartialEq)]
    enum Redis {
        Takes,
        /// The instant is too far ahead of Redis `TIME`.
        Refuses,
        /// The lease is not ours.
        Deposes,
    }

    /// How a round of the driver ended.
    #[derive(Debug, PartialEq)]
    enum Out {
        Next(Next),
        Follow,
        Early(Duration),
    }

    /// The machine and the world around it, played by the test as the driver plays it.
    struct World {
        m: Machine,
        /// The messages of each batch in flight, oldest first.
        flight: VecDeque<Vec<Envelope>>,
        /// Jobs (or keys) whose messages the broker refuses.
        refused: HashSet<String>,
        /// No connection to the broker: nothing is sent.
        unreachable: bool,
        /// The term stops holding after this many messages of the next batch.
        withdraw_after: Option<usize>,
        redis: Redis,
        deposed: bool,
        /// Keys the broker confirmed, in order: what workers receive.
        delivered: Vec<String>,
        journal: Vec<LeaderEntry>,
        /// Each job's progress as Redis holds it.
        recorded: HashMap<String, DateTime<Utc>>,
        holds: bool,
        stopping: bool,
        stats: BeatStats,
    }

    impl World {
        /// A term gained at `now` over `jobs`, each with `last` recorded (`None`: never).
        fn gained(jobs: &[(&str, &str)], last: Option<&str>, now: &str) -> World {
            World::recorded_at(jobs, &vec![last; jobs.len()], now)
        }

        /// A term gained at `now` over `jobs`, with each one's recorded progress.
        fn recorded_at(jobs: &[(&str, &str)], lasts: &[Option<&str>], now: &str) -> World {
            let config = config(jobs);
            let n = config.jobs.len();
            let recorded = config
                .jobs
                .iter()
                .zip(lasts)
                .filter_map(|(j, last)| Some((j.name.clone(), at((*last)?))))
                .collect();
            let lasts = lasts.iter().map(|l| l.map(at)).collect();
            let gain = Gain {
                lasts,
                resumes: vec![Resume::Continue; n],
                carried: Vec::new(),
                paused: HashSet::new(),
            };
            let stats = BeatStats::default();
            let (m, _) = Machine::gained(config, gain, at(now), stats.clone());
            World {
                m,
                flight: VecDeque::new(),
                refused: HashSet::new(),
                unreachable: false,
                withdraw_after: None,
                redis: Redis::Takes,
                deposed: false,
                delivered: Vec::new(),
                journal: Vec::new(),
                recorded,
                holds: true,
                stopping: false,
                stats,
            }
        }

        /// One round of the driver at `now` (as `Beat::run_due`).
        fn round(&mut self, now: &str) -> Out {
            let now = at(now);
            loop {
                match self.m.poll(now, self.holds, self.stopping) {
                    Do::FinishAll => {
                        let wait = self.finish_all();
                        if let Some(next) = after_finishing(self.stopping, wait) {
                            return Out::Next(next);
                        }
                    }
                    Do::Return(next) => return Out::Next(next),
                    Do::Follow => return Out::Follow,
                    Do::SleepPrecisely(d) => return Out::Early(d),
                    Do::Send => {
                        if let Some(next) = self.send(now) {
                            return Out::Next(next);
                        }
                    }
                }
            }
        }

        /// Plans and sends the batch due (as `Beat::send_next`).
        fn send(&mut self, now: DateTime<Utc>) -> Option<Next> {
            let planned = self.m.plan(now);
            self.journal.extend(planned.drops);
            let saved = self.save(&planned.save);
            let outgoing = self.m.planned_saved(&saved, now).to_vec();
            let unsent = (self.unreachable && !outgoing.is_empty()).then(|| {
                let (nodes, reason) = ("127.0.0.1:5672".into(), "refused".into());
                BrokerError::Unreachable { nodes, reason }
            });
            let sent = if unsent.is_some() {
                Vec::new()
            } else {
                outgoing
            };
            self.flight.push_back(sent);
            match self.m.sent(unsent) {
                AfterSend::More => None,
                AfterSend::FinishAll => self.finish_all().map(Next::Backoff),
                AfterSend::FinishOldest => {
                    let wait = self.finish_oldest().flatten()?;
                    let also = self.finish_all();
                    Some(Next::Backoff(also.map_or(wait, |w| w.max(wait))))
                }
            }
        }

        /// The broker's answer to one message.
        fn confirm(&mut self, e: &Envelope, nth: usize) -> Result<(), BrokerError> {
            if self.withdraw_after.is_some_and(|n| nth >= n) {
                self.holds = false;
                return Err(BrokerError::Withdrawn);
            }
            let job = e.key.split('@').next().unwrap_or_default();
            if self.refused.contains(job) || self.refused.contains(&e.key) {
                return Err(BrokerError::Nacked);
            }
            self.delivered.push(e.key.clone());
            Ok(())
        }

        /// Finishes the oldest batch in flight (as `Beat::finish_oldest`).
        fn finish_oldest(&mut self) -> Option<Option<Duration>> {
            let sent = self.flight.pop_front()?;
            let outcomes = sent
                .iter()
                .enumerate()
                .map(|(nth, e)| self.confirm(e, nth))
                .collect();
            let confirmed = self.m.confirmed(outcomes);
            self.journal.extend(confirmed.published);
            let saved = self.save(&confirmed.save);
            Some(self.m.finished(&saved))
        }

        fn finish_all(&mut self) -> Option<Duration> {
            let mut wait: Option<Duration> = None;
            while let Some(asked) = self.finish_oldest() {
                if let Some(w) = asked {
                    wait = Some(wait.map_or(w, |v| v.max(w)));
                }
            }
            wait
        }

        /// Writes the progress of `which` as Redis answers (as `Beat::save`).
        fn save(&mut self, which: &[usize]) -> Vec<Option<Arc<ProgressError>>> {
            let writes = self.m.writes(which);
            let mut all: Vec<(String, DateTime<Utc>)> = Vec::new();
            all.extend(writes.progress.iter().map(|(j, t)| (j.to_string(), *t)));
            let moved_n = all.len();
            all.extend(writes.starts.iter().map(|(j, t, _)| (j.to_string(), *t)));
            let answer = |t: DateTime<Utc>| match self.redis {
                Redis::Takes => None,
                Redis::Refuses => Some(Arc::new(ProgressError::Ahead { at: t })),
                Redis::Deposes => Some(Arc::new(ProgressError::Deposed)),
            };
            let answers: Vec<_> = all.iter().map(|(_, t)| answer(*t)).collect();
            if self.redis == Redis::Takes {
                for (job, t) in &all {
                    let was = self.recorded.entry(job.clone()).or_insert(*t);
                    *was = (*was).max(*t);
                }
            }
            let started = answers[moved_n..].to_vec();
            let moved = answers[..moved_n].to_vec();
            let saved = self.m.saved(which, moved, started);
            self.deposed |= saved.deposed;
            self.journal.extend(saved.started);
            saved.outcomes
        }

        /// Persists every new start (as `Beat::reload`'s loop).
        fn persist_starts(&mut self) {
            while let Some(slice) = self.m.next_starts() {
                let saved = self.save(&slice);
                if !self.m.starts_saved(&saved) {
                    break;
                }
            }
        }

        fn journaled(&self, event: &str) -> Vec<(String, &'static str)> {
            let entries = self.journal.iter().filter(|e| e.event == event);
            entries.map(|e| (e.key.clone(), e.reason)).collect()
        }

        fn recorded(&self, job: &str) -> Option<DateTime<Utc>> {
            self.recorded.get(job).copied()
        }
    }

    fn key(job: &str, t: &str) -> String {
        instance_key(job, at(t))
    }

    fn keys(job: &str, minutes: std::ops::RangeInclusive<u32>) -> Vec<String> {
        let ts = crate::misfire::tests::minutes(minutes);
        ts.into_iter().map(|t| instance_key(job, t)).collect()
    }

    const ABC: [(&str, &str); 3] = [("a", MINUTELY), ("b", MINUTELY), ("c", MINUTELY)];

    #[test]
    fn instants_due_in_one_tick_are_published_once_each() {
        let mut w = World::gained(&ABC, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        let next = w.round("2026-03-02T12:01:00Z");
        assert_eq!(next, Out::Next(Next::Wait(MAX_WAIT)));
        let t = "2026-03-02T12:01:00Z";
        assert_eq!(w.delivered, vec![key("a", t), key("b", t), key("c", t)]);
        assert_eq!(w.journaled("published").len(), 3);
        assert_eq!(w.recorded("b"), Some(at(t)));
        // Looked at again within the same instant: nothing more.
        w.round("2026-03-02T12:01:00.400Z");
        assert_eq!(w.delivered.len(), 3);
        assert_eq!(w.stats.published_total(), 3);
    }

    #[test]
    fn a_tick_with_nothing_due_sleeps_until_the_next_instant() {
        let mut w = World::gained(&ABC, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:10Z");
        let wait = |ms| Out::Next(Next::Wait(Duration::from_millis(ms)));
        assert_eq!(w.round("2026-03-02T12:00:30Z"), wait(1000));
        assert_eq!(w.round("2026-03-02T12:00:59.500Z"), wait(497));
        // Within `WAKE_EARLY`: the rest is slept precisely, then the instant is sent.
        let early = w.round("2026-03-02T12:00:59.999Z");
        assert_eq!(early, Out::Early(Duration::from_millis(1)));
        assert!(w.delivered.is_empty());
        w.round("2026-03-02T12:01:00Z");
        assert_eq!(w.delivered.len(), 3);
    }

    /// The beat was down ten minutes and a half: what each misfire policy publishes.
    fn after_a_long_pause(policy: &str) -> World {
        let keys = format!("{MINUTELY}\nmisfire = \"{policy}\"\noverlap = \"queue\"");
        let jobs = [("a", keys.as_str())];
        let mut w = World::gained(&jobs, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:10:30Z");
        w.round("2026-03-02T12:10:30Z");
        w
    }

    #[test]
    fn after_a_long_pause_run_once_publishes_only_the_latest_missed() {
        let w = after_a_long_pause("run_once");
        assert_eq!(w.delivered, keys("a", 10..=10));
        let skipped = w.journaled("skipped");
        assert_eq!(skipped.len(), 9);
        assert!(
            skipped.iter().all(|(_, why)| *why == "misfire_run_once"),
            "{skipped:?}"
        );
        assert_eq!(w.recorded("a"), Some(at("2026-03-02T12:10:00Z")));
    }

    #[test]
    fn after_a_long_pause_skip_publishes_none_and_moves_past_them() {
        let mut w = after_a_long_pause("skip");
        assert!(w.delivered.is_empty());
        assert_eq!(w.journaled("skipped").len(), 10);
        assert_eq!(w.recorded("a"), Some(at("2026-03-02T12:10:00Z")));
        // The next instant, on time, is published.
        w.round("2026-03-02T12:11:00Z");
        assert_eq!(w.delivered, keys("a", 11..=11));
    }

    #[test]
    fn after_a_long_pause_catch_up_publishes_every_missed_instant_oldest_first() {
        let w = after_a_long_pause("catch_up");
        assert_eq!(w.delivered, keys("a", 1..=10));
        assert!(w.journaled("skipped").is_empty());
    }

    /// The term stops holding after the first message of the batch: the rest is withdrawn,
    /// nothing further is published, and only what was confirmed is recorded.
    #[test]
    fn leadership_lost_mid_batch_publishes_nothing_further() {
        let mut w = World::gained(&ABC, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        w.withdraw_after = Some(1);
        let t = "2026-03-02T12:01:00Z";
        assert_eq!(w.round(t), Out::Next(Next::NotHolding));
        assert_eq!(w.delivered, vec![key("a", t)]);
        assert_eq!(w.recorded("a"), Some(at(t)));
        assert_eq!(w.recorded("b"), Some(at("2026-03-02T12:00:00Z")));
        assert_eq!(w.recorded("c"), Some(at("2026-03-02T12:00:00Z")));
        // Not the jobs' fault: no stall counted, no drop journaled.
        assert_eq!(w.stats.publish_failures.get(), 0);
        assert!(w.journaled("skipped").is_empty());
        assert_eq!(w.round("2026-03-02T12:01:01Z"), Out::Next(Next::NotHolding));
        assert_eq!(w.delivered.len(), 1);
    }

    /// What the last leader left unconfirmed, its successor publishes, on time, from the
    /// progress recorded: nothing it recorded is published again.
    #[test]
    fn a_successor_publishes_the_instants_left_unconfirmed_and_nothing_twice() {
        let mut w = World::gained(&ABC, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        w.withdraw_after = Some(1);
        let t = "2026-03-02T12:01:00Z";
        w.round(t);
        let (a, b) = (w.recorded("a").unwrap(), w.recorded("b").unwrap());
        let (a, b) = (a.to_rfc3339(), b.to_rfc3339());
        let jobs = [("a", MINUTELY), ("b", MINUTELY)];
        let lasts = [Some(a.as_str()), Some(b.as_str())];
        let mut next = World::recorded_at(&jobs, &lasts, "2026-03-02T12:01:02Z");
        next.round("2026-03-02T12:01:02Z");
        assert_eq!(next.delivered, vec![key("b", t)]);
    }

    #[test]
    fn a_gained_term_picks_up_from_recorded_progress_without_republishing() {
        let last = Some("2026-03-02T12:01:00Z");
        let mut w = World::gained(&ABC, last, "2026-03-02T12:01:30Z");
        assert_eq!(
            w.round("2026-03-02T12:01:30Z"),
            Out::Next(Next::Wait(MAX_WAIT))
        );
        assert!(w.delivered.is_empty());
        assert!(w.journal.is_empty());
        w.round("2026-03-02T12:02:00Z");
        let t = "2026-03-02T12:02:00Z";
        assert_eq!(w.delivered, vec![key("a", t), key("b", t), key("c", t)]);
    }

    #[test]
    fn a_refused_message_is_retried_alone_without_skipping_ahead() {
        let jobs = [("a", MINUTELY)];
        let mut w = World::gained(&jobs, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        w.refused.insert("a".into());
        // Its own failure: no shared backoff; retried after its own (200 ms).
        let next = w.round("2026-03-02T12:01:00Z");
        assert_eq!(next, Out::Next(Next::Wait(Duration::from_millis(197))));
        assert!(w.delivered.is_empty());
        assert_eq!(w.recorded("a"), Some(at("2026-03-02T12:00:00Z")));
        assert_eq!(w.stats.publish_failures.get(), 1);
        assert_eq!(w.stats.stalled_jobs.get(), 1);
        w.refused.clear();
        w.round("2026-03-02T12:01:00.200Z");
        assert_eq!(w.delivered, keys("a", 1..=1));
        assert_eq!(w.stats.stalled_jobs.get(), 0);
    }

    #[test]
    fn a_job_refused_by_the_broker_does_not_hold_up_the_others() {
        let mut w = World::gained(&ABC, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        w.refused.insert("b".into());
        let t = "2026-03-02T12:01:00Z";
        let next = w.round(t);
        assert!(matches!(next, Out::Next(Next::Wait(_))), "{next:?}");
        assert_eq!(w.delivered, vec![key("a", t), key("c", t)]);
        w.refused.clear();
        w.round("2026-03-02T12:01:00.300Z");
        assert_eq!(w.delivered.last(), Some(&key("b", t)));
        assert_eq!(w.delivered.len(), 3);
    }

    #[test]
    fn a_partly_confirmed_catch_up_records_the_confirmed_prefix_and_retries_the_rest() {
        let jobs = [(
            "a",
            "every = \"1m\"\nmisfire = \"catch_up\"\noverlap = \"queue\"",
        )];
        let mut w = World::gained(&jobs, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:03:01Z");
        w.refused.insert(key("a", "2026-03-02T12:02:00Z"));
        w.round("2026-03-02T12:03:01Z");
        // 12:03 was confirmed, but after the refused 12:02: only 12:01 is recorded.
        assert_eq!(w.delivered, [keys("a", 1..=1), keys("a", 3..=3)].concat());
        assert_eq!(w.recorded("a"), Some(at("2026-03-02T12:01:00Z")));
        w.refused.clear();
        w.round("2026-03-02T12:03:01.300Z");
        let again = &w.delivered[2..];
        assert_eq!(again, keys("a", 2..=3), "12:01 is not published again");
        assert_eq!(w.recorded("a"), Some(at("2026-03-02T12:03:00Z")));
    }

    #[test]
    fn an_unreachable_broker_backs_off_and_the_same_instants_go_out_later() {
        let mut w = World::gained(&ABC, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        w.unreachable = true;
        let backoff = |ms| Out::Next(Next::Backoff(Duration::from_millis(ms)));
        assert_eq!(w.round("2026-03-02T12:01:00Z"), backoff(200));
        assert_eq!(w.round("2026-03-02T12:01:00.200Z"), backoff(400));
        assert_eq!(w.stats.stalled_jobs.get(), 3);
        w.unreachable = false;
        w.round("2026-03-02T12:01:00.600Z");
        assert_eq!(
            w.delivered,
            keys("a", 1..=1)
                .into_iter()
                .chain(keys("b", 1..=1))
                .chain(keys("c", 1..=1))
                .collect::<Vec<_>>()
        );
        assert!(
            w.journaled("skipped").is_empty(),
            "late within the threshold: not missed"
        );
        assert_eq!(w.stats.stalled_jobs.get(), 0);
    }

    #[test]
    fn a_job_whose_progress_cannot_be_written_publishes_nothing_until_it_is() {
        let jobs = [("a", MINUTELY)];
        // A first start: its start is written before its first publish.
        let mut w = World::gained(&jobs, None, "2026-03-02T12:00:30Z");
        w.redis = Redis::Refuses;
        let next = w.round("2026-03-02T12:01:00Z");
        assert_eq!(next, Out::Next(Next::Backoff(Duration::from_millis(200))));
        assert!(w.delivered.is_empty());
        assert_eq!(w.stats.persist_failures.get(), 1);
        w.redis = Redis::Takes;
        w.round("2026-03-02T12:01:00.200Z");
        assert_eq!(w.delivered, keys("a", 1..=1));
        let start = key("a", "2026-03-02T12:00:30Z");
        assert_eq!(w.journaled("start"), vec![(start, "")]);
    }

    #[test]
    fn a_progress_write_refused_for_the_lease_says_the_term_is_over() {
        let mut w = World::gained(&ABC, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        w.redis = Redis::Deposes;
        w.round("2026-03-02T12:01:00Z");
        assert!(w.deposed);
    }

    #[test]
    fn a_first_start_misses_nothing_before_it_and_journals_its_start() {
        let mut w = World::gained(&ABC, None, "2026-03-02T12:00:30.250Z");
        w.persist_starts();
        assert_eq!(w.journaled("start").len(), 3);
        // As a restart reads it back: the whole millisecond.
        let start = first_start(at("2026-03-02T12:00:30.250Z"));
        assert_eq!(w.recorded("a"), Some(start));
        assert!(w.m.next_starts().is_none());
        w.round("2026-03-02T12:01:00Z");
        assert_eq!(w.delivered.len(), 3);
        assert!(w.journaled("skipped").is_empty());
    }

    #[test]
    fn a_paused_job_drops_its_instants_and_a_resumed_one_publishes_again() {
        let mut w = World::gained(&ABC, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        w.m.paused_seen(HashSet::from(["a".to_owned()]));
        let t = "2026-03-02T12:01:00Z";
        w.round(t);
        assert_eq!(w.delivered, vec![key("b", t), key("c", t)]);
        assert_eq!(w.journaled("skipped"), vec![(key("a", t), "paused")]);
        assert_eq!(
            w.recorded("a"),
            Some(at(t)),
            "moved past what the pause dropped"
        );
        w.m.paused_seen(HashSet::new());
        w.round("2026-03-02T12:02:00Z");
        assert!(w.delivered.contains(&key("a", "2026-03-02T12:02:00Z")));
    }

    #[test]
    fn an_instant_on_a_calendar_date_is_skipped_and_journaled() {
        let holiday = "every = \"1h\"\nexclude = [\"h\"]\n[calendars.h]\ndates = [\"2026-03-03\"]";
        let jobs = [("a", holiday), ("b", "every = \"1h\"")];
        let mut w = World::gained(&jobs, Some("2026-03-02T23:00:00Z"), "2026-03-02T23:30:00Z");
        let t = "2026-03-03T00:00:00Z";
        w.round(t);
        assert_eq!(w.delivered, vec![key("b", t)]);
        assert_eq!(w.journaled("skipped"), vec![(key("a", t), "calendar")]);
        assert_eq!(
            w.recorded("a"),
            Some(at(t)),
            "moved past what the calendar skipped"
        );
        w.round("2026-03-04T00:00:00Z");
        assert!(w.delivered.contains(&key("a", "2026-03-04T00:00:00Z")));
    }

    /// Job `a` stalls on its 12:01; `change` (at 12:01:00.100) reschedules `b` to every 2 m
    /// and keeps `a`: `a`'s 12:01 is still published, `b` starts from the change.
    fn rescheduling_b_keeps_the_pending_instants_of_a(
        change: impl FnOnce(&mut Machine, DateTime<Utc>),
    ) {
        let jobs = [("a", MINUTELY), ("b", MINUTELY)];
        let mut w = World::gained(&jobs, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        w.refused.insert("a".into());
        w.round("2026-03-02T12:01:00Z");
        w.refused.clear();
        change(&mut w.m, at("2026-03-02T12:01:00.100Z"));
        w.persist_starts();
        assert_eq!(
            w.journaled("start"),
            vec![(key("b", "2026-03-02T12:01:00.100Z"), "")]
        );
        w.round("2026-03-02T12:01:00.300Z");
        assert_eq!(
            w.delivered,
            vec![
                key("b", "2026-03-02T12:01:00Z"),
                key("a", "2026-03-02T12:01:00Z")
            ]
        );
        w.round("2026-03-02T12:02:00Z");
        assert_eq!(
            &w.delivered[2..],
            [
                key("a", "2026-03-02T12:02:00Z"),
                key("b", "2026-03-02T12:02:00Z")
            ]
        );
    }

    /// Job `b` added by `change` at 12:01:30 starts from it: its start journaled, nothing of it
    /// before.
    fn adding_b_starts_it_from_the_change(change: impl FnOnce(&mut Machine, DateTime<Utc>)) {
        let jobs = [("a", MINUTELY)];
        let mut w = World::gained(&jobs, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:01:30Z");
        change(&mut w.m, at("2026-03-02T12:01:30Z"));
        w.persist_starts();
        assert_eq!(
            w.journaled("start"),
            vec![(key("b", "2026-03-02T12:01:30Z"), "")]
        );
        w.round("2026-03-02T12:01:30Z");
        assert_eq!(
            w.delivered,
            keys("a", 1..=1),
            "nothing of b before the change"
        );
        w.round("2026-03-02T12:02:00Z");
        assert!(w.delivered.contains(&key("b", "2026-03-02T12:02:00Z")));
    }

    #[test]
    fn a_reload_that_reschedules_keeps_the_pending_instants_of_kept_jobs() {
        rescheduling_b_keeps_the_pending_instants_of_a(|m, now| {
            m.reload(config(&[("a", MINUTELY), ("b", "every = \"2m\"")]), now)
        });
    }

    #[test]
    fn a_reload_adding_a_job_starts_it_from_the_reload() {
        adding_b_starts_it_from_the_change(|m, now| m.reload(config(&ABC[..2]), now));
    }

    /// Schedule `name` checked as the leader checks it (`keys` its `[[jobs]]` keys).
    fn schedule(name: &str, keys: &str) -> Option<Job> {
        Some(config(&[(name, keys)]).jobs[0].clone())
    }

    /// No file jobs: every name is a schedule's.
    fn no_file() -> Arc<Config> {
        config(&[])
    }

    /// A schedule created at run time starts from the edit, as a reload starts an added job.
    #[test]
    fn an_edit_adding_a_schedule_starts_it_from_the_edit() {
        adding_b_starts_it_from_the_change(|m, now| {
            m.edit(vec![("b".into(), schedule("b", MINUTELY))], &no_file(), now)
        });
    }

    /// An edit rescheduling one schedule leaves the others' pending instants, in place as the
    /// reload above does.
    #[test]
    fn an_edit_rescheduling_one_schedule_leaves_the_others_pending_instants() {
        rescheduling_b_keeps_the_pending_instants_of_a(|m, now| {
            let edits = vec![("b".into(), schedule("b", "every = \"2m\""))];
            m.edit(edits, &no_file(), now)
        });
    }

    /// An edit that keeps the schedule (new args) keeps the progress: no start, no instant
    /// twice, none lost.
    #[test]
    fn an_edit_keeping_the_schedule_keeps_the_progress() {
        let jobs = [("a", MINUTELY)];
        let mut w = World::gained(&jobs, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        w.round("2026-03-02T12:01:00Z");
        let args = format!("{MINUTELY}\nargs = {{ n = 2 }}");
        w.m.edit(
            vec![("a".into(), schedule("a", &args))],
            &no_file(),
            at("2026-03-02T12:01:10Z"),
        );
        w.persist_starts();
        assert!(w.journaled("start").is_empty());
        w.round("2026-03-02T12:02:00Z");
        assert_eq!(w.delivered, keys("a", 1..=2));
    }

    /// Removing the first of three schedules moves the last into its place: the two left run
    /// on, the removed one never again; a file job of the same name is never touched.
    #[test]
    fn an_edit_removing_a_schedule_stops_it_and_keeps_the_others() {
        let mut w = World::gained(&ABC, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        w.round("2026-03-02T12:01:00Z");
        w.m.edit(
            vec![("a".into(), None)],
            &no_file(),
            at("2026-03-02T12:01:10Z"),
        );
        let file = config(&[("b", MINUTELY)]);
        w.m.edit(vec![("b".into(), None)], &file, at("2026-03-02T12:01:10Z"));
        w.delivered.clear();
        w.round("2026-03-02T12:02:00Z");
        let mut delivered = w.delivered.clone();
        delivered.sort();
        assert_eq!(
            delivered,
            vec![
                key("b", "2026-03-02T12:02:00Z"),
                key("c", "2026-03-02T12:02:00Z")
            ]
        );
        assert_eq!(w.m.config.jobs.len(), 2);
    }

    #[test]
    fn a_jittered_instant_goes_out_at_its_offset_and_is_never_dropped() {
        let jobs = [("a", "every = \"1m\"\njitter = \"50s\"\nmisfire = \"skip\"")];
        let mut w = World::gained(&jobs, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        let offset = w.m.config.jobs[0].jitter_offset();
        let instant = at("2026-03-02T12:01:00Z");
        let due = (instant + offset).to_rfc3339();
        let before = (instant + offset - chrono::TimeDelta::seconds(1)).to_rfc3339();
        w.round(&before);
        assert!(w.delivered.is_empty(), "not before its offset");
        w.round(&due);
        assert_eq!(w.delivered, vec![instance_key("a", instant)]);
        assert!(w.journaled("skipped").is_empty());
    }

    /// A reload lowering the jitter (to none) just before the instant's old jittered time:
    /// `skip` would drop it as long missed; held, it is published at once.
    #[test]
    fn a_reload_lowering_the_jitter_never_drops_the_pending_instant() {
        let jobs = [("a", "every = \"1m\"\njitter = \"50s\"\nmisfire = \"skip\"")];
        let mut w = World::gained(&jobs, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        let offset = w.m.config.jobs[0].jitter_offset();
        let instant = at("2026-03-02T12:01:00Z");
        let reload_at = instant + offset - chrono::TimeDelta::milliseconds(1);
        w.m.reload(
            config(&[("a", "every = \"1m\"\nmisfire = \"skip\"")]),
            reload_at,
        );
        w.round(&(reload_at + chrono::TimeDelta::milliseconds(1)).to_rfc3339());
        assert_eq!(w.delivered, vec![instance_key("a", instant)]);
        assert!(w.journaled("skipped").is_empty());
    }

    #[test]
    fn a_follower_is_never_due_on_its_own_and_is_followed_when_there_is_room() {
        let jobs = [("a", MINUTELY), ("b", "after = \"a\"")];
        let mut w = World::gained(&jobs, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        assert_eq!(w.round("2026-03-02T12:00:30Z"), Out::Follow);
        // Too close to the next instant: the followers wait, the instant does not.
        let close = w.round("2026-03-02T12:00:59.990Z");
        assert_eq!(close, Out::Next(Next::Wait(Duration::from_millis(7))));
        w.round("2026-03-02T12:01:00Z");
        assert_eq!(
            w.delivered,
            keys("a", 1..=1),
            "b is published by the followers' step"
        );
        // The step decided b's 12:01 (its upstream succeeded): its progress is written.
        let which = w.m.followed(vec![(1, at("2026-03-02T12:01:00Z"))]);
        assert_eq!(which, vec![1]);
        w.save(&which);
        assert_eq!(w.recorded("b"), Some(at("2026-03-02T12:01:00Z")));
        let after = w.m.wait_after_follow(at("2026-03-02T12:01:30Z"));
        assert_eq!(after, Next::Wait(FOLLOW_POLL));
    }

    #[test]
    fn a_stop_finishes_the_batches_in_flight_and_sends_no_more() {
        let mut w = World::gained(&ABC, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        let t = at("2026-03-02T12:01:00Z");
        assert_eq!(w.m.poll(t, true, false), Do::Send);
        assert_eq!(w.send(t), None, "in flight, its confirms not read yet");
        assert!(w.delivered.is_empty());
        w.stopping = true;
        let next = w.round("2026-03-02T12:01:00Z");
        assert_eq!(next, Out::Next(Next::Shutdown));
        assert_eq!(w.delivered.len(), 3);
        assert_eq!(
            w.recorded("c"),
            Some(t),
            "confirmed, so recorded before the exit"
        );
    }

    #[test]
    fn a_stop_with_nothing_in_flight_publishes_nothing_due() {
        let mut w = World::gained(&ABC, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        w.stopping = true;
        assert_eq!(w.round("2026-03-02T12:01:00Z"), Out::Next(Next::Shutdown));
        assert!(w.delivered.is_empty());
        assert_eq!(w.recorded("a"), Some(at("2026-03-02T12:00:00Z")));
    }

    #[test]
    fn jobs_due_beyond_a_batch_go_out_in_batches_several_in_flight() {
        let names: Vec<String> = (0..BATCH_JOBS + 200).map(|i| format!("j{i}")).collect();
        let jobs: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), MINUTELY)).collect();
        let mut w = World::gained(&jobs, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        let t = at("2026-03-02T12:01:00Z");
        assert_eq!(w.send(t), None);
        assert_eq!(w.flight[0].len(), BATCH_JOBS);
        assert_eq!(
            w.m.poll(t, true, false),
            Do::Send,
            "the rest is sent before a confirm"
        );
        assert_eq!(w.send(t), None);
        assert_eq!(w.flight.len(), 2);
        assert_eq!(w.m.poll(t, true, false), Do::FinishAll);
        w.round("2026-03-02T12:01:00Z");
        let unique: HashSet<&String> = w.delivered.iter().collect();
        assert_eq!(
            (w.delivered.len(), unique.len()),
            (BATCH_JOBS + 200, BATCH_JOBS + 200)
        );
    }

    #[test]
    fn a_backward_clock_jump_republishes_nothing() {
        let mut w = World::gained(&ABC, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        w.round("2026-03-02T12:01:00Z");
        let next = w.round("2026-03-02T12:00:20Z");
        assert_eq!(next, Out::Next(Next::Wait(MAX_WAIT)));
        assert_eq!(w.delivered.len(), 3);
    }

    #[test]
    fn a_term_that_stops_holding_sends_nothing_and_says_so() {
        let mut w = World::gained(&ABC, Some("2026-03-02T12:00:00Z"), "2026-03-02T12:00:30Z");
        w.holds = false;
        assert_eq!(w.round("2026-03-02T12:01:00Z"), Out::Next(Next::NotHolding));
        assert!(w.delivered.is_empty());
        w.holds = true;
        w.round("2026-03-02T12:01:00.500Z");
        assert_eq!(w.delivered.len(), 3, "late within the threshold: published");
    }
}
