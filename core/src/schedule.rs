//! Schedule math: when is a job due? Pure code, time injected, no I/O.
//!
//! Two kinds of rule (docs/design.md):
//!
//! - **Cron** ([`CronExpr`]): 5 fields (`min hour dom month dow`, seconds = 0) or 6 fields (leading
//!   seconds), evaluated on the *wall clock* of an IANA zone, with explicit policies for wall times
//!   that do not exist ([`DstGap`]) or happen twice ([`DstFold`]).
//! - **Every**: a fixed rate `anchor + k·every` on the UTC timeline (elapsed time, no DST effect).
//!
//! # Ordering contract
//!
//! [`Schedule::next_occurrence_after`] yields occurrences in strictly increasing `at` order and
//! **at most one occurrence per UTC instant**: wall times that collapse onto one instant (every
//! wall time of a gap under `shift`, plus the wall time right after the gap) are merged into one
//! occurrence. When a `skip`ped gap marker would share its instant (the transition) with a real
//! run (the cron also matches the first wall time after the gap), the real run wins and the marker
//! disappears. Hence [`Schedule::next_after`] may step over skipped occurrences with
//! `after = occ.at` without ever losing a real one.
//!
//! # Why a hand-written cron parser
//!
//! We evaluate the field sets ourselves (DST policies), so a crate would only parse. `croner` 4
//! exposes its bit sets but keeps the `*` flags that decide Vixie's day-of-month/day-of-week OR
//! private, accepts Quartz extensions (`?`, years) we would have to screen out, and its
//! errors do not name the field; `cron` 0.17 speaks another dialect (mandatory seconds, weekday
//! 1 = Sunday, no OR); `saffron` 0.1 is UTC-only. So the ~200 lines of parsing live here.

use chrono::{
    DateTime, Datelike, LocalResult, NaiveDate, NaiveDateTime, NaiveTime, Offset, TimeDelta,
    TimeZone, Timelike, Utc,
};
use chrono_tz::Tz;
use std::fmt;
use std::str::FromStr;

/// How far ahead a cron search looks before giving up (`None`). Feb 29 can wait 8 years
/// (2096 → 2104); a fifth Monday in February (`* 2 MON#5`) 40 (2072 → 2112, 2100 not being leap).
const HORIZON_YEARS: i32 = 41;

/// What to do with a local time that does not exist (spring-forward gap). Default `Shift`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DstGap {
    /// Run at the first valid instant after the gap (the transition itself).
    #[default]
    Shift,
    /// Do not run.
    Skip,
}

/// What to do with a local time that happens twice (fall-back fold). Default `First`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DstFold {
    /// Run at the earlier of the two instants.
    #[default]
    First,
    /// Run at the later of the two instants.
    Second,
    /// Run at both.
    Both,
}

impl DstGap {
    /// The config's spelling (`dst_gap = "shift"`).
    pub fn as_str(self) -> &'static str {
        match self {
            DstGap::Shift => "shift",
            DstGap::Skip => "skip",
        }
    }
}

impl DstFold {
    /// The config's spelling (`dst_fold = "first"`).
    pub fn as_str(self) -> &'static str {
        match self {
            DstFold::First => "first",
            DstFold::Second => "second",
            DstFold::Both => "both",
        }
    }
}

/// Why a cron expression or a time zone was refused; the message names the field and the
/// reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// `@something` that is not one of the macros.
    #[error(
        "cron {expr:?}: unknown macro {expr:?} (known: @yearly, @annually, @monthly, @weekly, \
         @daily, @midnight, @hourly)"
    )]
    UnknownMacro {
        /// The expression as written (trimmed).
        expr: String,
    },
    /// Neither 5 nor 6 fields.
    #[error("cron {expr:?}: expected 5 or 6 fields, got {got}")]
    FieldCount {
        /// The expression as written (trimmed).
        expr: String,
        /// How many fields it has.
        got: usize,
    },
    /// A bad value, range or step in one field.
    #[error("cron {expr:?}: field {field}: {why}")]
    Field {
        /// The expression as written (trimmed).
        expr: String,
        /// The field's name (`minute`, `day-of-week`, …).
        field: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// A day of month that no month of the expression has (`0 0 30 2 *`).
    #[error(
        "cron {expr:?}: never matches: day-of-month {days:?} does not occur in month {months:?}"
    )]
    NeverMatches {
        /// The expression as written (trimmed).
        expr: String,
        /// Its day-of-month field.
        days: String,
        /// Its month field.
        months: String,
    },
    /// Not an IANA zone name known to chrono-tz.
    #[error("unknown time zone {name:?}{}", zone_hint(suggestions))]
    UnknownZone {
        /// The name as written.
        name: String,
        /// The closest known names (at most 3).
        suggestions: Vec<&'static str>,
    },
}

/// ` (did you mean …?)` for an unknown zone, or what a zone name looks like.
fn zone_hint(suggestions: &[&'static str]) -> String {
    match suggestions {
        [] => " (expected an IANA name such as \"Europe/Berlin\" or \"UTC\")".to_string(),
        [one] => format!(" (did you mean {one:?}?)"),
        [init @ .., last] => {
            let init: Vec<String> = init.iter().map(|s| format!("{s:?}")).collect();
            format!(" (did you mean {} or {last:?}?)", init.join(", "))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Cron parsing
// ---------------------------------------------------------------------------------------------

/// A parsed cron expression (5 fields, or 6 with leading seconds).
///
/// Syntax per field: `*`, `n`, `a-b`, `*/n`, `a-b/n`, `a/n` (from `a` to the field's maximum),
/// and comma lists of those. Months accept `JAN`–`DEC`, weekdays `SUN`–`SAT` (case-insensitive);
/// weekday `0` and `7` are both Sunday, and a weekday range may end in Sunday (`FRI-SUN`).
/// The macros `@yearly`/`@annually`, `@monthly`, `@weekly`, `@daily`/`@midnight` and `@hourly`
/// are accepted.
///
/// Day extensions (docs/design.md#cron-day-extensions): in day-of-month, `L` is the month's last day,
/// `LW` its last weekday (Monday–Friday) and `15W` the weekday nearest the 15th, never crossing
/// the month (`1W` on a Saturday is Monday the 3rd; `31W` does not match a 30-day month). In
/// day-of-week, `5L` (or `FRIL`) is the month's last Friday and `MON#2` (or `1#2`) its second
/// Monday (`#1`–`#5`); 0 and 7 are Sunday. Each stands alone as a list item (`1,15,L`), without
/// a range or a step. Quartz's `?` is not accepted.
///
/// Day semantics are Vixie cron's: when both day-of-month and day-of-week are restricted (neither
/// field is exactly `*`), a day matches if **either** matches; otherwise both must match.
/// Consequently `0 0 */1 * MON` means every day (`*/1` is a restriction that happens to cover all
/// days), which is what Vixie's documentation says and what a literal reading gives.
///
/// An expression that can never match (`0 0 30 2 *`) is refused by [`CronExpr::parse`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CronExpr {
    /// The expression as written (trimmed), for display.
    text: String,
    /// Bit `s` set when second `s` matches (0–59).
    seconds: u64,
    /// Bit `m` set when minute `m` matches (0–59).
    minutes: u64,
    /// Bit `h` set when hour `h` matches (0–23).
    hours: u32,
    /// Bit `d` set when day-of-month `d` matches (1–31).
    days: u32,
    /// Bit `m` set when month `m` matches (1–12).
    months: u16,
    /// Bit `w` set when weekday `w` matches (0 = Sunday … 6).
    weekdays: u8,
    /// Day-of-month field was exactly `*`.
    dom_any: bool,
    /// Day-of-week field was exactly `*`.
    dow_any: bool,
    /// Written with 6 fields.
    has_seconds: bool,
    /// For each weekday `w` of the 1st of a month: the days of that month (bit `d`) whose weekday
    /// is in `weekdays`. Precomputed so a month's matching days are a couple of bit operations.
    dow_days_by_first: [u32; 7],
    /// The `L`, `W` and `#` items of the two day fields.
    special: DaySpecials,
}

/// The day items that depend on the month's length or its weekdays: `L`, `LW`, `15W` (day of
/// month), `5L`, `MON#2` (day of week).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct DaySpecials {
    /// `L`: the last day of the month.
    last_day: bool,
    /// `LW`: the last weekday (Monday–Friday) of the month.
    last_weekday: bool,
    /// Bit `n` for `nW`: the weekday nearest day `n`, within the month.
    nearest_weekday: u32,
    /// Bit `w` for `wL`: the last weekday `w` (0 = Sunday) of the month.
    last_of: u8,
    /// `nth[n - 1]` has bit `w` for `w#n`: the `n`-th weekday `w` of the month.
    nth: [u8; 5],
}

/// One cron field's rules.
struct Field {
    name: &'static str,
    min: u32,
    /// Largest value accepted as written (7 for weekdays: Sunday again).
    max: u32,
    /// Largest value `*` and `a/n` expand to (6 for weekdays, so `1/2` does not include Sunday).
    star_max: u32,
    names: &'static [&'static str],
    /// What the kind of name is called in error messages.
    names_desc: &'static str,
}

const MONTH_NAMES: [&str; 12] = [
    "JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC",
];
const WEEKDAY_NAMES: [&str; 7] = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"];

const SECOND: Field = Field {
    name: "second",
    min: 0,
    max: 59,
    star_max: 59,
    names: &[],
    names_desc: "",
};
const MINUTE: Field = Field {
    name: "minute",
    ..SECOND
};
const HOUR: Field = Field {
    name: "hour",
    min: 0,
    max: 23,
    star_max: 23,
    names: &[],
    names_desc: "",
};
const DAY_OF_MONTH: Field = Field {
    name: "day-of-month",
    min: 1,
    max: 31,
    star_max: 31,
    names: &[],
    names_desc: "",
};
const MONTH: Field = Field {
    name: "month",
    min: 1,
    max: 12,
    star_max: 12,
    names: &MONTH_NAMES,
    names_desc: "month name (JAN-DEC)",
};
const DAY_OF_WEEK: Field = Field {
    name: "day-of-week",
    min: 0,
    max: 7,
    star_max: 6,
    names: &WEEKDAY_NAMES,
    names_desc: "weekday name (SUN-SAT)",
};

impl Field {
    /// Parses one value: a number in range or (where the field has them) a name.
    fn value(&self, s: &str) -> Result<u32, String> {
        if s.is_empty() {
            return Err("missing value".into());
        }
        if s.bytes().all(|b| b.is_ascii_digit()) {
            return match s.parse::<u32>() {
                Ok(v) if (self.min..=self.max).contains(&v) => Ok(v),
                _ => Err(format!("{s} is out of range {}-{}", self.min, self.max)),
            };
        }
        if let Some(i) = self.names.iter().position(|n| n.eq_ignore_ascii_case(s)) {
            // Month names count from 1, weekday names from 0 (= their index).
            return Ok(i as u32 + self.min);
        }
        if s == "?" {
            return Err("\"?\" is Quartz syntax, which is not supported (write *)".into());
        }
        if is_day_extension(s) {
            return Err(format!(
                "{s:?}: L, W and # belong to day-of-month (L, LW, 15W) and day-of-week \
                 (5L, MON#2), each as a list item of its own"
            ));
        }
        if self.names.is_empty() {
            Err(format!("{s:?} is not a number"))
        } else {
            Err(format!("{s:?} is not a number or {}", self.names_desc))
        }
    }

    /// Parses a whole field into a bit set (bit `v` for value `v`).
    fn parse(&self, text: &str) -> Result<u64, String> {
        let mut bits = 0u64;
        for item in text.split(',') {
            if item.is_empty() {
                return Err(format!("empty item in list {text:?}"));
            }
            let (range, step) = match item.split_once('/') {
                Some((range, step)) => (range, Some(parse_step(step)?)),
                None => (item, None),
            };
            let (lo, hi) = if range == "*" {
                (self.min, self.star_max)
            } else if let Some((a, b)) = range.split_once('-') {
                let lo = self.value(a)?;
                let mut hi = self.value(b)?;
                // `FRI-SUN`: a weekday range may end on Sunday written as 0.
                if self.max == 7 && hi == 0 && lo > 0 {
                    hi = 7;
                }
                if lo > hi {
                    return Err(format!(
                        "range {range} goes backwards (wrap-around is not supported; \
                         use a list such as {a}-{max},{min}-{b})",
                        max = self.star_max,
                        min = self.min
                    ));
                }
                (lo, hi)
            } else {
                let v = self.value(range)?;
                // `a/n` runs from `a` to the end of the field, as in Vixie cron.
                (
                    v,
                    if step.is_some() {
                        self.star_max.max(v)
                    } else {
                        v
                    },
                )
            };
            for v in (lo..=hi).step_by(step.unwrap_or(1) as usize) {
                bits |= 1 << v;
            }
        }
        if self.max == 7 && bits & (1 << 7) != 0 {
            bits = (bits & !(1 << 7)) | 1;
        }
        Ok(bits)
    }
}

/// `L`, `LW`, `15W`, `5L`, `5#3` where they do not belong, worth a specific message.
fn is_day_extension(s: &str) -> bool {
    let digits_then = |suffix: char| {
        s.strip_suffix(suffix)
            .is_some_and(|head| !head.is_empty() && head.bytes().all(|b| b.is_ascii_digit()))
    };
    let upper = s.to_ascii_uppercase();
    matches!(upper.as_str(), "L" | "LW")
        || s.contains('#')
        || digits_then('L')
        || digits_then('W')
        || digits_then('l')
        || digits_then('w')
}

/// Takes the `L`, `LW` and `nW` items out of a day-of-month field: the specials and the rest
/// (for [`Field::parse`]; empty when nothing is left).
fn split_dom(text: &str) -> Result<(DaySpecials, String), String> {
    let mut special = DaySpecials::default();
    let mut rest = Vec::new();
    for item in text.split(',') {
        let upper = item.to_ascii_uppercase();
        if upper == "L" {
            special.last_day = true;
        } else if upper == "LW" {
            special.last_weekday = true;
        } else if let Some(day) = upper.strip_suffix('W') {
            let n = DAY_OF_MONTH
                .value(day)
                .map_err(|why| format!("{item:?}: W follows a single day (15W, or LW), {why}"))?;
            special.nearest_weekday |= 1 << n;
        } else if upper.contains('L') || upper.contains('W') || upper.contains('#') {
            return Err(format!(
                "{item:?}: expected L, LW or a day followed by W (15W); they take no range \
                 or step"
            ));
        } else {
            rest.push(item);
        }
    }
    Ok((special, rest.join(",")))
}

/// Takes the `wL` and `w#n` items out of a day-of-week field (see [`split_dom`]).
fn split_dow(text: &str) -> Result<(DaySpecials, String), String> {
    let mut special = DaySpecials::default();
    let mut rest = Vec::new();
    let weekday = |item: &str, w: &str| {
        let w = DAY_OF_WEEK
            .value(w)
            .map_err(|why| format!("{item:?}: {why}"))?;
        Ok::<u32, String>(w % 7)
    };
    for item in text.split(',') {
        if let Some((w, n)) = item.split_once('#') {
            let w = weekday(item, w)?;
            let n = match n.parse::<usize>() {
                Ok(n) if (1..=5).contains(&n) => n,
                _ => return Err(format!("{item:?}: # takes 1-5 (MON#2: the second Monday)")),
            };
            special.nth[n - 1] |= 1 << w;
        } else if let Some(w) = item.strip_suffix(['L', 'l']) {
            if w.is_empty() {
                return Err(
                    "\"L\" alone is not a day of week; write 5L or FRIL for the last Friday".into(),
                );
            }
            special.last_of |= 1 << weekday(item, w)?;
        } else {
            rest.push(item);
        }
    }
    Ok((special, rest.join(",")))
}

/// Bit `d` for each day of `year-month` an `L`, `W` or `#` item picks: those of the
/// day-of-month field (`dom = true`) or of the day-of-week field.
fn special_days(s: &DaySpecials, dom: bool, year: i32, month: u32) -> u32 {
    let Some(first) = NaiveDate::from_ymd_opt(year, month, 1) else {
        return 0;
    };
    let first = first.weekday().num_days_from_sunday();
    let len = days_in_month(year, month);
    let weekday_of = |d: u32| (first + d - 1) % 7;
    let mut bits = 0u32;
    if dom {
        if s.last_day {
            bits |= 1 << len;
        }
        if s.last_weekday {
            bits |= 1 << last_weekday(len, weekday_of);
        }
        for n in (1..=len).filter(|n| s.nearest_weekday & (1 << n) != 0) {
            bits |= 1 << nearest(n, len, weekday_of);
        }
        return bits;
    }
    for w in 0..7u32 {
        // The first day of the month that is a `w`.
        let first_w = 1 + (w + 7 - first) % 7;
        if s.last_of & (1 << w) != 0 {
            bits |= 1 << (first_w + 7 * ((len - first_w) / 7));
        }
        for (n, set) in (0u32..).zip(s.nth) {
            let day = first_w + 7 * n;
            if set & (1 << w) != 0 && day <= len {
                bits |= 1 << day;
            }
        }
    }
    bits
}

/// The last Monday–Friday of a month of `len` days.
fn last_weekday(len: u32, weekday_of: impl Fn(u32) -> u32) -> u32 {
    match weekday_of(len) {
        6 => len - 1,
        0 => len - 2,
        _ => len,
    }
}

/// The Monday–Friday nearest day `n` of a month of `len` days, never leaving the month.
fn nearest(n: u32, len: u32, weekday_of: impl Fn(u32) -> u32) -> u32 {
    match weekday_of(n) {
        6 if n == 1 => 3,
        6 => n - 1,
        0 if n == len => n - 2,
        0 => n + 1,
        _ => n,
    }
}

fn parse_step(s: &str) -> Result<u32, String> {
    if s.is_empty() {
        return Err("missing step after /".into());
    }
    if !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("step {s:?} is not a number"));
    }
    match s.parse::<u32>() {
        Ok(0) => Err("step 0 is not allowed".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("step {s} is too large")),
    }
}

/// Days in a month, February counted in the given year.
fn days_in_month(year: i32, month: u32) -> u32 {
    match month {
        4 | 6 | 9 | 11 => 30,
        2 if is_leap(year) => 29,
        2 => 28,
        _ => 31,
    }
}

fn is_leap(year: i32) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

/// Bits `1..=n` set.
fn days_up_to(n: u32) -> u32 {
    ((1u64 << (n + 1)) - 2) as u32
}

/// Smallest set bit `>= from`, if any.
/// `t` rounded up to a whole second.
fn ceil_second(t: NaiveDateTime) -> Option<NaiveDateTime> {
    if t.nanosecond() == 0 {
        return Some(t);
    }
    t.with_nanosecond(0)?
        .checked_add_signed(TimeDelta::seconds(1))
}

/// A day field's `L`/`W`/`#` items and the rest (empty when nothing is left), errors naming
/// the field.
fn split_day_field(
    expr: &str,
    spec: &Field,
    text: &str,
    split: fn(&str) -> Result<(DaySpecials, String), String>,
) -> Result<(DaySpecials, String), ScheduleError> {
    split(text).map_err(|why| ScheduleError::Field {
        expr: expr.to_owned(),
        field: spec.name,
        why,
    })
}

/// A cron expression's six fields as written; a 5-field one has second `0`.
struct CronFields<'a> {
    second: &'a str,
    minute: &'a str,
    hour: &'a str,
    day_of_month: &'a str,
    month: &'a str,
    day_of_week: &'a str,
    /// Written with 6 fields (a leading second).
    has_seconds: bool,
}

impl<'a> CronFields<'a> {
    /// `expanded` (`text` with its macro written out) split on whitespace into 5 or 6 fields.
    fn split(text: &str, expanded: &'a str) -> Result<Self, ScheduleError> {
        let fields: Vec<&str> = expanded.split_whitespace().collect();
        let (second, rest) = match fields.len() {
            5 => ("0", &fields[..]),
            6 => (fields[0], &fields[1..]),
            got => {
                return Err(ScheduleError::FieldCount {
                    expr: text.to_owned(),
                    got,
                })
            }
        };
        Ok(CronFields {
            second,
            minute: rest[0],
            hour: rest[1],
            day_of_month: rest[2],
            month: rest[3],
            day_of_week: rest[4],
            has_seconds: fields.len() == 6,
        })
    }
}

/// One field's bit set, errors naming the field; an empty `value` (a day field made only of
/// `L`/`W`/`#` items) matches no plain value.
fn parse_field(expr: &str, spec: &Field, value: &str) -> Result<u64, ScheduleError> {
    if value.is_empty() {
        // A day field made only of `L`/`W`/`#` items: no plain value matches.
        return Ok(0);
    }
    spec.parse(value).map_err(|why| ScheduleError::Field {
        expr: expr.to_owned(),
        field: spec.name,
        why,
    })
}

/// `text` with a macro (`@daily`) written out; any other `@…` is refused.
fn expand_macro(text: &str) -> Result<&str, ScheduleError> {
    Ok(match text {
        "@yearly" | "@annually" => "0 0 1 1 *",
        "@monthly" => "0 0 1 * *",
        "@weekly" => "0 0 * * 0",
        "@daily" | "@midnight" => "0 0 * * *",
        "@hourly" => "0 * * * *",
        t if t.starts_with('@') => return Err(ScheduleError::UnknownMacro { expr: t.to_owned() }),
        t => t,
    })
}

/// For each weekday the 1st of a month can fall on (0 = Sunday), the days (bit `d`) of that
/// month whose weekday is in `weekdays`.
fn weekday_days(weekdays: u8) -> [u32; 7] {
    let mut by_first = [0u32; 7];
    for (first, mask) in by_first.iter_mut().enumerate() {
        for day in 1..=31u32 {
            let weekday = (first as u32 + day - 1) % 7;
            if weekdays & (1 << weekday) != 0 {
                *mask |= 1 << day;
            }
        }
    }
    by_first
}

fn next_bit(mask: u64, from: u32) -> Option<u32> {
    if from >= 64 {
        return None;
    }
    let rest = mask & (!0u64 << from);
    (rest != 0).then(|| rest.trailing_zeros())
}

impl CronExpr {
    /// Parses `expr`; errors name the field (`minute`, `hour`, …) and say why.
    ///
    /// # Errors
    ///
    /// A wrong number of fields, a bad value, range or step in a field, an unknown macro, or an
    /// expression that can never match.
    pub fn parse(expr: &str) -> Result<Self, ScheduleError> {
        let text = expr.trim();
        let fields = CronFields::split(text, expand_macro(text)?)?;
        let cron = Self::from_fields(text, &fields)?;
        cron.check_possible(&fields)?;
        Ok(cron)
    }

    /// The expression whose fields are `fields`, each parsed into its bit set; errors name the
    /// field.
    fn from_fields(text: &str, fields: &CronFields) -> Result<Self, ScheduleError> {
        let field = |spec: &Field, value: &str| parse_field(text, spec, value);
        let seconds = field(&SECOND, fields.second)?;
        let minutes = field(&MINUTE, fields.minute)?;
        let hours = field(&HOUR, fields.hour)? as u32;
        let (dom_special, dom_rest) =
            split_day_field(text, &DAY_OF_MONTH, fields.day_of_month, split_dom)?;
        let days = field(&DAY_OF_MONTH, &dom_rest)? as u32;
        let months = field(&MONTH, fields.month)? as u16;
        let (dow_special, dow_rest) =
            split_day_field(text, &DAY_OF_WEEK, fields.day_of_week, split_dow)?;
        let weekdays = field(&DAY_OF_WEEK, &dow_rest)? as u8;
        Ok(CronExpr {
            text: text.to_string(),
            seconds,
            minutes,
            hours,
            days,
            months,
            weekdays,
            dom_any: fields.day_of_month == "*",
            dow_any: fields.day_of_week == "*",
            has_seconds: fields.has_seconds,
            dow_days_by_first: weekday_days(weekdays),
            special: DaySpecials {
                last_of: dow_special.last_of,
                nth: dow_special.nth,
                ..dom_special
            },
        })
    }

    /// Refuses an expression that can never match: a day of month none of its months has.
    fn check_possible(&self, fields: &CronFields) -> Result<(), ScheduleError> {
        // Only a restricted day-of-month ANDed with the months can be impossible: with a
        // restricted weekday every month has matching days. 28 years see every month length
        // and every weekday of the 1st.
        if !self.dow_any {
            return Ok(());
        }
        let possible = (1..=12u32)
            .filter(|m| self.months & (1 << m) != 0)
            .any(|m| (2000..2028).any(|y| self.day_mask(y, m) != 0));
        if !possible {
            return Err(ScheduleError::NeverMatches {
                expr: self.text.clone(),
                days: fields.day_of_month.to_owned(),
                months: fields.month.to_owned(),
            });
        }
        Ok(())
    }

    /// The expression as written (trimmed).
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// True when written with 6 fields (leading seconds).
    pub fn has_seconds(&self) -> bool {
        self.has_seconds
    }

    /// True when the wall time `t` matches (its sub-second part must be zero).
    pub fn matches(&self, t: NaiveDateTime) -> bool {
        t.nanosecond() == 0
            && self.seconds & (1 << t.second()) != 0
            && self.minutes & (1 << t.minute()) != 0
            && self.hours & (1 << t.hour()) != 0
            && self.months & (1 << t.month()) != 0
            && self.day_mask(t.year(), t.month()) & (1 << t.day()) != 0
    }

    /// The matching days (bit `d`) of a month, dom/dow semantics applied.
    fn day_mask(&self, year: i32, month: u32) -> u32 {
        let first = match NaiveDate::from_ymd_opt(year, month, 1) {
            Some(d) => d.weekday().num_days_from_sunday() as usize,
            None => return 0,
        };
        let mut by_weekday = self.dow_days_by_first[first];
        let mut by_day = self.days;
        if self.special != DaySpecials::default() {
            by_day |= special_days(&self.special, true, year, month);
            by_weekday |= special_days(&self.special, false, year, month);
        }
        let days = if !self.dom_any && !self.dow_any {
            by_day | by_weekday
        } else {
            // An unrestricted field has every bit set, so AND leaves the other one.
            by_day & by_weekday
        };
        days & days_up_to(days_in_month(year, month))
    }

    /// The first matching wall time `>= start` (a sub-second `start` rounds up), looking no
    /// further than the end of `limit_year`. Steps field by field (month → day → hour → minute
    /// → second), so sparse expressions cost a handful of iterations, not a walk over minutes.
    fn next_match(&self, start: NaiveDateTime, limit_year: i32) -> Option<NaiveDateTime> {
        let start = ceil_second(start)?;
        let (mut y, mut mo, mut d) = (start.year(), start.month(), start.day());
        let (mut h, mut mi, mut s) = (start.hour(), start.minute(), start.second());
        loop {
            if y > limit_year {
                return None;
            }
            match next_bit(u64::from(self.months), mo) {
                Some(m) if m <= 12 => {
                    if m != mo {
                        (mo, d, h, mi, s) = (m, 1, 0, 0, 0);
                    }
                }
                _ => {
                    (y, mo, d, h, mi, s) = (y + 1, 1, 1, 0, 0, 0);
                    continue;
                }
            }
            match next_bit(u64::from(self.day_mask(y, mo)), d) {
                Some(day) => {
                    if day != d {
                        (d, h, mi, s) = (day, 0, 0, 0);
                    }
                }
                None => {
                    (mo, d, h, mi, s) = (mo + 1, 1, 0, 0, 0);
                    if mo > 12 {
                        (y, mo) = (y + 1, 1);
                    }
                    continue;
                }
            }
            match self.next_time((h, mi, s)) {
                Some(time) => (h, mi, s) = time,
                None => {
                    // Day 32 has no bit in `day_mask`: the next round moves to the next month.
                    (d, h, mi, s) = (d + 1, 0, 0, 0);
                    continue;
                }
            }
            return NaiveDate::from_ymd_opt(y, mo, d)?.and_hms_opt(h, mi, s);
        }
    }

    /// The first matching time of day `>= (h, mi, s)` on a matching day; `None` when the day
    /// has none left (the search goes on with the next day).
    fn next_time(&self, (mut h, mut mi, mut s): (u32, u32, u32)) -> Option<(u32, u32, u32)> {
        loop {
            let hour = next_bit(u64::from(self.hours), h)?;
            if hour != h {
                (h, mi, s) = (hour, 0, 0);
            }
            match next_bit(self.minutes, mi) {
                Some(minute) if minute != mi => (mi, s) = (minute, 0),
                Some(_) => {}
                None => {
                    (h, mi, s) = (h + 1, 0, 0);
                    continue;
                }
            }
            match next_bit(self.seconds, s) {
                Some(second) => return Some((h, mi, second)),
                None => (mi, s) = (mi + 1, 0),
            }
        }
    }
}

impl fmt::Display for CronExpr {
    /// The expression as written.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl FromStr for CronExpr {
    type Err = ScheduleError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CronExpr::parse(s)
    }
}

// ---------------------------------------------------------------------------------------------
// Time zones
// ---------------------------------------------------------------------------------------------

/// Resolves an IANA zone name; an unknown name gets a message suggesting close names.
///
/// Suggestions (at most 3): names equal ignoring case, then the closest names by
/// Damerau-Levenshtein similarity, comparing a name without `/` (`Berlin`) with the last part of
/// each zone name (`Europe/Berlin`).
///
/// # Errors
///
/// `name` is not an IANA zone name known to chrono-tz.
pub fn parse_timezone(name: &str) -> Result<Tz, ScheduleError> {
    if let Ok(tz) = name.parse::<Tz>() {
        return Ok(tz);
    }
    Err(ScheduleError::UnknownZone {
        name: name.to_owned(),
        suggestions: suggest_timezones(name),
    })
}

fn suggest_timezones(name: &str) -> Vec<&'static str> {
    let norm = |s: &str| s.trim().to_ascii_lowercase().replace(' ', "_");
    let wanted = norm(name);
    if wanted.is_empty() {
        return Vec::new();
    }
    let mut scored: Vec<(f64, &'static str)> = chrono_tz::TZ_VARIANTS
        .iter()
        .map(|tz| {
            let candidate = tz.name();
            let lower = candidate.to_ascii_lowercase();
            let score = if lower == wanted {
                2.0
            } else if !wanted.contains('/') {
                let city = lower.rsplit('/').next().unwrap_or(&lower);
                strsim::normalized_damerau_levenshtein(&wanted, city)
            } else {
                strsim::normalized_damerau_levenshtein(&wanted, &lower)
            };
            (score, candidate)
        })
        .filter(|(score, _)| *score >= 0.75)
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(b.1)));
    scored.into_iter().take(3).map(|(_, name)| name).collect()
}

/// Seconds east of UTC in force at instant `t` (Unix seconds).
fn offset_at(tz: Tz, t: i64) -> Option<i64> {
    let utc = DateTime::from_timestamp(t, 0)?;
    Some(i64::from(
        tz.offset_from_utc_datetime(&utc.naive_utc())
            .fix()
            .local_minus_utc(),
    ))
}

/// For a wall time in a gap, the transition instant that opens the gap and the first valid wall
/// time after it (the transition seen on the new offset).
///
/// Searches the UTC instant where the wall clock `f(t) = t + offset(t)` jumps over `wall`. Offsets
/// stay within ±36 h, so `f(wall − 36 h) <= wall < f(wall + 36 h)`; the clock crosses a
/// non-existent wall time only by jumping over it, so the crossing is the gap's transition, of
/// whatever size (30 min at Lord Howe, 24 h at Apia in 2011). tzdb transitions fall on whole
/// seconds, so a binary search over seconds is exact.
fn gap_transition(tz: Tz, wall: NaiveDateTime) -> Option<(DateTime<Utc>, NaiveDateTime)> {
    let target = wall.and_utc().timestamp();
    let clock = |t: i64| offset_at(tz, t).map(|off| t + off);
    let (mut lo, mut hi) = (target - 36 * 3600, target + 36 * 3600);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if clock(mid)? > target {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let at = DateTime::from_timestamp(hi, 0)?;
    let after_gap = DateTime::from_timestamp(clock(hi)?, 0)?.naive_utc();
    Some((at, after_gap))
}

/// How far before `after`'s wall time a wall time can lie whose *second* instant (after a fold)
/// is still later than `after`: the size of a fold starting shortly after `after`. Found by
/// sampling the offset ahead; over-estimating only costs a few extra candidates.
fn fold_lookback(tz: Tz, after: i64) -> Option<i64> {
    let now = offset_at(tz, after)?;
    let mut lowest = now;
    for ahead in [1800, 3600, 2 * 3600, 3 * 3600, 6 * 3600, 25 * 3600] {
        lowest = lowest.min(offset_at(tz, after + ahead)?);
    }
    Some(now - lowest)
}

// ---------------------------------------------------------------------------------------------
// Schedules
// ---------------------------------------------------------------------------------------------

/// A job's rule.
#[derive(Debug, Clone, PartialEq)]
pub enum Schedule {
    /// Cron evaluated in a time zone with explicit DST policies.
    Cron {
        /// The expression (boxed: it is most of a cron schedule's size, and an `every`
        /// schedule, which many-job configs are made of, need not carry its room).
        cron: Box<CronExpr>,
        /// The zone whose wall clock the expression reads.
        tz: Tz,
        /// Policy for wall times in a spring-forward gap.
        gap: DstGap,
        /// Policy for wall times in a fall-back fold.
        fold: DstFold,
    },
    /// Fixed rate: `anchor + k·every`, elapsed time, no DST effect.
    Every {
        /// The period; must be positive (a zero or negative one never fires).
        every: chrono::Duration,
        /// A point of the timeline (`k = 0`); `k` may be negative.
        anchor: DateTime<Utc>,
    },
}

/// Why an occurrence is special (shown by `drumline-beat next`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Note {
    /// The wall time `from` fell in a gap and was shifted to the transition.
    GapShifted {
        /// The (first) matching wall time inside the gap.
        from: NaiveTime,
    },
    /// The wall time `local` fell in a gap and is not run (`dst_gap = skip`).
    GapSkipped {
        /// The (first) matching wall time inside the gap.
        local: NaiveTime,
    },
    /// First of the two instants of a folded wall time.
    FoldFirst,
    /// Second of the two instants of a folded wall time.
    FoldSecond,
}

impl fmt::Display for Note {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Note::GapShifted { from } => write!(f, "gap: shifted from {}", from.format("%H:%M")),
            Note::GapSkipped { local } => write!(f, "gap: skipped {}", local.format("%H:%M")),
            Note::FoldFirst => f.write_str("fold: first of two"),
            Note::FoldSecond => f.write_str("fold: second of two"),
        }
    }
}

/// One computed occurrence. `skipped` ones are reported (for `next`) but never run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occurrence {
    /// The UTC instant (for a skipped one: the gap's transition instant, for ordering).
    pub at: DateTime<Utc>,
    /// Annotation, if any.
    pub note: Option<Note>,
    /// True when the policy drops this occurrence.
    pub skipped: bool,
}

/// Which instant of a folded wall time one monotone pass picks.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    First,
    Second,
}

impl Schedule {
    /// The first instant strictly after `after` at which the job runs (skipped occurrences are
    /// stepped over). `None` when nothing runs within about forty years.
    pub fn next_after(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let give_up = after.checked_add_signed(TimeDelta::days(366 * i64::from(HORIZON_YEARS)))?;
        let mut from = after;
        loop {
            let occ = self.next_occurrence_after(from)?;
            if !occ.skipped {
                return Some(occ.at);
            }
            if occ.at > give_up {
                return None;
            }
            // Safe: at most one occurrence per instant, and a real one beats a skipped marker.
            from = occ.at;
        }
    }

    /// The first occurrence strictly after `after`, including skipped ones. Occurrences come in
    /// strictly increasing `at` order, one per UTC instant (see the module docs).
    pub fn next_occurrence_after(&self, after: DateTime<Utc>) -> Option<Occurrence> {
        match self {
            Schedule::Every { every, anchor } => {
                let at = next_every(*every, *anchor, after)?;
                Some(Occurrence {
                    at,
                    note: None,
                    skipped: false,
                })
            }
            Schedule::Cron {
                cron,
                tz,
                gap,
                fold,
            } => match fold {
                DstFold::First => next_cron(cron, *tz, *gap, Pass::First, after),
                DstFold::Second => next_cron(cron, *tz, *gap, Pass::Second, after),
                // `Both` is the union of the `First` and `Second` sequences; each is monotone in
                // wall time, the union is not, so take the earlier of the two answers.
                DstFold::Both => {
                    let first = next_cron(cron, *tz, *gap, Pass::First, after);
                    let second = next_cron(cron, *tz, *gap, Pass::Second, after);
                    match (first, second) {
                        (Some(a), Some(b)) => Some(if b.at < a.at { b } else { a }),
                        (a, b) => a.or(b),
                    }
                }
            },
        }
    }

    /// The occurrences after `after`, in order, skipped ones included.
    pub fn occurrences_after(&self, after: DateTime<Utc>) -> impl Iterator<Item = Occurrence> + '_ {
        let mut from = after;
        std::iter::from_fn(move || {
            let occ = self.next_occurrence_after(from)?;
            from = occ.at;
            Some(occ)
        })
    }

    /// A one-line description: `cron "0 30 2 * * *" in America/New_York` or `every 30s`.
    pub fn describe(&self) -> String {
        self.to_string()
    }

    /// The period at `now`: `every`, or for cron the gap between the two latest instants at or
    /// before `now`; `None` when there are not two within about nine years.
    pub fn period(&self, now: DateTime<Utc>) -> Option<TimeDelta> {
        if let Schedule::Every { every, .. } = self {
            return Some(*every);
        }
        // No "previous instant" API: walk forward from ever earlier points until two instants
        // at or before `now` are found (a per-second cron needs a short window, a yearly one a
        // long one).
        for back in [120i64, 7_200, 172_800, 5_529_600, 63_072_000, 283_824_000] {
            let mut cursor = now - TimeDelta::seconds(back);
            let (mut older, mut newer) = (None, None);
            while let Some(t) = self.next_after(cursor) {
                if t > now {
                    break;
                }
                older = newer;
                newer = Some(t);
                cursor = t;
            }
            if let (Some(a), Some(b)) = (older, newer) {
                return Some(b - a);
            }
        }
        None
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Schedule::Cron {
                cron,
                tz,
                gap,
                fold,
            } => {
                write!(f, "cron {:?} in {}", cron.as_str(), tz.name())?;
                // Only what differs from the defaults.
                if *gap != DstGap::default() {
                    write!(f, ", dst_gap = {}", gap.as_str())?;
                }
                if *fold != DstFold::default() {
                    write!(f, ", dst_fold = {}", fold.as_str())?;
                }
                Ok(())
            }
            Schedule::Every { every, anchor } => {
                write!(f, "every {}", format_duration(*every))?;
                if anchor.timestamp() != 0 || anchor.timestamp_subsec_nanos() != 0 {
                    write!(
                        f,
                        " from {}",
                        anchor.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
                    )?;
                }
                Ok(())
            }
        }
    }
}

/// `1h 30m`, `500ms`, `1d 2h`: humantime-compatible, largest units first.
fn format_duration(d: TimeDelta) -> String {
    if d <= TimeDelta::zero() {
        return format!("{}ms", d.num_milliseconds());
    }
    let total = nanos_of_delta(d);
    let units: [(i128, &str); 7] = [
        (86_400_000_000_000, "d"),
        (3_600_000_000_000, "h"),
        (60_000_000_000, "m"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
        (1_000, "us"),
        (1, "ns"),
    ];
    let mut rest = total;
    let mut parts = Vec::new();
    for (size, unit) in units {
        if rest >= size {
            parts.push(format!("{}{unit}", rest / size));
            rest %= size;
        }
    }
    parts.join(" ")
}

fn nanos_of_delta(d: TimeDelta) -> i128 {
    i128::from(d.num_seconds()) * 1_000_000_000 + i128::from(d.subsec_nanos())
}

fn nanos_of(t: DateTime<Utc>) -> i128 {
    i128::from(t.timestamp()) * 1_000_000_000 + i128::from(t.timestamp_subsec_nanos())
}

/// `anchor + k·every` for the smallest `k` (possibly negative) that lands strictly after
/// `after`. Exact to the nanosecond (i128 arithmetic), so millisecond periods never drift.
fn next_every(
    every: TimeDelta,
    anchor: DateTime<Utc>,
    after: DateTime<Utc>,
) -> Option<DateTime<Utc>> {
    let step = nanos_of_delta(every);
    if step <= 0 {
        return None;
    }
    let since = nanos_of(after) - nanos_of(anchor);
    let k = since.div_euclid(step) + 1;
    from_nanos(nanos_of(anchor) + k * step)
}

fn from_nanos(n: i128) -> Option<DateTime<Utc>> {
    let secs = i64::try_from(n.div_euclid(1_000_000_000)).ok()?;
    DateTime::from_timestamp(secs, n.rem_euclid(1_000_000_000) as u32)
}

/// The instants `anchor + k·every` strictly between `after` and `before`: how many, the first
/// and the last; `None` when there are none. Counts a long outage by arithmetic, not a walk.
pub fn every_between(
    every: TimeDelta,
    anchor: DateTime<Utc>,
    after: DateTime<Utc>,
    before: DateTime<Utc>,
) -> Option<(u64, DateTime<Utc>, DateTime<Utc>)> {
    let step = nanos_of_delta(every);
    if step <= 0 {
        return None;
    }
    let a = nanos_of(anchor);
    let k_lo = (nanos_of(after) - a).div_euclid(step) + 1;
    let k_hi = (nanos_of(before) - a - 1).div_euclid(step);
    if k_hi < k_lo {
        return None;
    }
    let count = u64::try_from(k_hi - k_lo + 1).ok()?;
    Some((
        count,
        from_nanos(a + k_lo * step)?,
        from_nanos(a + k_hi * step)?,
    ))
}

/// The first occurrence after `after` of a cron read under one fold pass.
///
/// Under a single pass the map from matching wall time to instant is non-decreasing (gap wall
/// times all map to their transition, fold wall times to their first — or second — instant), so
/// the answer is the first matching wall time, from a suitable start, whose instant is later
/// than `after`. The start is `after`'s own wall time, except under `Second`, where wall times a
/// little earlier can still have their second instant ahead (a fold is coming).
fn next_cron(
    cron: &CronExpr,
    tz: Tz,
    gap: DstGap,
    pass: Pass,
    after: DateTime<Utc>,
) -> Option<Occurrence> {
    let mut start = after.with_timezone(&tz).naive_local();
    if pass == Pass::Second {
        let back = fold_lookback(tz, after.timestamp())?;
        start = start.checked_sub_signed(TimeDelta::seconds(back))?;
    }
    let limit_year = start.year().checked_add(HORIZON_YEARS)?;
    let mut wall = cron.next_match(start, limit_year)?;
    loop {
        let (at, note) = match tz.from_local_datetime(&wall) {
            LocalResult::Single(at) => (at.with_timezone(&Utc), None),
            LocalResult::Ambiguous(first, second) => match pass {
                Pass::First => (first.with_timezone(&Utc), Some(Note::FoldFirst)),
                Pass::Second => (second.with_timezone(&Utc), Some(Note::FoldSecond)),
            },
            LocalResult::None => {
                let (at, after_gap) = gap_transition(tz, wall)?;
                if at > after {
                    return Some(gap_occurrence(cron, gap, wall, at, after_gap));
                }
                // The whole gap collapses onto an instant already past: resume after it.
                wall = cron.next_match(after_gap, limit_year)?;
                continue;
            }
        };
        if at > after {
            return Some(Occurrence {
                at,
                note,
                skipped: false,
            });
        }
        wall = cron.next_match(wall.checked_add_signed(TimeDelta::seconds(1))?, limit_year)?;
    }
}

/// The single occurrence at a gap's transition `at`: every matching wall time in the gap, the
/// first being `wall`, plus the wall time right after the gap if it matches too.
fn gap_occurrence(
    cron: &CronExpr,
    gap: DstGap,
    wall: NaiveDateTime,
    at: DateTime<Utc>,
    after_gap: NaiveDateTime,
) -> Occurrence {
    match gap {
        DstGap::Shift => Occurrence {
            at,
            note: Some(Note::GapShifted { from: wall.time() }),
            skipped: false,
        },
        // A real run at the transition wins over the skipped marker (one occurrence per instant).
        DstGap::Skip if cron.matches(after_gap) => Occurrence {
            at,
            note: None,
            skipped: false,
        },
        DstGap::Skip => Occurrence {
            at,
            note: Some(Note::GapSkipped { local: wall.time() }),
            skipped: true,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use DstFold::{Both, First, Second};
    use DstGap::{Shift, Skip};

    const NEW_YORK: &str = "America/New_York";
    const LONDON: &str = "Europe/London";
    const LORD_HOWE: &str = "Australia/Lord_Howe";
    const APIA: &str = "Pacific/Apia";
    const SAO_PAULO: &str = "America/Sao_Paulo";

    fn utc(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    fn tz(name: &str) -> Tz {
        parse_timezone(name).unwrap()
    }

    fn cron(expr: &str, zone: &str, gap: DstGap, fold: DstFold) -> Schedule {
        Schedule::Cron {
            cron: CronExpr::parse(expr).unwrap().into(),
            tz: tz(zone),
            gap,
            fold,
        }
    }

    /// `expr` in UTC, where gaps and folds never happen.
    fn utc_cron(expr: &str) -> Schedule {
        cron(expr, "UTC", Shift, First)
    }

    fn occ(at: &str, note: Option<Note>, skipped: bool) -> Occurrence {
        Occurrence {
            at: utc(at),
            note,
            skipped,
        }
    }

    /// An ordinary occurrence at `at`.
    fn plain(at: &str) -> Occurrence {
        occ(at, None, false)
    }

    /// The first pass through a repeated (fold) wall time.
    fn fold_first(at: &str) -> Occurrence {
        occ(at, Some(Note::FoldFirst), false)
    }

    /// The second pass through a repeated (fold) wall time.
    fn fold_second(at: &str) -> Occurrence {
        occ(at, Some(Note::FoldSecond), false)
    }

    /// A run moved out of a gap to `at`, from the wall time `from`.
    fn shifted(at: &str, from: NaiveTime) -> Occurrence {
        occ(at, Some(Note::GapShifted { from }), false)
    }

    /// The wall time `local` fell into a gap (at `at`) and does not run.
    fn skipped(at: &str, local: NaiveTime) -> Occurrence {
        occ(at, Some(Note::GapSkipped { local }), true)
    }

    fn hm(h: u32, m: u32) -> NaiveTime {
        NaiveTime::from_hms_opt(h, m, 0).unwrap()
    }

    fn take(s: &Schedule, after: &str, n: usize) -> Vec<Occurrence> {
        s.occurrences_after(utc(after)).take(n).collect()
    }

    /// Asserts that `s`'s occurrences after `after` begin with `expected`.
    #[track_caller]
    fn assert_occurrences(s: &Schedule, after: &str, expected: &[Occurrence]) {
        assert_eq!(take(s, after, expected.len()), expected);
    }

    /// Asserts that `s`'s runs after `after` (`next_after`, again and again) begin with
    /// `expected`.
    #[track_caller]
    fn assert_runs(s: &Schedule, after: &str, expected: &[&str]) {
        let expected: Vec<DateTime<Utc>> = expected.iter().map(|at| utc(at)).collect();
        assert_eq!(runs(s, after, expected.len()), expected);
    }

    /// Asserts that `s`'s next run after `after` is at `expected`.
    #[track_caller]
    fn assert_next(s: &Schedule, after: &str, expected: &str) {
        assert_eq!(s.next_after(utc(after)), Some(utc(expected)));
    }

    fn runs(s: &Schedule, after: &str, n: usize) -> Vec<DateTime<Utc>> {
        let mut out = Vec::new();
        let mut from = utc(after);
        for _ in 0..n {
            from = s.next_after(from).unwrap();
            out.push(from);
        }
        out
    }

    fn err(expr: &str) -> String {
        CronExpr::parse(expr).unwrap_err().to_string()
    }

    // --- DST: America/New_York ---------------------------------------------------------------

    #[test]
    fn new_york_gap_shift_runs_at_the_transition() {
        let s = cron("30 2 * * *", NEW_YORK, Shift, First);
        let got = take(&s, "2026-03-07T12:00:00Z", 2);
        let shifted_then_next = [
            shifted("2026-03-08T07:00:00Z", hm(2, 30)),
            plain("2026-03-09T06:30:00Z"),
        ];
        assert_eq!(got, shifted_then_next);
        assert_eq!(got[0].note.unwrap().to_string(), "gap: shifted from 02:30");
        let local = got[0].at.with_timezone(&tz("America/New_York"));
        assert_eq!(local.to_rfc3339(), "2026-03-08T03:00:00-04:00");
    }

    #[test]
    fn new_york_gap_skip_reports_but_does_not_run() {
        let s = cron("30 2 * * *", NEW_YORK, Skip, First);
        assert_occurrences(
            &s,
            "2026-03-07T12:00:00Z",
            &[skipped("2026-03-08T07:00:00Z", hm(2, 30))],
        );
        assert_next(&s, "2026-03-07T12:00:00Z", "2026-03-09T06:30:00Z");
    }

    #[test]
    fn new_york_fold_first_second_both() {
        let cases = [
            (
                First,
                vec![
                    fold_first("2026-11-01T05:30:00Z"),
                    plain("2026-11-02T06:30:00Z"),
                ],
            ),
            (
                Second,
                vec![
                    fold_second("2026-11-01T06:30:00Z"),
                    plain("2026-11-02T06:30:00Z"),
                ],
            ),
            (
                Both,
                vec![
                    fold_first("2026-11-01T05:30:00Z"),
                    fold_second("2026-11-01T06:30:00Z"),
                    plain("2026-11-02T06:30:00Z"),
                ],
            ),
        ];
        for (fold, expected) in cases {
            let s = cron("30 1 * * *", NEW_YORK, Shift, fold);
            assert_occurrences(&s, "2026-10-31T12:00:00Z", &expected);
        }
    }

    #[test]
    fn fold_both_interleaves_by_instant_not_wall_time() {
        // 01:00a 01:30a 01:00b 01:30b: wall order differs from instant order.
        let s = cron("*/30 * * * *", NEW_YORK, Shift, Both);
        assert_occurrences(
            &s,
            "2026-11-01T04:00:00Z",
            &[
                plain("2026-11-01T04:30:00Z"),
                fold_first("2026-11-01T05:00:00Z"),
                fold_first("2026-11-01T05:30:00Z"),
                fold_second("2026-11-01T06:00:00Z"),
                fold_second("2026-11-01T06:30:00Z"),
                plain("2026-11-01T07:00:00Z"),
            ],
        );
        // Starting inside the fold (first pass) still finds the second pass.
        let second = cron("*/30 * * * *", NEW_YORK, Shift, Second);
        assert_next(&second, "2026-11-01T05:10:00Z", "2026-11-01T06:00:00Z");
    }

    #[test]
    fn every_30_minutes_collapses_in_a_gap() {
        let shift = cron("*/30 * * * *", NEW_YORK, Shift, First);
        // 02:00, 02:30 (gap) and 03:00 are one 03:00 EDT = 07:00Z instance.
        assert_occurrences(
            &shift,
            "2026-03-08T06:00:00Z",
            &[
                plain("2026-03-08T06:30:00Z"),
                shifted("2026-03-08T07:00:00Z", hm(2, 0)),
                plain("2026-03-08T07:30:00Z"),
            ],
        );
        // Under skip the 03:00 run shares 07:00Z with the skipped 02:00/02:30: it is not lost.
        let skip = cron("*/30 * * * *", NEW_YORK, Skip, First);
        assert_occurrences(
            &skip,
            "2026-03-08T06:00:00Z",
            &[
                plain("2026-03-08T06:30:00Z"),
                plain("2026-03-08T07:00:00Z"),
                plain("2026-03-08T07:30:00Z"),
            ],
        );
        assert_next(&skip, "2026-03-08T06:30:00Z", "2026-03-08T07:00:00Z");
        let hourly_skip = cron("0 * * * *", NEW_YORK, Skip, First);
        assert_runs(
            &hourly_skip,
            "2026-03-08T06:00:00Z",
            &["2026-03-08T07:00:00Z", "2026-03-08T08:00:00Z"],
        );
    }

    // --- DST: Europe/London, Australia/Lord_Howe ---------------------------------------------

    #[test]
    fn london_gap_and_fold() {
        // 2026-03-29 01:00 GMT -> 02:00 BST at 01:00Z.
        let gap_eve = "2026-03-28T12:00:00Z";
        let shift = cron("30 1 * * *", LONDON, Shift, First);
        let shifted_then_next = [
            shifted("2026-03-29T01:00:00Z", hm(1, 30)),
            plain("2026-03-30T00:30:00Z"),
        ];
        assert_occurrences(&shift, gap_eve, &shifted_then_next);
        let skip = cron("30 1 * * *", LONDON, Skip, First);
        assert_runs(&skip, gap_eve, &["2026-03-30T00:30:00Z"]);
        // 2026-10-25 02:00 BST -> 01:00 GMT at 01:00Z: 01:30 happens at 00:30Z and 01:30Z.
        let folds: [(DstFold, &[&str]); 3] = [
            (First, &["2026-10-25T00:30:00Z"]),
            (Second, &["2026-10-25T01:30:00Z"]),
            (
                Both,
                &[
                    "2026-10-25T00:30:00Z",
                    "2026-10-25T01:30:00Z",
                    "2026-10-26T01:30:00Z",
                ],
            ),
        ];
        for (fold, expected) in folds {
            let s = cron("30 1 * * *", LONDON, Shift, fold);
            assert_runs(&s, "2026-10-24T12:00:00Z", expected);
        }
    }

    #[test]
    fn lord_howe_half_hour_gap_and_fold() {
        // 2026-10-04 02:00 (+10:30) -> 02:30 (+11) at 2026-10-03T15:30Z.
        let gap_day = "2026-10-03T00:00:00Z";
        let shift = cron("15 2 * * *", LORD_HOWE, Shift, First);
        assert_occurrences(
            &shift,
            gap_day,
            &[shifted("2026-10-03T15:30:00Z", hm(2, 15))],
        );
        // 02:30 exists (the first wall time after the gap): a normal run.
        let at_end = cron("30 2 * * *", LORD_HOWE, Skip, First);
        assert_occurrences(&at_end, gap_day, &[plain("2026-10-03T15:30:00Z")]);
        let skip = cron("15 2 * * *", LORD_HOWE, Skip, First);
        let skipped_then_next = [
            skipped("2026-10-03T15:30:00Z", hm(2, 15)),
            plain("2026-10-04T15:15:00Z"),
        ];
        assert_occurrences(&skip, gap_day, &skipped_then_next);
        // 2026-04-05 02:00 (+11) -> 01:30 (+10:30) at 2026-04-04T15:00Z; 01:30-02:00 twice.
        let fold_day = "2026-04-04T00:00:00Z";
        let both = cron("45 1 * * *", LORD_HOWE, Shift, Both);
        let twice_then_next = [
            fold_first("2026-04-04T14:45:00Z"),
            fold_second("2026-04-04T15:15:00Z"),
            plain("2026-04-05T15:15:00Z"),
        ];
        assert_occurrences(&both, fold_day, &twice_then_next);
        let before_fold = cron("15 1 * * *", LORD_HOWE, Shift, Both);
        assert_occurrences(&before_fold, fold_day, &[plain("2026-04-04T14:15:00Z")]);
    }

    // --- Odd zones ---------------------------------------------------------------------------

    #[test]
    fn kolkata_half_hour_offset_without_dst() {
        let s = cron("30 9 * * *", "Asia/Kolkata", Shift, First);
        assert_runs(
            &s,
            "2026-06-01T00:00:00Z",
            &["2026-06-01T04:00:00Z", "2026-06-02T04:00:00Z"],
        );
    }

    #[test]
    fn apia_skipped_a_whole_day_shift_runs_at_next_midnight() {
        // Local 2011-12-29 23:59:59 -10:00 was followed by 2011-12-31 00:00 +14:00 (10:00Z).
        let s = cron("0 12 * * *", APIA, Shift, First);
        let got = take(&s, "2011-12-29T00:00:00Z", 3);
        assert_eq!(
            got,
            [
                plain("2011-12-29T22:00:00Z"),
                shifted("2011-12-30T10:00:00Z", hm(12, 0)),
                plain("2011-12-30T22:00:00Z"),
            ]
        );
        let apia = tz("Pacific/Apia");
        assert_eq!(
            got[1].at.with_timezone(&apia).to_rfc3339(),
            "2011-12-31T00:00:00+14:00"
        );
        assert_eq!(
            got[2].at.with_timezone(&apia).to_rfc3339(),
            "2011-12-31T12:00:00+14:00"
        );
        let skip = cron("0 12 * * *", APIA, Skip, First);
        assert_runs(
            &skip,
            "2011-12-29T00:00:00Z",
            &["2011-12-29T22:00:00Z", "2011-12-30T22:00:00Z"],
        );
    }

    #[test]
    fn gap_transition_is_found_for_any_gap_size() {
        let wall = |s: &str| NaiveDateTime::parse_from_str(s, "%Y-%m-%d %H:%M").unwrap();
        let cases = [
            (
                "Pacific/Apia",
                "2011-12-30 12:00",
                "2011-12-30T10:00:00Z",
                "2011-12-31 00:00",
            ),
            (
                "Australia/Lord_Howe",
                "2026-10-04 02:10",
                "2026-10-03T15:30:00Z",
                "2026-10-04 02:30",
            ),
            (
                "America/New_York",
                "2026-03-08 02:59",
                "2026-03-08T07:00:00Z",
                "2026-03-08 03:00",
            ),
            (
                "Antarctica/Troll",
                "2026-03-29 01:30",
                "2026-03-29T01:00:00Z",
                "2026-03-29 03:00",
            ),
        ];
        for (zone, inside, at, after_gap) in cases {
            assert_eq!(
                gap_transition(tz(zone), wall(inside)),
                Some((utc(at), wall(after_gap))),
                "{zone}"
            );
        }
    }

    #[test]
    fn sao_paulo_before_and_after_abolishing_dst() {
        // 2018-11-04 00:00 -03 -> 01:00 -02 at 03:00Z: midnight does not exist.
        let s = cron("0 0 * * *", SAO_PAULO, Shift, First);
        assert_occurrences(
            &s,
            "2018-11-03T12:00:00Z",
            &[
                shifted("2018-11-04T03:00:00Z", hm(0, 0)),
                plain("2018-11-05T02:00:00Z"),
            ],
        );
        // DST abolished in 2019: 2019-11-03 is an ordinary day.
        assert_occurrences(
            &s,
            "2019-11-02T12:00:00Z",
            &[plain("2019-11-03T03:00:00Z"), plain("2019-11-04T03:00:00Z")],
        );
        // The last fold, 2019-02-17 00:00 -02 -> 2019-02-16 23:00 -03.
        let both = cron("30 23 * * *", SAO_PAULO, Shift, Both);
        assert_runs(
            &both,
            "2019-02-16T12:00:00Z",
            &["2019-02-17T01:30:00Z", "2019-02-17T02:30:00Z"],
        );
    }

    // --- Calendar ----------------------------------------------------------------------------

    #[test]
    fn feb_29_and_the_31st() {
        let leap = utc_cron("0 0 29 2 *");
        assert_runs(
            &leap,
            "2025-01-01T00:00:00Z",
            &["2028-02-29T00:00:00Z", "2032-02-29T00:00:00Z"],
        );
        // 2100 is not a leap year: 8 years between.
        assert_runs(&leap, "2096-03-01T00:00:00Z", &["2104-02-29T00:00:00Z"]);
        let thirty_first = utc_cron("0 12 31 * *");
        assert_runs(
            &thirty_first,
            "2026-01-31T12:00:00Z",
            &[
                "2026-03-31T12:00:00Z",
                "2026-05-31T12:00:00Z",
                "2026-07-31T12:00:00Z",
                "2026-08-31T12:00:00Z",
                "2026-10-31T12:00:00Z",
                "2026-12-31T12:00:00Z",
            ],
        );
    }

    #[test]
    fn year_rollover_seconds_and_subsecond_after() {
        let yearly = utc_cron("@yearly");
        assert_runs(&yearly, "2026-12-31T23:59:59Z", &["2027-01-01T00:00:00Z"]);
        let secs = utc_cron("*/20 * * * * *");
        let thirds = [
            "2026-01-01T00:00:20Z",
            "2026-01-01T00:00:40Z",
            "2026-01-01T00:01:00Z",
        ];
        assert_runs(&secs, "2026-01-01T00:00:00.500Z", &thirds);
        let every_sec = utc_cron("* * * * * *");
        assert_runs(
            &every_sec,
            "2026-01-01T00:00:00.5Z",
            &["2026-01-01T00:00:01Z"],
        );
        // The instant itself is excluded.
        let daily = utc_cron("0 0 * * *");
        assert_runs(&daily, "2026-01-01T00:00:00Z", &["2026-01-02T00:00:00Z"]);
    }

    #[test]
    fn last_day_last_weekday_and_nearest_weekday() {
        let at_noon = |days: &[&str]| -> Vec<String> {
            days.iter().map(|d| format!("{d}T12:00:00Z")).collect()
        };
        let check = |expr: &str, after: &str, days: &[&str]| {
            let expected = at_noon(days);
            let expected: Vec<&str> = expected.iter().map(String::as_str).collect();
            assert_runs(&utc_cron(expr), after, &expected);
        };
        check(
            "0 12 L * *",
            "2027-12-15T00:00:00Z",
            &[
                "2027-12-31",
                "2028-01-31",
                "2028-02-29",
                "2028-03-31",
                "2028-04-30",
            ],
        );
        // 2026-01-31 is a Saturday, 2026-02-28 a Saturday, 2026-05-31 a Sunday.
        check(
            "0 12 LW 1,2,3,5 *",
            "2026-01-01T00:00:00Z",
            &["2026-01-30", "2026-02-27", "2026-03-31", "2026-05-29"],
        );
        // 2022-01-01 is a Saturday: Monday the 3rd, not Friday Dec 31st.
        check("0 12 1W 1 *", "2021-12-01T00:00:00Z", &["2022-01-03"]);
        // The 15th: Sunday 2026-02-15 -> Monday 16th; Saturday 2026-08-15 -> Friday 14th.
        check(
            "0 12 15W 2,8 *",
            "2026-01-01T00:00:00Z",
            &["2026-02-16", "2026-08-14"],
        );
        // Sunday 2026-05-31 -> Friday 29th (never crossing into June); no 31st in June.
        check(
            "0 12 31W 5,6,7 *",
            "2026-01-01T00:00:00Z",
            &["2026-05-29", "2026-07-31", "2027-05-31"],
        );
        // A list mixes plain days and extensions.
        check(
            "0 12 1,15W,L 2 *",
            "2026-01-01T00:00:00Z",
            &["2026-02-01", "2026-02-16", "2026-02-28", "2027-02-01"],
        );
    }

    #[test]
    fn last_and_nth_weekday_of_the_month() {
        let runs_on = |expr: &str, after: &str, n: usize| -> Vec<String> {
            runs(&utc_cron(expr), after, n)
                .iter()
                .map(|t| t.format("%Y-%m-%d").to_string())
                .collect()
        };
        let last_friday = ["2026-01-30", "2026-02-27", "2026-03-27"];
        for expr in ["0 0 * * 5L", "0 0 * * FRIL", "0 0 * * fril"] {
            assert_eq!(
                runs_on(expr, "2026-01-01T00:00:00Z", 3),
                last_friday,
                "{expr}"
            );
        }
        let second_monday = ["2026-01-12", "2026-02-09", "2026-03-09"];
        for expr in ["0 0 * * MON#2", "0 0 * * 1#2", "0 0 * * mon#2"] {
            assert_eq!(
                runs_on(expr, "2026-01-01T00:00:00Z", 3),
                second_monday,
                "{expr}"
            );
        }
        // 0 and 7 are Sunday, for L and # alike.
        for expr in ["0 0 * * 0L", "0 0 * * 7L", "0 0 * * SUNL"] {
            assert_eq!(
                runs_on(expr, "2026-01-01T00:00:00Z", 2),
                ["2026-01-25", "2026-02-22"],
                "{expr}"
            );
        }
        assert_eq!(
            runs_on("0 0 * * 0#1,7#3", "2026-01-31T00:00:00Z", 3),
            ["2026-02-01", "2026-02-15", "2026-03-01"]
        );
        // A fifth Monday in February needs a leap year whose Feb 1 is a Monday: after 2072 the
        // next is 2112 (2100 is not leap), 40 years on, within the search horizon.
        assert_eq!(
            runs_on("0 0 * 2 MON#5", "2026-01-01T00:00:00Z", 2),
            ["2044-02-29", "2072-02-29"]
        );
        assert_eq!(
            runs_on("0 0 * 2 MON#5", "2072-03-01T00:00:00Z", 1),
            ["2112-02-29"]
        );
        // Both day fields restricted: either matches (the last day OR the first Monday).
        assert_eq!(
            runs_on("0 0 L * MON#1", "2026-01-01T00:00:00Z", 4),
            ["2026-01-05", "2026-01-31", "2026-02-02", "2026-02-28"]
        );
    }

    #[test]
    fn day_extensions_follow_the_dst_policies() {
        // 2026-03-08 is New York's second Sunday of March: 02:30 does not exist.
        let spring = |gap| cron("0 30 2 * * SUN#2", "America/New_York", gap, DstFold::First);
        assert_occurrences(
            &spring(DstGap::Shift),
            "2026-03-01T00:00:00Z",
            &[shifted("2026-03-08T07:00:00Z", hm(2, 30))],
        );
        assert_occurrences(
            &spring(DstGap::Skip),
            "2026-03-01T00:00:00Z",
            &[skipped("2026-03-08T07:00:00Z", hm(2, 30))],
        );
        assert_next(
            &spring(DstGap::Skip),
            "2026-03-01T00:00:00Z",
            "2026-04-12T06:30:00Z",
        );
        // 2026-11-01, the first Sunday of November: 01:30 happens twice.
        let fall = |fold| cron("0 30 1 * * 0#1", "America/New_York", DstGap::Shift, fold);
        assert_occurrences(
            &fall(DstFold::Both),
            "2026-10-15T00:00:00Z",
            &[
                fold_first("2026-11-01T05:30:00Z"),
                fold_second("2026-11-01T06:30:00Z"),
            ],
        );
        assert_next(
            &fall(DstFold::Second),
            "2026-10-15T00:00:00Z",
            "2026-11-01T06:30:00Z",
        );
        // London's last Sunday of October, 01:30 twice; of March, 01:30 in the gap.
        let london = cron(
            "0 30 1 * 3,10 7L",
            "Europe/London",
            DstGap::Skip,
            DstFold::Both,
        );
        assert_occurrences(
            &london,
            "2026-03-01T00:00:00Z",
            &[
                skipped("2026-03-29T01:00:00Z", hm(1, 30)),
                fold_first("2026-10-25T00:30:00Z"),
                fold_second("2026-10-25T01:30:00Z"),
            ],
        );
    }

    #[test]
    fn day_extension_errors_name_field_and_form() {
        let cases = [
            (
                "0 0 L-2 * *",
                r#"field day-of-month: "L-2": expected L, LW or a day followed by W (15W); they take no range or step"#,
            ),
            (
                "0 0 1-5W * *",
                r#"field day-of-month: "1-5W": W follows a single day (15W, or LW), "1-5" is not a number"#,
            ),
            (
                "0 0 32W * *",
                r#"field day-of-month: "32W": W follows a single day (15W, or LW), 32 is out of range 1-31"#,
            ),
            (
                "0 0 * * MON#6",
                r#"field day-of-week: "MON#6": # takes 1-5 (MON#2: the second Monday)"#,
            ),
            (
                "0 0 * * L",
                r#"field day-of-week: "L" alone is not a day of week; write 5L or FRIL for the last Friday"#,
            ),
            (
                "0 0 * * 8L",
                r#"field day-of-week: "8L": 8 is out of range 0-7"#,
            ),
            (
                "0 0 30W 2 *",
                r#"never matches: day-of-month "30W" does not occur in month "2""#,
            ),
        ];
        for (expr, message) in cases {
            assert_eq!(err(expr), format!("cron {expr:?}: {message}"), "{expr}");
        }
    }

    #[test]
    fn day_of_month_or_day_of_week_when_both_restricted() {
        // 2026-02-01 is a Sunday: the 1st OR Mondays.
        let s = utc_cron("0 0 1 * MON");
        assert_runs(
            &s,
            "2026-02-01T00:00:00Z",
            &[
                "2026-02-02T00:00:00Z",
                "2026-02-09T00:00:00Z",
                "2026-02-16T00:00:00Z",
                "2026-02-23T00:00:00Z",
                "2026-03-01T00:00:00Z",
                "2026-03-02T00:00:00Z",
            ],
        );
        // Only one restricted: AND (here: weekdays in January only).
        let weekday_only = CronExpr::parse("0 0 * 1 mon-fri").unwrap();
        let d = |s: &str| {
            NaiveDateTime::parse_from_str(&format!("{s} 00:00"), "%Y-%m-%d %H:%M").unwrap()
        };
        assert!(weekday_only.matches(d("2026-01-02"))); // Friday
        assert!(!weekday_only.matches(d("2026-01-03"))); // Saturday
        assert!(!weekday_only.matches(d("2026-02-02"))); // Monday, February
        let dom_only = CronExpr::parse("0 0 13 * *").unwrap();
        assert!(dom_only.matches(d("2026-02-13")));
        assert!(!dom_only.matches(d("2026-02-14")));
        // 0 and 7 are both Sunday; FRI-SUN ends on Sunday.
        let sunday = CronExpr::parse("0 0 * * 7").unwrap();
        assert_eq!(
            sunday,
            CronExpr {
                text: sunday.text.clone(),
                ..CronExpr::parse("0 0 * * 0").unwrap()
            }
        );
        let weekend = CronExpr::parse("0 0 * * FRI-SUN").unwrap();
        assert_eq!(weekend.weekdays, 0b110_0001);
        assert!(weekend.matches(d("2026-02-01")));
        // `*/2` in day-of-month is a restriction: ORed with Monday.
        let odd_days_or_monday = CronExpr::parse("0 0 */2 * 1").unwrap();
        assert!(odd_days_or_monday.matches(d("2026-02-03")));
        assert!(odd_days_or_monday.matches(d("2026-02-02")));
        assert!(!odd_days_or_monday.matches(d("2026-02-04")));
    }

    #[test]
    fn field_syntax() {
        let c = CronExpr::parse(" 5/15  1-10/3 * jan,Mar-may SAT ").unwrap();
        assert_eq!(c.minutes, (1 << 5) | (1 << 20) | (1 << 35) | (1 << 50));
        assert_eq!(c.hours, (1 << 1) | (1 << 4) | (1 << 7) | (1 << 10));
        assert_eq!(c.months, (1 << 1) | (1 << 3) | (1 << 4) | (1 << 5));
        assert_eq!(c.weekdays, 1 << 6);
        assert_eq!(c.seconds, 1);
        assert!(!c.has_seconds());
        assert_eq!(c.to_string(), "5/15  1-10/3 * jan,Mar-may SAT");
        let six = CronExpr::parse("0,30 * * * * *").unwrap();
        assert!(six.has_seconds());
        assert_eq!(six.seconds, 1 | (1 << 30));
        // `1/2` in weekdays stops at Saturday, it does not wrap to Sunday (7).
        assert_eq!(CronExpr::parse("0 0 * * 1/2").unwrap().weekdays, 0b010_1010);
        assert_eq!(
            "@daily".parse::<CronExpr>().unwrap().minutes,
            CronExpr::parse("0 0 * * *").unwrap().minutes
        );
    }

    /// Refused expressions and their exact messages. 5 fields: the second one is the hour; 6
    /// fields: it is the minute.
    const PARSE_ERRORS: [(&str, &str); 20] = [
        (
            "61 0 * * *",
            r#"cron "61 0 * * *": field minute: 61 is out of range 0-59"#,
        ),
        (
            "0 61 * * *",
            r#"cron "0 61 * * *": field hour: 61 is out of range 0-23"#,
        ),
        (
            "0 61 * * * *",
            r#"cron "0 61 * * * *": field minute: 61 is out of range 0-59"#,
        ),
        (
            "* * * *",
            r#"cron "* * * *": expected 5 or 6 fields, got 4"#,
        ),
        ("", r#"cron "": expected 5 or 6 fields, got 0"#),
        (
            "* * * * * * *",
            r#"cron "* * * * * * *": expected 5 or 6 fields, got 7"#,
        ),
        (
            "60 * * * * *",
            r#"cron "60 * * * * *": field second: 60 is out of range 0-59"#,
        ),
        (
            "0 24 * * *",
            r#"cron "0 24 * * *": field hour: 24 is out of range 0-23"#,
        ),
        (
            "0 0 0 * *",
            r#"cron "0 0 0 * *": field day-of-month: 0 is out of range 1-31"#,
        ),
        (
            "0 0 * 13 *",
            r#"cron "0 0 * 13 *": field month: 13 is out of range 1-12"#,
        ),
        (
            "0 0 * * 8",
            r#"cron "0 0 * * 8": field day-of-week: 8 is out of range 0-7"#,
        ),
        (
            "0 0 * FOO *",
            r#"cron "0 0 * FOO *": field month: "FOO" is not a number or month name (JAN-DEC)"#,
        ),
        (
            "0 0 * * MONDAY",
            r#"cron "0 0 * * MONDAY": field day-of-week: "MONDAY" is not a number or weekday name (SUN-SAT)"#,
        ),
        (
            "0 MON * * *",
            r#"cron "0 MON * * *": field hour: "MON" is not a number"#,
        ),
        (
            "*/0 * * * *",
            r#"cron "*/0 * * * *": field minute: step 0 is not allowed"#,
        ),
        (
            "*/x * * * *",
            r#"cron "*/x * * * *": field minute: step "x" is not a number"#,
        ),
        (
            "1,,2 * * * *",
            r#"cron "1,,2 * * * *": field minute: empty item in list "1,,2""#,
        ),
        (
            "0 22-2 * * *",
            r#"cron "0 22-2 * * *": field hour: range 22-2 goes backwards (wrap-around is not supported; use a list such as 22-23,0-2)"#,
        ),
        (
            "0 0 ? * MON",
            r#"cron "0 0 ? * MON": field day-of-month: "?" is Quartz syntax, which is not supported (write *)"#,
        ),
        (
            "0 0 30 2 *",
            r#"cron "0 0 30 2 *": never matches: day-of-month "30" does not occur in month "2""#,
        ),
    ];

    #[test]
    fn parse_errors_name_field_and_reason() {
        for (expr, message) in PARSE_ERRORS {
            assert_eq!(err(expr), message, "{expr}");
        }
        assert!(err("L 0 * * *").contains("field minute: \"L\": L, W and # belong to day-of-month"));
        assert!(err("0 5#3 * * *").contains("field hour: \"5#3\": L, W and # belong"));
        assert!(err("0 0 * 2L *").contains("field month: \"2L\": L, W and # belong"));
        assert!(err("0 0 * JULY *").contains(r#""JULY" is not a number or month name"#));
        assert!(err("0 0 31 4,6,9,11 *").contains("never matches"));
        assert!(err("@reboot").contains("unknown macro"));
        // Feb 29 is possible; so is the 30th with a weekday restriction (OR).
        assert!(CronExpr::parse("0 0 29 2 *").is_ok());
        assert!(CronExpr::parse("0 0 30 2 MON").is_ok());
        assert!(err("99999999999 * * * *").contains("field minute: 99999999999 is out of range"));
    }

    #[test]
    fn parse_errors_are_typed() {
        let parse = |expr: &str| CronExpr::parse(expr).unwrap_err();
        assert!(matches!(
            parse("* * * *"),
            ScheduleError::FieldCount { got: 4, .. }
        ));
        assert!(matches!(
            parse("0 24 * * *"),
            ScheduleError::Field { field: "hour", .. }
        ));
        assert!(matches!(
            parse("@reboot"),
            ScheduleError::UnknownMacro { .. }
        ));
        assert!(matches!(
            parse("0 0 30 2 *"),
            ScheduleError::NeverMatches { .. }
        ));
        assert!(matches!(
            parse_timezone("Europe/Berln"),
            Err(ScheduleError::UnknownZone { suggestions, .. }) if suggestions == ["Europe/Berlin"]
        ));
    }

    // --- Every -------------------------------------------------------------------------------

    #[test]
    fn every_hour_is_elapsed_time_across_dst() {
        let s = Schedule::Every {
            every: TimeDelta::hours(1),
            anchor: DateTime::UNIX_EPOCH,
        };
        let got = runs(&s, "2026-03-08T05:30:00Z", 4);
        assert_eq!(got[0], utc("2026-03-08T06:00:00Z"));
        for pair in got.windows(2) {
            assert_eq!((pair[1] - pair[0]).num_seconds(), 3600);
        }
        assert_next(&s, "2026-03-08T06:00:00Z", "2026-03-08T07:00:00Z");
    }

    #[test]
    fn every_handles_negative_k_subseconds_and_bad_periods() {
        let s = Schedule::Every {
            every: TimeDelta::milliseconds(1500),
            anchor: utc("2026-01-01T00:00:00.250Z"),
        };
        // Before the anchor: k is negative.
        assert_next(&s, "2025-12-31T23:59:58Z", "2025-12-31T23:59:58.750Z");
        assert_next(&s, "2025-12-31T23:59:58.750Z", "2026-01-01T00:00:00.250Z");
        assert_next(&s, "2026-01-01T00:00:00.250Z", "2026-01-01T00:00:01.750Z");
        // Far from the anchor, no drift: exactly anchor + k * 1.5 s.
        let far = s.next_after(utc("2036-01-01T00:00:00Z")).unwrap();
        assert_eq!(
            (nanos_of(far) - nanos_of(utc("2026-01-01T00:00:00.250Z"))) % 1_500_000_000,
            0
        );
        for every in [TimeDelta::zero(), TimeDelta::seconds(-5)] {
            let bad = Schedule::Every {
                every,
                anchor: DateTime::UNIX_EPOCH,
            };
            assert_eq!(bad.next_after(utc("2026-01-01T00:00:00Z")), None);
        }
    }

    // --- Time zones and display --------------------------------------------------------------

    #[test]
    fn timezone_suggestions() {
        assert_eq!(
            parse_timezone("Europe/Paris").unwrap(),
            chrono_tz::Europe::Paris
        );
        assert_eq!(
            parse_timezone("America/New_Yrok").unwrap_err().to_string(),
            r#"unknown time zone "America/New_Yrok" (did you mean "America/New_York"?)"#
        );
        let lower = parse_timezone("america/new_york").unwrap_err().to_string();
        assert!(
            lower.starts_with(
                r#"unknown time zone "america/new_york" (did you mean "America/New_York""#
            ),
            "{lower}"
        );
        let city = parse_timezone("Berlin").unwrap_err().to_string();
        assert!(city.contains(r#""Europe/Berlin""#), "{city}");
        let none = parse_timezone("Nowhere/Qqqqqq").unwrap_err().to_string();
        assert!(none.contains("expected an IANA name"), "{none}");
        assert!(suggest_timezones("Europe/Lon").len() <= 3);
    }

    #[test]
    fn notes_and_descriptions_display() {
        assert_eq!(
            Note::GapShifted { from: hm(2, 30) }.to_string(),
            "gap: shifted from 02:30"
        );
        assert_eq!(
            Note::GapSkipped { local: hm(2, 30) }.to_string(),
            "gap: skipped 02:30"
        );
        assert_eq!(Note::FoldFirst.to_string(), "fold: first of two");
        assert_eq!(Note::FoldSecond.to_string(), "fold: second of two");
        let s = cron("0 30 2 * * *", NEW_YORK, Skip, Both);
        assert_eq!(
            s.describe(),
            r#"cron "0 30 2 * * *" in America/New_York, dst_gap = skip, dst_fold = both"#
        );
        let every = Schedule::Every {
            every: TimeDelta::seconds(5430),
            anchor: DateTime::UNIX_EPOCH,
        };
        assert_eq!(every.to_string(), "every 1h 30m 30s");
        let every = Schedule::Every {
            every: TimeDelta::milliseconds(500),
            anchor: utc("2026-01-01T00:00:00Z"),
        };
        assert_eq!(every.to_string(), "every 500ms from 2026-01-01T00:00:00Z");
    }

    #[test]
    fn nothing_within_the_horizon_is_none() {
        // The next Feb 29 lies past the end of chrono's calendar.
        let s = utc_cron("0 0 29 2 *");
        assert_eq!(s.next_after(DateTime::<Utc>::MAX_UTC), None);
    }

    // --- Property test against a brute-force walk --------------------------------------------

    mod brute_force {
        use super::*;
        use proptest::prelude::*;
        use std::collections::{BTreeMap, HashMap};

        const ZONES: &[&str] = &[
            "UTC",
            "America/New_York",
            "Europe/London",
            "Europe/Dublin",
            "Australia/Lord_Howe",
            "Asia/Kolkata",
            "Asia/Kathmandu",
            "Pacific/Apia",
            "Pacific/Chatham",
            "America/Sao_Paulo",
            "America/St_Johns",
            "America/Santiago",
            "Africa/Casablanca",
            "Antarctica/Troll",
        ];

        fn field(min: u32, max: u32) -> impl Strategy<Value = String> {
            let item = prop_oneof![
                Just("*".to_string()),
                (min..=max).prop_map(|v| v.to_string()),
                (min..=max, min..=max).prop_map(|(a, b)| format!("{}-{}", a.min(b), a.max(b))),
                (1..=max.max(2) / 2).prop_map(|n| format!("*/{n}")),
                (min..=max, min..=max, 1..=7u32).prop_map(|(a, b, n)| format!(
                    "{}-{}/{n}",
                    a.min(b),
                    a.max(b)
                )),
                (min..=max, 1..=15u32).prop_map(|(a, n)| format!("{a}/{n}")),
            ];
            prop::collection::vec(item, 1..=3).prop_map(|items| items.join(","))
        }

        /// A day field with an `L`/`W`/`#` item beside the plain ones.
        fn with_extension(
            plain: impl Strategy<Value = String>,
            extension: impl Strategy<Value = String>,
        ) -> impl Strategy<Value = String> {
            (plain, extension).prop_map(|(plain, ext)| format!("{ext},{plain}"))
        }

        fn expr() -> impl Strategy<Value = String> {
            let dom_ext = prop_oneof![
                Just("L".to_string()),
                Just("LW".to_string()),
                (1..=31u32).prop_map(|n| format!("{n}W")),
            ];
            let dow_ext = prop_oneof![
                (0..=7u32).prop_map(|w| format!("{w}L")),
                (0..=7u32, 1..=5u32).prop_map(|(w, n)| format!("{w}#{n}")),
            ];
            (
                field(0, 59),
                field(0, 23),
                prop_oneof![3 => Just("*".to_string()), 1 => field(1, 31), 1 => dom_ext.clone(),
                    1 => with_extension(field(1, 31), dom_ext)],
                prop_oneof![3 => Just("*".to_string()), 1 => field(1, 12)],
                prop_oneof![3 => Just("*".to_string()), 1 => field(0, 7), 1 => dow_ext.clone(),
                    1 => with_extension(field(0, 7), dow_ext)],
            )
                .prop_map(|(mi, h, dom, mo, dow)| format!("{mi} {h} {dom} {mo} {dow}"))
        }

        /// The first hour (sampled hourly, up to ~400 days) whose offset differs from `t`'s.
        fn next_offset_change(tz: Tz, t: i64) -> Option<i64> {
            let now = offset_at(tz, t)?;
            (1..24 * 400)
                .map(|h| t + h * 3600)
                .find(|&u| offset_at(tz, u) != Some(now))
        }

        /// Expected occurrences in `(from, to]`, by a walk over every minute: UTC minute ->
        /// wall time gives each wall time's instants (0: gap, 1, 2: fold), gaps come from
        /// jumps of the wall clock. Value: true when some wall time really runs there.
        fn brute(s: &Schedule, from: i64, to: i64) -> BTreeMap<i64, bool> {
            let Schedule::Cron {
                cron,
                tz,
                gap,
                fold,
            } = s
            else {
                unreachable!()
            };
            let scan_start = (from - 3 * 86_400).div_euclid(60) * 60;
            let mut instants: HashMap<i64, Vec<i64>> = HashMap::new();
            let mut gaps = Vec::new(); // (first wall in gap, wall after gap, transition)
            let mut prev_wall = None;
            let mut t = scan_start;
            while t <= to + 3 * 86_400 {
                let wall = t + offset_at(*tz, t).unwrap();
                instants.entry(wall).or_default().push(t);
                if let Some(prev) = prev_wall {
                    if wall - prev > 60 {
                        gaps.push((prev + 60, wall, t));
                    }
                }
                prev_wall = Some(wall);
                t += 60;
            }
            let mut out: BTreeMap<i64, bool> = BTreeMap::new();
            let mut wall = (from - 36 * 3600).div_euclid(60) * 60;
            while wall <= to + 36 * 3600 {
                let naive = DateTime::from_timestamp(wall, 0).unwrap().naive_utc();
                if cron.matches(naive) {
                    let mut at = instants.get(&wall).cloned().unwrap_or_default();
                    at.sort();
                    let picked: Vec<(i64, bool)> = match (at.as_slice(), fold) {
                        ([], _) => {
                            let &(_, _, transition) = gaps
                                .iter()
                                .find(|(lo, hi, _)| (*lo..*hi).contains(&wall))
                                .expect("a missing wall time lies in a gap");
                            vec![(transition, *gap == DstGap::Shift)]
                        }
                        ([one], _) => vec![(*one, true)],
                        ([a, _], DstFold::First) => vec![(*a, true)],
                        ([_, b], DstFold::Second) => vec![(*b, true)],
                        ([a, b], DstFold::Both) => vec![(*a, true), (*b, true)],
                        (more, _) => panic!("wall time with {} instants", more.len()),
                    };
                    for (at, real) in picked {
                        *out.entry(at).or_insert(false) |= real;
                    }
                }
                wall += 60;
            }
            out.retain(|&at, _| at > from && at <= to);
            out
        }

        // --- L, W and # against a calendar walk over ten years ------------------------------

        /// Does one day-of-month item pick `date`? Read off the calendar, day by day.
        fn dom_item(item: &str, date: NaiveDate) -> bool {
            let in_month = |d: u32| NaiveDate::from_ymd_opt(date.year(), date.month(), d);
            let is_weekday = |d: NaiveDate| d.weekday().num_days_from_monday() < 5;
            let month_days: Vec<NaiveDate> = (1..=31).filter_map(in_month).collect();
            match item {
                "*" => true,
                "L" => month_days.last() == Some(&date),
                "LW" => month_days.iter().copied().rfind(|d| is_weekday(*d)) == Some(date),
                w if w.ends_with('W') => {
                    let n: u32 = w.trim_end_matches('W').parse().unwrap();
                    // The weekday of the month closest to day n (only when day n exists).
                    in_month(n).is_some()
                        && month_days
                            .iter()
                            .copied()
                            .filter(|d| is_weekday(*d))
                            .min_by_key(|d| d.day().abs_diff(n))
                            == Some(date)
                }
                n => date.day() == n.parse::<u32>().unwrap(),
            }
        }

        /// Does one day-of-week item pick `date`?
        fn dow_item(item: &str, date: NaiveDate) -> bool {
            let names = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"];
            let weekday = |w: &str| -> u32 {
                let n = names.iter().position(|n| *n == w).map(|i| i as u32);
                n.unwrap_or_else(|| w.parse().unwrap()) % 7
            };
            let is = |w: &str| date.weekday().num_days_from_sunday() == weekday(w);
            let same_month = |d: Option<NaiveDate>| d.is_some_and(|d| d.month() == date.month());
            if item == "*" {
                true
            } else if let Some((w, n)) = item.split_once('#') {
                // How many days of this weekday the month has had up to `date`.
                let nth = (0..5)
                    .filter(|k| same_month(date.checked_sub_days(chrono::Days::new(7 * k))))
                    .count();
                is(w) && nth == n.parse::<usize>().unwrap()
            } else if let Some(w) = item.strip_suffix('L') {
                is(w) && !same_month(date.checked_add_days(chrono::Days::new(7)))
            } else {
                is(item)
            }
        }

        /// Vixie's rule: both day fields restricted -> either; otherwise both.
        fn day_matches(dom: &str, dow: &str, date: NaiveDate) -> bool {
            let d = dom.split(',').any(|i| dom_item(i, date));
            let w = dow.split(',').any(|i| dow_item(i, date));
            if dom != "*" && dow != "*" {
                d || w
            } else {
                d && w
            }
        }

        /// A wall time's instants: the `t` with `t + offset(t) = wall`, tried for every offset
        /// the zone shows within a day; none: the gap's transition, found minute by minute.
        fn wall_instants(tz: Tz, wall: i64) -> (Vec<i64>, Option<i64>) {
            let mut offsets: Vec<i64> = (-14..=14)
                .map(|h| offset_at(tz, wall + h * 3600).unwrap())
                .collect();
            offsets.sort();
            offsets.dedup();
            let mut at: Vec<i64> = offsets
                .iter()
                .map(|o| wall - o)
                .filter(|&t| t + offset_at(tz, t).unwrap() == wall)
                .collect();
            at.sort();
            if !at.is_empty() {
                return (at, None);
            }
            let clock = |t: i64| t + offset_at(tz, t).unwrap();
            let (lo, hi) = (
                wall - offsets[offsets.len() - 1] - 60,
                wall - offsets[0] + 60,
            );
            let transition = (lo..=hi)
                .step_by(60)
                .find(|&t| clock(t - 60) < wall && clock(t) > wall);
            (at, transition)
        }

        /// The wall times (as UTC-read seconds) of `0 30 1,2 DOM MONTHS DOW` on the days from
        /// `first` to `last`.
        fn matching_walls(
            (dom, months, dow): (&str, &[u32], &str),
            first: NaiveDate,
            last: NaiveDate,
        ) -> Vec<i64> {
            first
                .iter_days()
                .take_while(|d| *d <= last)
                .filter(|d| months.contains(&d.month()) && day_matches(dom, dow, *d))
                .flat_map(|d| {
                    [1, 2].map(|h| d.and_hms_opt(h, 30, 0).unwrap().and_utc().timestamp())
                })
                .collect()
        }

        /// The expected occurrences of the wall times `walls` in `(from, to]`: true when
        /// something really runs there (as `brute` above).
        fn expected(
            walls: &[i64],
            tz: Tz,
            (gap, fold): (DstGap, DstFold),
            (from, to): (i64, i64),
            cache: &mut HashMap<i64, (Vec<i64>, Option<i64>)>,
        ) -> BTreeMap<i64, bool> {
            let mut out = BTreeMap::new();
            for &wall in walls {
                let (at, transition) = cache.entry(wall).or_insert_with(|| wall_instants(tz, wall));
                let picked = match (at.as_slice(), fold) {
                    ([], _) => vec![(
                        transition.expect("a gap has a transition"),
                        gap == DstGap::Shift,
                    )],
                    ([one], _) => vec![(*one, true)],
                    ([a, _], DstFold::First) => vec![(*a, true)],
                    ([_, b], DstFold::Second) => vec![(*b, true)],
                    ([a, b], DstFold::Both) => vec![(*a, true), (*b, true)],
                    (more, _) => panic!("wall time with {} instants", more.len()),
                };
                for (at, real) in picked {
                    *out.entry(at).or_insert(false) |= real;
                }
            }
            out.retain(|&at, _| at > from && at <= to);
            out
        }

        /// The entries of `a` and `b` that differ, for a readable failure.
        fn differences(a: &BTreeMap<i64, bool>, b: &BTreeMap<i64, bool>) -> Vec<String> {
            let when = |t: i64| DateTime::from_timestamp(t, 0).unwrap().to_rfc3339();
            a.keys()
                .chain(b.keys())
                .filter(|t| a.get(t) != b.get(t))
                .map(|&t| format!("{}: got {:?}, want {:?}", when(t), a.get(&t), b.get(&t)))
                .collect()
        }

        /// `L`, `W` and `#` (alone, in lists, ORed with the other day field, with months
        /// restricted to the DST months) agree with a calendar walk from 2020 to 2030 in five
        /// zones, at 01:30 and 02:30 (in New York, London, Sydney and Lord Howe those wall times
        /// fall in the spring gap or the autumn fold on the transition Sundays), under four DST
        /// policy pairs.
        #[test]
        fn day_extensions_agree_with_a_calendar_walk_over_ten_years() {
            const ALL: &[u32] = &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
            let exprs: &[(&str, &[u32], &str)] = &[
                ("L", ALL, "*"),
                ("LW", ALL, "*"),
                ("1W,15W,31W", ALL, "*"),
                ("*", ALL, "FRIL"),
                ("*", &[3, 4, 10, 11], "SUN#1,0#2,7L"),
                ("1,L", ALL, "MON#2"),
                ("15W", ALL, "5L,SAT#5"),
            ];
            let zones = [
                "UTC",
                "America/New_York",
                "Europe/London",
                "Australia/Sydney",
                "Australia/Lord_Howe",
            ];
            let policies = [
                (DstGap::Shift, DstFold::First),
                (DstGap::Skip, DstFold::Second),
                (DstGap::Shift, DstFold::Both),
                (DstGap::Skip, DstFold::Both),
            ];
            let (from, to) = (1_577_836_800i64, 1_893_456_000i64); // 2020-01-01 .. 2030-01-01
            let (first, last) = (
                NaiveDate::from_ymd_opt(2019, 12, 30).unwrap(),
                NaiveDate::from_ymd_opt(2030, 1, 2).unwrap(),
            );
            let walls: Vec<Vec<i64>> = exprs
                .iter()
                .map(|e| matching_walls(*e, first, last))
                .collect();
            let mut transitions_hit = 0;
            for zone in zones {
                let tz: Tz = zone.parse().unwrap();
                let mut cache = HashMap::new();
                for (&(dom, months, dow), walls) in exprs.iter().zip(&walls) {
                    let month_list: Vec<String> = months.iter().map(u32::to_string).collect();
                    let text = format!("0 30 1,2 {dom} {} {dow}", month_list.join(","));
                    let cron = CronExpr::parse(&text).unwrap();
                    for (gap, fold) in policies {
                        let want = expected(walls, tz, (gap, fold), (from, to), &mut cache);
                        let s = Schedule::Cron {
                            cron: cron.clone().into(),
                            tz,
                            gap,
                            fold,
                        };
                        let got: BTreeMap<i64, bool> = s
                            .occurrences_after(DateTime::from_timestamp(from, 0).unwrap())
                            .take_while(|o| o.at.timestamp() <= to)
                            .inspect(|o| transitions_hit += usize::from(o.note.is_some()))
                            .map(|o| (o.at.timestamp(), !o.skipped))
                            .collect();
                        assert!(!want.is_empty(), "{text} in {zone}");
                        let diff = differences(&got, &want);
                        assert!(
                            diff.is_empty(),
                            "{text} in {zone}, {gap:?}/{fold:?}: {diff:#?}"
                        );
                    }
                }
            }
            // The walk did cross gaps and folds, not only plain days.
            assert!(transitions_hit > 100, "{transitions_hit}");
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

            #[test]
            fn agrees_with_minute_walk(
                expr in expr(),
                zone in prop::sample::select(ZONES),
                gap in prop::sample::select(&[DstGap::Shift, DstGap::Skip][..]),
                fold in prop::sample::select(&[DstFold::First, DstFold::Second, DstFold::Both][..]),
                start in 946_684_800i64..2_082_758_400,
                near_transition in any::<bool>(),
                back in 0i64..36 * 3600,
            ) {
                let Ok(cron) = CronExpr::parse(&expr) else { return Ok(()) };
                let tz: Tz = zone.parse().unwrap();
                let mut from = start;
                if near_transition {
                    if let Some(change) = next_offset_change(tz, start) {
                        from = change - back;
                    }
                }
                let to = from + 2 * 86_400;
                let s = Schedule::Cron { cron: cron.clone().into(), tz, gap, fold };
                let expected = brute(&s, from, to);

                let mut got = BTreeMap::new();
                let mut at = DateTime::from_timestamp(from, 0).unwrap();
                while let Some(occ) = s.next_occurrence_after(at) {
                    prop_assert!(occ.at > at, "not increasing: {occ:?} after {at}");
                    if occ.at.timestamp() > to { break; }
                    let wall = occ.at.with_timezone(&tz).naive_local();
                    match occ.note {
                        Some(Note::GapShifted { .. }) | Some(Note::GapSkipped { .. }) => {
                            let t = occ.at.timestamp();
                            prop_assert!(offset_at(tz, t - 1) < offset_at(tz, t), "{occ:?} is no gap transition");
                        }
                        _ => prop_assert!(cron.matches(wall), "{occ:?} ({wall}) does not match"),
                    }
                    prop_assert_eq!(occ.skipped, matches!(occ.note, Some(Note::GapSkipped { .. })));
                    got.insert(occ.at.timestamp(), !occ.skipped);
                    at = occ.at;
                }
                prop_assert_eq!(&got, &expected, "{} in {} gap={:?} fold={:?} from {}", expr, zone, gap, fold, from);

                let mut real = Vec::new();
                let mut at = DateTime::from_timestamp(from, 0).unwrap();
                while let Some(next) = s.next_after(at) {
                    prop_assert!(next > at);
                    if next.timestamp() > to { break; }
                    real.push(next.timestamp());
                    at = next;
                }
                let expected_real: Vec<i64> = expected.iter().filter(|(_, r)| **r).map(|(t, _)| *t).collect();
                prop_assert_eq!(real, expected_real);
            }
        }
    }

    // --- Benchmark ---------------------------------------------------------------------------

    /// `cargo test --release -- --ignored --nocapture bench_next_after`
    #[test]
    #[ignore = "benchmark; run in release with --nocapture"]
    fn bench_next_after() {
        const N: u32 = 100_000;
        for (expr, zone) in [
            ("0 30 2 * * *", "UTC"),
            ("0 30 2 * * *", "America/New_York"),
            ("*/15 * * * *", "America/New_York"),
            ("0 0 29 2 *", "Europe/London"),
        ] {
            let s = cron(expr, zone, DstGap::Shift, DstFold::First);
            let mut at = utc("2026-01-01T00:00:00Z");
            let started = std::time::Instant::now();
            for _ in 0..N {
                at = std::hint::black_box(s.next_after(at).unwrap());
                if at.year() > 2200 {
                    at = utc("2026-01-01T00:00:00Z");
                }
            }
            let ns = started.elapsed().as_nanos() / u128::from(N);
            println!("next_after {expr:?} in {zone}: {ns} ns/call");
        }
    }

    #[test]
    fn every_between_counts_like_a_walk() {
        let anchor = utc("2026-03-02T12:00:00.250Z");
        let every = TimeDelta::milliseconds(1500);
        let after = utc("2026-03-02T11:59:00Z");
        let before = utc("2026-03-02T12:03:00.250Z");
        let schedule = Schedule::Every { every, anchor };
        let walked: Vec<_> = schedule
            .occurrences_after(after)
            .map(|o| o.at)
            .take_while(|t| *t < before)
            .collect();
        let (n, first, last) = every_between(every, anchor, after, before).unwrap();
        assert_eq!(n as usize, walked.len());
        assert_eq!(first, walked[0]);
        assert_eq!(last, *walked.last().unwrap());
        // An instant exactly at `after` or `before` is excluded.
        assert_eq!(every_between(every, anchor, anchor, anchor + every), None);
    }

    #[test]
    fn period_of_every_and_of_cron() {
        let at = |h: u32, m: u32| Utc.with_ymd_and_hms(2026, 3, 8, h, m, 0).unwrap();
        let every = Schedule::Every {
            every: TimeDelta::seconds(30),
            anchor: DateTime::UNIX_EPOCH,
        };
        assert_eq!(every.period(at(7, 0)), Some(TimeDelta::seconds(30)));
        let cron = |expr| cron(expr, "UTC", DstGap::Shift, DstFold::First);
        assert_eq!(
            cron("*/15 * * * *").period(at(7, 7)),
            Some(TimeDelta::minutes(15))
        );
        assert_eq!(cron("0 3 * * *").period(at(7, 7)), Some(TimeDelta::days(1)));
    }
}
