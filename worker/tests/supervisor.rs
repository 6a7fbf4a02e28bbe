//! The shell executor's supervisor, `drumline-supervisor`, as the worker runs it: it starts
//! nothing when its parent is no longer the worker, passes the command's status on, and a
//! dropped run takes its whole process group down. (Non-dumpable and the parent-death signal
//! are tested end to end in the workspace's `tests/tests/executor.rs` and `worker_faults.rs`.)

use drumline_shared::config::Task;
use drumline_worker::executor::{use_supervisor, ShellExecutor};
use drumline_worker::{Handler, TaskContext};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const SUPERVISOR: &str = env!("CARGO_BIN_EXE_drumline-supervisor");

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

fn context() -> TaskContext {
    TaskContext {
        task: "t".into(),
        key: "k".into(),
        job: None,
        scheduled_for: chrono::Utc::now(),
        attempt: 0,
        fencing_token: 1,
        args: serde_json::json!({}),
        cancel: CancellationToken::new(),
        kill_grace: Duration::from_millis(100),
    }
}

async fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    for _ in 0..200 {
        if condition() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{what}");
}

/// Its parent-death signal came too late when its parent is no longer the worker: then the
/// supervisor starts nothing (exit 125). Otherwise it runs the command and exits with its code,
/// or 128 + the signal that killed it, as a shell would.
#[test]
fn the_supervisor_starts_nothing_when_its_parent_is_not_the_worker() {
    let dir = std::env::temp_dir().join(format!("drumline-sup-{}", uuid::Uuid::new_v4()));
    let marker = dir.to_string_lossy().into_owned();
    let run = |worker_pid: String, command: &[&str]| {
        std::process::Command::new(SUPERVISOR)
            .arg(worker_pid)
            .args(command)
            .status()
            .expect("supervisor")
    };
    let me = std::process::id().to_string();
    let refused = run("1".into(), &["/usr/bin/touch", &marker]);
    assert_eq!(refused.code(), Some(125));
    assert!(
        !dir.exists(),
        "the command ran under a supervisor nobody would signal"
    );
    let ran = run(me.clone(), &["/usr/bin/touch", &marker]);
    assert_eq!(ran.code(), Some(0));
    assert!(
        dir.exists(),
        "the command runs when the parent is the worker"
    );
    let _ = std::fs::remove_file(&dir);
    assert_eq!(run(me.clone(), &["sh", "-c", "exit 7"]).code(), Some(7));
    assert_eq!(
        run(me.clone(), &["sh", "-c", "kill -9 $$"]).code(),
        Some(137)
    );
    assert_eq!(run(me.clone(), &["/nonexistent/command"]).code(), Some(127));
    // The command starts with no signal blocked, whatever the supervisor blocks for itself.
    let out = std::process::Command::new(SUPERVISOR)
        .args([&me, "grep", "SigBlk", "/proc/self/status"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.trim(), "SigBlk:\t0000000000000000", "{text}");
}

/// One test, not several: the spawner thread belongs to the first runtime that uses it.
#[tokio::test]
async fn dropping_a_run_kills_its_whole_group() {
    assert!(use_supervisor(SUPERVISOR.into()));
    let dir = std::env::temp_dir().join(format!("drumline-exec-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let pids = dir.join("pids");
    // The command is the supervisor's child; its `sleep` is a grandchild of the worker.
    let script = format!(
        "sleep 30 & echo \"$$ $!\" > {0}.tmp && mv {0}.tmp {0}; wait",
        pids.display()
    );
    let task = Task {
        name: "t".into(),
        command: Some(vec!["/bin/sh".into(), "-c".into(), script]),
        timeout: None,
        max_retries: 0,
        retry_base: Duration::from_secs(1),
        retry_max: Duration::from_secs(1),
        permanent_exit_codes: vec![],
        env: BTreeMap::new(),
        http: None,
        limit: None,
    };
    let executor = ShellExecutor::for_task(&task, &[]).unwrap();
    let run = tokio::spawn(executor.call(context()));
    wait_for("the task never started", || Path::new(&pids).exists()).await;
    let text = std::fs::read_to_string(&pids).unwrap();
    let pids: Vec<i32> = text
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2, "{text}");
    assert!(pids.iter().all(|&p| alive(p)));

    // As the worker does with in-flight runs when it abandons a connection.
    run.abort();
    assert!(run.await.unwrap_err().is_cancelled());
    for pid in pids {
        wait_for(&format!("process {pid} outlived its dropped run"), || {
            !alive(pid)
        })
        .await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}
