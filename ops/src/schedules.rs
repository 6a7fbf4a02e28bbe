//! `drumline schedules|calendars apply|get|list|delete` (docs/design.md#schedules-as-data):
//! jobs and calendars created, changed and removed at run time, stored in Redis
//! ([`Store::put_objects`]) where the leader follows them. What to store and what to show is decided here without I/O ([`checked`],
//! [`shown`]); the commands read and write through the [`Store`].

use chrono::{DateTime, SecondsFormat, TimeZone, Utc};
use drumline_shared::config::{Config, Job, Refusal};
use drumline_shared::exit::Failure;
use drumline_shared::store::{Applied, ObjectKind, Store, Stored};
use serde_json::{json, Value};
use std::collections::HashSet;
use std::io::Read;
use std::path::Path;

/// How many upcoming instants a shown schedule lists (`next`).
const NEXT_SHOWN: usize = 3;

/// Schedules read per page by `list`.
const LIST_PAGE: usize = 1000;

/// The objects of an apply's input: one object, or an array of them.
pub fn objects_of(text: &str) -> Result<Vec<Value>, Failure> {
    match serde_json::from_str(text) {
        Ok(Value::Array(objects)) => Ok(objects),
        Ok(object) => Ok(vec![object]),
        Err(e) => Err(Failure::usage(format!("not JSON: {e}"))),
    }
}

/// Every object of `kind` checked against `config`, all or nothing: the first bad one is
/// refused by its place in the input and its name, naming the key. Each as its name and
/// stored form.
pub fn checked(
    config: &Config,
    kind: ObjectKind,
    objects: Vec<Value>,
) -> Result<Vec<(String, String)>, Failure> {
    let mut names = HashSet::new();
    let mut out = Vec::with_capacity(objects.len());
    for (i, object) in objects.into_iter().enumerate() {
        let named = object.get("name").and_then(Value::as_str);
        let what = &kind.as_str()[..kind.as_str().len() - 1];
        let place = match named {
            Some(name) => format!("{what} {} ({name:?})", i + 1),
            None => format!("{what} {}", i + 1),
        };
        let (name, json) =
            check(config, kind, object).map_err(|r| Failure::usage(refused(&place, &r)))?;
        if !names.insert(name.clone()) {
            return Err(Failure::usage(format!("{place}: key `name`: given twice")));
        }
        out.push((name, json));
    }
    Ok(out)
}

/// One object of `kind` checked: its name and stored form.
pub fn check(
    config: &Config,
    kind: ObjectKind,
    object: Value,
) -> Result<(String, String), Refusal> {
    match kind {
        ObjectKind::Schedule => {
            let (spec, _) = config.check_schedule(None, object)?;
            Ok((spec.name.clone(), spec.to_json()))
        }
        ObjectKind::Calendar => {
            let (name, _, json) = config.check_calendar(None, object)?;
            Ok((name, json))
        }
    }
}

/// A refusal as `PLACE: key `K`: MESSAGE`.
pub fn refused(place: &str, refusal: &Refusal) -> String {
    match &refusal.field {
        Some(field) => format!("{place}: key `{field}`: {refusal}"),
        None => format!("{place}: {refusal}"),
    }
}

/// A stored schedule as shown: the object with `source`, `created_at`, `updated_at` and the
/// next instants after `now`; `None` when it no longer checks against `config` (a task
/// removed from the file since).
pub fn shown(config: &Config, stored: &Stored, now: DateTime<Utc>) -> Option<Value> {
    let object: Value = serde_json::from_str(&stored.json).ok()?;
    let (_, job) = config.check_schedule(None, object.clone()).ok()?;
    let mut object = shown_stored(object, stored)?;
    object["next"] = next_instants(&job, now).into();
    Some(object)
}

/// A stored object with `source` (`api`), `created_at` and `updated_at`.
fn shown_stored(object: Value, stored: &Stored) -> Option<Value> {
    let Value::Object(mut object) = object else {
        return None;
    };
    object.insert("source".into(), "api".into());
    object.insert("created_at".into(), ms_text(stored.created_ms).into());
    object.insert("updated_at".into(), ms_text(stored.updated_ms).into());
    Some(Value::Object(object))
}

/// A stored object of `kind` as shown (a schedule with its next instants).
pub fn shown_of(
    config: &Config,
    kind: ObjectKind,
    stored: &Stored,
    now: DateTime<Utc>,
) -> Option<Value> {
    match kind {
        ObjectKind::Schedule => shown(config, stored, now),
        ObjectKind::Calendar => shown_stored(serde_json::from_str(&stored.json).ok()?, stored),
    }
}

/// The config file's objects of `kind`, as `list` shows them before the stored ones.
pub fn config_rows(config: &Config, kind: ObjectKind) -> Vec<Value> {
    match kind {
        ObjectKind::Schedule => config.jobs.iter().map(shown_config_job).collect(),
        ObjectKind::Calendar => config
            .calendars
            .iter()
            .map(|(name, c)| json!({"name": name, "dates": c.dates(), "source": "config"}))
            .collect(),
    }
}

/// A config file's job as `list` shows it beside the stored ones.
pub fn shown_config_job(job: &Job) -> Value {
    json!({"name": job.name, "task": &*job.spec.task, "queue": &*job.spec.queue,
        "schedule": job.schedule_text(), "labels": {}, "source": "config"})
}

fn next_instants(job: &Job, now: DateTime<Utc>) -> Vec<String> {
    let mut at = now;
    let mut next = Vec::with_capacity(NEXT_SHOWN);
    while let Some(t) = job
        .schedule
        .next_after(at)
        .filter(|_| next.len() < NEXT_SHOWN)
    {
        next.push(t.to_rfc3339_opts(SecondsFormat::Millis, true));
        at = t;
    }
    next
}

fn ms_text(ms: i64) -> String {
    let at = Utc.timestamp_millis_opt(ms).single().unwrap_or_default();
    at.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Whether `object` carries every `labels` pair (`K=V`).
pub fn has_labels(object: &Value, labels: &[(String, String)]) -> bool {
    labels
        .iter()
        .all(|(k, v)| object["labels"][k].as_str() == Some(v.as_str()))
}

/// `--label K=V`.
pub fn parse_label(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{text:?} is not K=V")),
    }
}

/// `schedules|calendars apply [FILE|-]`: prints `created|replaced|unchanged NAME` per object.
pub async fn apply(
    config: &Config,
    store: &Store,
    kind: ObjectKind,
    file: Option<&Path>,
) -> Result<(), Failure> {
    let text = read_input(file)?;
    let objects = checked(config, kind, objects_of(&text)?)?;
    let now = Utc::now().timestamp_millis();
    let applied = store
        .put_objects(kind, &objects, now)
        .await
        .map_err(redis_failure)?;
    let mut out = String::with_capacity(objects.len() * 24);
    for ((name, _), applied) in objects.iter().zip(applied) {
        let verb = match applied {
            Applied::Created => "created",
            Applied::Replaced => "replaced",
            Applied::Unchanged => "unchanged",
        };
        out.push_str(&format!("{verb} {name}\n"));
    }
    print!("{out}");
    Ok(())
}

fn read_input(file: Option<&Path>) -> Result<String, Failure> {
    let mut text = String::new();
    match file.filter(|f| *f != Path::new("-")) {
        Some(file) => {
            text = std::fs::read_to_string(file)
                .map_err(|e| Failure::usage(format!("{}: {e}", file.display())))?;
        }
        None => {
            std::io::stdin()
                .read_to_string(&mut text)
                .map_err(|e| Failure::usage(format!("stdin: {e}")))?;
        }
    }
    Ok(text)
}

/// `schedules|calendars get NAME [--json]`: exit 1 when there is none.
pub async fn get(
    config: &Config,
    store: &Store,
    (kind, name): (ObjectKind, &str),
    json: bool,
) -> Result<(), Failure> {
    let what = &kind.as_str()[..kind.as_str().len() - 1];
    let stored = store.object(kind, name).await;
    let Some(stored) = stored.map_err(redis_failure)? else {
        return Err(Failure::other(format!("no {what} {name:?}")));
    };
    let shown = shown_of(config, kind, &stored, Utc::now())
        .ok_or_else(|| Failure::other(format!("{what} {name:?} no longer checks")))?;
    if json {
        println!("{shown}");
    } else {
        println!(
            "{}",
            serde_json::to_string_pretty(&shown).unwrap_or_default()
        );
    }
    Ok(())
}

/// `schedules|calendars list [--label K=V]… [--json]`: the config's, then every stored one.
pub async fn list(
    config: &Config,
    store: &Store,
    (kind, labels): (ObjectKind, &[(String, String)]),
    json: bool,
) -> Result<(), Failure> {
    let mut rows: Vec<Value> = match labels.is_empty() {
        true => config_rows(config, kind),
        false => Vec::new(),
    };
    rows.extend(stored_rows(config, store, (kind, labels)).await?);
    if json {
        println!("{}", json!({kind.as_str(): rows, "next_cursor": null}));
        return Ok(());
    }
    println!("{:<32} {:<7} WHAT", "NAME", "SOURCE");
    for row in rows {
        let what = match kind {
            ObjectKind::Schedule => schedule_text(&row),
            ObjectKind::Calendar => {
                row["dates"].as_array().map_or(0, Vec::len).to_string() + " dates"
            }
        };
        let (name, source) = (row["name"].as_str(), row["source"].as_str());
        println!(
            "{:<32} {:<7} {what}",
            name.unwrap_or(""),
            source.unwrap_or("")
        );
    }
    Ok(())
}

/// A listed schedule's rule and task: `every 1h report`.
fn schedule_text(row: &Value) -> String {
    let rule = ["schedule", "every", "cron"]
        .iter()
        .find_map(|k| row[*k].as_str().map(|v| format!("{k} {v}")))
        .unwrap_or_default();
    let rule = rule.trim_start_matches("schedule ");
    format!("{rule} {}", row["task"].as_str().unwrap_or(""))
}

async fn stored_rows(
    config: &Config,
    store: &Store,
    (kind, labels): (ObjectKind, &[(String, String)]),
) -> Result<Vec<Value>, Failure> {
    let (mut rows, mut cursor, now) = (Vec::new(), 0, Utc::now());
    loop {
        let (next, page) = store
            .objects_page(kind, cursor, LIST_PAGE)
            .await
            .map_err(redis_failure)?;
        let shown = page.iter().filter_map(|s| shown_of(config, kind, s, now));
        rows.extend(shown.filter(|o| has_labels(o, labels)));
        if next == 0 {
            return Ok(rows);
        }
        cursor = next;
    }
}

/// `schedules|calendars delete NAME…`: `deleted NAME` each; exit 1 when one of them was not
/// stored.
pub async fn delete(store: &Store, kind: ObjectKind, names: &[String]) -> Result<(), Failure> {
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let gone = store
        .delete_objects(kind, &names)
        .await
        .map_err(redis_failure)?;
    let missing: Vec<&str> = names
        .iter()
        .zip(&gone)
        .filter(|(_, gone)| !**gone)
        .map(|(name, _)| *name)
        .collect();
    for (name, _) in names.iter().zip(gone).filter(|(_, gone)| *gone) {
        println!("deleted {name}");
    }
    match missing.is_empty() {
        true => Ok(()),
        false => Err(Failure::other(format!(
            "no schedule {}",
            missing.join(", ")
        ))),
    }
}

fn redis_failure(e: impl std::fmt::Display) -> Failure {
    Failure::other(format!("redis: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        let text = "[tasks.report]\ncommand = [\"true\"]\n\n[[jobs]]\nname = \"nightly\"\n\
                    task = \"report\"\ncron = \"0 3 * * *\"\n";
        Config::parse(text, Path::new("drumline.toml"), |_| None).expect("config")
    }

    fn usage(f: Failure) -> String {
        match f {
            Failure::Usage(m) => m,
            other => panic!("not a usage failure: {other:?}"),
        }
    }

    #[test]
    fn an_apply_is_all_or_nothing_and_names_the_object_and_key() {
        let text = r#"[{"name": "a", "task": "report", "every": "1m"},
                       {"name": "b", "task": "report", "every": "often"}]"#;
        let refusal =
            usage(checked(&config(), ObjectKind::Schedule, objects_of(text).unwrap()).unwrap_err());
        assert!(
            refusal.starts_with("schedule 2 (\"b\"): key `every`:"),
            "{refusal}"
        );
        let twice = r#"[{"name": "a", "task": "report", "every": "1m"},
                        {"name": "a", "task": "report", "every": "2m"}]"#;
        let refusal = usage(
            checked(&config(), ObjectKind::Schedule, objects_of(twice).unwrap()).unwrap_err(),
        );
        assert_eq!(refusal, "schedule 2 (\"a\"): key `name`: given twice");
        let one = r#"{"name": "a", "task": "report", "every": "1m"}"#;
        assert_eq!(
            checked(&config(), ObjectKind::Schedule, objects_of(one).unwrap())
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn a_shown_schedule_has_its_times_source_and_next_instants() {
        let text = r#"{"name": "a", "task": "report", "every": "1h", "labels": {"t": "x"}}"#;
        let (_, json) = checked(&config(), ObjectKind::Schedule, objects_of(text).unwrap())
            .unwrap()
            .remove(0);
        let stored = Stored {
            name: "a".into(),
            json,
            created_ms: 0,
            updated_ms: 1_000,
        };
        let now = Utc.with_ymd_and_hms(2026, 12, 4, 10, 30, 0).unwrap();
        let shown = shown(&config(), &stored, now).expect("shown");
        assert_eq!(shown["source"], "api");
        assert_eq!(shown["updated_at"], "1970-01-01T00:00:01.000Z");
        let next = [
            "2026-12-04T11:00:00.000Z",
            "2026-12-04T12:00:00.000Z",
            "2026-12-04T13:00:00.000Z",
        ];
        assert_eq!(shown["next"], json!(next));
        assert!(has_labels(&shown, &[("t".into(), "x".into())]));
        assert!(!has_labels(&shown, &[("t".into(), "y".into())]));
    }

    #[test]
    fn labels_are_k_equals_v() {
        assert_eq!(parse_label("a=b=c"), Ok(("a".into(), "b=c".into())));
        assert!(parse_label("=b").is_err() && parse_label("ab").is_err());
    }
}
