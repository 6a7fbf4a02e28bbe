//! `after` jobs (docs/design.md#job-dependencies): the leader publishes a follower's instance
//! for instant T once its upstream's instance for T is `done`, and records it `skipped`
//! (reason `upstream`) once that instance is dead, skipped or expired, was never published
//! (paused, dropped by the misfire policy), or `after_timeout` has passed without a success.
//! Expiry and `after_timeout` count from T's jittered time: T plus the root's jitter offset
//! (docs/design.md#jitter), when the root's instance is published.
//!
//! Nothing here is remembered only in memory but the upstream instants this term dropped (a
//! new leader that does not know of them skips their followers at the expiry or the timeout
//! instead): what to do for T is decided from the upstream's
//! run record in Redis (written by the worker's own outcome script) and the clock, and the
//! follower's progress `{ns}:beat:last:{job}` moves past T only after the follower's message was
//! confirmed or its skip written. A leader killed anywhere in between leaves T undecided for
//! the next one, which decides it again from the same record: at worst it publishes T's
//! message twice (the worker's claim dedupes it by its key `job@T`). A worker killed between
//! its outcome and its ack changes nothing here: the outcome is in Redis or it is not.
//!
//! The decision ([`decide`]), which instants to look at ([`candidates`]) and how far progress
//! moves ([`settled_up_to`]) are pure, and so is a step's deciding over all the followers
//! (`Followers::pending`, `verdicts`, `Followers::moved`); [`step`] only carries it out.

use crate::leader::Term;
use crate::misfire::{Dropped, Plan};
use crate::publisher::Publisher;
use crate::stats::BeatStats;
use chrono::{DateTime, TimeDelta, Utc};
use drumline_shared::broker::BrokerError;
use drumline_shared::config::{Config, Job};
use drumline_shared::envelope::{format_instant, instance_key, Envelope};
use drumline_shared::planted::{planted, Defect};
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
    /// The leader did not publish the upstream's instance (paused, misfire policy, expired).
    NotPublished(Dropped),
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
            Why::NotPublished(why) => {
                format!(
                    "upstream {upstream_key} was not published: {}",
                    why.reason()
                )
            }
            Why::TimedOut => format!(
                "upstream {upstream_key} did not succeed within after_timeout ({})",
                drumline_shared::duration::format(timeout)
            ),
            Why::Paused => "the job is paused".to_owned(),
        }
    }
}

/// What is known of an upstream's instance for one instant.
#[derive(Debug, Clone, Copy)]
pub struct Upstream<'a> {
    /// Its run state (`None`: no record).
    pub state: Option<&'a str>,
    /// When it is due: the instant plus the root's jitter offset (docs/design.md#jitter).
    pub due: DateTime<Utc>,
    /// The upstream's `expires`, counted from `due`.
    pub expires: Option<Duration>,
    /// Why this term's leader did not publish it, if it dropped it.
    pub dropped: Option<Dropped>,
}

/// The follower's instance for the `upstream`'s instance at `now`, given the follower's
/// `timeout` (counted from the upstream's `due`).
pub fn decide(upstream: Upstream<'_>, now: DateTime<Utc>, timeout: Duration) -> Follow {
    let due = upstream.due;
    let passed = |d: Duration| TimeDelta::from_std(d).is_ok_and(|d| now >= due + d);
    match (upstream.state, upstream.dropped) {
        (Some("done"), _) => Follow::Publish,
        (Some(_), _) if planted(Defect::EarlyFollower) => Follow::Publish,
        (Some("dead"), _) => Follow::Skip(Why::Dead),
        (Some("skipped"), _) => Follow::Skip(Why::Skipped),
        // Never published: nothing will run it (a backfill later runs it alone).
        (None, Some(why)) => Follow::Skip(Why::NotPublished(why)),
        (None, None) if upstream.expires.is_some_and(|e| passed(e + EXPIRY_MARGIN)) => {
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

/// What a reload at `at` leaves a restarted follower to decide (docs/design.md#job-dependencies):
/// for each follower of `new` that does not keep its progress (`kept[i]` is `None`: its root
/// was rescheduled) and followed under the old config too, the instants of its old rule after
/// its old progress (`old_last`) up to `at`, at most [`PER_STEP`]: a chain in flight when the
/// root was rescheduled still decides them.
pub fn carried_over(
    (old, old_last): (&[Job], &dyn Fn(usize) -> DateTime<Utc>),
    new: &[Job],
    kept: &[Option<usize>],
    at: DateTime<Utc>,
) -> Vec<(usize, Vec<DateTime<Utc>>)> {
    let by_name: HashMap<&str, usize> = old
        .iter()
        .enumerate()
        .filter(|(_, j)| j.after.is_some())
        .map(|(i, j)| (j.name.as_str(), i))
        .collect();
    new.iter()
        .zip(kept)
        .enumerate()
        .filter(|(_, (job, kept))| job.after.is_some() && kept.is_none())
        .filter_map(|(i, (job, _))| {
            let o = *by_name.get(job.name.as_str())?;
            Some((i, old_rule_instants(&old[o].schedule, old_last(o), at)))
        })
        .collect()
}

/// A restarted follower's instants of its old rule (`old`) after its old progress (`last`) up
/// to `at`, at most [`PER_STEP`]: on a reload ([`carried_over`]), or when a beat takes over a
/// follower rescheduled since its progress was recorded.
pub fn old_rule_instants(
    old: &Schedule,
    last: DateTime<Utc>,
    at: DateTime<Utc>,
) -> Vec<DateTime<Utc>> {
    candidates(old, last, &BTreeSet::new(), at, PER_STEP)
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

/// A follower's link: indexes into the config's jobs, and its root's jitter offset.
#[derive(Debug, Clone, Copy)]
struct Link {
    follower: usize,
    upstream: usize,
    /// How late the root publishes each instant: expiry and timeouts count from then.
    offset: TimeDelta,
}

/// Instants of an upstream this term's leader dropped: `first..=last` of its schedule.
#[derive(Debug, Clone, Copy)]
struct DroppedSpan {
    first: DateTime<Utc>,
    last: DateTime<Utc>,
    why: Dropped,
}

/// What a leader knows about its followers for its term: each follower's upstream, the
/// instants decided beyond its persisted progress (an instant held back by an older one still
/// waiting), and the upstream instants it dropped. Rebuilt for a new term or a reloaded
/// config; losing it costs at most a duplicate publish, or a skip that waits for the expiry
/// or the timeout.
#[derive(Debug, Default)]
pub struct Followers {
    links: Vec<Link>,
    /// The jobs some job follows.
    upstreams: HashSet<usize>,
    decided: HashMap<usize, BTreeSet<DateTime<Utc>>>,
    /// Per upstream, what it dropped that a follower may not have decided yet.
    dropped: HashMap<usize, Vec<DroppedSpan>>,
    /// Per follower, instants of the rule before a reload that it has not decided yet
    /// ([`carried_over`]): decided like the others, whatever its progress says.
    carried: HashMap<usize, BTreeSet<DateTime<Utc>>>,
}

impl Followers {
    /// The followers of `config` (none when no job has `after`).
    pub fn new(config: &Config) -> Self {
        let mut followers = Followers::default();
        if config.jobs.iter().all(|j| j.after.is_none()) {
            return followers;
        }
        let index: HashMap<&str, usize> = config
            .jobs
            .iter()
            .enumerate()
            .map(|(i, j)| (j.name.as_str(), i))
            .collect();
        let upstream_of = |i: usize| -> Option<usize> {
            index
                .get(&*config.jobs[i].after.as_ref()?.upstream)
                .copied()
        };
        for follower in 0..config.jobs.len() {
            let Some(upstream) = upstream_of(follower) else {
                continue;
            };
            // The checked config has no cycles: the walk ends at the root.
            let mut root = upstream;
            while let Some(up) = upstream_of(root) {
                root = up;
            }
            let offset = config.jobs[root].jitter_offset();
            followers.links.push(Link {
                follower,
                upstream,
                offset,
            });
            followers.upstreams.insert(upstream);
        }
        followers
    }

    /// Hands follower `job` the `instants` of its rule before a reload still to decide.
    pub fn carry(&mut self, job: usize, instants: Vec<DateTime<Utc>>) {
        if !instants.is_empty() {
            self.carried.entry(job).or_default().extend(instants);
        }
    }

    /// Hands the instants `old` (the followers before a reload) still carried, and had not
    /// decided, to the same followers here, by name: a change of the config before a chain
    /// carried over was decided (another reload, a schedule applied at run time) keeps it.
    pub fn carry_on(&mut self, old: &Followers, old_jobs: &[Job], jobs: &[Job]) {
        if old.carried.is_empty() {
            return;
        }
        let by_name: HashMap<&str, usize> = jobs
            .iter()
            .enumerate()
            .filter(|(_, j)| j.after.is_some())
            .map(|(i, j)| (j.name.as_str(), i))
            .collect();
        for (o, instants) in &old.carried {
            let Some(i) = by_name.get(old_jobs[*o].name.as_str()) else {
                continue;
            };
            let decided = old.decided.get(o);
            let open = instants
                .iter()
                .filter(|t| decided.is_none_or(|d| !d.contains(t)));
            self.carry(*i, open.copied().collect());
        }
    }

    /// Forgets the carried instants decided meanwhile.
    fn settle_carried(&mut self) {
        for (job, instants) in &mut self.carried {
            if let Some(decided) = self.decided.get(job) {
                instants.retain(|t| !decided.contains(t));
            }
        }
        self.carried.retain(|_, instants| !instants.is_empty());
    }

    /// Whether any job follows another.
    pub fn any(&self) -> bool {
        !self.links.is_empty()
    }

    /// The followers' job indexes.
    pub fn jobs(&self) -> impl Iterator<Item = usize> + '_ {
        self.links.iter().map(|l| l.follower)
    }

    /// Notes the instants `job`'s `plan` drops (it publishes none of them), when some job
    /// follows it: their followers are skipped at the next step.
    pub fn upstream_dropped(&mut self, job: usize, plan: &Plan) {
        if !self.upstreams.contains(&job) {
            return;
        }
        let spans = self.dropped.entry(job).or_default();
        for (t, why) in &plan.dropped {
            spans.push(DroppedSpan {
                first: *t,
                last: *t,
                why: *why,
            });
        }
        let more = &plan.unlisted;
        if let (Some(first), Some(last)) = (more.first, more.last) {
            // Past the counted ones, a long cron walk drops up to `dropped_up_to` uncounted.
            let last = plan.dropped_up_to.map_or(last, |d| d.max(last));
            let why = more.reasons.first().map_or(Dropped::PastGrace, |r| r.0);
            spans.push(DroppedSpan { first, last, why });
        }
    }

    /// Why `upstream`'s instance at `instant` was dropped, if this term dropped it.
    fn dropped(&self, upstream: usize, instant: DateTime<Utc>) -> Option<Dropped> {
        let spans = self.dropped.get(&upstream)?;
        spans
            .iter()
            .find(|s| s.first <= instant && instant <= s.last)
            .map(|s| s.why)
    }

    /// Forgets the drops every follower of their upstream has moved past.
    fn forget_dropped(&mut self, last: impl Fn(usize) -> DateTime<Utc>) {
        let mut oldest: HashMap<usize, DateTime<Utc>> = HashMap::new();
        for link in &self.links {
            let at = last(link.follower);
            oldest
                .entry(link.upstream)
                .and_modify(|o| *o = (*o).min(at))
                .or_insert(at);
        }
        for (upstream, spans) in &mut self.dropped {
            let settled = oldest.get(upstream).copied();
            spans.retain(|s| settled.is_some_and(|o| s.last > o));
        }
        self.dropped.retain(|_, spans| !spans.is_empty());
    }
}

/// One follower instance under decision.
struct Pending {
    link: Link,
    instant: DateTime<Utc>,
}

impl Pending {
    /// When the instant is due: published by its root (docs/design.md#jitter).
    fn due(&self) -> DateTime<Utc> {
        self.instant + self.link.offset
    }
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
/// The deciding is [`Followers`]'s (pure); this reads the upstreams' records, publishes and
/// records the skips.
pub async fn step(
    jobs: &[Job],
    followers: &mut Followers,
    last: impl Fn(usize) -> DateTime<Utc>,
    ctx: Ctx<'_>,
) -> Result<Vec<(usize, DateTime<Utc>)>, BrokerError> {
    let now = ctx.term.now();
    let pending = followers.pending(jobs, &last, now);
    if !pending.is_empty() {
        decide_pending(jobs, followers, &pending, now, ctx).await?;
        followers.settle_carried();
    }
    Ok(followers.moved(jobs, &last))
}

impl Followers {
    /// The instances to decide at `now`: each follower's undecided instants after its progress
    /// (`last`) and the instants carried over to it, at most [`PER_STEP`] of each.
    fn pending(
        &mut self,
        jobs: &[Job],
        last: impl Fn(usize) -> DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Vec<Pending> {
        let mut pending = Vec::new();
        for link in self.links.clone() {
            let job = link.follower;
            let decided = self.decided.entry(job).or_default();
            for instant in candidates(&jobs[job].schedule, last(job), decided, now, PER_STEP) {
                pending.push(Pending { link, instant });
            }
            let carried = self.carried.get(&job).into_iter().flatten();
            for instant in carried.take(PER_STEP).copied() {
                pending.push(Pending { link, instant });
            }
        }
        pending
    }

    /// Notes `p` decided (published and confirmed, or its skip recorded).
    fn decided(&mut self, p: &Pending) {
        let decided = self.decided.entry(p.link.follower).or_default();
        decided.insert(p.instant);
    }

    /// The followers whose progress may move past what they decided, with where to; forgets
    /// the drops every follower has moved past.
    fn moved(
        &mut self,
        jobs: &[Job],
        last: impl Fn(usize) -> DateTime<Utc>,
    ) -> Vec<(usize, DateTime<Utc>)> {
        let mut moved = Vec::new();
        for link in &self.links {
            let (job, from) = (link.follower, last(link.follower));
            let decided = self.decided.entry(job).or_default();
            let to = settled_up_to(&jobs[job].schedule, from, decided);
            if to > from {
                moved.push((job, to));
            }
        }
        self.forget_dropped(|job| {
            moved
                .iter()
                .find(|(j, _)| *j == job)
                .map_or_else(|| last(job), |(_, to)| *to)
        });
        moved
    }
}

/// What to do with `p` now, its upstream's run state being `state`.
fn judge(
    jobs: &[Job],
    followers: &Followers,
    p: &Pending,
    state: Option<&str>,
    (now, paused): (DateTime<Utc>, &HashSet<String>),
) -> Follow {
    let job = &jobs[p.link.follower];
    if paused.contains(&job.name) {
        return Follow::Skip(Why::Paused);
    }
    let upstream = Upstream {
        state,
        due: p.due(),
        expires: jobs[p.link.upstream].spec.expires,
        dropped: followers.dropped(p.link.upstream, p.instant),
    };
    decide(upstream, now, timeout_of(job))
}

/// A follower's `after_timeout`.
fn timeout_of(job: &Job) -> Duration {
    job.after.as_ref().map_or(Duration::ZERO, |a| a.timeout)
}

/// The instances to publish, and the ones to skip with the reason and detail of their record.
type Verdicts<'p> = (Vec<&'p Pending>, Vec<(&'p Pending, &'static str, String)>);

/// What to do with each of `pending` at `now`, its upstream's run state being `states`' (in
/// order; `keys` are the upstream instances'); the ones neither published nor skipped wait.
fn verdicts<'p>(
    jobs: &[Job],
    followers: &Followers,
    (pending, states, keys): (&'p [Pending], &[Option<String>], &[String]),
    (now, paused): (DateTime<Utc>, &HashSet<String>),
) -> Verdicts<'p> {
    let mut publish = Vec::new();
    let mut skip = Vec::new();
    for ((p, state), key) in pending.iter().zip(states).zip(keys) {
        let timeout = timeout_of(&jobs[p.link.follower]);
        match judge(jobs, followers, p, state.as_deref(), (now, paused)) {
            Follow::Publish => publish.push(p),
            Follow::Skip(why) => skip.push((p, why.reason(), why.detail(key, timeout))),
            Follow::Wait => {}
        }
    }
    (publish, skip)
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
        .map(|p| instance_key(&jobs[p.link.upstream].name, p.instant))
        .collect();
    let states = match ctx.store.run_states(&keys).await {
        Ok(states) => states,
        Err(e) => {
            warn!(error = %e, "cannot read the upstream instances of `after` jobs; trying again");
            return Ok(());
        }
    };
    let at = (now, ctx.paused);
    let (publish, skip) = verdicts(jobs, followers, (pending, &states, &keys), at);
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
        .map(|p| envelope(&jobs[p.link.follower], p))
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
        let job = &jobs[p.link.follower].name;
        match outcome {
            Ok(()) => {
                stats.published(job);
                info!(job = %job, key = %env.key, "published (its upstream succeeded)");
                followers.decided(p);
            }
            Err(e) => {
                warn!(job = %job, key = %env.key, error = %e, "not published yet; trying again")
            }
        }
    }
    Ok(())
}

/// The message of follower `job`'s pending instance `p`: `expires` counts from the instant's
/// jittered time, as the root's does.
fn envelope(job: &Job, p: &Pending) -> Envelope {
    let expires_at = job
        .spec
        .expires
        .and_then(|e| TimeDelta::from_std(e).ok())
        .map(|e| p.due() + e);
    Envelope::of_job(job, p.instant, expires_at, Utc::now())
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
    let job = &jobs[p.link.follower].name;
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
            followers.decided(p);
        }
        Ok(Skipped::Known) => followers.decided(p),
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

    /// The upstream's instance at `t` in `state`, due at `t` (no jitter), with `expires`.
    fn up(state: Option<&str>, t: DateTime<Utc>, expires: Option<Duration>) -> Upstream<'_> {
        Upstream {
            state,
            due: t,
            expires,
            dropped: None,
        }
    }

    #[test]
    fn a_success_publishes_a_failure_skips_and_the_rest_waits_until_the_timeout() {
        let t = at(10);
        let decide_at = |state, now| decide(up(state, t, None), now, S(5));
        assert_eq!(decide_at(Some("done"), at(59)), Follow::Publish);
        assert_eq!(decide_at(Some("dead"), at(10)), Follow::Skip(Why::Dead));
        assert_eq!(
            decide_at(Some("skipped"), at(10)),
            Follow::Skip(Why::Skipped)
        );
        for state in [None, Some("running"), Some("retrying")] {
            assert_eq!(decide_at(state, at(14)), Follow::Wait, "{state:?}");
            assert_eq!(
                decide_at(state, at(15)),
                Follow::Skip(Why::TimedOut),
                "{state:?}"
            );
        }
        // A success that comes late still runs the follower if it is seen first.
        assert_eq!(decide_at(Some("done"), at(50)), Follow::Publish);
    }

    #[test]
    fn an_upstream_that_expired_unrun_skips_before_the_timeout() {
        let t = at(10);
        // expires 3 s: no record 5 s (3 + margin) after the instant means it never ran.
        let three = Some(S(3));
        assert_eq!(decide(up(None, t, three), at(14), S(60)), Follow::Wait);
        assert_eq!(
            decide(up(None, t, three), at(15), S(60)),
            Follow::Skip(Why::Expired)
        );
        // A run that started before its deadline is waited for.
        assert_eq!(
            decide(up(Some("running"), t, three), at(15), S(60)),
            Follow::Wait
        );
        assert_eq!(Why::Expired.reason(), "upstream");
        assert_eq!(Why::Paused.reason(), "paused");
    }

    #[test]
    fn expiry_and_timeout_count_from_the_jittered_time() {
        // Instant 10, published 8 s late: neither a 3 s expiry nor a 5 s timeout has passed
        // 2 s after the instant was due.
        let jittered = |state| Upstream {
            due: at(18),
            ..up(state, at(10), Some(S(3)))
        };
        assert_eq!(decide(jittered(None), at(20), S(5)), Follow::Wait);
        assert_eq!(
            decide(jittered(None), at(23), S(60)),
            Follow::Skip(Why::Expired)
        );
        assert_eq!(
            decide(jittered(Some("running")), at(22), S(5)),
            Follow::Wait
        );
        assert_eq!(
            decide(jittered(Some("running")), at(23), S(5)),
            Follow::Skip(Why::TimedOut)
        );
    }

    #[test]
    fn an_upstream_instance_the_leader_dropped_skips_at_once_unless_it_ran() {
        let dropped = |state| Upstream {
            dropped: Some(Dropped::Paused),
            ..up(state, at(10), None)
        };
        let skip = Follow::Skip(Why::NotPublished(Dropped::Paused));
        assert_eq!(decide(dropped(None), at(10), S(60)), skip);
        assert_eq!(Why::NotPublished(Dropped::Paused).reason(), "upstream");
        // A backfill ran it meanwhile: its record decides.
        assert_eq!(
            decide(dropped(Some("done")), at(10), S(60)),
            Follow::Publish
        );
        assert_eq!(
            decide(dropped(Some("running")), at(10), S(60)),
            Follow::Wait
        );
    }

    fn chain(every_a: &str) -> Vec<Job> {
        let text = format!(
            "[tasks.t]\ncommand = [\"/bin/true\"]\n\
             [[jobs]]\nname = \"a\"\ntask = \"t\"\nevery = \"{every_a}\"\n\
             [[jobs]]\nname = \"b\"\ntask = \"t\"\nafter = \"a\"\n\
             [[jobs]]\nname = \"c\"\ntask = \"t\"\nafter = \"b\"\n"
        );
        Config::parse(&text, std::path::Path::new("d.toml"), |_| None)
            .unwrap()
            .jobs
    }

    /// Issue 33: the root rescheduled by a reload at 00:09 restarts its followers (their
    /// schedule is its); each keeps its old rule's instants after its progress to decide.
    #[test]
    fn a_reload_of_the_root_carries_the_followers_undecided_instants_over() {
        let (old, new) = (chain("2s"), chain("3s"));
        let kept = crate::reload::carried(&old, &new);
        assert_eq!(
            kept,
            [None, None, None],
            "the chain follows its root's schedule"
        );
        let progress = |o: usize| if o == 1 { at(4) } else { at(2) };
        let carried = carried_over((&old, &progress), &new, &kept, at(9));
        assert_eq!(
            carried,
            [(1, vec![at(6), at(8)]), (2, vec![at(4), at(6), at(8)])]
        );
        // A follower that keeps its progress carries nothing.
        let same = chain("2s");
        let kept = crate::reload::carried(&old, &same);
        assert!(carried_over((&old, &progress), &same, &kept, at(9)).is_empty());
        let mut followers = Followers::new(&Config::parse(
            "[tasks.t]\ncommand = [\"/bin/true\"]\n[[jobs]]\nname = \"a\"\ntask = \"t\"\nevery = \"3s\"\n[[jobs]]\nname = \"b\"\ntask = \"t\"\nafter = \"a\"\n",
            std::path::Path::new("d.toml"),
            |_| None,
        )
        .unwrap());
        followers.carry(1, vec![at(6), at(8)]);
        followers.decided.entry(1).or_default().insert(at(6));
        followers.settle_carried();
        assert_eq!(followers.carried[&1], BTreeSet::from([at(8)]));
    }

    /// The checker's seed 901: a second change of the config (here the same chain, every
    /// follower kept) before the carried instants were decided hands them on, those decided
    /// meanwhile aside.
    #[test]
    fn a_second_change_keeps_what_the_reload_carried_over() {
        let (old, new) = (chain("2s"), chain("3s"));
        let config = |jobs: Vec<Job>| Config {
            jobs,
            ..Config::parse("", std::path::Path::new("d.toml"), |_| None).unwrap()
        };
        let mut before = Followers::new(&config(new.clone()));
        before.carry(1, vec![at(6), at(8)]);
        before.carry(2, vec![at(4)]);
        before.decided.entry(1).or_default().insert(at(6));
        let mut after = Followers::new(&config(new.clone()));
        after.carry_on(&before, &new, &new);
        assert_eq!(after.carried[&1], BTreeSet::from([at(8)]));
        assert_eq!(after.carried[&2], BTreeSet::from([at(4)]));
        let mut unrelated = Followers::new(&config(old.clone()));
        unrelated.carry_on(&Followers::new(&config(old.clone())), &old, &old);
        assert!(unrelated.carried.is_empty());
    }

    #[test]
    fn drops_are_noted_for_upstreams_only_and_forgotten_once_passed() {
        let config = Config::parse(
            "[tasks.t]\ncommand = [\"/bin/true\"]\n\
             [[jobs]]\nname = \"a\"\ntask = \"t\"\nevery = \"2s\"\njitter = \"1s\"\n\
             [[jobs]]\nname = \"b\"\ntask = \"t\"\nafter = \"a\"\n\
             [[jobs]]\nname = \"c\"\ntask = \"t\"\nafter = \"b\"\n",
            std::path::Path::new("d.toml"),
            |_| None,
        )
        .unwrap();
        let mut followers = Followers::new(&config);
        let offset = config.jobs[0].jitter_offset();
        // Both followers count from the root's jittered time.
        assert!(followers.links.iter().all(|l| l.offset == offset));
        let plan = crate::misfire::paused(Plan {
            publish: vec![at(2), at(4)],
            ..Plan::default()
        });
        followers.upstream_dropped(0, &plan);
        followers.upstream_dropped(2, &plan);
        assert_eq!(followers.dropped(0, at(4)), Some(Dropped::Paused));
        assert_eq!(followers.dropped(0, at(6)), None);
        assert_eq!(followers.dropped(2, at(4)), None, "nothing follows c");
        followers.forget_dropped(|_| at(2));
        assert_eq!(followers.dropped(0, at(4)), Some(Dropped::Paused));
        followers.forget_dropped(|_| at(4));
        assert!(followers.dropped.is_empty());
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

    /// `a` every `every_a`, `b` after `a`, `c` after `b` (each waiting a minute), as one config.
    fn chain_config(every_a: &str) -> Config {
        let text = format!(
            "[tasks.t]\ncommand = [\"/bin/true\"]\n\
             [[jobs]]\nname = \"a\"\ntask = \"t\"\nevery = \"{every_a}\"\n\
             [[jobs]]\nname = \"b\"\ntask = \"t\"\nafter = \"a\"\nafter_timeout = \"1m\"\n\
             [[jobs]]\nname = \"c\"\ntask = \"t\"\nafter = \"b\"\nafter_timeout = \"1m\"\n"
        );
        Config::parse(&text, std::path::Path::new("d.toml"), |_| None).unwrap()
    }

    /// What one step published and skipped (follower, instant, reason), and the progress it moved.
    type Step = (
        Vec<(usize, DateTime<Utc>)>,
        Vec<(usize, DateTime<Utc>, &'static str)>,
        Vec<(usize, DateTime<Utc>)>,
    );

    /// One step's decisions at `now` with every follower at `at(0)`, the upstream instances
    /// in `states` (`(upstream job, instant) -> state`), the jobs `paused`: what it publishes
    /// and skips (follower, instant, reason); both are marked decided. Returns with them the
    /// progress moved.
    fn one_step(
        followers: &mut Followers,
        config: &Config,
        states: &[((usize, DateTime<Utc>), &str)],
        (now, paused): (DateTime<Utc>, &[&str]),
    ) -> Step {
        let jobs = &config.jobs;
        let last = |_: usize| at(0);
        let pending = followers.pending(jobs, last, now);
        let keys: Vec<String> = pending
            .iter()
            .map(|p| instance_key(&jobs[p.link.upstream].name, p.instant))
            .collect();
        let state_of = |p: &Pending| {
            let found = states
                .iter()
                .find(|(k, _)| *k == (p.link.upstream, p.instant));
            found.map(|(_, s)| s.to_string())
        };
        let read: Vec<Option<String>> = pending.iter().map(state_of).collect();
        let paused: HashSet<String> = paused.iter().map(|p| p.to_string()).collect();
        let seen = (&pending[..], &read[..], &keys[..]);
        let (publish, skip) = verdicts(jobs, followers, seen, (now, &paused));
        let published: Vec<(usize, DateTime<Utc>)> = publish
            .iter()
            .map(|p| (p.link.follower, p.instant))
            .collect();
        let skipped: Vec<_> = skip
            .iter()
            .map(|(p, reason, _)| (p.link.follower, p.instant, *reason))
            .collect();
        let decided: Vec<&Pending> = publish
            .into_iter()
            .chain(skip.into_iter().map(|s| s.0))
            .collect();
        for p in decided {
            followers.decided(p);
        }
        (published, skipped, followers.moved(jobs, last))
    }

    #[test]
    fn a_success_publishes_its_follower_and_moves_the_followers_progress() {
        let config = chain_config("2s");
        let mut followers = Followers::new(&config);
        let done = [((0, at(2)), "done")];
        let (published, skipped, moved) = one_step(&mut followers, &config, &done, (at(3), &[]));
        assert_eq!(published, [(1, at(2))], "b's 2; c waits for b's");
        assert!(skipped.is_empty());
        assert_eq!(moved, [(1, at(2))]);
    }

    #[test]
    fn an_undecided_instant_holds_the_followers_progress_back() {
        let config = chain_config("2s");
        let mut followers = Followers::new(&config);
        let later_done = [((0, at(4)), "done")];
        let step = one_step(&mut followers, &config, &later_done, (at(5), &[]));
        assert_eq!(step.0, [(1, at(4))], "published, out of order");
        assert!(step.2.is_empty(), "b's 2 is not decided: {step:?}");
        let both = [((0, at(2)), "done"), ((0, at(4)), "done")];
        let step = one_step(&mut followers, &config, &both, (at(5), &[]));
        assert_eq!(step.0, [(1, at(2))], "b's 4 is not published twice");
        assert_eq!(step.2, [(1, at(4))]);
    }

    #[test]
    fn a_dead_upstream_skips_its_follower_and_a_paused_follower_is_skipped_paused() {
        let config = chain_config("2s");
        let mut followers = Followers::new(&config);
        let states = [((0, at(2)), "dead"), ((1, at(2)), "done")];
        let (published, skipped, _) = one_step(&mut followers, &config, &states, (at(3), &["c"]));
        assert!(published.is_empty());
        let dead = (1, at(2), Why::Dead.reason());
        let paused = (2, at(2), Why::Paused.reason());
        assert_eq!(skipped, [dead, paused]);
    }
}
