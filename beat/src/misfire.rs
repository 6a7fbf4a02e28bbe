//! The misfire decision (docs/design.md): which instants of a job in `(last, now]` to publish and
//! which to drop, and why. Pure — [`plan`] takes the job, the last decided instant and `now` —
//! so every policy is tested on fixed instants. Touches nothing: no clock, no Redis, no broker.

use crate::reload::Held;
use chrono::{DateTime, TimeDelta, Utc};
use drumline_shared::config::{Job, Misfire};
use drumline_shared::schedule::{every_between, Schedule};
use std::collections::VecDeque;
use std::time::Duration;

/// Dropped instances listed one by one (each logged with its key) per planning step; the rest
/// are counted and logged as one range (a 1-second job down for a day misses 86,400).
pub const MAX_LISTED: usize = 1000;

/// Cron instances missed by more than `misfire_grace` that one planning step counts by walking
/// the schedule beyond the listed ones; past that the count is a lower bound and the walk jumps
/// to the grace edge. (`every` instances are counted exactly, by arithmetic, at no cost.)
pub const MAX_COUNTED: u64 = 1_000_000;

/// Why an instance was not published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// Missed by more than `misfire_grace`.
    PastGrace,
    /// Missed, and the policy (`run_once`, `skip`, `catch_up` beyond `max_catch_up`) drops it.
    Policy(Misfire),
    /// `expires` had already passed when it came due.
    Expired,
    /// The job was paused (`drumline-beat pause`) when it came due.
    Paused,
    /// A calendar of the job's `exclude` holds its local date (docs/design.md#calendars).
    Calendar,
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
            Dropped::Paused => "the job is paused",
            Dropped::Calendar => "a calendar excludes its date",
        }
    }
}

/// Dropped instances beyond the [`MAX_LISTED`] listed ones: counted, not listed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Unlisted {
    /// How many.
    pub count: u64,
    /// The oldest of them.
    pub first: Option<DateTime<Utc>>,
    /// The newest of them that was counted.
    pub last: Option<DateTime<Utc>>,
    /// True when a cron walk stopped counting at [`MAX_COUNTED`]: `count` is a lower bound.
    pub lower_bound: bool,
    /// `count` by reason, each reason once, in the order first met.
    pub reasons: Vec<(Dropped, u64)>,
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
    #[cfg(test)]
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
            self.add_unlisted(1, t, t, why);
        }
    }

    fn listing_full(&self) -> bool {
        self.listed.len() >= MAX_LISTED
    }

    fn add_unlisted(
        &mut self,
        count: u64,
        first: DateTime<Utc>,
        last: DateTime<Utc>,
        why: Dropped,
    ) {
        self.unlisted.count += count;
        match self.unlisted.reasons.iter_mut().find(|(r, _)| *r == why) {
            Some((_, n)) => *n += count,
            None => self.unlisted.reasons.push((why, count)),
        }
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
#[cfg(test)]
pub fn plan(job: &Job, last: DateTime<Utc>, now: DateTime<Utc>, threshold: Duration) -> Plan {
    plan_held(job, last, now, threshold, None)
}

/// [`plan`], with the instants a reload that lowered the job's jitter `held`: each counts as
/// due no earlier than the reload ([`Held::due`]) for lateness, grace and expiry alike
/// (docs/design.md#jitter).
pub fn plan_held(
    job: &Job,
    last: DateTime<Utc>,
    now: DateTime<Utc>,
    threshold: Duration,
    held: Option<Held>,
) -> Plan {
    let due = |t| held.map_or(t, |h| h.due(t));
    // `None`: the duration reaches before the start of time, so nothing is that old.
    let older_than = |d: Duration| {
        chrono::Duration::from_std(d)
            .ok()
            .and_then(|d| now.checked_sub_signed(d))
    };
    let missed_before = older_than(threshold);
    let stale_before = older_than(job.spec.misfire_grace);
    let keep = kept_missed(job);

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
        if let Some(stale) = stale_before.filter(|s| due(t) < *s) {
            drops.push(t, Dropped::PastGrace);
            if drops.listing_full() {
                let stale = stale_edge(held, stale);
                if let Some(jump) = count_stale(&job.schedule, t, stale, &mut drops) {
                    cursor = jump;
                }
            }
        } else if missed_before.is_some_and(|m| due(t) < m) {
            missed.push_back(t);
            if missed.len() > keep {
                let oldest = missed.pop_front().expect("longer than keep");
                drops.push(oldest, Dropped::Policy(job.spec.misfire));
            }
        } else {
            on_time.push(t);
        }
    }

    let mut publish: Vec<_> = missed.into_iter().chain(on_time).collect();
    drop_expired(job, (now, held), &mut publish, &mut drops);
    Plan {
        publish,
        dropped: drops.listed,
        unlisted: drops.unlisted,
        dropped_up_to: drops.up_to,
        decided_up_to: (cursor > last).then_some(cursor),
    }
}

/// Where a count of the instants missed by more than `misfire_grace` (all older than `stale`)
/// stops: before the held ones, unless they are that old too.
fn stale_edge(held: Option<Held>, stale: DateTime<Utc>) -> DateTime<Utc> {
    match held {
        Some(h) if h.until >= stale => stale.min(h.after + TimeDelta::nanoseconds(1)),
        _ => stale,
    }
}

/// How many of the newest missed instants the job's `misfire` policy publishes.
fn kept_missed(job: &Job) -> usize {
    match job.spec.misfire {
        Misfire::RunOnce => 1,
        Misfire::CatchUp => job.spec.max_catch_up,
        Misfire::Skip => 0,
    }
}

/// Moves the instants of `publish` whose `expires` (from when each is due: [`Held::due`]) has
/// passed by `now` to `drops`.
fn drop_expired(
    job: &Job,
    (now, held): (DateTime<Utc>, Option<Held>),
    publish: &mut Vec<DateTime<Utc>>,
    drops: &mut Drops,
) {
    let Some(expires) = job
        .spec
        .expires
        .and_then(|e| chrono::Duration::from_std(e).ok())
    else {
        return;
    };
    // Expiry is monotone in the instant (so is `Held::due`): the expired ones are a prefix.
    let live = publish.partition_point(|t| {
        held.map_or(*t, |h| h.due(*t))
            .checked_add_signed(expires)
            .is_some_and(|deadline| deadline <= now)
    });
    for t in publish.drain(..live) {
        drops.push(t, Dropped::Expired);
    }
}

/// The plan of a paused job (docs/design.md): what `plan` would publish is dropped as
/// [`Dropped::Paused`] instead (after what it drops anyway, which is older), so progress moves
/// past it and a resumed job never publishes it.
pub fn paused(plan: Plan) -> Plan {
    let mut drops = Drops {
        listed: plan.dropped,
        unlisted: plan.unlisted,
        up_to: plan.dropped_up_to,
    };
    for t in plan.publish {
        drops.push(t, Dropped::Paused);
    }
    Plan {
        publish: Vec::new(),
        dropped: drops.listed,
        unlisted: drops.unlisted,
        dropped_up_to: drops.up_to,
        decided_up_to: plan.decided_up_to,
    }
}

/// `plan` with the instants `excluded` holds not published: dropped as [`Dropped::Calendar`].
/// Drops come before every publish, so an excluded instant after one to publish ends the plan
/// there (it is decided by the next, which drops it).
pub fn excluded(plan: Plan, excluded: impl Fn(DateTime<Utc>) -> bool) -> Plan {
    if !plan.publish.iter().any(|t| excluded(*t)) {
        return plan;
    }
    let mut drops = Drops {
        listed: plan.dropped,
        unlisted: plan.unlisted,
        up_to: plan.dropped_up_to,
    };
    let (mut publish, mut decided_up_to) = (Vec::new(), plan.decided_up_to);
    for t in plan.publish {
        match (excluded(t), publish.last()) {
            (false, _) => publish.push(t),
            (true, None) => drops.push(t, Dropped::Calendar),
            (true, Some(kept)) => {
                decided_up_to = Some(*kept);
                break;
            }
        }
    }
    Plan {
        publish,
        dropped: drops.listed,
        unlisted: drops.unlisted,
        dropped_up_to: drops.up_to,
        decided_up_to,
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
            drops.add_unlisted(count, first, last, Dropped::PastGrace);
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

/// Fixtures shared with the other modules' tests.
#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use drumline_shared::config::Config;
    use std::path::Path;

    pub(crate) const THRESHOLD: Duration = Duration::from_secs(5);

    /// Job `j` with the given TOML keys (schedule, policies).
    pub(crate) fn job(keys: &str) -> Job {
        let text = format!(
            "[[jobs]]\nname = \"j\"\ntask = \"t\"\n{keys}\n[tasks.t]\ncommand = [\"/bin/true\"]\n"
        );
        let mut config = Config::parse(&text, Path::new("test.toml"), |_| None)
            .unwrap_or_else(|e| panic!("bad test config: {e}"));
        config.jobs.remove(0)
    }

    pub(crate) fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .expect("test instant")
            .with_timezone(&Utc)
    }

    /// `12:MM:00Z` on 2026-03-02 for each minute.
    pub(crate) fn minutes(range: std::ops::RangeInclusive<u32>) -> Vec<DateTime<Utc>> {
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

    /// Each minute of `range` (as [`minutes`]) dropped for `why`.
    fn minutes_dropped(
        range: std::ops::RangeInclusive<u32>,
        why: Dropped,
    ) -> Vec<(DateTime<Utc>, Dropped)> {
        minutes(range).into_iter().map(|t| (t, why)).collect()
    }

    // The beat was down from 12:00 to 12:10:30: 12:01 … 12:10 were all missed.
    pub(crate) const LAST: &str = "2026-03-02T12:00:00Z";
    pub(crate) const NOW: &str = "2026-03-02T12:10:30Z";
    pub(crate) const EVERY_MINUTE: &str = "every = \"1m\"";
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
        assert_eq!(p.dropped, minutes_dropped(1..=5, Dropped::PastGrace));
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
        assert_eq!(p.dropped, minutes_dropped(1..=7, Dropped::Expired));
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
        // Counted by reason: past grace, then the last hour's missed ones (run_once).
        let past_grace = due - 3600 - MAX_LISTED as u64;
        assert_eq!(
            p.unlisted.reasons,
            vec![
                (Dropped::PastGrace, past_grace),
                (Dropped::Policy(Misfire::RunOnce), 3599)
            ]
        );
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

    /// A reload at 12:10:30 lowered the job's offset by 5 min 30 s: 12:06 … 12:10, not yet due
    /// under the old offset, are held until 12:10:30 on the new jittered clock (`after` and
    /// `until`: the reload less the old offset and less the new one). See: issues/33
    fn held() -> Held {
        Held {
            after: at("2026-03-02T12:05:00Z"),
            until: at(NOW),
        }
    }

    /// An every-minute job with a 3 min grace, `misfire = policy` and further `keys`.
    fn graced(policy: &str, keys: &str) -> Job {
        job(&format!(
            "every = \"1m\"\nmisfire_grace = \"3m\"\nmisfire = \"{policy}\"\noverlap = \"queue\"\n{keys}"
        ))
    }

    #[test]
    fn instants_a_reload_held_are_late_grace_and_expiry_only_from_the_reload() {
        let held = Some(held());
        for policy in ["skip", "run_once", "catch_up"] {
            let j = graced(policy, "expires = \"3s\"");
            let p = plan_held(&j, at(LAST), at(NOW), THRESHOLD, held);
            assert_eq!(p.publish, minutes(6..=10), "{policy}");
            // The instants due before the reload stay as late as they were.
            let past_grace = minutes_dropped(1..=5, Dropped::PastGrace);
            assert_eq!(p.dropped, past_grace, "{policy}");
            // `expires` (3 s) counts from the reload too.
            let p = plan_held(&j, at(LAST), at("2026-03-02T12:10:33Z"), THRESHOLD, held);
            assert!(p.publish.is_empty(), "{policy}");
            assert_eq!(p.dropped[5..], minutes_dropped(6..=10, Dropped::Expired));
        }
        // Missed from the reload on: 6 s after it `skip` drops them; `catch_up` publishes them.
        let later = at("2026-03-02T12:10:36Z");
        let p = plan_held(&graced("skip", ""), at(LAST), later, THRESHOLD, held);
        let skipped = minutes_dropped(6..=10, Dropped::Policy(Misfire::Skip));
        assert_eq!(p.dropped[5..], skipped);
        let p = plan_held(&graced("catch_up", ""), at(LAST), later, THRESHOLD, held);
        assert_eq!(p.publish, minutes(6..=10));
        // Unheld, the same instants were all missed long ago: `skip` publishes none.
        let p = plan(&graced("skip", ""), at(LAST), at(NOW), THRESHOLD);
        assert!(p.publish.is_empty());
    }

    #[test]
    fn a_count_of_stale_instants_stops_before_the_held_ones() {
        let held = Held {
            after: at("2026-03-30T22:00:00Z"),
            until: at("2026-03-31T00:00:00Z"),
        };
        let stale = at("2026-03-30T23:00:00Z");
        let edge = held.after + TimeDelta::nanoseconds(1);
        assert_eq!(stale_edge(Some(held), stale), edge);
        assert_eq!(stale_edge(None, stale), stale);
        // Held instants past grace themselves do not stop it.
        let older = Held {
            until: at("2026-03-30T22:30:00Z"),
            ..held
        };
        assert_eq!(stale_edge(Some(older), stale), stale);
        // Every second, down 30 days, grace 1 h, the last 2 h held: counted up to the held
        // ones, which are all on time.
        let j = job("every = \"1s\"");
        let last = at("2026-03-01T00:00:00Z");
        let now = at("2026-03-31T00:00:00.500Z");
        let p = plan_held(&j, last, now, THRESHOLD, Some(held));
        assert_eq!(p.publish.len(), 7200);
        assert_eq!(p.publish[0], at("2026-03-30T22:00:01Z"));
        let stale_count = 30 * 86_400 - 7200;
        assert_eq!(p.dropped_count(), stale_count);
        let unlisted = stale_count - MAX_LISTED as u64;
        assert_eq!(p.unlisted.reasons, vec![(Dropped::PastGrace, unlisted)]);
        assert_eq!(p.dropped_up_to, Some(held.after));
    }

    #[test]
    fn a_paused_job_drops_what_it_would_publish_and_moves_past_it() {
        let j = job(
            "cron = \"* * * * *\"\nmisfire = \"catch_up\"\noverlap = \"allow\"\nmax_catch_up = 3",
        );
        let p = paused(plan(&j, at(LAST), at(NOW), THRESHOLD));
        assert!(p.publish.is_empty());
        // 12:01..12:07 beyond max_catch_up, then 12:08..12:10 paused instead of caught up.
        let mut want = minutes_dropped(1..=7, Dropped::Policy(Misfire::CatchUp));
        want.extend(minutes_dropped(8..=10, Dropped::Paused));
        assert_eq!(p.dropped, want);
        let newest = minutes(10..=10)[0];
        assert_eq!(
            (p.dropped_up_to, p.decided_up_to),
            (Some(newest), Some(newest))
        );
    }

    #[test]
    fn excluded_instants_are_dropped_before_the_first_kept_one_and_end_the_plan_after_it() {
        let t = |m: u32| at(&format!("2026-03-02T12:{m:02}:00Z"));
        let plan = Plan {
            publish: vec![t(1), t(2), t(3), t(4)],
            decided_up_to: Some(t(4)),
            ..Plan::default()
        };
        let odd = |x: DateTime<Utc>| chrono::Timelike::minute(&x) % 2 == 1;
        let p = excluded(plan.clone(), odd);
        assert_eq!(p.publish, vec![t(2)]);
        assert_eq!(p.dropped, vec![(t(1), Dropped::Calendar)]);
        assert_eq!(
            p.decided_up_to,
            Some(t(2)),
            "03 is decided by the next plan"
        );
        assert_eq!(excluded(plan.clone(), |_| false), plan);
    }
}
