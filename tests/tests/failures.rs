//! Failure paths of the worker, end to end: retries through delay queues, exhaustion and
//! permanent failures to `{ns}.dead`, expired and oversize messages, timeouts that kill the
//! task's whole process group.

use chrono::Utc;
use drumline_e2e::{adhoc, setup, toml_string, wait_until, wait_until_async, TestEnv};
use drumline_shared::broker::{header_int, header_str};
use lapin::options::{BasicAckOptions, BasicGetOptions};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// Config with tasks whose shell scripts log `KEY ATTEMPT` to `runs` and then behave per task.
fn config(env: &TestEnv) -> std::path::PathBuf {
    let runs = env.path("runs");
    let log = format!(
        "echo \"$DRUMLINE_KEY $DRUMLINE_ATTEMPT\" >> {}",
        runs.display()
    );
    let task = |name: &str, tail: &str, extra: &str| {
        format!(
            "[tasks.{name}]\ncommand = [\"/bin/sh\", \"-c\", {}]\nretry_base = \"200ms\"\nretry_max = \"1s\"\n{extra}\n",
            toml_string(&format!("{log}; {tail}"))
        )
    };
    let pids = env.path("pids");
    env.config(
        "drumline.toml",
        &format!(
            "[worker]\nconcurrency = 4\nlease = \"3s\"\nmax_message_bytes = 4096\n\n{}{}{}{}",
            task(
                "flaky",
                "[ \"$DRUMLINE_ATTEMPT\" -ge 2 ]",
                "max_retries = 5"
            ),
            task("broken", "exit 1", "max_retries = 1"),
            task("refuses", "exit 3", "permanent_exit_codes = [3]"),
            task(
                "hangs",
                &format!("sleep 30 & echo $! >> {}; wait", pids.display()),
                "timeout = \"1s\"\nmax_retries = 0"
            ),
        ),
    )
}

async fn dead_letters(env: &TestEnv) -> Vec<(String, String, i64, String)> {
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    let dead = env.names().dead();
    while let Some(msg) = ch
        .basic_get(dead.as_str().into(), BasicGetOptions::default())
        .await
        .unwrap()
    {
        let h = msg.delivery.properties.headers().clone();
        let key = msg
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|m| m.to_string())
            .unwrap_or_default();
        out.push((
            key,
            header_str(h.as_ref(), "x-drumline-reason").unwrap(),
            header_int(h.as_ref(), "x-drumline-attempts").unwrap(),
            header_str(h.as_ref(), "x-drumline-error").unwrap(),
        ));
        msg.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    let _ = conn.close(200, "bye".into()).await;
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn retries_exhaustion_permanent_failures_expiry_and_size() {
    let env = setup("e2e_failures");
    let cfg = config(&env);
    let mut worker = env.worker("worker", &["--config", cfg.to_str().unwrap()]);
    let dead = env.names().dead();
    env.wait_for_topology(&worker).await;

    env.publish(&adhoc("k-flaky", "flaky")).await;
    env.publish(&adhoc("k-broken", "broken")).await;
    env.publish(&adhoc("k-refuses", "refuses")).await;
    env.publish(&adhoc("k-hangs", "hangs")).await;
    let mut expired = adhoc("k-expired", "flaky");
    expired.expires_at = Some(Utc::now() - chrono::Duration::seconds(1));
    // Published without an AMQP expiration, so it reaches the worker, which must refuse to run it.
    env.publish_raw("default", &expired.encode(), Default::default())
        .await;
    let mut big = adhoc("k-big", "flaky");
    big.args = serde_json::json!({ "blob": "x".repeat(5000) });
    env.publish(&big).await;

    assert!(
        wait_until_async(WAIT, || async { env.queue_len(&dead).await == Some(5) }).await,
        "dead letters: {:?}\n{}",
        env.queue_len(&dead).await,
        worker.log_tail(40)
    );
    assert!(
        wait_until_async(WAIT, || async {
            env.run_state("k-flaky").await.as_deref() == Some("done")
        })
        .await
    );

    let letters = dead_letters(&env).await;
    let summary: Vec<(&str, &str, i64)> = letters
        .iter()
        .map(|(k, r, a, _)| (k.as_str(), r.as_str(), *a))
        .collect();
    assert_eq!(
        summary,
        vec![
            ("k-big", "oversize", 0),
            ("k-broken", "retries_exhausted", 2),
            ("k-expired", "expired", 0),
            ("k-hangs", "retries_exhausted", 1),
            ("k-refuses", "permanent", 1),
        ]
    );
    let hang_error = &letters.iter().find(|l| l.0 == "k-hangs").unwrap().3;
    assert!(hang_error.contains("timed out"), "{hang_error}");
    assert_eq!(
        letters.iter().find(|l| l.0 == "k-refuses").unwrap().3,
        "exit code 3"
    );

    let mut runs = env.lines("runs");
    runs.sort();
    assert_eq!(
        runs,
        vec![
            "k-broken 0",
            "k-broken 1", // max_retries = 1: two runs
            "k-flaky 0",
            "k-flaky 1",
            "k-flaky 2", // succeeded on the third
            "k-hangs 0",
            "k-refuses 0", // permanent: never retried
        ]
    );
    // The dead letter is confirmed before the run state is marked: wait for the mark.
    for key in ["k-broken", "k-refuses"] {
        let marked = wait_until_async(WAIT, || async {
            env.run_state(key).await.as_deref() == Some("dead")
        })
        .await;
        assert!(marked, "{key}: {:?}", env.run_state(key).await);
    }
    assert_eq!(env.run_state("k-expired").await, None, "never claimed");

    // The timed-out task's whole process group was killed, background child included.
    let sleeper: i32 = env.lines("pids")[0].parse().unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || !std::path::Path::new(&format!(
            "/proc/{sleeper}"
        ))
        .exists()),
        "the timed-out task's child {sleeper} survived"
    );

    assert!(worker.terminate(Duration::from_secs(20)).success());
    assert_eq!(
        env.queue_len(&env.names().work_queue("default")).await,
        Some(0)
    );
}

/// A failing shell task's stderr is readable where people look: its dead letter's
/// `x-drumline-error` (bounded, the end of stderr kept) and `status`; and with `--log-format
/// json` its output lines are JSON events carrying key, task and stream.
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_tasks_stderr_reaches_its_dead_letter_and_status() {
    use drumline_e2e::cfg::{cron, shell, Cfg};
    let env = setup("e2e_failures_stderr");
    // 8 KiB of noise on stderr, then the line that explains the failure.
    let script = "echo 'hello out'; i=0; while [ $i -lt 100 ]; do \
                  echo \"noise $i $(printf '%070d' 0)\" >&2; i=$((i+1)); done; \
                  echo 'ledger refused: account 42 is closed' >&2; exit 1";
    let cfg = env.write_config(
        "drumline.toml",
        &Cfg::new()
            .task("noisy", shell(script).with("max_retries", "0"))
            .job("noisy", cron("0 0 1 1 *")),
    );
    let cfg = cfg.to_str().unwrap();
    let worker = env.worker("worker", &["--config", cfg, "--log-format", "json"]);
    env.wait_for_topology(&worker).await;
    let (status, _, stderr) = env.run("drumline-beat", &["--config", cfg, "trigger", "noisy"]);
    assert!(status.success(), "{stderr}");
    let dead = env.names().dead();
    assert!(
        wait_until_async(WAIT, || async { env.queue_len(&dead).await == Some(1) }).await,
        "{}",
        worker.log_tail(20)
    );
    let letters = dead_letters(&env).await;
    let (key, reason, _, error) = &letters[0];
    assert_eq!(reason, "retries_exhausted");
    assert!(error.starts_with("exit code 1: stderr: "), "{error}");
    assert!(
        error
            .trim_end()
            .ends_with("ledger refused: account 42 is closed"),
        "{error}"
    );
    assert!(error.len() <= 4096, "{} bytes", error.len());
    assert!(
        !error.contains("noise 0 "),
        "the start of stderr is dropped, not its end"
    );

    let (status, stdout, stderr) = env.run("drumline-beat", &["--config", cfg, "status", "--json"]);
    assert!(status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let last_error = report["jobs"][0]["last_error"].as_str().unwrap_or_default();
    assert_eq!(last_error, error, "{report:#}");

    // The task's output lines are JSON events of the worker's log, with their fields.
    let said = |stream: &str, line: &str| {
        worker
            .log()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .any(|e| {
                let f = &e["fields"];
                f["stream"] == stream
                    && f["line"] == line
                    && f["key"] == key.as_str()
                    && f["task"] == "noisy"
            })
    };
    assert!(
        wait_until(WAIT, || said("stdout", "hello out")),
        "{}",
        worker.log_tail(5)
    );
    assert!(said("stderr", "ledger refused: account 42 is closed"));
}
