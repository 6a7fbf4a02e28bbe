//! TLS fixtures: a throw-away CA and server certificate made with `openssl`, a private
//! TLS-only `redis-server`, and a `stunnel` TLS terminator in front of the shared RabbitMQ.
//! Missing tools are installed through `scripts/services tls-tools`; if that fails the test
//! fails (a TLS test that skips would prove nothing).

use crate::{unused_port, wait_until};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Makes sure `tool` is on the PATH, installing it through `scripts/services tls-tools` if not;
/// panics when it still is not there.
pub fn require_tool(tool: &str) {
    let found = |name: &str| {
        Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if found(tool) {
        return;
    }
    let services = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/services");
    let status = Command::new("bash")
        .arg(&services)
        .arg("tls-tools")
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", services.display()));
    assert!(
        status.success() && found(tool),
        "{tool} is required and could not be installed (scripts/services tls-tools: {status})"
    );
}

/// The `stunnel` binary (Debian's stunnel4 package installs both names).
fn stunnel_binary() -> &'static str {
    let has = |name: &str| {
        Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if has("stunnel") {
        "stunnel"
    } else {
        require_tool("stunnel4");
        "stunnel4"
    }
}

/// A throw-away CA and a server certificate it signed, valid for `127.0.0.1` (IP SAN) and
/// `localhost` (DNS SAN), in PEM files in a directory.
pub struct Certs {
    /// The CA certificate: what `ca_file` points at.
    pub ca: PathBuf,
    /// The server certificate.
    pub cert: PathBuf,
    /// The server's private key.
    pub key: PathBuf,
}

impl Certs {
    /// Generates the CA and the server certificate in `dir` (files `ca.pem`, `server.pem`,
    /// `server.key`).
    pub fn generate(dir: &Path) -> Self {
        require_tool("openssl");
        fs::create_dir_all(dir).expect("cert dir");
        let p = |name: &str| dir.join(name);
        fs::write(
            p("server.ext"),
            "basicConstraints = critical, CA:FALSE\n\
             keyUsage = critical, digitalSignature, keyEncipherment\n\
             extendedKeyUsage = serverAuth\n\
             subjectAltName = IP:127.0.0.1, DNS:localhost\n",
        )
        .expect("ext file");
        // EC keys: quick to make. Subjects without spaces: the commands are split on whitespace.
        let ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1";
        openssl(
            dir,
            &format!(
                "req -x509 -nodes {ec} -keyout ca.key -out ca.pem -days 2 \
                 -subj /CN=drumline-throw-away-test-CA \
                 -addext basicConstraints=critical,CA:TRUE \
                 -addext keyUsage=critical,keyCertSign,cRLSign"
            ),
        );
        openssl(
            dir,
            &format!("req -nodes {ec} -keyout server.key -out server.csr -subj /CN=127.0.0.1"),
        );
        openssl(
            dir,
            "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
             -out server.pem -days 2 -extfile server.ext",
        );
        Self {
            ca: p("ca.pem"),
            cert: p("server.pem"),
            key: p("server.key"),
        }
    }
}

/// Runs `openssl` with `args` split on whitespace, in `dir`.
fn openssl(dir: &Path, args: &str) {
    let mut openssl = Command::new("openssl");
    openssl.args(args.split_whitespace()).current_dir(dir);
    crate::scenario::run_checked(openssl.stdin(Stdio::null()), &format!("openssl {args}"));
}

/// A private `redis-server` serving TLS on `tls_port` (the one drumline is given), plus a
/// plain port on 127.0.0.1 for the test's own reads, so what the test sees does not depend on
/// the TLS code under test. Killed on drop.
pub struct TlsRedis {
    /// The TLS port: `rediss://127.0.0.1:{tls_port}/0`.
    pub tls_port: u16,
    /// A plain port for the test's inspection.
    pub plain_port: u16,
    child: Child,
    log: PathBuf,
}

impl TlsRedis {
    /// Starts it with `certs` (clients are not asked for certificates) and waits until its plain
    /// port answers.
    pub fn start(dir: &Path, certs: &Certs) -> Self {
        let tls_port = unused_port();
        let plain_port = unused_port();
        let log = dir.join("redis-tls.log");
        let out = File::create(&log).expect("log");
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &plain_port.to_string()])
            .args(["--tls-port", &tls_port.to_string()])
            .arg("--tls-cert-file")
            .arg(&certs.cert)
            .arg("--tls-key-file")
            .arg(&certs.key)
            .arg("--tls-ca-cert-file")
            .arg(&certs.ca)
            .args([
                "--tls-auth-clients",
                "no",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("dup"))
            .stderr(out)
            .spawn()
            .expect("redis-server must be installed (scripts/services installs it)");
        let mut redis = Self {
            tls_port,
            plain_port,
            child,
            log,
        };
        let up = wait_until(Duration::from_secs(10), || {
            redis.query(&["PING"]).is_some_and(|r| r == "PONG")
        });
        if !up {
            let _ = redis.child.kill();
            panic!(
                "private TLS redis-server did not start (built without TLS?): {}",
                fs::read_to_string(&redis.log).unwrap_or_default()
            );
        }
        redis
    }

    /// The URL drumline is given.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}/0", self.tls_port)
    }

    /// One command on the plain port (`redis-cli --raw`): its output, trimmed.
    pub fn query(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("redis-cli")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.plain_port.to_string(),
                "--raw",
            ])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// A field of `INFO stats`, e.g. `total_connections_received`.
    pub fn stat(&self, field: &str) -> Option<u64> {
        let info = self.query(&["INFO", "stats"])?;
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .and_then(|v| v.trim().parse().ok())
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `stunnel` terminating TLS on `port` (127.0.0.1) and forwarding to `127.0.0.1:{target}` in
/// plain text: an `amqps://` front for the shared RabbitMQ. Killed on drop.
pub struct Stunnel {
    /// The TLS port.
    pub port: u16,
    child: Child,
}

impl Stunnel {
    /// Starts it in the foreground with a config written to `dir` and waits until it accepts.
    pub fn start(dir: &Path, certs: &Certs, target: u16) -> Self {
        let bin = stunnel_binary();
        let port = unused_port();
        let conf = dir.join("stunnel.conf");
        fs::write(
            &conf,
            format!(
                "foreground = yes\npid =\noutput = {log}\ndebug = notice\n\
                 [amqps]\naccept = 127.0.0.1:{port}\nconnect = 127.0.0.1:{target}\n\
                 cert = {cert}\nkey = {key}\n",
                log = dir.join("stunnel.log").display(),
                cert = certs.cert.display(),
                key = certs.key.display(),
            ),
        )
        .expect("stunnel config");
        let child = Command::new(bin)
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
        let mut stunnel = Self { port, child };
        let up = wait_until(Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        if !up {
            let _ = stunnel.child.kill();
            panic!(
                "stunnel did not start: {}",
                fs::read_to_string(dir.join("stunnel.log")).unwrap_or_default()
            );
        }
        stunnel
    }

    /// `amqps://guest:guest@127.0.0.1:{port}/%2f`.
    pub fn url(&self) -> String {
        format!("amqps://guest:guest@127.0.0.1:{}/%2f", self.port)
    }
}

impl Drop for Stunnel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain TCP forwarder on 127.0.0.1 that counts the connections it accepted: proof that a
/// client tried (say, a TLS handshake that was then refused) when the server keeps no count of
/// failed handshakes. Runs on the caller's tokio runtime; stops accepting on drop.
pub struct CountingForwarder {
    /// Where clients connect.
    pub port: u16,
    accepted: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl CountingForwarder {
    /// Forwards every connection to `127.0.0.1:{target}`.
    pub async fn start(target: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let count = accepted.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    if let Ok(mut server) =
                        tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        Self {
            port,
            accepted,
            task,
        }
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for CountingForwarder {
    fn drop(&mut self) {
        self.task.abort();
    }
}
