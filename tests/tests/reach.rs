//! A new user's first steps with the `drumline` command: what its output does when read by a
//! pipe that closes early.

use drumline_e2e::binary;
use std::process::{Command, Stdio};

/// `drumline completions bash | head -1`: the reader goes away after the first line; the
/// command stops quietly (exit 0, no panic) instead of exit 101.
#[test]
fn completions_into_a_closed_pipe_exit_quietly() {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let out = Command::new(binary("drumline"))
        .args(["completions", "bash"])
        .stdout(Stdio::from(writer))
        .stderr(Stdio::piped())
        .output()
        .expect("drumline runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A cron job that has not fired yet shows no LAST PUBLISHED, though its first leader recorded
/// the moment it started it (that moment was shown as published).
#[tokio::test(flavor = "multi_thread")]
async fn status_of_a_cron_job_that_never_fired_shows_nothing_published() {
    use drumline_e2e::cfg::{cron, shell, Cfg};
    let env = drumline_e2e::setup("reach_never_fired");
    let cfg = Cfg::new()
        .task("nightly", shell("true"))
        .job("nightly", cron("0 3 1 1 *"));
    let path = env.write_config("drumline.toml", &cfg);
    let path = path.to_str().expect("utf-8");
    let beat = env.beat("beat", &["--config", path]);
    let progress = env.names().beat_last("nightly");
    let redis = env.redis().await;
    let started = drumline_e2e::wait_until_async(std::time::Duration::from_secs(30), || {
        let (progress, mut redis) = (progress.clone(), redis.clone());
        async move {
            let exists = redis::cmd("EXISTS")
                .arg(progress)
                .query_async(&mut redis)
                .await;
            exists.unwrap_or(false)
        }
    })
    .await;
    assert!(
        started,
        "the leader never started the job\n{}",
        beat.log_tail(20)
    );
    let (status, out, err) = env.run("drumline", &["--config", path, "status", "--json"]);
    assert!(status.success(), "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(
        report["jobs"][0]["last_published"],
        serde_json::Value::Null,
        "{out}"
    );
}

/// A shell task whose output does not end its last line does not glue the worker's next log
/// line onto it: the worker closes the line.
#[tokio::test(flavor = "multi_thread")]
async fn task_output_without_a_final_newline_is_not_glued_to_the_log() {
    use drumline_e2e::cfg::{shell, Cfg};
    let env = drumline_e2e::setup("reach_newline");
    let cfg = Cfg::new().task("partial", shell("printf 'no-newline-here' >&2"));
    let path = env.write_config("drumline.toml", &cfg);
    let worker = env.worker("worker", &["--config", path.to_str().expect("utf-8")]);
    env.wait_for_topology(&worker).await;
    env.publish(&drumline_e2e::adhoc("k1", "partial")).await;
    let done = drumline_e2e::wait_until_async(std::time::Duration::from_secs(30), || async {
        env.run_state("k1").await.as_deref() == Some("done")
    })
    .await;
    assert!(done, "the task never finished\n{}", worker.log_tail(20));
    let log = worker.log();
    let line = log
        .lines()
        .find(|l| l.contains("no-newline-here"))
        .expect("the output");
    assert_eq!(
        line,
        "no-newline-here",
        "glued to a log line:\n{}",
        worker.log_tail(20)
    );
}

/// A program embedding the worker, with a shell task in its config and no
/// `drumline-supervisor` beside it or on PATH, refuses to start and says why (instead of
/// running none of its shell tasks in silence).
#[test]
fn an_embedded_worker_without_its_supervisor_refuses_to_start() {
    use drumline_e2e::cfg::{shell, Cfg};
    let env = drumline_e2e::setup("reach_no_supervisor");
    let cfg = Cfg::new()
        .set("tasks.greet", "timeout", "\"5s\"")
        .set("tasks.deposit", "timeout", "\"5s\"")
        .task("sh", shell("true"));
    let config = env.write_config("drumline.toml", &cfg);
    let alone = env.path("typed-worker");
    std::fs::copy(binary("typed-worker"), &alone).expect("a copy");
    let out = Command::new(&alone)
        .args([config.as_os_str(), env.path("effects").as_os_str()])
        .env("PATH", "/usr/bin:/bin")
        .output()
        .expect("it runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("drumline-supervisor") && stderr.contains("missing"),
        "{stderr}"
    );
}
