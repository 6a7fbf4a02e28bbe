//! `drumline-supervisor WORKER_PID COMMAND [ARG…]`: the process that leads a shell task's
//! process group (docs/design.md#the-task-supervisor). The worker starts it (with `posix_spawn`:
//! no code of the worker runs between fork and exec) as the leader of a new process group; it
//! then, before it starts anything:
//!
//! 1. makes itself non-dumpable (`PR_SET_DUMPABLE = 0`): a task running as the same user can
//!    then neither read its `/proc/<pid>/environ` or `mem` nor ptrace it
//!    (docs/design.md#tasks-cannot-read-the-worker). A flag set by the worker before the exec
//!    would not do: `execve` makes a process dumpable again, which is why the supervisor is a
//!    program of ours and not `/bin/sh`;
//! 2. asks for SIGHUP when its parent dies (`PR_SET_PDEATHSIG`), and checks that its parent is
//!    still `WORKER_PID`: a worker that died before the request could not trigger it, and then
//!    the supervisor exits 125 without starting the command;
//! 3. blocks SIGHUP, SIGTERM, SIGINT and SIGCHLD, to take them one at a time with `sigwait`.
//!
//! It starts the command with `posix_spawnp` (stdin, stdout, stderr and environment passed
//! through, `PATH` searched; the signal mask emptied and SIGPIPE set back to its default for it:
//! std's `Command` would pass the blocked mask on) and waits: on SIGHUP (the worker died, even by
//! `kill -9`) it SIGKILLs its whole process group, itself included, so no task process outlives
//! the worker; SIGTERM and SIGINT it ignores (the command gets them directly, as a member of the
//! group, and the supervisor still reports its status); when the command exits, it exits with
//! the command's code, or 128 + the signal that killed it (as a shell does).

use nix::errno::Errno;
use nix::spawn::{posix_spawnp, PosixSpawnAttr, PosixSpawnFileActions, PosixSpawnFlags};
use nix::sys::prctl;
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{getppid, Pid};
use std::ffi::{CString, OsString};
use std::os::unix::ffi::OsStrExt;

/// Exit code when the worker was gone before the supervisor could be signalled of its death.
pub const ORPHANED: i32 = 125;
/// Exit code when the command could not be started (not executable, or a set-up failure).
pub const CANNOT_START: i32 = 126;
/// Exit code when the command does not exist.
pub const NOT_FOUND: i32 = 127;
/// Exit code for a command line the supervisor cannot read (a bug of the worker's).
pub const USAGE: i32 = 2;

/// Runs the supervisor on its command line (program name first) and returns its exit code.
pub fn run(args: impl IntoIterator<Item = OsString>) -> i32 {
    let mut args = args.into_iter().skip(1);
    let worker = args.next().and_then(|a| a.to_str()?.parse::<i32>().ok());
    let command: Option<Vec<CString>> = args.map(|a| CString::new(a.as_bytes()).ok()).collect();
    let (Some(worker), Some(command)) = (worker, command.filter(|c| !c.is_empty())) else {
        eprintln!("usage: drumline-supervisor WORKER_PID COMMAND [ARG...]");
        return USAGE;
    };
    match prepare(worker) {
        Ok(()) => {}
        Err(Errno::ESRCH) => return ORPHANED,
        Err(e) => {
            eprintln!("drumline-supervisor: cannot set itself up: {e}");
            return CANNOT_START;
        }
    }
    let child = match start(&command) {
        Ok(child) => child,
        Err(e) => {
            eprintln!("drumline-supervisor: cannot start {:?}: {e}", command[0]);
            return if e == Errno::ENOENT {
                NOT_FOUND
            } else {
                CANNOT_START
            };
        }
    };
    let waited = waited_signals();
    loop {
        match waited.wait() {
            Ok(Signal::SIGHUP) => {
                // The worker died: the whole group goes, this process with it.
                let _ = kill(Pid::from_raw(0), Signal::SIGKILL);
            }
            Ok(Signal::SIGCHLD) => match waitpid(child, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(_, code)) => return code,
                Ok(WaitStatus::Signaled(_, signal, _)) => return 128 + signal as i32,
                // Stopped or continued, or not changed after all.
                Ok(_) => {}
                Err(e) => {
                    eprintln!("drumline-supervisor: cannot wait for the command: {e}");
                    return CANNOT_START;
                }
            },
            // SIGTERM, SIGINT: the command received them too; its status comes with SIGCHLD.
            _ => {}
        }
    }
}

/// Starts `command` (program first, looked up on `PATH`) with this process's environment and
/// standard streams, the signal mask empty and SIGPIPE at its default.
fn start(command: &[CString]) -> nix::Result<Pid> {
    let mut attr = PosixSpawnAttr::init()?;
    attr.set_sigmask(&SigSet::empty())?;
    let mut default = SigSet::empty();
    default.add(Signal::SIGPIPE);
    attr.set_sigdefault(&default)?;
    attr.set_flags(
        PosixSpawnFlags::POSIX_SPAWN_SETSIGMASK | PosixSpawnFlags::POSIX_SPAWN_SETSIGDEF,
    )?;
    let env: Vec<CString> = std::env::vars_os()
        .filter_map(|(key, value)| {
            let mut pair = key.as_bytes().to_vec();
            pair.push(b'=');
            pair.extend_from_slice(value.as_bytes());
            CString::new(pair).ok()
        })
        .collect();
    posix_spawnp(
        &command[0],
        &PosixSpawnFileActions::init()?,
        &attr,
        command,
        &env,
    )
}

/// Steps 1–3 of the module doc; `Err(ESRCH)` when the parent is no longer `worker`.
fn prepare(worker: i32) -> nix::Result<()> {
    prctl::set_dumpable(false)?;
    prctl::set_pdeathsig(Signal::SIGHUP)?;
    waited_signals().thread_block()?;
    // After the parent-death request: a worker that dies from now on is noticed.
    if getppid().as_raw() != worker {
        return Err(Errno::ESRCH);
    }
    Ok(())
}

/// The signals the supervisor takes with `sigwait`.
fn waited_signals() -> SigSet {
    let mut set = SigSet::empty();
    for signal in [
        Signal::SIGHUP,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGCHLD,
    ] {
        set.add(signal);
    }
    set
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_line_without_a_command_is_refused() {
        let args = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(run(args(&["drumline-supervisor"])), USAGE);
        assert_eq!(run(args(&["drumline-supervisor", "12"])), USAGE);
        assert_eq!(run(args(&["drumline-supervisor", "x", "/bin/true"])), USAGE);
    }
}
