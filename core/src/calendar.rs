//! Calendars (docs/design.md#calendars): lists of dates a job skips. A job's `exclude` names
//! calendars; an instant whose local date (in the job's zone) is in one of them is skipped,
//! journaled `skipped` with reason `calendar`, never published.

use chrono::{DateTime, Datelike, NaiveDate, Utc};
use chrono_tz::Tz;
use std::collections::BTreeSet;

/// A calendar: dates, and dates that come back every year.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Calendar {
    dates: BTreeSet<NaiveDate>,
    /// `(month, day)` of the `*-MM-DD` forms.
    yearly: BTreeSet<(u32, u32)>,
}

/// A date form that is neither `YYYY-MM-DD` nor `*-MM-DD`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a date: write YYYY-MM-DD, or *-MM-DD for every year")]
pub struct BadDate(pub String);

impl Calendar {
    /// The calendar of `dates`, each `YYYY-MM-DD` or `*-MM-DD` (every year).
    pub fn parse<S: AsRef<str>>(dates: &[S]) -> Result<Self, BadDate> {
        let mut calendar = Calendar::default();
        for text in dates {
            let text = text.as_ref();
            let bad = || BadDate(text.to_owned());
            match text.strip_prefix("*-") {
                Some(month_day) => {
                    // Checked against a leap year, so `*-02-29` is a date.
                    let date = NaiveDate::parse_from_str(&format!("2000-{month_day}"), "%Y-%m-%d")
                        .map_err(|_| bad())?;
                    calendar.yearly.insert((date.month(), date.day()));
                }
                None => {
                    let date = NaiveDate::parse_from_str(text, "%Y-%m-%d").map_err(|_| bad())?;
                    calendar.dates.insert(date);
                }
            }
        }
        Ok(calendar)
    }

    /// Whether `date` is in the calendar.
    pub fn contains(&self, date: NaiveDate) -> bool {
        self.dates.contains(&date) || self.yearly.contains(&(date.month(), date.day()))
    }

    /// The dates as written back: `YYYY-MM-DD` first, then `*-MM-DD`.
    pub fn dates(&self) -> Vec<String> {
        let dates = self.dates.iter().map(|d| d.format("%Y-%m-%d").to_string());
        let yearly = self.yearly.iter().map(|(m, d)| format!("*-{m:02}-{d:02}"));
        dates.chain(yearly).collect()
    }
}

/// The first of `exclude` (calendar names, looked up with `calendar`) whose dates hold the
/// local date of `instant` in `zone`; `None` when the instant is not excluded. A name with no
/// calendar excludes nothing.
pub fn excluded_by<'n, 'c>(
    exclude: &'n [impl AsRef<str>],
    instant: DateTime<Utc>,
    zone: Tz,
    calendar: impl Fn(&str) -> Option<&'c Calendar>,
) -> Option<&'n str> {
    if exclude.is_empty() {
        return None;
    }
    let date = instant.with_timezone(&zone).date_naive();
    exclude
        .iter()
        .map(AsRef::as_ref)
        .find(|name| calendar(name).is_some_and(|c| c.contains(date)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn dates_and_yearly_dates_are_held() {
        let c = Calendar::parse(&["2026-12-25", "*-01-01", "*-02-29"]).expect("valid");
        let day = |y, m, d| NaiveDate::from_ymd_opt(y, m, d).unwrap();
        assert!(c.contains(day(2026, 12, 25)) && !c.contains(day(2027, 12, 25)));
        assert!(c.contains(day(2027, 1, 1)) && c.contains(day(2028, 2, 29)));
        assert_eq!(c.dates(), ["2026-12-25", "*-01-01", "*-02-29"]);
    }

    #[test]
    fn bad_dates_are_refused() {
        for bad in ["2026-13-01", "25.12.2026", "*-02-30", "*-1-1x", ""] {
            assert_eq!(Calendar::parse(&[bad]), Err(BadDate(bad.into())), "{bad}");
        }
    }

    #[test]
    fn an_instant_is_excluded_by_its_local_date() {
        let holidays = Calendar::parse(&["2026-12-25"]).unwrap();
        let lookup = |name: &str| (name == "holidays").then_some(&holidays);
        let berlin: Tz = "Europe/Berlin".parse().unwrap();
        // 23:30 UTC on the 24th is already the 25th in Berlin.
        let eve = Utc.with_ymd_and_hms(2026, 12, 24, 23, 30, 0).unwrap();
        assert_eq!(
            excluded_by(&["holidays"], eve, berlin, lookup),
            Some("holidays")
        );
        assert_eq!(
            excluded_by(&["holidays"], eve, chrono_tz::UTC, lookup),
            None
        );
        assert_eq!(
            excluded_by(&["unknown", "holidays"], eve, berlin, lookup),
            Some("holidays")
        );
        assert_eq!(excluded_by(&["unknown"], eve, berlin, lookup), None);
        let none: [&str; 0] = [];
        assert_eq!(excluded_by(&none, eve, berlin, lookup), None);
    }
}
