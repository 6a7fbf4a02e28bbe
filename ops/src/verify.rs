//! `verify` (docs/design.md#audit-and-verify), the pure part: every instance and ad-hoc key the
//! journal names in the window checked against the promise — no missed instant, no second
//! success, attempts never backwards, runs within `max_retries + 1` (a takeover after a crash
//! is the allowed repeat), no two runs of a `skip`/`queue` job overlapping by more than a lease,
//! every published instance ended by its deadline (`lost`), every failed attempt's retry run
//! (`retry_dropped`), every due instant decided by a beat (`not_published`).

use crate::audit::{Class, Row};
use drumline_shared::store::JournalEntry;
use serde::Serialize;
use std::collections::BTreeMap;

/// One broken rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// The instance's (or ad-hoc task's) key.
    pub key: String,
    /// Which rule (docs/audit.md#verify): `missed`, `doubled`, `lost`, `not_published`,
    /// `retry_dropped`, `attempts_backwards`, `over_bound`, `overlap`.
    pub rule: &'static str,
    /// What shows it: journal entry ids, workers, attempts.
    pub evidence: String,
}

/// The `verify --json` document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// Start of the window (RFC 3339).
    pub since: String,
    /// Keys checked.
    pub checked: usize,
    /// True when there is no violation.
    pub holds: bool,
    /// Each violation.
    pub violations: Vec<Violation>,
}

/// The bound one key's runs are held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// The task's `max_retries`.
    pub max_retries: u32,
}

/// The entries of each key, in journal order.
pub fn by_key(entries: &[JournalEntry]) -> BTreeMap<&str, Vec<&JournalEntry>> {
    let mut out: BTreeMap<&str, Vec<&JournalEntry>> = BTreeMap::new();
    for e in entries {
        out.entry(e.key.as_str()).or_default().push(e);
    }
    out
}

fn cite(e: &JournalEntry) -> String {
    let attempt = e.attempt.map_or(String::new(), |a| format!(" attempt {a}"));
    format!(
        "{} {}{attempt} by {:?} (token {:?})",
        e.id, e.event, e.worker, e.token
    )
}

/// The rules one key's entries must keep: one success, attempts never backwards, runs within
/// the bound.
pub fn check_key(key: &str, entries: &[&JournalEntry], bound: Bound) -> Vec<Violation> {
    let mut out = Vec::new();
    let violation = |rule, evidence| Violation {
        key: key.to_owned(),
        rule,
        evidence,
    };
    let mut successes: Vec<&&JournalEntry> = Vec::new();
    for e in entries.iter().filter(|e| e.event == "success") {
        if !successes.iter().any(|s| s.token == e.token) {
            successes.push(e);
        }
    }
    if successes.len() > 1 {
        let cited: Vec<String> = successes.iter().map(|e| cite(e)).collect();
        out.push(violation("doubled", cited.join("; ")));
    }
    let runs: Vec<&&JournalEntry> = entries
        .iter()
        .filter(|e| matches!(e.event.as_str(), "claim" | "takeover"))
        .collect();
    for pair in runs.windows(2) {
        if let (Some(a), Some(b)) = (pair[0].attempt, pair[1].attempt) {
            if b < a {
                let evidence = format!("{} then {}", cite(pair[0]), cite(pair[1]));
                out.push(violation("attempts_backwards", evidence));
            }
        }
    }
    let claims = runs.iter().filter(|e| e.event == "claim").count();
    let takeovers = runs.len() - claims;
    let allowed = bound.max_retries as usize + 1;
    if claims > allowed {
        let evidence = format!(
            "{claims} runs claimed (and {takeovers} repeats after a crash), at most {allowed} \
             allowed (max_retries + 1); last: {}",
            runs.last().map(|e| cite(e)).unwrap_or_default()
        );
        out.push(violation("over_bound", evidence));
    }
    out
}

/// What Redis says of a key now, beside its journal entries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Now<'a> {
    /// Its run state (`{ns}:run:{key}` `state`), if recorded.
    pub state: Option<&'a str>,
    /// Whether a claim's lease on it is live now (a run in progress).
    pub live: bool,
}

/// The times one key's fate is judged by (ms, Redis `TIME`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// When `verify` runs.
    pub now_ms: i64,
    /// By when the instance must have ended: its expiry (from its jittered time), else its
    /// due time plus `--overdue`.
    pub end_by_ms: i64,
    /// How long a failed attempt's retry may be waited for: `--overdue` beyond the task's
    /// longest retry delay (`retry_max`, its jitter included).
    pub retry_wait_ms: i64,
}

/// Events after which an instance has ended, whatever follows.
fn ends(e: &JournalEntry) -> bool {
    matches!(e.event.as_str(), "success" | "dead" | "expired" | "skipped")
}

/// The rules of an instance's end (docs/audit.md#verify): `retry_dropped`, a failed attempt
/// below `max_retries` (the worker only hands over to a retry then) whose retry never ran and
/// that has no terminal state (skipped by a newer instance, or not claimed within
/// `--overdue`); `lost`, a published instance with no terminal state and no live claim past
/// its deadline.
pub fn check_fate(
    key: &str,
    entries: &[&JournalEntry],
    now: Now<'_>,
    deadlines: Deadlines,
) -> Option<Violation> {
    let violation = |rule, evidence| Violation {
        key: key.to_owned(),
        rule,
        evidence,
    };
    let ended_state = matches!(now.state, Some("done" | "dead" | "expired"));
    if let Some(i) = entries.iter().rposition(|e| e.event == "retry") {
        let retry = entries[i];
        let next = retry.next.unwrap_or(0);
        let after = &entries[i + 1..];
        let ran_on = after.iter().any(|e| {
            matches!(e.event.as_str(), "claim" | "takeover") && e.attempt.unwrap_or(0) >= next
        });
        let ended = after
            .iter()
            .any(|e| matches!(e.event.as_str(), "success" | "dead" | "expired"));
        if ended || ended_state || now.live {
            return None;
        }
        if !ran_on {
            if let Some(skip) = after.iter().find(|e| e.event == "skipped") {
                let evidence =
                    format!("{} then {}: the retry was skipped", cite(retry), cite(skip));
                return Some(violation("retry_dropped", evidence));
            }
            if deadlines.now_ms - retry.at_ms > deadlines.retry_wait_ms {
                let evidence = format!("{}: attempt {next} never claimed", cite(retry));
                return Some(violation("retry_dropped", evidence));
            }
            return None;
        }
        // The retry ran and has not ended: judged as any published instance below.
    }
    let published = entries.iter().find(|e| {
        matches!(
            e.event.as_str(),
            "published" | "claim" | "takeover" | "release"
        )
    })?;
    let ended = entries.iter().any(|e| ends(e)) || ended_state || now.state == Some("skipped");
    if ended || now.live || deadlines.now_ms <= deadlines.end_by_ms {
        return None;
    }
    let evidence = format!(
        "{} and no end {} ms past its deadline (state {})",
        cite(published),
        deadlines.now_ms - deadlines.end_by_ms,
        now.state.unwrap_or("none")
    );
    Some(violation("lost", evidence))
}

/// `not_published`: the first instant of a job, after its recorded progress and already due
/// (`due_ms` of it: jitter, `misfire_threshold` and 10 s of slack included), that no beat
/// decided: a dead or stuck beat.
pub fn check_published(job: &str, undecided_due: Option<&str>) -> Option<Violation> {
    let instant = undecided_due?;
    Some(Violation {
        key: format!("{job}@{instant}"),
        rule: "not_published",
        evidence: format!(
            "job {job}: instant {instant} is due and no beat published or dropped it \
             (is a beat leading?)"
        ),
    })
}

/// `order`: an `after` job's instance published by the leader (its claim carries the leader's
/// epoch) was claimed before its upstream's instance for the same instant succeeded, or its
/// upstream has entries and no success. A trigger or backfill (epoch 0) runs a follower alone;
/// an upstream with no entries in the window is not judged (docs/audit.md#verify).
pub fn check_order(
    key: &str,
    entries: &[&JournalEntry],
    upstream: &[&JournalEntry],
) -> Option<Violation> {
    let claim = entries.iter().find(|e| {
        matches!(e.event.as_str(), "claim" | "takeover") && e.epoch.is_some_and(|ep| ep > 0)
    })?;
    if upstream.is_empty() {
        return None;
    }
    let evidence = match upstream.iter().find(|e| e.event == "success") {
        Some(success) if success.at_ms <= claim.at_ms => return None,
        Some(success) => format!("{} before its upstream's {}", cite(claim), cite(success)),
        None => format!("{} and its upstream has no success", cite(claim)),
    };
    Some(Violation {
        key: key.to_owned(),
        rule: "order",
        evidence,
    })
}

/// One run: its key, start and end (ms, Redis `TIME`), its first entry's id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span<'a> {
    /// The instance.
    pub key: &'a str,
    /// When it was claimed.
    pub start: i64,
    /// When its task ended: its outcome's (or release's) entry less `ago`.
    pub end: i64,
    /// The claim's entry.
    pub id: &'a str,
}

/// The runs of a job, in start order. A run ends when its task ended: the end entry's time
/// less its `ago`; a run with no end entry (a crash, a frozen worker's refused write, or still
/// running) is counted as running until its lease deadline, `lease_ms` after its claim
/// (docs/audit.md#verify).
pub fn spans<'a>(entries: &[&'a JournalEntry], lease_ms: i64) -> Vec<Span<'a>> {
    let mut out = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        if !matches!(e.event.as_str(), "claim" | "takeover") || e.token.is_empty() {
            continue;
        }
        let end = entries[i + 1..].iter().find(|x| {
            x.token == e.token
                && x.key == e.key
                && matches!(x.event.as_str(), "success" | "retry" | "dead" | "release")
        });
        out.push(Span {
            key: &e.key,
            start: e.at_ms,
            // When the task ended, not when its outcome was written (a late write, after a
            // stop or a failover, would stretch the run).
            end: end.map_or(e.at_ms + lease_ms, |end| end.ended_ms().max(e.at_ms)),
            id: &e.id,
        });
    }
    out.sort_by_key(|s| s.start);
    out
}

/// `limit`: a moment when more runs of concurrency group `group` ran at once than its
/// `concurrency` allows, one violation per run that started beyond it. `spans` are the group's
/// runs from every job whose task is in it (an end and a start at the same ms: the end first).
pub fn check_limit(group: &str, concurrency: u32, spans: &[Span<'_>]) -> Vec<Violation> {
    let mut moments: Vec<(i64, bool, &Span<'_>)> = spans
        .iter()
        .flat_map(|s| [(s.start, true, s), (s.end, false, s)])
        .collect();
    moments.sort_by_key(|(at, starts, _)| (*at, *starts));
    let mut running = 0u32;
    let mut out = Vec::new();
    for (at, starts, span) in moments {
        if !starts {
            running = running.saturating_sub(1);
            continue;
        }
        running += 1;
        if running > concurrency {
            out.push(Violation {
                key: span.key.to_owned(),
                rule: "limit",
                evidence: format!(
                    "claimed ({}) at {at} ms while {} runs of group {group} ran (concurrency {concurrency})",
                    span.id,
                    running - 1
                ),
            });
        }
    }
    out
}

/// Two runs of different instances of a `skip`/`queue` job that overlap by more than
/// `margin_ms` (a lease: a holder cut off for longer than its lease loses the lock).
pub fn check_overlap(spans: &[Span<'_>], margin_ms: i64) -> Vec<Violation> {
    let mut out = Vec::new();
    let mut longest: Option<&Span<'_>> = None;
    for s in spans {
        if let Some(prev) = longest {
            if prev.key != s.key && prev.end - s.start > margin_ms {
                out.push(Violation {
                    key: s.key.to_owned(),
                    rule: "overlap",
                    evidence: format!(
                        "claimed ({}) {} ms before {} ended (run {}, margin {margin_ms} ms)",
                        s.id,
                        prev.end - s.start,
                        prev.key,
                        prev.id
                    ),
                });
            }
        }
        if longest.is_none_or(|p| s.end > p.end) {
            longest = Some(s);
        }
    }
    out
}

/// The audit's broken promises: a missed instant, a doubled one without journal entries (only
/// the run records say so; the journal's are reported by [`check_key`]).
pub fn from_audit(rows: &[Row], journaled: impl Fn(&str) -> bool) -> Vec<Violation> {
    rows.iter()
        .filter_map(|r| match r.class {
            Class::Missed => Some(Violation {
                key: r.key.clone(),
                rule: "missed",
                evidence: format!("{}: {}", r.instant, r.reason.clone().unwrap_or_default()),
            }),
            Class::Doubled if !journaled(&r.key) => Some(Violation {
                key: r.key.clone(),
                rule: "doubled",
                evidence: format!("run records: {}", r.reason.clone().unwrap_or_default()),
            }),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::tests::entry;

    const BOUND: Bound = Bound { max_retries: 1 };

    fn rules(v: &[Violation]) -> Vec<&'static str> {
        v.iter().map(|v| v.rule).collect()
    }

    /// A follower claimed after its upstream's success holds; one claimed before it, or whose
    /// upstream failed for good, is out of `order`; a trigger's copy (epoch 0) runs alone.
    #[test]
    fn a_follower_claimed_before_its_upstreams_success_is_out_of_order() {
        let up = [
            entry(1, "claim", "u@t", 0, "a"),
            entry(5, "success", "u@t", 0, "a"),
        ];
        let up: Vec<&JournalEntry> = up.iter().collect();
        let on_time = [entry(6, "claim", "f@t", 0, "b")];
        let on_time: Vec<&JournalEntry> = on_time.iter().collect();
        assert_eq!(check_order("f@t", &on_time, &up), None);
        let early = [entry(3, "claim", "f@t", 0, "b")];
        let early: Vec<&JournalEntry> = early.iter().collect();
        let v = check_order("f@t", &early, &up).expect("out of order");
        assert_eq!(v.rule, "order");
        assert!(v.evidence.contains("5-0 success"), "{}", v.evidence);
        let failed = [
            entry(1, "claim", "u@t", 0, "a"),
            entry(2, "dead", "u@t", 0, "a"),
        ];
        let failed: Vec<&JournalEntry> = failed.iter().collect();
        assert!(check_order("f@t", &on_time, &failed).is_some());
        let mut triggered = entry(3, "claim", "f@t", 0, "b");
        triggered.epoch = Some(0);
        assert_eq!(check_order("f@t", &[&triggered], &failed), None);
        assert_eq!(
            check_order("f@t", &early, &[]),
            None,
            "no upstream entries: not judged"
        );
    }

    #[test]
    fn a_clean_history_holds() {
        let e = [
            entry(1, "claim", "k", 0, "a"),
            entry(2, "retry", "k", 0, "a"),
            entry(3, "claim", "k", 1, "b"),
            entry(4, "takeover", "k", 1, "c"),
            entry(5, "success", "k", 1, "c"),
            entry(6, "success", "k", 1, "c"),
            entry(7, "duplicate", "k", 0, "d"),
        ];
        let refs: Vec<&JournalEntry> = e.iter().collect();
        assert!(check_key("k", &refs, BOUND).is_empty());
    }

    #[test]
    fn a_second_success_backwards_attempts_and_too_many_runs_are_reported() {
        let e = [
            entry(1, "claim", "k", 1, "a"),
            entry(2, "success", "k", 1, "a"),
            entry(3, "claim", "k", 0, "b"),
            entry(4, "claim", "k", 2, "c"),
            entry(5, "success", "k", 2, "c"),
        ];
        let refs: Vec<&JournalEntry> = e.iter().collect();
        let v = check_key("k", &refs, BOUND);
        assert_eq!(rules(&v), ["doubled", "attempts_backwards", "over_bound"]);
        assert!(
            v[0].evidence.contains("2-0 success attempt 1"),
            "{}",
            v[0].evidence
        );
        assert!(v[0].evidence.contains("5-0 success"), "{}", v[0].evidence);
    }

    #[test]
    fn runs_overlapping_beyond_the_margin_are_reported() {
        let e = [
            entry(0, "claim", "a", 0, "t1"),
            entry(1_000, "claim", "b", 0, "t2"),
            entry(5_000, "success", "b", 0, "t2"),
            entry(40_000, "success", "a", 0, "t1"),
            entry(50_000, "claim", "c", 0, "t3"),
        ];
        let refs: Vec<&JournalEntry> = e.iter().collect();
        let s = spans(&refs, 30_000);
        assert_eq!(s.len(), 3, "c has no end: counted until its lease deadline");
        assert_eq!((s[2].start, s[2].end), (50_000, 80_000));
        let v = check_overlap(&s, 30_000);
        assert_eq!(rules(&v), ["overlap"]);
        assert_eq!(v[0].key, "b");
        assert!(check_overlap(&s, 60_000).is_empty());
    }

    /// An outcome written late (the worker stopped, or Redis failed over, between the task's
    /// end and the write) carries how long before the write the task ended (`ago`): the run
    /// ends then, not at the write, so the next instance's claim in between is no overlap
    /// (the one-hour soak's false report).
    #[test]
    fn a_late_written_outcome_ends_its_run_when_the_task_ended() {
        let mut late = entry(10_000, "success", "a", 0, "t1");
        late.ago = Some(8_000);
        let e = [
            entry(0, "claim", "a", 0, "t1"),
            entry(3_000, "claim", "b", 0, "t2"),
            late,
            entry(12_000, "success", "b", 0, "t2"),
        ];
        let refs: Vec<&JournalEntry> = e.iter().collect();
        let s = spans(&refs, 30_000);
        assert_eq!((s[0].start, s[0].end), (0, 2_000));
        assert!(check_overlap(&s, 500).is_empty());
        // Without it, the write's time: the runs overlap by 7 s.
        let mut unknown = e.clone();
        unknown[2].ago = None;
        let refs: Vec<&JournalEntry> = unknown.iter().collect();
        assert_eq!(
            rules(&check_overlap(&spans(&refs, 30_000), 500)),
            ["overlap"]
        );
    }

    const MIN: i64 = 60_000;

    fn fate(entries: &[JournalEntry], now: Now<'_>, now_ms: i64) -> Vec<&'static str> {
        let refs: Vec<&JournalEntry> = entries.iter().collect();
        let deadlines = Deadlines {
            now_ms,
            end_by_ms: 10 * MIN,
            retry_wait_ms: 15 * MIN,
        };
        check_fate("k", &refs, now, deadlines)
            .map(|v| v.rule)
            .into_iter()
            .collect()
    }

    fn retry(at_ms: i64, next: u32) -> JournalEntry {
        let mut e = entry(at_ms, "retry", "k", next - 1, "a");
        e.next = Some(next);
        e
    }

    /// Issue 33: a retry the claim turned into an overlap skip, and a retry never claimed.
    #[test]
    fn a_retry_skipped_or_never_run_is_dropped() {
        let skipped = [
            entry(0, "claim", "k", 0, "a"),
            retry(1_000, 1),
            entry(2_000, "skipped", "k", 1, "b"),
        ];
        assert_eq!(fate(&skipped, Now::default(), 3_000), ["retry_dropped"]);
        let waiting = [entry(0, "claim", "k", 0, "a"), retry(1_000, 1)];
        let retrying = Now {
            state: Some("retrying"),
            live: false,
        };
        assert!(
            fate(&waiting, retrying, 10 * MIN).is_empty(),
            "within --overdue"
        );
        assert_eq!(fate(&waiting, retrying, 20 * MIN), ["retry_dropped"]);
        // The retry ran, and ended or runs: nothing dropped.
        let mut ran = waiting.to_vec();
        ran.push(entry(2_000, "claim", "k", 1, "b"));
        let running = Now {
            state: Some("running"),
            live: true,
        };
        assert!(fate(&ran, running, 20 * MIN).is_empty());
        // ... and whose run was lost (its worker killed, the requeued copy gone): lost.
        let lapsed = Now {
            state: Some("running"),
            live: false,
        };
        assert_eq!(fate(&ran, lapsed, 20 * MIN), ["lost"]);
        ran.push(entry(3_000, "dead", "k", 1, "b"));
        assert!(fate(&ran, Now::default(), 20 * MIN).is_empty());
    }

    /// Issue 33: published and never ended, past its deadline, with no live claim.
    #[test]
    fn a_published_instance_without_an_end_past_its_deadline_is_lost() {
        let published = [entry(0, "published", "k", 0, "")];
        assert!(
            fate(&published, Now::default(), 10 * MIN).is_empty(),
            "not yet"
        );
        assert_eq!(fate(&published, Now::default(), 11 * MIN), ["lost"]);
        let mut claimed = published.to_vec();
        claimed.push(entry(1_000, "claim", "k", 0, "a"));
        let live = Now {
            state: Some("running"),
            live: true,
        };
        assert!(fate(&claimed, live, 11 * MIN).is_empty(), "a live run");
        let lapsed = Now {
            state: Some("running"),
            live: false,
        };
        assert_eq!(fate(&claimed, lapsed, 11 * MIN), ["lost"]);
        // Any end is an end: expired (the broker's or the claim's), skipped, dead, done.
        for end in ["expired", "skipped", "dead", "success"] {
            let mut ended = published.to_vec();
            ended.push(entry(2_000, end, "k", 0, ""));
            assert!(fate(&ended, Now::default(), 11 * MIN).is_empty(), "{end}");
        }
        let done = Now {
            state: Some("done"),
            live: false,
        };
        assert!(fate(&published, done, 11 * MIN).is_empty());
        // Never published (a duplicate copy's entry alone): nothing to lose.
        let dup = [entry(0, "duplicate", "k", 0, "a")];
        assert!(fate(&dup, Now::default(), 11 * MIN).is_empty());
    }

    #[test]
    fn an_undecided_due_instant_is_not_published() {
        assert!(check_published("j", None).is_none());
        let v = check_published("j", Some("2026-01-01T00:00:00Z")).unwrap();
        assert_eq!(
            (v.rule, v.key.as_str()),
            ("not_published", "j@2026-01-01T00:00:00Z")
        );
    }

    /// Issue 33: a concurrency group of one, a frozen worker's run with no end entry (its
    /// write refused) and another worker's run of the group inside its lease: reported.
    #[test]
    fn runs_of_a_group_beyond_its_concurrency_are_reported_endless_ones_until_their_lease() {
        let e = [
            entry(0, "claim", "a", 0, "t1"),
            entry(2_000, "claim", "b", 0, "t2"),
            entry(4_000, "success", "b", 0, "t2"),
            entry(5_000, "claim", "c", 0, "t3"),
            entry(6_000, "success", "c", 0, "t3"),
        ];
        let refs: Vec<&JournalEntry> = e.iter().collect();
        let v = check_limit("g", 1, &spans(&refs, 3_000));
        assert_eq!(rules(&v), ["limit"]);
        assert_eq!(v[0].key, "b");
        assert!(check_limit("g", 2, &spans(&refs, 3_000)).is_empty());
        // One run ending as the next starts is no overlap.
        let back_to_back = [
            entry(0, "claim", "a", 0, "t1"),
            entry(1_000, "success", "a", 0, "t1"),
            entry(1_000, "claim", "b", 0, "t2"),
            entry(2_000, "success", "b", 0, "t2"),
        ];
        let refs: Vec<&JournalEntry> = back_to_back.iter().collect();
        assert!(check_limit("g", 1, &spans(&refs, 3_000)).is_empty());
    }

    #[test]
    fn missed_rows_become_violations() {
        let row = |class, key: &str| Row {
            instant: "2026-01-01T00:00:00Z".into(),
            key: key.into(),
            class,
            attempts: None,
            lateness_ms: None,
            duration_ms: None,
            reason: Some("why".into()),
            worker: None,
        };
        let rows = [
            row(Class::Ran, "a"),
            row(Class::Missed, "b"),
            row(Class::Doubled, "c"),
        ];
        assert_eq!(rules(&from_audit(&rows, |_| true)), ["missed"]);
        assert_eq!(rules(&from_audit(&rows, |_| false)), ["missed", "doubled"]);
    }
}
