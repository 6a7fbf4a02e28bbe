//! The worker's side of its supervisors ([`super`]): starts them on first use, sends them
//! requests, and routes their replies to the runs that wait for them. A worker has one
//! supervisor per core (at most [`MAX_SUPERVISORS`]), each on a link of its own, and gives its
//! runs to them in turn: a supervisor starts one task at a time (`posix_spawn` holds it until
//! the task's `exec`), so two let two tasks start at once, as two cores can. A link that broke,
//! or whose runtime shut down, is replaced (with a new supervisor) on its next use.
//!
//! Nothing here waits on a thread but starting a supervisor (a `posix_spawn`, once per core,
//! under the slot's lock): the socket is non-blocking under tokio's reactor, and a request that
//! finds the socket full waits for room in the run's own task (a kill from a `Drop` is sent
//! from a task of its own then).

use super::wire::{Deadline, Reply, Request, Start, Status};
use drumline_shared::config::{ENV_AMQP_URL, ENV_REDIS_URL};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};
use std::collections::HashMap;
use std::ffi::{CString, OsString};
use std::io;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::Interest;
use tokio::net::UnixDatagram;
use tokio::sync::mpsc;

/// A task to start: its command line and whole environment, and the ends of its standard
/// streams that it gets (the worker keeps the other ends).
pub struct Spec {
    /// The command line, program first.
    pub argv: Vec<CString>,
    /// Its whole environment, `NAME=value` each.
    pub env: Vec<CString>,
    /// The task's end of its stdin (the args as JSON come through it).
    pub stdin: OwnedFd,
    /// The task's end of its stderr.
    pub stderr: OwnedFd,
    /// The task's end of its stdout, when the worker reads it (else it is the worker's own).
    pub stdout: Option<OwnedFd>,
    /// When the supervisor stops the task on its own (its lease's stop point), unless
    /// [`Task::hold_until`] moves it.
    pub deadline: Option<Deadline>,
}

/// The supervisor went away while the task ran (it was killed, or the link broke and the worker
/// closed it: a supervisor whose link closes kills every task it holds). The task itself was
/// killed through its pidfd.
#[derive(Debug, thiserror::Error)]
#[error("the task supervisor died while the task ran; the task was killed")]
pub struct Lost;

/// Why a task could not be started.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The supervisor tried and the kernel refused (`ENOENT`: no such program). Nothing runs.
    #[error("{0}")]
    Refused(io::Error),
    /// The supervisor could not be reached or started.
    #[error("the task supervisor is unavailable: {0}")]
    Unavailable(io::Error),
    /// The command line and environment, this many bytes, are more than one start carries
    /// ([`MAX_START`]).
    #[error("a task start of {0} bytes is more than {MAX_START}")]
    TooLarge(usize),
}

/// The most bytes of command line and environment one start carries: one `SOCK_SEQPACKET`
/// message, within the socket's default send buffer (about 208 KiB) and the supervisor's read
/// ([`super::MAX_MESSAGE`]).
pub const MAX_START: usize = 192 * 1024;

/// What the reader hands a run.
enum Event {
    Started { pid: i32, pidfd: Option<OwnedFd> },
    Failed(i32),
    Exited(Status),
    Census(usize),
    Lost,
}

struct Link {
    /// A `SOCK_SEQPACKET` socket, held as a `UnixDatagram` (connected, one message per
    /// packet) for tokio's readiness; every send and receive goes through `sendmsg`/`recvmsg`.
    socket: UnixDatagram,
    runs: Mutex<HashMap<u64, mpsc::UnboundedSender<Event>>>,
    next: AtomicU64,
    alive: AtomicBool,
}

/// The most supervisors a worker starts, whatever its cores.
pub const MAX_SUPERVISORS: usize = 4;

/// The links, one slot per supervisor, and whose turn it is.
struct Links {
    slots: Vec<Mutex<Option<Arc<Link>>>>,
    turn: AtomicU64,
}

fn links() -> &'static Links {
    static LINKS: std::sync::OnceLock<Links> = std::sync::OnceLock::new();
    LINKS.get_or_init(|| {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        Links {
            slots: (0..n.clamp(1, MAX_SUPERVISORS))
                .map(|_| Mutex::new(None))
                .collect(),
            turn: AtomicU64::new(0),
        }
    })
}

/// How the worker starts a supervisor: a program and the arguments before the worker's pid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    /// The executable: `drumline-supervisor`, or the running binary itself.
    pub path: PathBuf,
    /// The arguments before the worker's pid (the built-in supervisor's [`super::BUILTIN`]).
    pub leading: Vec<OsString>,
}

/// The next link in turn, started (with its supervisor, `program`) when it is not live.
fn link(program: &Program) -> io::Result<Arc<Link>> {
    let links = links();
    let turn = links.turn.fetch_add(1, Ordering::Relaxed) as usize % links.slots.len();
    let mut current = links.slots[turn].lock().expect("supervisor link lock");
    if let Some(link) = current.as_ref().filter(|l| l.alive.load(Ordering::Acquire)) {
        return Ok(link.clone());
    }
    let (ours, theirs) = rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?;
    // The supervisor reads its end as stdin, blocking.
    rustix::io::ioctl_fionbio(&theirs, false)?;
    let child = tokio::process::Command::new(&program.path)
        .args(&program.leading)
        .arg(std::process::id().to_string())
        .stdin(Stdio::from(theirs))
        // It needs neither URL; every task gets its own environment with each start.
        .env_remove(ENV_AMQP_URL)
        .env_remove(ENV_REDIS_URL)
        // Not in the worker's group: a kill of that whole group must leave the supervisor to
        // see the worker's end close and kill the tasks.
        .process_group(0)
        .spawn()?;
    let link = Arc::new(Link {
        socket: UnixDatagram::from_std(std::os::unix::net::UnixDatagram::from(ours))?,
        runs: Mutex::new(HashMap::new()),
        next: AtomicU64::new(1),
        alive: AtomicBool::new(true),
    });
    tokio::spawn(read(link.clone(), child));
    *current = Some(link.clone());
    Ok(link)
}

impl Link {
    fn register(self: &Arc<Self>) -> (Registration, mpsc::UnboundedReceiver<Event>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        self.runs.lock().expect("runs lock").insert(id, tx);
        // A link that broke before the insert would never tell this run.
        if !self.alive.load(Ordering::Acquire) {
            self.lose();
        }
        let registration = Registration {
            link: self.clone(),
            id,
            kill_on_drop: true,
        };
        (registration, rx)
    }

    /// Sends `request` (with `fds`), waiting for room in the socket.
    async fn send(&self, request: &Request, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        self.send_encoded(&request.encode(), fds).await
    }

    /// [`Link::send`] of a request already encoded.
    async fn send_encoded(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        loop {
            self.socket.writable().await?;
            match self
                .socket
                .try_io(Interest::WRITABLE, || send_now(&self.socket, bytes, fds))
            {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                result => return result,
            }
        }
    }

    /// Sends a kill from a `Drop`: at once when the socket has room, else from a task.
    fn kill_from_drop(self: &Arc<Self>, id: u64) {
        let request = Request::Signal {
            id,
            signal: libc_sigkill(),
        };
        match send_now(&self.socket, &request.encode(), &[]) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    let link = self.clone();
                    runtime.spawn(async move { link.send(&request, &[]).await });
                }
            }
            _ => {}
        }
    }

    /// Tells every run the link is gone and marks it so the next start makes a new one.
    fn lose(&self) {
        self.alive.store(false, Ordering::Release);
        for (_, run) in self.runs.lock().expect("runs lock").drain() {
            let _ = run.send(Event::Lost);
        }
    }

    fn deliver(&self, reply: Reply, pidfd: Option<OwnedFd>) {
        let (id, event) = match reply {
            Reply::Started { id, pid } => (id, Event::Started { pid, pidfd }),
            Reply::Failed { id, errno } => (id, Event::Failed(errno)),
            Reply::Exited { id, status } => (id, Event::Exited(status)),
            Reply::Census { id, tasks } => (id, Event::Census(tasks)),
        };
        if let Some(run) = self.runs.lock().expect("runs lock").get(&id) {
            let _ = run.send(event);
        }
    }
}

/// SIGKILL's number, for the wire.
fn libc_sigkill() -> i32 {
    rustix::process::Signal::KILL.as_raw()
}

fn send_now(socket: &UnixDatagram, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        control.push(SendAncillaryMessage::ScmRights(fds));
    }
    rustix::net::sendmsg(
        socket,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
    )
    .map(drop)
    .map_err(io::Error::from)
}

/// Reads replies until the supervisor's end closes (it died) or the runtime drops this task;
/// either way the link is lost for every run still on it.
async fn read(link: Arc<Link>, mut supervisor: tokio::process::Child) {
    struct LoseOnDrop(Arc<Link>);
    impl Drop for LoseOnDrop {
        fn drop(&mut self) {
            self.0.lose();
        }
    }
    let guard = LoseOnDrop(link);
    let link = &guard.0;
    let mut buf = [0u8; 256];
    loop {
        if link.socket.readable().await.is_err() {
            break;
        }
        let received = link.socket.try_io(Interest::READABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let got = rustix::net::recvmsg(
                &link.socket,
                &mut [IoSliceMut::new(&mut buf)],
                &mut control,
                RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC,
            )?;
            let mut fds = Vec::new();
            for message in control.drain() {
                if let RecvAncillaryMessage::ScmRights(received) = message {
                    fds.extend(received);
                }
            }
            Ok((got.bytes, fds))
        });
        match received {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(_) | Ok((0, _)) => break,
            Ok((n, mut fds)) => match Reply::decode(&buf[..n]) {
                Ok(reply) => link.deliver(reply, fds.pop()),
                Err(e) => {
                    tracing::error!(error = %e, "the task supervisor sent a message out of shape; starting another");
                    break;
                }
            },
        }
    }
    let link = guard.0.clone();
    drop(guard);
    // Closed, not killed: a supervisor that sees its link close kills every task it holds
    // (a SIGKILL would leave them running).
    let _ = rustix::net::shutdown(&link.socket, rustix::net::Shutdown::Both);
    let _ = supervisor.wait().await;
}

/// A run's place on the link: while it is held the run's replies reach it; dropped, it stops
/// them and, unless the task is known to have ended, kills the task's group.
struct Registration {
    link: Arc<Link>,
    id: u64,
    kill_on_drop: bool,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.link.runs.lock().expect("runs lock").remove(&self.id);
        if self.kill_on_drop && self.link.alive.load(Ordering::Acquire) {
            self.link.kill_from_drop(self.id);
        }
    }
}

/// A task that runs under the supervisor. Dropped before [`Task::wait`] returned, it kills the
/// task's whole group.
pub struct Task {
    registration: Registration,
    events: mpsc::UnboundedReceiver<Event>,
    pid: i32,
    pidfd: Option<OwnedFd>,
}

/// Starts a task under the supervisor at `program` (started first when there is none).
pub async fn start(program: &Program, spec: Spec) -> Result<Task, StartError> {
    let link = link(program).map_err(StartError::Unavailable)?;
    let (mut registration, mut events) = link.register();
    let request = Request::Start(Start {
        id: registration.id,
        stdout: spec.stdout.is_some(),
        deadline: spec.deadline,
        argv: spec.argv,
        env: spec.env,
    });
    let bytes = request.encode();
    if bytes.len() > MAX_START {
        registration.kill_on_drop = false;
        return Err(StartError::TooLarge(bytes.len()));
    }
    let mut fds = vec![spec.stdin.as_fd(), spec.stderr.as_fd()];
    fds.extend(spec.stdout.as_ref().map(|fd| fd.as_fd()));
    link.send_encoded(&bytes, &fds)
        .await
        .map_err(StartError::Unavailable)?;
    // The task has its copies; ours close now, so the worker sees the streams end with it.
    drop((spec.stdin, spec.stderr, spec.stdout));
    match events.recv().await {
        Some(Event::Started { pid, pidfd }) => Ok(Task {
            registration,
            events,
            pid,
            pidfd,
        }),
        Some(Event::Failed(errno)) => {
            // Nothing was registered: there is nothing to kill.
            registration.kill_on_drop = false;
            Err(StartError::Refused(io::Error::from_raw_os_error(errno)))
        }
        _ => Err(StartError::Unavailable(io::Error::other(
            "the task supervisor died",
        ))),
    }
}

impl Task {
    /// The leader's pid (its group's id).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Waits until the leader exits (its group killed after it). Cancel-safe.
    pub async fn wait(&mut self) -> Result<Status, Lost> {
        loop {
            match self.events.recv().await {
                Some(Event::Exited(status)) => {
                    self.registration.kill_on_drop = false;
                    return Ok(status);
                }
                Some(Event::Started { .. } | Event::Failed(_) | Event::Census(_)) => continue,
                Some(Event::Lost) | None => {
                    self.kill_orphaned();
                    return Err(Lost);
                }
            }
        }
    }

    /// Sends `signal` to the task's group.
    pub async fn signal(&self, signal: rustix::process::Signal) {
        let request = Request::Signal {
            id: self.registration.id,
            signal: signal.as_raw(),
        };
        let _ = self.registration.link.send(&request, &[]).await;
    }

    /// Moves the task's deadline (its lease was renewed): the supervisor stops it then unless
    /// it is moved again. Ignored once the supervisor began stopping it.
    pub async fn hold_until(&self, deadline: Deadline) {
        let request = Request::Deadline {
            id: self.registration.id,
            deadline,
        };
        let _ = self.registration.link.send(&request, &[]).await;
    }

    /// The supervisor is gone (killed: a supervisor whose link closes kills its tasks itself)
    /// and the task was reparented: kill it through its pidfd. Only the leader: once the
    /// supervisor is gone, nothing holds the leader unreaped, so its number, the group's id,
    /// could be reused and is not signalled (children it started may survive this case).
    fn kill_orphaned(&mut self) {
        self.registration.kill_on_drop = false;
        if let Some(pidfd) = &self.pidfd {
            let _ = rustix::process::pidfd_send_signal(pidfd, rustix::process::Signal::KILL);
        }
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        // A live link kills the group (the registration's drop); a dead one cannot.
        if self.registration.kill_on_drop && !self.registration.link.alive.load(Ordering::Acquire) {
            self.kill_orphaned();
        }
    }
}

/// How many tasks the worker's supervisors hold, all together (a supervisor not running holds
/// none): for the tests and the operator's question "is anything of a failed start left
/// behind?".
pub async fn census() -> io::Result<usize> {
    let live: Vec<Arc<Link>> = links()
        .slots
        .iter()
        .filter_map(|slot| slot.lock().expect("supervisor link lock").clone())
        .filter(|l| l.alive.load(Ordering::Acquire))
        .collect();
    let mut total = 0;
    for link in live {
        let (mut registration, mut events) = link.register();
        registration.kill_on_drop = false;
        link.send(
            &Request::Census {
                id: registration.id,
            },
            &[],
        )
        .await?;
        total += loop {
            match events.recv().await {
                Some(Event::Census(n)) => break n,
                Some(Event::Lost) | None => return Err(io::Error::other("a task supervisor died")),
                Some(_) => continue,
            }
        };
    }
    Ok(total)
}
