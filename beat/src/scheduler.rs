//! When to publish what (DESIGN §2). The decision is pure — [`plan`] takes the job, the last
//! decided instant and `now` — so misfire policies are tested on fixed instants; [`run`] is the
//! loop that feeds it the wall clock, publishes, and persists progress after each confirm.

use crate::publisher::{PublishError, Publisher};
use chrono::{DateTime, Utc};
use drumline_shared::config::{Config, Job, Misfire};
use drumline_shared::envelope::{instance_key, Envelope};
use drumline_shared::names::Names;
use drumline_shared::store::Store;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::time::Duration;
use tracing::{error, info, warn};

/// Most due instants one planning step enumerates; beyond that (a 1-second job down for days)
/// the oldest are dropped in bulk and reported as one count.
pub const MAX_ENUMERATED: usize = 100_000;

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

/// What to do with the instants in `(last, now]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Publish these, oldest first.
    pub publish: Vec<DateTime<Utc>>,
    /// Do not publish these (each is logged with its key and counted).
    pub dropped: Vec<(DateTime<Utc>, Dropped)>,
    /// Due instants not even enumerated (beyond [`MAX_ENUMERATED`]); all dropped.
    pub dropped_uncounted: bool,
    /// The newest instant decided: persisted once everything before it is published.
    pub decided_up_to: Option<DateTime<Utc>>,
}

/// Decides the instants of `job` in `(last, now]`. An instant is *missed* when `now` is more than
/// `threshold` past it; missed ones follow the job's `misfire` policy, and those more than
/// `misfire_grace` old are never published.
pub fn plan(job: &Job, last: DateTime<Utc>, now: DateTime<Utc>, threshold: Duration) -> Plan {
    let mut due = Vec::new();
    let mut cursor = last;
    let mut truncated = false;
    while let Some(t) = job.schedule.next_after(cursor) {
        if t > now {
            break;
        }
        if due.len() == MAX_ENUMERATED {
            // Keep the newest window: drop the oldest half and go on.
            due.drain(..MAX_ENUMERATED / 2);
            truncated = true;
        }
        due.push(t);
        cursor = t;
    }
    let mut plan = Plan {
        decided_up_to: due.last().copied(),
        dropped_uncounted: truncated,
        ..Plan::default()
    };
    let threshold = chrono::Duration::from_std(threshold).unwrap_or(chrono::Duration::MAX);
    let grace = chrono::Duration::from_std(job.misfire_grace).unwrap_or(chrono::Duration::MAX);
    let (missed, on_time): (Vec<_>, Vec<_>) = due.into_iter().partition(|t| now - *t > threshold);
    let (stale, missed): (Vec<_>, Vec<_>) = missed.into_iter().partition(|t| now - *t > grace);
    plan.dropped
        .extend(stale.into_iter().map(|t| (t, Dropped::PastGrace)));
    let keep = match job.misfire {
        Misfire::RunOnce => 1,
        Misfire::CatchUp => job.max_catch_up,
        Misfire::Skip => 0,
    };
    let split = missed.len().saturating_sub(keep);
    plan.dropped.extend(
        missed[..split]
            .iter()
            .map(|t| (*t, Dropped::Policy(job.misfire))),
    );
    plan.publish.extend_from_slice(&missed[split..]);
    plan.publish.extend(on_time);
    if let Some(expires) = job.expires.and_then(|e| chrono::Duration::from_std(e).ok()) {
        let (live, expired): (Vec<_>, Vec<_>) =
            plan.publish.into_iter().partition(|t| *t + expires > now);
        plan.publish = live;
        plan.dropped
            .extend(expired.into_iter().map(|t| (t, Dropped::Expired)));
    }
    plan.dropped.sort_by_key(|(t, _)| *t);
    plan
}

/// Counters the beat keeps.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BeatStats {
    /// Instances published and confirmed.
    pub published: u64,
    /// Instances decided not to publish.
    pub dropped: u64,
    /// Publish attempts that failed (retried).
    pub publish_failures: u64,
}

/// Per-job progress.
struct JobState {
    /// Newest instant decided (published or dropped); never moves back.
    last: DateTime<Utc>,
    /// The first instant after `last`, if any.
    next: Option<DateTime<Utc>>,
}

/// Runs the beat until `shutdown` completes.
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
    let start = Utc::now();
    let mut states = Vec::with_capacity(config.jobs.len());
    for job in &config.jobs {
        let last = loop {
            match store.last_published(&job.name).await {
                Ok(last) => break last.unwrap_or(start),
                Err(e) => {
                    error!(job = %job.name, error = %e, "cannot read the job's progress from redis; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = &mut shutdown => return Ok(stats),
                    }
                }
            }
        };
        states.push(JobState {
            last,
            next: job.schedule.next_after(last),
        });
    }
    let mut queue: BinaryHeap<Reverse<(DateTime<Utc>, usize)>> = states
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.next.map(|n| Reverse((n, i))))
        .collect();
    info!(jobs = config.jobs.len(), namespace = %config.namespace, "beat started");

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

    let mut retry_backoff = Duration::from_millis(200);
    loop {
        let now = Utc::now();
        // Wake at the next due instant, but at least once a second to notice wall-clock jumps.
        let mut wait = Duration::from_secs(1);
        while let Some(Reverse((due, i))) = queue.peek().copied() {
            if due > now {
                wait = wait.min((due - now).to_std().unwrap_or_default());
                break;
            }
            queue.pop();
            let job = &config.jobs[i];
            let state = &mut states[i];
            match advance(
                job,
                state,
                now,
                &config,
                &store,
                &mut publisher,
                &mut stats,
                epoch,
            )
            .await
            {
                Ok(()) => {
                    retry_backoff = Duration::from_millis(200);
                    if let Some(next) = state.next {
                        queue.push(Reverse((next, i)));
                    }
                }
                Err(e) => {
                    stats.publish_failures += 1;
                    warn!(job = %job.name, error = %e, retry_in_ms = retry_backoff.as_millis() as u64, "publish failed; will retry");
                    if let PublishError::Topology(_) = e {
                        return Err(e);
                    }
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
        "beat stopped"
    );
    Ok(stats)
}

/// Publishes what is due for one job and moves its progress forward.
#[allow(clippy::too_many_arguments)]
async fn advance(
    job: &Job,
    state: &mut JobState,
    now: DateTime<Utc>,
    config: &Config,
    store: &Store,
    publisher: &mut Publisher,
    stats: &mut BeatStats,
    epoch: u64,
) -> Result<(), PublishError> {
    let plan = plan(job, state.last, now, config.beat.misfire_threshold);
    if plan.dropped_uncounted {
        warn!(job = %job.name, "more than {MAX_ENUMERATED} instances were due; the oldest were dropped uncounted");
    }
    // Drops are decided first (they are all older than anything published after them... except
    // expired ones, which never publish anyway), so report them now.
    for (t, why) in &plan.dropped {
        stats.dropped += 1;
        warn!(job = %job.name, key = %instance_key(&job.name, *t), reason = why.reason(), "instance not published");
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
        persist(store, &job.name, state.last).await;
    }
    if let Some(decided) = plan.decided_up_to {
        if decided > state.last {
            state.last = decided;
            persist(store, &job.name, decided).await;
        }
    }
    state.next = job.schedule.next_after(state.last);
    Ok(())
}

/// Records progress; a failure is logged, not fatal: the in-memory position stops this beat
/// from republishing, and after a restart dedupe absorbs a republished instance.
async fn persist(store: &Store, job: &str, at: DateTime<Utc>) {
    if let Err(e) = store.advance_last_published(job, at).await {
        warn!(job, error = %e, "cannot persist the last published instant");
    }
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
