//! Test support for drumline's end-to-end tests: every test gets its own namespace (so tests
//! run in parallel on one broker and one Redis), its own scratch directory, the real
//! `drumline-beat` / `drumline-worker` binaries, and cleanup of everything it declared.
//!
//! # Map
//!
//! - `lib.rs`: the test kit: `Namespace` (a unique namespace whose keys, queues and exchanges
//!   are deleted on drop, used by `store/tests/store.rs` and `beat/tests/live.rs` too), and for
//!   end-to-end tests `TestEnv`: a namespace and scratch directory per test, `env.names()`,
//!   `env.metric(port, name)`, the real binaries as child processes, cleanup in `Drop`;
//!   `RabbitCluster`: three private RabbitMQ nodes joined into one cluster (own names, ports,
//!   dirs), leader and queue-type queries, kill -9 / freeze / start again; `StreamPublisher`
//!   for long confirmed streams.
//! - `hook.rs`: `Hook`: a webhook receiver (axum on a free port) that records every request
//!   (arrival instant, path, headers, body) and answers per path and per how many times that
//!   key came before, for the HTTP executor's tests.
//! - `otlp.rs`: `Collector`: a tiny OTLP/HTTP (JSON) receiver that keeps the spans POSTed to
//!   `/v1/traces`, for the traces tests.
//! - `cfg.rs`: `Cfg`: a test's `drumline.toml` written in code
//!   (`Cfg::new().task("t", shell("…")).job("tick", every("1s"))`), checked against drumline's
//!   own parser; `TestEnv::write_config` adds the namespace.
//! - `proxy.rs`: fault-injection TCP proxy between one process and a server: pass, delay or
//!   blackhole, switched at run time, for every connection, for those from one source address,
//!   or for those of one process (the proxy reads the owner from `/proc`).
//! - `suspend.rs`: a host suspend played on one process: SIGSTOP, then SIGCONT with its
//!   `CLOCK_MONOTONIC` held back by the stop (an `LD_PRELOAD` shim, `src/suspend_shim.c`,
//!   compiled with `cc`).
//! - `tls.rs`: throw-away CA, TLS-only Redis, stunnel in front of RabbitMQ.
//! - `sentinel.rs`: a private Redis primary + 2 replicas + 3 Sentinels, once per test binary,
//!   torn down at exit; `behind_proxy`: a set of a test's own whose first primary the replicas
//!   and Sentinels reach through a proxy from 127.0.0.2, so the test can cut it off from them
//!   and from nobody else; `announced` (the soak's): every node behind a proxy of its own whose
//!   port it announces, so one client process can be cut off from whichever node is primary.
//! - `checker/`: the randomized checker (docs/soak.md#the-randomized-checker): `draw.rs` a
//!   round from its seed (jobs, actions, faults) and its config, `oracle.rs` the promise judged
//!   from the round, the harness's timeline and the tasks' effect log alone (pure,
//!   unit-tested), `round.rs` one round on the real binaries and `verify` held against the
//!   oracle; `tests/checker.rs` runs seeds 1–3, `examples/soak.rs --random` more.
//! - `soak/`: the soak behind `scripts/soak` (docs/soak.md): the world of beats and workers on
//!   private servers, the seeded faults, the effect check.
//! - `snoop.rs`: a test-owned queue bound like the work queue: every message a beat publishes,
//!   with its epoch and arrival time (what was published is read here, never from logs).
//! - `tests/*.rs`: one file per area: `pipeline`, `misfire`, `overlap`, `retries`, `failures`,
//!   `http` (the HTTP executor against `Hook`), `faults`, `worker_faults`, `lease`, `lapses`
//!   (attempts outlive the lease), `executor`, `dlq`, `hostile`, `validation`, `isolation`,
//!   `config`, `commands`, `next`, `tls`, `leadership` (kill -9, SIGSTOP, a host suspend,
//!   SIGTERM, clocks off by an hour under libfaketime, a stolen lease, a partition), `operate`
//!   (pause, trigger, backfill), `jitter` (offsets across beats and a restart, keys
//!   un-jittered), `trigger` (a trigger on a running `skip` job warns and runs nothing more),
//!   `operators` (errors that name the service, `publish`'s warnings, every command through
//!   `drumline`, workers and queues in `status`, build and process metrics), `deploy` (the files
//!   in `deploy/`, `READY=1` and `WATCHDOG=1`), `reload` (SIGHUP, a standby that reloaded and
//!   then leads), `metrics` (labelled series, promtool), `page` (the status page in headless
//!   Chromium), `sentinel` (WAIT, a primary killed under load, a primary cut off from its
//!   replicas and Sentinels but not its clients), `queue_type` (quorum queues, a refused type
//!   change, `urls`), `cluster` (kill -9 of a quorum queue's leader node, SIGSTOP of the node
//!   the beat publishes through), `typed` (typed Rust handlers: decoded args, decode errors,
//!   retry after, panics, cancellation, fencing across a kill -9 takeover of the example
//!   worker), `envelope` (the wire contract: every envelope written checked against the
//!   schema, the Python producer `examples/python/publish.py` from the virtualenv
//!   `scripts/services` makes), `client` (the producer client: unroutable, declared,
//!   recovering), `limits` (a concurrency group across three workers, a killed holder's slot, a
//!   rate across three workers), `after` (job dependencies: a chain in order per instant, a
//!   dead upstream and a timeout skip the chain below, `check` refusals, a jittered root's
//!   followers timed from its jittered time, a paused or misfired root skipping the chain below
//!   at once, a trigger or backfill of an upstream running it alone), `audit` (the journal,
//!   `audit` and `verify` on clean and broken histories), `checker` and `soak` (both briefly),
//!   `docs` (every link and anchor in the README and `docs/` resolves), `house`
//!   (docs/design.md#the-house).
//! - `typed-worker` (binary): `worker/examples/typed_worker.rs` built as a binary of this
//!   crate, so `typed.rs` can kill -9 it.

pub mod cfg;
pub mod checker;
pub mod hook;
pub mod otlp;
pub mod probe;
pub mod proxy;
pub mod scenario;
pub mod sentinel;
pub mod snoop;
pub mod soak;
pub mod suspend;
pub mod tls;

use drumline_shared::names::Names;
use lapin::options::{BasicPublishOptions, ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The shared broker every test uses (namespaced).
pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// The shared Redis every test uses (namespaced).
pub const REDIS_URL: &str = "redis://127.0.0.1:6379/0";

/// A test's own namespace on the shared broker and Redis: a unique name, and on drop (a
/// panicking test's too) its Redis keys, its work queues (`default` and any named with
/// [`Namespace::forget_queue_later`]), `{ns}.dead`, `{ns}.dead.watch` and its exchanges are
/// deleted; delay queues expire by themselves. The one clean-up every kind of test uses:
/// end-to-end tests through [`TestEnv`], the store's and the beat's integration tests directly.
pub struct Namespace {
    name: String,
    extra_queues: Vec<String>,
}

impl Namespace {
    /// `t_{test}_{8 hex digits}`.
    pub fn new(test: &str) -> Self {
        let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
        Namespace {
            name: format!("t_{test}_{suffix}"),
            extra_queues: Vec::new(),
        }
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Also delete the work queue of logical queue `queue` (`{ns}.q.{queue}`) at the end.
    pub fn forget_work_queue_later(&mut self, queue: &str) {
        let name = Names::new(self.name.as_str()).work_queue(queue);
        self.extra_queues.push(name);
    }

    /// Also delete the queue named `name` at the end.
    pub fn forget_queue_later(&mut self, name: String) {
        self.extra_queues.push(name);
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let ns = self.name.clone();
        let extra = std::mem::take(&mut self.extra_queues);
        // A runtime of its own: `Drop` cannot await, and a panicking test's runtime may be gone.
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(cleanup(ns, extra));
        })
        .join();
    }
}

/// One test's world.
pub struct TestEnv {
    /// The namespace: unique per test run.
    pub ns: String,
    /// Scratch directory (configs, effect files, process logs).
    pub dir: PathBuf,
    /// Deletes what the test declared when the test ends.
    namespace: Namespace,
}

/// Creates a test's namespace and scratch directory.
pub fn setup(test: &str) -> TestEnv {
    let namespace = Namespace::new(test);
    let ns = namespace.name().to_owned();
    let dir = std::env::temp_dir().join("drumline-tests").join(&ns);
    fs::create_dir_all(&dir).expect("cannot create the test directory");
    TestEnv { ns, dir, namespace }
}

/// Copies the workspace binary `name` to `to`, to be run from there. The copy is written by `cp`,
/// not by this process: a file this process holds open for writing may be inherited by a child
/// another test thread forks meanwhile, and running the copy then fails with "Text file busy"
/// (ETXTBSY) until that child has exec'd — as a CI run saw.
pub fn copy_binary(name: &str, to: &Path) {
    let status = Command::new("cp")
        .arg(binary(name))
        .arg(to)
        .status()
        .expect("cp runs");
    assert!(status.success(), "cp {name} {}: {status}", to.display());
}

/// Path of a workspace binary (built by `cargo build --bins`, which `scripts/test` runs first).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test-binary>
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --workspace --bins` first (scripts/test does)",
        path.display()
    );
    path
}

impl TestEnv {
    /// A path inside the scratch directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Writes `drumline.toml` with this test's namespace prepended; returns its path.
    pub fn config(&self, name: &str, body: &str) -> PathBuf {
        let path = self.path(name);
        fs::write(&path, format!("namespace = \"{}\"\n{body}", self.ns)).expect("write config");
        path
    }

    /// Writes `cfg` (with this test's namespace) as `name` in the scratch directory.
    pub fn write_config(&self, name: &str, cfg: &cfg::Cfg) -> PathBuf {
        self.config(name, &cfg.toml())
    }

    /// A shell command (TOML array) that appends `$DRUMLINE_KEY` to `file` after `sleep` s.
    pub fn append_key_command(&self, file: &str, sleep: f64) -> String {
        let effect = self.path(file);
        let script = if sleep > 0.0 {
            format!(
                "sleep {sleep}; echo \"$DRUMLINE_KEY\" >> {}",
                effect.display()
            )
        } else {
            format!("echo \"$DRUMLINE_KEY\" >> {}", effect.display())
        };
        format!("[\"/bin/sh\", \"-c\", {}]", toml_string(&script))
    }

    /// Starts `drumline-beat` with `args` (logs to `<label>.log`).
    pub fn beat(&self, label: &str, args: &[&str]) -> Proc {
        self.spawn("drumline-beat", label, args)
    }

    /// Starts `drumline-beat` with `args` and extra environment variables `vars` (e.g.
    /// [`faketime_ahead`]'s, to run it with a wrong wall clock).
    pub fn beat_with_env(&self, label: &str, args: &[&str], vars: &[(&str, &str)]) -> Proc {
        self.spawn_with_env("drumline-beat", label, args, vars)
    }

    /// Starts `drumline-worker` with `args` (logs to `<label>.log`).
    pub fn worker(&self, label: &str, args: &[&str]) -> Proc {
        self.spawn("drumline-worker", label, args)
    }

    /// Starts `drumline-worker` with `args` as the leader of a process group of its own, as a
    /// shell starts a job (so [`Proc::kill9_group`] can kill it with everything in its group).
    pub fn worker_leading_its_group(&self, label: &str, args: &[&str]) -> Proc {
        let mut cmd = Command::new(binary("drumline-worker"));
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        self.launch(cmd, "drumline-worker", label, args, &[])
    }

    /// Starts `drumline-worker` with `args` and extra environment variables `vars` (which may
    /// include `DRUMLINE_AMQP_URL` / `DRUMLINE_REDIS_URL`, removed otherwise).
    pub fn worker_with_env(&self, label: &str, args: &[&str], vars: &[(&str, &str)]) -> Proc {
        self.spawn_with_env("drumline-worker", label, args, vars)
    }

    /// Starts the program at `path` (a copy or an installed binary, not the build's) with
    /// `args` and `vars` (logs to `<label>.log`).
    pub fn program_at(
        &self,
        path: &Path,
        label: &str,
        args: &[&str],
        vars: &[(&str, &str)],
    ) -> Proc {
        self.launch(Command::new(path), label, label, args, vars)
    }

    /// Starts the workspace binary `bin` (e.g. `typed-worker`, the typed-handler example) with
    /// `args` (logs to `<label>.log`).
    pub fn program(&self, bin: &str, label: &str, args: &[&str]) -> Proc {
        self.spawn(bin, label, args)
    }

    /// Starts `drumline-worker` with `args` and `vars` as the unprivileged user `nobody` (group
    /// `nogroup`, no supplementary groups), through util-linux `setpriv`, which execs it: the
    /// pid is the worker's. Its config and everything its tasks write must be open to `nobody`.
    pub fn worker_as_nobody(&self, label: &str, args: &[&str], vars: &[(&str, &str)]) -> Proc {
        // Copies of the worker and its supervisor (found beside the worker) in the scratch
        // directory: the build directory may sit where `nobody` cannot enter (a clone under a
        // 0700 `mktemp -d`).
        let bin = self.path("bin");
        fs::create_dir_all(&bin).expect("mkdir bin");
        for name in ["drumline-worker", "drumline-supervisor"] {
            copy_binary(name, &bin.join(name));
        }
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"])
            .arg(bin.join("drumline-worker"));
        self.launch(cmd, "drumline-worker", label, args, vars)
    }

    fn spawn(&self, bin: &str, label: &str, args: &[&str]) -> Proc {
        self.spawn_with_env(bin, label, args, &[])
    }

    fn spawn_with_env(&self, bin: &str, label: &str, args: &[&str], vars: &[(&str, &str)]) -> Proc {
        self.launch(Command::new(binary(bin)), bin, label, args, vars)
    }

    fn launch(
        &self,
        mut cmd: Command,
        bin: &str,
        label: &str,
        args: &[&str],
        vars: &[(&str, &str)],
    ) -> Proc {
        let log = self.path(&format!("{label}.log"));
        let out = File::create(&log).expect("log file");
        let child = cmd
            .args(args)
            .env("RUST_LOG", "info")
            .env_remove("DRUMLINE_CONFIG")
            .env_remove("DRUMLINE_PLANTED_DEFECT")
            .env_remove("DRUMLINE_AMQP_URL")
            .env_remove("DRUMLINE_REDIS_URL")
            .envs(vars.iter().copied())
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("dup"))
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
        Proc {
            child: Some(child),
            label: label.to_owned(),
            log,
        }
    }

    /// Runs a binary to completion (for `check`, `next`, bad configs): (status, stdout, stderr).
    pub fn run(&self, bin: &str, args: &[&str]) -> (ExitStatus, String, String) {
        let out = Command::new(binary(bin))
            .args(args)
            .env_remove("DRUMLINE_CONFIG")
            .env_remove("DRUMLINE_PLANTED_DEFECT")
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {bin}: {e}"));
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Lines of an effect file (empty when it does not exist yet).
    pub fn lines(&self, file: &str) -> Vec<String> {
        fs::read_to_string(self.path(file))
            .map(|t| t.lines().map(str::to_owned).collect())
            .unwrap_or_default()
    }

    /// Also delete queue `name` at cleanup.
    pub fn forget_queue_later(&mut self, name: String) {
        self.namespace.forget_queue_later(name);
    }

    /// A Redis connection.
    pub async fn redis(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(REDIS_URL)
            .expect("redis url")
            .get_multiplexed_async_connection()
            .await
            .expect("redis connection")
    }

    /// An AMQP connection.
    pub async fn amqp(&self) -> Connection {
        Connection::connect(AMQP_URL, ConnectionProperties::default())
            .await
            .expect("amqp connection")
    }

    /// Publishes a raw body to `{ns}.tasks` with routing key `queue` (as a hand-written producer
    /// would), waiting for the confirm.
    pub async fn publish_raw(&self, queue: &str, body: &[u8], props: BasicProperties) {
        let conn = self.amqp().await;
        let ch = conn.create_channel().await.expect("channel");
        ch.confirm_select(Default::default())
            .await
            .expect("confirm");
        ch.basic_publish(
            self.names().tasks_exchange().as_str().into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            props,
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
        let _ = conn.close(200, "bye".into()).await;
    }

    /// Number of messages ready in queue `name` (passive declare), or `None` if it does not exist.
    pub async fn queue_len(&self, name: &str) -> Option<u32> {
        self.queue_counts(name).await.map(|(messages, _)| messages)
    }

    /// (ready messages, consumers) of queue `name` (passive declare), or `None` if it does not
    /// exist.
    async fn queue_counts(&self, name: &str) -> Option<(u32, u32)> {
        scenario::queue_counts_at(AMQP_URL, name).await
    }

    /// True when exchange `name` exists.
    pub async fn exchange_exists(&self, name: &str) -> bool {
        let conn = self.amqp().await;
        let ch = conn.create_channel().await.expect("channel");
        let exists = ch
            .exchange_declare(
                name.into(),
                lapin::ExchangeKind::Direct,
                lapin::options::ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .is_ok();
        let _ = conn.close(200, "bye".into()).await;
        exists
    }
}

/// Deletes namespace `ns`: its Redis keys, queues `default`, `{ns}.dead`, `{ns}.dead.watch` and
/// `extra`, and its exchanges. Whatever is not there is skipped.
async fn cleanup(ns: String, extra: Vec<String>) {
    let names = Names::new(ns.as_str());
    if let Ok(conn) = Connection::connect(AMQP_URL, ConnectionProperties::default()).await {
        let mut queues = vec![
            names.work_queue("default"),
            names.dead(),
            names.dead_watch(),
        ];
        queues.extend(extra);
        for q in queues {
            if let Ok(ch) = conn.create_channel().await {
                let _ = ch
                    .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
        }
        for x in [names.tasks_exchange(), names.dead()] {
            if let Ok(ch) = conn.create_channel().await {
                let _ = ch
                    .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
                    .await;
            }
        }
        let _ = conn.close(200, "cleanup".into()).await;
    }
    if let Ok(client) = redis::Client::open(REDIS_URL) {
        if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("{ns}:*"))
                .query_async(&mut conn)
                .await
                .unwrap_or_default();
            if !keys.is_empty() {
                let _: redis::RedisResult<()> =
                    redis::cmd("DEL").arg(keys).query_async(&mut conn).await;
            }
        }
    }
}

/// A running binary; killed (SIGKILL) on drop if still running.
pub struct Proc {
    child: Option<Child>,
    label: String,
    log: PathBuf,
}

impl Proc {
    /// Its pid.
    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }

    /// Sends `signal` (e.g. `libc::SIGTERM`).
    pub fn signal(&self, signal: i32) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{signal} {} failed", self.label);
    }

    /// kill -9.
    pub fn kill9(&mut self) -> ExitStatus {
        self.signal(9);
        self.wait(Duration::from_secs(10))
    }

    /// `kill -9 -PID`: SIGKILL to the whole process group this process leads (see
    /// [`TestEnv::worker_leading_its_group`]), then wait for its exit.
    pub fn kill9_group(&mut self) -> ExitStatus {
        let status = Command::new("kill")
            .args(["-9", "--", &format!("-{}", self.pid())])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -9 of the group failed");
        self.wait(Duration::from_secs(10))
    }

    /// SIGTERM, then wait for the exit.
    pub fn terminate(&mut self, within: Duration) -> ExitStatus {
        self.signal(15);
        self.wait(within)
    }

    /// Waits for the exit (panics with the log tail after `within`).
    pub fn wait(&mut self, within: Duration) -> ExitStatus {
        let child = self.child.as_mut().expect("running");
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                self.child = None;
                return status;
            }
            if Instant::now() > deadline {
                panic!(
                    "{} did not exit within {within:?}\n{}",
                    self.label,
                    self.log_tail(40)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// True while running.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => c.try_wait().expect("try_wait").is_none(),
            None => false,
        }
    }

    /// The last `n` lines of its log (for failure messages).
    pub fn log_tail(&self, n: usize) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        format!(
            "--- {} (last {n} lines) ---\n{}",
            self.label,
            lines[lines.len().saturating_sub(n)..].join("\n")
        )
    }

    /// The whole log, for tests of what the log says (an output contract: a dropped instance
    /// named, a password never printed). Outcomes are read from effects, Redis, the broker
    /// ([`snoop`]) or `/metrics`, never from here.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Polls `condition` every 100 ms until it holds or `within` passes; returns whether it held.
pub fn wait_until(within: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Async variant of [`wait_until`].
pub async fn wait_until_async<F, Fut>(within: Duration, mut condition: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if condition().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// libfaketime's preload library (Debian package `faketime`; `scripts/services` installs it).
pub const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// Environment that runs a process with its wall clock `offset` ahead (libfaketime syntax,
/// e.g. `"+1h"`), for [`TestEnv::beat_with_env`]. Only the wall clock moves: the monotonic
/// clock stays real (`FAKETIME_DONT_FAKE_MONOTONIC`), so tokio's timers and the beat's lease
/// deadlines work. Panics when libfaketime is not installed.
pub fn faketime_ahead(offset: &str) -> Vec<(&'static str, String)> {
    assert!(
        Path::new(FAKETIME_LIB).exists(),
        "{FAKETIME_LIB} is missing: run scripts/services faketime (Debian: apt-get install faketime)"
    );
    vec![
        ("LD_PRELOAD", FAKETIME_LIB.to_owned()),
        ("FAKETIME", offset.to_owned()),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_owned()),
    ]
}

/// A TOML basic string literal.
pub fn toml_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// Counts how often each line occurs.
pub fn counts(lines: &[String]) -> std::collections::BTreeMap<String, usize> {
    let mut map = std::collections::BTreeMap::new();
    for l in lines {
        *map.entry(l.clone()).or_insert(0) += 1;
    }
    map
}

/// The instant of a scheduled instance's key `{job}@{instant}`.
pub fn instant_of(key: &str) -> chrono::DateTime<chrono::Utc> {
    let text = key.split_once('@').expect("job@instant").1;
    chrono::DateTime::parse_from_rfc3339(text)
        .expect("rfc3339")
        .with_timezone(&chrono::Utc)
}

/// Effect lines (one key per execution) of a 1 s job: every second from the first to the last
/// key is there exactly once, and there are at least `at_least` of them.
pub fn assert_contiguous_exactly_once(lines: &[String], at_least: usize) {
    let counts = counts(lines);
    let doubled: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "executed more than once: {doubled:?}");
    let instants: Vec<chrono::DateTime<chrono::Utc>> =
        counts.keys().map(|k| instant_of(k)).collect();
    assert!(
        instants.len() >= at_least,
        "only {} executions: {lines:?}",
        instants.len()
    );
    for pair in instants.windows(2) {
        assert_eq!(
            (pair[1] - pair[0]).num_seconds(),
            1,
            "missing instants between {} and {}",
            pair[0],
            pair[1]
        );
    }
}

/// A private RabbitMQ node on free ports, for tests that stop and restart the broker (never
/// the shared one). Its data directory survives a restart, like a real broker's.
pub struct PrivateRabbit {
    /// AMQP port.
    pub port: u16,
    dist_port: u16,
    dir: PathBuf,
    name: String,
    /// The launcher process (it becomes the node), reaped on stop.
    child: Option<Child>,
}

/// A port for a server a test starts: nobody listens on it now, this process never handed it
/// out before, and it lies below the kernel's ephemeral range, so neither an outgoing
/// connection nor another `bind(0)` (an Erlang CLI's distribution listener, a proxy) can take
/// it between this call and the server's bind. A port from `bind(0)` could be: a CI soak once
/// found a Sentinel's port held by a listener of the RabbitMQ node starting beside it.
fn free_port() -> u16 {
    static NEXT: std::sync::Mutex<Option<u16>> = std::sync::Mutex::new(None);
    let (low, high) = fixed_port_range();
    let span = high - low;
    let mut next = NEXT.lock().unwrap_or_else(|e| e.into_inner());
    // Each process starts at its own offset, so test binaries run one after another (or two
    // suites on one machine) rarely walk the same ports.
    let mut candidate = next.unwrap_or(low + (std::process::id() % u32::from(span)) as u16);
    for _ in 0..span {
        let port = candidate;
        candidate = if port + 1 >= high { low } else { port + 1 };
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            *next = Some(candidate);
            return port;
        }
    }
    panic!("no free port in {low}..{high}");
}

/// The 10,000 ports below the ephemeral range (`ip_local_port_range`). No wider: RabbitMQ's
/// CLI tools listen at the node's distribution port + 10,000 and up, which then falls into
/// the ephemeral range, never onto a port handed out here.
fn fixed_port_range() -> (u16, u16) {
    let ephemeral_low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768)
        .max(2048);
    (
        ephemeral_low.saturating_sub(10_000).max(1024),
        ephemeral_low,
    )
}

impl PrivateRabbit {
    /// Starts a node and waits until it accepts connections.
    pub fn start(label: &str) -> Self {
        Self::start_with(label, "")
    }

    /// [`PrivateRabbit::start`] with extra `rabbitmq.conf` lines (e.g. `max_message_size = 4096`).
    pub fn start_with(label: &str, extra_conf: &str) -> Self {
        let dir = std::env::temp_dir().join("drumline-tests").join(format!(
            "rabbit-{label}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ));
        fs::create_dir_all(dir.join("mnesia")).expect("mkdir");
        fs::create_dir_all(dir.join("log")).expect("mkdir");
        fs::write(dir.join("enabled_plugins"), "[].\n").expect("plugins file");
        let port = free_port();
        let dist_port = free_port();
        fs::write(
            dir.join("rabbitmq.conf"),
            format!("listeners.tcp.local = 127.0.0.1:{port}\n{extra_conf}\n"),
        )
        .expect("conf");
        // rabbitmq-server drops to the rabbitmq user when started as root.
        let _ = Command::new("chown")
            .args(["-R", "rabbitmq:rabbitmq"])
            .arg(&dir)
            .status();
        let mut rabbit = Self {
            port,
            dist_port,
            name: format!(
                "drumline_{}@localhost",
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            ),
            dir,
            child: None,
        };
        rabbit.boot();
        rabbit
    }

    /// The URL to put in `[broker] url`.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    fn boot(&mut self) {
        let d = &self.dir;
        let log = File::create(d.join("out.log")).expect("log");
        let child = Command::new("/usr/sbin/rabbitmq-server")
            .current_dir(d)
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_NODENAME", &self.name)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_PID_FILE", d.join("pid"))
            .env("RABBITMQ_FEATURE_FLAGS_FILE", d.join("feature_flags"))
            .env("RABBITMQ_PLUGINS_EXPAND_DIR", d.join("plugins-expand"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup"))
            .stderr(log)
            .spawn()
            .expect("rabbitmq-server must be installed (scripts/services installs it)");
        self.child = Some(child);
        let up = wait_until(Duration::from_secs(90), || {
            std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
        });
        assert!(
            up,
            "private RabbitMQ did not start; see {}",
            d.join("out.log").display()
        );
    }

    fn pid(&self) -> Option<String> {
        fs::read_to_string(self.dir.join("pid"))
            .ok()
            .map(|p| p.trim().to_owned())
    }

    /// Stops the node (SIGTERM: a clean broker shutdown) and waits until its port is closed.
    pub fn stop(&self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").arg(&pid).status();
            let gone = wait_until(Duration::from_secs(60), || {
                !Path::new(&format!("/proc/{pid}")).exists()
            });
            assert!(gone, "private RabbitMQ {pid} did not stop");
        }
    }

    /// Stops and starts the node again with the same data.
    pub fn restart(&mut self) {
        self.stop();
        self.boot();
    }

    /// Kills the node with SIGKILL (a broker that goes away without a goodbye) and waits until
    /// its port is closed.
    pub fn kill9(&self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").args(["-9", &pid]).status();
            let gone = wait_until(Duration::from_secs(30), || {
                !Path::new(&format!("/proc/{pid}")).exists()
            });
            assert!(gone, "private RabbitMQ {pid} did not die");
        }
    }

    /// Freezes the node (SIGSTOP): its connections stay open but nothing answers, as in a
    /// network partition. [`thaw`](Self::thaw) resumes it.
    pub fn freeze(&self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").args(["-STOP", &pid]).status();
        }
    }

    /// Resumes a frozen node (SIGCONT).
    pub fn thaw(&self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").args(["-CONT", &pid]).status();
        }
    }

    /// Closes every client connection on the node (`rabbitmqctl close_all_connections`): the
    /// clients see a broker-side close and must reconnect.
    pub fn close_connections(&self) {
        let mut close = Command::new("rabbitmqctl");
        close.args([
            "-n",
            &self.name,
            "close_all_connections",
            "closed by a test",
        ]);
        scenario::run_checked(&mut close, "rabbitmqctl close_all_connections");
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").args(["-9", &pid]).status();
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// An ad-hoc envelope for `task` with idempotency key `key`, due now, queue `default`.
pub fn adhoc(key: &str, task: &str) -> drumline_shared::envelope::Envelope {
    let now = chrono::Utc::now();
    drumline_shared::envelope::Envelope {
        v: 1,
        id: uuid::Uuid::new_v4(),
        key: key.to_owned(),
        task: task.to_owned(),
        job: None,
        args: serde_json::json!({}),
        scheduled_for: now,
        published_at: now,
        expires_at: None,
        not_before: None,
        attempt: 0,
        queue: "default".to_owned(),
        backfill: false,
        overlap: None,
        trace: None,
    }
}

impl TestEnv {
    /// Every exchange, queue and Redis key name of this test's namespace.
    pub fn names(&self) -> Names {
        Names::new(self.ns.as_str())
    }

    /// The value of metric `name` served on 127.0.0.1:`port` (see [`metric`]).
    pub fn metric(&self, port: u16, name: &str) -> Option<f64> {
        metric(port, name)
    }

    /// Publishes `envelope` the way drumline does (properties and headers included).
    pub async fn publish(&self, envelope: &drumline_shared::envelope::Envelope) {
        self.publish_raw(
            &envelope.queue,
            &envelope.encode(),
            drumline_shared::broker::properties(envelope, chrono::Utc::now(), 0),
        )
        .await;
    }

    /// The `state` field of instance `key` in Redis.
    pub async fn run_state(&self, key: &str) -> Option<String> {
        let mut redis = self.redis().await;
        redis::cmd("HGET")
            .arg(self.names().run_key(key))
            .arg("state")
            .query_async(&mut redis)
            .await
            .expect("redis")
    }

    /// True once nobody's lease on instance `key` is live: no record, or its `lease_until`
    /// (ms, Redis `TIME`) has passed (docs/design.md#attempts-outlive-the-lease).
    pub async fn lease_lapsed(&self, key: &str) -> bool {
        let mut redis = self.redis().await;
        let (until, (secs, micros)): (Option<u64>, (u64, u64)) = redis::pipe()
            .cmd("HGET")
            .arg(self.names().run_key(key))
            .arg("lease_until")
            .cmd("TIME")
            .query_async(&mut redis)
            .await
            .expect("redis");
        until.is_none_or(|until| until <= secs * 1000 + micros / 1000)
    }

    /// Waits until a worker consumes `{ns}.q.default`, i.e. has declared and bound its topology.
    pub async fn wait_for_topology(&self, worker: &Proc) {
        let queue = self.names().work_queue("default");
        // A consumer, not only the queue: the worker declares its queues first and binds them
        // to `{ns}.tasks` after, so a message published as soon as the queue exists can find
        // no binding and be dropped. It consumes only once everything is declared and bound.
        let consuming = wait_until_async(Duration::from_secs(60), || async {
            self.queue_consumers(&queue).await.is_some_and(|n| n > 0)
        })
        .await;
        assert!(
            consuming,
            "nobody consumes {queue}\n{}",
            worker.log_tail(20)
        );
    }

    /// Number of consumers of queue `name` (passive declare), or `None` if it does not exist.
    pub async fn queue_consumers(&self, name: &str) -> Option<u32> {
        self.queue_counts(name)
            .await
            .map(|(_, consumers)| consumers)
    }
}

/// A plain HTTP/1.1 GET on 127.0.0.1:`port`: (status code, body).
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    http(port, "GET", path, Duration::from_secs(5)).map(|(code, _, body)| (code, body))
}

/// One HTTP/1.1 request `method path` (no body) on 127.0.0.1:`port`, waiting up to `wait` for
/// the whole answer: (status code, head, body).
pub fn http(port: u16, method: &str, path: &str, wait: Duration) -> Option<(u16, String, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(wait)).ok()?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\
         Connection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split(' ').nth(1)?.parse().ok()?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    Some((status, head.to_owned(), body.to_owned()))
}

/// A TCP port nobody listens on right now.
pub fn unused_port() -> u16 {
    free_port()
}

/// The value of metric `name` (an exact series name, labels included if any) in the Prometheus
/// exposition served on 127.0.0.1:`port`, or `None` when absent or unreachable.
pub fn metric(port: u16, name: &str) -> Option<f64> {
    let (_, body) = http_get(port, "/metrics")?;
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Worker arguments that also serve `/metrics` on a fresh port: (args, port).
pub fn with_metrics(args: &[&str]) -> (Vec<String>, u16) {
    let port = free_port();
    let mut out: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    out.push("--metrics-addr".into());
    out.push(format!("127.0.0.1:{port}"));
    (out, port)
}

/// Three private RabbitMQ nodes joined into one cluster (own node names, ports, data and config
/// dirs; the cookie is the `rabbitmq` user's, which every node started here shares), for the
/// tests that kill a node under quorum queues. Never touches the shared node on 5672. Started
/// by the test that needs it and torn down (every node killed, its directory removed) when
/// dropped, at the end of the test that started it.
pub struct RabbitCluster {
    /// The nodes; `nodes[0]` is the one the others joined.
    pub nodes: Vec<PrivateRabbit>,
}

/// What a cluster node does when it finds itself cut off: RabbitMQ's advice for three nodes or
/// more. The default (`ignore`) leaves a node that was frozen past `net_ticktime` partitioned
/// from the others after it resumes, until someone restarts it.
const PARTITION_HANDLING: &str = "cluster_partition_handling = pause_minority";

impl RabbitCluster {
    /// Boots three nodes at once, joins the second and third to the first (`stop_app`,
    /// `join_cluster`, `start_app`), and waits until the cluster reports all three running.
    pub fn start(label: &str) -> Self {
        let nodes: Vec<PrivateRabbit> = std::thread::scope(|s| {
            let starting: Vec<_> = (0..3)
                .map(|i| {
                    s.spawn(move || {
                        PrivateRabbit::start_with(&format!("{label}{i}"), PARTITION_HANDLING)
                    })
                })
                .collect();
            starting
                .into_iter()
                .map(|h| h.join().expect("a node failed to boot"))
                .collect()
        });
        let cluster = Self { nodes };
        let seed = cluster.nodes[0].name.clone();
        for i in 1..cluster.nodes.len() {
            cluster.ctl(i, &["stop_app"]);
            cluster.ctl(i, &["join_cluster", &seed]);
            cluster.ctl(i, &["start_app"]);
        }
        let joined = wait_until(Duration::from_secs(60), || {
            cluster.running_nodes(0).len() == cluster.nodes.len()
        });
        assert!(
            joined,
            "the cluster did not form: {:?}",
            cluster.running_nodes(0)
        );
        cluster
    }

    /// Node `i`'s URL for `[broker] url(s)`.
    pub fn url(&self, i: usize) -> String {
        self.nodes[i].url()
    }

    /// Node `i`'s Erlang node name.
    pub fn node_name(&self, i: usize) -> &str {
        &self.nodes[i].name
    }

    /// Runs `rabbitmqctl -n NODE args` against node `i`; panics when it fails.
    pub fn ctl(&self, i: usize, args: &[&str]) -> String {
        self.try_ctl(i, "rabbitmqctl", args)
            .unwrap_or_else(|e| panic!("rabbitmqctl {args:?} on node {i} failed: {e}"))
    }

    /// Runs the node script `script` (`rabbitmqctl`, `rabbitmq-queues`, …) with `-n NODE` for
    /// node `i`: its stdout, or its stderr as the error.
    pub fn try_ctl(&self, i: usize, script: &str, args: &[&str]) -> Result<String, String> {
        let out = Command::new(format!("/usr/sbin/{script}"))
            .args(["-n", &self.nodes[i].name])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("{script} must be installed: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// The running nodes as node `i` sees them (empty when `i` does not answer).
    pub fn running_nodes(&self, i: usize) -> Vec<String> {
        let Ok(status) = self.try_ctl(i, "rabbitmqctl", &["cluster_status", "--formatter", "json"])
        else {
            return Vec::new();
        };
        serde_json::from_str::<serde_json::Value>(&status)
            .ok()
            .and_then(|v| {
                v.get("running_nodes")?.as_array().map(|nodes| {
                    nodes
                        .iter()
                        .filter_map(|n| n.as_str().map(str::to_owned))
                        .collect()
                })
            })
            .unwrap_or_default()
    }

    /// The index of the node that leads quorum queue `queue` (default vhost), asked of node
    /// `via`; `None` while it has no leader or `via` does not answer.
    pub fn leader_of(&self, via: usize, queue: &str) -> Option<usize> {
        let list = self
            .try_ctl(
                via,
                "rabbitmqctl",
                &[
                    "list_queues",
                    "name",
                    "leader",
                    "--no-table-headers",
                    "--silent",
                ],
            )
            .ok()?;
        let leader = list.lines().find_map(|line| {
            let mut cols = line.split_whitespace();
            (cols.next()? == queue).then(|| cols.next().map(str::to_owned))?
        })?;
        self.nodes.iter().position(|n| n.name == leader)
    }

    /// Kills node `i` with SIGKILL (no goodbye to its peers or clients) and waits until it is
    /// gone.
    pub fn kill9(&self, i: usize) {
        self.nodes[i].kill9();
    }

    /// Freezes node `i` (SIGSTOP): its sockets stay open but nothing answers, as when a machine
    /// hangs or drops off the network. [`thaw`](Self::thaw) resumes it.
    pub fn freeze(&self, i: usize) {
        self.nodes[i].freeze();
    }

    /// Resumes a frozen node `i` (SIGCONT).
    pub fn thaw(&self, i: usize) {
        self.nodes[i].thaw();
    }

    /// Boots node `i` again (after [`kill9`](Self::kill9)) with its data: it rejoins the
    /// cluster by itself.
    pub fn start_again(&mut self, i: usize) {
        self.nodes[i].boot();
    }

    /// The type (`classic`, `quorum`) of queue `queue`, asked of node `via`.
    pub fn queue_type(&self, via: usize, queue: &str) -> Option<String> {
        queue_type_on(Some(&self.nodes[via].name), queue)
    }
}

/// The type (`classic`, `quorum`) of queue `queue` in the default vhost of node `node` (the
/// shared node when `None`), from `rabbitmqctl list_queues` (read only).
pub fn queue_type_on(node: Option<&str>, queue: &str) -> Option<String> {
    queue_info_on(node, queue, "type")
}

/// Every queue whose name starts with `prefix`, with column `item` (see [`queue_info_on`]).
pub fn queues_on(node: Option<&str>, prefix: &str, item: &str) -> Vec<(String, String)> {
    let mut cmd = Command::new("/usr/sbin/rabbitmqctl");
    if let Some(node) = node {
        cmd.args(["-n", node]);
    }
    let Ok(out) = cmd
        .args([
            "list_queues",
            "name",
            item,
            "--no-table-headers",
            "--silent",
        ])
        .stdin(Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let (name, value) = line.split_once('\t')?;
            name.starts_with(prefix)
                .then(|| (name.to_owned(), value.trim().to_owned()))
        })
        .collect()
}

/// Column `item` of `rabbitmqctl list_queues` (read only) for queue `queue` in the default
/// vhost of node `node` (the shared node when `None`): `type`, `arguments`, `leader`, …
pub fn queue_info_on(node: Option<&str>, queue: &str, item: &str) -> Option<String> {
    queues_on(node, queue, item)
        .into_iter()
        .find_map(|(name, value)| (name == queue).then_some(value))
}

/// A publisher with confirms to one broker `url`, for streams of many messages: one connection
/// and channel, reopened after a failure; a message that fails is sent again (its idempotency
/// key makes a repeat harmless), so every message given is confirmed once `publish` returns.
pub struct StreamPublisher {
    url: String,
    channel: Option<(Connection, lapin::Channel)>,
    /// Sends that failed and were repeated.
    pub retries: u32,
}

impl StreamPublisher {
    /// A publisher for `url`; connects lazily.
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            channel: None,
            retries: 0,
        }
    }

    /// Publishes `envelope` to `{ns}.tasks` (`names`) as drumline does, until confirmed or
    /// `within` passes (then panics).
    pub async fn publish(
        &mut self,
        names: &Names,
        envelope: &drumline_shared::envelope::Envelope,
        within: Duration,
    ) {
        let deadline = Instant::now() + within;
        loop {
            match self.try_publish(names, envelope).await {
                Ok(()) => return,
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "{} not confirmed within {within:?}: {e}",
                        envelope.key
                    );
                    self.retries += 1;
                    self.channel = None;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    async fn try_publish(
        &mut self,
        names: &Names,
        envelope: &drumline_shared::envelope::Envelope,
    ) -> Result<(), String> {
        if self.channel.is_none() {
            let conn = Connection::connect(&self.url, ConnectionProperties::default())
                .await
                .map_err(|e| e.to_string())?;
            let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
            ch.confirm_select(Default::default())
                .await
                .map_err(|e| e.to_string())?;
            self.channel = Some((conn, ch));
        }
        let (_, ch) = self.channel.as_ref().expect("just set");
        let confirm = async {
            ch.basic_publish(
                names.tasks_exchange().as_str().into(),
                envelope.queue.as_str().into(),
                BasicPublishOptions::default(),
                &envelope.encode(),
                drumline_shared::broker::properties(envelope, chrono::Utc::now(), 0),
            )
            .await?
            .await
        };
        match tokio::time::timeout(Duration::from_secs(10), confirm).await {
            Ok(Ok(c)) if c.is_ack() => Ok(()),
            Ok(Ok(c)) => Err(format!("not acked: {c:?}")),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("no confirm within 10s".into()),
        }
    }
}
