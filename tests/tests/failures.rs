//! Failure paths of the worker, end to end: retries through delay queues, exhaustion and
//! permanent failures to `{ns}.dead`, expired and oversize messages, timeouts that kill the
//! task's whole process group.

use chrono::Utc;
use drumline_e2e::cfg::{cron, shell, Cfg};
use drumline_e2e::scenario::{take_dead_letters, Scenario};
use drumline_e2e::{adhoc, wait_until_async, TestEnv};
use drumline_shared::broker::{header_int, header_str};
use serde_json::Value;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// Tasks whose shell scripts log `KEY ATTEMPT` to `runs` and then behave per task.
fn config(env: &TestEnv) -> Cfg {
    let runs = env.path("runs").display().to_string();
    let task = |tail: &str| {
        shell(&format!(
            "echo \"$DRUMLINE_KEY $DRUMLINE_ATTEMPT\" >> {runs}; {tail}"
        ))
        .with("retry_base", "\"200ms\"")
        .with("retry_max", "\"1s\"")
    };
    let pids = env.path("pids").display().to_string();
    Cfg::new()
        .worker_slots(4, "3s")
        .set("worker", "max_message_bytes", "4096")
        .task(
            "flaky",
            task("[ \"$DRUMLINE_ATTEMPT\" -ge 2 ]").with("max_retries", "5"),
        )
        .task("broken", task("exit 1").with("max_retries", "1"))
        .task(
            "refuses",
            task("exit 3").with("permanent_exit_codes", "[3]"),
        )
        .task(
            "hangs",
            task(&format!("sleep 30 & echo $! >> {pids}; wait"))
                .with("timeout", "\"1s\"")
                .with("max_retries", "0"),
        )
}

/// (key, reason, attempts, error) of every dead letter, taken off `{ns}.dead`, sorted.
async fn dead_letters(env: &TestEnv) -> Vec<(String, String, i64, String)> {
    let letter = |props: &lapin::BasicProperties| {
        let h = props.headers().clone();
        let key = props.message_id().as_ref().map(|m| m.to_string());
        (
            key.unwrap_or_default(),
            header_str(h.as_ref(), "x-drumline-reason").unwrap(),
            header_int(h.as_ref(), "x-drumline-attempts").unwrap(),
            header_str(h.as_ref(), "x-drumline-error").unwrap(),
        )
    };
    let letters = take_dead_letters(env).await;
    let mut out: Vec<_> = letters
        .iter()
        .map(|l| letter(&l.delivery.properties))
        .collect();
    out.sort();
    out
}

/// Waits until `{ns}.dead` holds `n` letters.
async fn wait_dead(sc: &Scenario, n: u32) {
    let dead = sc.names().dead();
    let full = || async { sc.queue_len(&dead).await == Some(n) };
    let held = wait_until_async(WAIT, full).await;
    sc.check(
        held,
        format!("dead letters: {:?}", sc.queue_len(&dead).await),
    );
}

/// The dead letters [`config`]'s tasks leave, sorted: (key, reason, attempts).
const EXPECTED_LETTERS: [(&str, &str, i64); 5] = [
    ("k-big", "oversize", 0),
    ("k-broken", "retries_exhausted", 2),
    ("k-expired", "expired", 0),
    ("k-hangs", "retries_exhausted", 1),
    ("k-refuses", "permanent", 1),
];

/// The runs of [`config`]'s tasks, sorted: `KEY ATTEMPT`.
const EXPECTED_RUNS: [&str; 7] = [
    "k-broken 0",
    "k-broken 1", // max_retries = 1: two runs
    "k-flaky 0",
    "k-flaky 1",
    "k-flaky 2", // succeeded on the third
    "k-hangs 0",
    "k-refuses 0", // permanent: never retried
];

#[tokio::test(flavor = "multi_thread")]
async fn retries_exhaustion_permanent_failures_expiry_and_size() {
    let mut sc = Scenario::start("e2e_failures", 0, 1, config).await;
    for task in ["flaky", "broken", "refuses", "hangs"] {
        sc.publish(&adhoc(&format!("k-{task}"), task)).await;
    }
    let mut expired = adhoc("k-expired", "flaky");
    expired.expires_at = Some(Utc::now() - chrono::Duration::seconds(1));
    // Published without an AMQP expiration, so it reaches the worker, which must refuse to run it.
    sc.publish_raw("default", &expired.encode(), Default::default())
        .await;
    let mut big = adhoc("k-big", "flaky");
    big.args = serde_json::json!({ "blob": "x".repeat(5000) });
    sc.publish(&big).await;
    wait_dead(&sc, 5).await;
    sc.wait_state("k-flaky", "done").await;
    let letters = dead_letters(&sc).await;
    let summary: Vec<(&str, &str, i64)> = letters
        .iter()
        .map(|(k, r, a, _)| (k.as_str(), r.as_str(), *a))
        .collect();
    assert_eq!(summary, EXPECTED_LETTERS);
    let error_of = |key: &str| letters.iter().find(|l| l.0 == key).unwrap().3.clone();
    let hung = error_of("k-hangs");
    assert!(hung.contains("timed out"), "{hung}");
    assert_eq!(error_of("k-refuses"), "exit code 3");
    let mut runs = sc.lines("runs");
    runs.sort();
    assert_eq!(runs, EXPECTED_RUNS);
    // The dead letter is confirmed before the run state is marked: wait for the mark.
    sc.wait_state("k-broken", "dead").await;
    sc.wait_state("k-refuses", "dead").await;
    assert_eq!(sc.run_state("k-expired").await, None, "never claimed");
    // The timed-out task's whole process group was killed, background child included.
    let sleeper: i32 = sc.lines("pids")[0].parse().unwrap();
    let gone = || !std::path::Path::new(&format!("/proc/{sleeper}")).exists();
    let what = format!("the timed-out task's child {sleeper} survived");
    sc.wait(Duration::from_secs(5), what, gone);
    sc.stop();
    let queue = sc.names().work_queue("default");
    assert_eq!(sc.queue_len(&queue).await, Some(0));
}

/// Task `noisy` (no retries, a job that never comes due) says `hello out`, writes 8 KiB of
/// noise on stderr, then the line that explains its failure, and exits 1.
fn noisy() -> Cfg {
    let script = "echo 'hello out'; i=0; while [ $i -lt 100 ]; do \
                  echo \"noise $i $(printf '%070d' 0)\" >&2; i=$((i+1)); done; \
                  echo 'ledger refused: account 42 is closed' >&2; exit 1";
    let noisy = shell(script).with("max_retries", "0");
    Cfg::new()
        .task("noisy", noisy)
        .job("noisy", cron("0 0 1 1 *"))
}

/// Whether the worker's JSON log `log` has an event of task `noisy`'s instance `key` that
/// says `line` on `stream`.
fn said(log: &str, key: &str, stream: &str, line: &str) -> bool {
    let mut events = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok());
    events.any(|e| {
        let f = &e["fields"];
        f["stream"] == stream && f["line"] == line && f["key"] == key && f["task"] == "noisy"
    })
}

/// A failing shell task's stderr is readable where people look: its dead letter's
/// `x-drumline-error` (bounded, the end of stderr kept) and `status`; and with `--log-format
/// json` its output lines are JSON events carrying key, task and stream.
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_tasks_stderr_reaches_its_dead_letter_and_status() {
    let mut sc = Scenario::new("e2e_failures_stderr", |_| noisy());
    sc.start_worker_with(&["--log-format", "json"]).await;
    sc.run_ok("drumline-beat", &["trigger", "noisy"]);
    wait_dead(&sc, 1).await;
    let letters = dead_letters(&sc).await;
    let (key, reason, _, error) = &letters[0];
    assert_eq!(reason, "retries_exhausted");
    assert!(error.starts_with("exit code 1: stderr: "), "{error}");
    let explained = "ledger refused: account 42 is closed";
    assert!(error.trim_end().ends_with(explained), "{error}");
    assert!(error.len() <= 4096, "{} bytes", error.len());
    let what = "the start of stderr is dropped, not its end";
    assert!(!error.contains("noise 0 "), "{what}");
    let report = sc.status_json();
    let last_error = report["jobs"][0]["last_error"].as_str().unwrap_or_default();
    assert_eq!(last_error, error, "{report:#}");
    // The task's output lines are JSON events of the worker's log, with their fields.
    let said = |stream: &str, line: &str| said(&sc.workers[0].log(), key, stream, line);
    sc.wait(WAIT, "no stdout event", || said("stdout", "hello out"));
    assert!(said("stderr", explained));
}
