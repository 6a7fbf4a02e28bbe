//! Concurrency groups and rate limits (`[limits.NAME]`, docs/design.md#limits): the checked
//! form, `N/PERIOD` parsing, and the sliding-window rule the store's claim script applies
//! ([`next_start`] is that rule as a pure function, the reference its tests hold the script to).

use std::time::Duration;

/// One checked `[limits.NAME]` table: at least one of `concurrency` and `rate`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    /// The table's name; `[tasks.X] limit = "NAME"` refers to it.
    pub name: String,
    /// At most this many runs of the group at once, across all workers. Default none.
    pub concurrency: Option<u32>,
    /// At most `rate.count` starts in any window of `rate.period`, across all workers.
    /// Default none.
    pub rate: Option<Rate>,
}

/// `N/PERIOD`: at most `count` starts in any sliding window of `period`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    /// Starts allowed per window, at least 1.
    pub count: u32,
    /// The window: a second, a minute or an hour.
    pub period: Duration,
}

/// Why a rate text is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RateError {
    /// Not `N/PERIOD`.
    #[error("{0:?} is not N/PERIOD; write e.g. \"5/s\", \"100/m\" or \"10/h\"")]
    Syntax(String),
    /// `N` is zero.
    #[error("{0:?} allows no start at all; N must be at least 1")]
    Zero(String),
    /// `PERIOD` is not `s`, `m` or `h`.
    #[error("{0:?}: the period must be s, m or h")]
    Period(String),
}

impl Rate {
    /// Parses `N/PERIOD` (`5/s`, `100/m`, `10/h`; `sec`, `min`, `hour` spelled out also work).
    pub fn parse(text: &str) -> Result<Rate, RateError> {
        let syntax = || RateError::Syntax(text.to_owned());
        let (count, period) = text.split_once('/').ok_or_else(syntax)?;
        let count: u32 = count.trim().parse().map_err(|_| syntax())?;
        let period = match period.trim() {
            "s" | "sec" | "second" => Duration::from_secs(1),
            "m" | "min" | "minute" => Duration::from_secs(60),
            "h" | "hour" => Duration::from_secs(3600),
            "" => return Err(syntax()),
            _ => return Err(RateError::Period(text.to_owned())),
        };
        if count == 0 {
            return Err(RateError::Zero(text.to_owned()));
        }
        Ok(Rate { count, period })
    }

    /// The window the claim script counts starts in: the period plus a guard of a tenth of it
    /// (at most 1 s). A start is stamped when it is claimed; the task itself starts a little
    /// later (a process to spawn, a request to send), by an amount that varies. The guard
    /// keeps the bound on the tasks' own start times too, as long as that lag varies by less
    /// than the guard (docs/design.md#limits).
    pub fn window(&self) -> Duration {
        self.period + (self.period / 10).min(Duration::from_secs(1))
    }
}

/// When the next start may be stamped under a rate of `count` starts per `window` ms: `stamps`
/// are the starts (and reservations) recorded, `now` the clock. Starts are spread evenly, each
/// at least [`gap`] after the newest, so any window of `window` ms holds at most `count` of
/// them: `count + 1` stamps span `count` gaps, a whole window. Spread rather than in bursts,
/// the starts do not queue behind each other to spawn, so the lag from a start's stamp to the
/// task's own start stays small and even, and the bound holds on the tasks' clocks too
/// (docs/design.md#limits). The claim script in `store/src/lib.rs` applies the same rule.
pub fn next_start(stamps: &[u64], count: u32, window: u64, now: u64) -> u64 {
    match stamps.iter().max() {
        Some(newest) => now.max(newest + gap(count, window)),
        None => now,
    }
}

/// The least time between two starts of a rate of `count` per `window` ms: `window / count`,
/// rounded up.
pub fn gap(count: u32, window: u64) -> u64 {
    window.div_ceil(u64::from(count.max(1)))
}

/// The most stamps in any half-open window `[t, t + window)`: what the rule bounds. `stamps`
/// need not be sorted.
pub fn most_in_window(stamps: &[u64], window: u64) -> usize {
    let mut sorted = stamps.to_vec();
    sorted.sort_unstable();
    let mut first = 0;
    let mut most = 0;
    for (last, at) in sorted.iter().enumerate() {
        while sorted[first] + window <= *at {
            first += 1;
        }
        most = most.max(last + 1 - first);
    }
    most
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_with_their_periods() {
        let rate = |count, secs| Rate {
            count,
            period: Duration::from_secs(secs),
        };
        assert_eq!(Rate::parse("5/s"), Ok(rate(5, 1)));
        assert_eq!(Rate::parse("100/m"), Ok(rate(100, 60)));
        assert_eq!(Rate::parse("10/h"), Ok(rate(10, 3600)));
        assert_eq!(Rate::parse(" 3 / min "), Ok(rate(3, 60)));
    }

    #[test]
    fn bad_rates_say_what_is_wrong() {
        for bad in ["5", "/s", "x/s", "-1/s", "5/", "1.5/s", ""] {
            assert!(
                matches!(Rate::parse(bad), Err(RateError::Syntax(_))),
                "{bad}"
            );
        }
        assert_eq!(Rate::parse("0/s"), Err(RateError::Zero("0/s".into())));
        assert_eq!(Rate::parse("5/d"), Err(RateError::Period("5/d".into())));
        assert!(Rate::parse("5/d")
            .unwrap_err()
            .to_string()
            .contains("s, m or h"));
    }

    #[test]
    fn the_window_has_a_guard_of_a_tenth_at_most_a_second() {
        let w = |text| Rate::parse(text).unwrap().window();
        assert_eq!(w("10/s"), Duration::from_millis(1100));
        assert_eq!(w("10/m"), Duration::from_secs(61));
        assert_eq!(w("10/h"), Duration::from_secs(3601));
    }

    #[test]
    fn next_start_comes_a_gap_after_the_newest() {
        assert_eq!(gap(3, 1000), 334);
        assert_eq!(next_start(&[], 2, 1000, 50), 50);
        assert_eq!(next_start(&[10], 2, 1000, 50), 510);
        assert_eq!(next_start(&[10, 20], 2, 1000, 600), 600);
        // Reservations ahead of now count like starts.
        assert_eq!(next_start(&[10, 1020, 520], 2, 1000, 50), 1520);
        assert_eq!(next_start(&[10, 20], 2, 1000, 5000), 5000);
    }

    #[test]
    fn stamping_at_next_start_never_overfills_a_window() {
        // Bursty arrivals: every stamp goes where the rule puts it, and no window of the
        // rule's length ever holds more than `count`.
        let (count, window) = (10u32, 1100u64);
        let mut stamps = Vec::new();
        let mut seed = 7u64;
        let mut now = 0u64;
        for _ in 0..500 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            now += (seed >> 33) % 40;
            stamps.push(next_start(&stamps, count, window, now));
        }
        assert_eq!(most_in_window(&stamps, window), count as usize);
    }

    #[test]
    fn most_in_window_counts_half_open_windows() {
        assert_eq!(most_in_window(&[], 1000), 0);
        assert_eq!(most_in_window(&[0, 999, 1000], 1000), 2);
        assert_eq!(most_in_window(&[5, 5, 5], 1), 3);
        assert_eq!(most_in_window(&[3000, 0, 100, 2000, 2500], 1000), 2);
    }
}
