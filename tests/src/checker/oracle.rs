//! The randomized checker's oracle (docs/soak.md#the-randomized-checker): what must hold,
//! derived from the drawn round (config and events), the times the harness did things, and the
//! tasks' effect log alone — never from drumline's journal, run records or Redis.

use super::draw::{JobDraw, Round, AFTER_TIMEOUT, PERMANENT, RETRY_DELAY};
use super::schedules::ScheduleTimes;
use chrono::{DateTime, Utc};
use drumline_shared::envelope::{instance_key, parse_instant};
use std::collections::BTreeMap;

/// One broken promise the oracle sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The instance's key.
    pub key: String,
    /// Its job.
    pub job: String,
    /// `doubled`, `over_bound`, `retry_dropped`, `overlap`, `missed`, `order`, and for a
    /// schedule applied at run time `catch_up`, `after_delete`, `calendar`.
    pub rule: &'static str,
    /// What shows it.
    pub detail: String,
}

/// One run of a task, from its `start` line and (unless it was killed) its `end` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    /// The instance.
    pub key: String,
    /// `DRUMLINE_ATTEMPT`.
    pub attempt: u32,
    /// Wall time of the start line, ms.
    pub start: i64,
    /// Wall time and exit code of the end line.
    pub end: Option<(i64, i32)>,
}

/// The runs in the effect log, each end paired with its key's and attempt's latest start.
pub fn runs(lines: &[String]) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    for line in lines {
        let parts: Vec<&str> = line.split(' ').collect();
        let (Some(key), Some(attempt), Some(at)) = (
            parts.get(1),
            parts.get(2).and_then(|a| a.parse().ok()),
            parts.get(3).and_then(|t| t.parse().ok()),
        ) else {
            continue;
        };
        match (parts[0], parts.get(4).and_then(|c| c.parse().ok())) {
            ("start", _) => out.push(Run {
                key: (*key).to_owned(),
                attempt,
                start: at,
                end: None,
            }),
            ("end", Some(code)) => {
                let open = out
                    .iter_mut()
                    .rev()
                    .find(|r| r.key == *key && r.attempt == attempt && r.end.is_none());
                if let Some(run) = open {
                    run.end = Some((at, code));
                }
            }
            _ => {}
        }
    }
    out
}

/// When the harness did what the round drew (ms, wall time), and the window it judges.
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    /// The members started.
    pub start: i64,
    /// The faults and actions ended; instants up to here (less their jitter) are judged.
    pub judge_end: i64,
    /// Per job: paused from, resumed at.
    pub pauses: Vec<(usize, i64, i64)>,
    /// When a beat was killed.
    pub beat_kills: Vec<i64>,
    /// When a worker was killed (kill -9).
    pub worker_kills: Vec<i64>,
    /// When a worker was stopped (SIGSTOP) and continued: a copy it had prefetched waits.
    pub freezes: Vec<(i64, i64)>,
    /// Per job: the backfilled instants.
    pub backfills: Vec<(usize, Vec<DateTime<Utc>>)>,
    /// Per job: the key `drumline trigger` printed.
    pub triggers: Vec<(usize, String)>,
    /// Per job: when its config changed to a new `every` (whole seconds), SIGHUP sent.
    pub reloads: Vec<(usize, i64, u32)>,
    /// Per drawn schedule (by index): what was done to it and when.
    pub schedules: Vec<ScheduleTimes>,
    /// How long a beat's takeover may take: its leader lease, `misfire_threshold` and slack.
    pub takeover_ms: i64,
    /// When the effect log was read: a failure more recent than a retry delay and slack may
    /// still have its retry on the way.
    pub now: i64,
}

/// Every finding of `round` over the effect `lines`.
pub fn judge(round: &Round, timeline: &Timeline, lines: &[String]) -> Vec<Finding> {
    let all = runs(lines);
    let mut out = Vec::new();
    for (j, job) in round.jobs.iter().enumerate() {
        let by_key = of_job(job, timeline, &all, &mut out);
        match job.after {
            None => {
                let instants = scheduled(j, job, timeline);
                out.extend(at_least_once(j, job, timeline, &by_key, instants));
            }
            Some(up) => out.extend(follows(job, &round.jobs[up], timeline, &all, &by_key)),
        }
    }
    let none = ScheduleTimes::default();
    for (k, s) in round.schedules.iter().enumerate() {
        let by_key = of_job(&s.job, timeline, &all, &mut out);
        let times = timeline.schedules.get(k).unwrap_or(&none);
        let instants = times.expected(s, (timeline.start, timeline.judge_end));
        // Its index is past the file's jobs: no pause, backfill, trigger or reload names it.
        let j = round.jobs.len() + k;
        out.extend(at_least_once(j, &s.job, timeline, &by_key, instants));
        out.extend(times.forbidden(s, &by_key));
    }
    out
}

/// The job's runs by key, after the rules every job keeps (per key, and no overlap but under
/// `allow`) are held and their findings pushed to `out`.
fn of_job<'a>(
    job: &JobDraw,
    timeline: &Timeline,
    all: &'a [Run],
    out: &mut Vec<Finding>,
) -> BTreeMap<&'a str, Vec<&'a Run>> {
    let prefix = format!("{}@", job.name);
    let mine: Vec<&Run> = all.iter().filter(|r| r.key.starts_with(&prefix)).collect();
    let mut by_key: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
    for r in &mine {
        by_key.entry(r.key.as_str()).or_default().push(r);
    }
    for (key, runs) in &by_key {
        // A retry of an instance after the judged window may still be on its way.
        let judged = instant_ms(key).is_some_and(|t| t <= timeline.judge_end);
        let now = judged.then_some(timeline.now);
        out.extend(per_key(job, key, runs, (now, &timeline.worker_kills)));
    }
    if job.overlap != "allow" {
        out.extend(overlaps(job, &mine));
    }
    by_key
}

/// A finding of `rule` of `job`'s `key`.
pub(crate) fn finding(job: &JobDraw, key: &str, rule: &'static str, detail: String) -> Finding {
    Finding {
        key: key.to_owned(),
        job: job.name.clone(),
        rule,
        detail,
    }
}

/// At most one success, attempts within `max_retries`, and (for an instant of the judged
/// window, the log read at `judged`) a retryable failure followed by its retry. A success a
/// worker was killed right after (within 2 s of its end: the outcome not written yet) may run
/// again: the documented limit (docs/guarantees.md), not a double.
fn per_key(
    job: &JobDraw,
    key: &str,
    runs: &[&Run],
    (judged, kills): (Option<i64>, &[i64]),
) -> Vec<Finding> {
    let mut out = Vec::new();
    let ends: Vec<i64> = runs
        .iter()
        .filter_map(|r| r.end.filter(|e| e.1 == 0).map(|e| e.0))
        .collect();
    let unrecorded = |end: &i64| kills.iter().any(|k| (end - 200..=end + 2_000).contains(k));
    let repeats = ends.iter().filter(|e| unrecorded(e)).count();
    let successes = ends.len() - repeats.min(ends.len().saturating_sub(1));
    if successes > 1 {
        out.push(finding(
            job,
            key,
            "doubled",
            format!("{successes} successful runs"),
        ));
    }
    if let Some(r) = runs.iter().find(|r| r.attempt > job.max_retries) {
        let detail = format!("attempt {} ran, max_retries {}", r.attempt, job.max_retries);
        out.push(finding(job, key, "over_bound", detail));
    }
    let last = runs
        .iter()
        .filter(|_| judged.is_some())
        .max_by_key(|r| (r.attempt, r.start));
    let retry_due = RETRY_DELAY.as_millis() as i64 * 6 / 5 + 3_000;
    if let Some(Run {
        attempt,
        end: Some((at, 1)),
        ..
    }) = last.map(|r| &**r)
    {
        let waited = judged.is_some_and(|now| now - at > retry_due);
        if *attempt < job.max_retries && waited && !expired_by(job, key, at + retry_due) {
            let detail = format!(
                "attempt {attempt} failed retryably and attempt {} never ran",
                attempt + 1
            );
            out.push(finding(job, key, "retry_dropped", detail));
        }
    }
    out
}

/// Whether `key`'s `expires` (from its instant, jitter and slack included) has passed at `ms`.
fn expired_by(job: &JobDraw, key: &str, ms: i64) -> bool {
    let (Some(expires), Some(t)) = (job.expires_s, instant_ms(key)) else {
        return false;
    };
    let jitter = i64::from(job.jitter_s.unwrap_or(0)) * 1000;
    ms + 3_000 > t + jitter + i64::from(expires) * 1000
}

/// The instant `key` names, ms.
pub(crate) fn instant_ms(key: &str) -> Option<i64> {
    let text = key.split_once('@')?.1;
    Some(parse_instant(text)?.timestamp_millis())
}

/// Two runs of different instances of a `skip` or `queue` job that overlap in time.
fn overlaps(job: &JobDraw, runs: &[&Run]) -> Vec<Finding> {
    let mut ended: Vec<(i64, i64, &str)> = runs
        .iter()
        .filter_map(|r| Some((r.start, r.end?.0, r.key.as_str())))
        .collect();
    ended.sort_unstable();
    let mut out = Vec::new();
    let mut longest: Option<(i64, &str)> = None;
    for (start, end, key) in ended {
        if let Some((prev_end, prev_key)) = longest {
            if prev_key != key && prev_end > start {
                let detail = format!("ran {} ms inside {prev_key}'s run", prev_end - start);
                out.push(finding(job, key, "overlap", detail));
            }
        }
        if longest.is_none_or(|(e, _)| end > e) {
            longest = Some((end, key));
        }
    }
    out
}

/// Whether `runs` end the instance: a success, a permanent failure, or the last attempt's.
fn finished(job: &JobDraw, runs: &[&Run]) -> bool {
    runs.iter().any(|r| match r.end {
        Some((_, 0)) | Some((_, PERMANENT)) => true,
        Some((_, _)) => r.attempt >= job.max_retries,
        None => false,
    })
}

/// A follower's instance for T runs only once its upstream's instance for T has succeeded
/// (`order`); and when that success came within the play and within `after_timeout` of T
/// (jitter included), it runs to its end (`missed`). Triggered and backfilled upstream
/// instances run alone (docs/configuration.md#job-dependencies): nothing is asked of them.
fn follows(
    job: &JobDraw,
    up: &JobDraw,
    timeline: &Timeline,
    all: &[Run],
    by_key: &BTreeMap<&str, Vec<&Run>>,
) -> Vec<Finding> {
    let prefix = format!("{}@", up.name);
    let mut succeeded: BTreeMap<i64, i64> = BTreeMap::new();
    for r in all.iter().filter(|r| r.key.starts_with(&prefix)) {
        if let (Some(t), Some((end, 0))) = (instant_ms(&r.key), r.end) {
            let first = succeeded.entry(t).or_insert(end);
            *first = (*first).min(end);
        }
    }
    let mut out = Vec::new();
    for (key, runs) in by_key {
        let Some(t) = instant_ms(key) else { continue };
        let after = succeeded.get(&t);
        if let Some(r) = runs.iter().find(|r| after.is_none_or(|end| r.start < *end)) {
            let detail = match after {
                Some(end) => format!("ran at {} before its upstream succeeded at {end}", r.start),
                None => format!("ran at {} though its upstream never succeeded", r.start),
            };
            out.push(finding(job, key, "order", detail));
        }
    }
    let jitter = i64::from(up.jitter_s.unwrap_or(0)) * 1000;
    let timeout = AFTER_TIMEOUT.as_millis() as i64;
    let operator = |t: i64| {
        t < timeline.start
            || timeline
                .triggers
                .iter()
                .any(|(_, k)| instant_ms(k) == Some(t))
    };
    for (t, end) in &succeeded {
        if *end > timeline.judge_end || *end > t + jitter + timeout - 2_000 || operator(*t) {
            continue;
        }
        let at = DateTime::from_timestamp_millis(*t).expect("an instant");
        let key = instance_key(&job.name, at);
        let runs = by_key.get(key.as_str()).map_or(&[][..], Vec::as_slice);
        if !finished(job, runs) {
            let detail = format!(
                "its upstream succeeded at {end}; {} runs, none final",
                runs.len()
            );
            out.push(finding(job, &key, "missed", detail));
        }
    }
    out
}

/// How an instance the oracle expects to end came to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// The job's schedule: pauses, a takeover and (`skip`) another instance excuse it.
    Scheduled,
    /// `drumline backfill`: nothing excuses it.
    Backfilled,
    /// `drumline trigger`: under `skip`, another instance holding the job excuses it.
    Triggered,
}

/// Every instant judged (and every backfilled or triggered one) ends, unless the round excuses
/// it: paused, a beat's takeover, or (`skip`) another instance holding the job when it came.
fn at_least_once(
    j: usize,
    job: &JobDraw,
    timeline: &Timeline,
    by_key: &BTreeMap<&str, Vec<&Run>>,
    instants: Vec<i64>,
) -> Vec<Finding> {
    let holds = holds(job, by_key);
    let mut out = Vec::new();
    for (key, t, origin) in expected(j, job, timeline, instants) {
        let runs = by_key.get(key.as_str()).map_or(&[][..], Vec::as_slice);
        if finished(job, runs) {
            continue;
        }
        let excuse = match origin {
            Origin::Scheduled => excused(j, job, timeline, &holds, (&key, t)),
            Origin::Triggered => held(&holds, (&key, t), t + 1_500),
            Origin::Backfilled => false,
        };
        if excuse {
            continue;
        }
        let detail = if runs.is_empty() {
            "never ran".to_owned()
        } else {
            format!("{} runs, none final", runs.len())
        };
        out.push(finding(job, &key, "missed", detail));
    }
    out
}

/// The instances of job `j` that must end, its scheduled `instants` and what the operator
/// added: (key, instant in ms, origin).
fn expected(
    j: usize,
    job: &JobDraw,
    timeline: &Timeline,
    instants: Vec<i64>,
) -> Vec<(String, i64, Origin)> {
    let key = |t: i64| {
        let at = DateTime::from_timestamp_millis(t).expect("an instant");
        instance_key(&job.name, at)
    };
    let mut out: Vec<(String, i64, Origin)> = instants
        .into_iter()
        .map(|t| (key(t), t, Origin::Scheduled))
        .collect();
    let backfilled = timeline.backfills.iter().filter(|(b, _)| *b == j);
    for t in backfilled.flat_map(|(_, ts)| ts.iter().map(|t| t.timestamp_millis())) {
        out.retain(|(_, s, _)| *s != t);
        out.push((key(t), t, Origin::Backfilled));
    }
    let triggered = timeline.triggers.iter().filter(|(t, _)| *t == j);
    for (_, k) in triggered {
        let t = instant_ms(k).expect("a trigger's key names its instant");
        out.push((k.clone(), t, Origin::Triggered));
    }
    out
}

/// How long before and after a reload the oracle leaves the job's instants unjudged: either
/// rule may own them (the beat reloads when it reads the signal).
const RELOAD_SLACK_MS: i64 = 1_500;

/// The job's scheduled instants the round judges, each rule from when it was in force: from
/// 5 s after the start (or [`RELOAD_SLACK_MS`] after a reload) to the judged window's end (or
/// as long before the next reload), jitter included.
fn scheduled(j: usize, job: &JobDraw, timeline: &Timeline) -> Vec<i64> {
    let jitter = i64::from(job.jitter_s.unwrap_or(0)) * 1000;
    let mut rules = vec![(timeline.start + 5_000, job.every_s)];
    let reloads = timeline.reloads.iter().filter(|(r, _, _)| *r == j);
    rules.extend(reloads.map(|(_, at, every)| (at + RELOAD_SLACK_MS, *every)));
    let mut out = Vec::new();
    for (k, (from, every)) in rules.iter().enumerate() {
        let period = i64::from(*every) * 1000;
        let until = rules
            .get(k + 1)
            .map_or(timeline.judge_end - 2_000, |(next, _)| {
                next - 2 * RELOAD_SLACK_MS
            });
        let first = from.div_euclid(period) * period + period;
        let instants = (0..).map(|n| first + n * period);
        out.extend(instants.take_while(|t| t + jitter <= until));
    }
    out
}

/// Per instance of the job: from its first start to its last end (or last start), ms.
fn holds<'a>(job: &JobDraw, by_key: &BTreeMap<&'a str, Vec<&Run>>) -> Vec<(&'a str, i64, i64)> {
    if job.overlap != "skip" {
        return Vec::new();
    }
    by_key
        .iter()
        .filter_map(|(key, runs)| {
            let from = runs.iter().map(|r| r.start).min()?;
            let to = runs.iter().map(|r| r.end.map_or(r.start, |e| e.0)).max()?;
            Some((*key, from, to))
        })
        .collect()
}

fn excused(
    j: usize,
    job: &JobDraw,
    timeline: &Timeline,
    holds: &[(&str, i64, i64)],
    (key, t): (&str, i64),
) -> bool {
    let jitter = i64::from(job.jitter_s.unwrap_or(0)) * 1000;
    let paused = timeline.pauses.iter().any(|(p, from, to)| {
        *p == j && from - 1_500 <= t + jitter && t <= to.saturating_add(2_500)
    });
    let takeover = timeline
        .beat_kills
        .iter()
        .any(|k| k - 1_000 <= t + jitter && t <= k + timeline.takeover_ms);
    // The instance comes to be claimed by `came`: soon after it is due, or, when a frozen
    // worker may have held its copy, soon after that worker continued.
    let due = t + jitter + 1_500;
    let came = timeline
        .freezes
        .iter()
        .filter(|(from, to)| *from <= due && t <= *to)
        .map(|(_, to)| to.saturating_add(1_500))
        .fold(due, i64::max);
    paused || takeover || held(holds, (key, t), came)
}

/// Whether another instance held the job (`skip`) between instant `t` and `came`.
fn held(holds: &[(&str, i64, i64)], (key, t): (&str, i64), came: i64) -> bool {
    holds
        .iter()
        .any(|(k, from, to)| *k != key && *from - 500 <= came && t - 500 <= *to)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn job(overlap: &'static str, max_retries: u32) -> JobDraw {
        JobDraw {
            name: "j0".into(),
            every_s: 1,
            overlap,
            run: Duration::from_millis(100),
            fail_pct: 0,
            permanent_pct: 0,
            max_retries,
            expires_s: None,
            jitter_s: None,
            after: None,
        }
    }

    fn round(job: JobDraw) -> Round {
        Round {
            seed: 1,
            jobs: vec![job],
            schedules: vec![],
            events: vec![],
            length: Duration::from_secs(20),
        }
    }

    const T0: i64 = 1_800_000_000_000;

    fn key(s: i64) -> String {
        instance_key(
            "j0",
            DateTime::from_timestamp_millis(T0 + s * 1000).unwrap(),
        )
    }

    /// Start and end lines of one run of instant `s` (seconds after T0).
    fn ran(s: i64, attempt: u32, (from, to): (i64, i64), code: i32) -> Vec<String> {
        let k = key(s);
        vec![
            format!("start {k} {attempt} {from}"),
            format!("end {k} {attempt} {to} {code}"),
        ]
    }

    fn timeline(seconds: i64) -> Timeline {
        Timeline {
            start: T0 - 5_000,
            judge_end: T0 + seconds * 1000 + 2_000,
            takeover_ms: 10_000,
            now: T0 + seconds * 1000 + 60_000,
            ..Timeline::default()
        }
    }

    fn rules(f: &[Finding]) -> Vec<&'static str> {
        f.iter().map(|f| f.rule).collect()
    }

    /// Instants 1..=3 (T0 is the first judged: start + 5 s rounded up).
    fn clean() -> Vec<String> {
        (0..4)
            .flat_map(|s| ran(s, 0, (T0 + s * 1000 + 10, T0 + s * 1000 + 100), 0))
            .collect()
    }

    #[test]
    fn a_clean_log_holds_and_a_missing_instant_does_not() {
        let r = round(job("queue", 0));
        assert_eq!(judge(&r, &timeline(3), &clean()), vec![]);
        let mut gone = clean();
        gone.drain(2..4);
        assert_eq!(rules(&judge(&r, &timeline(3), &gone)), ["missed"]);
    }

    #[test]
    fn two_successes_too_many_attempts_and_a_dropped_retry_are_found() {
        let r = round(job("allow", 1));
        let mut lines = clean();
        lines.extend(ran(0, 0, (T0 + 200, T0 + 300), 0));
        assert_eq!(rules(&judge(&r, &timeline(3), &lines)), ["doubled"]);
        let mut lines = clean();
        lines.extend(ran(1, 2, (T0 + 1_200, T0 + 1_300), 1));
        assert!(rules(&judge(&r, &timeline(3), &lines)).contains(&"over_bound"));
        // Instant 2 failed its attempt 0 with a retry left, and nothing followed.
        let mut lines: Vec<String> = clean().into_iter().take(4).collect();
        lines.extend(ran(2, 0, (T0 + 2_010, T0 + 2_100), 1));
        lines.extend(ran(3, 0, (T0 + 3_010, T0 + 3_100), 0));
        assert_eq!(
            rules(&judge(&r, &timeline(3), &lines)),
            ["retry_dropped", "missed"]
        );
    }

    #[test]
    fn overlapping_runs_of_a_skip_job_are_found_and_the_skipped_instant_excused() {
        let r = round(job("skip", 0));
        // Instant 1 runs 1.5 s: instant 2 is skipped (excused), instant 3 runs after it.
        let mut lines = ran(0, 0, (T0 + 10, T0 + 100), 0);
        lines.extend(ran(1, 0, (T0 + 1_010, T0 + 2_510), 0));
        lines.extend(ran(3, 0, (T0 + 3_010, T0 + 3_100), 0));
        assert_eq!(judge(&r, &timeline(3), &lines), vec![]);
        lines.extend(ran(2, 0, (T0 + 2_010, T0 + 2_100), 0));
        assert_eq!(rules(&judge(&r, &timeline(3), &lines)), ["overlap"]);
        // Under `queue` nothing excuses the skip.
        let q = round(job("queue", 0));
        let mut lines = ran(0, 0, (T0 + 10, T0 + 100), 0);
        lines.extend(ran(1, 0, (T0 + 1_010, T0 + 2_510), 0));
        lines.extend(ran(3, 0, (T0 + 3_010, T0 + 3_100), 0));
        assert_eq!(rules(&judge(&q, &timeline(3), &lines)), ["missed"]);
    }

    #[test]
    fn pauses_and_a_beats_takeover_excuse_absent_instants() {
        let r = round(job("queue", 0));
        let lines: Vec<String> = clean().into_iter().take(2).collect();
        let mut t = timeline(3);
        t.pauses.push((0, T0 + 1_000, T0 + 3_000));
        assert_eq!(judge(&r, &t, &lines), vec![]);
        let mut t = timeline(3);
        t.beat_kills.push(T0 + 500);
        assert_eq!(judge(&r, &t, &lines), vec![]);
    }

    /// Under `skip`, an instance whose copy a frozen worker held is skipped by the next one if
    /// that one runs when the frozen worker continues: excused while the freeze lasted.
    #[test]
    fn a_copy_held_by_a_frozen_worker_may_be_skipped_by_the_next_instance() {
        let r = round(JobDraw {
            every_s: 3,
            ..job("skip", 0)
        });
        // Instant 3's copy sat in a frozen worker until 6.5 s; instant 6 ran from 6.01 s.
        let mut lines = ran(6, 0, (T0 + 6_010, T0 + 7_900), 0);
        lines.extend(ran(9, 0, (T0 + 9_010, T0 + 9_100), 0));
        let mut t = timeline(9);
        assert_eq!(
            rules(&judge(&r, &t, &lines)),
            ["missed"],
            "3 is not excused"
        );
        t.freezes.push((T0 + 2_900, T0 + 6_500));
        assert_eq!(judge(&r, &t, &lines), vec![]);
    }

    /// Each rule judges its own instants, those within the slack of the reload neither; a
    /// trigger's key must end like any instance.
    #[test]
    fn a_reload_changes_the_instants_judged_and_a_trigger_must_end() {
        let r = round(job("queue", 0));
        let mut t = timeline(10);
        t.reloads.push((0, T0 + 4_000, 2));
        let run = |s: i64| ran(s, 0, (T0 + s * 1000 + 10, T0 + s * 1000 + 100), 0);
        let lines: Vec<String> = [1, 2, 6, 8, 10].into_iter().flat_map(run).collect();
        assert_eq!(judge(&r, &t, &lines), vec![]);
        let gone: Vec<String> = [1, 2, 6, 10].into_iter().flat_map(run).collect();
        assert_eq!(rules(&judge(&r, &t, &gone)), ["missed"]);
        let at = DateTime::from_timestamp_millis(T0 + 7_123).unwrap();
        let trigger = instance_key("j0", at);
        t.triggers.push((0, trigger.clone()));
        let found = judge(&r, &t, &lines);
        assert_eq!(rules(&found), ["missed"]);
        assert_eq!(found[0].key, trigger);
        let mut lines = lines;
        lines.push(format!("start {trigger} 0 {}", T0 + 7_200));
        lines.push(format!("end {trigger} 0 {} 0", T0 + 7_300));
        assert_eq!(judge(&r, &t, &lines), vec![]);
    }

    /// A follower runs after its upstream's success, for each instant that succeeded, and
    /// never for one that did not.
    #[test]
    fn a_follower_runs_after_each_upstream_success_and_only_then() {
        let follower = JobDraw {
            name: "j1".into(),
            after: Some(0),
            ..job("allow", 0)
        };
        let r = Round {
            jobs: vec![job("queue", 0), follower],
            ..round(job("queue", 0))
        };
        let t = timeline(3);
        let follow = |s: i64, from: i64| {
            let at = DateTime::from_timestamp_millis(T0 + s * 1000).unwrap();
            let k = instance_key("j1", at);
            vec![
                format!("start {k} 0 {}", T0 + from),
                format!("end {k} 0 {} 0", T0 + from + 50),
            ]
        };
        let mut lines = clean();
        for s in 0..4 {
            lines.extend(follow(s, s * 1000 + 150));
        }
        assert_eq!(judge(&r, &t, &lines), vec![]);
        // Instant 2's follower never ran; instant 3's ran before its upstream ended.
        let mut lines = clean();
        lines.extend(follow(0, 150));
        lines.extend(follow(1, 1_150));
        lines.extend(follow(3, 3_050));
        assert_eq!(rules(&judge(&r, &t, &lines)), ["order", "missed"]);
        // A follower of an instant whose upstream never succeeded.
        let mut lines: Vec<String> = clean().into_iter().take(6).collect();
        lines.extend(follow(0, 150));
        lines.extend(follow(1, 1_150));
        lines.extend(follow(2, 2_150));
        lines.extend(follow(3, 3_150));
        let found = judge(&r, &t, &lines);
        assert!(
            found
                .iter()
                .any(|f| f.rule == "order" && f.key.contains("03Z")),
            "{found:?}"
        );
    }

    /// A worker killed right after a success, before its outcome was written: the repeat is
    /// the documented limit, not a double; with no kill near it, two successes are.
    #[test]
    fn a_success_its_worker_died_after_may_run_again() {
        let r = round(job("allow", 0));
        let mut lines = clean();
        lines.extend(ran(0, 0, (T0 + 5_000, T0 + 5_100), 0));
        let mut t = timeline(3);
        assert_eq!(rules(&judge(&r, &t, &lines)), ["doubled"]);
        t.worker_kills.push(T0 + 130);
        assert_eq!(judge(&r, &t, &lines), vec![]);
    }

    #[test]
    fn a_killed_run_is_repeated_and_a_final_failure_ends_the_instance() {
        let r = round(job("allow", 1));
        let mut lines = clean();
        lines.push(format!("start {} 0 {}", key(4), T0 + 4_010));
        lines.extend(ran(4, 0, (T0 + 9_000, T0 + 9_100), 1));
        lines.extend(ran(4, 1, (T0 + 10_200, T0 + 10_300), 1));
        assert_eq!(judge(&r, &timeline(4), &lines), vec![]);
    }
}
