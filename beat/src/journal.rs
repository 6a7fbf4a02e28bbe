//! What the leader journals (docs/design.md#journal): each instance it published, and each it
//! dropped with the reason (misfire policy, past grace, expired, paused), under its epoch. The
//! workers' scripts journal the rest; `audit` and `verify` read it all back.

use crate::leader::Term;
use crate::misfire::Plan;
use crate::stats::DropReason;
use drumline_shared::config::Job;
use drumline_shared::envelope::{format_instant, instance_key};
use drumline_shared::store::{LeaderEntry, Store};
use tracing::warn;

/// The entries for what `plan` drops: one per listed instant, one range for the unlisted.
pub fn dropped(job: &Job, plan: &Plan) -> Vec<LeaderEntry> {
    let mut out: Vec<LeaderEntry> = plan
        .dropped
        .iter()
        .map(|(t, why)| LeaderEntry {
            event: "skipped",
            key: instance_key(&job.name, *t),
            reason: DropReason::from(*why).as_str(),
            to: String::new(),
        })
        .collect();
    let more = &plan.unlisted;
    if let (Some(first), Some(last)) = (more.first, more.last) {
        let reason = more
            .reasons
            .first()
            .map_or("past_grace", |(why, _)| DropReason::from(*why).as_str());
        out.push(LeaderEntry {
            event: "skipped",
            key: instance_key(&job.name, first),
            reason,
            to: format_instant(last),
        });
    }
    out
}

/// The entry for a job that starts at `at` under its rule (a first start, an added or a
/// rescheduled job): its first instant is the first after `at`, and `audit` plans none of its
/// rule's instants before it.
pub fn started(job: &Job, at: chrono::DateTime<chrono::Utc>) -> LeaderEntry {
    LeaderEntry {
        event: "start",
        key: instance_key(&job.name, at),
        reason: "",
        to: String::new(),
    }
}

/// The entry for a published instance.
pub fn published(key: &str) -> LeaderEntry {
    LeaderEntry {
        event: "published",
        key: key.to_owned(),
        reason: "",
        to: String::new(),
    }
}

/// Appends `entries` while `term` leads. A failure is logged, never a stall: the journal is
/// evidence, the progress is what decides.
pub async fn write(store: &Store, term: &Term, entries: &[LeaderEntry]) {
    if entries.is_empty() {
        return;
    }
    match store
        .journal_leader(term.token(), term.epoch, entries)
        .await
    {
        Ok(true) => {}
        Ok(false) => warn!(
            entries = entries.len(),
            "not journaled: this beat no longer leads"
        ),
        Err(e) => warn!(error = %e, entries = entries.len(), "could not append to the journal"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::misfire::tests::{at, job, EVERY_MINUTE};
    use crate::misfire::{paused, Plan};

    #[test]
    fn a_paused_plan_journals_each_instant_as_skipped_paused() {
        let j = job(EVERY_MINUTE);
        let plan = paused(Plan {
            publish: vec![at("2026-01-01T00:01:00Z"), at("2026-01-01T00:02:00Z")],
            dropped: Vec::new(),
            unlisted: Default::default(),
            dropped_up_to: None,
            decided_up_to: None,
        });
        let entries = dropped(&j, &plan);
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].reason, "paused");
        assert_eq!(
            entries[0].key,
            instance_key(&j.name, at("2026-01-01T00:01:00Z"))
        );
    }
}
