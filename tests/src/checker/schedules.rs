//! Schedules as data in the randomized checker (docs/soak.md#the-randomized-checker,
//! docs/design.md#schedules-as-data): what a round draws of them — schedules applied at run
//! time by the CLI or a beat's API, an edit, a delete, and a calendar that excludes today — and
//! the rules the oracle holds their runs to.

use super::draw::{job, Event, JobDraw};
use super::oracle::{finding, instant_ms, Finding, Run};
use crate::soak::rng::Rng;
use chrono::{DateTime, NaiveDate, TimeDelta, Utc};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;

/// The stream schedules are drawn from: a seed draws the same jobs, faults and operator
/// actions as before schedules were drawn.
const STREAM: u64 = 0x7363_6865_6475_6c65;

/// The zones a schedule is drawn in, with their (fixed) offset from UTC in hours: a calendar
/// holds local dates, so the zone decides which instants "today" is.
const ZONES: [(&str, i32); 3] = [("UTC", 0), ("Etc/GMT-14", 14), ("Etc/GMT+10", -10)];

/// How long after a change's success the oracle holds the beat to it: the leader applies a
/// change within 1 s (docs/design.md#schedules-as-data).
pub const CHANGE_MS: i64 = 1_000;

/// How long before a change was sent the oracle stops judging the instants it may touch:
/// an instant due then may still be on its way out when the change lands (as for a reload).
pub const BEFORE_CHANGE_MS: i64 = 1_500;

/// One schedule a round applies at run time: a job drawn like a file job (never `after`),
/// whose task is in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleDraw {
    /// Its job: `s0`, `s1`, …, the task of the same name.
    pub job: JobDraw,
    /// `timezone` and its offset from UTC in hours.
    pub zone: (&'static str, i32),
    /// Whether it excludes its calendar `c0`, `c1`, … (`exclude`, applied before the calendar
    /// exists: the calendar is drawn as events).
    pub calendar: bool,
}

/// Which beat's API a change goes through, or `None`: the CLI.
fn via(rng: &mut Rng) -> Option<usize> {
    [None, Some(0), Some(1)][rng.below(3)]
}

/// Draws the round's schedules (two rounds in three have any) and pushes their events: each is
/// applied 5–8 s in; then, from 3 s later to 3 s before the end, an edit to another `every` its
/// runs fit, its calendar made to hold today and then not (deleted or moved to another date),
/// and, one in two, its delete, always last.
pub fn draw(seed: u64, length: Duration, events: &mut Vec<(Duration, Event)>) -> Vec<ScheduleDraw> {
    let mut rng = Rng::new(seed ^ STREAM);
    if rng.below(3) == 0 {
        return Vec::new();
    }
    let end = length.saturating_sub(Duration::from_secs(3));
    (0..1 + rng.below(2))
        .map(|s| one(&mut rng, s, end, events))
        .collect()
}

fn one(
    rng: &mut Rng,
    s: usize,
    end: Duration,
    events: &mut Vec<(Duration, Event)>,
) -> ScheduleDraw {
    let mut job = job(rng, s);
    job.name = format!("s{s}");
    let zone = ZONES[rng.below(ZONES.len())];
    let calendar = rng.below(2) == 0;
    let applied = Duration::from_secs(5) + rng.between(Duration::ZERO, Duration::from_secs(3));
    events.push((applied, Event::Apply { s, api: via(rng) }));
    let mut acts = Vec::new();
    if calendar {
        acts.push(Event::Exclude { s });
        let delete = rng.below(2) == 0;
        acts.push(Event::Include { s, delete });
    }
    let fits: Vec<u32> = [1, 2, 3]
        .into_iter()
        .filter(|p| *p != job.every_s && job.fits(*p))
        .collect();
    if !fits.is_empty() {
        let every_s = fits[rng.below(fits.len())];
        let at = rng.below(acts.len() + 1);
        acts.insert(
            at,
            Event::Edit {
                s,
                every_s,
                api: via(rng),
            },
        );
    }
    if rng.below(2) == 0 {
        acts.push(Event::Delete { s, api: via(rng) });
    }
    let from = applied + Duration::from_secs(3);
    let mut times: Vec<Duration> = acts
        .iter()
        .map(|_| rng.between(from, end.max(from)))
        .collect();
    times.sort();
    events.extend(times.into_iter().zip(acts));
    ScheduleDraw {
        job,
        zone,
        calendar,
    }
}

impl ScheduleDraw {
    /// Its calendar's name.
    pub fn calendar_name(&self) -> String {
        format!("c{}", &self.job.name[1..])
    }

    /// The local date of `ms` in its zone.
    pub fn local_date(&self, ms: i64) -> NaiveDate {
        let at = DateTime::from_timestamp_millis(ms).expect("an instant");
        (at + TimeDelta::hours(self.zone.1.into())).date_naive()
    }

    /// The stored object with `every` = `every_s`.
    pub fn object(&self, every_s: u32) -> Value {
        let j = &self.job;
        let mut o = json!({
            "name": j.name, "task": j.name, "every": format!("{every_s}s"),
            "overlap": j.overlap, "timezone": self.zone.0,
        });
        if let Some(s) = j.expires_s {
            o["expires"] = json!(format!("{s}s"));
        }
        if let Some(s) = j.jitter_s {
            o["jitter"] = json!(format!("{s}s"));
        }
        if self.calendar {
            o["exclude"] = json!([self.calendar_name()]);
        }
        o
    }
}

/// What the harness did to one schedule and when (ms, wall time): each change as (sent,
/// succeeded), the success being the CLI's exit or the API's answer.
#[derive(Debug, Clone, Default)]
pub struct ScheduleTimes {
    /// Stored (created).
    pub applied: Option<(i64, i64)>,
    /// Stored again with another `every` (whole seconds).
    pub edits: Vec<(i64, i64, u32)>,
    /// Deleted.
    pub deleted: Option<(i64, i64)>,
    /// Its calendar changed: the local dates it holds from then on.
    pub calendar: Vec<(i64, i64, Vec<NaiveDate>)>,
}

impl ScheduleTimes {
    /// Whether instant `t` (published by `t + jitter`) is one its calendar excludes:
    /// `None` while a change to the calendar is under way, from [`BEFORE_CHANGE_MS`] before it
    /// was sent to [`CHANGE_MS`] after its success (either state may decide it).
    pub fn excluded(&self, s: &ScheduleDraw, t: i64, jitter: i64) -> Option<bool> {
        let mut dates: &[NaiveDate] = &[];
        for (sent, done, held) in &self.calendar {
            if t + jitter >= sent - BEFORE_CHANGE_MS && t <= done + CHANGE_MS {
                return None;
            }
            if t > done + CHANGE_MS {
                dates = held;
            }
        }
        Some(dates.contains(&s.local_date(t)))
    }

    /// The instants that must run: each rule's from [`CHANGE_MS`] after its apply or edit
    /// succeeded (and 5 s after the start: the beats elect) to [`BEFORE_CHANGE_MS`] before the
    /// next edit or the delete was sent (or 2 s before the judged window's end), jitter
    /// included; none its calendar excludes or may exclude.
    pub fn expected(&self, s: &ScheduleDraw, (start, judge_end): (i64, i64)) -> Vec<i64> {
        let Some((_, created)) = self.applied else {
            return Vec::new();
        };
        let jitter = i64::from(s.job.jitter_s.unwrap_or(0)) * 1000;
        let mut rules = vec![(created.max(start + 5_000) + CHANGE_MS, s.job.every_s)];
        rules.extend(self.edits.iter().map(|(_, done, e)| (done + CHANGE_MS, *e)));
        let last = self
            .deleted
            .map_or(judge_end - 2_000, |(sent, _)| sent - BEFORE_CHANGE_MS)
            .min(judge_end - 2_000);
        let mut out = Vec::new();
        for (k, (from, every)) in rules.iter().enumerate() {
            let until = self
                .edits
                .get(k)
                .map_or(last, |(sent, _, _)| sent - BEFORE_CHANGE_MS)
                .min(last);
            let period = i64::from(*every) * 1000;
            let first = from.div_euclid(period) * period + period;
            let instants = (0..).map(|n| first + n * period);
            out.extend(instants.take_while(|t| t + jitter <= until));
        }
        out.retain(|t| self.excluded(s, *t, jitter) == Some(false));
        out
    }

    /// The `every` in force at instant `t` when `t` is not one of its instants (an `every` is
    /// epoch-anchored) and no apply or edit was under way then (from [`BEFORE_CHANGE_MS`]
    /// before it was sent to [`CHANGE_MS`] after its success): an edit applies from the first
    /// instant not yet published, so the old rule publishes none after it.
    fn off_rule(&self, s: &ScheduleDraw, t: i64) -> Option<u32> {
        let (sent, done) = self.applied?;
        let changes = std::iter::once((sent, done, s.job.every_s));
        let changes = changes.chain(self.edits.iter().copied());
        let mut every = None;
        for (sent, done, e) in changes {
            if (sent - BEFORE_CHANGE_MS..=done + CHANGE_MS).contains(&t) {
                return None;
            }
            if t > done + CHANGE_MS {
                every = Some(e);
            }
        }
        every.filter(|e| t.rem_euclid(i64::from(*e) * 1000) != 0)
    }

    /// The runs that must not have happened: of an instant before the schedule was applied
    /// (`catch_up`), of one not on the rule in force (`off_rule`), of one due more than
    /// [`CHANGE_MS`] after its delete succeeded (`after_delete`), or of one its calendar
    /// excluded (`calendar`).
    pub fn forbidden(&self, s: &ScheduleDraw, by_key: &BTreeMap<&str, Vec<&Run>>) -> Vec<Finding> {
        let jitter = i64::from(s.job.jitter_s.unwrap_or(0)) * 1000;
        let mut out = Vec::new();
        for (key, runs) in by_key {
            let (Some(t), Some(first)) = (instant_ms(key), runs.iter().map(|r| r.start).min())
            else {
                continue;
            };
            let ran = format!("instant {t} ran at {first}");
            if let Some((sent, _)) = self.applied.filter(|(sent, _)| t < *sent) {
                let detail = format!("{ran}; the schedule was applied at {sent}");
                out.push(finding(&s.job, key, "catch_up", detail));
            }
            if let Some((_, done)) = self.deleted.filter(|(_, done)| t > done + CHANGE_MS) {
                let detail = format!("{ran}; the schedule was deleted at {done}");
                out.push(finding(&s.job, key, "after_delete", detail));
            }
            if let Some(every) = self.off_rule(s, t) {
                let detail = format!("{ran}; the rule in force is every {every}s");
                out.push(finding(&s.job, key, "off_rule", detail));
            }
            if self.excluded(s, t, jitter) == Some(true) {
                let detail = format!("{ran}; its local date {} is excluded", s.local_date(t));
                out.push(finding(&s.job, key, "calendar", detail));
            }
        }
        out
    }
}

/// The calendar `{"name", "dates"}` holding today's local date in `s`'s zone (`Some`), or
/// another date (`None`): the object and the dates it holds.
pub fn calendar_object(s: &ScheduleDraw, today: bool) -> (Value, Vec<NaiveDate>) {
    let date = if today {
        s.local_date(Utc::now().timestamp_millis())
    } else {
        NaiveDate::from_ymd_opt(2001, 2, 3).expect("a date")
    };
    let object = json!({"name": s.calendar_name(), "dates": [date.to_string()]});
    (object, vec![date])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::draw::round;

    /// Two rounds in three have schedules, seeds 2 and 3 of the suite among them; each is applied
    /// first, edited to a period its runs fit, its calendar excluding before including, the
    /// delete last.
    #[test]
    fn schedules_are_drawn_in_order_and_the_suites_seeds_have_them() {
        let length = Duration::from_secs(30);
        let with: Vec<u64> = (1..=3)
            .filter(|s| !round(*s, length).schedules.is_empty())
            .collect();
        assert_eq!(with, [2, 3], "the suite's seeds with schedules");
        let mut counts = [0; 4];
        for seed in 0..200 {
            let r = round(seed, length);
            counts[0] += usize::from(!r.schedules.is_empty());
            for (i, s) in r.schedules.iter().enumerate() {
                let mine: Vec<&Event> = r
                    .events
                    .iter()
                    .map(|(_, e)| e)
                    .filter(|e| of(e) == Some(i))
                    .collect();
                assert!(matches!(mine[0], Event::Apply { .. }), "{mine:?}");
                let at = |f: fn(&Event) -> bool| mine.iter().position(|e| f(e));
                let (on, off) = (
                    at(|e| matches!(e, Event::Exclude { .. })),
                    at(|e| matches!(e, Event::Include { .. })),
                );
                assert_eq!(on.is_some(), s.calendar);
                assert!(!s.calendar || on < off, "{mine:?}");
                if let Some(d) = at(|e| matches!(e, Event::Delete { .. })) {
                    assert_eq!(d, mine.len() - 1);
                    counts[1] += 1;
                }
                for e in &mine {
                    if let Event::Edit { every_s, .. } = e {
                        assert!(*every_s != s.job.every_s && s.job.fits(*every_s));
                        counts[2] += 1;
                    }
                }
                counts[3] += usize::from(s.calendar);
            }
        }
        assert!(counts.iter().all(|n| *n > 40), "{counts:?}");
    }

    fn of(e: &Event) -> Option<usize> {
        match e {
            Event::Apply { s, .. }
            | Event::Edit { s, .. }
            | Event::Delete { s, .. }
            | Event::Exclude { s }
            | Event::Include { s, .. } => Some(*s),
            _ => None,
        }
    }

    const T0: i64 = 1_800_000_000_000;

    fn drawn(calendar: bool) -> ScheduleDraw {
        ScheduleDraw {
            job: JobDraw {
                name: "s0".into(),
                every_s: 1,
                overlap: "allow",
                run: Duration::from_millis(100),
                fail_pct: 0,
                permanent_pct: 0,
                max_retries: 0,
                expires_s: None,
                jitter_s: None,
                after: None,
            },
            zone: ("Etc/GMT-14", 14),
            calendar,
        }
    }

    fn run(s: i64) -> Run {
        let at = DateTime::from_timestamp_millis(T0 + s * 1000).unwrap();
        Run {
            key: drumline_shared::envelope::instance_key("s0", at),
            attempt: 0,
            start: T0 + s * 1000 + 10,
            end: Some((T0 + s * 1000 + 100, 0)),
        }
    }

    fn rules(times: &ScheduleTimes, s: &ScheduleDraw, seconds: &[i64]) -> Vec<&'static str> {
        let runs: Vec<Run> = seconds.iter().map(|t| run(*t)).collect();
        let mut by_key: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
        for r in &runs {
            by_key.entry(r.key.as_str()).or_default().push(r);
        }
        times.forbidden(s, &by_key).iter().map(|f| f.rule).collect()
    }

    /// Applied at 0 s, edited to 2 s at 5 s, deleted at 11 s: the first rule's instants to
    /// 1.5 s before the edit, the second's from 1 s after it to 1.5 s before the delete.
    #[test]
    fn an_edit_and_a_delete_bound_the_instants_that_must_run_and_those_that_must_not() {
        let s = drawn(false);
        let times = ScheduleTimes {
            applied: Some((T0, T0 + 100)),
            edits: vec![(T0 + 5_000, T0 + 5_100, 2)],
            deleted: Some((T0 + 11_000, T0 + 11_100)),
            calendar: vec![],
        };
        let want: Vec<i64> = [2, 3, 8].iter().map(|s| T0 + s * 1000).collect();
        assert_eq!(times.expected(&s, (T0 - 5_000, T0 + 30_000)), want);
        assert_eq!(
            rules(&times, &s, &[1, 2, 3, 4, 6, 8, 10, 12]),
            Vec::<&str>::new()
        );
        assert_eq!(rules(&times, &s, &[-1, 14]), ["catch_up", "after_delete"]);
        assert_eq!(rules(&times, &s, &[7]), ["off_rule"]);
    }

    /// A calendar holding the instants' local date (UTC+14) from 4 s to 8 s: the instants
    /// between (its changes' margins left out) must not run, those outside must.
    #[test]
    fn a_calendar_excludes_its_local_dates_while_it_holds_them() {
        let s = drawn(true);
        let today = s.local_date(T0);
        let times = ScheduleTimes {
            applied: Some((T0 - 5_000, T0 - 4_900)),
            calendar: vec![
                (T0 + 4_000, T0 + 4_100, vec![today]),
                (T0 + 8_000, T0 + 8_100, vec![]),
            ],
            ..ScheduleTimes::default()
        };
        let want: Vec<i64> = [-3, -2, -1, 0, 1, 2, 10, 11]
            .iter()
            .map(|s| T0 + s * 1000)
            .collect();
        assert_eq!(times.expected(&s, (T0 - 10_000, T0 + 13_000)), want);
        assert_eq!(rules(&times, &s, &[2, 3, 4, 5, 9, 10]), Vec::<&str>::new());
        assert_eq!(rules(&times, &s, &[6]), ["calendar"]);
        let other = ScheduleDraw {
            zone: ("Etc/GMT+10", -10),
            ..drawn(true)
        };
        let elsewhere = other.local_date(T0) != today;
        assert_eq!(rules(&times, &other, &[6]).is_empty(), elsewhere);
    }
}
