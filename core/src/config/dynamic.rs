//! Schedules as data (docs/design.md#schedules-as-data): a job created at run time is a JSON
//! object with the keys of a `[[jobs]]` table plus `labels`, checked by the same rules as the
//! file's jobs ([`Config::check_schedule`]). The keys a stored copy carries besides
//! (`source`, `created_at`, `updated_at`, `next`) are ignored, so what `schedules get --json`
//! prints can be applied again.

use super::{check_job_keys, Calendar, Config, Interned, Job, RawJob, PARSE_THREADS};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::collections::{HashMap, HashSet};

/// Keys a stored schedule is shown with that are not part of it.
pub const SHOWN_ONLY: [&str; 4] = ["source", "created_at", "updated_at", "next"];

/// A checked schedule as applied: its name, labels and job keys.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleSpec {
    /// The job's name: unique among schedules, never a name the config file uses.
    pub name: String,
    /// Free-form `labels` (string → string), for `list --label K=V`.
    pub labels: BTreeMap<String, String>,
    /// The `[[jobs]]` keys as given, without `name` and `labels`.
    pub keys: Map<String, Value>,
}

impl ScheduleSpec {
    /// The stored form: one JSON object, keys sorted, `name` and `labels` included; equal
    /// schedules give equal text (how an apply tells `unchanged`).
    pub fn to_json(&self) -> String {
        let mut object = self.keys.clone();
        object.insert("name".into(), Value::String(self.name.clone()));
        let labels = self
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone().into()));
        object.insert("labels".into(), Value::Object(labels.collect()));
        Value::Object(object).to_string()
    }
}

/// Why a schedule is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    /// The offending key, when one is.
    pub field: Option<String>,
    /// What is wrong.
    pub message: String,
    /// Whether the schedule is bad or its name belongs to the config file.
    pub kind: RefusalKind,
}

/// The two kinds of [`Refusal`]: the CLI exits 2 for both; the API answers 400 and 409.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// A key is missing, unknown or wrong.
    Invalid,
    /// The name is a job of the config file.
    ConfigName,
}

impl Refusal {
    fn invalid(field: Option<&str>, message: impl Into<String>) -> Self {
        Refusal {
            field: field.map(str::to_owned),
            message: message.into(),
            kind: RefusalKind::Invalid,
        }
    }
}

/// Up to this many edits at once, [`Config::put_schedules`] searches the jobs for each name.
const LINEAR_EDITS: usize = 8;

/// Where each job is, by name, and the file's names: for many edits at once.
struct Index {
    at: HashMap<String, usize>,
    file: HashSet<String>,
}

impl Index {
    fn of(jobs: &[Job], file: &Config) -> Self {
        Index {
            at: jobs
                .iter()
                .enumerate()
                .map(|(i, j)| (j.name.clone(), i))
                .collect(),
            file: file.jobs.iter().map(|j| j.name.clone()).collect(),
        }
    }

    /// Keeps the index true after `what` was done to job `name`.
    fn moved(&mut self, jobs: &[Job], name: &str, what: &Placed) {
        match what {
            Placed::Added => drop(self.at.insert(name.to_owned(), jobs.len() - 1)),
            Placed::Removed(i) => {
                self.at.remove(name);
                if let Some(moved) = jobs.get(*i) {
                    self.at.insert(moved.name.clone(), *i);
                }
            }
            Placed::Replaced(..) => {}
        }
    }
}

/// What [`Config::put_schedules`] did to the jobs.
#[derive(Debug)]
pub enum Placed {
    /// Job `i` replaced; the job it was.
    Replaced(usize, Job),
    /// Added as the last job.
    Added,
    /// Job `i` removed; the last job (if it was not `i`) moved to `i`.
    Removed(usize),
}

impl Config {
    /// Checks one schedule object against this config's tasks, as `check` checks a job.
    /// `name` is the name the caller addresses (the API's path); the object may then omit
    /// `name` or must repeat it.
    pub fn check_schedule(
        &self,
        name: Option<&str>,
        object: Value,
    ) -> Result<(ScheduleSpec, Job), Refusal> {
        self.check_schedule_sharing(name, object, &mut Interned::default())
    }

    /// Checks stored schedules (each its JSON text) as [`Config::check_schedule`] does: each
    /// one's job, or why it is refused, in `texts`' order. A million at a beat's start: they
    /// are cut in as many parts as threads (cores, at most four), and the jobs of a part share
    /// their task and queue names and equal specs, where checked one at a time each held its
    /// own (docs/performance.md).
    pub fn check_stored(&self, texts: &[&str]) -> Vec<Result<Job, Refusal>> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let part = texts.len().div_ceil(threads.clamp(1, PARSE_THREADS)).max(1);
        std::thread::scope(|scope| {
            let parts: Vec<_> = texts
                .chunks(part)
                .map(|texts| scope.spawn(move || self.check_part(texts)))
                .collect();
            let joined = parts.into_iter().map(|p| p.join());
            // A panic in a part is the checker's bug: raised again here, as if checked here.
            joined
                .flat_map(|r| r.unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
                .collect()
        })
    }

    /// [`Config::check_stored`] of one part, on one thread.
    fn check_part(&self, texts: &[&str]) -> Vec<Result<Job, Refusal>> {
        let mut interned = Interned::default();
        let mut check = |text: &str| {
            let object: Value = serde_json::from_str(text)
                .map_err(|e| Refusal::invalid(None, format!("not JSON: {e}")))?;
            let (_, job) = self.check_schedule_sharing(None, object, &mut interned)?;
            Ok(job)
        };
        texts.iter().map(|text| check(text)).collect()
    }

    /// [`Config::check_schedule`], sharing names and specs through `interned`.
    fn check_schedule_sharing(
        &self,
        name: Option<&str>,
        object: Value,
        interned: &mut Interned,
    ) -> Result<(ScheduleSpec, Job), Refusal> {
        let Value::Object(mut keys) = object else {
            return Err(Refusal::invalid(None, "a schedule is a JSON object"));
        };
        let name = take_name(&mut keys, name)?;
        let labels = take_labels(&mut keys)?;
        for shown in SHOWN_ONLY {
            keys.remove(shown);
        }
        if self.job(&name).is_some() {
            return Err(Refusal {
                field: Some("name".into()),
                message: format!("{name:?} is a job of the config file; change it there"),
                kind: RefusalKind::ConfigName,
            });
        }
        if keys.contains_key("after") {
            let message = "a schedule cannot follow another job (`after`); use `every` or `cron`";
            return Err(Refusal::invalid(Some("after"), message));
        }
        let job = self.check_schedule_job(&name, &keys, interned)?;
        let spec = ScheduleSpec { name, labels, keys };
        Ok((spec, job))
    }

    /// Checks one calendar object, `{"name", "dates"}`, as `[calendars.NAME]` is checked;
    /// `name` as in [`Config::check_schedule`]. The calendar and its stored form (canonical
    /// JSON). A name the file uses is refused ([`RefusalKind::ConfigName`]).
    pub fn check_calendar(
        &self,
        name: Option<&str>,
        object: Value,
    ) -> Result<(String, Calendar, String), Refusal> {
        let Value::Object(mut keys) = object else {
            return Err(Refusal::invalid(None, "a calendar is a JSON object"));
        };
        let name = take_name(&mut keys, name)?;
        for shown in SHOWN_ONLY {
            keys.remove(shown);
        }
        if self.calendars.contains_key(&name) {
            return Err(Refusal {
                field: Some("name".into()),
                message: format!("{name:?} is a calendar of the config file; change it there"),
                kind: RefusalKind::ConfigName,
            });
        }
        if let Some(key) = keys.keys().find(|k| *k != "dates") {
            return Err(Refusal::invalid(
                Some(key),
                "unknown key (a calendar has `dates`)",
            ));
        }
        let dates: Vec<String> = match keys.remove("dates") {
            Some(dates) => serde_json::from_value(dates)
                .map_err(|_| Refusal::invalid(Some("dates"), "must be an array of strings"))?,
            None => return Err(Refusal::invalid(Some("dates"), "missing")),
        };
        let calendar =
            Calendar::parse(&dates).map_err(|e| Refusal::invalid(Some("dates"), e.to_string()))?;
        let json = serde_json::json!({"name": name, "dates": calendar.dates()}).to_string();
        Ok((name, calendar, json))
    }

    /// Puts each schedule of `edits` in place as its job (replacing the job of that name, or
    /// added after the others), or removes it (`None`; the last job takes its place), in
    /// order, in place, telling `placed` what each did (with the jobs as they are right after
    /// it): what a change to a million schedules costs is a search and a swap, not a copy of
    /// every job. A name the file uses is left alone (the file wins, as in
    /// [`Config::with_schedules`]). Many edits at once look names up in an index built once.
    pub fn put_schedules(
        &mut self,
        edits: Vec<(String, Option<Job>)>,
        file: &Config,
        mut placed: impl FnMut(Placed, &[Job]),
    ) {
        let mut index = (edits.len() > LINEAR_EDITS).then(|| Index::of(&self.jobs, file));
        for (name, job) in edits {
            let at = match &index {
                Some(index) if index.file.contains(&name) => continue,
                Some(index) => index.at.get(&name).copied(),
                None if file.jobs.iter().any(|j| j.name == name) => continue,
                None => self.jobs.iter().position(|j| j.name == name),
            };
            let what = match (at, job) {
                (Some(i), Some(job)) => {
                    Placed::Replaced(i, std::mem::replace(&mut self.jobs[i], job))
                }
                (None, Some(job)) => {
                    self.jobs.push(job);
                    Placed::Added
                }
                (Some(i), None) => {
                    self.jobs.swap_remove(i);
                    Placed::Removed(i)
                }
                (None, None) => continue,
            };
            if let Some(index) = index.as_mut() {
                index.moved(&self.jobs, &name, &what);
            }
            placed(what, &self.jobs);
        }
    }

    /// This config with `schedules` (checked jobs, [`Config::check_schedule`]) after the
    /// file's jobs and `calendars` beside the file's: what the leader runs. A schedule or a
    /// calendar named as one of the file's is left out (the file wins).
    pub fn with_schedules<'c>(
        &self,
        schedules: impl IntoIterator<Item = Job>,
        calendars: impl IntoIterator<Item = (&'c String, &'c Calendar)>,
    ) -> Config {
        let file: HashSet<&str> = self.jobs.iter().map(|j| j.name.as_str()).collect();
        let mut jobs = self.jobs.clone();
        jobs.extend(
            schedules
                .into_iter()
                .filter(|j| !file.contains(j.name.as_str())),
        );
        let mut all = self.calendars.clone();
        for (name, calendar) in calendars {
            all.entry(name.clone()).or_insert_with(|| calendar.clone());
        }
        Config {
            jobs,
            calendars: all,
            ..self.clone_without_jobs()
        }
    }

    /// Everything of this config but its jobs (none).
    fn clone_without_jobs(&self) -> Config {
        Config {
            path: self.path.clone(),
            namespace: self.namespace.clone(),
            broker_url: self.broker_url.clone(),
            broker: self.broker.clone(),
            redis_url: self.redis_url.clone(),
            broker_ca_file: self.broker_ca_file.clone(),
            redis_ca_file: self.redis_ca_file.clone(),
            redis_wait: self.redis_wait,
            beat: self.beat.clone(),
            worker: self.worker.clone(),
            journal: self.journal,
            api: self.api.clone(),
            telemetry: self.telemetry.clone(),
            jobs: Vec::new(),
            tasks: self.tasks.clone(),
            limits: self.limits.clone(),
            calendars: self.calendars.clone(),
        }
    }

    /// The job of schedule `name` with `keys`, checked as the file's jobs are.
    fn check_schedule_job(
        &self,
        name: &str,
        keys: &Map<String, Value>,
        interned: &mut Interned,
    ) -> Result<Job, Refusal> {
        let mut object = keys.clone();
        object.insert("name".into(), Value::String(name.to_owned()));
        let raw: RawJob = serde_path_to_error::deserialize(Value::Object(object)).map_err(|e| {
            let field = e.path().to_string();
            let message = e.inner().to_string();
            let field = unknown_field(&message).or((field != ".").then_some(field));
            Refusal::invalid(field.as_deref(), message)
        })?;
        let tasks = (self.namespace.as_str(), &self.tasks);
        check_job_keys(raw, tasks, interned)
            .map_err(|(_, (key, message))| Refusal::invalid(Some(key), message))
    }
}

/// The schedule's name: the object's `name` (a string), or `addressed` when the object has
/// none; both must agree when both are given.
fn take_name(keys: &mut Map<String, Value>, addressed: Option<&str>) -> Result<String, Refusal> {
    let given = match keys.remove("name") {
        None => None,
        Some(Value::String(name)) => Some(name),
        Some(_) => return Err(Refusal::invalid(Some("name"), "must be a string")),
    };
    let name = match (given, addressed) {
        (Some(given), Some(addressed)) if given != addressed => {
            let message = format!("{given:?} differs from the name addressed, {addressed:?}");
            return Err(Refusal::invalid(Some("name"), message));
        }
        (Some(name), _) => name,
        (None, Some(addressed)) => addressed.to_owned(),
        (None, None) => return Err(Refusal::invalid(Some("name"), "missing")),
    };
    crate::names::check_name(&name)
        .map_err(|m| Refusal::invalid(Some("name"), format!("{name:?} {m}")))?;
    Ok(name)
}

/// The object's `labels`: an object of strings, empty when absent.
fn take_labels(keys: &mut Map<String, Value>) -> Result<BTreeMap<String, String>, Refusal> {
    let Some(labels) = keys.remove("labels") else {
        return Ok(BTreeMap::new());
    };
    let Value::Object(labels) = labels else {
        return Err(Refusal::invalid(
            Some("labels"),
            "must be an object of strings",
        ));
    };
    labels
        .into_iter()
        .map(|(k, v)| match v {
            Value::String(v) => Ok((k, v)),
            _ => Err(Refusal::invalid(
                Some(&format!("labels.{k}")),
                "must be a string",
            )),
        })
        .collect()
}

/// The key an "unknown field `x`, expected …" message names.
fn unknown_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("unknown field `")?;
    Some(rest[..rest.find('`')?].to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::Arc;

    fn config() -> Config {
        let text = r#"
[tasks.report]
command = ["true"]

[[jobs]]
name = "nightly"
task = "report"
cron = "0 3 * * *"
"#;
        Config::parse(text, std::path::Path::new("drumline.toml"), |_| None).expect("config")
    }

    fn refused(name: Option<&str>, object: Value) -> Refusal {
        config().check_schedule(name, object).expect_err("refused")
    }

    #[test]
    fn a_schedule_is_checked_as_a_job_and_keeps_its_labels() {
        let object = json!({"name": "acme-report", "task": "report", "every": "1h",
            "args": {"customer": "acme"}, "labels": {"tenant": "acme"}});
        let (spec, job) = config().check_schedule(None, object).expect("valid");
        assert_eq!(job.name, "acme-report");
        assert_eq!(job.schedule_text(), "every 1h");
        assert_eq!(job.spec.args.as_str(), r#"{"customer":"acme"}"#);
        assert_eq!(spec.labels["tenant"], "acme");
        assert!(!spec.keys.contains_key("name") && !spec.keys.contains_key("labels"));
    }

    #[test]
    fn the_stored_form_is_canonical_and_can_be_applied_again() {
        let a = json!({"task": "report", "cron": "0 * * * *", "labels": {"b": "2", "a": "1"}});
        let (spec, _) = config().check_schedule(Some("x"), a).expect("valid");
        let text = spec.to_json();
        let mut shown: Value = serde_json::from_str(&text).expect("json");
        shown["created_at"] = json!("2026-12-04T00:00:00Z");
        shown["source"] = json!("api");
        let (again, _) = config().check_schedule(None, shown).expect("valid again");
        assert_eq!(again.to_json(), text);
    }

    #[test]
    fn bad_keys_are_named() {
        let cases = [
            (json!({"task": "report"}), Some("cron")),
            (json!({"task": "nope", "every": "1m"}), Some("task")),
            (
                json!({"task": "report", "every": "1m", "colour": 1}),
                Some("colour"),
            ),
            (json!({"task": "report", "every": "soon"}), Some("every")),
            (json!({"task": "report", "every": 5}), Some("every")),
            (
                json!({"task": "report", "cron": "0 3 * * *", "after": "n"}),
                Some("after"),
            ),
            (
                json!({"task": "report", "every": "1m", "labels": {"a": 1}}),
                Some("labels.a"),
            ),
            (json!([1]), None),
        ];
        for (object, field) in cases {
            let refusal = refused(Some("s"), object.clone());
            assert_eq!(refusal.kind, RefusalKind::Invalid, "{object}");
            assert_eq!(refusal.field.as_deref(), field, "{object}: {refusal}");
        }
    }

    #[test]
    fn schedules_join_the_files_jobs_and_the_file_wins_a_name() {
        let config = config();
        let (_, a) = config
            .check_schedule(Some("a"), json!({"task": "report", "every": "1m"}))
            .unwrap();
        let mut clash = a.clone();
        clash.name = "nightly".into();
        let extra = Calendar::parse(&["2026-12-25"]).unwrap();
        let calendars = [("holidays".to_owned(), extra)];
        let all = config.with_schedules([a, clash], calendars.iter().map(|(n, c)| (n, c)));
        let names: Vec<&str> = all.jobs.iter().map(|j| j.name.as_str()).collect();
        assert_eq!(names, ["nightly", "a"]);
        assert_eq!(
            all.job("nightly").unwrap().schedule_text(),
            "cron \"0 3 * * *\""
        );
        assert!(all.calendars.contains_key("holidays") && all.tasks == config.tasks);
    }

    #[test]
    fn calendars_are_checked_and_the_files_names_refused() {
        let mut config = config();
        config.calendars.insert("file".into(), Calendar::default());
        let (name, calendar, json) = config
            .check_calendar(Some("h"), json!({"dates": ["*-12-25", "2026-01-02"]}))
            .expect("valid");
        assert_eq!((name.as_str(), calendar.dates().len()), ("h", 2));
        assert_eq!(json, r#"{"dates":["2026-01-02","*-12-25"],"name":"h"}"#);
        let refused = |object: Value| config.check_calendar(Some("h"), object).unwrap_err();
        assert_eq!(
            refused(json!({"dates": ["soon"]})).field.as_deref(),
            Some("dates")
        );
        assert_eq!(
            refused(json!({"dates": "x"})).field.as_deref(),
            Some("dates")
        );
        assert_eq!(refused(json!({"days": []})).field.as_deref(), Some("days"));
        let file = config
            .check_calendar(Some("file"), json!({"dates": []}))
            .unwrap_err();
        assert_eq!(file.kind, RefusalKind::ConfigName);
    }

    #[test]
    fn names_must_be_valid_agree_and_not_be_the_files() {
        let body = json!({"task": "report", "every": "1m"});
        let refusal = refused(Some("nightly"), body.clone());
        assert_eq!(refusal.kind, RefusalKind::ConfigName);
        assert_eq!(refused(None, body.clone()).field.as_deref(), Some("name"));
        assert_eq!(refused(Some("a b"), body).field.as_deref(), Some("name"));
        let differs = json!({"name": "a", "task": "report", "every": "1m"});
        assert_eq!(refused(Some("b"), differs).field.as_deref(), Some("name"));
    }

    /// Stored schedules checked at once (on threads) are what each gives checked alone, in
    /// order, refusals in their place; jobs with the same task and keys share one spec.
    #[test]
    fn stored_schedules_checked_at_once_are_checked_alone_and_share_specs() {
        let file = config();
        let texts: Vec<String> = (0..50)
            .map(|n| match n {
                7 => "{not json".to_owned(),
                9 => json!({"name": "s9", "task": "nope", "every": "1m"}).to_string(),
                n => json!({"name": format!("s{n}"), "task": "report", "every": "1m",
                    "args": {"n": n % 2}, "labels": {"t": "x"}})
                .to_string(),
            })
            .collect();
        let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
        let together = file.check_stored(&texts);
        assert_eq!(together.len(), texts.len());
        for (text, got) in texts.iter().zip(&together) {
            let alone = serde_json::from_str(text)
                .map_err(|_| ())
                .and_then(|o| file.check_schedule(None, o).map_err(|_| ()));
            match (alone, got) {
                (Ok((_, a)), Ok(b)) => assert_eq!(format!("{a:?}"), format!("{b:?}")),
                (Err(()), Err(refusal)) => assert_eq!(refusal.kind, RefusalKind::Invalid),
                (a, b) => panic!("{text}: alone {a:?}, together {b:?}"),
            }
        }
        let (a, b) = (together[0].as_ref().unwrap(), together[2].as_ref().unwrap());
        assert_eq!(a.spec.args.as_str(), r#"{"n":0}"#);
        assert!(
            Arc::ptr_eq(&a.spec, &b.spec),
            "one spec for the same task and args"
        );
    }

    /// Many edits at once (through the index) leave the jobs exactly as the same edits one at
    /// a time (each a search): adds, replaces, removes that move the last job, a file name.
    #[test]
    fn edits_at_once_place_the_jobs_as_edits_one_by_one() {
        let file = config();
        let job = |n: usize| {
            let object = json!({"name": format!("s{n}"), "task": "report", "every": format!("{}m", n % 7 + 1)});
            Some(file.check_schedule(None, object).expect("valid").1)
        };
        let mut edits: Vec<(String, Option<Job>)> =
            (0..20).map(|n| (format!("s{n}"), job(n))).collect();
        edits.extend([
            ("s3".into(), None),
            ("s19".into(), job(5)),
            ("nightly".into(), None),
        ]);
        edits.extend([
            ("s0".into(), None),
            ("s21".into(), job(21)),
            ("s7".into(), None),
        ]);
        let names = |c: &Config| c.jobs.iter().map(|j| j.name.clone()).collect::<Vec<_>>();
        let (mut together, mut alone) = (file.clone(), file.clone());
        let mut seen = 0;
        together.put_schedules(edits.clone(), &file, |_, _| seen += 1);
        for edit in edits {
            alone.put_schedules(vec![edit], &file, |_, _| {});
        }
        assert_eq!(names(&together), names(&alone));
        assert_eq!(seen, 25, "every edit but the file's name");
        assert_eq!(
            together.jobs[0].name, "nightly",
            "the file's job stays first"
        );
        assert_eq!(together.jobs.len(), 1 + 20 - 3 + 1);
    }
}
