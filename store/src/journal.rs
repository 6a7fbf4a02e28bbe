//! The journal `{ns}:journal` (docs/design.md#journal): a Redis stream of fate decisions. The
//! workers' scripts append to it in the same call as the state change they record (so the two
//! never disagree), the leader for what it published or dropped; `audit` and `verify` read it.
//! Each entry is a handful of short fields: `ev` (what happened), `key`, `att` (attempt), `tok`
//! (claim token), `w` (worker), and by event `f` (fence), `next` (the retry's attempt), `r`
//! (reason), `by` (the overlapping holder), `ep` (the leader's epoch: the publishing one's on a
//! claim script's entry), `to` (the last instant of a dropped range), `ago` (on an outcome, a
//! retry or a release: how many ms before the write the run ended, when the worker knew).

use super::batch::Args;
use super::leader::HELD_BY;
use super::{Store, StoreError};
use crate::config::JournalConfig;
use redis::Script;
use std::collections::HashMap;
use std::sync::LazyLock;

// JOURNAL: every script that decides an instance's fate ends its KEYS with `{ns}:journal` and
// its ARGV with the instance's key, the retention in ms and the most entries (0: journal off),
// as [`Store::journal_tail`] adds them. `jot(ev, attempt, token, worker, ...)` appends one entry
// (then the extra field/value pairs) capped by `MAXLEN ~`. The retention's `XTRIM MINID ~`
// (Redis `TIME` minus `keep`) is sent only by the first entry of a millisecond whose number is
// below 8 modulo 256 — a few times a second under load, every few hundred entries when quiet —
// because with `TIME` it costs as much as the XADD itself (docs/performance.md), and `keep` is
// days while a trim is late by less than a second of traffic.
pub(super) const JOURNAL: &str = r#"
local function jot(ev, attempt, token, worker, ...)
  local n = #ARGV
  local max = tonumber(ARGV[n])
  if max == 0 then return end
  local journal = KEYS[#KEYS]
  local id = redis.call('XADD', journal, 'MAXLEN', '~', max, '*', 'ev', ev, 'key', ARGV[n - 2],
    'att', tostring(attempt or ''), 'tok', token or '', 'w', worker or '', ...)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  if seq ~= '0' or tonumber(ms) % 256 >= 8 then return end
  local t = redis.call('TIME')
  local floor = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[n - 1])
  if floor > 0 then redis.call('XTRIM', journal, 'MINID', '~', floor) end
end
"#;

// LEADER_JOURNAL
// KEYS[1] -> {ns}:beat:leader        KEYS[2] -> {ns}:journal
// ARGV[1] -> the leader's token      ARGV[2] -> retention in ms   ARGV[3] -> most entries
// ARGV[4] -> the epoch, then per entry: ev, key, reason ('' none), to ('' none)
// Output: 1 written | 0 this beat does not lead (nothing written).
static LEADER_JOURNAL: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{HELD_BY}{}",
        r#"
if not held_by(KEYS[1], ARGV[1]) then return 0 end
for i = 5, #ARGV, 4 do
  local entry = {'XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'ev', ARGV[i], 'key', ARGV[i + 1],
    'ep', ARGV[4]}
  if ARGV[i + 2] ~= '' then entry[#entry + 1] = 'r'; entry[#entry + 1] = ARGV[i + 2] end
  if ARGV[i + 3] ~= '' then entry[#entry + 1] = 'to'; entry[#entry + 1] = ARGV[i + 3] end
  redis.call(unpack(entry))
end
local floor = now_ms() - tonumber(ARGV[2])
if floor > 0 then redis.call('XTRIM', KEYS[2], 'MINID', '~', floor) end
return 1
"#
    ))
});

/// What the leader journals about one instant (or a range of dropped ones).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderEntry {
    /// `published` or `skipped`.
    pub event: &'static str,
    /// The instance's key (a range's first).
    pub key: String,
    /// Why it was dropped (`misfire`, `paused`, `expired`, `past_grace`), empty when published.
    pub reason: &'static str,
    /// A dropped range's last instant (RFC 3339), empty for one instant.
    pub to: String,
}

/// One journal entry as read back.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct JournalEntry {
    /// The stream id (`ms-seq`, Redis `TIME`).
    pub id: String,
    /// When it was appended, ms since the epoch (the id's first part).
    pub at_ms: i64,
    /// `claim`, `takeover`, `success`, `retry`, `dead`, `duplicate`, `expired`, `skipped`,
    /// `release`, `published`.
    pub event: String,
    /// The instance's key.
    pub key: String,
    /// The attempt, when the entry has one.
    pub attempt: Option<u32>,
    /// The claim token ("" when none).
    pub token: String,
    /// The worker ("" when none).
    pub worker: String,
    /// Why (a drop's or a duplicate's reason), "" when none.
    pub reason: String,
    /// The leader's epoch: on the leader's entries, and on the claim script's the epoch of the
    /// leader that published the copy (none for epoch 0: an operator's or a producer's).
    pub epoch: Option<u64>,
    /// The fence of a claim or takeover.
    pub fence: Option<u64>,
    /// A retry's next attempt.
    pub next: Option<u32>,
    /// The last instant of a dropped range (RFC 3339), "" for one instant.
    pub to: String,
    /// On a `success`, `dead`, `retry` or `release`: how many ms before this entry the run
    /// ended (a worker stopped, or a failover, between the two makes it large).
    pub ago: Option<u64>,
}

impl JournalEntry {
    /// An entry from its id and fields (unknown fields ignored).
    pub fn from_fields(id: &str, fields: &HashMap<String, String>) -> Self {
        let text = |k: &str| fields.get(k).cloned().unwrap_or_default();
        fn number<T: std::str::FromStr>(fields: &HashMap<String, String>, k: &str) -> Option<T> {
            fields.get(k).and_then(|v| v.parse().ok())
        }
        JournalEntry {
            id: id.to_owned(),
            at_ms: id
                .split('-')
                .next()
                .and_then(|ms| ms.parse().ok())
                .unwrap_or(0),
            event: text("ev"),
            key: text("key"),
            attempt: number(fields, "att"),
            token: text("tok"),
            worker: text("w"),
            reason: text("r"),
            epoch: number(fields, "ep"),
            fence: number(fields, "f"),
            next: number(fields, "next"),
            to: text("to"),
            ago: number(fields, "ago"),
        }
    }

    /// When the run this entry ends ended, ms since the epoch: the entry's time less its
    /// [`ago`](Self::ago).
    pub fn ended_ms(&self) -> i64 {
        self.at_ms - self.ago.unwrap_or(0).min(i64::MAX as u64) as i64
    }
}

/// Entries per `XRANGE` page when reading the journal.
pub const JOURNAL_PAGE: usize = 10_000;

/// The field/value pairs of one stream entry.
type StreamEntry = (String, HashMap<String, String>);

impl Store {
    /// Journals with `journal`'s settings (the default: on, 7 days).
    pub fn with_journal(mut self, journal: JournalConfig) -> Self {
        self.journal = journal;
        self
    }

    /// [`journal_tail`](Self::journal_tail) for a holder's script (FINISH, RETRY, RELEASE):
    /// first how many ms ago the run ended ('' when unknown: see
    /// [`with_ended`](Self::with_ended)), measured now, so a write repeated after a failover
    /// counts its wait too.
    pub(super) fn holder_tail(&self, call: &mut impl Args, key: &str) {
        match self.ended {
            Some(ended) => call.arg(ended.elapsed().as_millis() as u64),
            None => call.arg(""),
        };
        self.journal_tail(call, key);
    }

    /// Ends a fate-deciding script's call with what [`JOURNAL`] reads: the journal key last
    /// among the KEYS, then the instance's key, the retention and the cap (0 when off).
    pub(super) fn journal_tail(&self, call: &mut impl Args, key: &str) {
        let max = if self.journal.enabled {
            self.journal.max_len
        } else {
            0
        };
        call.key(self.names.journal())
            .arg(key)
            .arg(self.journal.keep.as_millis() as u64)
            .arg(max);
    }

    /// Appends the leader's `entries` under `epoch`, while `token` holds the leader lease;
    /// `false` when it does not (nothing written). Nothing is sent when the journal is off.
    pub async fn journal_leader(
        &self,
        token: &str,
        epoch: u64,
        entries: &[LeaderEntry],
    ) -> Result<bool, StoreError> {
        if !self.journal.enabled || entries.is_empty() {
            return Ok(true);
        }
        let mut call = LEADER_JOURNAL.prepare_invoke();
        call.key(self.names.beat_leader())
            .key(self.names.journal())
            .arg(token)
            .arg(self.journal.keep.as_millis() as u64)
            .arg(self.journal.max_len)
            .arg(epoch);
        for e in entries {
            call.arg(e.event).arg(&e.key).arg(e.reason).arg(&e.to);
        }
        let written: i64 = call.invoke_async(&mut self.conn.clone()).await?;
        Ok(written == 1)
    }

    /// Every journal entry from `from_ms` on (ms since the epoch), oldest first, whose key
    /// `keep` accepts, read a page (`JOURNAL_PAGE` entries) at a time.
    pub async fn journal_since(
        &self,
        from_ms: i64,
        keep: impl Fn(&str) -> bool,
    ) -> Result<Vec<JournalEntry>, StoreError> {
        let mut conn = self.conn.clone();
        let mut out = Vec::new();
        let mut start = format!("{}", from_ms.max(0));
        loop {
            let page: Vec<StreamEntry> = redis::cmd("XRANGE")
                .arg(self.names.journal())
                .arg(&start)
                .arg("+")
                .arg("COUNT")
                .arg(JOURNAL_PAGE)
                .query_async(&mut conn)
                .await?;
            let full = page.len() == JOURNAL_PAGE;
            if let Some((last, _)) = page.last() {
                start = format!("({last}");
            }
            out.extend(
                page.iter()
                    .map(|(id, fields)| JournalEntry::from_fields(id, fields))
                    .filter(|e| keep(&e.key)),
            );
            if !full {
                return Ok(out);
            }
        }
    }

    /// The newest `n` journal entries (fewer when the stream holds fewer), oldest first: one
    /// `XREVRANGE {ns}:journal + - COUNT n`, never a scan: the status page's strips read it
    /// once per render (docs/design.md#bounded-work).
    pub async fn journal_newest(&self, n: usize) -> Result<Vec<JournalEntry>, StoreError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let page: Vec<StreamEntry> = redis::cmd("XREVRANGE")
            .arg(self.names.journal())
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(n)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(page
            .iter()
            .rev()
            .map(|(id, fields)| JournalEntry::from_fields(id, fields))
            .collect())
    }

    /// Every run record kept for `job` (newest first, unreadable ones left out).
    pub async fn history_all(&self, job: &str) -> Result<Vec<super::RunRecord>, StoreError> {
        let mut conn = self.conn.clone();
        let texts: Vec<String> = redis::cmd("LRANGE")
            .arg(self.names.history(job))
            .arg(0)
            .arg(-1)
            .query_async(&mut conn)
            .await?;
        Ok(texts
            .iter()
            .filter_map(|t| serde_json::from_str(t).ok())
            .collect())
    }
}
