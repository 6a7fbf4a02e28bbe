//! The shell executor against the real worker binary: what a task's environment holds, what
//! it cannot read of the worker's (run as a non-root user), and a timeout that holds even when
//! the task never reads its stdin.

use drumline_e2e::cfg::{shell, Cfg, Keys};
use drumline_e2e::scenario::Scenario;
use drumline_e2e::{adhoc, toml_string, wait_until, TestEnv, AMQP_URL, REDIS_URL};
use std::collections::BTreeMap;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);

fn pid_alive(pid: i32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.contains(") Z "))
            .unwrap_or(true)
}

/// A task `dump` that writes its whole environment to the file `env` (atomically).
fn dump_env(env: &drumline_e2e::TestEnv) -> Keys {
    shell(&format!(
        "env > {}.tmp && mv {0}.tmp {0}",
        env.path("env").display()
    ))
}

/// Publishes an ad-hoc instance `key` of `task` and waits until the file `file` exists: its
/// text.
async fn run_once(sc: &Scenario, key: &str, task: &str, file: &std::path::Path) -> String {
    sc.publish(&adhoc(key, task)).await;
    sc.wait(WAIT, "the task never ran", || file.exists());
    std::fs::read_to_string(file).expect("the task's file")
}

/// `dump` with an `env` of its own (one variable new, one overriding the worker's), and the
/// worker removing `DRUMLINE_TEST_SECRET` from what tasks inherit.
fn dump_with_own_env(env: &drumline_e2e::TestEnv) -> Cfg {
    let own = "{ DRUMLINE_TEST_GREETING = \"hello there\", DRUMLINE_TEST_KEPT = \"overridden\" }";
    Cfg::new()
        .set("worker", "env_remove", "[\"DRUMLINE_TEST_SECRET\"]")
        .task("dump", dump_env(env).with("env", own))
}

/// The worker's own environment: both URLs (as the compose file sets them), a secret the
/// config removes, and ordinary variables tasks inherit.
const WORKER_ENV: [(&str, &str); 5] = [
    ("DRUMLINE_AMQP_URL", AMQP_URL),
    ("DRUMLINE_REDIS_URL", REDIS_URL),
    ("DRUMLINE_TEST_SECRET", "s3cret"),
    ("DRUMLINE_TEST_INHERITED", "from the worker"),
    ("DRUMLINE_TEST_KEPT", "from the worker"),
];

/// What of [`WORKER_ENV`] a task must not see.
const NOT_INHERITED: [&str; 3] = [
    "DRUMLINE_AMQP_URL",
    "DRUMLINE_REDIS_URL",
    "DRUMLINE_TEST_SECRET",
];

#[tokio::test(flavor = "multi_thread")]
async fn a_task_sees_neither_url_nor_removed_variables_but_its_own_env() {
    let mut sc = Scenario::new("e2e_taskenv", dump_with_own_env);
    sc.start_worker_env(&WORKER_ENV).await;
    let text = run_once(&sc, "k-env", "dump", &sc.path("env")).await;
    let vars: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
    for gone in NOT_INHERITED {
        assert_eq!(vars.get(gone), None, "{text}");
    }
    assert!(!text.contains("s3cret"), "{text}");
    let expected = [
        ("DRUMLINE_TEST_INHERITED", "from the worker"),
        ("DRUMLINE_TEST_GREETING", "hello there"),
        ("DRUMLINE_TEST_KEPT", "overridden"),
        ("DRUMLINE_KEY", "k-env"),
        ("DRUMLINE_TASK", "dump"),
        ("DRUMLINE_ATTEMPT", "0"),
    ];
    for (name, value) in expected {
        assert_eq!(vars.get(name), Some(&value), "{name}");
    }
}

/// Task `deaf` writes `KEY PID` to `starts`, sleeps 30 s (its timeout is 1 s, no retries),
/// then writes its key to `effects`; messages up to 4 MiB.
fn deaf(env: &drumline_e2e::TestEnv) -> Cfg {
    let script = format!(
        "echo \"$DRUMLINE_KEY $$\" >> {starts}; sleep 30; echo \"$DRUMLINE_KEY\" >> {effects}",
        starts = env.path("starts").display(),
        effects = env.path("effects").display()
    );
    let deaf = shell(&script)
        .with("timeout", "\"1s\"")
        .with("max_retries", "0");
    Cfg::new()
        .set("worker", "max_message_bytes", "4194304")
        .task("deaf", deaf)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_that_never_reads_a_mebibyte_of_args_still_times_out() {
    let sc = Scenario::start("e2e_stdin", 0, 1, deaf).await;
    let mut envelope = adhoc("k-deaf", "deaf");
    // Sixteen pipe buffers' worth: a blocking write of it could never finish.
    envelope.args = serde_json::json!({ "blob": "x".repeat(1 << 20) });
    sc.publish(&envelope).await;
    sc.wait(WAIT, "never started", || sc.lines("starts").len() == 1);
    let pid: i32 = sc.lines("starts")[0]
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    // timeout 1 s, then SIGTERM (sh dies of it at once): well inside 10 s.
    let dead = || async { sc.run_state("k-deaf").await.as_deref() == Some("dead") };
    let what = "the run never timed out";
    sc.wait_async(Duration::from_secs(10), what, dead).await;
    let gone = wait_until(Duration::from_secs(2), || !pid_alive(pid));
    assert!(gone, "the task outlived its timeout");
    let what = "dead-lettered once (retries exhausted)";
    assert_eq!(sc.queue_len(&sc.names().dead()).await, Some(1), "{what}");
    assert!(sc.lines("effects").is_empty());
}

/// Task `peek` (the worker removes `DRUMLINE_TEST_SECRET` from tasks' environments) writes
/// to `out/report` its uid, the worker's pid (its supervisor's parent), and whether it could
/// read the worker's and its supervisor's environments; `out` is writable by anyone.
fn peek_config(env: &TestEnv) -> Cfg {
    use std::os::unix::fs::PermissionsExt;
    // Where the task (as `nobody`) may write.
    let out = env.path("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).unwrap();
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
        out.join("report").display()
    );
    let command = format!(
        "[\"/bin/sh\", \"-c\", {}]",
        toml_string(&script).replace('\n', "\\n")
    );
    Cfg::new()
        .set("worker", "env_remove", "[\"DRUMLINE_TEST_SECRET\"]")
        .task("peek", Keys::default().with("command", &command))
}

/// A task running as the worker's own (non-root) user cannot read the worker's environment,
/// where its broker and Redis URLs and their passwords are, nor its supervisor's: both make
/// themselves non-dumpable before they start anything (docs/design.md "Tasks cannot read the
/// worker"). Root may read any process's environment, so the worker runs as `nobody` here, as
/// docs/guarantees.md says to run workers; the task asks its supervisor's status for the worker's pid.
// See: issues/16
#[tokio::test(flavor = "multi_thread")]
async fn a_task_as_the_workers_user_cannot_read_the_workers_environment() {
    let mut sc = Scenario::new("e2e_nondumpable", peek_config);
    let password = format!("pw-{}", uuid::Uuid::new_v4().simple());
    let secret = format!("secret-{}", uuid::Uuid::new_v4().simple());
    // Redis accepts any password for its password-less `default` user.
    let redis_url = format!("redis://default:{password}@127.0.0.1:6379/0");
    let vars = [
        ("DRUMLINE_AMQP_URL", AMQP_URL),
        ("DRUMLINE_REDIS_URL", &redis_url),
        ("DRUMLINE_TEST_SECRET", &secret),
    ];
    let worker = sc.worker_as_nobody("worker", &["--config", sc.cfg()], &vars);
    sc.wait_for_topology(&worker).await;
    let pid = worker.pid();
    sc.workers.push(worker);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let nobody = status.contains("\nUid:\t65534\t");
    assert!(nobody, "the worker is not nobody:\n{status}");
    let text = run_once(&sc, "k-peek", "peek", &sc.path("out").join("report")).await;
    let uid = format!("uid 65534 worker {pid}\n");
    assert!(text.starts_with(&uid), "{text}");
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
    let mut sc = Scenario::new("e2e_secret_env", |env| {
        let hook = Keys::default()
            .with("http.url", "\"http://127.0.0.1:9/hook\"")
            .with("http.secret_env", "\"DRUMLINE_TEST_HOOK_SECRET\"");
        Cfg::new().task("dump", dump_env(env)).task("hook", hook)
    });
    let secret = format!("whsec_{}", uuid::Uuid::new_v4().simple());
    sc.start_worker_env(&[("DRUMLINE_TEST_HOOK_SECRET", &secret)])
        .await;
    let text = run_once(&sc, "k-secret", "dump", &sc.path("env")).await;
    assert!(!text.contains("DRUMLINE_TEST_HOOK_SECRET"), "{text}");
    assert!(!text.contains(&secret), "the secret leaked:\n{text}");
    assert!(text.contains("DRUMLINE_KEY=k-secret"), "{text}");
}
