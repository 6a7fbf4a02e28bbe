//! SIGHUP for the beat (docs/design.md "Reload"): which jobs of a reloaded config carry their
//! progress over. A job keeps its state when a job of the same name with the same schedule
//! (`cron`, `every`, `anchor`, `timezone`, DST policies) ran before; an added job — or a
//! re-added one, whatever Redis still holds for it — and a rescheduled one start from the
//! reload as on a first start; a removed job stops. Pure: the scheduler applies it.
//!
//! The same rule holds across beats (docs/design.md#reload-on-a-standby): progress is recorded
//! with its job's [`rule`] (`{ns}:beat:rule:{job}`), and a beat that starts leading
//! ([`resume`]) goes on from a job's progress only when it was recorded under the schedule the
//! beat runs; otherwise the job was rescheduled since (a standby reloaded, or started with
//! another file, while another beat led) and starts from the new term, as a reload starts it.
//!
//! A kept job whose jitter a reload lowers has its instants not yet due under the old offset
//! [`held`] (docs/design.md#jitter): published, never dropped as missed.

use chrono::{DateTime, SecondsFormat, Utc};
use drumline_shared::config::Job;
use drumline_shared::schedule::{parse_timezone, CronExpr, DstFold, DstGap, Schedule};
use std::collections::HashMap;

/// For each job of `new`, the index in `old` of the job whose state it keeps, if any.
pub fn carried(old: &[Job], new: &[Job]) -> Vec<Option<usize>> {
    let by_name: HashMap<&str, usize> = old
        .iter()
        .enumerate()
        .map(|(i, j)| (j.name.as_str(), i))
        .collect();
    new.iter()
        .map(|job| {
            by_name
                .get(job.name.as_str())
                .copied()
                .filter(|i| old[*i].schedule == job.schedule)
        })
        .collect()
}

/// The instants of a job that a reload lowering its jitter found not yet due under the old
/// offset (docs/design.md#jitter): each counts as due no earlier than the reload, so the reload
/// drops none of them. In instants (the planner's clock: the beat's clock less the job's offset).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The reload less the old offset: the instants after it were not yet due.
    pub after: DateTime<Utc>,
    /// The reload less the new offset: a held instant counts as due from here.
    pub until: DateTime<Utc>,
}

impl Held {
    /// When instant `t` counts as due for lateness, grace and expiry: no earlier than `until`
    /// when it is held. Monotone in `t`, like the instants themselves.
    pub fn due(&self, t: DateTime<Utc>) -> DateTime<Utc> {
        if t > self.after {
            t.max(self.until)
        } else {
            t
        }
    }
}

/// What a reload at `at` holds of a kept job's instants, from its jitter in the old config
/// (`old`) and in the new (`new`), and what an earlier reload held (`before`): with the same
/// offset, that; with a lower one, the instants not yet due under the old ([`Held`]); with a
/// higher one, none (every instant not yet due only moves later).
pub fn held(old: &Job, new: &Job, at: DateTime<Utc>, before: Option<Held>) -> Option<Held> {
    let (old, new) = (old.jitter_offset(), new.jitter_offset());
    if old == new {
        return before;
    }
    (new < old).then(|| Held {
        after: at - old,
        until: at - new,
    })
}

/// The text a job's progress is recorded under (`{ns}:beat:rule:{job}`): every part of its
/// schedule that [`carried`] compares, so two schedules are equal exactly when their rules
/// are. Spelled out here, not taken from a `Display`, so that it stays the same across
/// releases (a changed text would restart every job at the next term).
pub fn rule(schedule: &Schedule) -> String {
    match schedule {
        Schedule::Cron {
            cron,
            tz,
            gap,
            fold,
        } => format!(
            "cron {:?} in {} dst_gap {} dst_fold {}",
            cron.as_str(),
            tz.name(),
            gap.as_str(),
            fold.as_str()
        ),
        Schedule::Every { every, anchor } => format!(
            "every {}.{:09}s from {}",
            every.num_seconds(),
            every.subsec_nanos(),
            anchor.to_rfc3339_opts(SecondsFormat::AutoSi, true)
        ),
    }
}

/// What a beat that starts leading makes of a job's recorded progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// Nothing recorded: the job starts now, as on a first start (its rule is recorded with
    /// its start).
    Start,
    /// Recorded under the job's rule: the job goes on from its progress.
    Continue,
    /// Recorded without a rule (by a release before rules were): the job goes on from its
    /// progress, and its rule is recorded.
    Adopt,
    /// Recorded under another rule: the job was rescheduled since, so it starts now, as a
    /// reload starts a rescheduled job (nothing before is caught up), and its rule is recorded.
    Restart,
}

/// The schedule a [`rule`] text spells, read back: a beat that takes over a job rescheduled
/// since its progress was recorded decides its followers' instants of the old rule
/// (docs/design.md#job-dependencies). `None` for a text no release of [`rule`] wrote.
pub fn schedule_of(rule: &str) -> Option<Schedule> {
    if let Some(rest) = rule.strip_prefix("every ") {
        let (period, anchor) = rest.split_once("s from ")?;
        let (secs, nanos) = period.split_once('.')?;
        let every = chrono::Duration::seconds(secs.parse().ok()?)
            + chrono::Duration::nanoseconds(nanos.parse().ok()?);
        let anchor = DateTime::parse_from_rfc3339(anchor)
            .ok()?
            .with_timezone(&Utc);
        return Some(Schedule::Every { every, anchor });
    }
    let rest = rule.strip_prefix("cron \"")?;
    let (cron, rest) = rest.rsplit_once("\" in ")?;
    let (tz, rest) = rest.split_once(" dst_gap ")?;
    let (gap, fold) = rest.split_once(" dst_fold ")?;
    Some(Schedule::Cron {
        cron: Box::new(CronExpr::parse(cron).ok()?),
        tz: parse_timezone(tz).ok()?,
        gap: [DstGap::Shift, DstGap::Skip]
            .into_iter()
            .find(|g| g.as_str() == gap)?,
        fold: [DstFold::First, DstFold::Second, DstFold::Both]
            .into_iter()
            .find(|f| f.as_str() == fold)?,
    })
}

/// How a beat that starts leading resumes `job`, from whether it has progress recorded
/// (`recorded`) and the rule recorded with it.
#[cfg(test)]
pub fn resume(job: &Job, recorded: bool, recorded_rule: Option<&str>) -> Resume {
    resume_from(recorded, recorded_rule.map(|r| r == rule(&job.schedule)))
}

/// [`resume`] from whether the recorded rule, if any, is the job's rule now (`Some(true)`).
pub fn resume_from(recorded: bool, same_rule: Option<bool>) -> Resume {
    match (recorded, same_rule) {
        (false, _) => Resume::Start,
        (true, None) => Resume::Adopt,
        (true, Some(true)) => Resume::Continue,
        (true, Some(false)) => Resume::Restart,
    }
}

/// What a reload did, for its log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// Jobs that kept their progress.
    pub kept: usize,
    /// Jobs that start from the reload (added or rescheduled).
    pub started: usize,
    /// Jobs of the old config no longer run (removed, or replaced by a rescheduled one).
    pub removed: usize,
}

impl Summary {
    /// From [`carried`]'s answer and the old config's job count.
    pub fn of(carried: &[Option<usize>], old_jobs: usize) -> Self {
        let kept = carried.iter().flatten().count();
        Summary {
            kept,
            started: carried.len() - kept,
            removed: old_jobs - kept,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeDelta;
    use drumline_shared::config::Config;
    use std::path::Path;

    fn jobs(body: &str) -> Vec<Job> {
        let text = format!("{body}\n[tasks.t]\ncommand = [\"/bin/true\"]\n");
        Config::parse(&text, Path::new("test.toml"), |_| None)
            .unwrap_or_else(|e| panic!("bad test config: {e}"))
            .jobs
    }

    fn job(name: &str, rule: &str) -> String {
        format!("[[jobs]]\nname = \"{name}\"\ntask = \"t\"\n{rule}\n")
    }

    /// Every rule text reads back as the schedule it was written from.
    #[test]
    fn a_rule_reads_back_as_its_schedule() {
        let all = jobs(
            &[
                job(
                    "e",
                    "every = \"1500ms\"\nanchor = \"2026-01-01T00:00:00.25Z\"",
                ),
                job("c", "cron = \"30 2 * * 1-5\"\ntimezone = \"Europe/Paris\""),
                job(
                    "d",
                    "cron = \"0 3 L * *\"\ndst_gap = \"skip\"\ndst_fold = \"both\"",
                ),
            ]
            .concat(),
        );
        for j in &all {
            assert_eq!(
                schedule_of(&rule(&j.schedule)).as_ref(),
                Some(&j.schedule),
                "{}",
                j.name
            );
        }
        assert_eq!(schedule_of("hourly"), None);
        assert_eq!(schedule_of("every xs from now"), None);
    }

    #[test]
    fn same_name_and_schedule_keeps_its_state_anything_else_starts_over() {
        let old = jobs(
            &[
                job("kept", "every = \"1s\""),
                job("faster", "every = \"10s\""),
                job("moved", "cron = \"0 3 * * *\"\ntimezone = \"Europe/Paris\""),
                job("gone", "every = \"1m\""),
            ]
            .concat(),
        );
        let new = jobs(
            &[
                job("added", "every = \"1s\""),
                job(
                    "moved",
                    "cron = \"0 3 * * *\"\ntimezone = \"Europe/Berlin\"",
                ),
                job("faster", "every = \"5s\""),
                // Other keys than the schedule may change: the job keeps its progress.
                job("kept", "every = \"1s\"\nexpires = \"1m\""),
            ]
            .concat(),
        );
        let carried = carried(&old, &new);
        assert_eq!(carried, vec![None, None, None, Some(0)]);
        // Across beats: the rule recorded with the progress tells the same.
        for (job, from) in new.iter().zip(&carried) {
            let recorded = old.iter().find(|o| o.name == job.name);
            let rule = recorded.map(|o| rule(&o.schedule));
            let expected = match (recorded, from) {
                (None, _) => Resume::Start,
                (Some(_), Some(_)) => Resume::Continue,
                (Some(_), None) => Resume::Restart,
            };
            assert_eq!(
                resume(job, recorded.is_some(), rule.as_deref()),
                expected,
                "{}",
                job.name
            );
        }
        assert_eq!(
            Summary::of(&carried, old.len()),
            Summary {
                kept: 1,
                started: 3,
                removed: 3
            }
        );
    }

    /// The one job `j` with `rule_keys`.
    fn one(rule_keys: &str) -> Job {
        let text = format!("[[jobs]]\nname = \"j\"\ntask = \"t\"\n{rule_keys}\n");
        jobs(&text).remove(0)
    }

    #[test]
    fn a_rule_names_every_part_of_the_schedule_and_nothing_else() {
        let every = one("every = \"1s\"");
        assert_eq!(
            rule(&every.schedule),
            "every 1.000000000s from 1970-01-01T00:00:00Z"
        );
        let cron = one("cron = \"0 3 * * *\"\ntimezone = \"Europe/Paris\"");
        assert_eq!(
            rule(&cron.schedule),
            "cron \"0 3 * * *\" in Europe/Paris dst_gap shift dst_fold first"
        );
        // Each part of a schedule changes the rule, as it changes what `carried` compares.
        let variants = [
            "every = \"1s\"",
            "every = \"1500ms\"",
            "every = \"1s\"\nanchor = \"2026-01-01T00:00:00.5Z\"",
            "cron = \"0 3 * * *\"",
            "cron = \"0 4 * * *\"",
            "cron = \"0 3 * * *\"\ntimezone = \"Europe/Paris\"",
            "cron = \"0 3 * * *\"\ntimezone = \"Europe/Paris\"\ndst_gap = \"skip\"",
            "cron = \"0 3 * * *\"\ntimezone = \"Europe/Paris\"\ndst_fold = \"both\"",
        ];
        let jobs: Vec<Job> = variants.iter().map(|v| one(v)).collect();
        for (i, a) in jobs.iter().enumerate() {
            for (k, b) in jobs.iter().enumerate() {
                let same_rule = rule(&a.schedule) == rule(&b.schedule);
                assert_eq!(
                    same_rule,
                    a.schedule == b.schedule,
                    "{} / {}",
                    variants[i],
                    variants[k]
                );
                assert_eq!(same_rule, i == k, "{} / {}", variants[i], variants[k]);
            }
        }
        // Other keys do not.
        let expiring = one("every = \"1s\"\nexpires = \"1m\"\nmisfire = \"skip\"");
        assert_eq!(rule(&expiring.schedule), rule(&every.schedule));
    }

    #[test]
    fn only_a_lowered_jitter_holds_the_instants_not_yet_due() {
        let at = DateTime::parse_from_rfc3339("2026-03-02T12:00:30Z")
            .unwrap()
            .with_timezone(&Utc);
        let plain = one("every = \"1m\"");
        let wide = one("every = \"1m\"\njitter = \"50s\"");
        let narrow = one("every = \"1m\"\njitter = \"1ms\"");
        let (o, n) = (wide.jitter_offset(), narrow.jitter_offset());
        assert!(o > n, "{o} {n}");
        let lowered = Held {
            after: at - o,
            until: at - n,
        };
        assert_eq!(held(&wide, &narrow, at, None), Some(lowered));
        // Removed: lowered to none.
        let removed = held(&wide, &plain, at, None).unwrap();
        assert_eq!((removed.after, removed.until), (at - o, at));
        // Raised or added: nothing held, whatever an earlier reload held.
        assert_eq!(held(&narrow, &wide, at, Some(lowered)), None);
        assert_eq!(held(&plain, &wide, at, None), None);
        // Unchanged: what an earlier reload held stays held.
        assert_eq!(held(&narrow, &narrow, at, Some(lowered)), Some(lowered));
        // Held: the instants after `after` are due from `until` on, no earlier.
        assert_eq!(lowered.due(lowered.after), lowered.after);
        let t = lowered.after + TimeDelta::milliseconds(1);
        assert_eq!(lowered.due(t), lowered.until);
        assert_eq!(lowered.due(at), at);
    }

    #[test]
    fn progress_goes_on_only_under_the_rule_it_was_recorded_with() {
        let j = one("every = \"1s\"");
        let own = rule(&j.schedule);
        assert_eq!(resume(&j, false, None), Resume::Start);
        assert_eq!(resume(&j, false, Some("every 5s")), Resume::Start);
        assert_eq!(resume(&j, true, Some(&own)), Resume::Continue);
        assert_eq!(resume(&j, true, None), Resume::Adopt);
        assert_eq!(
            resume(
                &j,
                true,
                Some("every 2.000000000s from 1970-01-01T00:00:00Z")
            ),
            Resume::Restart
        );
    }
}
