//! The built-in shell executor (DESIGN §4): `command = ["path", "arg"]`, run without a shell,
//! the envelope's `args` on stdin, the context in `DRUMLINE_*` variables.
//!
//! A task process never outlives its worker, children included. Each task runs in its own
//! process group (so a timeout or cancellation kills the whole tree), led by the command
//! itself. One [`Sentinel`] per worker process, a tiny `/bin/sh` script started once, holds
//! the read end of a pipe: each task's process registers its group there *before* it execs
//! the command, and the worker unregisters the group once it has reaped the command and
//! killed what was left of the group. When the worker dies, even by `kill -9`, the kernel
//! closes the write end; the sentinel reads end of file and SIGKILLs every group still
//! registered, so no orphan (not even a grandchild) can complete the instance a second time.
//!
//! A task starts through `clone(CLONE_VM | CLONE_VFORK)` ([`spawn`]), like `posix_spawn`: a
//! `fork` of the worker (what the former per-run `/bin/sh` supervisor needed, for its
//! parent-death signal) copied the worker's page tables on every run and cost more than the
//! task's own exec (issue 11).
//!
//! Dropping a run's future (the worker does when a run outlives its lease deadline, or when it
//! abandons a connection's runs) SIGKILLs the whole group. The task's environment is the
//! worker's minus the broker and Redis URLs and `[worker] env_remove`, plus `[tasks.NAME] env`
//! and the context (DESIGN §9 "Task environment").

mod spawn;

use crate::handler::{Handler, HandlerError, HandlerFuture, TaskContext};
use drumline_shared::config::{Task, ENV_AMQP_URL, ENV_REDIS_URL};
use drumline_shared::envelope::format_instant;
use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use spawn::SpawnError;
use std::collections::BTreeMap;
use std::ffi::{CString, OsString};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::io::AsyncWriteExt;

/// The sentinel script, run as `/bin/sh -c SENTINEL` with the registration pipe on stdin.
/// Lines `+PGID` (written by a task process before its exec) and `-PGID` (by the worker once
/// the group is dead) keep the set of live task groups; at end of file (the worker is gone)
/// it SIGKILLs each. It ignores the signals aimed at the worker's own process group (a
/// terminal's ^C, a polite stop): it must outlive the worker, and it ends by itself.
pub const SENTINEL: &str = r#"trap '' HUP INT TERM QUIT
groups=' '
while read -r group; do
  case $group in
    +*) groups="$groups${group#+} " ;;
    -*) pg=${group#-}
        case $groups in *" $pg "*) groups="${groups%% $pg *} ${groups#* $pg }" ;; esac ;;
  esac
done
for pg in $groups; do kill -KILL -"$pg" 2>/dev/null; done"#;

/// The longest grace between SIGTERM and SIGKILL when a task is stopped. The worker gives a
/// shorter one ([`TaskContext::kill_grace`]) when the lease leaves less room.
pub const KILL_GRACE: Duration = Duration::from_secs(5);

/// The context variables, which `[tasks.NAME] env` cannot override.
const CONTEXT: [&str; 6] = [
    "DRUMLINE_TASK",
    "DRUMLINE_KEY",
    "DRUMLINE_JOB",
    "DRUMLINE_SCHEDULED_FOR",
    "DRUMLINE_ATTEMPT",
    "DRUMLINE_FENCING_TOKEN",
];

/// Runs a `[tasks.*]` command.
#[derive(Debug, Clone)]
pub struct ShellExecutor {
    plan: Arc<Plan>,
}

/// What every run of one task shares, built once: the argv, where to look for the program,
/// and the environment without the run's context.
#[derive(Debug)]
struct Plan {
    command: Vec<String>,
    argv: Vec<CString>,
    /// `execvp`'s candidates: the path itself when it has a `/`, else each `PATH` entry (the
    /// task's `PATH`, as a shell started with the task's environment would search).
    paths: Vec<CString>,
    /// `NAME=value`: the worker's environment minus the removed variables, plus
    /// `[tasks.NAME] env`, minus the context names.
    env: Vec<CString>,
    timeout: Option<Duration>,
    permanent_exit_codes: Vec<i32>,
    /// Why the command cannot be passed to `execve` (a NUL byte in it or its `env`): each run
    /// fails with this, retryable, as a spawn error did before.
    invalid: Option<String>,
}

impl ShellExecutor {
    /// The executor for `task`, or `None` when it has no `command`. `env_remove` is
    /// `[worker] env_remove`: inherited variables the task must not see, on top of the
    /// broker and Redis URLs (DESIGN §9 "Task environment"). The worker's environment is read
    /// here, once.
    pub fn for_task(task: &Task, env_remove: &[String]) -> Option<Self> {
        let command = task.command.clone()?;
        let mut env: BTreeMap<OsString, OsString> = std::env::vars_os().collect();
        for name in [ENV_AMQP_URL, ENV_REDIS_URL]
            .into_iter()
            .chain(env_remove.iter().map(String::as_str))
        {
            env.remove(std::ffi::OsStr::new(name));
        }
        for (k, v) in &task.env {
            env.insert(k.into(), v.into());
        }
        for name in CONTEXT {
            env.remove(std::ffi::OsStr::new(name));
        }
        let program = command.first()?.as_bytes();
        let paths = if program.contains(&b'/') {
            vec![program.to_vec()]
        } else {
            let search = env
                .get(std::ffi::OsStr::new("PATH"))
                .map(|p| p.as_bytes().to_vec())
                .unwrap_or_else(|| b"/bin:/usr/bin".to_vec());
            search
                .split(|&b| b == b':')
                .map(|dir| {
                    let dir = if dir.is_empty() { &b"."[..] } else { dir };
                    [dir, b"/", program].concat()
                })
                .collect()
        };
        let mut invalid = None;
        let mut c = |b: Vec<u8>| {
            CString::new(b).unwrap_or_else(|e| {
                invalid = Some(e.to_string());
                CString::default()
            })
        };
        let argv = command.iter().map(|a| c(a.clone().into_bytes())).collect();
        let paths = paths.into_iter().map(&mut c).collect();
        let env = env
            .into_iter()
            .map(|(k, v)| {
                let mut kv = k.into_vec();
                kv.push(b'=');
                kv.extend(v.into_vec());
                c(kv)
            })
            .collect();
        Some(Self {
            plan: Arc::new(Plan {
                argv,
                paths,
                env,
                command,
                timeout: task.timeout,
                permanent_exit_codes: task.permanent_exit_codes.clone(),
                invalid,
            }),
        })
    }

    /// The run's context variables (appended to the plan's environment).
    fn context(&self, ctx: &TaskContext) -> Vec<CString> {
        let values = [
            ctx.task.clone(),
            ctx.key.clone(),
            ctx.job.clone().unwrap_or_default(),
            format_instant(ctx.scheduled_for),
            ctx.attempt.to_string(),
            ctx.fencing_token.to_string(),
        ];
        let mut env = Vec::with_capacity(CONTEXT.len());
        for (name, value) in CONTEXT.iter().zip(values) {
            // A NUL inside a value cannot be passed; such a variable is left out.
            if let Ok(kv) = CString::new(format!("{name}={value}")) {
                env.push(kv);
            }
        }
        env
    }

    /// The decision for a command that ended with exit `code`.
    fn exit_code(&self, code: i32) -> Result<(), HandlerError> {
        match code {
            0 => Ok(()),
            code if self.plan.permanent_exit_codes.contains(&code) => {
                Err(HandlerError::Permanent(format!("exit code {code}")))
            }
            code => Err(HandlerError::Retryable(format!("exit code {code}"))),
        }
    }

    async fn run(self, ctx: TaskContext) -> Result<(), HandlerError> {
        let plan = &self.plan;
        if let Some(problem) = &plan.invalid {
            return Err(HandlerError::Retryable(format!(
                "cannot start {:?}: {problem}",
                plan.command[0]
            )));
        }
        let context = self.context(&ctx);
        let mut task = match TaskGroup::start(plan, &context) {
            Ok(task) => task,
            // As a shell reports a command it cannot run: 127 not found, 126 not executable.
            Err(StartError::Exec(e)) => {
                let code = match e.raw_os_error() {
                    Some(libc::ENOENT | libc::ENOTDIR) => 127,
                    _ => 126,
                };
                tracing::warn!(command = ?plan.command[0], error = %e, code, "cannot start the task");
                return self.exit_code(code);
            }
            Err(StartError::Other(e)) => {
                return Err(HandlerError::Retryable(format!(
                    "cannot start {:?}: {e}",
                    plan.command[0]
                )))
            }
        };
        // From here on, however this future ends (returned or dropped), the group is killed.

        // Fed alongside the wait, never before it: a task that does not read its stdin must
        // not keep the timeout and the cancellation from firing (DESIGN §9).
        let stdin = task.stdin.take();
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
            match plan.timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                () = &mut feed, if !fed => fed = true,
                status = task.wait() => {
                    let status = status.map_err(|e| HandlerError::Retryable(format!("wait failed: {e}")))?;
                    // The leader exited; stragglers in its group must not outlive the run.
                    drop(task);
                    return match status {
                        Exit::Code(code) => self.exit_code(code),
                        // As the former `/bin/sh` supervisor reported it: 128 + the signal.
                        Exit::Signal(sig) => self.exit_code(128 + sig),
                    };
                }
                () = &mut deadline => {
                    task.stop(ctx.kill_grace).await;
                    return Err(HandlerError::Retryable(format!(
                        "timed out after {}",
                        humantime::format_duration(plan.timeout.unwrap_or_default())
                    )));
                }
                () = ctx.cancel.cancelled() => {
                    task.stop(ctx.kill_grace).await;
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

/// How a task's command ended.
enum Exit {
    Code(i32),
    Signal(i32),
}

enum StartError {
    /// The command cannot be executed (not found, not executable).
    Exec(io::Error),
    Other(io::Error),
}

/// One run's process group, led by the command. Dropping it SIGKILLs the group, unregisters
/// it from the sentinel, and reaps the leader (at once, or in the background).
struct TaskGroup {
    pid: Pid,
    /// Readable once the leader has exited; `None` once reaped.
    pidfd: Option<AsyncFd<OwnedFd>>,
    stdin: Option<tokio::net::unix::pipe::Sender>,
    registry: Arc<Registry>,
}

impl TaskGroup {
    fn start(plan: &Plan, context: &[CString]) -> Result<Self, StartError> {
        let (read, write) = spawn::pipe().map_err(StartError::Other)?;
        let mut retried = false;
        loop {
            let registry = Registry::current().map_err(StartError::Other)?;
            match spawn::spawn(
                &plan.paths,
                &plan.argv,
                &plan.env,
                context,
                &read,
                registry.fd.as_raw_fd(),
            ) {
                Ok(child) => {
                    drop(read);
                    let pid = Pid::from_raw(child.pid);
                    // Owned from here: a failure below still kills and reaps the group.
                    let mut task = TaskGroup {
                        pid,
                        pidfd: None,
                        stdin: None,
                        registry,
                    };
                    task.pidfd = Some(spawn::watch(child.pidfd).map_err(StartError::Other)?);
                    task.stdin = Some(
                        tokio::net::unix::pipe::Sender::from_owned_fd(write)
                            .map_err(StartError::Other)?,
                    );
                    return Ok(task);
                }
                Err(SpawnError::Exec(e)) => return Err(StartError::Exec(e)),
                // The sentinel is gone (killed from outside): start another, once.
                Err(SpawnError::Register(e)) if retried => return Err(StartError::Other(e)),
                Err(SpawnError::Register(_)) => {
                    registry.retire();
                    retried = true;
                }
                Err(SpawnError::Os(e)) => return Err(StartError::Other(e)),
            }
        }
    }

    /// Waits for the leader to exit and reaps it.
    async fn wait(&mut self) -> io::Result<Exit> {
        let Some(pidfd) = &self.pidfd else {
            return Err(io::Error::other("already reaped"));
        };
        loop {
            let mut ready = pidfd.readable().await?;
            match waitpid(self.pid, Some(WaitPidFlag::WNOHANG)).map_err(io::Error::from)? {
                WaitStatus::Exited(_, code) => {
                    self.pidfd = None;
                    return Ok(Exit::Code(code));
                }
                WaitStatus::Signaled(_, sig, _) => {
                    self.pidfd = None;
                    return Ok(Exit::Signal(sig as i32));
                }
                _ => ready.clear_ready(),
            }
        }
    }

    /// SIGTERM to the group, SIGKILL after `grace` (at most [`KILL_GRACE`]).
    async fn stop(&mut self, grace: Duration) {
        let _ = killpg(self.pid, Signal::SIGTERM);
        if tokio::time::timeout(grace.min(KILL_GRACE), self.wait())
            .await
            .is_err()
        {
            let _ = killpg(self.pid, Signal::SIGKILL);
            let _ = self.wait().await;
        }
        // Dropping the task kills what is left of the group.
    }
}

impl Drop for TaskGroup {
    fn drop(&mut self) {
        let _ = killpg(self.pid, Signal::SIGKILL);
        let Some(pidfd) = self.pidfd.take() else {
            self.registry.unregister(self.pid);
            return;
        };
        // The leader was not reaped: it dies of the SIGKILL; reap it when it has.
        let pid = self.pid;
        let registry = self.registry.clone();
        let reap = async move {
            let _ = pidfd.readable().await;
            let _ = waitpid(pid, None);
            registry.unregister(pid);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(reap)),
            Err(_) => {
                let _ = waitpid(pid, None);
                self.registry.unregister(pid);
            }
        }
    }
}

/// The write end of the sentinel's pipe, and the sentinel.
#[derive(Debug)]
struct Registry {
    fd: OwnedFd,
    sentinel: Mutex<std::process::Child>,
}

/// The worker's sentinel: started at the first run, replaced if something killed it.
static SENTINEL_NOW: Mutex<Option<Arc<Registry>>> = Mutex::new(None);

impl Registry {
    /// The live sentinel's registry, starting one if there is none (or it died).
    fn current() -> io::Result<Arc<Self>> {
        let mut now = SENTINEL_NOW.lock().expect("sentinel lock poisoned");
        if let Some(registry) = &*now {
            let exited = registry
                .sentinel
                .lock()
                .expect("sentinel lock poisoned")
                .try_wait();
            if matches!(exited, Ok(None)) {
                return Ok(registry.clone());
            }
            tracing::warn!("the task sentinel is gone; starting another");
        }
        let mut child = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(SENTINEL)
            .arg("drumline-sentinel")
            .stdin(std::process::Stdio::piped())
            .spawn()?;
        let fd = OwnedFd::from(child.stdin.take().expect("piped stdin"));
        let registry = Arc::new(Registry {
            fd,
            sentinel: Mutex::new(child),
        });
        *now = Some(registry.clone());
        Ok(registry)
    }

    /// Forgets this sentinel: the next run starts another.
    fn retire(&self) {
        let mut now = SENTINEL_NOW.lock().expect("sentinel lock poisoned");
        if now.as_ref().is_some_and(|r| std::ptr::eq(&**r, self)) {
            *now = None;
        }
    }

    /// The group is dead: the sentinel may forget it.
    fn unregister(&self, group: Pid) {
        // One write of a few bytes: atomic on a pipe. A gone sentinel has nothing to forget.
        let _ = nix::unistd::write(&self.fd, format!("-{group}\n").as_bytes());
    }
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

    fn task(command: Vec<String>) -> Task {
        Task {
            name: "t".into(),
            command: Some(command),
            timeout: None,
            max_retries: 0,
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(1),
            permanent_exit_codes: vec![4],
            env: BTreeMap::new(),
        }
    }

    fn executor(command: Vec<String>) -> ShellExecutor {
        ShellExecutor::for_task(&task(command), &[]).unwrap()
    }

    fn sh(script: &str) -> ShellExecutor {
        executor(vec!["/bin/sh".into(), "-c".into(), script.into()])
    }

    #[tokio::test]
    async fn exit_statuses_map_as_a_shell_reports_them() {
        let run = |e: ShellExecutor| e.call(context());
        assert_eq!(run(sh("exit 0")).await, Ok(()));
        assert_eq!(
            run(sh("exit 3")).await,
            Err(HandlerError::Retryable("exit code 3".into()))
        );
        assert_eq!(
            run(sh("exit 4")).await,
            Err(HandlerError::Permanent("exit code 4".into()))
        );
        // Death by a signal reads as a shell reports it: 128 + the signal.
        assert_eq!(
            run(sh("kill -KILL $$")).await,
            Err(HandlerError::Retryable("exit code 137".into()))
        );
        // Found through PATH, as `execvp` and a shell would.
        assert_eq!(run(executor(vec!["true".into()])).await, Ok(()));
        assert_eq!(
            run(executor(vec!["/nonexistent/drumline-task".into()])).await,
            Err(HandlerError::Retryable("exit code 127".into()))
        );
        assert_eq!(
            run(executor(vec!["/".into()])).await,
            Err(HandlerError::Retryable("exit code 126".into()))
        );
    }

    #[tokio::test]
    async fn a_task_reads_its_args_then_eof_and_sees_its_context() {
        let dir = std::env::temp_dir().join(format!("drumline-exec-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("out");
        let script = format!(
            "{{ cat; echo; echo \"$DRUMLINE_KEY $DRUMLINE_ATTEMPT $DRUMLINE_FENCING_TOKEN\"; }} > {}",
            out.display()
        );
        let mut ctx = context();
        ctx.args = serde_json::json!({"region": "eu"});
        sh(&script).call(ctx).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(&out).unwrap(),
            "{\"region\":\"eu\"}\nk 0 1\n"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_timeout_stops_the_whole_group() {
        let dir = std::env::temp_dir().join(format!("drumline-exec-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let pids = dir.join("pids");
        let script = format!(
            "sleep 30 & echo \"$$ $!\" > {0}.tmp && mv {0}.tmp {0}; wait",
            pids.display()
        );
        let task = Task {
            timeout: Some(Duration::from_millis(300)),
            ..task(vec!["/bin/sh".into(), "-c".into(), script])
        };
        let started = std::time::Instant::now();
        let result = ShellExecutor::for_task(&task, &[])
            .unwrap()
            .call(context())
            .await;
        assert_eq!(
            result,
            Err(HandlerError::Retryable("timed out after 300ms".into()))
        );
        assert!(started.elapsed() < Duration::from_secs(10));
        let text = std::fs::read_to_string(&pids).unwrap();
        for pid in text.split_whitespace().map(|p| p.parse::<i32>().unwrap()) {
            wait_for(&format!("process {pid} outlived the timeout"), || {
                !alive(pid)
            })
            .await;
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The sentinel script on its own: the groups still registered when its pipe closes (the
    /// worker died) are killed, children included; unregistered ones are left alone.
    #[test]
    fn the_sentinel_kills_the_registered_groups_at_end_of_file() {
        use std::io::Write;
        use std::os::unix::process::{CommandExt, ExitStatusExt};
        let group = |secs: &str| {
            std::process::Command::new("/bin/sh")
                .arg("-c")
                .arg(format!("sleep {secs} & wait"))
                .process_group(0)
                .spawn()
                .unwrap()
        };
        let (mut doomed, mut spared) = (group("30"), group("31"));
        let mut sentinel = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(SENTINEL)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut pipe = sentinel.stdin.take().unwrap();
        write!(
            pipe,
            "+{}\n+{}\n+4194000\n-{1}\n-4194000\n",
            doomed.id(),
            spared.id()
        )
        .unwrap();
        drop(pipe);
        assert!(sentinel.wait().unwrap().success());
        let status = doomed.wait().unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        // Its `sleep` (a grandchild of the test) died with it.
        let doomed_group = Pid::from_raw(doomed.id() as i32);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while killpg(doomed_group, None).is_ok() {
            assert!(
                std::time::Instant::now() < deadline,
                "the group's sleep outlived it"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            spared.try_wait().unwrap(),
            None,
            "an unregistered group lives on"
        );
        let _ = killpg(Pid::from_raw(spared.id() as i32), Signal::SIGKILL);
        let _ = spared.wait();
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

    #[tokio::test]
    async fn dropping_a_run_kills_its_whole_group() {
        let dir = std::env::temp_dir().join(format!("drumline-exec-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let pids = dir.join("pids");
        // The command leads the group; its `sleep` is a grandchild of the worker.
        let script = format!(
            "sleep 30 & echo \"$$ $!\" > {0}.tmp && mv {0}.tmp {0}; wait",
            pids.display()
        );
        let executor = executor(vec!["/bin/sh".into(), "-c".into(), script]);
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
