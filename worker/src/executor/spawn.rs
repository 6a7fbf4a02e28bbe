//! Starting a task process without copying the worker: `clone(CLONE_VM | CLONE_VFORK)`, the
//! way glibc's `posix_spawn` does it, plus the two steps `posix_spawn` has no hook for: the
//! child registers its process group with the [sentinel](super::Sentinel) *before* it execs
//! the command (so no process of the task can exist unregistered), and the parent gets a pidfd
//! to await the exit on.
//!
//! A `fork` (what `Command::pre_exec` forces) copies the page tables of the whole worker for
//! every run, and that, not the exec, was the bulk of a short task's cost (issue 11). The
//! child here shares the worker's memory until it execs, with the parent thread suspended, so
//! it may only make raw system calls: it allocates nothing, takes no lock, and touches only
//! the [`Exec`] block prepared for it.
#![allow(unsafe_code)]

use libc::{c_char, c_int, c_void};
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr;
use std::sync::atomic::{AtomicI32, Ordering};

/// The child's stack: it runs a few system calls and no Rust code that allocates.
const STACK: usize = 64 * 1024;

/// Where the child failed, written back through the shared memory before it exits.
const FAILED_REGISTER: i32 = 1;
const FAILED_EXEC: i32 = 2;

/// A started task process: it leads its own process group (`pgid == pid`).
pub(super) struct Spawned {
    pub pid: i32,
    pub pidfd: OwnedFd,
}

/// Why a task process could not be started.
pub(super) enum SpawnError {
    /// The command could not be executed (errno of the last `execve`).
    Exec(io::Error),
    /// The sentinel did not take the registration (it is gone).
    Register(io::Error),
    /// `clone` or `pipe2` failed.
    Os(io::Error),
}

/// Everything the child reads. Built by the parent; the pointers stay valid until `clone`
/// returns, which (CLONE_VFORK) is after the child's exec or exit.
struct Exec {
    /// Paths to try, in order (`execvp` semantics; one entry when the command has a `/`).
    paths: Vec<*const c_char>,
    /// `argv`, null-terminated.
    argv: Vec<*const c_char>,
    /// `/bin/sh`'s `argv` for a file without a `#!` line (`ENOEXEC`), as `execvp` and a shell
    /// would run it: `["/bin/sh", PATH, args…, null]`, slot 1 filled in by the child.
    sh_argv: Vec<*const c_char>,
    envp: Vec<*const c_char>,
    stdin: RawFd,
    registry: RawFd,
    failed: AtomicI32,
    errno: AtomicI32,
}

/// Starts `argv` (tried at each of `paths`) with the environment `env` then `context`, stdin
/// from `stdin`, in a new process group registered on `registry` before the exec. stdout and
/// stderr are the worker's.
pub(super) fn spawn(
    paths: &[CString],
    argv: &[CString],
    env: &[CString],
    context: &[CString],
    stdin: &OwnedFd,
    registry: RawFd,
) -> Result<Spawned, SpawnError> {
    let nul = |v: &[CString]| -> Vec<*const c_char> {
        v.iter()
            .map(|s| s.as_ptr())
            .chain(std::iter::once(ptr::null()))
            .collect()
    };
    let sh = c"/bin/sh";
    let mut sh_argv = vec![sh.as_ptr(), ptr::null()];
    sh_argv.extend(argv.iter().skip(1).map(|s| s.as_ptr()));
    sh_argv.push(ptr::null());
    let mut exec = Exec {
        paths: paths.iter().map(|s| s.as_ptr()).collect(),
        argv: nul(argv),
        sh_argv,
        envp: env
            .iter()
            .chain(context)
            .map(|s| s.as_ptr())
            .chain(std::iter::once(ptr::null()))
            .collect(),
        stdin: stdin.as_raw_fd(),
        registry,
        failed: AtomicI32::new(0),
        errno: AtomicI32::new(0),
    };
    let mut stack = vec![0u8; STACK];
    let mut pidfd: c_int = -1;
    // SAFETY: all signals are blocked on this thread for the clone, so no handler of the
    // worker's can run in the child (which shares our memory) before it has reset them;
    // `child` only makes system calls on `exec`, which outlives the call (CLONE_VFORK
    // suspends us until the child execs or exits). The stack top is 16-byte aligned.
    let pid = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let top = stack.as_mut_ptr().add(STACK) as usize & !15;
        let pid = libc::clone(
            child,
            top as *mut c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PIDFD | libc::SIGCHLD,
            &mut exec as *mut Exec as *mut c_void,
            &mut pidfd as *mut c_int,
        );
        let err = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, ptr::null_mut());
        if pid == -1 {
            return Err(SpawnError::Os(err));
        }
        pid
    };
    drop(stack);
    // SAFETY: the kernel gave us this fresh pidfd (CLONE_PIDFD); nobody else owns it.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    let failed = exec.failed.load(Ordering::Acquire);
    if failed == 0 {
        return Ok(Spawned { pid, pidfd });
    }
    // The child has exited: reap it.
    let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
    let err = io::Error::from_raw_os_error(exec.errno.load(Ordering::Acquire));
    Err(match failed {
        FAILED_REGISTER => SpawnError::Register(err),
        _ => SpawnError::Exec(err),
    })
}

/// The child: reset signal handlers, new process group, register it, stdin, unblock, exec.
extern "C" fn child(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the parent's `Exec`, alive and not touched by the parent (suspended)
    // until we exec or exit. Everything below is a plain system call.
    unsafe {
        let exec = arg as *mut Exec;
        let fail = move |stage: i32| -> ! {
            (*exec)
                .errno
                .store(*libc::__errno_location(), Ordering::Release);
            (*exec).failed.store(stage, Ordering::Release);
            libc::_exit(127)
        };
        // A handler of the worker's must not run here, in its memory; ignored signals stay
        // ignored across exec except SIGPIPE, which Rust ignores and std resets for children.
        for sig in 1..=libc::SIGRTMAX() {
            let mut sa: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, ptr::null(), &mut sa) == 0
                && (sig == libc::SIGPIPE
                    || (sa.sa_sigaction != libc::SIG_DFL && sa.sa_sigaction != libc::SIG_IGN))
            {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &dfl, ptr::null_mut());
            }
        }
        if libc::setpgid(0, 0) != 0 {
            fail(FAILED_EXEC);
        }
        // Registered before the command exists: from here on, the worker's death kills the
        // whole group (the sentinel sees end of file once this copy closes on exec).
        let pid = libc::syscall(libc::SYS_getpid) as u64;
        let mut line = [0u8; 24];
        let mut at = line.len() - 1;
        line[at] = b'\n';
        let mut n = pid;
        loop {
            at -= 1;
            line[at] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        at -= 1;
        line[at] = b'+';
        let len = line.len() - at;
        if libc::write(
            (*exec).registry,
            line.as_ptr().add(at) as *const c_void,
            len,
        ) != len as isize
        {
            fail(FAILED_REGISTER);
        }
        if (*exec).stdin == 0 {
            // pipe2 handed out fd 0 (the worker has no stdin): keep it across exec.
            libc::fcntl(0, libc::F_SETFD, 0);
        } else if libc::dup2((*exec).stdin, 0) != 0 {
            fail(FAILED_EXEC);
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, ptr::null_mut());
        // execvp's search: skip what is not there, remember a permission problem.
        let mut eacces = false;
        for i in 0..(*exec).paths.len() {
            let path = (&(*exec).paths)[i];
            libc::execve(path, (*exec).argv.as_ptr(), (*exec).envp.as_ptr());
            match *libc::__errno_location() {
                libc::ENOEXEC => {
                    (&mut (*exec).sh_argv)[1] = path;
                    let sh_argv = (*exec).sh_argv.as_ptr();
                    libc::execve(*sh_argv, sh_argv, (*exec).envp.as_ptr());
                    fail(FAILED_EXEC);
                }
                libc::EACCES => eacces = true,
                libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT => {}
                _ => fail(FAILED_EXEC),
            }
        }
        if eacces {
            *libc::__errno_location() = libc::EACCES;
        }
        fail(FAILED_EXEC)
    }
}

/// A pipe whose both ends close on exec (the child dups the read end onto its stdin).
pub(super) fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as c_int; 2];
    // SAFETY: pipe2 fills `fds` with two new descriptors that we then own.
    unsafe {
        if libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])))
    }
}

/// `pidfd` as a tokio readiness source: readable once the process has exited.
pub(super) fn watch(pidfd: OwnedFd) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    // SAFETY: the `OwnedFd` keeps the descriptor open for as long as the `AsyncFd` holds it.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
    }
    .map_err(io::Error::from)
}
