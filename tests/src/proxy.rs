//! A fault-injection TCP proxy: put it between one process and a server (a worker and Redis,
//! say) and switch what the network does at run time, so "this worker cannot reach Redis while
//! the others can" is a test instead of a thought experiment.
//!
//! [`Fault::Pass`] forwards bytes as they come, [`Fault::Delay`] holds every chunk for a while
//! before forwarding it, and [`Fault::Blackhole`] is a partition: connections (old and new) stay
//! open but nothing is forwarded either way, so the client sees timeouts, never a reset. Bytes
//! held during a blackhole are delivered when the proxy passes again, as TCP would after a
//! partition heals.
//!
//! A fault may also be set for the connections from one source address only
//! ([`Proxy::set_from`]): with each side of a network on its own loopback address (127.0.0.1,
//! 127.0.0.2, …), that is a partition between hosts that still lets the others through.
//!
//! A proxy started with [`Proxy::start_knowing_processes`] also learns which process owns each
//! client connection (from `/proc`), so [`Proxy::set_for_process`] partitions one process while
//! every other client of the same server, on the same address, still passes.
//!
//! The proxy runs on its own small tokio runtime, so sync and async tests can use it alike;
//! dropping it closes every connection.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to the traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward everything at once.
    Pass,
    /// Hold each chunk read for this long before forwarding it.
    Delay(Duration),
    /// Accept connections but forward nothing, in either direction, until switched back.
    Blackhole,
    /// A server that is gone: every open connection is closed and new ones are closed at
    /// once, so the client sees resets and refusals (a Redis blip), never a timeout.
    Reset,
}

/// Who a rule is for: a source address or the process that owns the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Addr(IpAddr),
    Process(i32),
}

/// The faults in force: one for every connection, and one per source named.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Rules {
    all: Fault,
    from: Vec<(Source, Fault)>,
}

impl Rules {
    /// The fault for a connection from `peer` owned by process `owner` (a process rule wins).
    fn of(&self, peer: IpAddr, owner: Option<i32>) -> Fault {
        let rule = |source: Source| {
            self.from
                .iter()
                .find(|(s, _)| *s == source)
                .map(|(_, fault)| *fault)
        };
        owner
            .and_then(|pid| rule(Source::Process(pid)))
            .or_else(|| rule(Source::Addr(peer)))
            .unwrap_or(self.all)
    }

    fn set(&mut self, source: Source, fault: Fault) {
        self.from.retain(|(s, _)| *s != source);
        self.from.push((source, fault));
    }
}

/// A running proxy on a free 127.0.0.1 port.
pub struct Proxy {
    /// The port clients connect to.
    pub port: u16,
    rules: watch::Sender<Rules>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Proxy {
    /// Starts a proxy to `target`, passing traffic.
    pub fn start(target: SocketAddr) -> Self {
        Self::launch(target, false)
    }

    /// Starts a proxy to `target` that learns the process owning each client connection, for
    /// [`set_for_process`](Self::set_for_process).
    pub fn start_knowing_processes(target: SocketAddr) -> Self {
        Self::launch(target, true)
    }

    fn launch(target: SocketAddr, know_processes: bool) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("proxy address").port();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fault-proxy")
            .enable_all()
            .build()
            .expect("proxy runtime");
        let (rules, rx) = watch::channel(Rules {
            all: Fault::Pass,
            from: Vec::new(),
        });
        runtime.spawn(async move {
            let listener = TcpListener::from_std(listener).expect("proxy listener");
            while let Ok((client, peer)) = listener.accept().await {
                let rules = rx.clone();
                tokio::spawn(async move {
                    let owner = if know_processes {
                        tokio::task::spawn_blocking(move || owner_of(peer, port))
                            .await
                            .ok()
                            .flatten()
                    } else {
                        None
                    };
                    let fault = View {
                        rules,
                        peer: peer.ip(),
                        owner,
                    };
                    connection(client, target, fault).await;
                });
            }
        });
        Self {
            port,
            rules,
            runtime: Some(runtime),
        }
    }

    /// Switches the fault for every connection, open or future (but those from an address
    /// given its own with [`set_from`](Self::set_from)).
    pub fn set(&self, fault: Fault) {
        self.rules.send_modify(|rules| rules.all = fault);
    }

    /// Switches the fault for the connections, open or future, whose source address is `peer`.
    pub fn set_from(&self, peer: IpAddr, fault: Fault) {
        self.rules
            .send_modify(|rules| rules.set(Source::Addr(peer), fault));
    }

    /// Switches the fault for the connections, open or future, of process `pid` (a proxy
    /// [`start_knowing_processes`](Self::start_knowing_processes) only).
    pub fn set_for_process(&self, pid: i32, fault: Fault) {
        self.rules
            .send_modify(|rules| rules.set(Source::Process(pid), fault));
    }

    /// A `redis://` URL through this proxy (database 0).
    pub fn redis_url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Does not block, so a proxy may be dropped inside an async test.
            runtime.shutdown_background();
        }
    }
}

/// One connection's view of the rules: the fault for its source address and process.
#[derive(Clone)]
struct View {
    rules: watch::Receiver<Rules>,
    peer: IpAddr,
    owner: Option<i32>,
}

impl View {
    /// The fault now (marked seen, for [`changed`](Self::changed)).
    fn now(&mut self) -> Fault {
        self.rules.borrow_and_update().of(self.peer, self.owner)
    }

    /// Waits until the rules change; `false` when the proxy is gone.
    async fn changed(&mut self) -> bool {
        self.rules.changed().await.is_ok()
    }

    /// True while the fault is [`Fault::Reset`]: the connection must close.
    fn resetting(&self) -> bool {
        self.rules.borrow().of(self.peer, self.owner) == Fault::Reset
    }

    /// Waits until the fault lets bytes through; `false` when the proxy is gone.
    async fn passable(&mut self) -> bool {
        let (peer, owner) = (self.peer, self.owner);
        self.rules
            .wait_for(|rules| rules.of(peer, owner) != Fault::Blackhole)
            .await
            .is_ok()
    }
}

/// The process owning the client end of a connection from `peer` to 127.0.0.1:`port`: the
/// socket's inode from `/proc/net/tcp`, then the process holding `socket:[inode]`.
fn owner_of(peer: SocketAddr, port: u16) -> Option<i32> {
    let SocketAddr::V4(peer) = peer else {
        return None;
    };
    // `/proc/net/tcp` writes addresses as little-endian hex words: 127.0.0.1 is 0100007F.
    let hex = |ip: std::net::Ipv4Addr, port: u16| {
        format!("{:08X}:{port:04X}", u32::from_le_bytes(ip.octets()))
    };
    let local = hex(*peer.ip(), peer.port());
    let remote = hex(std::net::Ipv4Addr::LOCALHOST, port);
    // A read of the table is not atomic: while other sockets come and go it may skip a line,
    // so a connection not found is looked for again.
    let inode = (0..5).find_map(|_| {
        let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
        table.lines().skip(1).find_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            (cols.get(1) == Some(&local.as_str()) && cols.get(2) == Some(&remote.as_str()))
                .then(|| cols.get(9).map(|s| (*s).to_owned()))
                .flatten()
        })
    })?;
    let link = format!("socket:[{inode}]");
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let fds = std::fs::read_dir(entry.path().join("fd")).ok()?;
            fds.flatten()
                .any(|fd| {
                    std::fs::read_link(fd.path())
                        .is_ok_and(|target| target.as_os_str() == link.as_str())
                })
                .then_some(pid)
        })
}

async fn connection(client: TcpStream, target: SocketAddr, mut fault: View) {
    // A blackholed network does not reach the server either: connect only once it passes.
    if !fault.passable().await || fault.resetting() {
        return;
    }
    let Ok(server) = TcpStream::connect(target).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::join!(
        pump(client_read, server_write, fault.clone()),
        pump(server_read, client_write, fault),
    );
}

/// Copies one direction, obeying the fault.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut fault: View) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        // While blackholed nothing is read, so bytes pile up in the kernel as on a dead link.
        if !fault.passable().await || fault.resetting() {
            let _ = to.shutdown().await;
            return;
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => n,
            },
            changed = fault.changed() => {
                if !changed {
                    return;
                }
                continue;
            }
        };
        // The fault is judged again when forwarding: a chunk read just before a switch to
        // blackhole is held too.
        loop {
            match fault.now() {
                Fault::Pass => break,
                Fault::Reset => {
                    let _ = to.shutdown().await;
                    return;
                }
                Fault::Delay(d) => {
                    tokio::time::sleep(d).await;
                    break;
                }
                Fault::Blackhole => {
                    if !fault.passable().await {
                        return;
                    }
                }
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// An echo server on a free port.
    fn echo_server() -> SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = stream.read(&mut buf) {
                        if n == 0 || stream.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    fn round_trip(stream: &mut std::net::TcpStream, msg: &[u8]) -> std::io::Result<Vec<u8>> {
        stream.write_all(msg)?;
        let mut got = vec![0u8; msg.len()];
        stream.read_exact(&mut got)?;
        Ok(got)
    }

    #[test]
    fn passes_delays_and_blackholes_then_heals() {
        let proxy = Proxy::start(echo_server());
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", proxy.port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        assert_eq!(round_trip(&mut stream, b"one").unwrap(), b"one");

        proxy.set(Fault::Delay(Duration::from_millis(200)));
        let started = std::time::Instant::now();
        assert_eq!(round_trip(&mut stream, b"two").unwrap(), b"two");
        // Held once each way.
        assert!(started.elapsed() >= Duration::from_millis(400));

        proxy.set(Fault::Blackhole);
        let err = round_trip(&mut stream, b"three").unwrap_err();
        assert!(
            matches!(
                err.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "a timeout, not a reset: {err:?}"
        );
        // A new connection is accepted but gets nothing through either.
        let mut fresh = std::net::TcpStream::connect(("127.0.0.1", proxy.port)).unwrap();
        fresh
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        assert!(round_trip(&mut fresh, b"four").is_err());

        proxy.set(Fault::Pass);
        // What was held arrives once the partition heals.
        let mut held = [0u8; 5];
        stream.read_exact(&mut held).unwrap();
        assert_eq!(&held, b"three");
        let mut held = [0u8; 4];
        fresh.read_exact(&mut held).unwrap();
        assert_eq!(&held, b"four");
    }

    /// A blocking stream to the proxy from source address `from`.
    fn connect_from(from: &str, proxy: &Proxy) -> std::net::TcpStream {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let stream = runtime
            .block_on(async {
                let socket = tokio::net::TcpSocket::new_v4()?;
                socket.bind(format!("{from}:0").parse().unwrap())?;
                socket.connect(([127, 0, 0, 1], proxy.port).into()).await
            })
            .unwrap()
            .into_std()
            .unwrap();
        stream.set_nonblocking(false).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        stream
    }

    #[test]
    fn a_fault_for_one_process_leaves_the_others_through() {
        let proxy = Proxy::start_knowing_processes(echo_server());
        // A connection of this process, and one of a child process (nc through /bin/sh).
        let mut ours = std::net::TcpStream::connect(("127.0.0.1", proxy.port)).unwrap();
        ours.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        assert_eq!(round_trip(&mut ours, b"one").unwrap(), b"one");
        let mut other = std::process::Command::new("python3")
            .args([
                "-c",
                "import socket,sys\ns=socket.create_connection(('127.0.0.1',int(sys.argv[1])))\n\
                 for line in sys.stdin:\n s.sendall(line.encode()); print(s.recv(64).decode(), end='', flush=True)",
                &proxy.port.to_string(),
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut to_other = other.stdin.take().unwrap();
        let mut from_other = std::io::BufReader::new(other.stdout.take().unwrap());
        let mut echo = |msg: &str| {
            use std::io::BufRead;
            writeln!(to_other, "{msg}").unwrap();
            let mut line = String::new();
            from_other.read_line(&mut line).unwrap();
            line
        };
        assert_eq!(echo("two"), "two\n");

        proxy.set_for_process(std::process::id() as i32, Fault::Blackhole);
        assert!(round_trip(&mut ours, b"three").is_err());
        assert_eq!(echo("four"), "four\n");

        proxy.set_for_process(std::process::id() as i32, Fault::Pass);
        let mut held = [0u8; 5];
        ours.read_exact(&mut held).unwrap();
        assert_eq!(&held, b"three");
        drop(to_other);
        let _ = other.wait();
    }

    #[test]
    fn a_fault_from_one_source_address_leaves_the_others_through() {
        let proxy = Proxy::start(echo_server());
        let mut near = connect_from("127.0.0.1", &proxy);
        let mut far = connect_from("127.0.0.2", &proxy);
        assert_eq!(round_trip(&mut far, b"one").unwrap(), b"one");

        proxy.set_from("127.0.0.2".parse().unwrap(), Fault::Blackhole);
        assert!(round_trip(&mut far, b"two").is_err());
        assert!(round_trip(&mut connect_from("127.0.0.2", &proxy), b"new").is_err());
        assert_eq!(round_trip(&mut near, b"three").unwrap(), b"three");
        let mut fresh = connect_from("127.0.0.1", &proxy);
        assert_eq!(round_trip(&mut fresh, b"four").unwrap(), b"four");

        proxy.set_from("127.0.0.2".parse().unwrap(), Fault::Pass);
        let mut held = [0u8; 3];
        far.read_exact(&mut held).unwrap();
        assert_eq!(&held, b"two");
    }
}
