//! The built-in shell executor (docs/design.md): `command = ["path", "arg"]`, run without a shell,
//! the envelope's `args` on stdin, the context in `DRUMLINE_*` variables.
//!
//! A task process never outlives its worker, children included, and cannot read the worker.
//! Every task runs as the leader of its own process group (so a timeout or cancellation kills
//! the whole tree), started by one of the worker's supervisors, `drumline-supervisor`
//! ([`crate::supervisor`]): the worker hands it the command, the environment and the ends of
//! the task's pipes over a socket, and it starts the command with `posix_spawn`, holds its
//! pidfd, kills its group when the leader exits or the worker asks, and kills every group when
//! the worker's end of the socket closes (the worker died, even by `kill -9` of its whole
//! process group). Per run that is one `exec`, the command's: the fork/exec ceiling's own.
//!
//! Dropping a run's future (the worker does when a run outlives its lease deadline, or when it
//! abandons a connection's runs) has the supervisor SIGKILL the whole group (asked at once, or
//! from a task when the socket is full; through the task's pidfd when the supervisor is gone). The task's environment is the
//! worker's minus the broker and Redis URLs and `[worker] env_remove`, plus `[tasks.NAME] env`
//! and the context (docs/design.md "Task environment").

use crate::handler::{Handler, HandlerError, HandlerFuture, TaskContext};
use crate::lease::{self, LeaseClock, KILL_GRACE};
use crate::output::{self, Stream};
use crate::supervisor::link::{self, Program, Spec, StartError};
use crate::supervisor::wire::{Deadline, Status};
use drumline_shared::config::{Task, ENV_AMQP_URL, ENV_REDIS_URL};
use drumline_shared::envelope::format_instant;
use drumline_shared::trace::TRACEPARENT_VAR;
use rustix::fd::OwnedFd;
use rustix::pipe::PipeFlags;
use rustix::process::Signal;
use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;

/// The supervisor's program name, looked for beside the worker's executable, then on `PATH`.
pub const SUPERVISOR: &str = "drumline-supervisor";

/// Makes this process non-dumpable (`PR_SET_DUMPABLE = 0`): a process of the same (non-root)
/// user, such as a task, can then neither read its `/proc/<pid>/environ` or `mem`, where the
/// broker and Redis URLs are, nor ptrace it. [`crate::Worker::run`] calls it before anything
/// is spawned. Root reads any process's environment regardless: run workers as a non-root user.
pub fn make_non_dumpable() -> io::Result<()> {
    nix::sys::prctl::set_dumpable(false).map_err(io::Error::from)
}

/// Runs a `[tasks.*]` command.
/// Cloned for every run: what it holds is shared.
#[derive(Debug, Clone)]
pub struct ShellExecutor {
    command: Arc<[String]>,
    timeout: Option<Duration>,
    permanent_exit_codes: Arc<[i32]>,
    /// What every run's environment starts with (see [`Inherited`]).
    inherited: Inherited,
}

/// The worker's environment minus the variables a task must not see (the URLs and `[worker]
/// env_remove`), plus `[tasks.NAME] env`, without the run's context variables, as
/// `NAME=value` entries: made once per executor, when the worker starts or reloads (reading
/// and sorting the process environment for every run was a third of the executor's own CPU:
/// docs/performance.md). Its `Debug` shows how many, never the values: the worker's
/// environment may hold secrets.
#[derive(Clone)]
struct Inherited(Arc<[CString]>);

impl std::fmt::Debug for Inherited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Inherited({} variables)", self.0.len())
    }
}

/// The run's context variables, set by every run; the config cannot override them.
const CONTEXT: [&str; 7] = [
    "DRUMLINE_TASK",
    "DRUMLINE_KEY",
    "DRUMLINE_JOB",
    "DRUMLINE_SCHEDULED_FOR",
    "DRUMLINE_ATTEMPT",
    "DRUMLINE_FENCING_TOKEN",
    TRACEPARENT_VAR,
];

/// `NAME=value`, or `None` when either holds a NUL: such a variable cannot be passed (nor set
/// by a config: TOML strings may hold one) and is left out.
fn entry(name: &OsStr, value: &OsStr) -> Option<CString> {
    let mut entry = name.as_bytes().to_vec();
    entry.push(b'=');
    entry.extend_from_slice(value.as_bytes());
    CString::new(entry).ok()
}

impl Inherited {
    /// From this process's environment now, without `remove`, with `env` over it.
    fn new(env: &BTreeMap<String, String>, remove: &[String]) -> Self {
        let mut all: BTreeMap<OsString, OsString> = std::env::vars_os()
            .filter(|(name, _)| !remove.iter().any(|r| OsStr::new(r) == name))
            .collect();
        all.extend(env.iter().map(|(k, v)| (k.into(), v.into())));
        let entries = all
            .iter()
            .filter(|(name, _)| !CONTEXT.iter().any(|c| OsStr::new(c) == *name))
            .filter_map(|(name, value)| entry(name, value))
            .collect();
        Inherited(entries)
    }
}

impl ShellExecutor {
    /// The executor for `task`, or `None` when it has no `command`. `hidden` names the
    /// inherited variables the task must not see ([`Config::hidden_from_tasks`]: the secrets
    /// drumline reads and `[worker] env_remove`); the broker and Redis URLs are never passed on
    /// (docs/design.md "Task environment").
    ///
    /// [`Config::hidden_from_tasks`]: drumline_shared::config::Config::hidden_from_tasks
    pub fn for_task(task: &Task, hidden: &[String]) -> Option<Self> {
        let command = task.command.as_deref()?;
        let mut remove = vec![ENV_AMQP_URL.to_owned(), ENV_REDIS_URL.to_owned()];
        remove.extend(hidden.iter().cloned());
        Some(Self {
            command: command.into(),
            timeout: task.timeout,
            permanent_exit_codes: task.permanent_exit_codes.as_slice().into(),
            inherited: Inherited::new(&task.env, &remove),
        })
    }

    /// The task's environment: [`Inherited`], plus the run's context, as `NAME=value` entries.
    fn environment(&self, ctx: &TaskContext) -> Vec<CString> {
        let context = [
            ctx.task.clone(),
            ctx.key.clone(),
            ctx.job.clone().unwrap_or_default(),
            format_instant(ctx.scheduled_for),
            ctx.attempt.to_string(),
            ctx.fencing_token.to_string(),
            ctx.trace.to_string(),
        ];
        let mut env = Vec::with_capacity(self.inherited.0.len() + CONTEXT.len());
        env.extend(self.inherited.0.iter().cloned());
        env.extend(
            CONTEXT
                .iter()
                .zip(&context)
                .filter_map(|(name, value)| entry(OsStr::new(name), OsStr::new(value))),
        );
        env
    }

    /// Starts the task under its lease (when the run has one: the supervisor stops it at the
    /// lease's stop point on its own) and waits for its end ([`Self::supervise`]).
    async fn run(self, ctx: TaskContext, lease: Option<LeaseClock>) -> Result<(), HandlerError> {
        let supervisor = supervisor()
            .map_err(|e| HandlerError::retryable("cannot run a shell task").because(e))?;
        let cannot_pipe = |e: rustix::io::Errno| {
            HandlerError::retryable("cannot run a shell task").because(io::Error::from(e))
        };
        let pipe = || rustix::pipe::pipe_with(PipeFlags::CLOEXEC).map_err(cannot_pipe);
        let (stdin_theirs, stdin_ours) = pipe()?;
        let (stderr_ours, stderr_theirs) = pipe()?;
        // stderr is always read (its tail goes with a failure); stdout only to turn its lines
        // into log events (docs/design.md#failures-you-can-read).
        let (stdout_ours, stdout_theirs) = match output::as_events().then(pipe).transpose()? {
            Some((ours, theirs)) => (Some(ours), Some(theirs)),
            None => (None, None),
        };
        let argv: Vec<CString> = self
            .command
            .iter()
            .map(|a| CString::new(a.as_bytes()))
            .collect::<Result<_, _>>()
            .map_err(|e| HandlerError::permanent("the command holds a NUL byte").because(e))?;
        let spec = Spec {
            argv,
            env: self.environment(&ctx),
            stdin: stdin_theirs,
            stderr: stderr_theirs,
            stdout: stdout_theirs,
            deadline: lease.as_ref().map(LeaseClock::deadline),
        };
        let task = link::start(supervisor, spec)
            .await
            .map_err(|e| self.not_started(e))?;
        // From here on, however this future ends (returned or dropped), the group is killed.
        let stderr = read_output(stdout_ours, stderr_ours, &ctx);
        self.supervise(task, &ctx, stdin_ours, stderr, lease).await
    }

    /// Waits for the task's end while feeding its stdin, moving its deadline with each renewal
    /// of the lease, and stopping it on its timeout or when the run is cancelled.
    async fn supervise(
        &self,
        mut task: link::Task,
        ctx: &TaskContext,
        stdin: OwnedFd,
        stderr: Readers,
        mut lease: Option<LeaseClock>,
    ) -> Result<(), HandlerError> {
        // Fed alongside the wait, never before it: a task that does not read its stdin must
        // not keep the timeout and the cancellation from firing (docs/design.md).
        let args = serde_json::to_vec(&ctx.args).unwrap_or_default();
        let feed = async move {
            if let Ok(mut stdin) = pipe::Sender::from_owned_fd(stdin) {
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
                Some(deadline) = renewed(&mut lease) => task.hold_until(deadline).await,
                status = task.wait() => {
                    let status = status.map_err(|e| HandlerError::retryable("the task was lost").because(e))?;
                    return self.outcome(exit_status(status)).map_err(with_stderr(stderr).await);
                }
                () = &mut deadline => {
                    stop(&mut task, ctx.kill_grace).await;
                    let e = HandlerError::retryable(format!(
                        "timed out after {}",
                        humantime::format_duration(self.timeout.unwrap_or_default())
                    ));
                    return Err(with_stderr(stderr).await(e));
                }
                () = ctx.cancel.cancelled() => {
                    stop(&mut task, ctx.kill_grace).await;
                    return Err(HandlerError::retryable("cancelled"));
                }
            }
        }
    }

    /// The outcome of a start the supervisor could not make: as a shell reports it, exit code
    /// 127 when the program does not exist and 126 when it cannot be run (not executable, not
    /// a program), so `permanent_exit_codes` decide as they do for a shell's, the reason as
    /// its cause. Any other refusal (out of processes, memory or descriptors) is retried.
    fn not_started(&self, e: StartError) -> HandlerError {
        match e {
            StartError::Refused(e) => {
                let cause =
                    io::Error::new(e.kind(), format!("cannot start {:?}: {e}", self.command[0]));
                let code = match rustix::io::Errno::from_io_error(&e) {
                    Some(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR) => 127,
                    Some(
                        rustix::io::Errno::ACCESS
                        | rustix::io::Errno::NOEXEC
                        | rustix::io::Errno::PERM
                        | rustix::io::Errno::ISDIR,
                    ) => 126,
                    _ => return HandlerError::retryable("cannot start the task").because(cause),
                };
                match self.outcome(exit_status(Status::Code(code))) {
                    Err(failure) => failure.because(cause),
                    Ok(()) => HandlerError::retryable("cannot start").because(cause),
                }
            }
            StartError::TooLarge(size) => HandlerError::permanent(format!(
                "the command and its environment take {size} bytes, more than a task start \
                 may ({} bytes): shorten them or remove variables with [worker] env_remove",
                link::MAX_START
            )),
            StartError::Unavailable(e) => {
                HandlerError::retryable("cannot run a shell task").because(e)
            }
        }
    }
}

/// The task's end as the `ExitStatus` a wait would have given.
fn exit_status(status: Status) -> std::process::ExitStatus {
    match status {
        Status::Code(code) => std::process::ExitStatus::from_raw((code & 0xff) << 8),
        Status::Signal(signal) => std::process::ExitStatus::from_raw(signal & 0x7f),
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
        // Read while the future is created: the processor's scope ends with that.
        Box::pin(self.clone().run(ctx, lease::current()))
    }
}

/// The readers of a task's piped output ([`output::drain`]), each ending with the end of its
/// stream.
struct Readers {
    stdout: Option<tokio::task::JoinHandle<output::Tail>>,
    stderr: Option<tokio::task::JoinHandle<output::Tail>>,
}

/// Starts reading the task's piped output.
fn read_output(stdout: Option<OwnedFd>, stderr: OwnedFd, ctx: &TaskContext) -> Readers {
    let drain = |stream, fd: Option<OwnedFd>| {
        let (key, task) = (ctx.key.clone(), ctx.task.clone());
        let reader = fd.and_then(|fd| pipe::Receiver::from_owned_fd(fd).ok());
        reader.map(|r| tokio::spawn(output::drain(Box::new(r), stream, key, task)))
    };
    Readers {
        stdout: drain(Stream::Stdout, stdout),
        stderr: drain(Stream::Stderr, Some(stderr)),
    }
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

/// The supervisor's deadline after the lease's next renewal; `None` for a run without a lease
/// or once its watchdog has stopped. Cancel-safe.
async fn renewed(lease: &mut Option<LeaseClock>) -> Option<Deadline> {
    match lease {
        Some(lease) => lease.renewed().await,
        None => None,
    }
}

/// SIGTERM to the group, SIGKILL after `grace` (at most [`KILL_GRACE`]). (Dropping `task`
/// kills what is left of it.)
async fn stop(task: &mut link::Task, grace: Duration) {
    task.signal(Signal::TERM).await;
    if tokio::time::timeout(grace.min(KILL_GRACE), task.wait())
        .await
        .is_err()
    {
        task.signal(Signal::KILL).await;
        let _ = task.wait().await;
    }
}

/// How the worker starts its supervisors: as set by [`use_supervisor`] or
/// [`use_builtin_supervisor`], else `drumline-supervisor` beside the running executable (where
/// the release and `cargo build` put it), else on `PATH`; looked for once. `Err` says where it
/// was looked for.
pub fn supervisor() -> Result<&'static Program, SupervisorMissing> {
    SUPERVISOR_PROGRAM
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
                .map(|path| Program {
                    path: path.clone(),
                    leading: Vec::new(),
                })
                .ok_or(SupervisorMissing { beside })
        })
        .as_ref()
        .map_err(Clone::clone)
}

static SUPERVISOR_PROGRAM: OnceLock<Result<Program, SupervisorMissing>> = OnceLock::new();

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
    SUPERVISOR_PROGRAM
        .set(Ok(Program {
            path,
            leading: Vec::new(),
        }))
        .is_ok()
}

/// Runs shell tasks under this very binary as the supervisor (`/proc/self/exe` with
/// [`crate::supervisor::BUILTIN`] before the pid), for a binary whose `main` hands that
/// argument to [`crate::supervisor::builtin`] first, as `drumline` does: one file to install.
/// `/proc/self/exe` is the image the worker runs even after an upgrade replaced the file, so
/// worker and supervisor always speak the same wire. `false` when one was already chosen.
pub fn use_builtin_supervisor() -> bool {
    SUPERVISOR_PROGRAM
        .set(Ok(Program {
            path: PathBuf::from("/proc/self/exe"),
            leading: vec![OsString::from(crate::supervisor::BUILTIN)],
        }))
        .is_ok()
}

/// How many tasks the worker's supervisors hold right now (see [`link::census`]).
pub async fn supervised_tasks() -> io::Result<usize> {
    link::census().await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(env: &[(&str, &str)]) -> Task {
        Task {
            name: "t".into(),
            command: Some(vec!["/bin/true".into()]),
            timeout: None,
            max_retries: 0,
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(1),
            permanent_exit_codes: vec![],
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            http: None,
            limit: None,
        }
    }

    /// Made once per executor: the removed variables stay out, `[tasks.NAME] env` wins over
    /// the inherited, the run's context over both, each name once; `Debug` shows no value.
    #[test]
    fn a_runs_environment_is_the_shared_part_and_its_own_context() {
        // PATH is inherited by every process that runs this test; HOME is removed.
        let executor = ShellExecutor::for_task(
            &task(&[
                ("DRUMLINE_KEY", "from the config"),
                ("DRUMLINE_TEST_ONLY", "configured"),
                ("PATH", "/configured"),
            ]),
            &["HOME".to_owned()],
        )
        .expect("a command");
        let ctx = TaskContext {
            task: "t".into(),
            key: "k-1".into(),
            job: None,
            scheduled_for: chrono::Utc::now(),
            attempt: 2,
            fencing_token: 7,
            args: serde_json::json!({}),
            cancel: tokio_util::sync::CancellationToken::new(),
            kill_grace: Duration::from_secs(1),
            trace: drumline_shared::trace::TraceParent::root(),
        };
        let env = executor.environment(&ctx);
        let pairs: Vec<(String, String)> = env
            .iter()
            .map(|e| {
                let (k, v) = e.to_str().unwrap().split_once('=').unwrap();
                (k.to_owned(), v.to_owned())
            })
            .collect();
        let get = |name: &str| -> Vec<&str> {
            pairs
                .iter()
                .filter(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
                .collect()
        };
        assert_eq!(get("DRUMLINE_KEY"), ["k-1"]);
        assert_eq!(get("DRUMLINE_ATTEMPT"), ["2"]);
        assert_eq!(get("DRUMLINE_FENCING_TOKEN"), ["7"]);
        assert_eq!(get("DRUMLINE_JOB"), [""]);
        assert_eq!(get("DRUMLINE_TEST_ONLY"), ["configured"]);
        assert_eq!(get("PATH"), ["/configured"]);
        assert_eq!(get("HOME"), Vec::<&str>::new());
        assert_eq!(get(ENV_AMQP_URL), Vec::<&str>::new());
        // A second run shares the same part and has its own context.
        let again = executor.environment(&TaskContext {
            key: "k-2".into(),
            ..ctx
        });
        assert!(again.iter().any(|e| e.as_bytes() == b"DRUMLINE_KEY=k-2"));
        assert_eq!(again.len(), env.len());
        let shown = format!("{executor:?}");
        assert!(!shown.contains("/configured"), "{shown}");
    }
}
