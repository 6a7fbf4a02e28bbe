//! Defects planted on purpose, so that the randomized checker can show it finds them
//! (docs/soak.md#planted-defects). Each exists only in debug builds — the builds the tests run —
//! and only when `DRUMLINE_PLANTED_DEFECT` names it; a release build has none of them.

use std::sync::OnceLock;

/// One planted defect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Defect {
    /// The worker hands a failed attempt over to its retry but never publishes the retry.
    SkipRetry,
    /// The worker runs a successful handler a second time.
    DoubleRun,
    /// The worker acks one delivery in five without claiming or running it.
    DropDelivery,
    /// The worker claims every instance as if its job were `overlap = "allow"`.
    IgnoreOverlap,
    /// `audit` ignores the journal of one instant in seven (verify then reports it missed).
    FalseMissed,
    /// The beat publishes an `after` job's instance once its upstream's instance has any run
    /// state, not only `done`.
    EarlyFollower,
    /// The beat ignores the delete of a schedule applied at run time and keeps publishing it.
    IgnoreDelete,
}

impl Defect {
    /// The name `DRUMLINE_PLANTED_DEFECT` takes.
    pub fn name(self) -> &'static str {
        match self {
            Defect::SkipRetry => "skip_retry",
            Defect::DoubleRun => "double_run",
            Defect::DropDelivery => "drop_delivery",
            Defect::IgnoreOverlap => "ignore_overlap",
            Defect::FalseMissed => "false_missed",
            Defect::EarlyFollower => "early_follower",
            Defect::IgnoreDelete => "ignore_delete",
        }
    }

    /// Every planted defect.
    pub const ALL: [Defect; 7] = [
        Defect::SkipRetry,
        Defect::DoubleRun,
        Defect::DropDelivery,
        Defect::IgnoreOverlap,
        Defect::FalseMissed,
        Defect::EarlyFollower,
        Defect::IgnoreDelete,
    ];
}

/// Whether `defect` is planted in this process.
pub fn planted(defect: Defect) -> bool {
    static CHOSEN: OnceLock<Option<Defect>> = OnceLock::new();
    *CHOSEN.get_or_init(chosen) == Some(defect)
}

#[cfg(debug_assertions)]
fn chosen() -> Option<Defect> {
    let name = std::env::var("DRUMLINE_PLANTED_DEFECT").ok()?;
    let defect = Defect::ALL.into_iter().find(|d| d.name() == name);
    match defect {
        Some(d) => tracing::warn!(
            defect = d.name(),
            "a defect is planted on purpose (DRUMLINE_PLANTED_DEFECT, a test build)"
        ),
        None => {
            tracing::warn!(name = %name, "DRUMLINE_PLANTED_DEFECT names no defect: none planted")
        }
    }
    defect
}

#[cfg(not(debug_assertions))]
fn chosen() -> Option<Defect> {
    None
}

/// A stable pick of one key in `n` (the same key is picked in every process).
pub fn one_in(key: &str, n: u64) -> bool {
    let sum = key
        .bytes()
        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b.into()));
    sum % n == 0
}
