//! Where a retry is decided (docs/design.md step 7): the delay before attempt `n+1` is
//! `d = min(retry_max, retry_base · 2^n)` plus up to 20 % jitter, never less than `d`.

use drumline_shared::backoff::Backoff;
use drumline_shared::config::Task;
use std::time::Duration;

/// The most jitter adds to a retry delay: a fifth of it.
pub const RETRY_JITTER: f64 = 0.2;

/// What to do after a failed run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Publish attempt `attempt + 1` after `delay`.
    Retry {
        /// How long to wait.
        delay: Duration,
    },
    /// Retries are used up: dead-letter.
    Exhausted,
}

/// Decides what follows a retryable failure of run `attempt` (0-based). `jitter` in `[0, 1)`
/// is injected so tests are exact.
pub fn decide(task: &Task, attempt: u32, jitter: f64) -> Decision {
    if attempt >= task.max_retries {
        return Decision::Exhausted;
    }
    Decision::Retry {
        delay: backoff(task.retry_base, task.retry_max, attempt, jitter),
    }
}

/// `min(max, base·2^attempt)` plus `jitter·20 %` of it ([`Backoff::nth`] of the backoff from
/// `base` to `max` with [`RETRY_JITTER`]), rounded up to whole milliseconds. The config check
/// refuses a zero `retry_base` and a `retry_max` below it; a [`Task`] built by hand with such
/// values retries after `min(base, max)`, without jitter.
pub fn backoff(base: Duration, max: Duration, attempt: u32, jitter: f64) -> Duration {
    let total = match Backoff::new(base, max, RETRY_JITTER) {
        // Doublings stop at 31, as they always have: `retry_base · 2^31` is the longest delay
        // a short `retry_base` reaches (2^31 ms, 24.9 days, from 1 ms).
        Ok(backoff) => backoff.nth(attempt.min(31), jitter),
        Err(_) => base.min(max),
    };
    // Whole milliseconds, rounded up: the delay queue's TTL is in ms and must not undercut d.
    Duration::from_millis(total.as_nanos().div_ceil(1_000_000) as u64)
}

/// Rounds a delay *up* to two significant digits of milliseconds (1173 ms → 1200 ms,
/// 37 412 ms → 38 000 ms). Each distinct delay is its own delay queue; jittered delays would
/// otherwise create a queue per message. Rounding up keeps "never less than d".
pub fn bucket(delay: Duration) -> Duration {
    let ms = delay.as_nanos().div_ceil(1_000_000) as u64;
    let step = step_of(ms);
    Duration::from_millis(ms.div_ceil(step) * step)
}

/// Rounds a delay *down* to two significant digits of milliseconds (1173 ms → 1100 ms, 37 412
/// ms → 37 000 ms), at least 1 ms: a wait that must not overshoot an instant (`not_before`)
/// still shares its delay queue with others; what is left after it is waited for again.
pub fn bucket_down(delay: Duration) -> Duration {
    let ms = (delay.as_millis() as u64).max(1);
    let step = step_of(ms);
    Duration::from_millis(ms / step * step)
}

/// The power of ten that leaves `ms` two significant digits (1 below 100 ms).
fn step_of(ms: u64) -> u64 {
    let mut step = 1u64;
    while ms / step >= 100 {
        step *= 10;
    }
    step
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A task with `max_retries`, backoff from 1 s up to 10 s (also used by `decision`).
    pub(crate) fn task(max_retries: u32) -> Task {
        Task {
            name: "t".into(),
            command: None,
            timeout: None,
            max_retries,
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(10),
            permanent_exit_codes: vec![],
            env: Default::default(),
            http: None,
            limit: None,
        }
    }

    #[test]
    fn doubles_from_base_up_to_max() {
        let s = |n| backoff(Duration::from_secs(1), Duration::from_secs(10), n, 0.0);
        assert_eq!(s(0), Duration::from_secs(1));
        assert_eq!(s(1), Duration::from_secs(2));
        assert_eq!(s(3), Duration::from_secs(8));
        assert_eq!(s(4), Duration::from_secs(10));
        assert_eq!(s(200), Duration::from_secs(10));
    }

    #[test]
    fn jitter_adds_at_most_a_fifth_and_never_subtracts() {
        let base = Duration::from_secs(1);
        let max = Duration::from_secs(10);
        assert_eq!(
            backoff(base, max, 1, 0.999_999_9),
            Duration::from_millis(2400)
        );
        assert_eq!(backoff(base, max, 1, 0.5), Duration::from_millis(2200));
        assert!(backoff(base, max, 1, -3.0) >= Duration::from_secs(2));
    }

    #[test]
    fn buckets_round_up_to_two_significant_digits() {
        let b = |ms| bucket(Duration::from_millis(ms)).as_millis();
        assert_eq!(b(0), 0);
        assert_eq!(b(7), 7);
        assert_eq!(b(99), 99);
        assert_eq!(b(101), 110);
        assert_eq!(b(1173), 1200);
        assert_eq!(b(1200), 1200);
        assert_eq!(b(37_412), 38_000);
        assert_eq!(b(600_000), 600_000);
        assert_eq!(bucket(Duration::from_micros(1500)).as_millis(), 2);
    }

    #[test]
    fn buckets_down_keep_two_significant_digits_and_one_ms() {
        let b = |ms| bucket_down(Duration::from_millis(ms)).as_millis();
        assert_eq!(b(0), 1);
        assert_eq!(b(7), 7);
        assert_eq!(b(99), 99);
        assert_eq!(b(101), 100);
        assert_eq!(b(1173), 1100);
        assert_eq!(b(37_412), 37_000);
        assert_eq!(b(10_800_500), 10_000_000);
        // Already a bucket: the delay queue's own rounding up keeps it.
        let d = bucket_down(Duration::from_millis(2_951));
        assert_eq!(bucket(d), d);
    }

    #[test]
    fn max_retries_counts_retries_not_runs() {
        let t = task(2);
        assert!(matches!(decide(&t, 0, 0.0), Decision::Retry { .. }));
        assert!(matches!(decide(&t, 1, 0.0), Decision::Retry { .. }));
        assert_eq!(decide(&t, 2, 0.0), Decision::Exhausted);
        assert_eq!(decide(&task(0), 0, 0.0), Decision::Exhausted);
    }
}
