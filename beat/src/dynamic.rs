//! What changes the jobs a beat runs while it runs (docs/design.md#schedules-as-data): SIGHUP
//! (the file again) and the schedules and calendars applied at run time. Those are read whole
//! at start ([`Changes::load`]) and then followed through the change feed by a task of their
//! own, which reads each changed object and hands it over; a change becomes a new config (the
//! file's jobs, then the schedules), which the scheduler runs as it runs a reload.

use chrono::Utc;
use drumline_shared::calendar::Calendar;
use drumline_shared::config::{Config, Job};
use drumline_shared::planted::{planted, Defect};
use drumline_shared::signals::Hangups;
use drumline_shared::store::{FeedRead, ObjectKind, Store, StoreError};
use serde_json::Value;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::{error, info, warn};

/// Objects read per page at start.
const PAGE: usize = 1000;

/// Changes read from the feed at once.
const FEED_BATCH: usize = 1000;

/// Between reads of the feed that found nothing. The feed is polled, not read with `BLOCK`:
/// the store's one connection is shared, and a blocked read would hold up the leader's
/// renewals and progress writes behind it.
const FEED_POLL: Duration = Duration::from_millis(200);

/// Between tries of a failed feed read.
const FEED_RETRY: Duration = Duration::from_millis(500);

/// What the jobs a beat runs became.
pub(crate) enum Change {
    /// Everything again (SIGHUP, a calendar changed, the feed lost its place): the whole
    /// config, run as a reload.
    Whole(Arc<Config>),
    /// Only these schedules changed: each by name, its checked job, or `None` when deleted (or
    /// no longer checks). Applied in place ([`Config::put_schedule`]).
    Schedules(Vec<(String, Option<Job>)>),
}

/// One object's new state from the feed: its stored JSON, or `None` when deleted.
#[derive(Debug)]
enum Update {
    /// These objects changed.
    Objects(Vec<(ObjectKind, String, Option<String>)>),
    /// The feed lost its place: everything, read again.
    All(Box<Objects>),
}

/// Every schedule and calendar applied at run time, as stored JSON by name.
#[derive(Debug, Default)]
struct Objects {
    schedules: BTreeMap<String, String>,
    calendars: BTreeMap<String, String>,
}

/// The file's config and the objects applied at run time, and where changes to either come
/// from. Each schedule's job is held once, by the config the beat runs: here only its stored
/// JSON (to tell a change and to check it again against a reloaded file), never its job.
pub(crate) struct Changes {
    hangups: Hangups,
    file: Arc<Config>,
    objects: Objects,
    /// The stored schedules that do not check against `file` (left out, logged).
    left_out: HashSet<String>,
    calendars: BTreeMap<String, Calendar>,
    updates: mpsc::Receiver<Update>,
}

impl Changes {
    /// Reads every stored object, then follows the feed from before that read (so no change is
    /// missed) in a task of its own; with the config to run (the file's jobs and the
    /// schedules). `Err` gives `hangups` back with the error.
    pub(crate) async fn load(
        file: Arc<Config>,
        store: &Store,
        hangups: Hangups,
    ) -> Result<(Self, Arc<Config>), (StoreError, Hangups)> {
        let started = Instant::now();
        let read =
            async { Ok::<_, StoreError>((store.feed_head().await?, read_all(store).await?)) };
        let (head, objects) = match read.await {
            Ok(read) => read,
            Err(e) => return Err((e, hangups)),
        };
        let read_ms = started.elapsed().as_millis() as u64;
        info!(
            schedules = objects.schedules.len(),
            read_ms, "schedules read"
        );
        let (tx, updates) = mpsc::channel(16);
        tokio::spawn(follow(store.clone(), head, tx));
        let mut changes = Changes {
            hangups,
            file,
            objects,
            left_out: HashSet::new(),
            calendars: BTreeMap::new(),
            updates,
        };
        let config = changes.check_all();
        Ok((changes, config))
    }

    /// The file the schedules are checked against (its jobs win over a schedule's name).
    pub(crate) fn file(&self) -> &Config {
        &self.file
    }

    /// The next change: SIGHUP or a change in the feed. `None` when it changed nothing (a
    /// file that does not load, a put of what was stored). Cancel-safe.
    pub(crate) async fn next(&mut self) -> Option<Change> {
        let change = tokio::select! {
            _ = self.hangups.recv() => {
                self.file = reload(&self.file)?;
                Change::Whole(self.check_all())
            }
            update = self.updates.recv() => self.apply(update?)?,
        };
        info!(
            schedules = self.checked(),
            calendars = self.calendars.len(),
            "schedules changed"
        );
        Some(change)
    }

    /// Applies `update`: what changed, if anything did.
    fn apply(&mut self, update: Update) -> Option<Change> {
        let objects = match update {
            Update::All(all) => {
                self.objects = *all;
                return Some(Change::Whole(self.check_all()));
            }
            Update::Objects(objects) => objects,
        };
        let (mut jobs, mut calendars) = (Vec::new(), false);
        for (kind, name, json) in objects {
            if json.is_none() && kind == ObjectKind::Schedule && planted(Defect::IgnoreDelete) {
                continue;
            }
            let held = match kind {
                ObjectKind::Schedule => &mut self.objects.schedules,
                ObjectKind::Calendar => &mut self.objects.calendars,
            };
            let before = match &json {
                Some(json) => held.insert(name.clone(), json.clone()),
                None => held.remove(&name),
            };
            if before == json {
                continue;
            }
            match kind {
                ObjectKind::Schedule => {
                    let job = self.check_schedule(&name);
                    jobs.push((name, job));
                }
                ObjectKind::Calendar => {
                    self.check_calendar(&name);
                    calendars = true;
                }
            }
        }
        if calendars {
            // The schedules are checked again with the rest: their jobs are held by the
            // running config only.
            return Some(Change::Whole(self.check_all()));
        }
        (!jobs.is_empty()).then_some(Change::Schedules(jobs))
    }

    /// Checks every stored object again (at start, after SIGHUP, a calendar's change or a gap
    /// in the feed): the config to run, the file's jobs and the schedules that check.
    fn check_all(&mut self) -> Arc<Config> {
        let started = Instant::now();
        self.calendars.clear();
        let names: Vec<String> = self.objects.calendars.keys().cloned().collect();
        for name in names {
            self.check_calendar(&name);
        }
        let texts: Vec<&str> = self
            .objects
            .schedules
            .values()
            .map(String::as_str)
            .collect();
        let checked = self.file.check_stored(&texts);
        let left_out = &mut self.left_out;
        left_out.clear();
        let names = self.objects.schedules.keys();
        let jobs: Vec<Job> = names
            .zip(checked)
            .filter_map(|(name, checked)| match checked {
                Ok(job) => Some(job),
                Err(e) => {
                    warn!(schedule = %name, error = %e, "schedule left out");
                    left_out.insert(name.clone());
                    None
                }
            })
            .collect();
        // Nothing stored to add: the file's config itself, not a copy of its jobs (the first
        // edit copies it: `Arc::make_mut`).
        let config = match jobs.is_empty() && self.calendars.is_empty() {
            true => self.file.clone(),
            false => Arc::new(self.file.with_schedules(jobs, self.calendars.iter())),
        };
        info!(
            schedules = self.checked(),
            calendars = self.calendars.len(),
            check_ms = started.elapsed().as_millis() as u64,
            "schedules applied at run time"
        );
        config
    }

    /// How many stored schedules check against the file.
    fn checked(&self) -> usize {
        self.objects.schedules.len() - self.left_out.len()
    }

    /// Schedule `name`'s job as now stored: `None` when deleted or left out (logged).
    fn check_schedule(&mut self, name: &str) -> Option<Job> {
        self.left_out.remove(name);
        let json = self.objects.schedules.get(name)?;
        match schedule_job(&self.file, json) {
            Ok(job) => Some(job),
            Err(e) => {
                warn!(schedule = name, error = %e, "schedule left out");
                self.left_out.insert(name.to_owned());
                None
            }
        }
    }

    /// Takes calendar `name` as now stored (or gone).
    fn check_calendar(&mut self, name: &str) {
        self.calendars.remove(name);
        let Some(json) = self.objects.calendars.get(name) else {
            return;
        };
        match calendar_of(json) {
            Some(calendar) => drop(self.calendars.insert(name.to_owned(), calendar)),
            None => warn!(calendar = name, "calendar left out: not readable"),
        }
    }
}

/// A stored schedule as the job it runs, checked against `file`.
fn schedule_job(file: &Config, json: &str) -> Result<Job, String> {
    let object: Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
    let (_, job) = file
        .check_schedule(None, object)
        .map_err(|r| r.to_string())?;
    Ok(job)
}

/// A stored calendar (`{"name", "dates"}`).
fn calendar_of(json: &str) -> Option<Calendar> {
    let object: Value = serde_json::from_str(json).ok()?;
    let dates: Vec<String> = serde_json::from_value(object.get("dates")?.clone()).ok()?;
    Calendar::parse(&dates).ok()
}

/// `file` with every schedule and calendar stored now, checked as the leader checks them (those
/// that no longer check left out): the jobs the operator's commands see.
pub async fn with_stored(file: &Config, store: &Store) -> Result<Config, StoreError> {
    let objects = read_all(store).await?;
    let texts: Vec<&str> = objects.schedules.values().map(String::as_str).collect();
    let jobs = file.check_stored(&texts).into_iter().filter_map(Result::ok);
    let calendars: BTreeMap<String, Calendar> = objects
        .calendars
        .iter()
        .filter_map(|(name, json)| Some((name.clone(), calendar_of(json)?)))
        .collect();
    Ok(file.with_schedules(jobs, &calendars))
}

/// Every stored schedule and calendar.
async fn read_all(store: &Store) -> Result<Objects, StoreError> {
    let mut objects = Objects::default();
    for kind in [ObjectKind::Schedule, ObjectKind::Calendar] {
        let held = match kind {
            ObjectKind::Schedule => &mut objects.schedules,
            ObjectKind::Calendar => &mut objects.calendars,
        };
        let mut cursor = 0;
        loop {
            let (next, page) = store.object_bodies_page(kind, cursor, PAGE).await?;
            held.extend(page);
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(objects)
}

/// Follows the feed from `from` until the receiver is gone: each batch of changes read with
/// the objects as now stored.
async fn follow(store: Store, mut from: String, tx: mpsc::Sender<Update>) {
    loop {
        let update = match store.feed_since(&from, FEED_BATCH, 0).await {
            Ok(FeedRead::Changes(changes)) if changes.is_empty() => {
                tokio::time::sleep(FEED_POLL).await;
                continue;
            }
            Ok(FeedRead::Changes(changes)) => {
                let last = changes[changes.len() - 1].id.clone();
                match read_changed(&store, changes).await {
                    Ok(objects) => {
                        from = last;
                        Update::Objects(objects)
                    }
                    Err(e) => {
                        warn!(error = %e, "cannot read the changed schedules; trying again");
                        tokio::time::sleep(FEED_RETRY).await;
                        continue;
                    }
                }
            }
            Ok(FeedRead::Gap) => {
                match (store.feed_head().await, read_all(&store).await) {
                    (Ok(head), Ok(all)) => {
                        warn!("the change feed was trimmed past this beat's place: read everything again");
                        from = head;
                        Update::All(Box::new(all))
                    }
                    _ => {
                        tokio::time::sleep(FEED_RETRY).await;
                        continue;
                    }
                }
            }
            Err(e) => {
                warn!(error = %e, "cannot read the change feed; trying again");
                tokio::time::sleep(FEED_RETRY).await;
                continue;
            }
        };
        if tx.send(update).await.is_err() {
            return;
        }
    }
}

/// The changed objects as now stored (`None`: deleted), one read per kind.
async fn read_changed(
    store: &Store,
    changes: Vec<drumline_shared::store::Change>,
) -> Result<Vec<(ObjectKind, String, Option<String>)>, StoreError> {
    let started = Utc::now();
    let mut out = Vec::with_capacity(changes.len());
    for kind in [ObjectKind::Schedule, ObjectKind::Calendar] {
        let mut names: Vec<String> = changes
            .iter()
            .filter(|c| c.kind == kind)
            .map(|c| c.name.clone())
            .collect();
        names.sort();
        names.dedup();
        let stored = store.objects_named(kind, &names).await?;
        out.extend(
            names
                .into_iter()
                .zip(stored)
                .map(|(n, s)| (kind, n, s.map(|s| s.json))),
        );
    }
    tracing::debug!(
        changes = out.len(),
        read_ms = (Utc::now() - started).num_milliseconds(),
        "schedules changed"
    );
    Ok(out)
}

/// Re-reads the config file on SIGHUP: the running config with the file's `[[jobs]]` and
/// `[tasks.*]` (everything else takes a restart, and is named), or `None` (logged) when the
/// file does not load and the running one stays.
fn reload(config: &Config) -> Option<Arc<Config>> {
    match config.reload() {
        Ok((new, restart)) => {
            if !restart.is_empty() {
                warn!(changed = ?restart, "reloaded [[jobs]]; these changes take a restart of the beat");
            }
            // Field by field: `..config.clone()` would copy every running job only to drop it.
            Some(Arc::new(Config {
                jobs: new.jobs,
                tasks: new.tasks,
                limits: new.limits,
                calendars: new.calendars,
                path: config.path.clone(),
                namespace: config.namespace.clone(),
                broker_url: config.broker_url.clone(),
                broker: config.broker.clone(),
                redis_url: config.redis_url.clone(),
                broker_ca_file: config.broker_ca_file.clone(),
                redis_ca_file: config.redis_ca_file.clone(),
                redis_wait: config.redis_wait,
                beat: config.beat.clone(),
                worker: config.worker.clone(),
                journal: config.journal,
                api: config.api.clone(),
                telemetry: config.telemetry.clone(),
            }))
        }
        Err(e) => {
            error!(error = %e, "reload refused: the file does not load; the running config stays");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// The changes of a beat whose file has jobs `a` and `b` and which found `objects` stored.
    fn changes(objects: Objects) -> Changes {
        let mut text = String::new();
        for name in ["a", "b"] {
            text += &format!("[[jobs]]\nname = \"{name}\"\ntask = \"t\"\nevery = \"1m\"\n");
        }
        text += "[tasks.t]\ncommand = [\"/bin/true\"]\n";
        let file = Config::parse(&text, Path::new("test.toml"), |_| None).unwrap();
        let (_, updates) = mpsc::channel(1);
        Changes {
            hangups: Hangups::new(),
            file: Arc::new(file),
            objects,
            left_out: HashSet::new(),
            calendars: BTreeMap::new(),
            updates,
        }
    }

    /// With nothing stored, the beat runs the file's config itself: a second copy of a million
    /// file jobs was 100 MiB of a beat's memory (docs/performance.md, "A million jobs").
    #[tokio::test]
    async fn with_nothing_stored_the_file_is_run_as_it_is_not_copied() {
        let mut changes = changes(Objects::default());
        let config = changes.check_all();
        assert!(Arc::ptr_eq(&config, &changes.file));

        let schedule = r#"{"name": "s", "task": "t", "every": "1h"}"#;
        changes
            .objects
            .schedules
            .insert("s".into(), schedule.into());
        let config = changes.check_all();
        assert!(!Arc::ptr_eq(&config, &changes.file));
        let names: Vec<&str> = config.jobs.iter().map(|j| j.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "s"]);
    }
}
