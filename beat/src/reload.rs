//! SIGHUP for the beat (DESIGN §9 "Reload"): which jobs of a reloaded config carry their
//! progress over. A job keeps its state when a job of the same name with the same schedule
//! (`cron`, `every`, `anchor`, `timezone`, DST policies) ran before; an added job — or a
//! re-added one, whatever Redis still holds for it — and a rescheduled one start from the
//! reload as on a first start; a removed job stops. Pure: the scheduler applies it.

use drumline_shared::config::Job;
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
        assert_eq!(
            Summary::of(&carried, old.len()),
            Summary {
                kept: 1,
                started: 3,
                removed: 3
            }
        );
    }
}
