//! The built-in shell executor (docs/design.md): `command = ["path", "arg"]`, run without a shell,
//! the envelope's `args` on stdin, the context in `DRUMLINE_*` variables.
//!
//! A task process never outlives its worker, children included, and cannot read the worker.
//! Each task runs in its own process group (so a timeout or cancellation kills the whole tree)
//! under a small supervisor, `drumline-supervisor` ([`crate::supervisor`]), that leads the
//! group. The supervisor makes itself non-dumpable (as the worker did at start,
//! [`make_non_dumpable`]), so a task running as the worker's user can read neither's
//! `/proc/<pid>/environ` nor ptrace them (docs/design.md#tasks-cannot-read-the-worker), and
//! asks for `PR_SET_PDEATHSIG = SIGHUP`: when the worker dies, even by `kill -9`, the kernel
//! sends it SIGHUP and it kills its whole group with SIGKILL, so no orphan (not even a
//! grandchild) can complete the instance a second time. A parent-death signal on the task
//! itself would reach only the first process. PDEATHSIG fires when the *spawning thread* exits,
//! and tokio's blocking threads come and go, so every task is spawned from one dedicated thread
//! that lives as long as the worker process.
//!
//! The supervisor sets both flags itself, after its exec (an exec makes a process dumpable
//! again, so the worker could not set that one for it), and then checks that its parent is
//! still the worker (its pid is the supervisor's first argument): a worker that died before the
//! signal was asked for could not trigger it. With no code of ours between fork and exec, std
//! starts the supervisor with `posix_spawn` (a vfork-style clone) instead of forking the
//! worker, whose page-table copy grew with the worker's memory (issue 11).
//!
//! Dropping a run's future (the worker does when a run outlives its lease deadline, or when it
//! abandons a connection's runs) SIGKILLs the whole group. The task's environment is the
//! worker's minus the broker and Redis URLs and `[worker] env_remove`, plus `[tasks.NAME] env`
//! and the context (docs/design.md "Task environment").

use crate::handler::{Handler, HandlerError, HandlerFuture, TaskContext};
use crate::output::{self, Stream};
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

/// The supervisor's program name, looked for beside the worker's executable, then on `PATH`.
pub const SUPERVISOR: &str = "drumline-supervisor";

/// Makes this process non-dumpable (`PR_SET_DUMPABLE = 0`): a process of the same (non-root)
/// user, such as a task, can then neither read its `/proc/<pid>/environ` or `mem`, where the
/// broker and Redis URLs are, nor ptrace it. [`crate::Worker::run`] calls it before anything
/// is spawned. Root reads any process's environment regardless: run workers as a non-root user.
pub fn make_non_dumpable() -> io::Result<()> {
    nix::sys::prctl::set_dumpable(false).map_err(io::Error::from)
}

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
    /// broker and Redis URLs (docs/design.md "Task environment").
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
        let supervisor = supervisor()
            .map_err(|e| HandlerError::retryable("cannot run a shell task").because(e))?;
        let mut cmd = Command::new(supervisor);
        cmd.arg(std::process::id().to_string()).args(&self.command);
        self.environment(&mut cmd, &ctx);
        // stderr is always read (its tail goes with a failure); stdout only to turn its lines
        // into log events (docs/design.md#failures-you-can-read).
        cmd.stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .process_group(0);
        if output::as_events() {
            cmd.stdout(Stdio::piped());
        }
        let mut child = spawn(cmd).await.map_err(|e| {
            HandlerError::retryable(format!("cannot start {:?}", self.command[0])).because(e)
        })?;
        // From here on, however this future ends (returned or dropped), the group is killed.
        let group = child.id().map(|id| Group(Pid::from_raw(id as i32)));
        let stderr = read_output(&mut child, &ctx);

        // Fed alongside the wait, never before it: a task that does not read its stdin must
        // not keep the timeout and the cancellation from firing (docs/design.md).
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
                    let status = status.map_err(|e| HandlerError::retryable("wait failed").because(e))?;
                    // The leader exited; stragglers in its group must not outlive the run.
                    drop(group);
                    return self.outcome(status).map_err(with_stderr(stderr).await);
                }
                () = &mut deadline => {
                    stop(&mut child, group, ctx.kill_grace).await;
                    let e = HandlerError::retryable(format!(
                        "timed out after {}",
                        humantime::format_duration(self.timeout.unwrap_or_default())
                    ));
                    return Err(with_stderr(stderr).await(e));
                }
                () = ctx.cancel.cancelled() => {
                    stop(&mut child, group, ctx.kill_grace).await;
                    return Err(HandlerError::retryable("cancelled"));
                }
            }
        }
    }
}

impl ShellExecutor {
    /// A finished command's outcome: exit 0 succeeded, an exit code in `permanent_exit_codes`
    /// is permanent, any other end is retried.
    fn outcome(&self, status: std::process::ExitStatus) -> Result<(), HandlerError> {
        match (status.code(), status.signal()) {
            (Some(0), _) => Ok(()),
            (Some(code), _) if self.permanent_exit_codes.contains(&code) => {
                Err(HandlerError::permanent(format!("exit code {code}")))
            }
            (Some(code), _) => Err(HandlerError::retryable(format!("exit code {code}"))),
            (None, Some(sig)) => Err(HandlerError::retryable(format!("killed by signal {sig}"))),
            (None, None) => Err(HandlerError::retryable("exited abnormally")),
        }
    }
}

impl Handler for ShellExecutor {
    fn call(&self, ctx: TaskContext) -> HandlerFuture {
        Box::pin(self.clone().run(ctx))
    }
}

/// The readers of a task's piped output ([`output::drain`]), each ending with the end of its
/// stream.
struct Readers {
    stdout: Option<tokio::task::JoinHandle<output::Tail>>,
    stderr: Option<tokio::task::JoinHandle<output::Tail>>,
}

/// Starts reading the task's piped output.
fn read_output(child: &mut Child, ctx: &TaskContext) -> Readers {
    let drain = |stream, reader: Option<_>| {
        let (key, task) = (ctx.key.clone(), ctx.task.clone());
        reader.map(|r| tokio::spawn(output::drain(r, stream, key, task)))
    };
    Readers {
        stdout: drain(Stream::Stdout, child.stdout.take().map(boxed)),
        stderr: drain(Stream::Stderr, child.stderr.take().map(boxed)),
    }
}

/// A pipe of the child as one reader type.
fn boxed(
    r: impl tokio::io::AsyncRead + Unpin + Send + 'static,
) -> Box<dyn tokio::io::AsyncRead + Unpin + Send> {
    Box::new(r)
}

/// How long a finished task's output may take to reach its end (a straggler outside the group
/// holding it open) before the outcome goes without its stderr tail.
const STDERR_WAIT: Duration = Duration::from_secs(1);

/// Waits (at most [`STDERR_WAIT`]) until the task's output is read, so its lines come before
/// the outcome, and adds the end of its stderr to a failure, as its cause.
async fn with_stderr(readers: Readers) -> impl FnOnce(HandlerError) -> HandlerError {
    let read = async {
        if let Some(stdout) = readers.stdout {
            let _ = stdout.await;
        }
        match readers.stderr {
            Some(stderr) => stderr.await.map(|tail| tail.text()).unwrap_or_default(),
            None => String::new(),
        }
    };
    let text = tokio::time::timeout(STDERR_WAIT, read)
        .await
        .unwrap_or_default();
    move |e| {
        if text.is_empty() {
            e
        } else {
            e.because(output::Stderr(text))
        }
    }
}

/// A task's process group, SIGKILLed when this is dropped. `kill_on_drop` alone would reach
/// only the supervisor, and the command (the supervisor's child) would live on as an orphan
/// when the worker drops a run's future (docs/design.md).
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

/// Where the supervisor is: the path given to [`use_supervisor`], else `drumline-supervisor`
/// beside the running executable (where the release and `cargo build` put it), else on `PATH`;
/// looked for once. `Err` says where it was looked for.
pub fn supervisor() -> Result<&'static Path, SupervisorMissing> {
    SUPERVISOR_PATH
        .get_or_init(|| {
            let beside = std::env::current_exe()
                .ok()
                .and_then(|exe| Some(exe.parent()?.join(SUPERVISOR)));
            let on_path: Vec<PathBuf> = std::env::var_os("PATH")
                .map(|path| {
                    std::env::split_paths(&path)
                        .map(|dir| dir.join(SUPERVISOR))
                        .collect()
                })
                .unwrap_or_default();
            beside
                .iter()
                .chain(&on_path)
                .find(|p| p.is_file())
                .cloned()
                .ok_or(SupervisorMissing { beside })
        })
        .as_deref()
        .map_err(Clone::clone)
}

static SUPERVISOR_PATH: OnceLock<Result<PathBuf, SupervisorMissing>> = OnceLock::new();

/// `drumline-supervisor` is neither beside the running binary nor on `PATH`.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "{SUPERVISOR} (which runs every shell task) is missing: not at {} nor on PATH; install it \
     beside drumline-worker",
    beside.as_ref().map_or("-".into(), |p| p.display().to_string())
)]
pub struct SupervisorMissing {
    /// Where it was looked for beside the running binary (none when that is unknown).
    pub beside: Option<PathBuf>,
}

/// Runs shell tasks under the supervisor at `path` instead of looking for it (for a program
/// that embeds the worker and installs `drumline-supervisor` elsewhere). Call it before the
/// first task runs; `false` when the supervisor was already chosen.
pub fn use_supervisor(path: PathBuf) -> bool {
    SUPERVISOR_PATH.set(Ok(path)).is_ok()
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
