//! The status page's strips (docs/design.md#audit-and-verify): each listed job's last
//! [`INSTANTS`] due instants, classified by the audit's own code ([`audit::audit`]) from one
//! capped read of the journal's newest entries ([`JOURNAL_ENTRIES`], docs/design.md#bounded-work).
//! An instant the read may not hold every entry of is `unknown`, never `missed`: the strip
//! draws only what the journal read shows. Pure: the page reads, this decides and draws.

use crate::audit::{self, Class, Evidence};
use chrono::{DateTime, TimeDelta, Utc};
use drumline_shared::config::{Job, JournalConfig};
use drumline_shared::envelope::{format_instant, instance_key};
use drumline_shared::store::JournalEntry;
use std::collections::HashMap;
use std::fmt::Write;

/// Instants drawn per job.
pub const INSTANTS: usize = 12;

/// Journal entries one render reads (`XREVRANGE ... COUNT`), whatever the number of jobs.
pub const JOURNAL_ENTRIES: usize = 2_000;

/// How much earlier than its instant an entry may be stamped (a beat's clock ahead of Redis
/// `TIME`), and the page's clock off from Redis when it reasons about the retention.
const CLOCK_SLACK_MS: i64 = 60_000;

/// How far back the strip looks for a job's instants.
const LOOKBACK_DAYS: i64 = 400;

/// What one cell shows: the audit's class, or unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    /// Classified by the audit from entries the read holds all of.
    Known(Class),
    /// Older than the read covers, or before the journal names the job: not known.
    Unknown,
}

impl Mark {
    /// The cell's CSS class (and its tooltip's word).
    pub fn css(self) -> &'static str {
        match self {
            Mark::Known(Class::Ran) => "ran",
            Mark::Known(Class::Retried) => "retried",
            Mark::Known(Class::Dead) => "dead",
            Mark::Known(Class::Skipped) => "skipped",
            Mark::Known(Class::Expired) => "expired",
            Mark::Known(Class::Pending) => "pending",
            Mark::Known(Class::Missed) => "missed",
            Mark::Known(Class::Doubled) => "doubled",
            Mark::Unknown => "unknown",
        }
    }
}

/// One instant of a strip.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cell {
    /// The due instant.
    pub instant: DateTime<Utc>,
    /// Its idempotency key (the cell links to it).
    pub key: String,
    /// What became of it, as far as the read shows.
    pub mark: Mark,
}

/// The journal's newest entries as one render read them, by job.
pub struct Recent {
    by_job: HashMap<String, Vec<JournalEntry>>,
    covered_from: DateTime<Utc>,
}

impl Recent {
    /// `entries` (oldest first) as read asking for `asked`, under the `journal` settings, at
    /// `now`.
    pub fn new(
        entries: Vec<JournalEntry>,
        asked: usize,
        journal: &JournalConfig,
        now: DateTime<Utc>,
    ) -> Self {
        let covered_from = covered_from(&entries, asked, journal, now);
        let mut by_job: HashMap<String, Vec<JournalEntry>> = HashMap::new();
        for e in entries {
            if let Some((job, _)) = e.key.rsplit_once('@') {
                by_job.entry(job.to_owned()).or_default().push(e);
            }
        }
        Recent {
            by_job,
            covered_from,
        }
    }

    /// `job`'s strip at `now`, oldest first, with the beat's `progress` for it (read before
    /// the journal, so every instant it covers has its entries written).
    pub fn strip(
        &self,
        job: &Job,
        progress: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Vec<Cell> {
        let instants = last_instants(job, now, INSTANTS);
        let (Some(first), Some(last)) = (instants.first(), instants.last()) else {
            return Vec::new();
        };
        let evidence = Evidence {
            entries: self.by_job.get(&job.name).cloned().unwrap_or_default(),
            progress,
            ..Evidence::default()
        };
        let rows = audit::audit(job, *first, *last, &evidence);
        let classes: HashMap<&str, Class> =
            rows.iter().map(|r| (r.key.as_str(), r.class)).collect();
        instants
            .iter()
            .map(|&t| {
                let key = instance_key(&job.name, t);
                let mark = match classes.get(key.as_str()) {
                    Some(class) if t >= self.covered_from => Mark::Known(*class),
                    _ => Mark::Unknown,
                };
                Cell {
                    instant: t,
                    key,
                    mark,
                }
            })
            .collect()
    }
}

/// The earliest instant all of whose entries the read holds. A full read (as many as asked)
/// holds everything from its oldest entry on. A shorter one is the whole stream: what was
/// trimmed from it is older than its oldest entry and, when fewer than `max_len` remain (a
/// `MAXLEN ~` trim leaves at least that many, so the last trim was by age), older than
/// `now - keep` as well. An instant's entries come at most [`CLOCK_SLACK_MS`] before it.
pub fn covered_from(
    entries: &[JournalEntry],
    asked: usize,
    journal: &JournalConfig,
    now: DateTime<Utc>,
) -> DateTime<Utc> {
    let keep = i64::try_from(journal.keep.as_millis()).unwrap_or(i64::MAX);
    let aged = now.timestamp_millis().saturating_sub(keep);
    let oldest = entries.first().map(|e| e.at_ms);
    let full = entries.len() >= asked || entries.len() as u64 >= journal.max_len;
    let from_ms = match (oldest, full) {
        (Some(oldest), true) => oldest,
        (Some(oldest), false) => oldest.min(aged),
        (None, _) => aged,
    };
    DateTime::from_timestamp_millis(from_ms.saturating_add(CLOCK_SLACK_MS)).unwrap_or(now)
}

/// The last `n` instants of `job`'s schedule at or before `now`, oldest first (fewer when it
/// has fewer within [`LOOKBACK_DAYS`]). The window starts at `n + 1` of its coming gaps and
/// doubles, so a job's instants are walked about twice whatever its period.
pub fn last_instants(job: &Job, now: DateTime<Utc>, n: usize) -> Vec<DateTime<Utc>> {
    let next = job.schedule.next_after(now);
    let gap = next
        .and_then(|a| Some(job.schedule.next_after(a)? - a))
        .unwrap_or(TimeDelta::days(1));
    let limit = TimeDelta::days(LOOKBACK_DAYS);
    let mut span = (gap * (n as i32 + 1)).clamp(TimeDelta::seconds(1), limit);
    loop {
        let from = now.checked_sub_signed(span).unwrap_or(now);
        let found = audit::expected(job, from, now);
        if found.len() >= n || span >= limit {
            return found[found.len().saturating_sub(n)..].to_vec();
        }
        span = (span * 2).min(limit);
    }
}

/// One strip as HTML: a link per instant to its key's page, coloured by its class, the
/// instant and the class in its tooltip (`escape` escapes what is shown).
pub fn render(cells: &[Cell], escape: impl Fn(&str) -> String) -> String {
    let mut out = String::from("<span class=\"strip\">");
    for cell in cells {
        let class = cell.mark.css();
        let _ = write!(
            out,
            "<a class=\"cell {class}\" href=\"/keys/{href}\" title=\"{at} {class}\"></a>",
            href = escape(&path_segment(&cell.key)),
            at = escape(&format_instant(cell.instant)),
        );
    }
    out.push_str("</span>");
    out
}

/// The legend, once on the page: a sample cell per class.
pub fn legend() -> String {
    let marks = [
        Mark::Known(Class::Ran),
        Mark::Known(Class::Retried),
        Mark::Known(Class::Dead),
        Mark::Known(Class::Skipped),
        Mark::Known(Class::Expired),
        Mark::Known(Class::Pending),
        Mark::Known(Class::Missed),
        Mark::Known(Class::Doubled),
        Mark::Unknown,
    ];
    let mut out = String::from("<p id=\"legend\">Recent instants, oldest first:");
    for mark in marks {
        let class = mark.css();
        let _ = write!(out, " <span class=\"cell {class}\"></span> {class}");
    }
    out.push_str(" (beyond what the journal read shows)</p>\n");
    out
}

/// `text` as one URL path segment: unreserved characters, `@` and `:` kept, every other byte
/// percent-encoded.
pub fn path_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'@' | b':' => {
                out.push(b as char)
            }
            b => {
                let _ = write!(out, "%{b:02X}");
            }
        }
    }
    out
}

/// The CSS of the strips and the legend.
pub const STYLE: &str = ".cell{display:inline-block;width:10px;height:14px;margin-right:2px;\
border-radius:2px;vertical-align:middle;background:#e4e4e4;border:1px dashed #aaa;\
box-sizing:border-box}\
.cell.ran{background:#2f9e44;border:0}\
.cell.retried{background:#f08c00;border:0}\
.cell.dead{background:#c92a2a;border:0}\
.cell.skipped{background:#4c6ef5;border:0}\
.cell.expired{background:#862e9c;border:0}\
.cell.pending{background:#ffe066;border:0}\
.cell.missed{background:#000;border:0}\
.cell.doubled{background:#e64980;border:0}\
#legend{color:#555;margin-top:.5em}";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::tests::entry;
    use crate::fixtures::{at, job};

    fn ms(text: &str) -> i64 {
        at(text).timestamp_millis()
    }

    #[test]
    fn the_last_instants_up_to_now_oldest_first() {
        let j = job("every = \"1m\"");
        let got = last_instants(&j, at("2026-01-01T01:00:30Z"), 3);
        let want = [
            "2026-01-01T00:58:00Z",
            "2026-01-01T00:59:00Z",
            "2026-01-01T01:00:00Z",
        ];
        assert_eq!(got, want.map(at));
        let daily = job("cron = \"0 3 * * *\"");
        let got = last_instants(&daily, at("2026-01-20T12:00:00Z"), 12);
        assert_eq!((got.len(), got[0]), (12, at("2026-01-09T03:00:00Z")));
    }

    #[test]
    fn a_full_read_covers_from_its_oldest_entry_a_short_one_from_the_retention() {
        let now = at("2026-01-10T00:00:00Z");
        let journal = JournalConfig::default();
        let old = vec![entry(ms("2026-01-09T23:00:00Z"), "claim", "j@x", 0, "a")];
        let hour_later = at("2026-01-09T23:01:00Z");
        assert_eq!(covered_from(&old, 1, &journal, now), hour_later);
        let week_ago = at("2026-01-03T00:01:00Z");
        assert_eq!(covered_from(&old, 5, &journal, now), week_ago);
        assert_eq!(covered_from(&[], 5, &journal, now), week_ago);
        let capped = JournalConfig {
            max_len: 1,
            ..journal
        };
        assert_eq!(covered_from(&old, 5, &capped, now), hour_later);
    }

    /// A strip of a minute job: ran, dead, pending after the progress, and unknown before
    /// what the read covers (never missed, though the beat decided it).
    #[test]
    fn classes_from_the_audit_and_unknown_where_the_read_does_not_reach() {
        let j = job("every = \"1m\"");
        let key = |t: &str| instance_key(&j.name, at(t));
        let (k1, k2, k3) = (
            key("2026-01-01T00:09:00Z"),
            key("2026-01-01T00:10:00Z"),
            key("2026-01-01T00:11:00Z"),
        );
        let entries = vec![
            entry(ms("2026-01-01T00:09:00.020Z"), "claim", &k1, 0, "a"),
            entry(ms("2026-01-01T00:09:00.500Z"), "success", &k1, 0, "a"),
            entry(ms("2026-01-01T00:10:00.010Z"), "claim", &k2, 0, "b"),
            entry(ms("2026-01-01T00:10:00.900Z"), "dead", &k2, 0, "b"),
            entry(ms("2026-01-01T00:11:00.010Z"), "published", &k3, 0, ""),
        ];
        let now = at("2026-01-01T00:12:30Z");
        let marks = |asked: usize| -> Vec<&str> {
            let recent = Recent::new(entries.clone(), asked, &JournalConfig::default(), now);
            let cells = recent.strip(&j, Some(at("2026-01-01T00:11:00Z")), now);
            assert_eq!((cells.len(), &cells[8].key), (INSTANTS, &k1));
            cells.iter().map(|c| c.mark.css()).collect()
        };
        // Asked 10, read 5: the whole stream, covered back to the retention. 00:11 published,
        // 00:12 not decided yet: both pending. Before the journal names the job: unknown.
        let short = marks(10);
        assert_eq!(
            &short[8..],
            ["ran", "dead", "pending", "pending"],
            "{short:?}"
        );
        assert!(short[..8].iter().all(|m| *m == "unknown"), "{short:?}");
        // Asked 5, read 5: covered from 00:09:00.020 plus the slack, so 00:09 and 00:10 are
        // unknown though their entries were read (older ones of theirs might not be).
        let full = marks(5);
        assert_eq!(
            &full[8..],
            ["unknown", "unknown", "pending", "pending"],
            "{full:?}"
        );
    }

    /// Read full (the 2 newest entries), the journal is covered from 00:06:00.5 on: 00:06,
    /// decided and with no entry, is unknown; read short (the whole stream), it is missed,
    /// the audit's own verdict.
    #[test]
    fn a_decided_instant_older_than_a_full_read_is_unknown_not_missed() {
        let j = job("every = \"1m\"");
        let key = |t: &str| instance_key(&j.name, at(t));
        let entries = vec![
            entry(
                ms("2026-01-01T00:05:00.500Z"),
                "success",
                &key("2026-01-01T00:05:00Z"),
                0,
                "a",
            ),
            entry(
                ms("2026-01-01T00:10:00.010Z"),
                "published",
                &key("2026-01-01T00:10:00Z"),
                0,
                "",
            ),
        ];
        let now = at("2026-01-01T00:10:30Z");
        let mark_of = |asked: usize, t: &str| {
            let recent = Recent::new(entries.clone(), asked, &JournalConfig::default(), now);
            let cells = recent.strip(&j, Some(at("2026-01-01T00:10:00Z")), now);
            cells.iter().find(|c| c.key == key(t)).expect("a cell").mark
        };
        assert_eq!(mark_of(2, "2026-01-01T00:06:00Z"), Mark::Unknown);
        assert_eq!(
            mark_of(2, "2026-01-01T00:07:00Z"),
            Mark::Known(Class::Missed)
        );
        assert_eq!(
            mark_of(2, "2026-01-01T00:10:00Z"),
            Mark::Known(Class::Pending)
        );
        assert_eq!(
            mark_of(5, "2026-01-01T00:06:00Z"),
            Mark::Known(Class::Missed)
        );
        assert_eq!(mark_of(5, "2026-01-01T00:05:00Z"), Mark::Known(Class::Ran));
    }

    #[test]
    fn cells_link_to_their_key_escaped() {
        let cells = [Cell {
            instant: at("2026-01-01T00:10:00Z"),
            key: "a b<\"&@2026-01-01T00:10:00Z".into(),
            mark: Mark::Known(Class::Dead),
        }];
        let html = render(&cells, crate::page::escape);
        assert_eq!(
            html,
            "<span class=\"strip\"><a class=\"cell dead\" \
             href=\"/keys/a%20b%3C%22%26@2026-01-01T00:10:00Z\" \
             title=\"2026-01-01T00:10:00Z dead\"></a></span>"
        );
        assert!(legend().contains("<span class=\"cell unknown\"></span> unknown"));
    }
}
