//! `drumline inspect KEY` and `GET /api/v1/keys/{key}` (docs/api.md): what became of one key,
//! scheduled or ad hoc, from its run record, its journal entries and, for a job's instance,
//! the job's run records. What to say is decided here without I/O ([`report`]).

use chrono::{DateTime, TimeZone, Utc};
use drumline_shared::envelope::parse_instant;
use drumline_shared::exit::Failure;
use drumline_shared::store::{JournalEntry, RunRecord, Store, StoreError};
use serde_json::{json, Value};
use std::collections::HashMap;

/// How far before a job instance's instant its journal is read (a misfire, a retry's delay).
const BEFORE_INSTANT_MS: i64 = 3_600_000;

/// What is known of `key`: its run record's fields, its journal entries (oldest first) and the
/// job's run record for it, if one.
pub struct Known {
    /// The run record (`{ns}:run:{key}`); empty when none.
    pub fields: HashMap<String, String>,
    /// Its journal entries.
    pub journal: Vec<JournalEntry>,
    /// The newest run record the job keeps for it (a job's instance only).
    pub record: Option<RunRecord>,
}

/// Reads what `store` holds of `key`.
pub async fn read(store: &Store, key: &str) -> Result<Known, StoreError> {
    let fields = store.run_fields(key).await?;
    let from_ms = match instance(key) {
        Some((_, at)) => at.timestamp_millis() - BEFORE_INSTANT_MS,
        None => 0,
    };
    let journal = store.journal_since(from_ms, |k| k == key).await?;
    let record = record_of(store, key).await?;
    Ok(Known {
        fields,
        journal,
        record,
    })
}

/// What `store` holds of `key`, bounded for the status page (docs/design.md#bounded-work):
/// its journal entries only among the `newest` entries of the journal.
pub async fn read_newest(store: &Store, key: &str, newest: usize) -> Result<Known, StoreError> {
    let fields = store.run_fields(key).await?;
    let mut journal = store.journal_newest(newest).await?;
    journal.retain(|e| e.key == key);
    Ok(Known {
        record: record_of(store, key).await?,
        fields,
        journal,
    })
}

/// The job and instant of `key` when it is a job's instance (`{job}@{instant}`).
fn instance(key: &str) -> Option<(&str, DateTime<Utc>)> {
    key.split_once('@')
        .and_then(|(job, at)| Some((job, parse_instant(at)?)))
}

/// The newest run record the job keeps for `key`, when it is a job's instance.
async fn record_of(store: &Store, key: &str) -> Result<Option<RunRecord>, StoreError> {
    let Some((job, _)) = instance(key) else {
        return Ok(None);
    };
    let records = store.history_all(job).await?;
    Ok(records.into_iter().find(|r| r.key == key))
}

/// The report of `key`: `{key, state, attempt, fencing_token, worker, updated_at, error,
/// dead_letter, journal}`; `state` `unknown` (and nothing else) when drumline has no trace.
pub fn report(key: &str, known: &Known) -> Value {
    let Some(state) = state(known) else {
        return json!({"key": key, "state": "unknown"});
    };
    let field = |name: &str| known.fields.get(name).cloned();
    let number = |name: &str| field(name).and_then(|v| v.parse::<u64>().ok());
    let updated_at = number("at")
        .and_then(|s| Utc.timestamp_opt(s as i64, 0).single())
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
    let reason = field("reason").filter(|r| !r.is_empty());
    let dead_letter = matches!(state, "dead" | "expired").then(|| json!({"reason": reason}));
    let journal: Vec<Value> = known
        .journal
        .iter()
        .map(|e| {
            let at = Utc
                .timestamp_millis_opt(e.at_ms)
                .single()
                .unwrap_or_default();
            json!({"at": at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                   "event": e.event, "attempt": e.attempt,
                   "worker": (!e.worker.is_empty()).then_some(&e.worker),
                   "reason": (!e.reason.is_empty()).then_some(&e.reason)})
        })
        .collect();
    json!({"key": key, "state": state, "attempt": number("attempt"),
           "fencing_token": number("fence"), "worker": field("worker").filter(|w| !w.is_empty()),
           "updated_at": updated_at,
           "error": known.record.as_ref().and_then(|r| r.error.clone()),
           "dead_letter": dead_letter, "journal": journal})
}

/// `queued running retrying done dead expired skipped`, or `None` when nothing is known.
fn state(known: &Known) -> Option<&'static str> {
    let reason = known.fields.get("reason").map(String::as_str);
    match known.fields.get("state").map(String::as_str) {
        Some("running") => Some("running"),
        Some("retrying") => Some("retrying"),
        Some("done") => Some("done"),
        Some("skipped") => Some("skipped"),
        Some("dead") if reason == Some("expired") => Some("expired"),
        Some("dead") => Some("dead"),
        Some(_) => Some("queued"),
        None if known.journal.iter().any(|e| e.event == "skipped") => Some("skipped"),
        None if known.journal.iter().any(|e| e.event == "expired") => Some("expired"),
        None if !known.journal.is_empty() => Some("queued"),
        None => None,
    }
}

/// `inspect KEY [--json]`: exit 1 when drumline has no trace of it.
pub async fn inspect(store: &Store, key: &str, json: bool) -> Result<(), Failure> {
    let known = read(store, key)
        .await
        .map_err(|e| Failure::other(format!("redis: {e}")))?;
    let report = report(key, &known);
    match json {
        true => println!("{report}"),
        false => println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        ),
    }
    match report["state"] == "unknown" {
        true => Err(Failure::Reported),
        false => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(event: &str, reason: &str) -> JournalEntry {
        // The journal's short field names (store/src/journal.rs).
        let mut fields = HashMap::from([
            ("ev".to_owned(), event.to_owned()),
            ("key".to_owned(), "k".to_owned()),
        ]);
        fields.insert("r".into(), reason.into());
        JournalEntry::from_fields("1700000000000-0", &fields)
    }

    fn known(fields: &[(&str, &str)], journal: Vec<JournalEntry>) -> Known {
        let fields = fields
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Known {
            fields,
            journal,
            record: None,
        }
    }

    #[test]
    fn a_key_with_no_trace_is_unknown_and_says_nothing_else() {
        assert_eq!(
            report("k", &known(&[], vec![])),
            json!({"key": "k", "state": "unknown"})
        );
    }

    #[test]
    fn states_come_from_the_run_record_then_the_journal() {
        let cases = [
            (
                known(
                    &[("state", "done"), ("attempt", "1"), ("fence", "7")],
                    vec![],
                ),
                "done",
            ),
            (
                known(&[("state", "dead"), ("reason", "expired")], vec![]),
                "expired",
            ),
            (
                known(&[("state", "dead"), ("reason", "permanent")], vec![]),
                "dead",
            ),
            (known(&[("state", "retrying")], vec![]), "retrying"),
            (known(&[], vec![entry("published", "")]), "queued"),
            (
                known(
                    &[],
                    vec![entry("published", ""), entry("skipped", "calendar")],
                ),
                "skipped",
            ),
        ];
        for (known, want) in cases {
            assert_eq!(report("k", &known)["state"], want);
        }
        let done = report(
            "k",
            &known(
                &[("state", "done"), ("attempt", "1"), ("fence", "7")],
                vec![],
            ),
        );
        assert_eq!(
            (done["attempt"].as_u64(), done["fencing_token"].as_u64()),
            (Some(1), Some(7))
        );
        let dead = report(
            "k",
            &known(&[("state", "dead"), ("reason", "permanent")], vec![]),
        );
        assert_eq!(dead["dead_letter"], json!({"reason": "permanent"}));
    }
}
