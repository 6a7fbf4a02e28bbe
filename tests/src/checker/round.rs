//! One round of the randomized checker: start the members, play the drawn events, settle,
//! judge with the oracle, run `drumline verify` and hold the two against each other.

use super::draw::{self, Event, Round, BEATS, WORKERS};
use super::oracle::{self, Finding, Timeline};
use super::schedules::{calendar_object, ScheduleTimes};
use crate::probe::api_request;
use crate::{binary, Proc, TestEnv};
use chrono::{DateTime, Utc};
use drumline_shared::envelope::parse_instant;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `[beat] leader_lease` of every round: a killed leader's standby takes over within it.
const LEADER_LEASE_S: i64 = 3;
/// `verify --overdue` of every round.
const OVERDUE_S: i64 = 10;
/// The API token of a round with schedules (`DRUMLINE_API_TOKEN`).
const TOKEN: &str = "checker-token";

/// What one round found.
#[derive(Debug)]
pub struct RoundVerdict {
    /// Its seed.
    pub seed: u64,
    /// What was drawn.
    pub round: Round,
    /// The oracle's findings.
    pub findings: Vec<Finding>,
    /// `verify`'s violations: (rule, key).
    pub verify: Vec<(String, String)>,
    /// Where `verify` and the oracle disagree.
    pub disagreements: Vec<String>,
    /// How long the round took.
    pub took: Duration,
    /// Where its files are.
    pub dir: std::path::PathBuf,
}

impl RoundVerdict {
    /// True when the oracle found nothing and `verify` agreed.
    pub fn holds(&self) -> bool {
        self.findings.is_empty() && self.disagreements.is_empty()
    }

    /// One paragraph for the log.
    pub fn summary(&self, elapsed: Duration) -> String {
        let mut out = format!(
            "checker: seed {} ({} jobs, {} schedules, {} events) {} in {:.0}s (at {:.0}s): {} oracle findings, {} verify violations, {} disagreements; files in {}",
            self.seed,
            self.round.jobs.len(),
            self.round.schedules.len(),
            self.round.events.len(),
            if self.holds() { "holds" } else { "FAILS" },
            self.took.as_secs_f64(),
            elapsed.as_secs_f64(),
            self.findings.len(),
            self.verify.len(),
            self.disagreements.len(),
            self.dir.display()
        );
        for f in self.findings.iter().take(10) {
            out.push_str(&format!("\n  oracle: {} {}: {}", f.rule, f.key, f.detail));
        }
        for d in self.disagreements.iter().take(10) {
            out.push_str(&format!("\n  disagreement: {d}"));
        }
        if !self.holds() {
            out.push_str(&format!("\n  round: {:?}", self.round));
        }
        out
    }
}

/// The running members and what was done to them.
struct Members<'a> {
    env: &'a TestEnv,
    config: String,
    /// Where the tasks append their effects.
    log: std::path::PathBuf,
    /// Each job's `every` in the config file now.
    periods: Vec<u32>,
    vars: Vec<(&'static str, String)>,
    beats: Vec<Option<Proc>>,
    workers: Vec<Option<Proc>>,
    starts: u32,
    /// Each beat's API port (`--api-addr`), when the round has schedules.
    api: Vec<u16>,
}

impl Members<'_> {
    fn start(&mut self, beat: bool, i: usize) {
        self.starts += 1;
        let label = format!(
            "{}-{i}.{}",
            if beat { "beat" } else { "worker" },
            self.starts
        );
        let vars: Vec<(&str, &str)> = self.vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let addr = self.api.get(i).map(|port| format!("127.0.0.1:{port}"));
        let mut args = vec!["--config", self.config.as_str()];
        if let Some(addr) = addr.as_deref().filter(|_| beat) {
            args.extend(["--api-addr", addr]);
        }
        if beat {
            self.beats[i] = Some(self.env.beat_with_env(&label, &args, &vars));
        } else {
            self.workers[i] = Some(self.env.worker_with_env(&label, &args, &vars));
        }
    }

    fn slot(&mut self, beat: bool, i: usize) -> &mut Option<Proc> {
        if beat {
            &mut self.beats[i]
        } else {
            &mut self.workers[i]
        }
    }

    /// A command line tool of the round (`drumline ARGS`): success, stdout, and both outputs.
    fn cli(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(binary("drumline"))
            .arg("--config")
            .arg(&self.config)
            .args(args)
            .env_remove("DRUMLINE_CONFIG")
            .env_remove("DRUMLINE_PLANTED_DEFECT")
            .envs(self.vars.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .output()
            .expect("run drumline");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let both = stdout.clone() + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), stdout, both)
    }

    /// The API port of beat `api` while it runs.
    fn api_of(&self, api: Option<usize>) -> Option<u16> {
        let i = api?;
        self.beats[i].as_ref().and(self.api.get(i).copied())
    }

    /// `drumline KIND apply FILE` of `object`, which must succeed.
    fn apply_file(&self, kind: &str, object: &serde_json::Value) {
        let file = self.env.path(&format!("{kind}.json"));
        std::fs::write(&file, object.to_string()).expect("write the object");
        let file = file.to_str().expect("utf-8 path");
        let (ok, _, out) = self.cli(&[kind, "apply", file]);
        assert!(ok, "{kind} apply {object}: {out}");
    }

    /// Stores schedule `object` through beat `api`'s API (`PUT`), or by the CLI when that beat
    /// does not answer.
    fn store(&self, api: Option<usize>, object: &serde_json::Value) {
        let name = object["name"].as_str().expect("a name");
        let request = format!("PUT /api/v1/schedules/{name}");
        let body = object.to_string();
        let answer = self
            .api_of(api)
            .and_then(|port| api_request(port, &request, Some(TOKEN), &body));
        match answer {
            Some((status, _, body)) => {
                assert!(matches!(status, 200 | 201), "{request}: {status} {body}")
            }
            None => self.apply_file("schedules", object),
        }
    }

    /// Deletes schedule `name` through beat `api`'s API, or by the CLI.
    fn delete(&self, api: Option<usize>, name: &str) {
        let request = format!("DELETE /api/v1/schedules/{name}");
        let answer = self
            .api_of(api)
            .and_then(|port| api_request(port, &request, Some(TOKEN), ""));
        match answer {
            Some((status, _, body)) => assert_eq!(status, 204, "{request}: {body}"),
            None => {
                let (ok, _, out) = self.cli(&["schedules", "delete", name]);
                assert!(ok, "schedules delete {name}: {out}");
            }
        }
    }
}

/// A step of the round's schedule: an event, or the undoing of one.
#[derive(Debug, Clone)]
enum Step {
    Do(Event),
    Restart { beat: bool, i: usize },
    Thaw(usize),
    Resume(usize),
}

fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

/// Runs round `seed` of `length` (with `defect` planted, if any) and judges it.
pub fn run_round(seed: u64, length: Duration, defect: Option<&str>) -> RoundVerdict {
    let began = Instant::now();
    let round = draw::round(seed, length);
    let env = crate::setup(&format!("checker_{seed}"));
    let log = env.path("effects");
    let cfg = round
        .config(&log)
        .set("beat", "leader_lease", &format!("\"{LEADER_LEASE_S}s\""));
    let config = env.write_config("drumline.toml", &cfg);
    let mut vars: Vec<(&str, String)> = defect
        .map(|d| vec![("DRUMLINE_PLANTED_DEFECT", d.to_owned())])
        .unwrap_or_default();
    let mut api = Vec::new();
    if !round.schedules.is_empty() {
        vars.push(("DRUMLINE_API_TOKEN", TOKEN.to_owned()));
        api = (0..BEATS).map(|_| crate::unused_port()).collect();
    }
    let mut members = Members {
        env: &env,
        config: config.to_str().expect("utf-8 path").to_owned(),
        log: log.clone(),
        periods: round.jobs.iter().map(|j| j.every_s).collect(),
        vars,
        beats: (0..BEATS).map(|_| None).collect(),
        workers: (0..WORKERS).map(|_| None).collect(),
        starts: 0,
        api,
    };
    for i in 0..WORKERS {
        members.start(false, i);
    }
    for i in 0..BEATS {
        members.start(true, i);
    }
    let mut timeline = Timeline {
        start: now_ms(),
        takeover_ms: (LEADER_LEASE_S + 5 + 3) * 1000,
        schedules: vec![ScheduleTimes::default(); round.schedules.len()],
        ..Timeline::default()
    };
    play(&round, &mut members, &mut timeline, began);
    timeline.judge_end = now_ms();
    settle(&round, &mut timeline, &env);
    timeline.now = now_ms();
    let findings = oracle::judge(&round, &timeline, &env.lines("effects"));
    let since = began.elapsed().as_secs() + 120;
    let verify = verify(&members, since);
    for proc in members
        .beats
        .iter_mut()
        .chain(members.workers.iter_mut())
        .flatten()
    {
        proc.terminate(Duration::from_secs(30));
    }
    let disagreements = cross_check(&round, &timeline, &findings, &verify);
    RoundVerdict {
        seed,
        round,
        findings,
        verify,
        disagreements,
        took: began.elapsed(),
        dir: env.dir.clone(),
    }
}

/// Plays the round's events and their undoing at their times.
fn play(round: &Round, members: &mut Members<'_>, timeline: &mut Timeline, began: Instant) {
    let mut schedule: Vec<(Duration, Step)> = round
        .events
        .iter()
        .map(|(at, e)| (*at, Step::Do(e.clone())))
        .collect();
    while !schedule.is_empty() || began.elapsed() < round.length {
        schedule.sort_by_key(|(at, _)| *at);
        let due = schedule.first().map(|(at, _)| *at).unwrap_or(round.length);
        if let Some(wait) = due.checked_sub(began.elapsed()) {
            std::thread::sleep(wait);
        }
        if schedule.is_empty() {
            break;
        }
        let (at, step) = schedule.remove(0);
        if let Some(undo) = apply(&step, round, members, timeline) {
            schedule.push((at.max(began.elapsed()) + undo.0, undo.1));
        }
    }
}

/// Does `step`; returns what undoes it and after how long.
fn apply(
    step: &Step,
    round: &Round,
    members: &mut Members<'_>,
    timeline: &mut Timeline,
) -> Option<(Duration, Step)> {
    match step {
        Step::Do(Event::Pause { job, for_ }) => {
            let (ok, _, out) = members.cli(&["pause", &round.jobs[*job].name]);
            assert!(ok, "pause: {out}");
            timeline.pauses.push((*job, now_ms(), i64::MAX));
            Some((*for_, Step::Resume(*job)))
        }
        Step::Resume(job) => {
            let (ok, _, out) = members.cli(&["resume", &round.jobs[*job].name]);
            assert!(ok, "resume: {out}");
            // A resume resumes the job however often it was paused: every open pause ends.
            let now = now_ms();
            for p in timeline.pauses.iter_mut() {
                if p.0 == *job && p.2 == i64::MAX {
                    p.2 = now;
                }
            }
            None
        }
        Step::Do(Event::Backfill { job }) => {
            backfill(round, *job, members, timeline);
            None
        }
        Step::Do(Event::KillWorker { i }) => {
            timeline.worker_kills.push(now_ms());
            kill(members, false, *i, Duration::from_secs(1))
        }
        Step::Do(Event::KillBeat { i }) => {
            timeline.beat_kills.push(now_ms());
            kill(members, true, *i, Duration::from_secs(2))
        }
        Step::Restart { beat, i } => {
            members.start(*beat, *i);
            None
        }
        Step::Do(Event::Trigger { job }) => {
            let (ok, out, both) = members.cli(&["trigger", &round.jobs[*job].name]);
            assert!(ok, "trigger: {both}");
            let key = out.split(' ').find_map(|w| w.strip_prefix("key="));
            let key = key.unwrap_or_else(|| panic!("trigger printed no key: {out}"));
            timeline.triggers.push((*job, key.to_owned()));
            None
        }
        Step::Do(Event::Reload { job, every_s }) => {
            reload(round, (*job, *every_s), members, timeline);
            None
        }
        Step::Do(
            e @ (Event::Apply { .. }
            | Event::Edit { .. }
            | Event::Delete { .. }
            | Event::Exclude { .. }
            | Event::Include { .. }),
        ) => {
            as_data(e, round, members, timeline);
            None
        }
        Step::Do(Event::FreezeWorker { i, for_ }) => {
            let proc = members.workers[*i].as_ref()?;
            proc.signal(libc::SIGSTOP);
            timeline.freezes.push((now_ms(), i64::MAX));
            Some((*for_, Step::Thaw(*i)))
        }
        Step::Thaw(i) => {
            if let Some(p) = members.workers[*i].as_ref() {
                p.signal(libc::SIGCONT);
            }
            let now = now_ms();
            for f in timeline.freezes.iter_mut().filter(|f| f.1 == i64::MAX) {
                f.1 = now;
            }
            None
        }
    }
}

fn kill(
    members: &mut Members<'_>,
    beat: bool,
    i: usize,
    back: Duration,
) -> Option<(Duration, Step)> {
    let mut proc = members.slot(beat, i).take()?;
    proc.kill9();
    Some((back, Step::Restart { beat, i }))
}

/// Writes the config with the job's new period and sends SIGHUP to every running member.
fn reload(
    round: &Round,
    (job, every_s): (usize, u32),
    members: &mut Members<'_>,
    timeline: &mut Timeline,
) {
    members.periods[job] = every_s;
    let cfg = round.config_with(&members.log, &members.periods).set(
        "beat",
        "leader_lease",
        &format!("\"{LEADER_LEASE_S}s\""),
    );
    members.env.write_config("drumline.toml", &cfg);
    timeline.reloads.push((job, now_ms(), every_s));
    for proc in members.beats.iter().chain(members.workers.iter()).flatten() {
        proc.signal(libc::SIGHUP);
    }
}

/// Stores, edits or deletes a schedule, or changes its calendar, as `e` says; the times in
/// `timeline`.
fn as_data(e: &Event, round: &Round, members: &Members<'_>, timeline: &mut Timeline) {
    let sent = now_ms();
    match *e {
        Event::Apply { s, api } => {
            let d = &round.schedules[s];
            members.store(api, &d.object(d.job.every_s));
            timeline.schedules[s].applied = Some((sent, now_ms()));
        }
        Event::Edit { s, every_s, api } => {
            members.store(api, &round.schedules[s].object(every_s));
            timeline.schedules[s].edits.push((sent, now_ms(), every_s));
        }
        Event::Delete { s, api } => {
            members.delete(api, &round.schedules[s].job.name);
            timeline.schedules[s].deleted = Some((sent, now_ms()));
        }
        Event::Include { s, delete: true } => {
            let name = round.schedules[s].calendar_name();
            let (ok, _, out) = members.cli(&["calendars", "delete", &name]);
            assert!(ok, "calendars delete {name}: {out}");
            timeline.schedules[s]
                .calendar
                .push((sent, now_ms(), Vec::new()));
        }
        Event::Exclude { s } | Event::Include { s, .. } => {
            let today = matches!(e, Event::Exclude { .. });
            let (object, dates) = calendar_object(&round.schedules[s], today);
            members.apply_file("calendars", &object);
            timeline.schedules[s].calendar.push((sent, now_ms(), dates));
        }
        _ => unreachable!("not a change to a schedule: {e:?}"),
    }
}

/// `drumline backfill JOB` of the ten instants ending 30 s before the round began, under the
/// job's period now (a reload may have changed it).
fn backfill(round: &Round, job: usize, members: &Members<'_>, timeline: &mut Timeline) {
    let period = i64::from(members.periods[job]) * 1000;
    let to = (timeline.start - 30_000).div_euclid(period) * period;
    let from = to - 10 * period;
    let text = |ms: i64| {
        DateTime::from_timestamp_millis(ms)
            .expect("a time")
            .format("%Y-%m-%dT%H:%M:%SZ")
            .to_string()
    };
    let name = &round.jobs[job].name;
    let (ok, _, out) = members.cli(&["backfill", name, "--from", &text(from), "--to", &text(to)]);
    assert!(ok, "backfill: {out}");
    let instants = (0..10)
        .filter_map(|n| DateTime::from_timestamp_millis(from + n * period))
        .collect();
    timeline.backfills.push((job, instants));
}

/// Waits until the oracle has nothing left to wait for (every judged instant ended), at most
/// 60 s, and at least `--overdue` and 5 s past the judged window (what `verify` needs to call a
/// retry dropped).
fn settle(round: &Round, timeline: &mut Timeline, env: &TestEnv) {
    crate::wait_until(Duration::from_secs(60), || {
        timeline.now = now_ms();
        oracle::judge(round, timeline, &env.lines("effects")).is_empty()
    });
    let ready = timeline.judge_end + (OVERDUE_S + 5) * 1000;
    crate::wait_until(Duration::from_secs(60), || now_ms() >= ready);
}

/// `drumline verify --since S --overdue 10s --json`: its violations as (rule, key).
fn verify(members: &Members<'_>, since_s: u64) -> Vec<(String, String)> {
    let since = format!("{since_s}s");
    let overdue = format!("{OVERDUE_S}s");
    let (_, out, both) =
        members.cli(&["verify", "--since", &since, "--overdue", &overdue, "--json"]);
    let doc: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("verify --json: {e}: {both}"));
    doc["violations"]
        .as_array()
        .expect("violations")
        .iter()
        .map(|v| {
            let text = |k: &str| v[k].as_str().unwrap_or_default().to_owned();
            (text("rule"), text("key"))
        })
        .collect()
}

/// Where `verify` and the oracle disagree: a finding `verify` does not name (by key, or for a
/// missing instant by job), or a violation of a judged instant the oracle does not see.
fn cross_check(
    round: &Round,
    timeline: &Timeline,
    findings: &[Finding],
    verify: &[(String, String)],
) -> Vec<String> {
    let job_of = |key: &str| key.split_once('@').map_or(key, |(j, _)| j).to_owned();
    let mut out = Vec::new();
    for f in findings {
        let named = verify.iter().any(|(rule, key)| {
            *key == f.key
                || (f.rule == "missed"
                    && job_of(key) == f.job
                    && matches!(rule.as_str(), "missed" | "not_published" | "lost"))
        });
        if !named {
            out.push(format!(
                "verify missed the oracle's {} of {}",
                f.rule, f.key
            ));
        }
    }
    for (rule, key) in verify {
        let judged = key
            .split_once('@')
            .and_then(|(_, t)| parse_instant(t))
            .is_some_and(|t| t.timestamp_millis() <= timeline.judge_end);
        let seen = findings
            .iter()
            .any(|f| f.key == *key || f.job == job_of(key));
        let ours = round
            .jobs
            .iter()
            .chain(round.schedules.iter().map(|s| &s.job));
        if judged && !seen && ours.map(|j| &j.name).any(|n| *n == job_of(key)) {
            out.push(format!(
                "verify reported {rule} of {key}, the oracle saw nothing"
            ));
        }
    }
    out
}
