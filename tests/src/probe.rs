//! Probes: what an end-to-end test starts, waits for, reads and stops, in one call each, so a
//! test says its scenario and its checks and nothing else.
//!
//! - config: [`TestEnv::config_file`] writes a [`Cfg`]; [`TestEnv::appender`],
//!   [`TestEnv::script`] and [`argv`] make tasks; `Keys::task`/`text`/`texts` set string keys;
//! - start: [`TestEnv::start`] (config + beats + workers, topology awaited), [`TestEnv::scene`],
//!   [`TestEnv::beat_on`], [`TestEnv::worker_on`], [`TestEnv::worker_ready`], and `…_serving`
//!   variants that serve `/metrics` on a fresh port;
//! - wait: [`expect`] / [`expect_async`] (and [`TestEnv::expect_lines`],
//!   [`TestEnv::expect_state`], [`TestEnv::expect_drained`]) poll and, on a timeout, panic with the log tails;
//! - stop: [`stop`] (and [`Scene::stop`]) SIGTERMs processes and asserts they exit 0, with
//!   every log tail when one does not; [`stop_within`] also bounds the time to exit;
//! - read: [`TestEnv::runs_of`] (effect instants, each asserted once), [`series`] / [`total`]
//!   (Prometheus series), [`TestEnv::run_field`], [`TestEnv::get`], [`TestEnv::pttl`],
//!   [`TestEnv::ns_keys`], [`TestEnv::smembers`] (Redis), [`TestEnv::beat_cmd`] /
//!   [`TestEnv::status_json`], [`TestEnv::beat_ok`], [`TestEnv::drumline_cmd`], [`TestEnv::drumline_json`],
//!   [`TestEnv::apply`], [`TestEnv::audit_count`] (the CLI), [`TestEnv::expect_leader`];
//! - API: [`TestEnv::beat_with_api`] and [`api_request`] (docs/api.md).

use crate::cfg::{Cfg, Keys};
use crate::{counts, http_get, instant_of, toml_string, unused_port, wait_until, Proc, TestEnv};
use chrono::{DateTime, Utc};
use std::collections::BTreeMap;
use std::fmt::Display;
use std::time::Duration;

/// How long a stopped process gets to exit after SIGTERM (a worker drains its runs first).
pub const STOP_GRACE: Duration = Duration::from_secs(30);

/// The last 40 log lines of each of `procs`, for a failure message.
pub fn tails(procs: &[&Proc]) -> String {
    procs
        .iter()
        .map(|p| p.log_tail(40))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Polls `condition` until it holds or `within` passes; then panics with `what` and the log
/// tails of `procs`.
pub fn expect(
    within: Duration,
    procs: &[&Proc],
    what: impl Display,
    condition: impl FnMut() -> bool,
) {
    if !wait_until(within, condition) {
        panic!("{what}: not within {within:?}\n{}", tails(procs));
    }
}

/// Async variant of [`expect`].
pub async fn expect_async<F, Fut>(
    within: Duration,
    procs: &[&Proc],
    what: impl Display,
    condition: F,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    if !crate::wait_until_async(within, condition).await {
        panic!("{what}: not within {within:?}\n{}", tails(procs));
    }
}

/// Stops `procs` in order (SIGTERM, [`STOP_GRACE`] each) and asserts each exited 0; a failure
/// names the process and shows every log tail. One stopped before is passed over.
pub fn stop(procs: &mut [&mut Proc]) {
    let mut failed = Vec::new();
    for p in procs.iter_mut().filter(|p| p.child.is_some()) {
        let status = p.terminate(STOP_GRACE);
        if !status.success() {
            failed.push(format!("{} exited with {status}", p.label));
        }
    }
    if !failed.is_empty() {
        let all: Vec<&Proc> = procs.iter().map(|p| &**p).collect();
        panic!("{}\n{}", failed.join("; "), tails(&all));
    }
}

/// SIGTERMs `proc` and asserts it exits 0 in less than `within` (shutdown on time is what
/// the caller tests), with its log tail when not.
pub fn stop_within(proc: &mut Proc, within: Duration) {
    let asked = std::time::Instant::now();
    let status = proc.terminate(within);
    assert!(status.success(), "{status:?}\n{}", tails(&[proc]));
    assert!(
        asked.elapsed() < within,
        "exited {:?} after SIGTERM",
        asked.elapsed()
    );
}

/// A started scenario: its config file and its processes.
pub struct Scene {
    /// The config file every process was started with (`--config`).
    pub config: String,
    /// `beat-1`, `beat-2`, … (`beat` when there is one).
    pub beats: Vec<Proc>,
    /// `worker-1`, … (`worker` when there is one).
    pub workers: Vec<Proc>,
}

impl Scene {
    /// Every process, beats first.
    pub fn procs(&self) -> Vec<&Proc> {
        self.beats.iter().chain(&self.workers).collect()
    }

    /// [`expect`] with every process's log.
    pub fn expect(&self, within: Duration, what: impl Display, condition: impl FnMut() -> bool) {
        expect(within, &self.procs(), what, condition);
    }

    /// [`expect_async`] with every process's log.
    pub async fn expect_async<F, Fut>(&self, within: Duration, what: impl Display, condition: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        expect_async(within, &self.procs(), what, condition).await;
    }

    /// [`stop`]s the beats, then the workers.
    pub fn stop(&mut self) {
        let mut all: Vec<&mut Proc> = self.beats.iter_mut().chain(&mut self.workers).collect();
        stop(&mut all);
    }
}

/// The label of process `i` of `n` named `role`.
fn label(role: &str, i: usize, n: usize) -> String {
    if n == 1 {
        role.to_owned()
    } else {
        format!("{role}-{}", i + 1)
    }
}

impl TestEnv {
    /// Writes `cfg` as `drumline.toml`; its path, for `--config`.
    pub fn config_file(&self, cfg: &Cfg) -> String {
        self.config_named("drumline.toml", cfg)
    }

    /// Writes `cfg` as `name`; its path, for `--config`.
    pub fn config_named(&self, name: &str, cfg: &Cfg) -> String {
        let path = self.write_config(name, cfg);
        path.to_str().expect("utf-8 path").to_owned()
    }

    /// `drumline-beat --config CONFIG`.
    pub fn beat_on(&self, label: &str, config: &str) -> Proc {
        self.beat(label, &["--config", config])
    }

    /// `drumline-worker --config CONFIG`.
    pub fn worker_on(&self, label: &str, config: &str) -> Proc {
        self.worker(label, &["--config", config])
    }

    /// `drumline-worker --config CONFIG`, once it consumes (its topology declared and bound).
    pub async fn worker_ready(&self, label: &str, config: &str) -> Proc {
        let worker = self.worker_on(label, config);
        self.wait_for_topology(&worker).await;
        worker
    }

    /// `drumline-beat --config CONFIG` serving `/metrics`, the page and `/api/status` on a
    /// fresh port: (beat, port).
    pub fn beat_serving(&self, label: &str, config: &str) -> (Proc, u16) {
        let port = unused_port();
        let addr = format!("127.0.0.1:{port}");
        (
            self.beat(label, &["--config", config, "--metrics-addr", &addr]),
            port,
        )
    }

    /// `drumline-worker --config CONFIG` serving `/metrics` and `/healthz` on a fresh port:
    /// (worker, port).
    pub fn worker_serving(&self, label: &str, config: &str) -> (Proc, u16) {
        let port = unused_port();
        let addr = format!("127.0.0.1:{port}");
        let args = ["--config", config, "--metrics-addr", &addr];
        (self.worker(label, &args), port)
    }

    /// Starts a worker per label in `workers`, then a beat per label in `beats`, all on
    /// `config`, without waiting for anything.
    pub fn scene(&self, config: &str, beats: &[&str], workers: &[&str]) -> Scene {
        let workers = workers.iter().map(|l| self.worker_on(l, config)).collect();
        let beats = beats.iter().map(|l| self.beat_on(l, config)).collect();
        Scene {
            config: config.to_owned(),
            beats,
            workers,
        }
    }

    /// Writes `cfg`, starts `workers` workers, waits until they consume (their topology is
    /// declared), then starts `beats` beats.
    pub async fn start(&self, cfg: &Cfg, beats: usize, workers: usize) -> Scene {
        let config = self.config_file(cfg);
        let workers: Vec<Proc> = (0..workers)
            .map(|i| self.worker_on(&label("worker", i, workers), &config))
            .collect();
        if let Some(first) = workers.first() {
            self.wait_for_topology(first).await;
        }
        let beats = (0..beats)
            .map(|i| self.beat_on(&label("beat", i, beats), &config))
            .collect();
        Scene {
            config,
            beats,
            workers,
        }
    }

    /// Waits up to 60 s until effect file `file` has `n` lines or more; else panics with the
    /// log tails of `procs`.
    pub fn expect_lines(&self, file: &str, n: usize, procs: &[&Proc]) {
        let what = format!("{n} lines in {file}");
        expect(Duration::from_secs(60), procs, what, || {
            self.lines(file).len() >= n
        });
    }

    /// A task that appends `$DRUMLINE_KEY` to effect file `file` after `sleep` seconds.
    pub fn appender(&self, file: &str, sleep: f64) -> Keys {
        Keys::default().with("command", &self.append_key_command(file, sleep))
    }

    /// A task that runs `script` with `/bin/sh -c`, `{effects}` in it replaced by the path
    /// of effect file `effects` (so the script can write there).
    pub fn script(&self, script: &str) -> Keys {
        let path = self.path("effects").display().to_string();
        crate::cfg::shell(&script.replace("{effects}", &path))
    }

    /// `drumline-beat --config CONFIG ARGS…`: (exit code, stdout, stderr).
    pub fn beat_cmd(&self, config: &str, args: &[&str]) -> (i32, String, String) {
        self.cli("drumline-beat", config, args)
    }

    /// `BIN --config CONFIG ARGS…`: (exit code, stdout, stderr).
    fn cli(&self, bin: &str, config: &str, args: &[&str]) -> (i32, String, String) {
        let all: Vec<&str> = ["--config", config].iter().chain(args).copied().collect();
        let (status, out, err) = self.run(bin, &all);
        (status.code().unwrap_or(-1), out, err)
    }

    /// `drumline-beat --config CONFIG ARGS…`, asserted to exit 0: its stdout.
    pub fn beat_ok(&self, config: &str, args: &[&str]) -> String {
        let (code, out, err) = self.beat_cmd(config, args);
        assert_eq!(code, 0, "{args:?}: {out}{err}");
        out
    }

    /// Waits until the work queue `default` is empty (every copy settled); else panics with
    /// the log tails of `procs`.
    pub async fn expect_drained(&self, procs: &[&Proc]) {
        expect_async(
            Duration::from_secs(60),
            procs,
            "default drained",
            || async { self.default_queue_len().await == Some(0) },
        )
        .await;
    }

    /// `drumline --config CONFIG ARGS…`: (exit code, stdout, stderr).
    pub fn drumline_cmd(&self, config: &str, args: &[&str]) -> (i32, String, String) {
        self.cli("drumline", config, args)
    }

    /// Writes `json` to `file` in the scratch directory and runs `drumline --config CONFIG
    /// KIND apply FILE` (`kind`: `schedules` or `calendars`): (exit code, stdout, stderr).
    pub fn apply(&self, config: &str, kind: &str, file: &str, json: &str) -> (i32, String, String) {
        let path = self.path(file);
        std::fs::write(&path, json).expect("write the file to apply");
        let path = path.to_str().expect("utf-8 path");
        self.drumline_cmd(config, &[kind, "apply", path])
    }

    /// `drumline --config CONFIG ARGS… --json`, asserted to succeed, parsed.
    pub fn drumline_json(&self, config: &str, args: &[&str]) -> serde_json::Value {
        let all: Vec<&str> = args.iter().copied().chain(["--json"]).collect();
        let (code, out, err) = self.drumline_cmd(config, &all);
        assert_eq!(code, 0, "{args:?}: {err}");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
    }

    /// How many rows of `drumline audit JOB --json` satisfy `which` (0 while it fails), for
    /// polling.
    pub fn audit_count(
        &self,
        config: &str,
        job: &str,
        which: impl Fn(&serde_json::Value) -> bool,
    ) -> usize {
        let (_, out, _) = self.drumline_cmd(config, &["audit", job, "--json"]);
        let audit: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        let rows = audit["instants"].as_array().cloned().unwrap_or_default();
        rows.iter().filter(|r| which(r)).count()
    }

    /// Waits up to 30 s until `drumline status` names a leader; else panics with the log
    /// tails of `procs`.
    pub fn expect_leader(&self, config: &str, procs: &[&Proc]) {
        expect(Duration::from_secs(30), procs, "a leader", || {
            let (_, out, _) = self.drumline_cmd(config, &["status", "--json"]);
            serde_json::from_str::<serde_json::Value>(&out).is_ok_and(|s| s["leader"].is_object())
        });
    }

    /// `drumline --config CONFIG status --json`, asserted to succeed, parsed.
    pub fn status_json(&self, config: &str) -> serde_json::Value {
        let (status, out, err) = self.run("drumline", &["--config", config, "status", "--json"]);
        assert!(status.success(), "status --json: {err}");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("status --json: {e}: {out}"))
    }

    /// The instants run for `job` by effect file `file` (lines `job@instant`), in order, each
    /// asserted run once.
    pub fn runs_of(&self, file: &str, job: &str) -> Vec<DateTime<Utc>> {
        let prefix = format!("{job}@");
        let lines: Vec<String> = self
            .lines(file)
            .into_iter()
            .filter(|l| l.starts_with(&prefix))
            .collect();
        let counts = counts(&lines);
        let doubled: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
        assert!(doubled.is_empty(), "run more than once: {doubled:?}");
        counts.keys().map(|k| instant_of(k)).collect()
    }

    /// Waits until instance `key`'s Redis `state` is `state`; else panics with the log tails
    /// of `procs`.
    pub async fn expect_state(&self, key: &str, state: &str, procs: &[&Proc]) {
        let what = format!("{key} {state}");
        expect_async(Duration::from_secs(60), procs, what, || async {
            self.run_state(key).await.as_deref() == Some(state)
        })
        .await;
    }

    /// Field `field` of instance `key`'s Redis record (`state`, `token`, `attempt`, …).
    pub async fn run_field(&self, key: &str, field: &str) -> Option<String> {
        crate::scenario::run_field(self, key, field).await
    }

    /// The string at Redis key `key`.
    pub async fn get(&self, key: &str) -> Option<String> {
        self.query(redis::cmd("GET").arg(key)).await
    }

    /// Runs Redis command `cmd` on a connection of its own; panics when it fails.
    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        let mut redis = self.redis().await;
        let reply = cmd.query_async(&mut redis).await;
        reply.unwrap_or_else(|e| panic!("redis: {e}"))
    }

    /// Messages ready in the work queue of logical queue `default`.
    pub async fn default_queue_len(&self) -> Option<u32> {
        self.queue_len(&self.names().work_queue("default")).await
    }

    /// Sets the beat's progress for `job` (`{ns}:beat:last:{job}`) to `at`, as the beat
    /// writes it.
    pub async fn set_beat_last(&self, job: &str, at: DateTime<Utc>) {
        let text = drumline_shared::store::last_instant_text(at);
        let () = self
            .query(redis::cmd("SET").arg(self.names().beat_last(job)).arg(text))
            .await;
    }

    /// The time to live of Redis key `key`, in ms (`PTTL`: -2 when it does not exist, -1
    /// when it never expires).
    pub async fn pttl(&self, key: &str) -> i64 {
        self.query(redis::cmd("PTTL").arg(key)).await
    }

    /// Every Redis key of this namespace.
    pub async fn ns_keys(&self) -> Vec<String> {
        self.query(redis::cmd("KEYS").arg(format!("{}:*", self.ns)))
            .await
    }

    /// The members of Redis set `key`.
    pub async fn smembers(&self, key: &str) -> Vec<String> {
        self.query(redis::cmd("SMEMBERS").arg(key)).await
    }
}

/// Asserts consecutive `instants` are `seconds` apart (`what` names them in the failure).
pub fn assert_spaced(instants: &[DateTime<Utc>], seconds: i64, what: &str) {
    for pair in instants.windows(2) {
        assert_eq!(
            (pair[1] - pair[0]).num_seconds(),
            seconds,
            "{what}: {} then {}",
            pair[0],
            pair[1]
        );
    }
}

/// Every labelled series of metric `name` served on `port`: label set (`{a="x",b="y"}`) →
/// value (empty when unreachable).
pub fn series(port: u16, name: &str) -> BTreeMap<String, f64> {
    let Some((_, body)) = http_get(port, "/metrics") else {
        return BTreeMap::new();
    };
    body.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
        .filter_map(|l| {
            let (labels, value) = l.split_once("} ")?;
            Some((format!("{{{labels}}}"), value.trim().parse().ok()?))
        })
        .collect()
}

/// `{k="v",…}` → value, the expected side of [`series`].
pub fn rows(rows: &[(&str, f64)]) -> BTreeMap<String, f64> {
    rows.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// The sum of unlabelled metric `name` over the `/metrics` of `ports`.
pub fn total(ports: &[u16], name: &str) -> f64 {
    ports.iter().filter_map(|p| crate::metric(*p, name)).sum()
}

/// A task running `argv` as is (`["/bin/false"]`).
pub fn argv(argv: &[&str]) -> Keys {
    let items: Vec<String> = argv.iter().map(|a| toml_string(a)).collect();
    Keys::default().with("command", &format!("[{}]", items.join(", ")))
}

/// String-valued keys in one call, beside [`Keys::with`] (which takes TOML as written).
impl Keys {
    /// `task = "TASK"`: the job runs task `task`.
    pub fn task(self, task: &str) -> Self {
        self.with("task", &toml_string(task))
    }

    /// `key = "VALUE"`, `value` written as a TOML string.
    pub fn text(self, key: &str, value: &str) -> Self {
        self.with(key, &toml_string(value))
    }

    /// [`Keys::text`] for each (key, value).
    pub fn texts(self, pairs: &[(&str, &str)]) -> Self {
        pairs.iter().fold(self, |keys, (k, v)| keys.text(k, v))
    }
}

/// The beat's HTTP API (docs/api.md).
impl TestEnv {
    /// `drumline-beat --config CONFIG --api-addr ADDR` with `DRUMLINE_API_TOKEN=token`, once
    /// its API answers: (beat, port).
    pub fn beat_with_api(&self, config: &str, token: &str) -> (Proc, u16) {
        let port = unused_port();
        let addr = format!("127.0.0.1:{port}");
        let args = ["--config", config, "--api-addr", &addr];
        let beat = self.beat_with_env("beat", &args, &[("DRUMLINE_API_TOKEN", token)]);
        expect(Duration::from_secs(30), &[&beat], "the API answers", || {
            api_request(port, "GET /api/v1/schedules", None, "").is_some()
        });
        (beat, port)
    }
}

/// One HTTP/1.1 request `"METHOD PATH"` on 127.0.0.1:`port` with bearer `token` (none: no
/// header) and `body`: (status, content type, body as JSON, `Null` when it is not).
pub fn api_request(
    port: u16,
    request: &str,
    token: Option<&str>,
    body: &str,
) -> Option<(u16, String, serde_json::Value)> {
    api_request_with(port, request, token, &[], body)
}

/// [`api_request`] with the extra request `headers` (name, value).
pub fn api_request_with(
    port: u16,
    request: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
    body: &str,
) -> Option<(u16, String, serde_json::Value)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let mut extra = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    for (name, value) in headers {
        extra.push_str(&format!("{name}: {value}\r\n"));
    }
    let head = format!(
        "{request} HTTP/1.1\r\nHost: localhost\r\n{extra}Content-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(format!("{head}{body}").as_bytes()).ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let status = answer.split(' ').nth(1)?.parse().ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    let content_type = head.lines().find_map(|l| {
        let l = l.to_ascii_lowercase();
        l.strip_prefix("content-type: ").map(str::to_owned)
    });
    let json = serde_json::from_str(body).unwrap_or(serde_json::Value::Null);
    Some((status, content_type.unwrap_or_default(), json))
}
