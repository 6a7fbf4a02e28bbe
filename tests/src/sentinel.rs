//! A private Redis Sentinel deployment for failover tests: a primary, two replicas and three
//! Sentinels (quorum 2) on free ports, each with its own directory, from Debian's `redis`
//! package (`redis-server`, and `redis-server --sentinel`). Never the shared Redis on 6379.
//!
//! [`SentinelSet::shared`] starts it once per test binary and hands it to one test at a time
//! (a test may kill and restart its nodes; [`SentinelSet::heal`] puts it back together). It is
//! torn down when the test binary exits: a small watchdog process kills every node and removes
//! the directory once the binary's pid is gone (statics are never dropped).
//!
//! [`SentinelSet::behind_proxy`] starts a set of a test's own whose first primary the replicas
//! and Sentinels reach only through a [`Proxy`], from their own loopback address
//! ([`FAR_SIDE`]), while clients reach it through the same proxy from 127.0.0.1: cutting
//! [`FAR_SIDE`] at the proxy cuts the primary off from its replicas and Sentinels and from
//! nobody else. That set is torn down when dropped.
//!
//! [`SentinelSet::announced`] (the soak's) puts every data node behind a proxy of its own that
//! learns which process owns each connection, and has each node announce its proxy's port:
//! Sentinels, replicas and clients all reach every node through its proxy, whichever is primary,
//! so [`SentinelSet::set_for_process`] cuts one client process off from Redis across failovers.

use super::{free_port, wait_until};
use crate::proxy::Proxy;
use std::collections::HashMap;
use std::fs::{self, File};
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tokio::sync::{Mutex, MutexGuard};

/// The master name the Sentinels monitor.
pub const MASTER: &str = "drumline";
/// `down-after-milliseconds`: how long a silent primary takes to be thought down.
pub const DOWN_AFTER_MS: u64 = 1000;
/// `failover-timeout`.
pub const FAILOVER_TIMEOUT_MS: u64 = 5000;
/// The source address of the replicas' and Sentinels' connections in a set
/// [`behind_proxy`](SentinelSet::behind_proxy).
pub const FAR_SIDE: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));

/// The deployment (see the module docs).
pub struct SentinelSet {
    dir: PathBuf,
    /// The data nodes' ports; the first was the first primary.
    pub nodes: Vec<u16>,
    /// The Sentinels' ports.
    pub sentinels: Vec<u16>,
    /// Nodes killed and not restarted yet.
    down: Vec<u16>,
    /// Every process started, by port (reaped when killed).
    children: HashMap<u16, Child>,
    /// In a set [`behind_proxy`](Self::behind_proxy), the proxy in front of the first
    /// primary; its port is that primary's address for everyone.
    pub front: Option<Proxy>,
    /// In a set [`announced`](Self::announced), each node's proxy by node port.
    fronts: HashMap<u16, Proxy>,
    /// Tears the set down when the test binary exits.
    watchdog: Child,
    /// Leave the directory when dropped (see [`keep`](Self::keep)).
    kept: bool,
}

static SHARED: OnceLock<Mutex<SentinelSet>> = OnceLock::new();

/// How clients and nodes reach the data nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// Directly.
    Plain,
    /// The first primary through [`SentinelSet::front`].
    BehindProxy,
    /// Every node through its own announced proxy.
    Announced,
}

impl SentinelSet {
    /// The binary's deployment, started on first use, healthy (every node up, two replicas
    /// online), held until the guard is dropped.
    pub async fn shared() -> MutexGuard<'static, SentinelSet> {
        let set = SHARED.get_or_init(|| Mutex::new(SentinelSet::start(Layout::Plain)));
        // A test that failed while holding it may have left a node down: heal it.
        let mut guard = set.lock().await;
        guard.heal();
        guard
    }

    /// A set of the caller's own (not shared) whose first primary sits behind
    /// [`front`](Self::front) (see the module docs); healthy when it returns, torn down when
    /// dropped. `front.set_from(FAR_SIDE, Fault::Blackhole)` cuts that primary off from its
    /// replicas and Sentinels; the clients' connections (from 127.0.0.1) still pass.
    pub fn behind_proxy() -> Self {
        Self::start(Layout::BehindProxy)
    }

    /// A set of the caller's own with every node behind its own announced proxy (see the
    /// module docs); healthy when it returns, torn down when dropped.
    pub fn announced() -> Self {
        Self::start(Layout::Announced)
    }

    fn start(layout: Layout) -> Self {
        let dir = std::env::temp_dir().join("drumline-tests").join(format!(
            "sentinel-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ));
        fs::create_dir_all(&dir).expect("mkdir");
        let nodes: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let sentinels: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let watchdog = watchdog(&dir);
        let front = (layout == Layout::BehindProxy)
            .then(|| Proxy::start(([127, 0, 0, 1], nodes[0]).into()));
        let fronts = if layout == Layout::Announced {
            nodes
                .iter()
                .map(|n| {
                    (
                        *n,
                        Proxy::start_knowing_processes(([127, 0, 0, 1], *n).into()),
                    )
                })
                .collect()
        } else {
            HashMap::new()
        };
        let mut set = Self {
            dir,
            nodes,
            sentinels,
            down: Vec::new(),
            children: HashMap::new(),
            front,
            fronts,
            watchdog,
            kept: false,
        };
        // Everyone's address of the first primary.
        let first = set.address(set.nodes[0]);
        for (i, port) in set.nodes.clone().into_iter().enumerate() {
            let conf = set.dir.join(format!("redis-{port}.conf"));
            fs::create_dir_all(set.dir.join(format!("data-{port}"))).expect("mkdir");
            fs::write(&conf, set.node_conf(port)).expect("conf");
            let primary = (i > 0).then_some(first);
            set.spawn_node(port, primary);
        }
        for port in set.sentinels.clone() {
            let conf = set.dir.join(format!("sentinel-{port}.conf"));
            fs::write(&conf, set.sentinel_conf(port)).expect("conf");
            let child = set.spawn(
                &format!("sentinel-{port}"),
                &[conf.to_str().unwrap(), "--sentinel"],
            );
            set.children.insert(port, child);
            wait_port(port, &set.children[&port]);
        }
        set.wait_healthy(first);
        set
    }

    /// `port` and `bind` of a node's or Sentinel's config. Behind a proxy its connections
    /// leave from [`FAR_SIDE`] and it listens there too (a Sentinel announces the address its
    /// link to the primary leaves from), accepting both addresses (protected mode admits
    /// 127.0.0.1 only).
    fn listen_conf(&self, port: u16) -> String {
        let far = if self.front.is_some() {
            format!(" {FAR_SIDE}\nbind-source-addr {FAR_SIDE}\nprotected-mode no")
        } else {
            String::new()
        };
        format!("port {port}\nbind 127.0.0.1{far}\n")
    }

    fn node_conf(&self, port: u16) -> String {
        let d = self.dir.display();
        let announce = self.fronts.get(&port).map_or(String::new(), |p| {
            format!(
                "replica-announce-ip 127.0.0.1\nreplica-announce-port {}\n",
                p.port
            )
        });
        format!(
            "{}{announce}dir {d}/data-{port}\npidfile {d}/redis-{port}.pid\n\
             logfile {d}/redis-{port}.log\nappendonly yes\nappendfsync everysec\nsave \"\"\n\
             repl-diskless-sync yes\nrepl-diskless-sync-delay 0\n",
            self.listen_conf(port)
        )
    }

    /// Everyone's address (port on 127.0.0.1) of data node `port`: its proxy's in a set
    /// [`announced`](Self::announced) (and the first primary's behind
    /// [`front`](Self::front)), else its own.
    pub fn address(&self, node: u16) -> u16 {
        if let Some(p) = self.fronts.get(&node) {
            return p.port;
        }
        match &self.front {
            Some(p) if node == self.nodes[0] => p.port,
            _ => node,
        }
    }

    /// The data node behind `address` (see [`address`](Self::address)).
    pub fn node_at(&self, address: u16) -> u16 {
        self.nodes
            .iter()
            .copied()
            .find(|n| self.address(*n) == address)
            .unwrap_or(address)
    }

    /// Cuts process `pid`'s connections to every data node (open and new), or heals them
    /// (a set [`announced`](Self::announced) only).
    pub fn set_for_process(&self, pid: i32, fault: crate::proxy::Fault) {
        for p in self.fronts.values() {
            p.set_for_process(pid, fault);
        }
    }

    /// A plain connection to the primary the Sentinels name, if it answers.
    pub fn primary_connection(&self) -> Option<redis::Connection> {
        connection(self.primary()?)
    }

    /// Whether the set is whole (see [`heal`](Self::heal)): nothing down, the Sentinels
    /// agreeing on a primary that has two replicas online and that they all know.
    pub fn is_whole(&self) -> bool {
        self.down.is_empty() && self.whole().is_ok()
    }

    /// The data nodes killed and not restarted yet.
    pub fn down(&self) -> &[u16] {
        &self.down
    }

    /// Restarts killed node `port` as a replica of the primary the Sentinels name, once they
    /// name another node (a node told to replicate itself stays a replica the Sentinels still
    /// call the primary); false while they have not failed over yet.
    pub fn revive(&mut self, port: u16) -> bool {
        let Some(i) = self.down.iter().position(|p| *p == port) else {
            return true;
        };
        let Some(primary) = self.primary().filter(|p| *p != self.address(port)) else {
            return false;
        };
        self.down.remove(i);
        self.spawn_node(port, Some(primary));
        true
    }

    /// The set's directory (configs, logs, data).
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Keeps the set's directory (logs, configs) when it is dropped.
    pub fn keep(&mut self) {
        self.kept = true;
    }

    /// A clean restart of the primary: SIGTERM (the AOF is flushed), then the same node and
    /// data, started as a primary again. If the Sentinels failed over meanwhile they turn it
    /// into a replica, as they would any returning old primary. Returns its port.
    pub fn restart_primary(&mut self) -> Option<u16> {
        let port = self.node_at(self.primary()?);
        let mut child = self.children.remove(&port)?;
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let exited = wait_until(Duration::from_secs(20), || {
            child.try_wait().ok().flatten().is_some()
        });
        if !exited {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.spawn_node(port, None);
        Some(port)
    }

    fn sentinel_conf(&self, port: u16) -> String {
        let d = self.dir.display();
        let primary = self.address(self.nodes[0]);
        format!(
            "{}dir {d}\npidfile {d}/sentinel-{port}.pid\n\
             logfile {d}/sentinel-{port}.log\n\
             sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n\
             sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n\
             sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n\
             sentinel parallel-syncs {MASTER} 2\n",
            self.listen_conf(port)
        )
    }

    fn spawn(&self, label: &str, args: &[&str]) -> Child {
        let out = File::create(self.dir.join(format!("{label}.out"))).expect("log");
        Command::new("redis-server")
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("dup"))
            .stderr(out)
            .spawn()
            .expect("redis-server must be installed (scripts/services installs it)")
    }

    /// Starts data node `port`, a replica of `primary` if given.
    fn spawn_node(&mut self, port: u16, primary: Option<u16>) {
        let conf = self.dir.join(format!("redis-{port}.conf"));
        let mut args = vec![conf.to_str().unwrap().to_owned()];
        if let Some(primary) = primary {
            args.extend([
                "--replicaof".into(),
                "127.0.0.1".into(),
                primary.to_string(),
            ]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let child = self.spawn(&format!("redis-{port}"), &args);
        // Held first, so a start that fails is still torn down with the set.
        self.children.insert(port, child);
        wait_port(port, &self.children[&port]);
    }

    /// `redis+sentinel://` URL of the set (no password), database `db`.
    pub fn url(&self, db: u32) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+sentinel://{}/{MASTER}/{db}", hosts.join(","))
    }

    /// A plain URL of data node `port`.
    pub fn node_url(port: u16) -> String {
        format!("redis://127.0.0.1:{port}/0")
    }

    /// The primary as the first Sentinel that answers names it.
    pub fn primary(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|p| sentinel_primary(*p))
    }

    /// kill -9 of the current primary; waits until its port is closed. Returns its port.
    pub fn kill_primary(&mut self) -> u16 {
        let port = self.node_at(self.primary().expect("no primary known"));
        let mut child = self
            .children
            .remove(&port)
            .expect("a node this set started");
        child.kill().expect("kill -9");
        child.wait().expect("reap");
        let _ = fs::remove_file(self.dir.join(format!("redis-{port}.pid")));
        let closed = wait_until(Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err()
        });
        assert!(closed, "redis {port} still listens after kill -9");
        self.down.push(port);
        port
    }

    /// SIGSTOP of data node `port` (a replica that stalls: it neither replicates nor
    /// acknowledges until [`thaw`](Self::thaw)).
    pub fn freeze(&self, port: u16) {
        self.signal(port, "-STOP");
    }

    /// SIGCONT of data node `port`.
    pub fn thaw(&self, port: u16) {
        self.signal(port, "-CONT");
    }

    fn signal(&self, port: u16, signal: &str) {
        let pid = self
            .children
            .get(&port)
            .expect("a node this set started")
            .id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal} {pid}");
    }

    /// Waits until every Sentinel names a primary other than `old` and that node says it is
    /// one; returns its port and how long that took from `since`.
    pub fn wait_failover(&self, old: u16, since: Instant, within: Duration) -> (u16, Duration) {
        let mut new = None;
        let done = wait_until(within, || {
            let named: Vec<Option<u16>> = self
                .sentinels
                .iter()
                .map(|p| sentinel_primary(*p))
                .collect();
            new = named[0].filter(|p| *p != old && named.iter().all(|n| *n == named[0]));
            new.is_some_and(|p| role(p).as_deref() == Some("master"))
        });
        assert!(
            done,
            "no failover within {within:?}; see {}",
            self.dir.display()
        );
        (new.expect("new primary"), since.elapsed())
    }

    /// Restarts the nodes killed (as replicas of the current primary) and waits until the set
    /// is whole again: two replicas online, every Sentinel agreeing on the primary and knowing
    /// both replicas and the two other Sentinels.
    pub fn heal(&mut self) {
        let primary = wait_for(Duration::from_secs(60), || {
            self.primary()
                .filter(|p| role(*p).as_deref() == Some("master"))
        })
        .expect("no primary to heal around");
        for port in std::mem::take(&mut self.down) {
            self.spawn_node(port, Some(primary));
        }
        self.wait_healthy(primary);
    }

    /// Waits until the set is whole around whichever primary the Sentinels agree on: a
    /// failover may happen again while it heals (a loaded machine can keep a primary silent
    /// past `down-after-milliseconds`), so the primary is read afresh on every check.
    fn wait_healthy(&self, first: u16) {
        let mut seen = String::new();
        let mut whole = || match self.whole() {
            Ok(_) => true,
            Err(state) => {
                seen = state;
                false
            }
        };
        let mut healthy = wait_until(Duration::from_secs(60), &mut whole);
        if !healthy {
            // A Sentinel that kept a stale view of a node it saw die (seen once on a loaded
            // machine): `SENTINEL RESET` makes each discover the replicas and the other
            // Sentinels afresh, as an operator would.
            for s in &self.sentinels {
                if let Some(mut conn) = connection(*s) {
                    let _: redis::RedisResult<i64> = redis::cmd("SENTINEL")
                        .arg("RESET")
                        .arg(MASTER)
                        .query(&mut conn);
                }
            }
            healthy = wait_until(Duration::from_secs(60), &mut whole);
        }
        assert!(
            healthy,
            "the sentinel set (first primary {first}) did not become whole: {seen}; see {}",
            self.dir.display()
        );
    }

    /// The primary if the set is whole: every Sentinel names it, it says it is one, two
    /// replicas are online, and every Sentinel knows both replicas and the two other
    /// Sentinels. Otherwise what each part says.
    fn whole(&self) -> Result<u16, String> {
        let named: Vec<Option<u16>> = self
            .sentinels
            .iter()
            .map(|s| sentinel_primary(*s))
            .collect();
        let state = |why: &str| {
            let counts: Vec<String> = self
                .sentinels
                .iter()
                .map(|s| {
                    format!(
                        "sentinel {s}: replicas {:?} sentinels {:?}",
                        sentinel_count(*s, "replicas"),
                        sentinel_count(*s, "sentinels")
                    )
                })
                .collect();
            format!("{why}; primaries named {named:?}; {}", counts.join(", "))
        };
        let Some(primary) = named[0].filter(|p| named.iter().all(|n| *n == Some(*p))) else {
            return Err(state("the Sentinels disagree on the primary"));
        };
        if role(primary).as_deref() != Some("master") {
            return Err(state(&format!("{primary} is not a primary")));
        }
        let online = info(primary, "replication")
            .map(|i| i.matches("state=online").count())
            .unwrap_or(0);
        if online != 2 {
            return Err(state(&format!("{online} replicas online at {primary}")));
        }
        let known = self.sentinels.iter().all(|s| {
            sentinel_count(*s, "replicas") == Some(2) && sentinel_count(*s, "sentinels") == Some(2)
        });
        if !known {
            return Err(state("a Sentinel does not know the whole set"));
        }
        Ok(primary)
    }
}

impl Drop for SentinelSet {
    /// Kills every process of the set and removes its directory (the shared set, a static, is
    /// left to its watchdog).
    fn drop(&mut self) {
        for child in self.children.values_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = self.watchdog.kill();
        let _ = self.watchdog.wait();
        // A failed test's set is kept to be read (its message names the directory).
        if !std::thread::panicking() && !self.kept {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// Waits until the server started as `child` answers on `port`: the process answering must
/// be that child (`process_id` in `INFO server`), not another listener on the same port.
fn wait_port(port: u16, child: &Child) {
    let ours = format!("process_id:{}", child.id());
    let up = wait_until(Duration::from_secs(10), || {
        info(port, "server").is_some_and(|i| i.lines().any(|l| l.trim() == ours))
    });
    assert!(up, "redis-server {} did not answer on {port}", child.id());
}

fn wait_for<T>(within: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let mut out = None;
    wait_until(within, || {
        out = f();
        out.is_some()
    });
    out
}

fn connection(port: u16) -> Option<redis::Connection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .ok()?
        .get_connection_with_timeout(Duration::from_millis(500))
        .ok()
}

fn info(port: u16, section: &str) -> Option<String> {
    redis::cmd("INFO")
        .arg(section)
        .query(&mut connection(port)?)
        .ok()
}

/// `role:` from `INFO replication`.
fn role(port: u16) -> Option<String> {
    let info = info(port, "replication")?;
    info.lines()
        .find_map(|l| l.strip_prefix("role:"))
        .map(|r| r.trim().to_owned())
}

fn sentinel_primary(port: u16) -> Option<u16> {
    let (_, p): (String, u16) = redis::cmd("SENTINEL")
        .arg("get-master-addr-by-name")
        .arg(MASTER)
        .query::<Option<(String, u16)>>(&mut connection(port)?)
        .ok()??;
    Some(p)
}

/// How many `replicas` or `sentinels` Sentinel `port` knows (not flagged down).
fn sentinel_count(port: u16, what: &str) -> Option<usize> {
    let list: Vec<std::collections::HashMap<String, String>> = redis::cmd("SENTINEL")
        .arg(what)
        .arg(MASTER)
        .query(&mut connection(port)?)
        .ok()?;
    Some(
        list.iter()
            .filter(|m| m.get("flags").is_some_and(|f| !f.contains("down")))
            .count(),
    )
}

/// Kills every process of the set in `dir` (by their pid files) and removes `dir` once this test
/// binary's process is gone.
fn watchdog(dir: &std::path::Path) -> Child {
    let d = dir.display();
    let script = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 1; done; \
         for f in {d}/*.pid; do [ -f \"$f\" ] && kill -9 \"$(cat \"$f\")\"; done; \
         rm -rf {d}",
        pid = std::process::id()
    );
    Command::new("/bin/sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("sh")
}
