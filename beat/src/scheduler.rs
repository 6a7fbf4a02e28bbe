//! The beat loop (docs/design.md): the thin driver of the scheduling `Machine` (no I/O in
//! it). It asks the machine what to do at each wake and carries it out — reads the paused jobs,
//! journals and writes progress through the [`Store`] (via [`progress`] and `journal`),
//! publishes through the [`Publisher`] — and feeds the answers back. What is due, missed,
//! dropped, retried or backed off is decided in `machine.rs`.
//!
//! Only the leader publishes (`leader.rs`): a beat stands by until it holds the
//! lease, then loads every job's progress and leads a `Term` — checked before each batch and
//! before each message is handed to the broker — until the term ends; then it drops what it
//! knew and stands by again. Its progress writes are fenced by the lease's token. It plans with
//! its own clock capped at Redis `TIME` + `misfire_threshold` (`Term::now`).
//!
//! Progress is one instant per job, `{ns}:beat:last:{job}`: everything up to it has been
//! decided (published, or dropped and reported). Because it is persisted and only moves
//! forward, the same planning covers every way of missing instances — a beat restart, a broker
//! or Redis outage, a forward wall-clock jump — and a backward jump finds nothing to do.
//!
//! Jobs due together (100,000 on the minute is a supported size) are handled in batches of up
//! to [`BATCH_JOBS`] jobs or [`BATCH_MESSAGES`] messages: every message of a batch is sent
//! before the first confirm is awaited, and the batch's progress is written in one Redis round
//! trip, so a batch costs a few round trips rather than two per message. Up to
//! `IN_FLIGHT` (8) batches are in flight: the next ones are sent before the
//! confirms of the oldest are read, so the broker's confirms (its disk writes) overlap the
//! sending; each batch's progress is still written only after its own confirms, oldest first.

use crate::dynamic::{Change, Changes};
use crate::follower;
use crate::journal;
use crate::leader::{Leadership, Term};
use crate::machine::{self, after_finishing, AfterSend, Do, Gain, Machine, Next};
pub use crate::machine::{BATCH_JOBS, BATCH_MESSAGES};
use crate::machine::{STARTS_GAP, WAKE_EARLY};
use crate::progress;
use crate::publisher::Publisher;
use crate::reload::Resume;
pub use crate::stats::BeatStats;
use crate::stats::RedisContact;
use chrono::{DateTime, Utc};
use drumline_shared::backoff::Backoff;
use drumline_shared::broker::{BrokerError, Sending};
use drumline_shared::config::{Config, Job};
use drumline_shared::names::Names;
use drumline_shared::signals::Hangups;
use drumline_shared::store::{ProgressError, Store, StoreError};
use drumline_shared::url::Redacted;
use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{error, info, warn};

/// Between tries to reach Redis at start: 200 ms, doubled up to 5 s.
const REDIS_CONNECT: Backoff =
    Backoff::constant(Duration::from_millis(200), Duration::from_secs(5), 0.0);

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
    let hangups = Hangups::new();
    let config: Arc<Config> = config.into();
    let store = tokio::select! {
        s = connect_redis(&config, &stats) => s,
        _ = &mut shutdown => return Ok(stats),
    };
    // The file's jobs and the schedules: held by the term's machine while leading (one copy,
    // changed in place by an edit), by `serve` while standing by.
    let (mut changes, config) = tokio::select! {
        c = load_changes(config.clone(), &store, hangups) => c,
        _ = &mut shutdown => return Ok(stats),
    };
    let mut publisher = Publisher::new(&config);
    let (lease, threshold) = (config.beat.leader_lease, config.beat.misfire_threshold);
    let mut leadership = Leadership::start(store.clone(), lease, threshold, stats.clone());
    let served = serve(
        config,
        &store,
        (&mut publisher, &mut leadership, &mut changes),
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

/// Term after term until `shutdown`: wait to lead, load progress, lead. SIGHUP replaces
/// `config` (a standby's takes effect at its next term, where the reload rules are applied to
/// the progress recorded by whoever led, [`reload::resume`]; a leader's at once,
/// [`Machine::reload`]).
async fn serve<F: Future<Output = ()>>(
    mut config: Arc<Config>,
    store: &Store,
    (publisher, leadership, changes): (&mut Publisher, &mut Leadership, &mut Changes),
    stats: &BeatStats,
    shutdown: &mut Pin<&mut F>,
) -> Result<(), BrokerError> {
    connect_broker(&config, publisher).await?;
    loop {
        let mut term = loop {
            tokio::select! {
                term = leadership.next_term() => break term,
                change = changes.next() => {
                    if let Some(change) = change {
                        standby_apply(&mut config, change, changes.file());
                        publisher.reconfigure(&config);
                    }
                }
                _ = shutdown.as_mut() => return Ok(()),
            }
        };
        // The term's machine holds the one config (so an edit changes it in place).
        let Some(mut beat) = Beat::start(config, store, &term, stats, shutdown).await else {
            return Ok(());
        };
        let ended = beat
            .lead(
                (store, &mut *publisher, stats),
                (&mut term, &mut *changes),
                shutdown,
            )
            .await?;
        config = beat.machine.config().clone();
        drop(beat);
        match ended {
            Ended::Shutdown => return Ok(()),
            Ended::Lost => info!(epoch = term.epoch, "stopped publishing; standing by"),
        }
    }
}

/// What `change` makes of a standby's `config` (taken up at its next term).
fn standby_apply(config: &mut Arc<Config>, change: Change, file: &Config) {
    match change {
        Change::Whole(new) => *config = new,
        Change::Schedules(edits) => Arc::make_mut(config).put_schedules(edits, file, |_, _| {}),
    }
}

/// How a term of leadership ended.
enum Ended {
    /// `shutdown` completed.
    Shutdown,
    /// The lease was lost or taken: stand by.
    Lost,
}

/// What the driver carries the machine's answers out with, for one round.
struct Io<'a> {
    store: &'a Store,
    publisher: &'a mut Publisher,
    stats: &'a BeatStats,
    term: &'a Term,
}

/// The driver of one term: its [`Machine`], and what a machine holds no part of — the broker's
/// confirms awaited for each batch in flight (in step with the machine's, oldest first) and the
/// returned messages matched across them.
struct Beat {
    machine: Machine,
    /// One per batch in flight: its confirms (`None` when nothing was sent, or nothing could
    /// be), and the publisher's session it was sent on.
    sendings: VecDeque<(Option<Sending>, u64)>,
    /// Returned messages matched across the batches in flight (cleared when none is).
    returned: HashSet<String>,
}

impl Beat {
    /// Loads every job's progress and the rule it was recorded under (retrying while Redis
    /// fails; `None` on shutdown), restarts from now the jobs rescheduled since
    /// ([`reload::resume`](crate::reload::resume)), and reads the paused jobs, for `term`.
    /// The new jobs' starts are written while nothing is due ([`Beat::persist_starts_in_gaps`]).
    async fn start<F: Future<Output = ()>>(
        config: Arc<Config>,
        store: &Store,
        term: &Term,
        stats: &BeatStats,
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
        let resumes = machine::resumes(&config.jobs, &lasts, &rules);
        let carried = until_read("the followers' old rules", shutdown, || {
            carried_at_gain(store, &config.jobs, (&lasts, &resumes), term.now())
        })
        .await?;
        let now = term.now();
        let paused = until_read("the paused jobs", shutdown, || store.paused()).await?;
        let gain = Gain {
            lasts,
            resumes,
            carried,
            paused,
        };
        info!(
            jobs = config.jobs.len(),
            load_ms = loading.elapsed().as_millis() as u64,
            namespace = %config.namespace,
            epoch = term.epoch,
            "beat leading"
        );
        let (machine, resumed) = Machine::gained(config, gain, now, stats.clone());
        info!(resumed, "jobs resumed from their recorded progress");
        Some(Beat {
            machine,
            sendings: VecDeque::new(),
            returned: HashSet::new(),
        })
    }

    /// Runs what `change` made of the jobs from now on — a whole config as a reload
    /// ([`Machine::reload`]), schedules in place ([`Machine::edit`]) — and persists the new
    /// starts.
    async fn apply(&mut self, change: Change, file: &Config, io: &mut Io<'_>) {
        match change {
            Change::Whole(config) => self.machine.reload(config, io.term.now()),
            Change::Schedules(edits) => self.machine.edit(edits, file, io.term.now()),
        }
        io.publisher.reconfigure(self.machine.config());
        while self.persist_starts_in_gaps(io).await {}
    }

    /// Persists the next slice of new jobs' starts ([`Machine::next_starts`]); returns whether
    /// any is left.
    async fn persist_starts_in_gaps(&mut self, io: &Io<'_>) -> bool {
        let Some(slice) = self.machine.next_starts() else {
            return false;
        };
        let saved = self.save(&slice, io).await;
        self.machine.starts_saved(&saved)
    }

    /// Leads until the term ends or `shutdown` completes. `Err` only when the broker refused
    /// the topology.
    async fn lead<F: Future<Output = ()>>(
        &mut self,
        (store, publisher, stats): (&Store, &mut Publisher, &BeatStats),
        (term, changes): (&mut Term, &mut Changes),
        shutdown: &mut Pin<&mut F>,
    ) -> Result<Ended, BrokerError> {
        loop {
            let publisher = &mut *publisher;
            let mut io = Io {
                store,
                publisher,
                stats,
                term,
            };
            match self.run_due(&mut io, shutdown).await? {
                Next::Shutdown => return Ok(Ended::Shutdown),
                // Nothing due for a while: a slice of the new starts, then look again.
                Next::Wait(wait)
                    if wait >= STARTS_GAP && self.persist_starts_in_gaps(&io).await => {}
                Next::Wait(wait) | Next::Backoff(wait) => tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    change = changes.next() => {
                        if let Some(change) = change {
                            self.apply(change, changes.file(), &mut io).await;
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

    /// Carries out what the machine says until the round ends (nothing due now, a backoff,
    /// the term not holding, shutdown). `Err` only when the broker refused the topology.
    /// Shutdown is looked at between batches, never inside one.
    async fn run_due<F: Future<Output = ()>>(
        &mut self,
        io: &mut Io<'_>,
        shutdown: &mut Pin<&mut F>,
    ) -> Result<Next, BrokerError> {
        self.read_paused(io.store).await;
        let mut stopping = false;
        loop {
            let holds = io.term.holds();
            // Re-read per batch: lateness is judged against the clock when a job is planned.
            let now = io.term.now();
            // A completed shutdown future must not be polled again: remembered.
            stopping = stopping || stop_asked(shutdown).await;
            match self.machine.poll(now, holds, stopping) {
                Do::FinishAll => {
                    let wait = self.finish_all(io).await;
                    if let Some(next) = after_finishing(stopping, wait) {
                        return Ok(next);
                    }
                }
                Do::Return(next) => return Ok(next),
                Do::Follow => {
                    self.follow(io).await?;
                    return Ok(self.machine.wait_after_follow(io.term.now()));
                }
                // Then round again, so a clock that moved meanwhile is looked at with the lease.
                Do::SleepPrecisely(early) => sleep_precisely(early).await,
                Do::Send => {
                    if let Some(next) = self.send_next(now, io).await? {
                        return Ok(next);
                    }
                }
            }
        }
    }

    /// Plans the batch due at `now`, journals its drops and writes its progress, sends its
    /// messages without awaiting a confirm, and finishes what the machine says. `Some` ends
    /// the round; `Err` only when the broker refused the topology, which needs a human.
    async fn send_next(
        &mut self,
        now: DateTime<Utc>,
        io: &mut Io<'_>,
    ) -> Result<Option<Next>, BrokerError> {
        let planned = self.machine.plan(now);
        journal::write(io.store, io.term, &planned.drops).await;
        let saved = self.save(&planned.save, io).await;
        let outgoing = self.machine.planned_saved(&saved, Utc::now());
        let term = io.term;
        let sending = match outgoing.is_empty() {
            true => Ok(None),
            false => {
                let sending = io
                    .publisher
                    .send_batch(outgoing, term.epoch, || term.holds());
                sending.await.map(Some)
            }
        };
        let session = io.publisher.session();
        let unsent = match sending {
            Ok(sending) => {
                self.sendings.push_back((sending, session));
                None
            }
            Err(e @ BrokerError::Mismatch { .. }) => {
                // The batches in flight were sent: their progress is written first.
                self.finish_all(io).await;
                return Err(e);
            }
            Err(e) => {
                self.sendings.push_back((None, session));
                Some(e)
            }
        };
        match self.machine.sent(unsent) {
            AfterSend::More => Ok(None),
            AfterSend::FinishAll => Ok(self.finish_all(io).await.map(Next::Backoff)),
            AfterSend::FinishOldest => {
                let Some(wait) = self.finish_oldest(io).await.flatten() else {
                    return Ok(None);
                };
                // Backing off: the batches sent meanwhile are finished first.
                let also = self.finish_all(io).await;
                Ok(Some(Next::Backoff(also.map_or(wait, |w| w.max(wait)))))
            }
        }
    }

    /// Finishes the oldest batch in flight: awaits its confirms (the batches sent after it and
    /// `returned` match the broker's returns across them, [`Publisher::confirms`]), journals
    /// what was published and writes the progress it made. `None` when none is in flight;
    /// else the backoff the machine asks, if any.
    async fn finish_oldest(&mut self, io: &mut Io<'_>) -> Option<Option<Duration>> {
        let (sending, session) = self.sendings.pop_front()?;
        let outcomes = match sending {
            Some(sending) => {
                let later = self.sendings.iter_mut().filter_map(|f| f.0.as_mut());
                let returned = &mut self.returned;
                io.publisher
                    .confirms((sending, session), returned, later)
                    .await
            }
            None => Vec::new(),
        };
        let confirmed = self.machine.confirmed(outcomes);
        journal::write(io.store, io.term, &confirmed.published).await;
        let saved = self.save(&confirmed.save, io).await;
        Some(self.machine.finished(&saved))
    }

    /// Finishes every batch in flight, oldest first; the longest backoff asked.
    async fn finish_all(&mut self, io: &mut Io<'_>) -> Option<Duration> {
        let mut wait: Option<Duration> = None;
        while let Some(asked) = self.finish_oldest(io).await {
            if let Some(w) = asked {
                wait = Some(wait.map_or(w, |v| v.max(w)));
            }
        }
        self.returned.clear();
        wait
    }

    /// Publishes or skips what it can of the `after` jobs' instances ([`follower::step`]) and
    /// persists their progress. `Err` only when the broker refused the topology.
    async fn follow(&mut self, io: &mut Io<'_>) -> Result<(), BrokerError> {
        let following = self.machine.following();
        let ctx = follower::Ctx {
            store: io.store,
            publisher: &mut *io.publisher,
            stats: io.stats,
            term: io.term,
            paused: following.paused,
            retention: following.retention,
        };
        let lasts = following.lasts;
        let (jobs, followers) = (following.jobs, following.followers);
        let moved = follower::step(jobs, followers, |i| lasts.get(i), ctx).await?;
        let which = self.machine.followed(moved);
        if which.is_empty() {
            return Ok(());
        }
        let saved = self.save(&which, io).await;
        if let Some(e) = saved.into_iter().flatten().next() {
            warn!(error = %e, "cannot persist the progress of `after` jobs yet; trying again");
        }
        Ok(())
    }

    /// Reads which jobs are paused (at every wake). When Redis does not answer, the last known
    /// set stays.
    async fn read_paused(&mut self, store: &Store) {
        match store.paused().await {
            Ok(paused) => self.machine.paused_seen(paused),
            Err(e) => warn!(error = %e, "cannot read the paused jobs; keeping the last known set"),
        }
    }

    /// Writes the progress of jobs `which` as the machine asks ([`Machine::writes`]: through
    /// [`progress::save`] and [`progress::start`], fenced by the term), hands Redis's answers
    /// back, ends the term when Redis says the lease is not ours, and journals the starts
    /// written. Returns each one's failure, if any, in `which` order.
    async fn save(&mut self, which: &[usize], io: &Io<'_>) -> Vec<Option<Arc<ProgressError>>> {
        let writes = self.machine.writes(which);
        let starts: Vec<(&str, DateTime<Utc>, &str)> = writes
            .starts
            .iter()
            .map(|(job, at, rule)| (*job, *at, rule.as_str()))
            .collect();
        let (token, max_ahead) = (io.term.token(), io.term.max_ahead());
        let moved = progress::save(io.store, token, max_ahead, &writes.progress).await;
        let started = progress::start(io.store, token, max_ahead, &starts).await;
        let saved = self.machine.saved(which, moved, started);
        if saved.deposed {
            io.term.deposed();
        }
        journal::write(io.store, io.term, &saved.started).await;
        saved.outcomes
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

/// Sleeps `d` (at most [`WAKE_EARLY`]) with the OS timer on a blocking thread: it wakes within
/// tens of microseconds, where tokio's timer rounds up to its next millisecond tick.
/// The schedules applied at run time, read whole (retrying while Redis fails), and the
/// changes to come ([`Changes`]); with the config to run.
async fn load_changes(
    file: Arc<Config>,
    store: &Store,
    hangups: Hangups,
) -> (Changes, Arc<Config>) {
    let mut hangups = hangups;
    loop {
        match Changes::load(file.clone(), store, hangups).await {
            Ok(changes) => return changes,
            Err((e, back)) => {
                warn!(error = %e, "cannot read the schedules applied at run time; trying again");
                hangups = back;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

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
