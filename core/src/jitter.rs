//! A job's deterministic jitter (docs/design.md#jitter): `jitter = "D"` delays every instant of
//! the job by the same offset in `[0, D)`, drawn from a hash of the namespace and the job's name.
//! Pure: the same inputs give the same offset on every beat, on every host, after every restart.
//!
//! The hash is SHA-256 (fixed, unkeyed), never std's `DefaultHasher`, whose keys are random per
//! process: two beats would disagree, and a restart would move the job.

use sha2::{Digest, Sha256};
use std::time::Duration;

/// A job's jitter: the configured bound and the offset it gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Jitter {
    /// The configured `jitter`: offsets lie in `[0, max)`.
    pub max: Duration,
    /// This job's offset, added to each of its instants when publishing.
    pub offset: Duration,
}

impl Jitter {
    /// The jitter of job `job` in namespace `namespace` with bound `max`.
    pub fn new(namespace: &str, job: &str, max: Duration) -> Self {
        Jitter {
            max,
            offset: offset(namespace, job, max),
        }
    }

    /// The offset as a chrono delta (saturating; offsets are far below its range).
    pub fn delta(&self) -> chrono::TimeDelta {
        chrono::TimeDelta::from_std(self.offset).unwrap_or(chrono::TimeDelta::MAX)
    }
}

/// The offset in `[0, max)`, in whole milliseconds (the precision of instants and keys), of
/// `job` in `namespace`; zero when `max` is under a millisecond.
///
/// The first 8 bytes of `SHA-256(namespace NUL job)` as a fraction of 2^64, times `max` in
/// milliseconds: uniform over the range, and without the bias of a modulo.
pub fn offset(namespace: &str, job: &str, max: Duration) -> Duration {
    let mut hash = Sha256::new();
    hash.update(namespace.as_bytes());
    hash.update([0u8]);
    hash.update(job.as_bytes());
    let digest = hash.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let fraction = u128::from(u64::from_be_bytes(first));
    let millis = (fraction * max.as_millis()) >> 64;
    // `millis < max.as_millis()`, so it fits whenever `max` does.
    Duration::from_millis(u64::try_from(millis).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn the_same_inputs_give_the_same_offset() {
        let a = offset("billing", "nightly", HOUR);
        assert_eq!(a, offset("billing", "nightly", HOUR));
        assert_eq!(Jitter::new("billing", "nightly", HOUR).offset, a);
        // Pinned (checked with Python's hashlib): a change of the hash would move every
        // jittered job of every user.
        assert_eq!(
            offset("billing", "nightly", HOUR),
            Duration::from_millis(2_652_065)
        );
    }

    #[test]
    fn namespace_and_name_both_count_and_do_not_run_together() {
        let base = offset("billing", "nightly", HOUR);
        assert_ne!(offset("billing", "nightly2", HOUR), base);
        assert_ne!(offset("billing2", "nightly", HOUR), base);
        // The separator keeps ("ab", "c") apart from ("a", "bc").
        assert_ne!(offset("ab", "c", HOUR), offset("a", "bc", HOUR));
    }

    #[test]
    fn offsets_lie_in_the_range_and_spread_over_it() {
        let max = Duration::from_secs(60);
        let mut buckets = [0u32; 6];
        for i in 0..6000 {
            let o = offset("ns", &format!("job-{i}"), max);
            assert!(o < max, "{o:?}");
            buckets[(o.as_secs() / 10) as usize] += 1;
        }
        // 1000 expected per 10 s bucket; a fair hash stays well within ±20 %.
        for (i, n) in buckets.iter().enumerate() {
            assert!((800..=1200).contains(n), "bucket {i}: {n} of 6000");
        }
    }

    #[test]
    fn tiny_and_zero_bounds() {
        assert_eq!(offset("ns", "j", Duration::ZERO), Duration::ZERO);
        assert_eq!(
            offset("ns", "j", Duration::from_nanos(999_999)),
            Duration::ZERO
        );
        // Whole milliseconds, like instants and keys.
        assert_eq!(
            offset("ns", "j", Duration::from_secs(60)).subsec_nanos() % 1_000_000,
            0
        );
        let huge = Duration::from_secs(365 * 86_400);
        assert!(offset("ns", "j", huge) < huge);
        let j = Jitter::new("ns", "j", Duration::from_millis(1500));
        assert_eq!(j.delta().to_std().unwrap(), j.offset);
    }
}
