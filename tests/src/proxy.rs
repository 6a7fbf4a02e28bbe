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

/// The faults in force: one for every connection, and one per source address named.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Rules {
    all: Fault,
    from: Vec<(IpAddr, Fault)>,
}

impl Rules {
    /// The fault for a connection from `peer`.
    fn of(&self, peer: IpAddr) -> Fault {
        self.from
            .iter()
            .find(|(ip, _)| *ip == peer)
            .map_or(self.all, |(_, fault)| *fault)
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
                let fault = View {
                    rules: rx.clone(),
                    peer: peer.ip(),
                };
                tokio::spawn(connection(client, target, fault));
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
        self.rules.send_modify(|rules| {
            rules.from.retain(|(ip, _)| *ip != peer);
            rules.from.push((peer, fault));
        });
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

/// One connection's view of the rules: the fault for its source address.
#[derive(Clone)]
struct View {
    rules: watch::Receiver<Rules>,
    peer: IpAddr,
}

impl View {
    /// The fault now (marked seen, for [`changed`](Self::changed)).
    fn now(&mut self) -> Fault {
        self.rules.borrow_and_update().of(self.peer)
    }

    /// Waits until the rules change; `false` when the proxy is gone.
    async fn changed(&mut self) -> bool {
        self.rules.changed().await.is_ok()
    }

    /// True while the fault is [`Fault::Reset`]: the connection must close.
    fn resetting(&self) -> bool {
        self.rules.borrow().of(self.peer) == Fault::Reset
    }

    /// Waits until the fault lets bytes through; `false` when the proxy is gone.
    async fn passable(&mut self) -> bool {
        let peer = self.peer;
        self.rules
            .wait_for(|rules| rules.of(peer) != Fault::Blackhole)
            .await
            .is_ok()
    }
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
