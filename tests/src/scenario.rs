//! A scenario in one call, as ripgrep's `tests/util.rs` gives its tests: a config from a
//! [`Cfg`] written into a fresh [`TestEnv`], workers and beats started on it, one stop that
//! checks every clean exit, failure messages that carry every process's log tail, and typed
//! reads of what drumline keeps in Redis (a run's fields, a job's progress, the leader).
//!
//! ```no_run
//! # async fn f() {
//! use drumline_e2e::cfg::{every, Cfg};
//! use drumline_e2e::scenario::{appends, Scenario, WAIT};
//! let tick = |env: &_| Cfg::new().task("tick", appends(env, "effects")).job("tick", every("1s"));
//! let mut sc = Scenario::start("doc", 1, 1, tick).await;
//! sc.wait(WAIT, "three runs", || sc.lines("effects").len() >= 3);
//! sc.stop();
//! # }
//! ```

use crate::cfg::{shell, Cfg, Keys};
use crate::{setup, wait_until, wait_until_async, Proc, TestEnv, REDIS_URL};
use chrono::{DateTime, Utc};
use std::fmt::Display;
use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::time::Duration;

/// How long a scenario waits for what should come in a few seconds (a loaded machine included).
pub const WAIT: Duration = Duration::from_secs(40);

/// One test's world with its config written and its processes running.
pub struct Scenario {
    /// The namespace and scratch directory (the scenario derefs to it).
    pub env: TestEnv,
    /// `drumline.toml` in the scratch directory.
    pub config: PathBuf,
    /// Beats, in the order started (labels `beat`, `beat-2`, …).
    pub beats: Vec<Proc>,
    /// Workers, in the order started (labels `worker`, `worker-2`, …).
    pub workers: Vec<Proc>,
}

impl Deref for Scenario {
    type Target = TestEnv;
    fn deref(&self) -> &TestEnv {
        &self.env
    }
}

impl DerefMut for Scenario {
    fn deref_mut(&mut self) -> &mut TestEnv {
        &mut self.env
    }
}

impl Scenario {
    /// A fresh namespace for `test` with the config `cfg` builds (given the scratch
    /// directory, for effect files) written as `drumline.toml`; nothing runs yet.
    pub fn new(test: &str, cfg: impl FnOnce(&TestEnv) -> Cfg) -> Self {
        let env = setup(test);
        let config = env.write_config("drumline.toml", &cfg(&env));
        Self {
            env,
            config,
            beats: Vec::new(),
            workers: Vec::new(),
        }
    }

    /// [`Scenario::new`], then `workers` workers (waiting until they consume) and `beats` beats.
    pub async fn start(
        test: &str,
        beats: usize,
        workers: usize,
        cfg: impl FnOnce(&TestEnv) -> Cfg,
    ) -> Self {
        let mut sc = Self::new(test, cfg);
        sc.start_workers(workers).await;
        (0..beats).for_each(|_| {
            sc.start_beat();
        });
        sc
    }

    /// The config's path, for `--config`.
    pub fn cfg(&self) -> &str {
        self.config.to_str().expect("utf-8 path")
    }

    /// Writes `cfg` over `drumline.toml` (a reload, or the file a later beat reads).
    pub fn rewrite(&self, cfg: &Cfg) {
        self.env.write_config("drumline.toml", cfg);
    }

    /// Starts one more beat on the config; returns it.
    pub fn start_beat(&mut self) -> &mut Proc {
        let label = numbered("beat", self.beats.len());
        let beat = self.env.beat(&label, &["--config", self.cfg()]);
        self.beats.push(beat);
        self.beats.last_mut().expect("just started")
    }

    /// Starts `n` more workers on the config and waits until the first consumes (its topology
    /// declared and bound).
    pub async fn start_workers(&mut self, n: usize) {
        for _ in 0..n {
            let label = numbered("worker", self.workers.len());
            let worker = self.env.worker(&label, &["--config", self.cfg()]);
            self.workers.push(worker);
        }
        if let Some(first) = self.workers.first() {
            self.env.wait_for_topology(first).await;
        }
    }

    /// Starts one more worker with `extra` arguments after `--config CFG`, and waits until the
    /// first worker consumes.
    pub async fn start_worker_with(&mut self, extra: &[&str]) -> &mut Proc {
        let label = numbered("worker", self.workers.len());
        let args = [&["--config", self.cfg()], extra].concat();
        self.workers.push(self.env.worker(&label, &args));
        self.env.wait_for_topology(&self.workers[0]).await;
        self.workers.last_mut().expect("just started")
    }

    /// Starts one more worker with extra environment `vars` (see [`TestEnv::worker_with_env`])
    /// and waits until the first worker consumes.
    pub async fn start_worker_env(&mut self, vars: &[(&str, &str)]) -> &mut Proc {
        let label = numbered("worker", self.workers.len());
        let worker = self
            .env
            .worker_with_env(&label, &["--config", self.cfg()], vars);
        self.workers.push(worker);
        self.env.wait_for_topology(&self.workers[0]).await;
        self.workers.last_mut().expect("just started")
    }

    /// Waits (up to a minute: the longest any file waited for a run state) until instance
    /// `key`'s run state is `state`, or panics with every log tail.
    pub async fn wait_state(&self, key: &str, state: &str) {
        let reached = || async { self.env.run_state(key).await.as_deref() == Some(state) };
        let held = wait_until_async(Duration::from_secs(60), reached).await;
        let now = self.env.run_state(key).await;
        self.check(held, format!("{key} is {now:?}, not {state}"));
    }

    /// Starts one more worker that also serves `/metrics`, and waits until the first worker
    /// consumes: the metrics port.
    pub async fn start_metered_worker(&mut self) -> u16 {
        let label = numbered("worker", self.workers.len());
        let (args, port) = crate::with_metrics(&["--config", self.cfg()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.workers.push(self.env.worker(&label, &args));
        self.env.wait_for_topology(&self.workers[0]).await;
        port
    }

    /// Starts one more beat that also serves `/metrics` (and `/healthz`): the port.
    pub fn start_metered_beat(&mut self) -> u16 {
        let label = numbered("beat", self.beats.len());
        let (args, port) = crate::with_metrics(&["--config", self.cfg()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.beats.push(self.env.beat(&label, &args));
        port
    }

    /// The beat started last.
    pub fn last_beat(&mut self) -> &mut Proc {
        self.beats.last_mut().expect("a beat was started")
    }

    /// The last lines of every process's log, for a failure message.
    /// Panics with `what` and every log tail unless `held`.
    pub fn check(&self, held: bool, what: impl Display) {
        let procs: Vec<&Proc> = self.beats.iter().chain(&self.workers).collect();
        check(held, &procs, what);
    }

    /// Waits until `condition` holds, or panics with `what` and every log tail after `within`.
    pub fn wait(&self, within: Duration, what: impl Display, condition: impl FnMut() -> bool) {
        self.check(wait_until(within, condition), what);
    }

    /// Asserts `condition` holds throughout `within` (polled every 100 ms), or panics with
    /// `what` and every log tail the first time it does not.
    pub fn hold(&self, within: Duration, what: impl Display, mut condition: impl FnMut() -> bool) {
        let until = std::time::Instant::now() + within;
        while std::time::Instant::now() < until {
            self.check(condition(), &what);
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Async variant of [`Scenario::wait`].
    pub async fn wait_async<F, Fut>(&self, within: Duration, what: impl Display, condition: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        self.check(wait_until_async(within, condition).await, what);
    }

    /// Stops every beat, then every worker (SIGTERM), and checks each exited cleanly.
    pub fn stop(&mut self) {
        let mut procs: Vec<&mut Proc> = self
            .beats
            .iter_mut()
            .chain(self.workers.iter_mut())
            .collect();
        stop(&mut procs);
    }

    /// `drumline --config CFG args…`, which must succeed: its stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        self.run_ok("drumline", args)
    }

    /// `drumline-beat --config CFG status --json`, parsed.
    pub fn status_json(&self) -> serde_json::Value {
        let out = self.run_ok("drumline-beat", &["status", "--json"]);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("status --json: {e}\n{out}"))
    }

    /// `drumline --config CFG audit JOB --json [extra…]`: its rows.
    pub fn audit_rows(&self, job: &str, extra: &[&str]) -> Vec<serde_json::Value> {
        let mut args = vec!["audit", job, "--json"];
        args.extend_from_slice(extra);
        let out = self.cli(&args);
        let doc: serde_json::Value = serde_json::from_str(&out).expect("audit --json");
        doc["instants"].as_array().expect("instants").clone()
    }

    /// `drumline-worker --config CFG dlq list --json`: its rows, sorted by key.
    pub fn dlq_rows(&self) -> Vec<serde_json::Value> {
        let out = self.run_ok("drumline-worker", &["dlq", "list", "--json"]);
        let mut rows: Vec<serde_json::Value> = serde_json::from_str(&out).expect("dlq --json");
        rows.sort_by_key(|r| r["key"].as_str().unwrap_or_default().to_owned());
        rows
    }

    /// Waits until work queue `queue` (`default`…) is empty: each message taken and settled.
    pub async fn wait_drained(&self, queue: &str) {
        let name = self.env.names().work_queue(queue);
        let drained = || async { self.env.queue_len(&name).await == Some(0) };
        self.wait_async(WAIT, format!("{name} drained"), drained)
            .await;
    }

    /// Waits until work queue `queue` (`default`…) holds at least `n` messages.
    pub async fn wait_queued(&self, queue: &str, n: u32) {
        let name = self.env.names().work_queue(queue);
        let held = || async { self.env.queue_len(&name).await.is_some_and(|len| len >= n) };
        self.wait_async(WAIT, format!("{n} in {name}"), held).await;
    }

    /// Waits until `{ns}.dead` holds at least `n` dead letters.
    pub async fn wait_dead_letters(&self, n: u32) {
        let dead = self.env.names().dead();
        let held = || async { self.env.queue_len(&dead).await.is_some_and(|len| len >= n) };
        self.wait_async(WAIT, format!("{n} dead letters"), held)
            .await;
    }

    /// `bin --config CFG args…`, which must succeed: its stdout.
    pub fn run_ok(&self, bin: &str, args: &[&str]) -> String {
        let mut all = vec!["--config", self.cfg()];
        all.extend_from_slice(args);
        let (status, out, err) = self.env.run(bin, &all);
        assert!(status.success(), "{bin} {args:?}: {status}\n{out}{err}");
        out
    }
}

/// Runs `command` to its end and asserts it succeeded, with `what` and its stderr when it did
/// not (or could not start): its output.
pub fn run_checked(command: &mut std::process::Command, what: &str) -> std::process::Output {
    let out = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what} failed: {stderr}");
    out
}

/// `base` for the first, `base-N` for the N-th.
fn numbered(base: &str, started: usize) -> String {
    match started {
        0 => base.to_owned(),
        n => format!("{base}-{}", n + 1),
    }
}

pub use crate::probe::tails;

/// Panics with `what` and `procs`' log tails unless `held`.
pub fn check(held: bool, procs: &[&Proc], what: impl Display) {
    assert!(held, "{what}\n{}", tails(procs));
}

/// Waits until `condition` holds, or panics with `what` and `procs`' log tails after `within`.
pub fn wait_for(
    within: Duration,
    procs: &[&Proc],
    what: impl Display,
    condition: impl FnMut() -> bool,
) {
    check(wait_until(within, condition), procs, what);
}

/// Stops each of `procs` still running in turn (SIGTERM, 20 s to exit); panics with every log
/// tail unless each exits cleanly, one that already exited by itself included. One already
/// waited for (stopped or killed by the test) is passed over.
pub fn stop(procs: &mut [&mut Proc]) {
    for i in 0..procs.len() {
        if procs[i].child.is_none() {
            continue;
        }
        let status = if procs[i].is_running() {
            procs[i].terminate(Duration::from_secs(20))
        } else {
            procs[i].wait(Duration::ZERO)
        };
        if !status.success() {
            let all: Vec<&Proc> = procs.iter().map(|p| &**p).collect();
            panic!("{} exited {status}\n{}", procs[i].label, tails(&all));
        }
    }
}

/// A task that appends its instance's key (`$DRUMLINE_KEY`) to effect file `file`, one line
/// per execution.
pub fn appends(env: &TestEnv, file: &str) -> Keys {
    appends_after(env, file, "true")
}

/// A task that runs `script` first, then appends its key to `file` (`script` failing appends
/// nothing: `&&`).
pub fn appends_after(env: &TestEnv, file: &str, script: &str) -> Keys {
    let effect = env.path(file);
    shell(&format!(
        "{script} && echo \"$DRUMLINE_KEY\" >> {}",
        effect.display()
    ))
}

/// Field `field` of instance `key`'s run record (`state`, `reason`, `token`, `lease_until`…):
/// [`TestEnv::run_field`] as a function.
pub async fn run_field(env: &TestEnv, key: &str, field: &str) -> Option<String> {
    let mut redis = env.redis().await;
    redis::cmd("HGET")
        .arg(env.names().run_key(key))
        .arg(field)
        .query_async(&mut redis)
        .await
        .expect("redis")
}

/// Sets field `field` of instance `key`'s run record to `value` (a record drumline did not
/// write, for a test to start from).
pub async fn set_run_field(env: &TestEnv, key: &str, field: &str, value: &str) {
    let mut redis = env.redis().await;
    let mut set = redis::cmd("HSET");
    set.arg(env.names().run_key(key)).arg(field).arg(value);
    let () = set.query_async(&mut redis).await.expect("redis HSET");
}

/// A blocking Redis connection (for samplers on threads of their own).
pub fn redis_sync() -> redis::Connection {
    redis::Client::open(REDIS_URL)
        .expect("redis url")
        .get_connection()
        .expect("redis connection")
}

/// What `{ns}:beat:leader` holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Leader {
    /// The leading beat's pid.
    pub pid: u64,
    /// Its term.
    pub epoch: u64,
}

/// The leader lease now, if any.
pub fn leader(env: &TestEnv) -> Option<Leader> {
    let text: Option<String> = redis::cmd("GET")
        .arg(env.names().beat_leader())
        .query(&mut redis_sync())
        .expect("redis GET");
    let value: serde_json::Value = serde_json::from_str(&text?).ok()?;
    Some(Leader {
        pid: value["pid"].as_u64()?,
        epoch: value["epoch"].as_u64()?,
    })
}

/// Job `job`'s progress `{ns}:beat:last:{job}`: the newest instant it published.
pub fn progress(env: &TestEnv, job: &str) -> Option<DateTime<Utc>> {
    let text: Option<String> = redis::cmd("GET")
        .arg(env.names().beat_last(job))
        .query(&mut redis_sync())
        .expect("redis GET");
    text.map(|t| parse_instant(&t))
}

/// An RFC 3339 instant as drumline writes it.
pub fn parse_instant(text: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(text)
        .unwrap_or_else(|e| panic!("{text:?} is not RFC 3339: {e}"))
        .with_timezone(&Utc)
}

/// One entry of the namespace's journal `{ns}:journal`: its stream id and its fields (`ev`,
/// `key`, `r`…).
pub type JournalEntry = (String, std::collections::HashMap<String, String>);

/// Every entry of the namespace's journal, oldest first.
pub async fn journal(env: &TestEnv) -> Vec<JournalEntry> {
    let mut redis = env.redis().await;
    redis::cmd("XRANGE")
        .arg(env.names().journal())
        .arg("-")
        .arg("+")
        .query_async(&mut redis)
        .await
        .expect("XRANGE the journal")
}

/// Every dead letter of the namespace, taken off `{ns}.dead` (acknowledged, so each is
/// returned once), oldest first.
pub async fn take_dead_letters(env: &TestEnv) -> Vec<lapin::message::BasicGetMessage> {
    use lapin::options::{BasicAckOptions, BasicGetOptions};
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.expect("a channel");
    let dead = env.names().dead();
    let mut out = Vec::new();
    let get = || ch.basic_get(dead.as_str().into(), BasicGetOptions::default());
    while let Some(msg) = get().await.expect("basic.get on the dead-letter queue") {
        msg.delivery
            .ack(BasicAckOptions::default())
            .await
            .expect("ack");
        out.push(msg);
    }
    let _ = conn.close(200, "bye".into()).await;
    out
}

/// (ready messages, consumers) of queue `name` on the broker at `url` (passive declare, on a
/// connection of its own: a missing queue closes the channel), or `None` if it does not exist.
pub async fn queue_counts_at(url: &str, name: &str) -> Option<(u32, u32)> {
    use lapin::options::QueueDeclareOptions;
    use lapin::{Connection, ConnectionProperties};
    let conn = Connection::connect(url, ConnectionProperties::default());
    let conn = conn.await.expect("amqp connection");
    let ch = conn.create_channel().await.expect("channel");
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let declared = ch.queue_declare(name.into(), passive, Default::default());
    let counts = declared.await.ok();
    let _ = conn.close(200, "bye".into()).await;
    counts.map(|q| (q.message_count(), q.consumer_count()))
}

/// Job `job`'s row of a `status --json` document; panics if it has none.
pub fn job_of<'a>(status: &'a serde_json::Value, job: &str) -> &'a serde_json::Value {
    let jobs = status["jobs"].as_array().expect("jobs");
    let row = jobs.iter().find(|j| j["job"] == job);
    row.unwrap_or_else(|| panic!("no job {job} in {status}"))
}

/// The row of `key` among `audit`'s `rows`; panics if it has none.
pub fn row_of<'a>(rows: &'a [serde_json::Value], key: &str) -> &'a serde_json::Value {
    let row = rows.iter().find(|r| r["key"] == key);
    row.unwrap_or_else(|| panic!("{key} not in {rows:?}"))
}

/// The class (`ran`, `dead`, `skipped`, `pending`…) `audit` gives `key` among `rows`.
pub fn class_of(rows: &[serde_json::Value], key: &str) -> Option<String> {
    let row = rows.iter().find(|r| r["key"] == key)?;
    row["class"].as_str().map(str::to_owned)
}

/// `cfg` written as `drumline.toml` and parsed as drumline does, for a worker run in the test's
/// own process; Redis is reached at `redis_url` (a proxy's, or [`REDIS_URL`]).
pub fn parsed(env: &TestEnv, cfg: &Cfg, redis_url: &str) -> drumline_shared::config::Config {
    use drumline_shared::config::{Config, ENV_AMQP_URL, ENV_REDIS_URL};
    let path = env.write_config("drumline.toml", cfg);
    let text = std::fs::read_to_string(&path).expect("read the config back");
    Config::parse(&text, &path, |name| match name {
        ENV_REDIS_URL => Some(redis_url.to_owned()),
        ENV_AMQP_URL => Some(crate::AMQP_URL.to_owned()),
        _ => None,
    })
    .unwrap_or_else(|e| panic!("{e}"))
}
