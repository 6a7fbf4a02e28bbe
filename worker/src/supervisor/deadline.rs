//! The lease deadlines a supervisor holds for its tasks (docs/design.md#the-task-supervisor):
//! a task still running at its deadline's `term` gets SIGTERM (to its group), at its `kill`
//! SIGKILL, even when the worker that asked for it is frozen and cannot stop it itself
//! (docs/guarantees.md, "A partitioned or frozen worker stops its task before anyone else may
//! start it"). A renewal moves a deadline later; a stop once begun is finished.
//!
//! No I/O: the supervisor feeds it starts, renewals and reaps, asks it when to wake and what is
//! due, and owns the timer and the signals. Each step is a hash-map lookup and an ordered-set
//! insert or removal, whatever the number of tasks.

use super::wire::Deadline;
use std::collections::{BTreeSet, HashMap};

/// What is due to a task's group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGTERM: its lease's stop point is reached.
    Term,
    /// SIGKILL: the kill grace after the SIGTERM is over.
    Kill,
}

/// One task's deadline and the step that comes next.
#[derive(Debug, Clone, Copy)]
struct Held {
    deadline: Deadline,
    next: Stop,
    /// When `next` is due (`deadline.term` or `deadline.kill`).
    at: u64,
}

/// Every held deadline, in the order they fall due.
#[derive(Debug, Default)]
pub struct Deadlines {
    tasks: HashMap<u64, Held>,
    due: BTreeSet<(u64, u64)>,
}

impl Deadlines {
    /// Holds `deadline` for task `id`: a new one, or a renewal's. A task already SIGTERMed
    /// keeps its SIGKILL where it was: the worker's watchdog gives the lease up at the same
    /// instant, so a renewal that arrives after it came too late to count.
    pub fn hold(&mut self, id: u64, deadline: Deadline) {
        if let Some(held) = self.tasks.get(&id) {
            if held.next == Stop::Kill {
                return;
            }
            self.due.remove(&(held.at, id));
        }
        let held = Held {
            deadline,
            next: Stop::Term,
            at: deadline.term,
        };
        self.tasks.insert(id, held);
        self.due.insert((held.at, id));
    }

    /// Task `id` ended (or never had a deadline): nothing more is due to it.
    pub fn forget(&mut self, id: u64) {
        if let Some(held) = self.tasks.remove(&id) {
            self.due.remove(&(held.at, id));
        }
    }

    /// When the next step falls due, if any (for the supervisor's timer).
    pub fn next_at(&self) -> Option<u64> {
        self.due.first().map(|&(at, _)| at)
    }

    /// The next step due by `now` and its task, taken: a SIGTERM makes the SIGKILL the task's
    /// next step, a SIGKILL is its last. `None` when nothing is due yet.
    pub fn poll(&mut self, now: u64) -> Option<(u64, Stop)> {
        let &(at, id) = self.due.first()?;
        if at > now {
            return None;
        }
        self.due.remove(&(at, id));
        let held = self.tasks.get_mut(&id)?;
        let stop = held.next;
        match stop {
            Stop::Term => {
                held.next = Stop::Kill;
                held.at = held.deadline.kill.max(at);
                self.due.insert((held.at, id));
            }
            Stop::Kill => {
                self.tasks.remove(&id);
            }
        }
        Some((id, stop))
    }
}

/// Now on `CLOCK_BOOTTIME`, in nanoseconds: the clock of every [`Deadline`], read alike by the
/// worker and its supervisors.
pub fn now() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    (t.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(t.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deadline(term: u64, kill: u64) -> Deadline {
        Deadline { term, kill }
    }

    fn drain(d: &mut Deadlines, now: u64) -> Vec<(u64, Stop)> {
        std::iter::from_fn(|| d.poll(now)).collect()
    }

    #[test]
    fn a_task_past_its_deadline_is_terminated_then_killed() {
        let mut d = Deadlines::default();
        d.hold(1, deadline(2_000, 2_500));
        assert_eq!(d.next_at(), Some(2_000));
        assert_eq!(drain(&mut d, 1_999), []);
        assert_eq!(drain(&mut d, 2_000), [(1, Stop::Term)]);
        assert_eq!(d.next_at(), Some(2_500));
        assert_eq!(drain(&mut d, 2_499), []);
        assert_eq!(drain(&mut d, 2_500), [(1, Stop::Kill)]);
        assert_eq!(d.next_at(), None);
    }

    #[test]
    fn a_renewal_moves_the_deadline_and_an_end_forgets_it() {
        let mut d = Deadlines::default();
        d.hold(1, deadline(2_000, 2_500));
        d.hold(2, deadline(3_000, 3_500));
        // Renewed before its stop point: nothing is due at the old one.
        d.hold(1, deadline(5_000, 5_500));
        assert_eq!(d.next_at(), Some(3_000));
        d.forget(2);
        assert_eq!(drain(&mut d, 4_000), []);
        assert_eq!(drain(&mut d, 6_000), [(1, Stop::Term), (1, Stop::Kill)]);
        assert_eq!(drain(&mut d, u64::MAX), []);
    }

    #[test]
    fn a_renewal_after_the_sigterm_does_not_put_the_sigkill_off() {
        let mut d = Deadlines::default();
        d.hold(1, deadline(2_000, 2_500));
        assert_eq!(drain(&mut d, 2_000), [(1, Stop::Term)]);
        d.hold(1, deadline(5_000, 5_500));
        assert_eq!(d.next_at(), Some(2_500));
        assert_eq!(drain(&mut d, 2_500), [(1, Stop::Kill)]);
        // A task reaped after its stop began is forgotten without a trace.
        d.forget(1);
        assert_eq!(d.next_at(), None);
    }

    #[test]
    fn a_supervisor_woken_late_sends_each_step_in_order_at_once() {
        let mut d = Deadlines::default();
        d.hold(2, deadline(3_000, 3_500));
        d.hold(1, deadline(2_000, 2_500));
        d.hold(3, deadline(9_000, 9_500));
        assert_eq!(
            drain(&mut d, 4_000),
            [
                (1, Stop::Term),
                (1, Stop::Kill),
                (2, Stop::Term),
                (2, Stop::Kill)
            ]
        );
        assert_eq!(d.next_at(), Some(9_000));
    }
}
