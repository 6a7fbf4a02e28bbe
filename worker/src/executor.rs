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

use crate::handler::{Handler, HandlerError, HandlerFuture, TaskContext};
use drumline_shared::config::Task;
use drumline_shared::envelope::format_instant;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, Command};
use tokio::sync::oneshot;

/// The supervisor script, run as `/bin/sh -c SUPERVISOR drumline-task COMMAND…`. It starts
/// the command in the background (stdin passed through explicitly: a background job's stdin
/// would otherwise be /dev/null), waits for it, and exits with its status. On SIGHUP (the
/// worker died) it SIGKILLs its process group, itself included. SIGTERM and SIGINT get a no-op
/// handler so the supervisor outlives a polite stop of the group (the command receives those
/// signals directly, with default dispositions) and still reports the command's status.
pub const SUPERVISOR: &str = r#"trap 'kill -KILL 0' HUP
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

/// Grace between SIGTERM and SIGKILL when a task is stopped.
pub const KILL_GRACE: Duration = Duration::from_secs(5);

/// Runs a `[tasks.*]` command.
#[derive(Debug, Clone)]
pub struct ShellExecutor {
    command: Vec<String>,
    timeout: Option<Duration>,
    permanent_exit_codes: Vec<i32>,
}

impl ShellExecutor {
    /// The executor for `task`, or `None` when it has no `command`.
    pub fn for_task(task: &Task) -> Option<Self> {
        Some(Self {
            command: task.command.clone()?,
            timeout: task.timeout,
            permanent_exit_codes: task.permanent_exit_codes.clone(),
        })
    }

    async fn run(self, ctx: TaskContext) -> Result<(), HandlerError> {
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(SUPERVISOR)
            .arg("drumline-task")
            .args(&self.command)
            .env("DRUMLINE_TASK", &ctx.task)
            .env("DRUMLINE_KEY", &ctx.key)
            .env("DRUMLINE_JOB", ctx.job.as_deref().unwrap_or(""))
            .env("DRUMLINE_SCHEDULED_FOR", format_instant(ctx.scheduled_for))
            .env("DRUMLINE_ATTEMPT", ctx.attempt.to_string())
            .env("DRUMLINE_FENCING_TOKEN", ctx.fencing_token.to_string())
            .stdin(Stdio::piped())
            .kill_on_drop(true)
            .process_group(0);
        set_parent_death_signal(&mut cmd);
        let mut child = spawn(cmd).await.map_err(|e| {
            HandlerError::Retryable(format!("cannot start {:?}: {e}", self.command[0]))
        })?;
        let pgid = child.id().map(|id| Pid::from_raw(id as i32));

        if let Some(mut stdin) = child.stdin.take() {
            let args = serde_json::to_vec(&ctx.args).unwrap_or_default();
            // A task that does not read stdin closes it early: not an error.
            let _ = stdin.write_all(&args).await;
            drop(stdin);
        }

        let deadline = async {
            match self.timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            status = child.wait() => {
                let status = status.map_err(|e| HandlerError::Retryable(format!("wait failed: {e}")))?;
                // The leader exited; stragglers in its group must not outlive the run.
                if let Some(pgid) = pgid {
                    let _ = killpg(pgid, Signal::SIGKILL);
                }
                match (status.code(), status.signal()) {
                    (Some(0), _) => Ok(()),
                    (Some(code), _) if self.permanent_exit_codes.contains(&code) => {
                        Err(HandlerError::Permanent(format!("exit code {code}")))
                    }
                    (Some(code), _) => Err(HandlerError::Retryable(format!("exit code {code}"))),
                    (None, Some(sig)) => Err(HandlerError::Retryable(format!("killed by signal {sig}"))),
                    (None, None) => Err(HandlerError::Retryable("exited abnormally".into())),
                }
            }
            _ = deadline => {
                stop(&mut child, pgid).await;
                Err(HandlerError::Retryable(format!(
                    "timed out after {}",
                    humantime::format_duration(self.timeout.unwrap_or_default())
                )))
            }
            _ = ctx.cancel.cancelled() => {
                stop(&mut child, pgid).await;
                Err(HandlerError::Retryable("cancelled".into()))
            }
        }
    }
}

impl Handler for ShellExecutor {
    fn call(&self, ctx: TaskContext) -> HandlerFuture {
        Box::pin(self.clone().run(ctx))
    }
}

/// SIGTERM to the group, SIGKILL after [`KILL_GRACE`].
async fn stop(child: &mut Child, pgid: Option<Pid>) {
    let Some(pgid) = pgid else { return };
    let _ = killpg(pgid, Signal::SIGTERM);
    if tokio::time::timeout(KILL_GRACE, child.wait())
        .await
        .is_err()
    {
        let _ = killpg(pgid, Signal::SIGKILL);
        let _ = child.wait().await;
    }
    let _ = killpg(pgid, Signal::SIGKILL);
}

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
                        let _ = reply.send(cmd.spawn());
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
