//! `drumline-supervisor WORKER_PID`: a process that starts, watches and kills a worker's shell
//! tasks (docs/design.md#the-task-supervisor); a worker has one per core, at most four, and
//! gives them its runs in turn. The worker starts each on first use, in a process group of its
//! own, its end of a `SOCK_SEQPACKET` socket pair as stdin; the worker talks to it through
//! [`link`], in the messages of [`wire`].
//!
//! Before it reads a request it
//!
//! 1. makes itself non-dumpable (`PR_SET_DUMPABLE = 0`): a task running as the same user can
//!    then neither read its `/proc/<pid>/environ` or `mem` nor ptrace it
//!    (docs/design.md#tasks-cannot-read-the-worker); a flag set by the worker before the exec
//!    would not do (`execve` makes a process dumpable again);
//! 2. checks that its parent is still `WORKER_PID` (else it exits 125, [`ORPHANED`]);
//! 3. blocks SIGTERM, SIGINT and SIGHUP: a `systemctl stop` that signals every process of the
//!    service must not take the supervisor before the tasks it watches (they get the signal
//!    themselves, with an empty mask).
//!
//! Then, one request at a time, it starts each task with `posix_spawn` (a vfork-style clone:
//! the supervisor is small, and nothing of ours runs between fork and exec) as the leader of a
//! new process group, and holds its **pidfd** in an epoll set. A task is registered only once
//! it runs: a start that fails leaves nothing behind. When a leader exits, the supervisor
//! SIGKILLs its group *before* reaping it: until it is reaped, the leader's pid (the group's
//! id) cannot be reused, so no signal ever reaches another process through a stale number.
//! When the worker's end of the socket closes (the worker exited or died, even by `kill -9`,
//! alone or with its whole process group: the supervisor is not in it), the supervisor
//! SIGKILLs every task's group, reaps them and exits: no task outlives its worker.
//!
//! It also holds each task's lease deadline ([`deadline`]), sent with the start and moved by
//! each renewal: a task still running at its stop point gets SIGTERM, then SIGKILL after the
//! kill grace, from the supervisor itself, so a frozen worker's task is dead before its lease
//! can be taken over (docs/design.md#the-task-supervisor). A `CLOCK_BOOTTIME` timerfd in the
//! epoll set wakes it for the next step. Each step costs the same with one task running or
//! thousands (a hash map, an ordered set and epoll, no scan).

pub mod deadline;
pub mod link;
pub mod wire;

use deadline::{Deadlines, Stop};
use nix::spawn::{PosixSpawnAttr, PosixSpawnFileActions, PosixSpawnFlags};
use nix::sys::prctl;
use nix::sys::signal::{SigSet, Signal};
use nix::unistd::getppid;
use rustix::event::epoll;
use rustix::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use rustix::process::{Pid, PidfdFlags, WaitId, WaitIdOptions};
use rustix::time::{
    timerfd_create, timerfd_settime, Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags,
    Timespec,
};
use std::collections::HashMap;
use std::ffi::{CStr, CString, OsString};
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::unix::ffi::OsStrExt;
use wire::{Reply, Request, Start, Status};

/// Exit code when the worker was gone before the supervisor started.
pub const ORPHANED: i32 = 125;
/// Exit code when the supervisor cannot set itself up or its socket fails.
pub const BROKEN: i32 = 126;
/// Exit code for a command line the supervisor cannot read (a bug of the worker's).
pub const USAGE: i32 = 2;

/// The largest request the supervisor reads (a start with its whole environment).
pub const MAX_MESSAGE: usize = 256 * 1024;

/// The epoll token of the socket; every token but these two is a task's id (ids count up
/// from 1).
const SOCKET: u64 = u64::MAX;
/// The epoll token of the deadline timer.
const TIMER: u64 = u64::MAX - 1;

/// The first argument that makes a binary the built-in supervisor ([`builtin`]).
pub const BUILTIN: &str = "__supervisor";

/// When this process was started as the built-in supervisor (its first argument
/// [`BUILTIN`], by [`crate::executor::use_builtin_supervisor`]), runs it and returns its exit
/// code; `None` otherwise. A binary's `main` calls it before anything else: nothing of the
/// binary itself (logging, a runtime, the config) runs in the supervisor.
pub fn builtin() -> Option<i32> {
    let mut args = std::env::args_os();
    let _program = args.next();
    if args.next().as_deref() != Some(std::ffi::OsStr::new(BUILTIN)) {
        return None;
    }
    Some(run(std::env::args_os().skip(1)))
}

/// Runs the supervisor on its command line (program name first) and returns its exit code.
pub fn run(args: impl IntoIterator<Item = OsString>) -> i32 {
    let args: Vec<OsString> = args.into_iter().skip(1).collect();
    let worker = match args.as_slice() {
        [pid] => pid.to_str().and_then(|p| p.parse::<i32>().ok()),
        _ => None,
    };
    let Some(worker) = worker else {
        eprintln!(
            "usage: drumline-supervisor WORKER_PID (its socket on stdin; the worker starts it)"
        );
        return USAGE;
    };
    if let Err(e) = prepare() {
        eprintln!("drumline-supervisor: cannot set itself up: {e}");
        return BROKEN;
    }
    if getppid().as_raw() != worker {
        return ORPHANED;
    }
    match Supervisor::new().and_then(|mut s| s.serve()) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("drumline-supervisor: {e}");
            BROKEN
        }
    }
}

/// Steps 1 and 3 of the module doc.
fn prepare() -> nix::Result<()> {
    prctl::set_dumpable(false)?;
    let mut blocked = SigSet::empty();
    for signal in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        blocked.add(signal);
    }
    blocked.thread_block()
}

/// A task that runs: its leader's pid (also its group's id) and pidfd.
struct Task {
    pid: Pid,
    pidfd: OwnedFd,
}

struct Supervisor {
    socket: OwnedFd,
    epoll: OwnedFd,
    tasks: HashMap<u64, Task>,
    /// The tasks' lease deadlines, and the timer armed for the next step due.
    deadlines: Deadlines,
    timer: OwnedFd,
}

impl Supervisor {
    /// Moves the socket off stdin (a task must not inherit it) and sets up the epoll set.
    fn new() -> std::io::Result<Self> {
        let socket = rustix::io::fcntl_dupfd_cloexec(rustix::stdio::stdin(), 3)?;
        let null = rustix::fs::open(
            "/dev/null",
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )?;
        rustix::stdio::dup2_stdin(&null)?;
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let timer = timerfd_create(
            TimerfdClockId::Boottime,
            TimerfdFlags::CLOEXEC | TimerfdFlags::NONBLOCK,
        )?;
        for (fd, token) in [(&socket, SOCKET), (&timer, TIMER)] {
            epoll::add(
                &epoll,
                fd,
                epoll::EventData::new_u64(token),
                epoll::EventFlags::IN,
            )?;
        }
        Ok(Self {
            socket,
            epoll,
            tasks: HashMap::new(),
            deadlines: Deadlines::default(),
            timer,
        })
    }

    /// Serves until the worker's end closes, then kills every task.
    fn serve(&mut self) -> std::io::Result<()> {
        let mut events = Vec::with_capacity(64);
        let mut buf = vec![0u8; MAX_MESSAGE];
        loop {
            events.clear();
            match epoll::wait(
                &self.epoll,
                rustix::buffer::spare_capacity(&mut events),
                None,
            ) {
                Ok(_) => {}
                Err(Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
            for event in events.drain(..) {
                let served = match event.data.u64() {
                    SOCKET => self.read_requests(&mut buf),
                    TIMER => {
                        self.stop_overdue();
                        Ok(())
                    }
                    id => self.reap(id),
                };
                // However the worker's end went (read or written), no task outlives it.
                if let Err(e) = served {
                    self.kill_all();
                    return match e {
                        Gone::Closed => Ok(()),
                        Gone::Failed(e) => Err(e),
                    };
                }
            }
            // A timer that cannot be set could not stop a task at its deadline: none stays.
            if let Err(e) = self.arm() {
                self.kill_all();
                return Err(e);
            }
        }
    }

    /// Signals every task whose deadline's next step is due (the timer fired).
    fn stop_overdue(&mut self) {
        // Read to clear its readiness; nothing to read means a re-arm overtook the expiry.
        let mut expirations = [0u8; 8];
        let _ = rustix::io::read(&self.timer, &mut expirations);
        while let Some((id, stop)) = self.deadlines.poll(deadline::now()) {
            let signal = match stop {
                Stop::Term => rustix::process::Signal::TERM,
                Stop::Kill => rustix::process::Signal::KILL,
            };
            // Only a registered task's: its leader is unreaped, its pid still its group's.
            if let Some(task) = self.tasks.get(&id) {
                let _ = rustix::process::kill_process_group(task.pid, signal);
            }
        }
    }

    /// Sets the timer to the next deadline step due (an absolute time), or disarms it.
    fn arm(&self) -> std::io::Result<()> {
        // All zero disarms the timer: a step is never due at 0 (the clock counts from boot).
        let at = self.deadlines.next_at().map_or(0, |at| at.max(1));
        let timespec = |ns: u64| Timespec {
            tv_sec: (ns / 1_000_000_000) as i64,
            tv_nsec: (ns % 1_000_000_000) as i64,
        };
        let spec = Itimerspec {
            it_interval: timespec(0),
            it_value: timespec(at),
        };
        timerfd_settime(&self.timer, TimerfdTimerFlags::ABSTIME, &spec)?;
        Ok(())
    }

    /// Handles every request waiting on the socket.
    fn read_requests(&mut self, buf: &mut [u8]) -> Result<(), Gone> {
        while let Some((len, fds)) = self.receive(buf)? {
            match Request::decode(&buf[..len]) {
                Ok(request) => self.handle(request, fds)?,
                Err(e) => return Err(Gone::Failed(std::io::Error::other(e))),
            }
        }
        Ok(())
    }

    /// The next request waiting on the socket, read into `buf`: its length and the descriptors
    /// that came with it; `None` when none waits.
    fn receive(&self, buf: &mut [u8]) -> Result<Option<(usize, Vec<OwnedFd>)>, Gone> {
        loop {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let got = rustix::net::recvmsg(
                &self.socket,
                &mut [IoSliceMut::new(buf)],
                &mut control,
                RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC,
            );
            let got = match got {
                Ok(got) => got,
                Err(Errno::AGAIN) => return Ok(None),
                Err(Errno::INTR) => continue,
                // The worker exited with replies unread: its end is gone all the same.
                Err(Errno::CONNRESET) => return Err(Gone::Closed),
                Err(e) => return Err(Gone::Failed(e.into())),
            };
            if got.bytes == 0 {
                return Err(Gone::Closed);
            }
            let mut fds: Vec<OwnedFd> = Vec::new();
            for message in control.drain() {
                if let RecvAncillaryMessage::ScmRights(received) = message {
                    fds.extend(received);
                }
            }
            if got.flags.contains(rustix::net::ReturnFlags::TRUNC) {
                return Err(Gone::Failed(std::io::Error::other(
                    "a request longer than the supervisor reads",
                )));
            }
            return Ok(Some((got.bytes, fds)));
        }
    }

    /// Does what `request` asks; `fds` are a start's descriptors (closed here otherwise).
    fn handle(&mut self, request: Request, fds: Vec<OwnedFd>) -> Result<(), Gone> {
        match request {
            Request::Start(start) => {
                let reply = self.start(&start, fds);
                // The pidfd goes along as a borrow: the kernel gives the worker its own.
                let pidfd = match reply {
                    Reply::Started { id, .. } => self.tasks.get(&id).map(|t| t.pidfd.as_fd()),
                    _ => None,
                };
                self.send(reply, pidfd)?;
            }
            Request::Signal { id, signal } => {
                if let (Some(task), Some(signal)) = (
                    self.tasks.get(&id),
                    rustix::process::Signal::from_named_raw(signal),
                ) {
                    // The leader is not reaped yet: its pid is still its group's.
                    let _ = rustix::process::kill_process_group(task.pid, signal);
                }
            }
            Request::Deadline { id, deadline } => {
                // A task reaped already has its `Exited` on the way: nothing to hold.
                if self.tasks.contains_key(&id) {
                    self.deadlines.hold(id, deadline);
                }
            }
            Request::Census { id } => {
                self.send(
                    Reply::Census {
                        id,
                        tasks: self.tasks.len(),
                    },
                    None,
                )?;
            }
        }
        Ok(())
    }

    /// Starts a task; the received descriptors are closed when this returns (the task has its
    /// copies).
    fn start(&mut self, start: &Start, fds: Vec<OwnedFd>) -> Reply {
        let failed = |errno: Errno| Reply::Failed {
            id: start.id,
            errno: errno.raw_os_error(),
        };
        let expected = if start.stdout { 3 } else { 2 };
        if fds.len() != expected || self.tasks.contains_key(&start.id) {
            return failed(Errno::INVAL);
        }
        let pid = match spawn(start, &fds) {
            Ok(pid) => pid,
            Err(errno) => return failed(errno),
        };
        // Registered before anything else can happen: from here, a closed socket kills it.
        let pidfd = match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
            Ok(pidfd) => pidfd,
            Err(errno) => {
                // Unreaped, so the number is still this task's.
                let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
                let _ = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty());
                return failed(errno);
            }
        };
        if let Err(errno) = epoll::add(
            &self.epoll,
            &pidfd,
            epoll::EventData::new_u64(start.id),
            epoll::EventFlags::IN,
        ) {
            let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
            let _ = rustix::process::waitid(WaitId::PidFd(pidfd.as_fd()), WaitIdOptions::EXITED);
            return failed(errno);
        }
        self.tasks.insert(start.id, Task { pid, pidfd });
        if let Some(deadline) = start.deadline {
            self.deadlines.hold(start.id, deadline);
        }
        Reply::Started {
            id: start.id,
            pid: pid.as_raw_nonzero().get(),
        }
    }

    /// Task `id`'s leader exited: kill what is left of its group, reap it, report.
    fn reap(&mut self, id: u64) -> Result<(), Gone> {
        let Some(task) = self.tasks.remove(&id) else {
            return Ok(());
        };
        self.deadlines.forget(id);
        let _ = rustix::process::kill_process_group(task.pid, rustix::process::Signal::KILL);
        let status = wait(&task.pidfd);
        // Out of the epoll set by hand: closing our pidfd would not do it while the worker
        // holds its copy (epoll watches the open file, not the descriptor), and a reaped
        // process's pidfd stays readable.
        let _ = epoll::delete(&self.epoll, &task.pidfd);
        drop(task);
        self.send(Reply::Exited { id, status }, None)
    }

    /// The worker is gone: every task's group goes, then the leaders are reaped.
    fn kill_all(&mut self) {
        for task in self.tasks.values() {
            let _ = rustix::process::kill_process_group(task.pid, rustix::process::Signal::KILL);
        }
        for (_, task) in self.tasks.drain() {
            wait(&task.pidfd);
        }
    }

    fn send(&self, reply: Reply, pidfd: Option<BorrowedFd<'_>>) -> Result<(), Gone> {
        let bytes = reply.encode();
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds;
        if let Some(fd) = pidfd {
            fds = [fd];
            control.push(SendAncillaryMessage::ScmRights(&fds));
        }
        loop {
            match rustix::net::sendmsg(
                &self.socket,
                &[IoSlice::new(&bytes)],
                &mut control,
                SendFlags::NOSIGNAL,
            ) {
                Ok(_) => return Ok(()),
                Err(Errno::INTR) => continue,
                Err(Errno::PIPE | Errno::CONNRESET) => return Err(Gone::Closed),
                Err(e) => return Err(Gone::Failed(e.into())),
            }
        }
    }
}

/// Why the supervisor stops serving.
enum Gone {
    /// The worker's end closed.
    Closed,
    Failed(std::io::Error),
}

impl From<Gone> for std::io::Error {
    fn from(g: Gone) -> Self {
        match g {
            Gone::Closed => std::io::Error::from(std::io::ErrorKind::BrokenPipe),
            Gone::Failed(e) => e,
        }
    }
}

/// Reaps an exited leader through its pidfd.
fn wait(pidfd: &OwnedFd) -> Status {
    loop {
        match rustix::process::waitid(WaitId::PidFd(pidfd.as_fd()), WaitIdOptions::EXITED) {
            Ok(Some(status)) => {
                return match (status.exit_status(), status.terminating_signal()) {
                    (_, Some(signal)) => Status::Signal(signal),
                    (Some(code), _) => Status::Code(code),
                    (None, None) => Status::Code(BROKEN),
                }
            }
            Err(Errno::INTR) => continue,
            _ => return Status::Code(BROKEN),
        }
    }
}

/// `posix_spawn`s the command as the leader of a new process group, its stdin, stderr and
/// (when sent) stdout the received descriptors, its signal mask empty and SIGPIPE at its default
/// (Rust ignores it in the supervisor, and an ignored signal stays ignored across `exec`).
fn spawn(start: &Start, fds: &[OwnedFd]) -> Result<Pid, Errno> {
    let errno = |e: nix::Error| Errno::from_raw_os_error(e as i32);
    let mut actions = PosixSpawnFileActions::init().map_err(errno)?;
    let targets: &[i32] = if start.stdout { &[0, 2, 1] } else { &[0, 2] };
    for (fd, &target) in fds.iter().zip(targets) {
        actions.add_dup2(fd.as_raw_fd(), target).map_err(errno)?;
    }
    let mut attr = PosixSpawnAttr::init().map_err(errno)?;
    attr.set_sigmask(&SigSet::empty()).map_err(errno)?;
    let mut default = SigSet::empty();
    default.add(Signal::SIGPIPE);
    attr.set_sigdefault(&default).map_err(errno)?;
    attr.set_pgroup(nix::unistd::Pid::from_raw(0))
        .map_err(errno)?;
    attr.set_flags(
        PosixSpawnFlags::POSIX_SPAWN_SETSIGMASK
            | PosixSpawnFlags::POSIX_SPAWN_SETSIGDEF
            | PosixSpawnFlags::POSIX_SPAWN_SETPGROUP,
    )
    .map_err(errno)?;
    let program = program(&start.argv[0], &start.env)?;
    let pid = nix::spawn::posix_spawn(program.as_c_str(), &actions, &attr, &start.argv, &start.env)
        .map_err(errno)?;
    Pid::from_raw(pid.as_raw()).ok_or(Errno::SRCH)
}

/// The program to run: `name` itself when it holds a `/`, else the first executable file of
/// that name in the task's `PATH` (as `execvp` looks; a default when the task has none).
fn program(name: &CStr, env: &[CString]) -> Result<CString, Errno> {
    if name.to_bytes().contains(&b'/') {
        return Ok(name.to_owned());
    }
    let path = env
        .iter()
        .find_map(|e| e.to_bytes().strip_prefix(b"PATH="))
        .unwrap_or(b"/usr/local/bin:/usr/bin:/bin");
    // As `execvp`: a file found but not executable answers EACCES unless a later one runs.
    let mut found = Errno::NOENT;
    for dir in path.split(|&b| b == b':') {
        let dir = if dir.is_empty() { &b"."[..] } else { dir };
        let mut candidate = dir.to_vec();
        candidate.push(b'/');
        candidate.extend_from_slice(name.to_bytes());
        let Ok(candidate) = CString::new(candidate) else {
            continue;
        };
        match rustix::fs::access(candidate.as_c_str(), rustix::fs::Access::EXEC_OK) {
            Ok(())
                if !std::path::Path::new(std::ffi::OsStr::from_bytes(candidate.as_bytes()))
                    .is_dir() =>
            {
                return Ok(candidate)
            }
            Ok(()) => {}
            Err(Errno::ACCESS) => found = Errno::ACCESS,
            Err(_) => {}
        }
    }
    Err(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_line_that_is_not_one_worker_pid_is_refused() {
        let args = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(run(args(&["drumline-supervisor"])), USAGE);
        assert_eq!(run(args(&["drumline-supervisor", "x"])), USAGE);
        assert_eq!(
            run(args(&["drumline-supervisor", "12", "/bin/true"])),
            USAGE
        );
    }

    #[test]
    fn a_program_is_looked_for_on_the_tasks_path() {
        let c = |s: &str| CString::new(s).unwrap();
        assert_eq!(
            program(&c("sh"), &[c("PATH=/nonexistent:/bin")]),
            Ok(c("/bin/sh"))
        );
        assert_eq!(
            program(&c("sh"), &[c("PATH=/nonexistent")]),
            Err(Errno::NOENT)
        );
        assert_eq!(program(&c("./x"), &[]), Ok(c("./x")));
        // A directory of that name is not a program.
        assert_eq!(program(&c("bin"), &[c("PATH=/")]), Err(Errno::NOENT));
    }
}
