//! A new user's first steps with the `drumline` command: what its output does when read by a
//! pipe that closes early.

use drumline_e2e::cfg::{cron, every, shell, Cfg};
use drumline_e2e::{adhoc, assert_contiguous_exactly_once, binary, copy_binary, setup, wait_until};
use serde_json::Value;
use std::process::{Command, Stdio};
use std::time::Duration;

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
    let env = setup("reach_never_fired");
    let cfg = Cfg::new()
        .task("nightly", shell("true"))
        .job("nightly", cron("0 3 1 1 *"));
    let scene = env.start(&cfg, 1, 0).await;
    let progress = env.names().beat_last("nightly");
    let started = || async { env.get(&progress).await.is_some() };
    scene
        .expect_async(
            Duration::from_secs(30),
            "the leader started the job",
            started,
        )
        .await;
    let report = env.status_json(&scene.config);
    assert_eq!(report["jobs"][0]["last_published"], Value::Null, "{report}");
}

/// A shell task whose output does not end its last line does not glue the worker's next log
/// line onto it: the worker closes the line.
#[tokio::test(flavor = "multi_thread")]
async fn task_output_without_a_final_newline_is_not_glued_to_the_log() {
    let env = setup("reach_newline");
    let cfg = Cfg::new().task("partial", shell("printf 'no-newline-here' >&2"));
    let scene = env.start(&cfg, 0, 1).await;
    env.publish(&adhoc("k1", "partial")).await;
    env.expect_state("k1", "done", &scene.procs()).await;
    let worker = &scene.workers[0];
    let log = worker.log();
    let line = log.lines().find(|l| l.contains("no-newline-here"));
    let glued = format!("glued to a log line:\n{}", worker.log_tail(20));
    assert_eq!(line.expect("the output"), "no-newline-here", "{glued}");
}

/// A program embedding the worker, with a shell task in its config and no
/// `drumline-supervisor` beside it or on PATH, refuses to start and says why (instead of
/// running none of its shell tasks in silence).
#[test]
fn an_embedded_worker_without_its_supervisor_refuses_to_start() {
    let env = setup("reach_no_supervisor");
    // The example's own tasks get a timeout; `sh` is the shell task that needs the supervisor.
    let timeout = |cfg: Cfg, task: &str| cfg.set(&format!("tasks.{task}"), "timeout", "\"5s\"");
    let cfg = ["greet", "deposit"].into_iter().fold(Cfg::new(), timeout);
    let config = env.config_file(&cfg.task("sh", shell("true")));
    let alone = env.path("typed-worker");
    copy_binary("typed-worker", &alone);
    let out = Command::new(&alone)
        .arg(config)
        .arg(env.path("effects"))
        .env("PATH", "/usr/bin:/bin")
        .output()
        .expect("it runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let says = stderr.contains("drumline-supervisor") && stderr.contains("missing");
    assert!(says, "{stderr}");
}

/// `drumline beat` and `drumline worker`: the one binary, alone in a directory, with no
/// `drumline-supervisor` beside it or on PATH, runs both roles, and a shell job's instants each
/// run exactly once (the supervisor is built in).
#[test]
fn the_one_binary_runs_the_beat_and_a_worker_alone() {
    let env = setup("reach_one_binary");
    let cfg = Cfg::new()
        .task("mark", env.appender("effects", 0.0))
        .job("tick", every("1s").task("mark"));
    let config = env.config_file(&cfg);
    let config = config.as_str();
    let alone = env.path("drumline");
    copy_binary("drumline", &alone);
    let path = [("PATH", "/usr/bin:/bin")];
    let beat = env.program_at(&alone, "beat", &["--config", config, "beat"], &path);
    let worker = env.program_at(&alone, "worker", &["--config", config, "worker"], &path);
    let ran = wait_until(Duration::from_secs(30), || env.lines("effects").len() >= 3);
    assert!(
        ran,
        "beat:\n{}\nworker:\n{}",
        beat.log_tail(20),
        worker.log_tail(20)
    );
    assert_contiguous_exactly_once(&env.lines("effects"), 3);
}
