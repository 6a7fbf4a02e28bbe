//! The built-in shell executor (DESIGN §4): `command = ["path", "arg"]`, run without a shell,
//! the envelope's `args` on stdin, the context in `DRUMLINE_*` variables.
//!
//! A task process never outlives its worker, children included. Each task runs in its own
//! process group (so a timeout or cancellation kills the whole tree) under a tiny `/bin/sh`
//! supervisor ([`SUPERVISOR`]) that leads the group. The supervisor gets
//! `PR_SET_PDEATHSIG = SIGHUP`: when the worker dies, even by `kill -9`, the kernel sends it
//! SIGHUP and it kills its whole group with SIGKILL, so no orphan (not even a grandchild) can
//! complete the instance a second time. A parent-death signal on the task itself would reach
//! only the first process. PDEATHSIG fires when the *spawning thread* exits, and tokio's
//! blocking threads come and go, so every task is spawned from one dedicated thread that lives
//! as long as the worker process.
//!
//! The signal is set by util-linux `setpriv --pdeathsig HUP`, which then execs the supervisor:
//! with no code of ours between fork and exec, std starts it with `posix_spawn` (a vfork-style
//! clone) instead of forking the worker, whose page-table copy grew with the worker's memory and
//! was most of a short task's cost (issue 11). Without `setpriv` the signal is set in a
//! `pre_exec` hook (a fork). Either way the supervisor checks that its parent is still the
//! worker (its pid is the supervisor's first argument) before it starts the command: a worker
//! that died before the signal was set could not trigger it.
//!
//! Dropping a run's future (the worker does when a run outlives its lease deadline, or when it
//! abandons a connection's runs) SIGKILLs the whole group. The task's environment is the
//! worker's minus the broker and Redis URLs and `[worker] env_remove`, plus `[tasks.NAME] env`
//! and the context (DESIGN §9 "Task environment").

use crate::handler::{Handler, HandlerError, HandlerFuture, TaskContext};
use drumline_shared::config::{Task, ENV_AMQP_URL, ENV_REDIS_URL};
use drumline_shared::envelope::format_instant;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use std::collections::BTreeMap;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, Command};
use tokio::sync::oneshot;

/// The supervisor script, run as `/bin/sh -c SUPERVISOR drumline-task WORKER_PID COMMAND…`.
/// Its parent-death signal is set before it runs; if the worker died before that (its parent
/// is no longer `WORKER_PID`), nobody would signal it, so it exits before starting anything. It
/// starts
/// the command in the background (stdin passed through explicitly: a background job's stdin
/// would otherwise be /dev/null), waits for it, and exits with its status. On SIGHUP (the
/// worker died) it SIGKILLs its process group, itself included. SIGTERM and SIGINT get a no-op
/// handler so the supervisor outlives a polite stop of the group (the command receives those
/// signals directly, with default dispositions) and still reports the command's status.
pub const SUPERVISOR: &str = r#"trap 'kill -KILL 0' HUP
[ "$PPID" = "$1" ] || exit 125
shift
trap ':' TERM INT
exec 3<&0
"$@" <&3 3<&- &
child=$!
exec 3<&-
while :; do
  wait "$child"
  status=$?
  kill -0 "$child" 2>/dev/null || exit "$status"
done"#;

/// The longest grace between SIGTERM and SIGKILL when a task is stopped. The worker gives a
/// shorter one ([`TaskContext::kill_grace`]) when the lease leaves less room.
pub const KILL_GRACE: Duration = Duration::from_secs(5);

/// Runs a `[tasks.*]` command.
#[derive(Debug, Clone)]
pub struct ShellExecutor {
    command: Vec<String>,
    timeout: Option<Duration>,
    permanent_exit_codes: Vec<i32>,
    /// `[tasks.NAME] env`.
    env: BTreeMap<String, String>,
    /// Inherited variables a task must not see: the URLs and `[worker] env_remove`.
    env_remove: Vec<String>,
}

impl ShellExecutor {
    /// The executor for `task`, or `None` when it has no `command`. `env_remove` is
    /// `[worker] env_remove`: inherited variables the task must not see, on top of the
    /// broker and Redis URLs (DESIGN §9 "Task environment").
    pub fn for_task(task: &Task, env_remove: &[String]) -> Option<Self> {
        let mut remove = vec![ENV_AMQP_URL.to_owned(), ENV_REDIS_URL.to_owned()];
        remove.extend(env_remove.iter().cloned());
        Some(Self {
            command: task.command.clone()?,
            timeout: task.timeout,
            permanent_exit_codes: task.permanent_exit_codes.clone(),
            env: task.env.clone(),
            env_remove: remove,
        })
    }

    /// The worker's environment minus the removed variables, plus `[tasks.NAME] env`, plus
    /// the run's context (which the config cannot override).
    fn environment(&self, cmd: &mut Command, ctx: &TaskContext) {
        for name in &self.env_remove {
            cmd.env_remove(name);
        }
        cmd.envs(&self.env)
            .env("DRUMLINE_TASK", &ctx.task)
            .env("DRUMLINE_KEY", &ctx.key)
            .env("DRUMLINE_JOB", ctx.job.as_deref().unwrap_or(""))
            .env("DRUMLINE_SCHEDULED_FOR", format_instant(ctx.scheduled_for))
            .env("DRUMLINE_ATTEMPT", ctx.attempt.to_string())
            .env("DRUMLINE_FENCING_TOKEN", ctx.fencing_token.to_string());
    }

    async fn run(self, ctx: TaskContext) -> Result<(), HandlerError> {
        let mut cmd = match setpriv() {
            // `setpriv` sets the signal and execs the supervisor: no code of ours runs between
            // fork and exec, so the supervisor is started by `posix_spawn` (no copy of the
            // worker's page tables, which grows with the worker's memory).
            Some(setpriv) => {
                let mut cmd = Command::new(setpriv);
                cmd.args(["--pdeathsig", "HUP", "--", "/bin/sh"]);
                cmd
            }
            None => {
                let mut cmd = Command::new("/bin/sh");
                set_parent_death_signal(&mut cmd);
                cmd
            }
        };
        cmd.arg("-c")
            .arg(SUPERVISOR)
            .arg("drumline-task")
            .arg(std::process::id().to_string())
            .args(&self.command);
        self.environment(&mut cmd, &ctx);
        cmd.stdin(Stdio::piped())
            .kill_on_drop(true)
            .process_group(0);
        let mut child = spawn(cmd).await.map_err(|e| {
            HandlerError::Retryable(format!("cannot start {:?}: {e}", self.command[0]))
        })?;
        // From here on, however this future ends (returned or dropped), the group is killed.
        let group = child.id().map(|id| Group(Pid::from_raw(id as i32)));

        // Fed alongside the wait, never before it: a task that does not read its stdin must
        // not keep the timeout and the cancellation from firing (DESIGN §9).
        let stdin = child.stdin.take();
        let args = serde_json::to_vec(&ctx.args).unwrap_or_default();
        let feed = async move {
            if let Some(mut stdin) = stdin {
                // A task that does not read stdin closes it early: not an error.
                let _ = stdin.write_all(&args).await;
            }
        };
        tokio::pin!(feed);
        let mut fed = false;

        let deadline = async {
            match self.timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                () = &mut feed, if !fed => fed = true,
                status = child.wait() => {
                    let status = status.map_err(|e| HandlerError::Retryable(format!("wait failed: {e}")))?;
                    // The leader exited; stragglers in its group must not outlive the run.
                    drop(group);
                    return match (status.code(), status.signal()) {
                        (Some(0), _) => Ok(()),
                        (Some(code), _) if self.permanent_exit_codes.contains(&code) => {
                            Err(HandlerError::Permanent(format!("exit code {code}")))
                        }
                        (Some(code), _) => Err(HandlerError::Retryable(format!("exit code {code}"))),
                        (None, Some(sig)) => Err(HandlerError::Retryable(format!("killed by signal {sig}"))),
                        (None, None) => Err(HandlerError::Retryable("exited abnormally".into())),
                    };
                }
                () = &mut deadline => {
                    stop(&mut child, group, ctx.kill_grace).await;
                    return Err(HandlerError::Retryable(format!(
                        "timed out after {}",
                        humantime::format_duration(self.timeout.unwrap_or_default())
                    )));
                }
                () = ctx.cancel.cancelled() => {
                    stop(&mut child, group, ctx.kill_grace).await;
                    return Err(HandlerError::Retryable("cancelled".into()));
                }
            }
        }
    }
}

impl Handler for ShellExecutor {
    fn call(&self, ctx: TaskContext) -> HandlerFuture {
        Box::pin(self.clone().run(ctx))
    }
}

/// A task's process group, SIGKILLed when this is dropped. `kill_on_drop` alone would reach
/// only the supervisor, and the command (the supervisor's child) would live on as an orphan
/// when the worker drops a run's future (DESIGN §9).
struct Group(Pid);

impl Drop for Group {
    fn drop(&mut self) {
        let _ = killpg(self.0, Signal::SIGKILL);
    }
}

/// SIGTERM to the group, SIGKILL after `grace` (at most [`KILL_GRACE`]).
async fn stop(child: &mut Child, group: Option<Group>, grace: Duration) {
    let Some(group) = group else { return };
    let _ = killpg(group.0, Signal::SIGTERM);
    if tokio::time::timeout(grace.min(KILL_GRACE), child.wait())
        .await
        .is_err()
    {
        let _ = killpg(group.0, Signal::SIGKILL);
        let _ = child.wait().await;
    }
    // Dropping `group` kills what is left of it.
}

/// util-linux `setpriv`, when it is installed and can set a parent-death signal (2.33 and
/// later); checked once.
fn setpriv() -> Option<&'static Path> {
    static SETPRIV: OnceLock<Option<PathBuf>> = OnceLock::new();
    SETPRIV
        .get_or_init(|| {
            let path = ["/usr/bin/setpriv", "/bin/setpriv"]
                .iter()
                .map(PathBuf::from)
                .find(|p| p.is_file())?;
            let works = std::process::Command::new(&path)
                .args(["--pdeathsig", "HUP", "--", "/bin/sh", "-c", ":"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            works.then_some(path)
        })
        .as_deref()
}

/// Without `setpriv`: the signal set between fork and exec (a fork of the whole worker).
#[allow(unsafe_code)]
fn set_parent_death_signal(cmd: &mut Command) {
    let parent = std::process::id() as i32;
    // SAFETY: the closure runs in the forked child before exec and only makes two
    // async-signal-safe system calls (prctl, getppid); it allocates nothing and takes no lock.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGHUP).map_err(io::Error::from)?;
            // The worker may have died between fork and prctl: then nobody will signal us.
            if nix::unistd::getppid().as_raw() != parent {
                return Err(io::Error::other("worker exited before the task started"));
            }
            Ok(())
        });
    }
}

type SpawnRequest = (Command, oneshot::Sender<io::Result<Child>>);

/// Spawns `cmd` from the long-lived spawner thread (see the module doc for why).
async fn spawn(cmd: Command) -> io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let sender = SPAWNER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<SpawnRequest>();
            let runtime = tokio::runtime::Handle::current();
            std::thread::Builder::new()
                .name("drumline-spawner".into())
                .spawn(move || {
                    // tokio's child reaping needs the runtime's context on this thread.
                    let _guard = runtime.enter();
                    for (mut cmd, reply) in rx {
                        // The run was dropped while we spawned: take its group down with it.
                        if let Err(Ok(child)) = reply.send(cmd.spawn()) {
                            if let Some(id) = child.id() {
                                let _ = killpg(Pid::from_raw(id as i32), Signal::SIGKILL);
                            }
                        }
                    }
                })
                .expect("cannot start the spawner thread");
            Mutex::new(tx)
        })
        .lock()
        .expect("spawner lock poisoned")
        .clone();
    let (tx, rx) = oneshot::channel();
    sender
        .send((cmd, tx))
        .map_err(|_| io::Error::other("spawner thread is gone"))?;
    rx.await
        .map_err(|_| io::Error::other("spawner thread is gone"))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use tokio_util::sync::CancellationToken;

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

    /// Its parent-death signal came too late when its parent is no longer the worker: then
    /// the supervisor starts nothing.
    #[test]
    fn the_supervisor_starts_nothing_when_its_parent_is_not_the_worker() {
        let dir = std::env::temp_dir().join(format!("drumline-sup-{}", uuid::Uuid::new_v4()));
        let marker = dir.to_string_lossy().into_owned();
        let run = |worker_pid: String| {
            std::process::Command::new("/bin/sh")
                .args(["-c", SUPERVISOR, "drumline-task", &worker_pid])
                .args(["/usr/bin/touch", &marker])
                .status()
                .expect("sh")
        };
        let refused = run("1".into());
        assert_eq!(refused.code(), Some(125));
        assert!(
            !dir.exists(),
            "the command ran under a supervisor nobody would signal"
        );
        let ran = run(std::process::id().to_string());
        assert_eq!(ran.code(), Some(0));
        assert!(
            dir.exists(),
            "the command runs when the parent is the worker"
        );
        let _ = std::fs::remove_file(&dir);
    }

    /// One test, not several: the spawner thread belongs to the first runtime that uses it.
    #[tokio::test]
    async fn dropping_a_run_kills_its_whole_group() {
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
}
