//! Concurrency groups and rate limits across workers (docs/design.md#limits), end to end: three
//! real workers share one `[limits.NAME]`; what is measured are the tasks' own start and end
//! stamps, written to an effects file. See: issues/21.

use drumline_e2e::cfg::{shell, Cfg};
use drumline_e2e::scenario::{journal, JournalEntry, Scenario};
use drumline_e2e::{counts, wait_until, TestEnv, AMQP_URL};
use drumline_shared::client::{Message, Producer};
use drumline_shared::limit::most_in_window;
use std::collections::BTreeMap;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// A config whose task `t` runs the script `script(env)` under `[limits.grp]` with `limit`
/// keys; lease `lease`.
fn config(
    limit: &[(&str, &str)],
    lease: &str,
    script: impl FnOnce(&TestEnv) -> String,
) -> impl FnOnce(&TestEnv) -> Cfg {
    let limit: Vec<(String, String)> = limit
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let lease = format!("\"{lease}\"");
    move |env| {
        let cfg = Cfg::new()
            .set("worker", "concurrency", "4")
            .set("worker", "lease", &lease);
        let cfg = limit
            .iter()
            .fold(cfg, |cfg, (k, v)| cfg.set("limits.grp", k, v));
        cfg.task("t", shell(&script(env)).with("limit", "\"grp\""))
    }
}

/// Publishes ad-hoc task `t` with keys `{prefix}-{i}` for `i` in `0..n`.
async fn publish(env: &TestEnv, prefix: &str, n: usize) {
    let producer = Producer::connect(AMQP_URL, &env.ns).await.unwrap();
    for i in 0..n {
        let message = Message::new("t").key(format!("{prefix}-{i}"));
        producer.publish(&message).await.unwrap();
    }
    producer.close().await;
}

/// Lines `start|end KEY ATTEMPT NS` of the effects file `spans`: per key, its starts and ends.
fn spans(env: &TestEnv) -> BTreeMap<String, (Vec<u128>, Vec<u128>)> {
    let mut out: BTreeMap<String, (Vec<u128>, Vec<u128>)> = BTreeMap::new();
    for line in env.lines("spans") {
        let parts: Vec<&str> = line.split(' ').collect();
        let at: u128 = parts[3].parse().unwrap();
        assert_eq!(parts[2], "0", "a wait must not be an attempt: {line}");
        let entry = out.entry(parts[1].to_owned()).or_default();
        match parts[0] {
            "start" => entry.0.push(at),
            _ => entry.1.push(at),
        }
    }
    out
}

/// The script writing `start` and `end` lines around `middle`.
fn spanning(env: &TestEnv, middle: &str) -> String {
    let log = env.path("spans").display().to_string();
    format!(
        "echo \"start $DRUMLINE_KEY $DRUMLINE_ATTEMPT $(date +%s%N)\" >> {log}; {middle}; \
         echo \"end $DRUMLINE_KEY $DRUMLINE_ATTEMPT $(date +%s%N)\" >> {log}"
    )
}

/// The most runs that were in progress at once, from (start, end) stamps.
fn most_at_once(spans: &BTreeMap<String, (Vec<u128>, Vec<u128>)>) -> usize {
    let mut edges: Vec<(u128, i32)> = Vec::new();
    for (starts, ends) in spans.values() {
        edges.extend(starts.iter().map(|s| (*s, 1)));
        edges.extend(ends.iter().map(|e| (*e, -1)));
    }
    // An end and a start at the same nanosecond: the end first.
    edges.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, step) in edges {
        now += step;
        most = most.max(now);
    }
    most as usize
}

#[tokio::test(flavor = "multi_thread")]
async fn a_group_of_two_never_runs_three_at_once_across_three_workers() {
    let cfg = config(&[("concurrency", "2")], "3s", |env| {
        spanning(env, "sleep 0.3")
    });
    let sc = Scenario::start("e2e_limit_group", 0, 3, cfg).await;
    let n = 24;
    publish(&sc, "g", n).await;
    let ended = || spans(&sc).values().filter(|(_, e)| !e.is_empty()).count() == n;
    sc.wait(WAIT, "not all ended", ended);
    let spans = spans(&sc);
    for (key, (starts, ends)) in &spans {
        assert_eq!(
            (starts.len(), ends.len()),
            (1, 1),
            "{key} ran once: {spans:?}"
        );
    }
    let most = most_at_once(&spans);
    assert!(most <= 2, "{most} runs of a group of 2 at once: {spans:?}");
    assert_eq!(most, 2, "the group's two slots were used together");
    eprintln!("24 runs of 0.3 s, at most {most} at once across three workers");
}

/// `spans` holds `n` keys, each of whose runs ended.
fn all_ended(spans: &BTreeMap<String, (Vec<u128>, Vec<u128>)>, n: usize) -> bool {
    spans.len() == n && spans.values().all(|(_, ends)| !ends.is_empty())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_workers_slot_frees_within_its_lease() {
    // The first run of `stuck` holds the group's only slot for a long time; every other run,
    // its takeover included, is short.
    let cfg = config(&[("concurrency", "1")], "2s", |env| {
        let marker = env.path("marker").display().to_string();
        let middle = format!(
            "if [ \"$DRUMLINE_KEY\" = stuck ] && [ ! -e {marker} ]; then touch {marker}; sleep 60; fi"
        );
        spanning(env, &middle)
    });
    // The holder is the first worker; three others come once it holds the slot.
    let mut sc = Scenario::start("e2e_limit_killed", 0, 1, cfg).await;
    let producer = Producer::connect(AMQP_URL, &sc.ns).await.unwrap();
    producer
        .publish(&Message::new("t").key("stuck"))
        .await
        .unwrap();
    let started = || spans(&sc).contains_key("stuck");
    sc.wait(WAIT, "stuck never started", started);
    sc.start_workers(3).await;
    publish(&sc, "after", 3).await;
    // Taken off the queue by the workers and held, waiting for the slot the holder has.
    sc.wait_drained("default").await;
    sc.workers[0].kill9();
    let killed_at = now_ns();
    let all_done = wait_until(WAIT, || all_ended(&spans(&sc), 4));
    sc.check(all_done, format!("{:?}", spans(&sc)));
    let spans = spans(&sc);
    let first_after = (0..3).map(|i| spans[&format!("after-{i}")].0[0]).min();
    let first_after = first_after.expect("three runs after");
    assert!(
        first_after > killed_at,
        "a run started while the slot was held"
    );
    let waited = Duration::from_nanos((first_after - killed_at) as u64);
    // The contract: a waiting run starts within lease + 5 s of the dead holder's slot lapsing.
    let what = format!("the first waiting run started {waited:?} after the kill");
    assert!(waited < Duration::from_secs(2 + 5), "{what}");
    for i in 0..3 {
        let (starts, ends) = &spans[&format!("after-{i}")];
        assert_eq!((starts.len(), ends.len()), (1, 1), "{spans:?}");
    }
    eprintln!("the first waiting run started {waited:?} after the holder was killed (lease 2 s)");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rate_of_ten_a_second_holds_in_every_window_across_three_workers() {
    let cfg = config(&[("rate", "\"10/s\"")], "5s", |env| {
        let log = env.path("starts").display().to_string();
        format!("echo \"$DRUMLINE_KEY $(date +%s%N)\" >> {log}")
    });
    let sc = Scenario::start("e2e_limit_rate", 0, 3, cfg).await;
    let n = 300;
    publish(&sc, "r", n).await;
    let ran = |lines: &[String]| {
        let keys: Vec<String> = lines
            .iter()
            .map(|l| l.split(' ').next().unwrap().to_owned())
            .collect();
        counts(&keys)
    };
    let finished = || ran(&sc.lines("starts")).len() >= n;
    sc.wait(Duration::from_secs(120), "not all ran", finished);
    let lines = sc.lines("starts");
    let keys = ran(&lines);
    assert_eq!(keys.len(), n, "every key ran");
    // Each key succeeded once. A key may run a second time only as the promise allows: the
    // repeat of an attempt whose lease lapsed (a starved worker), journaled as a takeover.
    let twice: Vec<&String> = keys
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(k, _)| k)
        .collect();
    let journal = journal(&sc).await;
    let events = |key: &str, ev: &str| {
        journal
            .iter()
            .filter(|(_, f)| f["key"] == key && f["ev"] == ev)
            .count()
    };
    for key in keys.keys() {
        assert_eq!(events(key, "success"), 1, "{key}: {journal:#?}");
    }
    for key in &twice {
        assert!(
            events(key, "takeover") >= 1,
            "{key} ran twice: {journal:#?}"
        );
    }
    let stamps: Vec<u64> = lines
        .iter()
        .map(|l| (l.split(' ').nth(1).unwrap().parse::<u128>().unwrap() / 1_000_000) as u64)
        .collect();
    // A start is a granted claim: the journal stamps each with Redis `TIME`, the clock the
    // limit is judged on (docs/design.md#limits). The tasks' own stamps add the spawn's lag,
    // which a loaded machine stretches unevenly; they are reported, not asserted.
    let claims = claim_stamps(&journal);
    assert_eq!(claims.len(), n + twice.len(), "one granted claim per run");
    let most = most_in_window(&claims, 1000);
    let span = claims.iter().max().unwrap() - claims.iter().min().unwrap();
    assert!(
        span >= 29_000,
        "{n} starts at 10/s take 30 s, not {span} ms"
    );
    let mut sorted = claims.clone();
    sorted.sort_unstable();
    let offsets: Vec<u64> = sorted.iter().map(|s| s - sorted[0]).collect();
    assert!(most <= 10, "{most} starts in one 1 s window: {offsets:?}");
    eprintln!(
        "{n} starts over {span} ms, at most {most} in any 1 s window (the tasks' own stamps: {})",
        most_in_window(&stamps, 1000)
    );
}

/// The Redis `TIME` (ms) of every granted claim (a takeover too) in `journal`.
fn claim_stamps(journal: &[JournalEntry]) -> Vec<u64> {
    let granted = |(_, f): &&JournalEntry| {
        matches!(f.get("ev").map(String::as_str), Some("claim" | "takeover"))
    };
    let stamp = |(id, _): &JournalEntry| id.split('-').next().unwrap().parse().unwrap();
    journal.iter().filter(granted).map(stamp).collect()
}

fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}
