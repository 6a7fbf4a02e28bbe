//! `after` jobs (docs/design.md#job-dependencies): the leader publishes a follower's instance
//! for instant T once its upstream's instance for T is `done`, and records it `skipped`
//! (reason `upstream`) once that instance is dead, skipped or expired, or `after_timeout` has
//! passed after T without a success.
//!
//! Nothing here is remembered only in memory: what to do for T is decided from the upstream's
//! run record in Redis (written by the worker's own outcome script) and the clock, and the
//! follower's progress `{ns}:beat:last:{job}` moves past T only after the follower's message was
//! confirmed or its skip written. A leader killed anywhere in between leaves T undecided for
//! the next one, which decides it again from the same record: at worst it publishes T's
//! message twice (the worker's claim dedupes it by its key `job@T`). A worker killed between
//! its outcome and its ack changes nothing here: the outcome is in Redis or it is not.
//!
//! The decision ([`decide`]), which instants to look at ([`candidates`]) and how far progress
//! moves ([`settled_up_to`]) are pure; [`step`] carries them out.

use crate::leader::Term;
use crate::publisher::Publisher;
use crate::stats::BeatStats;
use chrono::{DateTime, Utc};
use drumline_shared::broker::BrokerError;
use drumline_shared::config::{Config, Job};
use drumline_shared::envelope::{format_instant, instance_key, Envelope};
use drumline_shared::schedule::Schedule;
use drumline_shared::store::{now_text, RunRecord, Skipped, Store};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;
use tracing::{info, warn};

/// Most instants of one follower looked at per step (oldest first); the rest wait their turn.
pub const PER_STEP: usize = 1000;

/// How long after an upstream instance's `expires_at` a missing run record counts as expired
/// (the worker judges expiry on its own clock).
pub const EXPIRY_MARGIN: Duration = Duration::from_secs(2);

/// What to do with a follower's instance now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Follow {
    /// The upstream succeeded: publish the instance.
    Publish,
    /// The upstream will not succeed in time: record the instance `skipped`.
    Skip(Why),
    /// Not decided yet: look again at the next step.
    Wait,
}

/// Why a follower's instance is skipped (the run record's `reason` is `upstream` for all but
/// [`Why::Paused`]; this detail goes in its `error`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The upstream's instance was dead-lettered.
    Dead,
    /// The upstream's instance was skipped (its own upstream, or its overlap policy).
    Skipped,
    /// The upstream's instance expired before it ran.
    Expired,
    /// `after_timeout` passed without a success.
    TimedOut,
    /// The follower itself is paused.
    Paused,
}

impl Why {
    /// The run record's `reason`.
    pub fn reason(self) -> &'static str {
        match self {
            Why::Paused => "paused",
            _ => "upstream",
        }
    }

    /// The run record's `error`: what happened upstream.
    fn detail(self, upstream_key: &str, timeout: Duration) -> String {
        match self {
            Why::Dead => format!("upstream {upstream_key} is dead"),
            Why::Skipped => format!("upstream {upstream_key} was skipped"),
            Why::Expired => format!("upstream {upstream_key} expired"),
            Why::TimedOut => format!(
                "upstream {upstream_key} did not succeed within after_timeout ({})",
                drumline_shared::duration::format(timeout)
            ),
            Why::Paused => "the job is paused".to_owned(),
        }
    }
}

/// The follower's instance for `instant` from the upstream's run `state` (`None`: no record)
/// at `now`, given the follower's `timeout` and the upstream's `expires`.
pub fn decide(
    state: Option<&str>,
    instant: DateTime<Utc>,
    now: DateTime<Utc>,
    timeout: Duration,
    upstream_expires: Option<Duration>,
) -> Follow {
    let passed = |d: Duration| chrono::Duration::from_std(d).is_ok_and(|d| now >= instant + d);
    match state {
        Some("done") => Follow::Publish,
        Some("dead") => Follow::Skip(Why::Dead),
        Some("skipped") => Follow::Skip(Why::Skipped),
        None if upstream_expires.is_some_and(|e| passed(e + EXPIRY_MARGIN)) => {
            Follow::Skip(Why::Expired)
        }
        _ if passed(timeout) => Follow::Skip(Why::TimedOut),
        _ => Follow::Wait,
    }
}

/// The follower's instants after `last` up to `now` not decided yet, oldest first, at most
/// `limit`.
pub fn candidates(
    schedule: &Schedule,
    last: DateTime<Utc>,
    decided: &BTreeSet<DateTime<Utc>>,
    now: DateTime<Utc>,
    limit: usize,
) -> Vec<DateTime<Utc>> {
    let mut out = Vec::new();
    let mut at = last;
    while out.len() < limit {
        match schedule.next_after(at) {
            Some(t) if t <= now => {
                if !decided.contains(&t) {
                    out.push(t);
                }
                at = t;
            }
            _ => break,
        }
    }
    out
}

/// How far the follower's progress may move from `last`: past every instant decided since,
/// up to the first one that is not; the decided instants passed are taken out of `decided`.
pub fn settled_up_to(
    schedule: &Schedule,
    last: DateTime<Utc>,
    decided: &mut BTreeSet<DateTime<Utc>>,
) -> DateTime<Utc> {
    let mut last = last;
    while let Some(t) = schedule.next_after(last) {
        if !decided.remove(&t) {
            break;
        }
        last = t;
    }
    // Anything at or before `last` is settled by the progress itself.
    decided.retain(|t| *t > last);
    last
}

/// What a leader knows about its followers for its term: each follower's upstream, and the
/// instants decided beyond its persisted progress (an instant held back by an older one still
/// waiting). Rebuilt for a new term or a reloaded config; losing it costs at most a duplicate
/// publish.
#[derive(Debug, Default)]
pub struct Followers {
    /// (follower, its upstream), as indexes into the config's jobs.
    links: Vec<(usize, usize)>,
    decided: HashMap<usize, BTreeSet<DateTime<Utc>>>,
}

impl Followers {
    /// The followers of `config` (none when no job has `after`).
    pub fn new(config: &Config) -> Self {
        let mut links = Vec::new();
        if config.jobs.iter().any(|j| j.after.is_some()) {
            let index: HashMap<&str, usize> = config
                .jobs
                .iter()
                .enumerate()
                .map(|(i, j)| (j.name.as_str(), i))
                .collect();
            for (i, job) in config.jobs.iter().enumerate() {
                if let Some(up) = job.after.as_ref().and_then(|a| index.get(&*a.upstream)) {
                    links.push((i, *up));
                }
            }
        }
        Followers {
            links,
            decided: HashMap::new(),
        }
    }

    /// Whether any job follows another.
    pub fn any(&self) -> bool {
        !self.links.is_empty()
    }

    /// The followers' job indexes.
    pub fn jobs(&self) -> impl Iterator<Item = usize> + '_ {
        self.links.iter().map(|(f, _)| *f)
    }
}

/// One follower instance under decision.
struct Pending {
    job: usize,
    upstream: usize,
    instant: DateTime<Utc>,
}

/// What [`step`] needs of the beat.
pub struct Ctx<'a> {
    /// The leader's store.
    pub store: &'a Store,
    /// The leader's publisher.
    pub publisher: &'a mut Publisher,
    /// Counters.
    pub stats: &'a BeatStats,
    /// The term it leads.
    pub term: &'a Term,
    /// Paused jobs.
    pub paused: &'a HashSet<String>,
    /// How long a skip is kept: the worker's `done_ttl`.
    pub retention: Duration,
}

/// Decides what it can of every follower's instants after `last(job)`; returns the followers
/// whose progress may move, with where to. `Err` only when the broker refused the topology.
pub async fn step(
    jobs: &[Job],
    followers: &mut Followers,
    last: impl Fn(usize) -> DateTime<Utc>,
    ctx: Ctx<'_>,
) -> Result<Vec<(usize, DateTime<Utc>)>, BrokerError> {
    let now = ctx.term.now();
    let mut pending = Vec::new();
    for (job, upstream) in followers.links.clone() {
        let decided = followers.decided.entry(job).or_default();
        for instant in candidates(&jobs[job].schedule, last(job), decided, now, PER_STEP) {
            pending.push(Pending {
                job,
                upstream,
                instant,
            });
        }
    }
    if !pending.is_empty() {
        decide_pending(jobs, followers, &pending, now, ctx).await?;
    }
    let mut moved = Vec::new();
    for (job, _) in &followers.links {
        let from = last(*job);
        let decided = followers.decided.entry(*job).or_default();
        let to = settled_up_to(&jobs[*job].schedule, from, decided);
        if to > from {
            moved.push((*job, to));
        }
    }
    Ok(moved)
}

/// Reads the upstream records of `pending`, then publishes what may run and records what is
/// skipped; marks each done so in `followers`.
async fn decide_pending(
    jobs: &[Job],
    followers: &mut Followers,
    pending: &[Pending],
    now: DateTime<Utc>,
    ctx: Ctx<'_>,
) -> Result<(), BrokerError> {
    let keys: Vec<String> = pending
        .iter()
        .map(|p| instance_key(&jobs[p.upstream].name, p.instant))
        .collect();
    let states = match ctx.store.run_states(&keys).await {
        Ok(states) => states,
        Err(e) => {
            warn!(error = %e, "cannot read the upstream instances of `after` jobs; trying again");
            return Ok(());
        }
    };
    let mut publish = Vec::new();
    let mut skip = Vec::new();
    for ((p, state), key) in pending.iter().zip(&states).zip(&keys) {
        let job = &jobs[p.job];
        let timeout = job.after.as_ref().map_or(Duration::ZERO, |a| a.timeout);
        let follow = if ctx.paused.contains(&job.name) {
            Follow::Skip(Why::Paused)
        } else {
            decide(
                state.as_deref(),
                p.instant,
                now,
                timeout,
                jobs[p.upstream].spec.expires,
            )
        };
        match follow {
            Follow::Publish => publish.push(p),
            Follow::Skip(why) => skip.push((p, why.reason(), why.detail(key, timeout))),
            Follow::Wait => {}
        }
    }
    publish_followers(
        jobs,
        followers,
        &publish,
        ctx.publisher,
        ctx.stats,
        ctx.term,
    )
    .await?;
    for (p, reason, detail) in skip {
        skip_one(jobs, followers, p, (reason, detail), &ctx).await;
    }
    Ok(())
}

/// Publishes the instances of `which` (confirmed); each confirmed one is decided.
async fn publish_followers(
    jobs: &[Job],
    followers: &mut Followers,
    which: &[&Pending],
    publisher: &mut Publisher,
    stats: &BeatStats,
    term: &Term,
) -> Result<(), BrokerError> {
    if which.is_empty() {
        return Ok(());
    }
    let envelopes: Vec<Envelope> = which
        .iter()
        .map(|p| {
            let job = &jobs[p.job];
            let expires_at = job
                .spec
                .expires
                .and_then(|e| chrono::Duration::from_std(e).ok())
                .map(|e| p.instant + e);
            let (name, task, queue) = (&job.name, &job.spec.task, &job.spec.queue);
            Envelope::scheduled(
                name,
                task,
                queue,
                job.spec.args.clone(),
                p.instant,
                expires_at,
                Utc::now(),
            )
        })
        .collect();
    let outcomes = match publisher
        .publish_batch(&envelopes, term.epoch, || term.holds())
        .await
    {
        Ok(outcomes) => outcomes,
        Err(e @ BrokerError::Mismatch { .. }) => return Err(e),
        Err(e) => {
            warn!(error = %e, "cannot publish `after` jobs' instances yet; trying again");
            return Ok(());
        }
    };
    for ((p, env), outcome) in which.iter().zip(&envelopes).zip(outcomes) {
        let job = &jobs[p.job].name;
        match outcome {
            Ok(()) => {
                stats.published(job);
                info!(job = %job, key = %env.key, "published (its upstream succeeded)");
                followers
                    .decided
                    .entry(p.job)
                    .or_default()
                    .insert(p.instant);
            }
            Err(e) => {
                warn!(job = %job, key = %env.key, error = %e, "not published yet; trying again")
            }
        }
    }
    Ok(())
}

/// Records one instance `skipped` (while this beat leads); decided once written, or when a
/// record exists already.
async fn skip_one(
    jobs: &[Job],
    followers: &mut Followers,
    p: &Pending,
    (reason, detail): (&str, String),
    ctx: &Ctx<'_>,
) {
    let job = &jobs[p.job].name;
    let key = instance_key(job, p.instant);
    let record = RunRecord {
        key: key.clone(),
        scheduled_for: format_instant(p.instant),
        status: "skipped".to_owned(),
        attempt: 0,
        worker: String::new(),
        started_at: None,
        finished_at: now_text(),
        error: Some(detail.clone()),
        reason: Some(reason.to_owned()),
    };
    let skipped = ctx
        .store
        .skip_follower(ctx.term.token(), job, &record, ctx.retention)
        .await;
    match skipped {
        Ok(Skipped::Recorded) => {
            info!(job = %job, key = %key, reason, detail = %detail, "skipped");
            followers
                .decided
                .entry(p.job)
                .or_default()
                .insert(p.instant);
        }
        Ok(Skipped::Known) => {
            followers
                .decided
                .entry(p.job)
                .or_default()
                .insert(p.instant);
        }
        Ok(Skipped::NotLeading) => ctx.term.deposed(),
        Err(e) => {
            warn!(job = %job, key = %key, error = %e, "cannot record the skip yet; trying again")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(s: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 3, 8, 7, 0, s).unwrap()
    }

    fn every2() -> Schedule {
        Schedule::Every {
            every: chrono::Duration::seconds(2),
            anchor: DateTime::UNIX_EPOCH,
        }
    }

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn a_success_publishes_a_failure_skips_and_the_rest_waits_until_the_timeout() {
        let t = at(10);
        assert_eq!(decide(Some("done"), t, at(59), S(5), None), Follow::Publish);
        assert_eq!(
            decide(Some("dead"), t, at(10), S(5), None),
            Follow::Skip(Why::Dead)
        );
        assert_eq!(
            decide(Some("skipped"), t, at(10), S(5), None),
            Follow::Skip(Why::Skipped)
        );
        for state in [None, Some("running"), Some("retrying")] {
            assert_eq!(
                decide(state, t, at(14), S(5), None),
                Follow::Wait,
                "{state:?}"
            );
            assert_eq!(
                decide(state, t, at(15), S(5), None),
                Follow::Skip(Why::TimedOut),
                "{state:?}"
            );
        }
        // A success that comes late still runs the follower if it is seen first.
        assert_eq!(decide(Some("done"), t, at(50), S(5), None), Follow::Publish);
    }

    #[test]
    fn an_upstream_that_expired_unrun_skips_before_the_timeout() {
        let t = at(10);
        // expires 3 s: no record 5 s (3 + margin) after the instant means it never ran.
        assert_eq!(decide(None, t, at(14), S(60), Some(S(3))), Follow::Wait);
        assert_eq!(
            decide(None, t, at(15), S(60), Some(S(3))),
            Follow::Skip(Why::Expired)
        );
        // A run that started before its deadline is waited for.
        assert_eq!(
            decide(Some("running"), t, at(15), S(60), Some(S(3))),
            Follow::Wait
        );
        assert_eq!(Why::Expired.reason(), "upstream");
        assert_eq!(Why::Paused.reason(), "paused");
    }

    #[test]
    fn candidates_are_the_undecided_instants_up_to_now() {
        let decided: BTreeSet<_> = [at(4)].into();
        assert_eq!(
            candidates(&every2(), at(0), &decided, at(7), 10),
            vec![at(2), at(6)]
        );
        assert_eq!(
            candidates(&every2(), at(0), &decided, at(7), 1),
            vec![at(2)]
        );
        assert!(candidates(&every2(), at(6), &decided, at(7), 10).is_empty());
    }

    #[test]
    fn progress_moves_over_the_decided_prefix_only() {
        let mut decided: BTreeSet<_> = [at(4), at(6), at(10)].into();
        // 2 is still waiting: nothing moves.
        assert_eq!(settled_up_to(&every2(), at(0), &mut decided), at(0));
        assert_eq!(decided.len(), 3);
        decided.insert(at(2));
        assert_eq!(settled_up_to(&every2(), at(0), &mut decided), at(6));
        assert_eq!(decided, [at(10)].into());
    }
}
