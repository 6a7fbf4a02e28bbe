//! One exponential backoff for every reconnect, pacing and retry path
//! (docs/design.md#module-map): checked once where it is made, then only asked for delays.
//!
//! A delay starts at `min`, doubles per call up to `max`, and gains a random extra of up to
//! `jitter` times itself: jitter only lengthens a delay, so a delay is never shorter than the
//! un-jittered one and never longer than `max · (1 + jitter)`. The random draw can be passed in
//! ([`Backoff::next_delay_with`], [`Backoff::nth`]) so tests are exact.

use std::time::Duration;

/// Nanoseconds in a second.
const NANOS: u128 = 1_000_000_000;

/// Why a backoff's settings were refused ([`Backoff::new`]).
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum BackoffError {
    /// A zero first delay would never grow: the loop would spin.
    #[error("the first delay must be above zero")]
    ZeroMin,
    /// The cap is below the first delay.
    #[error("the longest delay ({max:?}) is shorter than the first ({min:?})")]
    MaxBelowMin {
        /// The first delay asked for.
        min: Duration,
        /// The cap asked for.
        max: Duration,
    },
    /// The jitter fraction is not a number in `[0, 1]`.
    #[error("the jitter must be a fraction in [0, 1], not {0}")]
    Jitter(f64),
}

/// An exponential backoff: `min`, doubled per [`next_delay`](Self::next_delay) up to `max`,
/// plus up to `jitter` of each delay at random; [`reset`](Self::reset) starts again from `min`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    jitter: f64,
    /// The un-jittered delay the next call returns.
    upcoming: Duration,
}

impl Backoff {
    /// A backoff from `min` doubling up to `max`, each delay lengthened by up to `jitter` of
    /// itself (0 for none, 0.2 for up to 20 %). Refuses a zero `min`, a `max` below `min` and a
    /// `jitter` outside `[0, 1]`. `const`, so a constant backoff is checked when compiling.
    pub const fn new(min: Duration, max: Duration, jitter: f64) -> Result<Self, BackoffError> {
        if min.is_zero() {
            return Err(BackoffError::ZeroMin);
        }
        if max.as_nanos() < min.as_nanos() {
            return Err(BackoffError::MaxBelowMin { min, max });
        }
        // Written so that NaN is refused too.
        if !(jitter >= 0.0 && jitter <= 1.0) {
            return Err(BackoffError::Jitter(jitter));
        }
        Ok(Backoff {
            min,
            max,
            jitter,
            upcoming: min,
        })
    }

    /// [`new`](Self::new) for constants: settings `new` refuses fail the build in a `const`
    /// item (and panic elsewhere).
    ///
    /// ```
    /// # use drumline_core::backoff::Backoff;
    /// # use std::time::Duration;
    /// const RECONNECT: Backoff =
    ///     Backoff::constant(Duration::from_millis(200), Duration::from_secs(5), 0.0);
    /// assert_eq!(RECONNECT.nth(1, 0.0), Duration::from_millis(400));
    /// ```
    ///
    /// ```compile_fail
    /// # use drumline_core::backoff::Backoff;
    /// # use std::time::Duration;
    /// const SPINS: Backoff = Backoff::constant(Duration::ZERO, Duration::from_secs(5), 0.0);
    /// ```
    ///
    /// # Panics
    ///
    /// When [`new`](Self::new) refuses the settings.
    pub const fn constant(min: Duration, max: Duration, jitter: f64) -> Self {
        match Self::new(min, max, jitter) {
            Ok(backoff) => backoff,
            Err(_) => panic!("Backoff::new refuses these settings"),
        }
    }

    /// The next delay, with a random jitter draw (none is drawn when `jitter` is 0).
    pub fn next_delay(&mut self) -> Duration {
        let unit = if self.jitter > 0.0 {
            rand::random::<f64>()
        } else {
            0.0
        };
        self.next_delay_with(unit)
    }

    /// The next delay with the jitter draw `unit` in `[0, 1]` (clamped; NaN counts as 0):
    /// `unit` 0 adds nothing, 1 adds the whole `jitter` fraction. Then doubles, up to `max`.
    pub fn next_delay_with(&mut self, unit: f64) -> Duration {
        let delay = self.jittered(self.upcoming, unit);
        self.upcoming = self.upcoming.saturating_mul(2).min(self.max);
        delay
    }

    /// The un-jittered delay the next call to [`next_delay`](Self::next_delay) starts from (to
    /// log it before it is taken).
    pub fn peek(&self) -> Duration {
        self.upcoming
    }

    /// Starts again from `min` (after a success).
    pub fn reset(&mut self) {
        self.upcoming = self.min;
    }

    /// The delay after `n` doublings, statelessly: `min(max, min · 2^n)` lengthened by `unit`
    /// as in [`next_delay_with`](Self::next_delay_with): what the `n+1`-th call after a
    /// [`reset`](Self::reset) returns.
    pub fn nth(&self, n: u32, unit: f64) -> Duration {
        // In nanoseconds, where `min · 2^n` cannot overflow before it passes `max`.
        let nanos = match n {
            0..=63 => self.min.as_nanos().saturating_mul(1 << n),
            _ => u128::MAX,
        };
        let d = if nanos >= self.max.as_nanos() {
            self.max
        } else {
            // Below `max`, so the seconds fit.
            Duration::new((nanos / NANOS) as u64, (nanos % NANOS) as u32)
        };
        self.jittered(d, unit)
    }

    /// `d` plus `jitter · unit` of it. Computed as `Duration::mul_f64` does, without its panic
    /// on overflow.
    fn jittered(&self, d: Duration, unit: f64) -> Duration {
        let unit = if unit >= 0.0 { unit.min(1.0) } else { 0.0 };
        let extra = Duration::try_from_secs_f64(self.jitter * unit * d.as_secs_f64());
        d.saturating_add(extra.unwrap_or(Duration::MAX))
    }
}

/// `(min, max)` without jitter, checked as [`Backoff::new`] checks it.
impl TryFrom<(Duration, Duration)> for Backoff {
    type Error = BackoffError;

    fn try_from((min, max): (Duration, Duration)) -> Result<Self, BackoffError> {
        Backoff::new(min, max, 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn doubles_from_min_up_to_max() {
        let mut b = Backoff::new(MS(200), MS(5000), 0.0).unwrap();
        let delays: Vec<_> = (0..7).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [200, 400, 800, 1600, 3200, 5000, 5000]);
        assert_eq!(b.peek(), MS(5000));
        b.reset();
        assert_eq!((b.peek(), b.next_delay()), (MS(200), MS(200)));
    }

    #[test]
    fn jitter_only_lengthens_by_its_fraction() {
        let mut b = Backoff::new(MS(1000), MS(10_000), 0.2).unwrap();
        assert_eq!(b.next_delay_with(0.0), MS(1000));
        assert_eq!(b.next_delay_with(0.5), MS(2200));
        assert_eq!(b.next_delay_with(1.0), MS(4800));
        assert_eq!(
            b.next_delay_with(7.0),
            MS(9600),
            "a draw above 1 counts as 1"
        );
        assert_eq!(
            b.next_delay_with(-3.0),
            MS(10_000),
            "a draw below 0 counts as 0"
        );
        assert_eq!(b.next_delay_with(f64::NAN), MS(10_000), "NaN counts as 0");
    }

    #[test]
    fn nth_is_the_delay_after_n_doublings() {
        let b = Backoff::new(MS(200), MS(30_000), 0.0).unwrap();
        let ms = |n| b.nth(n, 0.0).as_millis();
        assert_eq!((ms(0), ms(1), ms(7)), (200, 400, 25_600));
        assert_eq!((ms(8), ms(u32::MAX)), (30_000, 30_000));
        let j = Backoff::new(MS(1000), MS(10_000), 0.2).unwrap();
        assert_eq!(j.nth(1, 0.5), MS(2200));
    }

    #[test]
    fn bad_settings_are_refused_with_their_reason() {
        assert_eq!(
            Backoff::new(Duration::ZERO, MS(1), 0.0),
            Err(BackoffError::ZeroMin)
        );
        assert_eq!(
            Backoff::new(MS(2), MS(1), 0.0),
            Err(BackoffError::MaxBelowMin {
                min: MS(2),
                max: MS(1)
            })
        );
        assert_eq!(
            Backoff::new(MS(1), MS(1), 1.5),
            Err(BackoffError::Jitter(1.5))
        );
        assert_eq!(
            Backoff::new(MS(1), MS(1), -0.1),
            Err(BackoffError::Jitter(-0.1))
        );
        assert!(matches!(
            Backoff::new(MS(1), MS(1), f64::NAN),
            Err(BackoffError::Jitter(j)) if j.is_nan()
        ));
        assert!(Backoff::new(MS(1), MS(1), 1.0).is_ok());
        assert_eq!(
            Backoff::try_from((MS(1), MS(2))),
            Backoff::new(MS(1), MS(2), 0.0)
        );
        assert_eq!(
            Backoff::try_from((Duration::ZERO, MS(2))),
            Err(BackoffError::ZeroMin)
        );
    }

    #[test]
    #[should_panic(expected = "Backoff::new refuses these settings")]
    fn a_constant_with_bad_settings_panics_at_run_time() {
        let max = std::hint::black_box(MS(1));
        Backoff::constant(MS(2), max, 0.0);
    }

    #[test]
    fn huge_bounds_saturate_instead_of_panicking() {
        let mut b = Backoff::new(Duration::MAX, Duration::MAX, 1.0).unwrap();
        assert_eq!(b.next_delay_with(1.0), Duration::MAX);
        assert_eq!(b.nth(40, 1.0), Duration::MAX);
    }

    /// Settings `new` accepts: `min` from 1 ns to ~11 days (small ones often, so the doubling
    /// runs long), `max` up to ~11 days above it, the jitter often at its ends.
    fn settings() -> impl Strategy<Value = (Duration, Duration, f64)> {
        let min = prop_oneof![1u64..1000, 1u64..1_000_000_000_000_000];
        let above = 0u64..1_000_000_000_000_000;
        (min, above, unit()).prop_map(|(min, above, jitter)| {
            let min = Duration::from_nanos(min);
            (min, min + Duration::from_nanos(above), jitter)
        })
    }

    /// A fraction in `[0, 1]`, often exactly 0 or 1.
    fn unit() -> impl Strategy<Value = f64> {
        prop_oneof![Just(0.0), Just(1.0), 0.0..=1.0f64]
    }

    proptest! {
        #[test]
        fn delays_stay_within_min_and_max_plus_jitter(
            (min, max, jitter) in settings(),
            draws in proptest::collection::vec(unit(), 1..80),
        ) {
            let mut b = Backoff::new(min, max, jitter).unwrap();
            let ceiling = max + max.mul_f64(jitter);
            for unit in draws {
                let d = b.next_delay_with(unit);
                prop_assert!(d >= min, "{d:?} below min {min:?}");
                prop_assert!(d <= ceiling, "{d:?} above {ceiling:?}");
            }
        }

        #[test]
        fn without_jitter_delays_never_shrink((min, max, _) in settings(), calls in 1usize..80) {
            let mut b = Backoff::new(min, max, 0.0).unwrap();
            let mut last = Duration::ZERO;
            for _ in 0..calls {
                let d = b.next_delay();
                prop_assert!(d >= last, "{d:?} after {last:?}");
                prop_assert!(d <= max);
                last = d;
            }
        }

        #[test]
        fn reset_goes_back_to_min((min, max, jitter) in settings(), calls in 0usize..80) {
            let mut b = Backoff::new(min, max, jitter).unwrap();
            for _ in 0..calls {
                b.next_delay();
            }
            b.reset();
            prop_assert_eq!(b.peek(), min);
            prop_assert_eq!(b.next_delay_with(0.0), min);
        }

        #[test]
        fn nth_matches_the_calls_after_a_reset(
            (min, max, jitter) in settings(),
            draws in proptest::collection::vec(unit(), 1..80),
        ) {
            let mut b = Backoff::new(min, max, jitter).unwrap();
            for (n, unit) in draws.into_iter().enumerate() {
                prop_assert_eq!(b.nth(n as u32, unit), b.next_delay_with(unit));
            }
        }
    }
}
