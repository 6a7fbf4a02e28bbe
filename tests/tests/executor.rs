//! The shell executor against the real worker binary: what a task's environment holds, what
//! it cannot read of the worker's (run as a non-root user), and a timeout that holds even when
//! the task never reads its stdin.

use drumline_e2e::cfg::{shell, Cfg, Keys};
use drumline_e2e::{adhoc, setup, toml_string, wait_until, wait_until_async, AMQP_URL, REDIS_URL};
use std::collections::BTreeMap;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);

fn pid_alive(pid: i32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.contains(") Z "))
            .unwrap_or(true)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_sees_neither_url_nor_removed_variables_but_its_own_env() {
    let env = setup("e2e_taskenv");
    let dump = env.path("env");
    let script = format!("env > {}.tmp && mv {0}.tmp {0}", dump.display());
    let config = env.config(
        "drumline.toml",
        &format!(
            r#"
[worker]
env_remove = ["DRUMLINE_TEST_SECRET"]

[tasks.dump]
command = ["/bin/sh", "-c", {}]
env = {{ DRUMLINE_TEST_GREETING = "hello there", DRUMLINE_TEST_KEPT = "overridden" }}
"#,
            toml_string(&script)
        ),
    );
    // The worker's own environment holds both URLs (as the compose file sets them), a secret
    // the config removes, and an ordinary variable tasks inherit.
    let worker = env.worker_with_env(
        "worker",
        &["--config", config.to_str().unwrap()],
        &[
            ("DRUMLINE_AMQP_URL", AMQP_URL),
            ("DRUMLINE_REDIS_URL", REDIS_URL),
            ("DRUMLINE_TEST_SECRET", "s3cret"),
            ("DRUMLINE_TEST_INHERITED", "from the worker"),
            ("DRUMLINE_TEST_KEPT", "from the worker"),
        ],
    );
    env.wait_for_topology(&worker).await;
    env.publish(&adhoc("k-env", "dump")).await;
    assert!(
        wait_until(WAIT, || dump.exists()),
        "the task never ran\n{}",
        worker.log_tail(30)
    );
    let text = std::fs::read_to_string(&dump).unwrap();
    let vars: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
    assert_eq!(vars.get("DRUMLINE_AMQP_URL"), None, "{text}");
    assert_eq!(vars.get("DRUMLINE_REDIS_URL"), None, "{text}");
    assert_eq!(vars.get("DRUMLINE_TEST_SECRET"), None, "{text}");
    assert!(!text.contains("s3cret"), "{text}");
    assert_eq!(
        vars.get("DRUMLINE_TEST_INHERITED"),
        Some(&"from the worker")
    );
    assert_eq!(vars.get("DRUMLINE_TEST_GREETING"), Some(&"hello there"));
    assert_eq!(vars.get("DRUMLINE_TEST_KEPT"), Some(&"overridden"));
    assert_eq!(vars.get("DRUMLINE_KEY"), Some(&"k-env"));
    assert_eq!(vars.get("DRUMLINE_TASK"), Some(&"dump"));
    assert_eq!(vars.get("DRUMLINE_ATTEMPT"), Some(&"0"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_that_never_reads_a_mebibyte_of_args_still_times_out() {
    let env = setup("e2e_stdin");
    let script = format!(
        "echo \"$DRUMLINE_KEY $$\" >> {starts}; sleep 30; echo \"$DRUMLINE_KEY\" >> {effects}",
        starts = env.path("starts").display(),
        effects = env.path("effects").display()
    );
    let config = env.config(
        "drumline.toml",
        &format!(
            r#"
[worker]
max_message_bytes = 4194304

[tasks.deaf]
command = ["/bin/sh", "-c", {}]
timeout = "1s"
max_retries = 0
"#,
            toml_string(&script)
        ),
    );
    let worker = env.worker("worker", &["--config", config.to_str().unwrap()]);
    env.wait_for_topology(&worker).await;
    let mut envelope = adhoc("k-deaf", "deaf");
    // Sixteen pipe buffers' worth: a blocking write of it could never finish.
    envelope.args = serde_json::json!({ "blob": "x".repeat(1 << 20) });
    env.publish(&envelope).await;
    assert!(
        wait_until(WAIT, || env.lines("starts").len() == 1),
        "never started\n{}",
        worker.log_tail(30)
    );
    let pid: i32 = env.lines("starts")[0]
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    // timeout 1 s, then SIGTERM (sh dies of it at once): well inside 10 s.
    let dead = wait_until_async(Duration::from_secs(10), || async {
        env.run_state("k-deaf").await.as_deref() == Some("dead")
    })
    .await;
    assert!(dead, "the run never timed out\n{}", worker.log_tail(30));
    assert!(
        wait_until(Duration::from_secs(2), || !pid_alive(pid)),
        "the task outlived its timeout"
    );
    assert_eq!(
        env.queue_len(&env.names().dead()).await,
        Some(1),
        "dead-lettered once (retries exhausted)"
    );
    assert!(env.lines("effects").is_empty());
}

/// A task running as the worker's own (non-root) user cannot read the worker's environment,
/// where its broker and Redis URLs and their passwords are, nor its supervisor's: both make
/// themselves non-dumpable before they start anything (docs/design.md "Tasks cannot read the
/// worker"). Root may read any process's environment, so the worker runs as `nobody` here, as
/// docs/guarantees.md says to run workers; the task asks its supervisor's status for the worker's pid.
// See: issues/16
#[tokio::test(flavor = "multi_thread")]
async fn a_task_as_the_workers_user_cannot_read_the_workers_environment() {
    use std::os::unix::fs::PermissionsExt;
    let env = setup("e2e_nondumpable");
    // Where the task (as `nobody`) may write.
    let out = env.path("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).unwrap();
    let report = out.join("report");
    let script = format!(
        r#"sup=$PPID
worker=$(awk '/^PPid:/ {{print $2}}' /proc/$sup/status)
{{
  echo "uid $(id -u) worker $worker"
  for who in worker:$worker supervisor:$sup; do
    if tr '\0' '\n' < /proc/${{who#*:}}/environ; then
      echo "${{who%%:*}} environ: readable"
    else
      echo "${{who%%:*}} environ: denied"
    fi
  done
}} > {0}.tmp 2>&1
mv {0}.tmp {0}"#,
        report.display()
    );
    let config = env.config(
        "drumline.toml",
        &format!(
            "[worker]\nenv_remove = [\"DRUMLINE_TEST_SECRET\"]\n\
             [tasks.peek]\ncommand = [\"/bin/sh\", \"-c\", {}]\n",
            toml_string(&script).replace('\n', "\\n")
        ),
    );
    let password = format!("pw-{}", uuid::Uuid::new_v4().simple());
    let secret = format!("secret-{}", uuid::Uuid::new_v4().simple());
    // Redis accepts any password for its password-less `default` user.
    let redis_url = format!("redis://default:{password}@127.0.0.1:6379/0");
    let worker = env.worker_as_nobody(
        "worker",
        &["--config", config.to_str().unwrap()],
        &[
            ("DRUMLINE_AMQP_URL", AMQP_URL),
            ("DRUMLINE_REDIS_URL", &redis_url),
            ("DRUMLINE_TEST_SECRET", &secret),
        ],
    );
    env.wait_for_topology(&worker).await;
    let status = std::fs::read_to_string(format!("/proc/{}/status", worker.pid())).unwrap();
    assert!(
        status.contains("\nUid:\t65534\t"),
        "the worker is not nobody:\n{status}"
    );
    env.publish(&adhoc("k-peek", "peek")).await;
    assert!(
        wait_until(WAIT, || report.exists()),
        "the task never ran\n{}",
        worker.log_tail(30)
    );
    let text = std::fs::read_to_string(&report).unwrap();
    assert!(
        text.starts_with(&format!("uid 65534 worker {}\n", worker.pid())),
        "{text}"
    );
    assert!(text.contains("\nworker environ: denied\n"), "{text}");
    assert!(text.contains("\nsupervisor environ: denied\n"), "{text}");
    for leaked in [password.as_str(), secret.as_str(), "guest:guest"] {
        assert!(!text.contains(leaked), "{leaked} leaked:\n{text}");
    }
}

/// Issue 33: a variable the worker reads itself (an HTTP task's `secret_env`) never reaches a
/// shell task, without being listed in `env_remove` (docs/guarantees.md#trust-who-can-do-what).
#[tokio::test(flavor = "multi_thread")]
async fn a_secret_the_worker_reads_is_not_in_a_shell_tasks_environment() {
    let env = setup("e2e_secret_env");
    let dump = env.path("env");
    let script = format!("env > {}.tmp && mv {0}.tmp {0}", dump.display());
    let cfg = Cfg::new().task("dump", shell(&script)).task(
        "hook",
        Keys::default()
            .with("http.url", "\"http://127.0.0.1:9/hook\"")
            .with("http.secret_env", "\"DRUMLINE_TEST_HOOK_SECRET\""),
    );
    let config = env.write_config("drumline.toml", &cfg);
    let secret = format!("whsec_{}", uuid::Uuid::new_v4().simple());
    let worker = env.worker_with_env(
        "worker",
        &["--config", config.to_str().unwrap()],
        &[("DRUMLINE_TEST_HOOK_SECRET", &secret)],
    );
    env.wait_for_topology(&worker).await;
    env.publish(&adhoc("k-secret", "dump")).await;
    assert!(
        wait_until(WAIT, || dump.exists()),
        "the task never ran\n{}",
        worker.log_tail(30)
    );
    let text = std::fs::read_to_string(&dump).unwrap();
    assert!(!text.contains("DRUMLINE_TEST_HOOK_SECRET"), "{text}");
    assert!(!text.contains(&secret), "the secret leaked:\n{text}");
    assert!(text.contains("DRUMLINE_KEY=k-secret"), "{text}");
}
