//! `drumline.toml` in two steps (docs/design.md): a raw, deserialised form, then a checked
//! [`Config`] in which cron strings, durations, zones and task references are already resolved.
//! A bad config yields one [`ConfigError`] naming the file, the job or task, and the key.

pub use crate::calendar::Calendar;
use crate::duration;
use crate::jitter::Jitter;
pub use crate::limit::{Limit, Rate};
pub use crate::policy::{Overlap, QueueType};
pub use crate::run::WaitReplicas;
use crate::schedule::{parse_timezone, CronExpr, DstFold, DstGap, Schedule};
use crate::url;
use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

mod after;
mod chunks;
mod dynamic;

pub use dynamic::{Placed, Refusal, RefusalKind, ScheduleSpec};

/// `[[jobs]]` parsed per piece when a file is cut ([`chunks`]).
const JOBS_PER_PIECE: usize = 1000;

/// Most threads that parse a cut file's pieces at once ([`parse_pieces`]).
const PARSE_THREADS: usize = 4;

/// Env var that overrides `[broker] url`.
pub const ENV_AMQP_URL: &str = "DRUMLINE_AMQP_URL";
/// Env var that overrides `[redis] url`.
pub const ENV_REDIS_URL: &str = "DRUMLINE_REDIS_URL";
/// Env var naming the config file when `--config` is not given.
pub const ENV_CONFIG: &str = "DRUMLINE_CONFIG";
/// Config file used when neither `--config` nor `DRUMLINE_CONFIG` is given.
pub const DEFAULT_CONFIG_PATH: &str = "drumline.toml";

/// A refused config: where, which key, what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// The config file.
    pub file: PathBuf,
    /// `job "x"`, `task "y"`, `[worker]`, … or nothing for the top level.
    pub place: Option<String>,
    /// The offending key, if one.
    pub key: Option<String>,
    /// What is wrong.
    pub message: String,
    /// Where in the file, for a TOML syntax error: shown as `FILE:LINE:COLUMN: message`
    /// followed by the line.
    pub at: Option<Box<Position>>,
}

/// A place in the config file (1-based line and column) and that line's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    /// Line, from 1.
    pub line: usize,
    /// Column in characters, from 1.
    pub column: usize,
    /// The line's text.
    pub text: String,
}

impl Position {
    /// The position of byte `offset` of `text` (clamped to its end).
    pub fn of(text: &str, offset: usize) -> Self {
        let mut offset = offset.min(text.len());
        while !text.is_char_boundary(offset) {
            offset -= 1;
        }
        let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
        let end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
        Position {
            line: text[..offset].matches('\n').count() + 1,
            column: text[start..offset].chars().count() + 1,
            text: text[start..end].trim_end_matches('\r').to_owned(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(at) = &self.at {
            return write!(
                f,
                "{}:{}:{}: {}\n{}",
                self.file.display(),
                at.line,
                at.column,
                self.message,
                at.text
            );
        }
        write!(f, "{}", self.file.display())?;
        if let Some(place) = &self.place {
            write!(f, ": {place}")?;
        }
        if let Some(key) = &self.key {
            write!(f, ": key `{key}`")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// The checked configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it came from.
    pub path: PathBuf,
    /// Namespace for every name on the broker and in Redis. Default `drumline`.
    pub namespace: String,
    /// AMQP URL; env `DRUMLINE_AMQP_URL` wins. Default `amqp://guest:guest@127.0.0.1:5672/%2f`.
    /// Checked at load; print it only through [`url::Redacted`]. With `[broker] urls`, the first
    /// of them.
    pub broker_url: String,
    /// `[broker] urls` / `url` / `DRUMLINE_AMQP_URL` as the list of nodes to connect to, in
    /// order (see [`BrokerConfig`]). Never empty; `broker_urls[0] == broker_url`.
    pub broker: BrokerConfig,
    /// Redis URL; env `DRUMLINE_REDIS_URL` wins. Default `redis://127.0.0.1:6379/0`.
    /// Checked at load; print it only through [`url::Redacted`].
    pub redis_url: String,
    /// `[broker] ca_file`: PEM file of the CAs an `amqps://` broker is trusted by, instead of the
    /// system roots. Default none (system roots). Checked at load.
    pub broker_ca_file: Option<PathBuf>,
    /// `[redis] ca_file`: PEM file of the CAs a `rediss://` server is trusted by, instead of the
    /// system roots. Default none (system roots). Checked at load.
    pub redis_ca_file: Option<PathBuf>,
    /// `[redis] wait_replicas` (default 0) and `wait_timeout` (default 1 s).
    pub redis_wait: WaitReplicas,
    /// `[beat]`.
    pub beat: BeatConfig,
    /// `[worker]`.
    pub worker: WorkerConfig,
    /// `[journal]`: the fate decisions kept in `{ns}:journal` (docs/design.md#journal).
    pub journal: JournalConfig,
    /// `[api]`.
    pub api: ApiConfig,
    /// `[telemetry]`.
    pub telemetry: TelemetryConfig,
    /// `[[jobs]]`, in file order.
    pub jobs: Vec<Job>,
    /// `[tasks.*]`, by name.
    pub tasks: BTreeMap<String, Task>,
    /// `[limits.*]`, by name (docs/design.md#limits). Default none.
    pub limits: BTreeMap<String, Limit>,
    /// `[calendars.*]`, by name (docs/design.md#calendars). Default none.
    pub calendars: BTreeMap<String, Calendar>,
}

impl Config {
    /// The environment variables no task may see (docs/configuration.md, a shell task's environment):
    /// every one drumline reads itself (the broker and Redis URLs, each HTTP task's
    /// `secret_env`), whether or not it is set, and `[worker] env_remove`.
    pub fn hidden_from_tasks(&self) -> Vec<String> {
        let read = [ENV_AMQP_URL, ENV_REDIS_URL, &self.api.token_env].map(|v| v.to_owned());
        let secrets = self
            .tasks
            .values()
            .filter_map(|t| t.http.as_ref()?.secret_env.clone());
        let mut names: Vec<String> = read.into_iter().chain(secrets).collect();
        names.extend(self.worker.env_remove.iter().cloned());
        names.sort();
        names.dedup();
        names
    }

    /// Re-reads the file this config came from (SIGHUP). `Err` — a file that does not load —
    /// leaves the caller on its running config. The second value names what changed but takes
    /// a restart to apply: everything outside `[[jobs]]` and `[tasks.*]`.
    pub fn reload(&self) -> Result<(Config, Vec<&'static str>), ConfigError> {
        let new = Config::load(&self.path)?;
        let restart = [
            ("namespace", self.namespace != new.namespace),
            (
                "[broker]",
                (&self.broker, &self.broker_ca_file) != (&new.broker, &new.broker_ca_file),
            ),
            (
                "[redis]",
                (&self.redis_url, &self.redis_ca_file, self.redis_wait)
                    != (&new.redis_url, &new.redis_ca_file, new.redis_wait),
            ),
            ("[beat]", self.beat != new.beat),
            ("[worker]", self.worker != new.worker),
            ("[journal]", self.journal != new.journal),
            ("[api]", self.api != new.api),
            ("[telemetry]", self.telemetry != new.telemetry),
        ]
        .into_iter()
        .filter_map(|(what, changed)| changed.then_some(what))
        .collect();
        Ok((new, restart))
    }
}

/// `[beat]` settings.
#[derive(Debug, Clone, PartialEq)]
pub struct BeatConfig {
    /// Leader lease. Default 10 s.
    pub leader_lease: Duration,
    /// An instance not published within this of its instant is missed. Default 5 s.
    pub misfire_threshold: Duration,
}

/// `[worker]` settings (CLI flags win).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerConfig {
    /// Tasks run at once, across all queues. Default 4.
    pub concurrency: usize,
    /// Logical queues consumed. Default `["default"]`.
    pub queues: Vec<String>,
    /// Claim lease, renewed every lease/3. Default 30 s.
    pub lease: Duration,
    /// How long in-flight handlers may finish after SIGTERM. Default 30 s.
    pub shutdown_grace: Duration,
    /// Retention of `done`/`skipped`/`dead` run states. Default 7 d.
    pub done_ttl: Duration,
    /// Message TTL of the `{ns}.dead` queue and its watch queue `{ns}.dead.watch`. Default 7 d.
    pub dead_ttl: Duration,
    /// Larger bodies are dead-lettered unread. Default 1 MiB.
    pub max_message_bytes: usize,
    /// Variables of the worker's environment that tasks do not inherit, on top of
    /// `DRUMLINE_AMQP_URL` and `DRUMLINE_REDIS_URL` (always removed). Default none.
    pub env_remove: Vec<String>,
}

/// `[journal]` settings: the stream `{ns}:journal` of fate decisions (docs/design.md#journal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalConfig {
    /// Whether the workers' scripts and the leader append to it. Default `true`.
    pub enabled: bool,
    /// Entries older than this are trimmed (by `MINID`, against Redis `TIME`). Default 7 d.
    pub keep: Duration,
    /// At most about this many entries are kept (`MAXLEN ~`). Default 10,000,000.
    pub max_len: u64,
}

impl Default for JournalConfig {
    fn default() -> Self {
        JournalConfig {
            enabled: true,
            keep: Duration::from_secs(7 * 86_400),
            max_len: DEFAULT_JOURNAL_MAX_LEN,
        }
    }
}

/// `[journal] max_len`'s default.
pub const DEFAULT_JOURNAL_MAX_LEN: u64 = 10_000_000;

/// What the beat does with instances it could not publish in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Misfire {
    /// Publish only the latest missed instance (default).
    #[default]
    RunOnce,
    /// Publish the missed instances oldest first (at most `max_catch_up`, the most recent).
    CatchUp,
    /// Publish none of them.
    Skip,
}

/// One checked `[[jobs]]` entry. A config may hold a million of them: what can be derived is
/// not stored (the schedule's text), what jobs share is held once ([`JobSpec`]), and what few
/// jobs have is boxed (about 90 bytes a job with a short name; docs/performance.md).
#[derive(Debug, Clone)]
pub struct Job {
    /// Unique name; part of every idempotency key.
    pub name: String,
    /// When it is due.
    pub schedule: Schedule,
    /// Zone the cron is evaluated in. Default UTC.
    pub timezone: Tz,
    /// What it runs and how its instances are handled: one `Arc` for every job with the same.
    pub spec: Arc<JobSpec>,
    /// `jitter = "D"`: every instant is published this job's fixed offset in `[0, D)` late;
    /// keys keep the instant (docs/design.md#jitter). Default none.
    pub jitter: Option<Box<Jitter>>,
    /// `after = "UPSTREAM"`: the job has no schedule of its own and follows UPSTREAM's
    /// instances (docs/design.md#job-dependencies); `schedule` and `timezone` are then its
    /// root's (the first job up the chain with a schedule). Default none.
    pub after: Option<Box<After>>,
}

/// What a job runs and how its instances are handled: everything of it but its name, schedule,
/// zone, jitter and upstream. Jobs with the same share one (a config of a million jobs made
/// from a template holds a handful).
#[derive(Debug, Clone, PartialEq)]
pub struct JobSpec {
    /// The `[tasks.*]` entry it runs.
    pub task: Arc<str>,
    /// Logical queue. Default `default`.
    pub queue: Arc<str>,
    /// Handed to the task.
    pub args: Args,
    /// Message deadline relative to `scheduled_for`. Default none.
    pub expires: Option<Duration>,
    /// Default `skip`.
    pub overlap: Overlap,
    /// Default `run_once`.
    pub misfire: Misfire,
    /// Missed instances older than this are never published. Default 1 h.
    pub misfire_grace: Duration,
    /// Most missed instances `catch_up` publishes. Default 100.
    pub max_catch_up: usize,
    /// `exclude`: the calendars whose dates the job skips (docs/design.md#calendars). Default
    /// none.
    pub exclude: Vec<Arc<str>>,
}

/// A job's `args`: the JSON object handed to its task, held as its text. A parsed object
/// holds a tree node of several hundred bytes even for one key, and a million schedules each
/// have their own (docs/performance.md); the text is parsed once per message. Two are equal
/// when written alike (JSON equality would take 0.0 for -0.0: a job publishes what it says).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Args(Box<str>);

impl Args {
    /// The text of `value`.
    pub fn of(value: &serde_json::Value) -> Self {
        Args(value.to_string().into_boxed_str())
    }

    /// The JSON text, as it is published.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The object, parsed again from its text.
    pub fn value(&self) -> serde_json::Value {
        // An invariant, not an input: the text is what serde_json wrote of a value.
        serde_json::from_str(&self.0).expect("serde_json reads back the text it wrote")
    }
}

/// A follower's link to its upstream (`after`, `after_timeout`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct After {
    /// The job whose instance for the same instant must succeed first.
    pub upstream: String,
    /// `after_timeout`: how long after the instant the upstream's success may come; later, the
    /// instance is skipped (reason `upstream`). Default: the root's `every`, or 1 h for cron.
    pub timeout: Duration,
}

impl Job {
    /// How late each instant is published: the jitter's offset, zero without one.
    pub fn jitter_offset(&self) -> chrono::TimeDelta {
        self.jitter
            .as_ref()
            .map_or(chrono::TimeDelta::zero(), |j| j.delta())
    }

    /// The rule (`cron "…"` / `every 30s`), for display.
    pub fn schedule_text(&self) -> String {
        if let Some(after) = &self.after {
            return format!("after {}", after.upstream);
        }
        match &self.schedule {
            Schedule::Cron { cron, .. } => format!("cron \"{}\"", cron.as_str()),
            Schedule::Every { every, .. } => match every.to_std() {
                Ok(every) => format!("every {}", duration::format(every)),
                Err(_) => format!("every {every}"),
            },
        }
    }
}

/// One checked `[tasks.*]` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    /// Its name (the table key).
    pub name: String,
    /// Shell executor command (argv, no shell). `None` for tasks served by a Rust handler.
    pub command: Option<Vec<String>>,
    /// Kill the run after this long (retryable). Default none.
    pub timeout: Option<Duration>,
    /// Retries after the first run: at most `max_retries + 1` runs. Default 5.
    pub max_retries: u32,
    /// First retry delay, doubled per attempt. Default 1 s.
    pub retry_base: Duration,
    /// Retry delay cap. Default 10 min.
    pub retry_max: Duration,
    /// Exit codes that mean "do not retry". Default none.
    pub permanent_exit_codes: Vec<i32>,
    /// Variables added to the command's environment (the run's `DRUMLINE_*` context wins over
    /// them). Default none.
    pub env: BTreeMap<String, String>,
    /// HTTP executor: the endpoint each run is sent to (docs/design.md#the-http-executor).
    /// `None` for a `command` or a Rust handler; never both with `command`.
    pub http: Option<HttpTask>,
    /// `limit = "NAME"`: the `[limits.NAME]` its runs count against, resolved. Default none.
    pub limit: Option<Limit>,
}

/// `[tasks.NAME] http = { … }`, checked (docs/design.md#the-http-executor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpTask {
    /// The one URL every run of the task calls (`http://` or `https://`, a host, no
    /// credentials). Nothing in a message can change it.
    pub url: String,
    /// Request method, an upper-case token. Default `POST`.
    pub method: String,
    /// Extra request headers (names and values checked). Default none; the headers the
    /// executor sets itself (`Idempotency-Key`, `webhook-*`, `X-Drumline-*`, `Content-Type`)
    /// cannot be given here.
    pub headers: BTreeMap<String, String>,
    /// The whole request's deadline, response body included (retryable). Default 30 s.
    pub timeout: Duration,
    /// The environment variable holding the Standard Webhooks secret (`whsec_` + base64);
    /// `None`: requests are not signed. Read by the worker at start.
    pub secret_env: Option<String>,
    /// PEM file of the CAs an `https://` URL is trusted by, instead of the system roots.
    pub ca_file: Option<PathBuf>,
}

/// The request headers the HTTP executor sets itself, which `http.headers` may not name
/// (compared case-insensitively).
pub const HTTP_RESERVED_HEADERS: [&str; 11] = [
    "idempotency-key",
    "traceparent",
    "x-drumline-attempt",
    "x-drumline-fencing-token",
    "x-drumline-scheduled-for",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "content-type",
    "content-length",
    "host",
];

// ---------------------------------------------------------------------------------------------
// Raw form

/// The file as written. `J`/`T` are the job and task forms: [`RawJob`]/[`RawTask`] on the fast
/// path, `toml::Table` when an error must be pinned to a job or task by name.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig<J, T> {
    namespace: Option<String>,
    #[serde(default)]
    broker: RawBroker,
    #[serde(default)]
    redis: RawRedis,
    #[serde(default)]
    beat: RawBeat,
    #[serde(default)]
    worker: RawWorker,
    #[serde(default)]
    journal: RawJournal,
    #[serde(default)]
    api: RawApi,
    #[serde(default)]
    telemetry: RawTelemetry,
    /// `None` when the file has no `[[jobs]]` (and, in the rest of a cut file, must be).
    jobs: Option<Vec<J>>,
    #[serde(default = "BTreeMap::new")]
    tasks: BTreeMap<String, T>,
    #[serde(default = "BTreeMap::new")]
    limits: BTreeMap<String, RawLimit>,
    #[serde(default = "BTreeMap::new")]
    calendars: BTreeMap<String, RawCalendar>,
}

/// `[calendars.NAME]` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCalendar {
    dates: Vec<String>,
}

/// The `[calendars.*]`: names checked, dates parsed.
fn check_calendars(
    fail: &Failer,
    raw: BTreeMap<String, RawCalendar>,
) -> Result<BTreeMap<String, Calendar>, ConfigError> {
    raw.into_iter()
        .map(|(name, c)| {
            let place = format!("calendar {name:?}");
            check_name(&name)
                .map_err(|m| fail.at(Some(&place), "name", format!("{name:?} {m}")))?;
            let calendar = Calendar::parse(&c.dates)
                .map_err(|e| fail.at(Some(&place), "dates", e.to_string()))?;
            Ok((name, calendar))
        })
        .collect()
}

/// An "unknown field `evry`, expected one of `name`, …" message with the closest known key
/// named, when one is close: "unknown field `evry`: did you mean `every`? (expected one of …)".
/// Any other message as it is.
fn suggest_key(message: &str) -> String {
    let unknown = message.strip_prefix("unknown field `").and_then(|rest| {
        let (given, rest) = rest.split_once('`')?;
        Some((given, rest.strip_prefix(", expected one of ")?))
    });
    let Some((given, known)) = unknown else {
        return message.to_owned();
    };
    let closest = known
        .split(", ")
        .map(|k| k.trim_matches('`'))
        .map(|k| (strsim::jaro_winkler(given, k), k))
        .max_by(|a, b| a.0.total_cmp(&b.0));
    match closest {
        Some((score, key)) if score >= 0.8 => {
            format!("unknown field `{given}`: did you mean `{key}`? (expected one of {known})")
        }
        _ => message.to_owned(),
    }
}

/// `[api]` as written.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawApi {
    addr: Option<String>,
    token_env: Option<String>,
}

/// `[api]`: the HTTP API every beat serves (docs/api.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiConfig {
    /// `addr`: where to serve it; `--api-addr` wins. Default none (not served).
    pub addr: Option<std::net::SocketAddr>,
    /// `token_env`: the variable holding the bearer token every request must carry. Default
    /// `DRUMLINE_API_TOKEN`.
    pub token_env: String,
}

/// The variable `[api] token_env` names by default.
pub const DEFAULT_API_TOKEN_ENV: &str = "DRUMLINE_API_TOKEN";

/// The `[api]` section.
fn check_api(fail: &Failer, a: RawApi) -> Result<ApiConfig, ConfigError> {
    let addr = match a.addr {
        None => None,
        Some(text) => Some(text.parse().map_err(|_| {
            let message = format!("{text:?} is not HOST:PORT (an IP address and a port)");
            fail.at(Some("[api]"), "addr", message)
        })?),
    };
    let token_env = a
        .token_env
        .unwrap_or_else(|| DEFAULT_API_TOKEN_ENV.to_owned());
    check_env_name(&token_env).map_err(|m| fail.at(Some("[api]"), "token_env", m))?;
    Ok(ApiConfig { addr, token_env })
}

/// `[telemetry]` as written.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTelemetry {
    otlp_endpoint: Option<String>,
}

/// `[telemetry]`: where drumline's own spans go (docs/operations.md#traces).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TelemetryConfig {
    /// `otlp_endpoint`: the base URL of an OTLP/HTTP collector (`http://host:4318`); spans
    /// are POSTed to its `/v1/traces`. Default none: nothing is exported.
    pub otlp_endpoint: Option<String>,
}

/// The `[telemetry]` section: an `http://` or `https://` URL with a host.
fn check_telemetry(fail: &Failer, t: RawTelemetry) -> Result<TelemetryConfig, ConfigError> {
    if let Some(text) = &t.otlp_endpoint {
        let parsed = ::url::Url::parse(text).ok();
        let web = parsed.filter(|u| matches!(u.scheme(), "http" | "https") && u.has_host());
        if web.is_none() {
            let message = format!("{text:?} is not an http:// or https:// URL");
            return Err(fail.at(Some("[telemetry]"), "otlp_endpoint", message));
        }
    }
    Ok(TelemetryConfig {
        otlp_endpoint: t.otlp_endpoint,
    })
}

/// `[limits.NAME]` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimit {
    concurrency: Option<i64>,
    rate: Option<String>,
}

/// `[redis]`: a URL section plus the replica wait.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawRedis {
    url: Option<String>,
    ca_file: Option<PathBuf>,
    wait_replicas: Option<i64>,
    wait_timeout: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawBeat {
    leader_lease: Option<String>,
    misfire_threshold: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawJournal {
    enabled: Option<bool>,
    keep: Option<String>,
    max_len: Option<i64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawWorker {
    concurrency: Option<i64>,
    queues: Option<Vec<String>>,
    lease: Option<String>,
    shutdown_grace: Option<String>,
    done_ttl: Option<String>,
    dead_ttl: Option<String>,
    max_message_bytes: Option<i64>,
    env_remove: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJob {
    name: String,
    task: String,
    cron: Option<String>,
    every: Option<String>,
    timezone: Option<String>,
    args: Option<toml::Value>,
    expires: Option<String>,
    overlap: Option<Overlap>,
    misfire: Option<Misfire>,
    dst_gap: Option<DstGap>,
    dst_fold: Option<DstFold>,
    misfire_grace: Option<String>,
    max_catch_up: Option<i64>,
    anchor: Option<String>,
    queue: Option<String>,
    jitter: Option<String>,
    after: Option<String>,
    after_timeout: Option<String>,
    exclude: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTask {
    command: Option<Vec<String>>,
    timeout: Option<String>,
    max_retries: Option<i64>,
    retry_base: Option<String>,
    retry_max: Option<String>,
    permanent_exit_codes: Option<Vec<i32>>,
    env: Option<BTreeMap<String, String>>,
    http: Option<RawHttp>,
    limit: Option<String>,
}

/// `[tasks.NAME] http` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHttp {
    url: String,
    method: Option<String>,
    headers: Option<BTreeMap<String, String>>,
    timeout: Option<String>,
    secret_env: Option<String>,
    ca_file: Option<PathBuf>,
}

// ---------------------------------------------------------------------------------------------
// [broker] (docs/design.md "Scale-out"): the nodes and the queue type

/// `[broker]` beyond `url` and `ca_file`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerConfig {
    /// The nodes, in the order they are tried: `DRUMLINE_AMQP_URL` alone when set, else
    /// `[broker] urls`, else `[broker] url`, else the default URL. Each checked at load; print
    /// them only through [`url::Redacted`].
    pub urls: Vec<String>,
    /// `[broker] queue_type`. Default classic.
    pub queue_type: QueueType,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawBroker {
    url: Option<String>,
    urls: Option<Vec<String>>,
    ca_file: Option<PathBuf>,
    queue_type: Option<QueueType>,
}

impl BrokerConfig {
    /// `urls` as checked, or `single` (the one URL in force) when `urls` was not used.
    fn or_single(mut self, single: &str) -> Self {
        if self.urls.is_empty() {
            self.urls.push(single.to_owned());
        }
        self
    }
}

/// The `[broker]` section's node list and queue type. The list is empty when `urls` is not
/// in force (`DRUMLINE_AMQP_URL` set, or no `urls` key): then the single URL is used.
fn check_broker(fail: &Failer, env_set: bool, b: &RawBroker) -> Result<BrokerConfig, ConfigError> {
    let queue_type = b.queue_type.unwrap_or_default();
    let urls = match (env_set, &b.urls) {
        (true, _) | (false, None) => Vec::new(),
        (false, Some(urls)) if urls.is_empty() => {
            return Err(fail.at(
                Some("[broker]"),
                "urls",
                "must list at least one URL (or leave `urls` out and use `url`)".into(),
            ))
        }
        (false, Some(urls)) => {
            for (i, text) in urls.iter().enumerate() {
                url::check_amqp(text).map_err(|e| {
                    fail.at(Some("[broker]"), "urls", format!("entry {}: {e}", i + 1))
                })?;
            }
            urls.clone()
        }
    };
    Ok(BrokerConfig { urls, queue_type })
}

// ---------------------------------------------------------------------------------------------
// Loading and checking

impl Config {
    /// Reads and checks `path`; env `DRUMLINE_AMQP_URL` / `DRUMLINE_REDIS_URL` win over the file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: path.to_owned(),
            place: None,
            key: None,
            message: format!("cannot read the config file: {e}"),
            at: None,
        })?;
        Self::parse(&text, path, |name| std::env::var(name).ok())
    }

    /// Checks `text` as if read from `path`, with `env` for the overrides (injected for tests).
    pub fn parse(
        text: &str,
        path: &Path,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let fail = Failer { file: path };
        // Parsed a piece at a time when the file can be cut ([`chunks`]); else, or when a
        // piece does not parse, the whole file at once, which gives every error as it always
        // has.
        let (prefix, jobs) = match Self::parse_in_pieces(text, &fail) {
            Some(parsed) => parsed?,
            None => Self::parse_whole(text, &fail)?,
        };
        let Prefix {
            namespace,
            beat,
            worker,
            journal,
            api,
            telemetry,
            tasks,
            limits,
            calendars,
            broker: raw_broker,
            redis: raw_redis,
        } = prefix;
        let amqp_env = env(ENV_AMQP_URL);
        let broker = check_broker(&fail, amqp_env.is_some(), &raw_broker)?;
        let broker_url = fail.url(
            ENV_AMQP_URL,
            amqp_env,
            "[broker]",
            raw_broker.url,
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            url::check_amqp,
        )?;
        let redis_wait = check_redis_wait(&fail, &raw_redis)?;
        let broker = broker.or_single(&broker_url);
        let broker_url = broker.urls[0].clone();
        let redis_url = check_redis_url(&fail, env(ENV_REDIS_URL), &raw_redis)?;
        Ok(Config {
            path: path.to_owned(),
            namespace,
            broker_url,
            broker,
            redis_url,
            broker_ca_file: fail.ca_file("[broker]", raw_broker.ca_file)?,
            redis_wait,
            redis_ca_file: fail.ca_file("[redis]", raw_redis.ca_file)?,
            beat,
            worker,
            journal,
            api,
            telemetry,
            jobs,
            tasks,
            limits,
            calendars,
        })
    }

    /// The whole file parsed at once: straight into the typed form; only when that fails,
    /// again keeping jobs and tasks as tables, so the error can name the job or task it is
    /// about.
    fn parse_whole(text: &str, fail: &Failer) -> Result<(Prefix, Vec<Job>), ConfigError> {
        let mut raw: RawConfig<RawJob, RawTask> = match toml::from_str(text) {
            Ok(raw) => raw,
            Err(fast) => return Err(fail.pinpoint(text, fast)),
        };
        let raw_jobs = raw.jobs.take().unwrap_or_default();
        let prefix = check_prefix(fail, raw)?;
        let mut jobs = JobChecker::new(&prefix.namespace, &prefix.tasks, raw_jobs.len());
        for j in raw_jobs {
            jobs.add(fail, j)?;
        }
        let jobs = jobs.done(fail)?;
        Ok((prefix, jobs))
    }

    /// The file cut into pieces ([`chunks`]) and parsed one piece at a time, each piece's jobs
    /// checked before the next is parsed (no more than one piece's raw form is held): the
    /// result, or an error the whole file gives too, or `None` for the caller to parse the
    /// whole file.
    fn parse_in_pieces(
        text: &str,
        fail: &Failer,
    ) -> Option<Result<(Prefix, Vec<Job>), ConfigError>> {
        let cut = chunks::cut(text, JOBS_PER_PIECE)?;
        let raw: RawConfig<RawJob, RawTask> = toml::from_str(&cut.rest).ok()?;
        if raw.jobs.is_some() {
            return None;
        }
        // An error stands only if the whole file parses (else the parse error comes first).
        let prefix = match check_prefix(fail, raw) {
            Ok(prefix) => prefix,
            Err(e) => return all_parse(&cut.jobs).then_some(Err(e)),
        };
        let mut jobs = JobChecker::new(&prefix.namespace, &prefix.tasks, 0);
        // Why checking stopped early: `None` when a piece does not parse (the whole file
        // decides then), else the job's error.
        let stopped = parse_pieces(&cut.jobs, |i, raw| {
            let Some(raw) = raw else {
                return Some(None);
            };
            for j in raw.jobs {
                if let Err(e) = jobs.add(fail, j) {
                    return Some(all_parse(&cut.jobs[i + 1..]).then_some(e));
                }
            }
            None
        });
        match stopped {
            Some(e) => e.map(Err),
            None => Some(jobs.done(fail).map(|jobs| (prefix, jobs))),
        }
    }

    /// The job named `name`.
    pub fn job(&self, name: &str) -> Option<&Job> {
        self.jobs.iter().find(|j| j.name == name)
    }

    /// Every logical queue anything here publishes to or consumes from.
    pub fn all_queues(&self) -> Vec<String> {
        let mut queues: Vec<String> = self.worker.queues.clone();
        for job in &self.jobs {
            if !queues.iter().any(|q| **q == *job.spec.queue) {
                queues.push(job.spec.queue.to_string());
            }
        }
        queues
    }
}

/// The config path: `--config` beats `DRUMLINE_CONFIG`, which beats `./drumline.toml`.
pub fn resolve_path(flag: Option<PathBuf>) -> PathBuf {
    flag.or_else(|| std::env::var_os(ENV_CONFIG).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH))
}

/// The `[beat]` section.
fn check_beat(fail: &Failer, b: &RawBeat) -> Result<BeatConfig, ConfigError> {
    let duration =
        |key, raw, default_secs| fail.duration("[beat]", key, raw, default_secs, Zero::Allowed);
    let leader_lease = duration("leader_lease", &b.leader_lease, 10)?;
    // Renewed every third of it, over a network round trip: shorter leases flap.
    if leader_lease < MIN_LEADER_LEASE {
        return Err(fail.at(Some("[beat]"), "leader_lease", "must be at least 1s".into()));
    }
    Ok(BeatConfig {
        leader_lease,
        misfire_threshold: duration("misfire_threshold", &b.misfire_threshold, 5)?,
    })
}

/// The `[journal]` section.
fn check_journal(fail: &Failer, j: &RawJournal) -> Result<JournalConfig, ConfigError> {
    let keep = fail.duration("[journal]", "keep", &j.keep, 7 * 86_400, Zero::Refused)?;
    let max_len = match j.max_len {
        None => DEFAULT_JOURNAL_MAX_LEN,
        Some(n) => u64::try_from(n).ok().filter(|n| *n >= 1).ok_or_else(|| {
            fail.at(
                Some("[journal]"),
                "max_len",
                format!("must be at least 1, not {n}"),
            )
        })?,
    };
    Ok(JournalConfig {
        enabled: j.enabled.unwrap_or(true),
        keep,
        max_len,
    })
}

/// `[redis] wait_replicas` and `wait_timeout`.
fn check_redis_wait(fail: &Failer, r: &RawRedis) -> Result<WaitReplicas, ConfigError> {
    let replicas = r.wait_replicas.unwrap_or(0);
    let replicas = u32::try_from(replicas)
        .ok()
        .filter(|n| *n <= MAX_WAIT_REPLICAS)
        .ok_or_else(|| {
            let m = format!("must be between 0 and {MAX_WAIT_REPLICAS}, not {replicas}");
            fail.at(Some("[redis]"), "wait_replicas", m)
        })?;
    let timeout = fail.duration("[redis]", "wait_timeout", &r.wait_timeout, 1, Zero::Refused)?;
    Ok(WaitReplicas { replicas, timeout })
}

/// Most `[redis] wait_replicas`.
pub const MAX_WAIT_REPLICAS: u32 = 100;

/// Shortest `[beat] leader_lease`.
pub const MIN_LEADER_LEASE: Duration = Duration::from_secs(1);

/// Shortest `every` of a job: every request about a job (`trigger`, `next`, the status page)
/// then does bounded work (docs/design.md#bounded-work), and instants are whole milliseconds
/// apart with room to spare.
pub const MIN_EVERY: Duration = Duration::from_millis(100);

/// The `[worker]` section.
fn check_worker(fail: &Failer, w: RawWorker) -> Result<WorkerConfig, ConfigError> {
    let at = |key, message: &str| fail.at(Some("[worker]"), key, message.into());
    let duration =
        |key, raw, default_secs, zero| fail.duration("[worker]", key, raw, default_secs, zero);
    let concurrency = w.concurrency.unwrap_or(4);
    if concurrency < 1 {
        return Err(at("concurrency", "must be at least 1"));
    }
    let queues = w.queues.unwrap_or_else(|| vec!["default".to_owned()]);
    if queues.is_empty() {
        return Err(at("queues", "must name at least one queue"));
    }
    for q in &queues {
        check_name(q).map_err(|m| at("queues", &format!("{q:?} {m}")))?;
    }
    let max_message_bytes = w.max_message_bytes.unwrap_or(1 << 20);
    if max_message_bytes < 1 {
        return Err(at("max_message_bytes", "must be positive"));
    }
    let worker = WorkerConfig {
        concurrency: concurrency as usize,
        queues,
        lease: duration("lease", &w.lease, 30, Zero::Refused)?,
        shutdown_grace: duration("shutdown_grace", &w.shutdown_grace, 30, Zero::Allowed)?,
        done_ttl: duration("done_ttl", &w.done_ttl, 7 * 86400, Zero::Refused)?,
        dead_ttl: duration("dead_ttl", &w.dead_ttl, 7 * 86400, Zero::Refused)?,
        max_message_bytes: max_message_bytes as usize,
        env_remove: w.env_remove.unwrap_or_default(),
    };
    for name in &worker.env_remove {
        check_env_name(name).map_err(|m| at("env_remove", &m))?;
    }
    if worker.lease < Duration::from_secs(1) {
        return Err(at("lease", "must be at least 1s"));
    }
    Ok(worker)
}

/// The `[tasks.NAME]` tables, by name; `limit` must name one of `limits`.
fn check_tasks(
    fail: &Failer,
    raw: BTreeMap<String, RawTask>,
    limits: &BTreeMap<String, Limit>,
) -> Result<BTreeMap<String, Task>, ConfigError> {
    let mut tasks = BTreeMap::new();
    for (name, mut t) in raw {
        let place = format!("task {name:?}");
        check_name(&name).map_err(|m| fail.at(Some(&place), "name", m.to_string()))?;
        let limit = match t.limit.take() {
            Some(wanted) => Some(limits.get(&wanted).cloned().ok_or_else(|| {
                let known: Vec<&str> = limits.keys().map(String::as_str).collect();
                let m = format!("no [limits.{wanted}] in this file (limits: {known:?})");
                fail.at(Some(&place), "limit", m)
            })?),
            None => None,
        };
        let mut task = check_task(fail, &place, name.clone(), t)?;
        task.limit = limit;
        tasks.insert(name, task);
    }
    Ok(tasks)
}

/// The `[limits.NAME]` tables, by name: each has a `concurrency` of at least 1, a `rate` that
/// reads as `N/PERIOD` with N at least 1, or both (docs/design.md#limits).
fn check_limits(
    fail: &Failer,
    raw: BTreeMap<String, RawLimit>,
) -> Result<BTreeMap<String, Limit>, ConfigError> {
    let mut limits = BTreeMap::new();
    for (name, l) in raw {
        let place = format!("limit {name:?}");
        let at = |key, message: String| fail.at(Some(&place), key, message);
        check_name(&name).map_err(|m| at("name", m.to_string()))?;
        let concurrency = match l.concurrency {
            Some(n) => Some(
                u32::try_from(n)
                    .ok()
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| at("concurrency", format!("must be at least 1, not {n}")))?,
            ),
            None => None,
        };
        let rate = match &l.rate {
            Some(text) => Some(Rate::parse(text).map_err(|e| at("rate", e.to_string()))?),
            None => None,
        };
        if concurrency.is_none() && rate.is_none() {
            let m = "sets neither `concurrency` nor `rate`; give one or both".to_owned();
            return Err(at("concurrency", m));
        }
        let limit = Limit {
            name: name.clone(),
            concurrency,
            rate,
        };
        limits.insert(name, limit);
    }
    Ok(limits)
}

/// Parses `pieces` on up to [`PARSE_THREADS`] threads (piece `i` on thread `i % n`) and hands
/// each one's result to `check` on the calling thread, in file order (`None`: it does not
/// parse), until `check` returns something, which is returned. A thread runs at most one piece
/// ahead of `check` (a channel of one per thread), so no more than two pieces' raw form per
/// thread is held at once, as when they were parsed one at a time.
fn parse_pieces<T>(
    pieces: &[&str],
    mut check: impl FnMut(usize, Option<RawJobs>) -> Option<T>,
) -> Option<T> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, PARSE_THREADS)
        .min(pieces.len());
    if threads <= 1 {
        return pieces
            .iter()
            .enumerate()
            .find_map(|(i, p)| check(i, toml::from_str(p).ok()));
    }
    std::thread::scope(|scope| {
        let parsed: Vec<std::sync::mpsc::Receiver<Option<RawJobs>>> = (0..threads)
            .map(|t| {
                let (tx, rx) = std::sync::mpsc::sync_channel(1);
                scope.spawn(move || {
                    for piece in pieces.iter().skip(t).step_by(threads) {
                        // The checker stopped (an error, or done): so do we.
                        if tx.send(toml::from_str(piece).ok()).is_err() {
                            return;
                        }
                    }
                });
                rx
            })
            .collect();
        // Returning drops the receivers, which stops every thread at its next send.
        (0..pieces.len()).find_map(|i| check(i, parsed[i % threads].recv().ok().flatten()))
    })
}

/// Whether every piece of jobs parses.
fn all_parse(pieces: &[&str]) -> bool {
    pieces.iter().all(|p| toml::from_str::<RawJobs>(p).is_ok())
}

/// A piece of a cut file's jobs region ([`chunks`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJobs {
    jobs: Vec<RawJob>,
}

/// What is checked before the jobs (namespace, `[beat]`, `[worker]`, `[tasks.*]`, in that
/// order), and the raw sections checked after them.
struct Prefix {
    namespace: String,
    beat: BeatConfig,
    worker: WorkerConfig,
    journal: JournalConfig,
    api: ApiConfig,
    telemetry: TelemetryConfig,
    tasks: BTreeMap<String, Task>,
    limits: BTreeMap<String, Limit>,
    calendars: BTreeMap<String, Calendar>,
    broker: RawBroker,
    redis: RawRedis,
}

/// Checks everything of `raw` that comes before the jobs.
fn check_prefix<J>(fail: &Failer, raw: RawConfig<J, RawTask>) -> Result<Prefix, ConfigError> {
    let namespace = raw.namespace.unwrap_or_else(|| "drumline".to_owned());
    check_name(&namespace).map_err(|m| fail.at(None, "namespace", format!("{namespace:?} {m}")))?;
    let beat = check_beat(fail, &raw.beat)?;
    let worker = check_worker(fail, raw.worker)?;
    let journal = check_journal(fail, &raw.journal)?;
    let api = check_api(fail, raw.api)?;
    let telemetry = check_telemetry(fail, raw.telemetry)?;
    let limits = check_limits(fail, raw.limits)?;
    let tasks = check_tasks(fail, raw.tasks, &limits)?;
    let calendars = check_calendars(fail, raw.calendars)?;
    Ok(Prefix {
        namespace,
        beat,
        worker,
        journal,
        api,
        telemetry,
        tasks,
        limits,
        calendars,
        broker: raw.broker,
        redis: raw.redis,
    })
}

/// The `[[jobs]]`, checked one by one in file order; names must be unique.
struct JobChecker<'t> {
    /// The namespace: part of each job's jitter hash.
    namespace: &'t str,
    tasks: &'t BTreeMap<String, Task>,
    jobs: Vec<Job>,
    seen: HashSet<String>,
    /// Task and queue names, one `Arc` each for all the jobs that name them.
    interned: Interned,
}

impl<'t> JobChecker<'t> {
    fn new(namespace: &'t str, tasks: &'t BTreeMap<String, Task>, capacity: usize) -> Self {
        JobChecker {
            namespace,
            tasks,
            jobs: Vec::with_capacity(capacity),
            seen: HashSet::with_capacity(capacity),
            interned: Interned::default(),
        }
    }

    /// Checks the next job.
    fn add(&mut self, fail: &Failer, j: RawJob) -> Result<(), ConfigError> {
        if !self.seen.insert(j.name.clone()) {
            return Err(fail.at(
                Some(&format!("job {:?}", j.name)),
                "name",
                "duplicate job name: job names must be unique".into(),
            ));
        }
        self.jobs.push(check_job(
            fail,
            j,
            (self.namespace, self.tasks),
            &mut self.interned,
        )?);
        Ok(())
    }

    /// The checked jobs, in file order, with their `after` chains resolved.
    fn done(mut self, fail: &Failer) -> Result<Vec<Job>, ConfigError> {
        self.jobs.shrink_to_fit();
        resolve_chains(fail, &mut self.jobs)?;
        Ok(self.jobs)
    }
}

fn check_task(fail: &Failer, place: &str, name: String, t: RawTask) -> Result<Task, ConfigError> {
    if t.command.is_some() && t.http.is_some() {
        return Err(fail.at(
            Some(place),
            "http",
            "a task has a `command` or an `http` endpoint, not both".into(),
        ));
    }
    if let Some(cmd) = &t.command {
        if cmd.is_empty() || cmd[0].is_empty() {
            return Err(fail.at(
                Some(place),
                "command",
                "must name a program: command = [\"path\", \"arg\", …]".into(),
            ));
        }
    }
    let max_retries = t.max_retries.unwrap_or(5);
    if !(0..=1000).contains(&max_retries) {
        return Err(fail.at(
            Some(place),
            "max_retries",
            "must be between 0 and 1000".into(),
        ));
    }
    let retry_base = fail.duration(place, "retry_base", &t.retry_base, 1, Zero::Refused)?;
    let retry_max = fail.duration(place, "retry_max", &t.retry_max, 600, Zero::Refused)?;
    if retry_max < retry_base {
        return Err(fail.at(
            Some(place),
            "retry_max",
            "must not be smaller than retry_base".into(),
        ));
    }
    Ok(Task {
        name,
        command: t.command,
        timeout: match &t.timeout {
            Some(_) => Some(fail.duration(place, "timeout", &t.timeout, 0, Zero::Refused)?),
            None => None,
        },
        max_retries: max_retries as u32,
        retry_base,
        retry_max,
        permanent_exit_codes: t.permanent_exit_codes.unwrap_or_default(),
        env: check_env(fail, place, t.env.unwrap_or_default())?,
        http: match t.http {
            Some(h) => Some(check_http(fail, place, h)?),
            None => None,
        },
        limit: None,
    })
}

/// `[tasks.NAME] http`, checked; an error names the task and the key (`http.url`, …).
fn check_http(fail: &Failer, place: &str, h: RawHttp) -> Result<HttpTask, ConfigError> {
    check_http_url(&h.url).map_err(|m| fail.at(Some(place), "http.url", m))?;
    let method = h.method.unwrap_or_else(|| "POST".into());
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
        let m = format!("{method:?} is not a method: upper-case letters, like \"POST\"");
        return Err(fail.at(Some(place), "http.method", m));
    }
    let headers = h.headers.unwrap_or_default();
    for (name, value) in &headers {
        check_http_header(name, value).map_err(|m| fail.at(Some(place), "http.headers", m))?;
    }
    if let Some(var) = &h.secret_env {
        check_env_name(var).map_err(|m| fail.at(Some(place), "http.secret_env", m))?;
    }
    let ca_file = match h.ca_file {
        Some(path) => {
            crate::tls::read_ca_file(&path)
                .map_err(|e| fail.at(Some(place), "http.ca_file", e.to_string()))?;
            Some(path)
        }
        None => None,
    };
    Ok(HttpTask {
        url: h.url,
        method,
        headers,
        timeout: fail.duration(place, "http.timeout", &h.timeout, 30, Zero::Refused)?,
        secret_env: h.secret_env,
        ca_file,
    })
}

/// An `http.url`: absolute `http`/`https` with a host, no user or password (a secret belongs
/// in `secret_env` or a header, not in a URL that is logged). The message never echoes it.
fn check_http_url(text: &str) -> Result<(), String> {
    let url = ::url::Url::parse(text).map_err(|e| format!("not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("scheme {:?}: must be http or https", url.scheme()));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err("names no host".into());
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err("must not hold a user or password; use headers or secret_env".into());
    }
    Ok(())
}

/// One `http.headers` entry: an RFC 9110 token name, not one the executor sets, and a value
/// of visible ASCII, spaces and tabs.
fn check_http_header(name: &str, value: &str) -> Result<(), String> {
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.is_empty() || !name.bytes().all(token) {
        return Err(format!("{name:?} is not a header name"));
    }
    if HTTP_RESERVED_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
        return Err(format!("{name:?} is set by drumline itself"));
    }
    if !value
        .bytes()
        .all(|b| b == b'\t' || (b' '..=b'~').contains(&b))
    {
        return Err(format!(
            "the value of {name:?} holds a control or non-ASCII byte"
        ));
    }
    Ok(())
}

/// An environment variable name a process can be given: not empty, no `=`, no NUL.
fn check_env_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.contains(['=', '\0']) {
        return Err(format!(
            "{name:?} is not a variable name (empty, or holds `=` or NUL)"
        ));
    }
    Ok(())
}

fn check_env(
    fail: &Failer,
    place: &str,
    env: BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, ConfigError> {
    for (name, value) in &env {
        check_env_name(name).map_err(|m| fail.at(Some(place), "env", m))?;
        if value.contains('\0') {
            return Err(fail.at(
                Some(place),
                "env",
                format!("the value of {name:?} holds a NUL byte"),
            ));
        }
    }
    Ok(env)
}

/// One job; an error is placed at `job "NAME"` (built only then: a 100,000-job file makes no
/// string per job to say where it is).
fn check_job(
    fail: &Failer,
    j: RawJob,
    (namespace, tasks): (&str, &BTreeMap<String, Task>),
    interned: &mut Interned,
) -> Result<Job, ConfigError> {
    check_job_keys(j, (namespace, tasks), interned)
        .map_err(|(name, (key, message))| fail.at(Some(&format!("job {name:?}")), key, message))
}

/// [`check_job`]'s checks, one key after another; a refusal comes back with the job's name
/// (moved out of `j`, not copied).
fn check_job_keys(
    j: RawJob,
    (namespace, tasks): (&str, &BTreeMap<String, Task>),
    interned: &mut Interned,
) -> Result<Job, (String, KeyError)> {
    macro_rules! check {
        ($e:expr) => {
            match $e {
                Ok(v) => v,
                Err(e) => return Err((j.name, e)),
            }
        };
    }
    check!(check_name(&j.name).map_err(|m| ("name", m.to_string())));
    check!(check_task_ref(&j.task, tasks));
    let (timezone, schedule, after) = check!(job_timing(&j));
    let policy = check!(job_policy(&j));
    let jitter = check!(job_jitter(&j, &schedule, namespace));
    let spec = check!(job_spec(&j, policy, interned));
    Ok(Job {
        name: j.name,
        schedule,
        timezone,
        spec,
        jitter: jitter.map(Box::new),
        after: after.map(Box::new),
    })
}

/// When the job runs: its zone (UTC by default) and its own schedule, or, for an `after` job,
/// the placeholder schedule and its upstream.
fn job_timing(j: &RawJob) -> Result<(Tz, Schedule, Option<After>), KeyError> {
    let timezone = match &j.timezone {
        Some(name) => parse_timezone(name).map_err(|e| ("timezone", e.to_string()))?,
        None => chrono_tz::UTC,
    };
    let (schedule, after) = match &j.after {
        Some(_) => follower(j)?,
        None => (job_schedule(j, timezone)?, None),
    };
    Ok((timezone, schedule, after))
}

/// What the job runs and how its instances are handled, shared through `interned` with every
/// job that has the same; `policy` is its checked overlap, misfire and `max_catch_up`.
fn job_spec(
    j: &RawJob,
    (overlap, misfire, max_catch_up): (Overlap, Misfire, usize),
    interned: &mut Interned,
) -> Result<Arc<JobSpec>, KeyError> {
    let queue = j.queue.as_deref().unwrap_or("default");
    check_name(queue).map_err(|m| ("queue", format!("{queue:?} {m}")))?;
    let queue = interned.name(queue);
    let args = job_args(j)?;
    let expires = match &j.expires {
        Some(_) => Some(job_duration("expires", &j.expires, 0, Zero::Refused)?),
        None => None,
    };
    let misfire_grace = job_duration("misfire_grace", &j.misfire_grace, 3600, Zero::Allowed)?;
    let exclude = j.exclude.iter().flatten().map(|name| {
        check_name(name).map_err(|m| ("exclude", format!("calendar {name:?} {m}")))?;
        Ok(interned.name(name))
    });
    let exclude = exclude.collect::<Result<Vec<_>, KeyError>>()?;
    let spec = JobSpec {
        task: interned.name(&j.task),
        queue,
        args,
        expires,
        overlap,
        misfire,
        misfire_grace,
        max_catch_up,
        exclude,
    };
    Ok(interned.spec(spec))
}

/// The job's `args` as the JSON handed to its task: a table, `{}` when absent.
fn job_args(j: &RawJob) -> Result<Args, KeyError> {
    let value = match &j.args {
        None => serde_json::json!({}),
        Some(v) if !v.is_table() => {
            let m = format!(
                "must be a table (args = {{ k = \"v\" }}), not {}",
                v.type_str()
            );
            return Err(("args", m));
        }
        Some(v) => serde_json::to_value(v).map_err(|e| ("args", e.to_string()))?,
    };
    Ok(Args::of(&value))
}

/// What the jobs checked so far share, one `Arc` each: task and queue names, and
/// [`JobSpec`]s (a job whose spec equals one already held, compared among those of the same
/// task and queue, at most [`SPECS_PER_TASK`] of them, shares it).
#[derive(Default)]
struct Interned {
    names: HashSet<Arc<str>>,
    /// Per (task, queue).
    specs: HashMap<TaskAndQueue, Vec<Arc<JobSpec>>>,
}

/// A job's task and queue names.
type TaskAndQueue = (Arc<str>, Arc<str>);

/// Distinct specs compared per task and queue before a job keeps its own (a file whose jobs
/// all differ in `args` would otherwise compare each with every other).
const SPECS_PER_TASK: usize = 16;

impl Interned {
    fn name(&mut self, name: &str) -> Arc<str> {
        if let Some(held) = self.names.get(name) {
            return held.clone();
        }
        let held: Arc<str> = Arc::from(name);
        self.names.insert(held.clone());
        held
    }

    fn spec(&mut self, spec: JobSpec) -> Arc<JobSpec> {
        let held = self
            .specs
            .entry((spec.task.clone(), spec.queue.clone()))
            .or_default();
        // `args` compare as written ([`Args`]).
        if let Some(same) = held.iter().find(|s| ***s == spec) {
            return same.clone();
        }
        let spec = Arc::new(spec);
        if held.len() < SPECS_PER_TASK {
            held.push(spec.clone());
        }
        spec
    }
}

/// The job's `jitter`: more than zero, and for `every` less than the period (a longer one
/// would only repeat smaller offsets and push each instant past the next).
fn job_jitter(
    j: &RawJob,
    schedule: &Schedule,
    namespace: &str,
) -> Result<Option<Jitter>, KeyError> {
    let Some(text) = &j.jitter else {
        return Ok(None);
    };
    let max = job_duration("jitter", &j.jitter, 0, Zero::Refused)?;
    if let Schedule::Every { every, .. } = schedule {
        if chrono::TimeDelta::from_std(max).is_ok_and(|m| m >= *every) {
            let every = every.to_std().map(duration::format).unwrap_or_default();
            return Err((
                "jitter",
                format!("{text:?} must be less than the period (every = {every:?})"),
            ));
        }
    }
    Ok(Some(Jitter::new(namespace, &j.name, max)))
}

/// A job's duration `key`, as [`Failer::duration`] checks it.
fn job_duration(
    key: &'static str,
    raw: &Option<String>,
    default_secs: u64,
    zero: Zero,
) -> Result<Duration, KeyError> {
    let d = match raw {
        None => Duration::from_secs(default_secs),
        Some(text) => duration::parse(text).map_err(|m| (key, m))?,
    };
    if zero == Zero::Refused && d.is_zero() {
        return Err((key, "must be greater than zero".into()));
    }
    Ok(d)
}

/// A refusal of one key of a job: the key and the message, placed by the caller.
type KeyError = (&'static str, String);

/// The job's `task` must name a defined task.
fn check_task_ref(task: &str, tasks: &BTreeMap<String, Task>) -> Result<(), KeyError> {
    if tasks.contains_key(task) {
        return Ok(());
    }
    let known: Vec<&str> = tasks.keys().map(String::as_str).collect();
    Err((
        "task",
        format!(
            "no task named {task:?}; define [tasks.{task}] (known tasks: {})",
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        ),
    ))
}

/// An `after` job: no schedule keys of its own; its schedule is a placeholder until the chain
/// is resolved ([`resolve_chains`]), and its timeout zero until then means "the default".
fn follower(j: &RawJob) -> Result<(Schedule, Option<After>), KeyError> {
    let own = [
        ("cron", j.cron.is_some()),
        ("every", j.every.is_some()),
        ("anchor", j.anchor.is_some()),
        ("timezone", j.timezone.is_some()),
        ("dst_gap", j.dst_gap.is_some()),
        ("dst_fold", j.dst_fold.is_some()),
    ];
    if let Some((key, _)) = own.iter().find(|(_, set)| *set) {
        return Err((
            "after",
            format!("an `after` job runs on its upstream's instants: remove `{key}`"),
        ));
    }
    let timeout = match &j.after_timeout {
        Some(_) => job_duration("after_timeout", &j.after_timeout, 0, Zero::Refused)?,
        None => Duration::ZERO,
    };
    let placeholder = Schedule::Every {
        every: chrono::Duration::seconds(1),
        anchor: DateTime::UNIX_EPOCH,
    };
    let upstream = j.after.clone().unwrap_or_default();
    Ok((placeholder, Some(After { upstream, timeout })))
}

/// Gives every `after` job its root's schedule and zone, and its default timeout (the root's
/// `every`, else 1 h); refuses unknown upstreams and cycles (key `after`).
fn resolve_chains(fail: &Failer, jobs: &mut [Job]) -> Result<(), ConfigError> {
    if jobs.iter().all(|j| j.after.is_none()) {
        return Ok(());
    }
    let names: Vec<&str> = jobs.iter().map(|j| j.name.as_str()).collect();
    let ups: Vec<Option<&str>> = jobs
        .iter()
        .map(|j| j.after.as_ref().map(|a| a.upstream.as_str()))
        .collect();
    let roots = after::roots(&names, &ups).map_err(|e| {
        let job = match &e {
            after::ChainError::Unknown { job, .. } | after::ChainError::Cycle { job, .. } => *job,
        };
        fail.at(
            Some(&format!("job {:?}", jobs[job].name)),
            "after",
            e.to_string(),
        )
    })?;
    for (i, root) in roots.into_iter().enumerate() {
        if root == i {
            continue;
        }
        let (schedule, timezone) = (jobs[root].schedule.clone(), jobs[root].timezone);
        let default = match &schedule {
            Schedule::Every { every, .. } => every.to_std().unwrap_or(Duration::from_secs(3600)),
            Schedule::Cron { .. } => Duration::from_secs(3600),
        };
        let job = &mut jobs[i];
        (job.schedule, job.timezone) = (schedule, timezone);
        if let Some(after) = job.after.as_mut().filter(|a| a.timeout.is_zero()) {
            after.timeout = default;
        }
    }
    Ok(())
}

/// The job's schedule, from exactly one of `cron` and `every`.
fn job_schedule(j: &RawJob, timezone: Tz) -> Result<Schedule, KeyError> {
    if j.after_timeout.is_some() {
        return Err(("after_timeout", "only applies to `after` jobs".into()));
    }
    match (&j.cron, &j.every) {
        (Some(_), Some(_)) => Err((
            "cron",
            "give exactly one of `cron` and `every`, not both".into(),
        )),
        (None, None) => Err((
            "cron",
            "give exactly one of `cron` and `every`; neither is set".into(),
        )),
        (Some(cron), None) => cron_schedule(j, cron, timezone),
        (None, Some(every_text)) => every_schedule(j, every_text),
    }
}

fn cron_schedule(j: &RawJob, cron: &str, tz: Tz) -> Result<Schedule, KeyError> {
    if j.anchor.is_some() {
        return Err(("anchor", "only applies to `every` jobs".into()));
    }
    let cron_expr = CronExpr::parse(cron).map_err(|e| ("cron", e.to_string()))?;
    Ok(Schedule::Cron {
        cron: Box::new(cron_expr),
        tz,
        gap: j.dst_gap.unwrap_or_default(),
        fold: j.dst_fold.unwrap_or_default(),
    })
}

fn every_schedule(j: &RawJob, every_text: &str) -> Result<Schedule, KeyError> {
    let every = duration::parse(every_text).map_err(|e| ("every", e))?;
    if every.is_zero() {
        return Err(("every", "must be greater than zero".into()));
    }
    if every < MIN_EVERY {
        return Err((
            "every",
            format!(
                "{every_text:?} is too short: must be at least {}",
                duration::format(MIN_EVERY)
            ),
        ));
    }
    let anchor = match &j.anchor {
        Some(text) => DateTime::parse_from_rfc3339(text)
            .map(|t| t.with_timezone(&Utc))
            .map_err(|e| {
                ("anchor", format!("{text:?} is not an RFC 3339 instant ({e}); write e.g. \"2026-01-01T00:00:00Z\""))
            })?,
        None => DateTime::UNIX_EPOCH,
    };
    Ok(Schedule::Every {
        every: chrono::Duration::from_std(every)
            .map_err(|_| ("every", "is too large".to_owned()))?,
        anchor,
    })
}

/// The job's overlap and misfire policies and its catch-up bound, checked together.
fn job_policy(j: &RawJob) -> Result<(Overlap, Misfire, usize), KeyError> {
    let overlap = j.overlap.unwrap_or_default();
    let misfire = j.misfire.unwrap_or_default();
    if misfire == Misfire::CatchUp && overlap == Overlap::Skip {
        return Err((
            "overlap",
            "misfire = \"catch_up\" with overlap = \"skip\" would drop the caught-up instances; set overlap = \"queue\" or \"allow\"".into(),
        ));
    }
    let max_catch_up = j.max_catch_up.unwrap_or(100);
    if max_catch_up < 1 {
        return Err(("max_catch_up", "must be at least 1".into()));
    }
    Ok((overlap, misfire, max_catch_up as usize))
}

/// The name rule lives with the names it protects; re-exported for the callers that already
/// use it from here.
pub use crate::names::check_name;

/// The first key of `table` whose value, alone, does not deserialise into `T` (a wrong type,
/// an unknown enum value, an unknown key), with serde's error. A lone key otherwise only
/// misses the required fields, which is not its fault.
fn culprit<T: serde::de::DeserializeOwned>(
    table: &toml::Table,
) -> Option<(String, toml::de::Error)> {
    table.iter().find_map(|(key, value)| {
        let mut alone = toml::Table::new();
        alone.insert(key.clone(), value.clone());
        match toml::Value::Table(alone).try_into::<T>() {
            Err(e) if !e.message().starts_with("missing field") => Some((key.clone(), e)),
            _ => None,
        }
    })
}

/// A task's `http` table that does not deserialise: `http.KEY` (or `http` when no key alone is
/// at fault, a missing `url`) with serde's error.
fn http_culprit(task: &toml::Table) -> Option<(String, toml::de::Error)> {
    let Some(toml::Value::Table(http)) = task.get("http") else {
        return None;
    };
    let e = toml::Value::Table(http.clone())
        .try_into::<RawHttp>()
        .err()?;
    let key = culprit::<RawHttp>(http).map_or("http".into(), |(k, _)| format!("http.{k}"));
    Some((key, e))
}

/// Whether a duration key may be zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Zero {
    /// Zero is a valid setting (say, no grace at all).
    Allowed,
    /// Zero is refused: "must be greater than zero".
    Refused,
}

/// Builds errors for one file.
struct Failer<'a> {
    file: &'a Path,
}

impl Failer<'_> {
    /// A `ca_file` must hold at least one PEM certificate now, not at the first TLS connection.
    fn ca_file(&self, place: &str, path: Option<PathBuf>) -> Result<Option<PathBuf>, ConfigError> {
        if let Some(path) = &path {
            crate::tls::read_ca_file(path)
                .map_err(|e| self.at(Some(place), "ca_file", e.to_string()))?;
        }
        Ok(path)
    }

    /// Turns a failed typed parse into an error that names the section, job or task and the
    /// key: parse again as plain tables and try each key's value alone in its typed form; the
    /// first that fails is the one. Only runs when the fast path failed.
    fn pinpoint(&self, text: &str, fast: toml::de::Error) -> ConfigError {
        let raw: toml::Table = match toml::from_str(text) {
            Ok(raw) => raw,
            Err(e) => return self.syntax(text, e),
        };
        type Finder = fn(&toml::Table) -> Option<(String, toml::de::Error)>;
        let sections: [(&str, Finder); 4] = [
            ("broker", culprit::<RawBroker>),
            ("redis", culprit::<RawRedis>),
            ("beat", culprit::<RawBeat>),
            ("worker", culprit::<RawWorker>),
        ];
        for (section, find) in sections {
            if let Some(toml::Value::Table(table)) = raw.get(section) {
                if let Some((key, e)) = find(table) {
                    return self.keyed(Some(&format!("[{section}]")), key, e);
                }
            }
        }
        if let Some(toml::Value::Table(tasks)) = raw.get("tasks") {
            for (name, task) in tasks {
                let place = format!("task {name:?}");
                if let toml::Value::Table(table) = task {
                    if let Some((key, e)) = http_culprit(table) {
                        return self.keyed(Some(&place), key, e);
                    }
                    if let Some((key, e)) = culprit::<RawTask>(table) {
                        return self.keyed(Some(&place), key, e);
                    }
                }
                if let Err(e) = task.clone().try_into::<RawTask>() {
                    return self.toml(Some(&place), e);
                }
            }
        }
        if let Some(toml::Value::Array(jobs)) = raw.get("jobs") {
            for (i, job) in jobs.iter().enumerate() {
                let place = match job.get("name").and_then(|n| n.as_str()) {
                    Some(name) => format!("job {name:?}"),
                    None => format!("jobs[{i}]"),
                };
                if let toml::Value::Table(table) = job {
                    if let Some((key, e)) = culprit::<RawJob>(table) {
                        return self.keyed(Some(&place), key, e);
                    }
                }
                if let Err(e) = job.clone().try_into::<RawJob>() {
                    return self.toml(Some(&place), e);
                }
            }
        }
        if let Some((key, e)) = culprit::<RawConfig<toml::Value, toml::Value>>(&raw) {
            return self.keyed(None, key, e);
        }
        self.toml(None, fast)
    }

    /// A serde error about `key`'s value.
    fn keyed(&self, place: Option<&str>, key: String, e: toml::de::Error) -> ConfigError {
        ConfigError {
            file: self.file.to_owned(),
            place: place.map(str::to_owned),
            key: Some(key),
            message: suggest_key(e.message()),
            at: None,
        }
    }

    fn at(&self, place: Option<&str>, key: &str, message: String) -> ConfigError {
        ConfigError {
            file: self.file.to_owned(),
            place: place.map(str::to_owned),
            key: Some(key.to_owned()),
            message,
            at: None,
        }
    }

    /// A TOML syntax error: `FILE:LINE:COLUMN: message` and the line.
    fn syntax(&self, text: &str, e: toml::de::Error) -> ConfigError {
        let Some(span) = e.span() else {
            return self.toml(None, e);
        };
        ConfigError {
            file: self.file.to_owned(),
            place: None,
            key: None,
            message: e.message().trim_end().to_owned(),
            at: Some(Box::new(Position::of(text, span.start))),
        }
    }

    /// A toml/serde error; pulls the key out of "unknown field `x`" / "missing field `x`".
    fn toml(&self, place: Option<&str>, e: toml::de::Error) -> ConfigError {
        let message = suggest_key(e.message());
        let key = ["unknown field `", "missing field `"]
            .iter()
            .find_map(|prefix| {
                let rest = message.strip_prefix(prefix)?;
                Some(rest[..rest.find('`')?].to_owned())
            });
        let message = match e.span() {
            Some(span) if place.is_none() => format!("{message} (at byte {})", span.start),
            _ => message,
        };
        ConfigError {
            file: self.file.to_owned(),
            place: place.map(str::to_owned),
            key,
            message,
            at: None,
        }
    }

    /// The URL in force (env over file over default), checked by `check`. An error names the
    /// env var or the section's `url` key, never the value (it may hold a password).
    fn url(
        &self,
        env_name: &str,
        from_env: Option<String>,
        section: &str,
        from_file: Option<String>,
        default: &str,
        check: fn(&str) -> Result<(), url::UrlError>,
    ) -> Result<String, ConfigError> {
        let (place, key, text) = match (from_env, from_file) {
            (Some(text), _) => ("environment", env_name, text),
            (None, Some(text)) => (section, "url", text),
            (None, None) => return Ok(default.to_owned()),
        };
        check(&text).map_err(|e| self.at(Some(place), key, e.to_string()))?;
        Ok(text)
    }

    /// `place`'s duration `key`: `raw` parsed, or `default_secs` when it is absent.
    fn duration(
        &self,
        place: &str,
        key: &str,
        raw: &Option<String>,
        default_secs: u64,
        zero: Zero,
    ) -> Result<Duration, ConfigError> {
        let d = match raw {
            None => Duration::from_secs(default_secs),
            Some(text) => duration::parse(text).map_err(|m| self.at(Some(place), key, m))?,
        };
        if zero == Zero::Refused && d.is_zero() {
            return Err(self.at(Some(place), key, "must be greater than zero".into()));
        }
        Ok(d)
    }
}

/// `[redis] url` (or `DRUMLINE_REDIS_URL`, which wins), checked; `ca_file` refused beside a
/// Sentinel URL.
fn check_redis_url(
    fail: &Failer,
    from_env: Option<String>,
    raw: &RawRedis,
) -> Result<String, ConfigError> {
    let url = fail.url(
        ENV_REDIS_URL,
        from_env,
        "[redis]",
        raw.url.clone(),
        "redis://127.0.0.1:6379/0",
        url::check_redis,
    )?;
    if url.starts_with("redis+sentinel:") && raw.ca_file.is_some() {
        let m = "is not supported with redis+sentinel:// (Sentinel connections are plain TCP)";
        return Err(fail.at(Some("[redis]"), "ca_file", m.into()));
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TASKS: &str = "[tasks.t]\ncommand = [\"/bin/true\"]\n";

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("/etc/d.toml"), |_| None)
    }

    fn err(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    /// A config with one job `j` of task `t`, with `lines` as its further keys.
    fn job_text(lines: &str) -> String {
        format!("[[jobs]]\nname = \"j\"\ntask = \"t\"\n{lines}\n{TASKS}")
    }

    /// The error for one job `j` of task `t`, with `lines` as its further keys.
    fn job_err(lines: &str) -> String {
        err(&job_text(lines))
    }

    /// `n` jobs `job-0` … (every 1 m), each with `keys(i)` as its further keys, and the tasks.
    fn many_jobs(n: usize, keys: impl Fn(usize) -> String) -> String {
        let mut text = String::from("namespace = \"many\"\n");
        for i in 0..n {
            text.push_str(&format!(
                "[[jobs]]\nname = \"job-{i}\"\ntask = \"t\"\nevery = \"1m\"\n{}\n",
                keys(i)
            ));
        }
        text + TASKS
    }

    #[test]
    fn jobs_with_the_same_spec_share_it_and_a_job_stays_small() {
        let text = jobs_text(&[
            ("a", "every = \"1m\""),
            ("b", "cron = \"* * * * *\"\ntimezone = \"Europe/Paris\""),
            ("c", "every = \"1m\"\nargs = { n = 1 }"),
            ("d", "every = \"1m\"\nargs = { n = 1 }\njitter = \"5s\""),
            ("e", "every = \"1m\"\nqueue = \"slow\""),
            ("f", "every = \"1m\"\nargs = { x = -0.0 }"),
            ("g", "every = \"1m\"\nargs = { x = 0.0 }"),
        ]);
        let config = parse(&text).unwrap();
        let spec = |name: &str| config.job(name).unwrap().spec.clone();
        // Name, schedule, zone and jitter are each job's own; the rest is shared when equal.
        assert!(Arc::ptr_eq(&spec("a"), &spec("b")));
        assert!(Arc::ptr_eq(&spec("c"), &spec("d")));
        assert!(!Arc::ptr_eq(&spec("a"), &spec("c")));
        assert!(!Arc::ptr_eq(&spec("a"), &spec("e")));
        assert_eq!(spec("c").args.value(), serde_json::json!({ "n": 1 }));
        assert_eq!(&*spec("e").queue, "slow");
        // JSON equality takes 0.0 for -0.0; each job keeps what its file says.
        assert!(!Arc::ptr_eq(&spec("f"), &spec("g")));
        assert_eq!(spec("g").args.as_str(), r#"{"x":0.0}"#);
        // A million jobs: what each holds inline (its name's bytes apart) stays under 100 bytes.
        assert!(
            std::mem::size_of::<Job>() <= 96,
            "{}",
            std::mem::size_of::<Job>()
        );
    }

    #[test]
    fn a_file_of_many_pieces_parses_as_a_whole_in_file_order() {
        // Pieces parsed on several threads are checked in file order.
        let n = JOBS_PER_PIECE * 4 + 7;
        let text = many_jobs(n, |i| format!("args = {{ i = {i} }}"));
        let fail = Failer {
            file: Path::new("/etc/d.toml"),
        };
        let (_, whole) = Config::parse_whole(&text, &fail).unwrap();
        let (_, pieces) = Config::parse_in_pieces(&text, &fail).unwrap().unwrap();
        assert_eq!(pieces.len(), n);
        assert_eq!(format!("{pieces:?}"), format!("{whole:?}"));
        for (i, job) in pieces.iter().enumerate() {
            assert_eq!(job.name, format!("job-{i}"));
            assert_eq!(job.spec.args.value()["i"], i);
        }
    }

    #[test]
    fn a_file_of_many_pieces_gives_the_whole_files_first_error() {
        let n = JOBS_PER_PIECE * 4;
        // A job's error in the third piece (a duplicate of a name in the first).
        let dup = many_jobs(n, |i| {
            if i == JOBS_PER_PIECE * 2 + 5 {
                "name = \"job-3\"".into()
            } else {
                String::new()
            }
        })
        .replace(
            &format!("name = \"job-{}\"\ntask", JOBS_PER_PIECE * 2 + 5),
            "task",
        );
        assert!(err(&dup).contains("duplicate job name"), "{}", err(&dup));
        // The same, and a syntax error in the last piece: the syntax error, as for the whole
        // file (a file that does not parse is reported as such first).
        let both = dup.replace(
            &format!("name = \"job-{}\"", n - 2),
            &format!("name = \"job-{}\"\nevery = ", n - 2),
        );
        let e = err(&both);
        assert!(!e.contains("duplicate job name"), "{e}");
        assert!(
            e.contains(&format!("d.toml:{}:", line_of(&both, "every = \n"))),
            "{e}"
        );
        // A job's error in the last piece only.
        let last = many_jobs(n, |i| {
            if i == n - 1 {
                "cron = \"* * * * *\"".into()
            } else {
                String::new()
            }
        });
        let e = err(&last);
        assert!(e.contains(&format!("job \"job-{}\"", n - 1)), "{e}");
    }

    /// The 1-based line of the first occurrence of `needle` in `text`.
    fn line_of(text: &str, needle: &str) -> usize {
        1 + text[..text.find(needle).unwrap()].matches('\n').count()
    }

    /// Jobs `(name, keys)` of task `t`.
    fn jobs_text(jobs: &[(&str, &str)]) -> String {
        let mut text = String::new();
        for (name, keys) in jobs {
            text.push_str(&format!(
                "[[jobs]]\nname = \"{name}\"\ntask = \"t\"\n{keys}\n"
            ));
        }
        format!("{text}{TASKS}")
    }

    #[test]
    fn after_jobs_take_their_roots_instants_and_default_timeout() {
        let c = parse(&jobs_text(&[
            ("c", "after = \"b\""),
            ("a", "every = \"2s\""),
            ("b", "after = \"a\"\nafter_timeout = \"30s\""),
            ("n", "cron = \"0 3 * * *\"\ntimezone = \"Europe/Paris\""),
            ("m", "after = \"n\""),
        ]))
        .unwrap();
        let (a, b, c_, m) = (
            c.job("a").unwrap(),
            c.job("b").unwrap(),
            c.job("c").unwrap(),
            c.job("m").unwrap(),
        );
        assert_eq!(b.schedule, a.schedule);
        assert_eq!(c_.schedule, a.schedule);
        assert_eq!(c_.after.as_ref().unwrap().upstream, "b");
        assert_eq!(c_.after.as_ref().unwrap().timeout, Duration::from_secs(2));
        assert_eq!(b.after.as_ref().unwrap().timeout, Duration::from_secs(30));
        assert_eq!(m.after.as_ref().unwrap().timeout, Duration::from_secs(3600));
        assert_eq!(m.timezone.name(), "Europe/Paris");
        assert_eq!(c_.schedule_text(), "after b");
        assert!(a.after.is_none());
    }

    #[test]
    fn after_refuses_cycles_unknown_upstreams_and_a_schedule_of_its_own() {
        let e = err(&jobs_text(&[
            ("a", "after = \"b\""),
            ("b", "after = \"a\""),
        ]));
        assert_eq!(e, "/etc/d.toml: job \"a\": key `after`: a cycle: a → b → a");
        let e = err(&jobs_text(&[
            ("a", "every = \"1s\""),
            ("b", "after = \"x\""),
        ]));
        assert!(
            e.starts_with("/etc/d.toml: job \"b\": key `after`: no job named \"x\""),
            "{e}"
        );
        let e = job_err("after = \"j\"");
        assert!(e.contains("key `after`: a cycle: j → j"), "{e}");
        let e = err(&jobs_text(&[
            ("a", "every = \"1s\""),
            ("b", "after = \"a\"\nevery = \"1s\""),
        ]));
        assert!(e.contains("job \"b\": key `after`: an `after` job runs on its upstream's instants: remove `every`"), "{e}");
        job_err_has("after = \"j\"\ncron = \"* * * * *\"", "remove `cron`");
        job_err_has(
            "every = \"1s\"\nafter_timeout = \"1s\"",
            "key `after_timeout`: only applies to `after` jobs",
        );
        let e = err(&jobs_text(&[
            ("a", "every = \"1s\""),
            ("b", "after = \"a\"\nafter_timeout = \"0s\""),
        ]));
        assert!(
            e.contains("key `after_timeout`: must be greater than zero"),
            "{e}"
        );
    }

    #[test]
    fn a_syntax_error_gives_file_line_column_and_the_line() {
        let e = err("namespace = \"n\"\n[beat]\nlock_ttl = = 3\n");
        let mut lines = e.lines();
        let first = lines.next().unwrap();
        assert!(first.starts_with("/etc/d.toml:3:"), "{e}");
        assert!(!first.contains("byte"), "{e}");
        assert_eq!(lines.next(), Some("lock_ttl = = 3"), "{e}");
    }

    #[test]
    fn job_args_must_be_a_table() {
        let e = job_err("every = \"1s\"\nargs = \"ny\"");
        assert!(e.contains("key `args`") && e.contains("table"), "{e}");
        assert!(parse(&job_text("every = \"1s\"\nargs = { city = \"ny\" }")).is_ok());
    }

    /// Asserts that `text` is refused with a message containing `needle`.
    fn err_has(text: &str, needle: &str) {
        let e = err(text);
        assert!(e.contains(needle), "{e}");
    }

    /// Asserts that job `j` with `lines` is refused with a message containing `needle`.
    fn job_err_has(lines: &str, needle: &str) {
        err_has(&job_text(lines), needle);
    }

    #[test]
    fn limits_resolve_into_their_tasks() {
        let c = parse(
            "[limits.api]\nconcurrency = 2\nrate = \"10/s\"\n[limits.slow]\nrate = \"100/m\"\n\
             [tasks.t]\ncommand = [\"/bin/true\"]\nlimit = \"api\"\n\
             [tasks.u]\ncommand = [\"/bin/true\"]\n",
        )
        .unwrap();
        let api = c.tasks["t"].limit.clone().unwrap();
        assert_eq!((api.name.as_str(), api.concurrency), ("api", Some(2)));
        assert_eq!(api.rate, Some(Rate::parse("10/s").unwrap()));
        assert_eq!(c.tasks["u"].limit, None);
        assert_eq!(c.limits["slow"].concurrency, None);
    }

    #[test]
    fn bad_limits_name_the_limit_and_key() {
        let task = "[tasks.t]\ncommand = [\"/bin/true\"]\nlimit = \"api\"\n";
        err_has(task, "task \"t\": key `limit`: no [limits.api]");
        let limit = |body: &str| format!("[limits.api]\n{body}\n{task}");
        err_has(
            &limit("concurrency = 0"),
            "limit \"api\": key `concurrency`: must be at least 1",
        );
        err_has(
            &limit("concurrency = -3"),
            "key `concurrency`: must be at least 1, not -3",
        );
        err_has(
            &limit("rate = \"0/s\""),
            "limit \"api\": key `rate`: \"0/s\" allows no start",
        );
        err_has(
            &limit("rate = \"ten/s\""),
            "key `rate`: \"ten/s\" is not N/PERIOD",
        );
        err_has(
            &limit("rate = \"5/d\""),
            "key `rate`: \"5/d\": the period must be s, m or h",
        );
        err_has(&limit(""), "sets neither `concurrency` nor `rate`");
        err_has(&limit("burst = 3"), "burst");
    }

    #[test]
    fn http_tasks_default_and_check_their_keys() {
        let c = parse("[tasks.h]\nhttp = { url = \"https://api.example/hook\" }\n").unwrap();
        let http = c.tasks["h"].http.clone().unwrap();
        assert_eq!(http.url, "https://api.example/hook");
        assert_eq!(http.method, "POST");
        assert_eq!(http.timeout, Duration::from_secs(30));
        assert_eq!((http.secret_env, http.ca_file), (None, None));
        assert!(http.headers.is_empty());
        let full = parse(
            "[tasks.h]\nhttp = { url = \"http://127.0.0.1:9/x\", method = \"PUT\", timeout = \"2s\", secret_env = \"HOOK_SECRET\", headers = { Authorization = \"Bearer t\" } }\n",
        )
        .unwrap();
        let http = full.tasks["h"].http.clone().unwrap();
        assert_eq!(http.method, "PUT");
        assert_eq!(http.timeout, Duration::from_secs(2));
        assert_eq!(http.secret_env.as_deref(), Some("HOOK_SECRET"));
        assert_eq!(http.headers["Authorization"], "Bearer t");
    }

    #[test]
    fn bad_http_settings_name_the_file_task_and_key() {
        let bad = |http: &str, needle: &str| {
            let e = err(&format!("[tasks.h]\nhttp = {{ {http} }}\n"));
            assert!(e.starts_with("/etc/d.toml: task \"h\": key `"), "{e}");
            assert!(e.contains(needle), "{e}");
        };
        bad("url = \"ftp://x/y\"", "key `http.url`: scheme \"ftp\"");
        bad("url = \"not a url\"", "key `http.url`: not a URL");
        bad(
            "url = \"https://u:pw@x/\"",
            "key `http.url`: must not hold a user",
        );
        bad(
            "url = \"http://x/\", urls = 1",
            "key `http.urls`: unknown field `urls`",
        );
        bad(
            "url = \"http://x/\", method = \"post\"",
            "key `http.method`",
        );
        bad(
            "url = \"http://x/\", timeout = \"0s\"",
            "key `http.timeout`",
        );
        bad(
            "url = \"http://x/\", headers = { \"Webhook-Id\" = \"x\" }",
            "key `http.headers`: \"Webhook-Id\" is set by drumline",
        );
        bad(
            "url = \"http://x/\", headers = { \"a b\" = \"x\" }",
            "is not a header name",
        );
        bad(
            "url = \"http://x/\", secret_env = \"A=B\"",
            "key `http.secret_env`",
        );
        bad(
            "url = \"http://x/\", ca_file = \"/nonexistent.pem\"",
            "key `http.ca_file`",
        );
        bad("method = \"POST\"", "key `http");
        // The password is never echoed.
        let e = err("[tasks.h]\nhttp = { url = \"https://u:hunter2@x/\" }\n");
        assert!(!e.contains("hunter2"), "{e}");
        err_has(
            "[tasks.h]\ncommand = [\"/bin/true\"]\nhttp = { url = \"http://x/\" }\n",
            "key `http`: a task has a `command` or an `http` endpoint, not both",
        );
    }

    /// Every variable drumline reads itself is hidden from tasks, listed or not.
    #[test]
    fn the_variables_drumline_reads_are_hidden_from_tasks() {
        let c = parse(
            "[worker]\nenv_remove = [\"AWS_SECRET_ACCESS_KEY\"]\n\
             [tasks.h]\nhttp = { url = \"http://x/\", secret_env = \"HOOK_SECRET\" }\n",
        )
        .unwrap();
        assert_eq!(
            c.hidden_from_tasks(),
            [
                "AWS_SECRET_ACCESS_KEY",
                ENV_AMQP_URL,
                DEFAULT_API_TOKEN_ENV,
                ENV_REDIS_URL,
                "HOOK_SECRET"
            ]
        );
        let c = parse("[api]\ntoken_env = \"OPS_TOKEN\"\n").unwrap();
        assert!(c.hidden_from_tasks().contains(&"OPS_TOKEN".to_owned()));
    }

    #[test]
    fn calendars_are_parsed_and_jobs_name_them() {
        let c = parse(
            "[calendars.holidays]\ndates = [\"2026-12-25\", \"*-01-01\"]\n\
             [tasks.t]\ncommand = [\"true\"]\n\
             [[jobs]]\nname = \"j\"\ntask = \"t\"\nevery = \"1h\"\nexclude = [\"holidays\", \"later\"]\n",
        )
        .unwrap();
        assert_eq!(c.calendars["holidays"].dates(), ["2026-12-25", "*-01-01"]);
        let exclude: Vec<&str> = c.jobs[0].spec.exclude.iter().map(|n| &**n).collect();
        assert_eq!(exclude, ["holidays", "later"]);
        let e = err("[calendars.h]\ndates = [\"2026-02-30\"]\n");
        assert!(e.contains("calendar \"h\"") && e.contains("`dates`"), "{e}");
        assert!(job_err("every = \"1h\"\nexclude = [\"a b\"]").contains("`exclude`"));
    }

    #[test]
    fn the_api_section_is_checked() {
        let c = parse("[api]\naddr = \"127.0.0.1:8080\"\n").unwrap();
        assert_eq!(c.api.addr, Some("127.0.0.1:8080".parse().unwrap()));
        assert_eq!(c.api.token_env, DEFAULT_API_TOKEN_ENV);
        assert_eq!(parse("").unwrap().api.addr, None);
        let e = err("[api]\naddr = \"localhost\"\n");
        assert!(e.contains("[api]") && e.contains("`addr`"), "{e}");
        assert!(err("[api]\ntoken_env = \"\"\n").contains("`token_env`"));
        assert!(err("[api]\nport = 1\n").contains("port"));
    }

    #[test]
    fn the_telemetry_section_is_checked() {
        assert_eq!(parse("").unwrap().telemetry.otlp_endpoint, None);
        let c = parse("[telemetry]\notlp_endpoint = \"http://otel:4318\"\n").unwrap();
        assert_eq!(
            c.telemetry.otlp_endpoint.as_deref(),
            Some("http://otel:4318")
        );
        for bad in ["otel:4318", "ftp://otel", "http://"] {
            let e = err(&format!("[telemetry]\notlp_endpoint = \"{bad}\"\n"));
            assert!(
                e.contains("[telemetry]") && e.contains("`otlp_endpoint`"),
                "{e}"
            );
        }
        let e = err("[telemetry]\notlp_endpiont = \"http://otel:4318\"\n");
        assert!(
            e.contains("`otlp_endpiont`") && e.contains("`otlp_endpoint`"),
            "{e}"
        );
    }

    #[test]
    fn task_environment_settings() {
        let c = parse(
            "[worker]\nenv_remove = [\"AWS_SECRET_ACCESS_KEY\"]\n[tasks.t]\ncommand = [\"/bin/true\"]\nenv = { LANG = \"C\", MODE = \"batch\" }\n",
        )
        .unwrap();
        assert_eq!(c.worker.env_remove, vec!["AWS_SECRET_ACCESS_KEY"]);
        let env = &c.tasks["t"].env;
        assert_eq!(env.get("LANG").map(String::as_str), Some("C"));
        assert_eq!(env.get("MODE").map(String::as_str), Some("batch"));
        let d = parse(TASKS).unwrap();
        assert!(d.worker.env_remove.is_empty() && d.tasks["t"].env.is_empty());
        err_has(
            "[worker]\nenv_remove = [\"A=B\"]\n",
            "[worker]: key `env_remove`",
        );
        err_has(
            "[tasks.t]\ncommand = [\"/bin/true\"]\nenv = { \"\" = \"x\" }\n",
            "key `env`",
        );
    }

    #[test]
    fn defaults_match_the_design() {
        let c = parse(&format!(
            "[[jobs]]\nname = \"j\"\ntask = \"t\"\nevery = \"30s\"\n{TASKS}"
        ))
        .unwrap();
        assert_eq!(c.namespace, "drumline");
        assert_eq!(c.broker_url, "amqp://guest:guest@127.0.0.1:5672/%2f");
        assert_eq!(c.redis_url, "redis://127.0.0.1:6379/0");
        assert_eq!(c.beat.leader_lease, Duration::from_secs(10));
        assert_eq!(c.beat.misfire_threshold, Duration::from_secs(5));
        assert_eq!(c.worker.concurrency, 4);
        assert_eq!(c.worker.queues, vec!["default"]);
        assert_eq!(c.worker.lease, Duration::from_secs(30));
        assert_eq!(c.worker.done_ttl, Duration::from_secs(7 * 86400));
        assert_eq!(c.worker.max_message_bytes, 1 << 20);
        let j = &c.jobs[0];
        assert_eq!(
            (j.spec.overlap, j.spec.misfire, j.spec.max_catch_up),
            (Overlap::Skip, Misfire::RunOnce, 100)
        );
        assert_eq!(j.spec.misfire_grace, Duration::from_secs(3600));
        assert_eq!(&*j.spec.queue, "default");
        assert_eq!(j.schedule_text(), "every 30s");
        let t = &c.tasks["t"];
        assert_eq!(
            (t.max_retries, t.retry_base, t.retry_max),
            (5, Duration::from_secs(1), Duration::from_secs(600))
        );
    }

    #[test]
    fn env_overrides_the_file() {
        let c = Config::parse(
            "[broker]\nurl = \"amqp://file\"\n[redis]\nurl = \"redis://file\"\n",
            Path::new("d.toml"),
            |name| (name == ENV_REDIS_URL).then(|| "redis://env".to_owned()),
        )
        .unwrap();
        assert_eq!(c.broker_url, "amqp://file");
        assert_eq!(c.redis_url, "redis://env");
    }

    #[test]
    fn unknown_key_names_file_job_and_key() {
        let e = job_err("every = \"1s\"\nfrequency = 3");
        assert!(
            e.starts_with("/etc/d.toml: job \"j\": key `frequency`: unknown field"),
            "{e}"
        );
        err_has("[worker]\nconcurency = 3\n", "key `concurency`");
    }

    #[test]
    fn an_unknown_key_close_to_a_known_one_is_suggested() {
        let e = job_err("evry = \"1s\"");
        assert!(
            e.contains("key `evry`: unknown field `evry`: did you mean `every`?"),
            "{e}"
        );
        err_has("[worker]\nconcurrncy = 3\n", "did you mean `concurrency`?");
        err_has(
            "[tasks.t]\ncomand = [\"true\"]\n",
            "did you mean `command`?",
        );
        let far = job_err("every = \"1s\"\nfrequency = 3");
        assert!(!far.contains("did you mean"), "{far}");
    }

    #[test]
    fn cron_and_every_exactly_one() {
        job_err_has(
            "every = \"1s\"\ncron = \"* * * * *\"",
            "job \"j\": key `cron`: give exactly one of `cron` and `every`, not both",
        );
        job_err_has(
            "",
            "job \"j\": key `cron`: give exactly one of `cron` and `every`; neither is set",
        );
    }

    #[test]
    fn jitter_is_checked_and_hashed_from_namespace_and_name() {
        job_err_has(
            "every = \"1m\"\njitter = \"1m\"",
            "job \"j\": key `jitter`: \"1m\" must be less than the period (every = \"1m\")",
        );
        job_err_has(
            "every = \"30s\"\njitter = \"2m\"",
            "key `jitter`: \"2m\" must be less than the period (every = \"30s\")",
        );
        job_err_has(
            "every = \"1m\"\njitter = \"0s\"",
            "key `jitter`: must be greater than zero",
        );
        job_err_has(
            "every = \"1m\"\njitter = \"soon\"",
            "key `jitter`: \"soon\" is not a duration",
        );
        let one = |ns: &str, keys: &str| {
            let c = parse(&format!("namespace = \"{ns}\"\n{}", job_text(keys))).unwrap();
            c.jobs[0].clone()
        };
        let j = one("billing", "every = \"1m\"\njitter = \"59s\"");
        let jitter = j.jitter.clone().unwrap();
        assert_eq!(jitter.max, Duration::from_secs(59));
        assert_eq!(
            jitter.offset,
            crate::jitter::offset("billing", "j", jitter.max)
        );
        assert_eq!(j.jitter_offset().to_std().unwrap(), jitter.offset);
        // A cron job takes any jitter; no jitter is a zero offset.
        let cron = one("billing", "cron = \"0 * * * *\"\njitter = \"2h\"");
        assert!(cron.jitter.unwrap().offset < Duration::from_secs(7200));
        assert_eq!(
            one("billing", "every = \"1m\"").jitter_offset(),
            chrono::TimeDelta::zero()
        );
    }

    #[test]
    fn bad_duration_and_zero_every() {
        job_err_has(
            "every = \"soon\"",
            "job \"j\": key `every`: \"soon\" is not a duration",
        );
        job_err_has("every = \"0s\"", "key `every`: must be greater than zero");
        job_err_has(
            "every = \"500us\"",
            "key `every`: \"500us\" is too short: must be at least 100ms",
        );
        job_err_has("every = \"99ms\"", "key `every`: \"99ms\" is too short");
        assert!(parse(&format!(
            "[[jobs]]\nname = \"j\"\ntask = \"t\"\nevery = \"100ms\"\n{TASKS}"
        ))
        .is_ok());
        err_has("[worker]\nlease = \"forever\"\n", "[worker]: key `lease`");
        err_has(
            "[beat]\nleader_lease = \"500ms\"\n",
            "[beat]: key `leader_lease`: must be at least 1s",
        );
    }

    #[test]
    fn missing_task_and_duplicate_names() {
        err_has(
            &format!("[[jobs]]\nname = \"j\"\ntask = \"nope\"\nevery = \"1s\"\n{TASKS}"),
            "job \"j\": key `task`: no task named \"nope\"",
        );
        job_err_has(
            "every = \"1s\"\n[[jobs]]\nname = \"j\"\ntask = \"t\"\nevery = \"2s\"",
            "job \"j\": key `name`: duplicate job name",
        );
    }

    #[test]
    fn bad_anchor_and_catch_up_with_skip() {
        job_err_has(
            "every = \"1m\"\nanchor = \"yesterday\"",
            "key `anchor`: \"yesterday\" is not an RFC 3339 instant",
        );
        job_err_has("every = \"1m\"\nmisfire = \"catch_up\"", "key `overlap`");
        let e = job_err("every = \"1m\"\nmisfire = \"sometimes\"");
        assert!(
            e.contains("job \"j\"") && e.contains("unknown variant `sometimes`"),
            "{e}"
        );
    }

    #[test]
    fn bad_timezone_and_cron_are_named() {
        job_err_has(
            "cron = \"0 3 * * *\"\ntimezone = \"Mars/Olympus\"",
            "job \"j\": key `timezone`: unknown time zone",
        );
        job_err_has("cron = \"0 99 * * *\"", "job \"j\": key `cron`");
    }

    #[test]
    fn bad_names_are_refused() {
        err_has("namespace = \"a b\"\n", "key `namespace`");
        err_has(
            &format!("[[jobs]]\nname = \"a@b\"\ntask = \"t\"\nevery = \"1s\"\n{TASKS}"),
            "key `name`",
        );
    }

    #[test]
    fn wrong_typed_and_unknown_values_name_their_key() {
        for (extra, place, key) in [
            ("overlap = \"sometimes\"", "job \"j\"", "overlap"),
            ("misfire = 3", "job \"j\"", "misfire"),
            ("max_catch_up = \"lots\"", "job \"j\"", "max_catch_up"),
            ("dst_gap = \"maybe\"", "job \"j\"", "dst_gap"),
            ("dst_fold = \"twice\"", "job \"j\"", "dst_fold"),
        ] {
            let e = parse(&format!(
                "[[jobs]]\nname = \"j\"\ntask = \"t\"\ncron = \"0 3 * * *\"\n{extra}\n{TASKS}"
            ))
            .unwrap_err();
            assert_eq!(
                (e.place.as_deref(), e.key.as_deref()),
                (Some(place), Some(key)),
                "{e}"
            );
        }
        let e = parse("[tasks.t]\nmax_retries = \"x\"\n").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("max_retries"), "{e}");
        let e = parse("[worker]\nconcurrency = \"lots\"\n").unwrap_err();
        assert_eq!(
            (e.place.as_deref(), e.key.as_deref()),
            (Some("[worker]"), Some("concurrency")),
            "{e}"
        );
        let e = parse("namespace = 7\n").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("namespace"), "{e}");
        // A job missing a required key still names it.
        let e = parse(&format!("[[jobs]]\nname = \"j\"\nevery = \"1s\"\n{TASKS}")).unwrap_err();
        assert_eq!(e.key.as_deref(), Some("task"), "{e}");
    }

    #[test]
    fn redis_wait_replicas_is_checked() {
        let c = parse("").unwrap();
        assert_eq!(
            c.redis_wait,
            WaitReplicas {
                replicas: 0,
                timeout: Duration::from_secs(1)
            }
        );
        let c = parse("[redis]\nwait_replicas = 2\nwait_timeout = \"250ms\"\n").unwrap();
        assert_eq!(
            (c.redis_wait.replicas, c.redis_wait.timeout),
            (2, Duration::from_millis(250))
        );
        for (text, key) in [
            (
                "[redis]\nurl = \"redis+sentinel://s:26379/m/0\"\nca_file = \"/etc/ca.pem\"\n",
                "ca_file",
            ),
            ("[redis]\nwait_replicas = -1\n", "wait_replicas"),
            ("[redis]\nwait_replicas = 101\n", "wait_replicas"),
            ("[redis]\nwait_replicas = \"1\"\n", "wait_replicas"),
            ("[redis]\nwait_timeout = \"0s\"\n", "wait_timeout"),
            ("[redis]\nwait_timeout = \"soon\"\n", "wait_timeout"),
        ] {
            let e = parse(text).unwrap_err();
            assert_eq!(
                (e.place.as_deref(), e.key.as_deref()),
                (Some("[redis]"), Some(key)),
                "{text}: {e}"
            );
        }
    }

    #[test]
    fn the_journal_is_on_for_a_week_by_default_and_checked() {
        assert_eq!(parse("").unwrap().journal, JournalConfig::default());
        assert!(JournalConfig::default().enabled);
        let c = parse("[journal]\nenabled = false\nkeep = \"1h\"\nmax_len = 500\n").unwrap();
        assert_eq!(
            (c.journal.enabled, c.journal.keep, c.journal.max_len),
            (false, Duration::from_secs(3600), 500)
        );
        for (text, key) in [
            ("[journal]\nkeep = \"0s\"\n", "keep"),
            ("[journal]\nmax_len = 0\n", "max_len"),
        ] {
            let e = parse(text).unwrap_err();
            assert_eq!(
                (e.place.as_deref(), e.key.as_deref()),
                (Some("[journal]"), Some(key)),
                "{text}: {e}"
            );
        }
        assert!(
            parse("[journal]\nsize = 1\n").is_err(),
            "unknown keys are refused"
        );
    }

    #[test]
    fn urls_are_checked_at_load_without_echoing_them() {
        let e = parse("[broker]\nurl = \"amqp:u:s3cret@h\"\n").unwrap_err();
        assert_eq!(
            (e.place.as_deref(), e.key.as_deref()),
            (Some("[broker]"), Some("url"))
        );
        assert!(!e.to_string().contains("s3cret"), "{e}");
        let e = Config::parse("", Path::new("d.toml"), |name| {
            (name == ENV_REDIS_URL).then(|| "http://:s3cret@h/".to_owned())
        })
        .unwrap_err();
        assert_eq!(e.key.as_deref(), Some(ENV_REDIS_URL));
        assert!(!e.to_string().contains("s3cret"), "{e}");
    }

    #[test]
    fn broker_nodes_env_beats_urls_beats_url() {
        let file = "[broker]\nurl = \"amqp://one\"\nurls = [\"amqp://a\", \"amqp://b:5673\"]\n";
        let c = parse(file).unwrap();
        assert_eq!(c.broker.urls, ["amqp://a", "amqp://b:5673"]);
        assert_eq!(c.broker_url, "amqp://a");
        let c = parse("[broker]\nurl = \"amqp://one\"\n").unwrap();
        assert_eq!(c.broker.urls, ["amqp://one"]);
        let c = parse("").unwrap();
        assert_eq!(c.broker.urls.len(), 1);
        assert_eq!(c.broker.urls[0], c.broker_url);
        let c = Config::parse(file, Path::new("d.toml"), |name| {
            (name == ENV_AMQP_URL).then(|| "amqp://env".to_owned())
        })
        .unwrap();
        assert_eq!(
            (c.broker.urls, c.broker_url),
            (vec!["amqp://env".to_owned()], "amqp://env".to_owned())
        );
    }

    #[test]
    fn broker_urls_are_each_checked_without_echoing_them() {
        let e = parse("[broker]\nurls = [\"amqp://a\", \"amqp:u:s3cret@h\"]\n").unwrap_err();
        assert_eq!(
            (e.place.as_deref(), e.key.as_deref()),
            (Some("[broker]"), Some("urls"))
        );
        assert!(e.message.starts_with("entry 2:"), "{e}");
        assert!(!e.to_string().contains("s3cret"), "{e}");
        err_has("[broker]\nurls = []\n", "at least one URL");
    }

    #[test]
    fn queue_type_defaults_to_classic() {
        assert_eq!(parse("").unwrap().broker.queue_type, QueueType::Classic);
        let c = parse("[broker]\nqueue_type = \"quorum\"\n").unwrap();
        assert_eq!(c.broker.queue_type, QueueType::Quorum);
        let e = parse("[broker]\nqueue_type = \"mirrored\"\n").unwrap_err();
        assert_eq!(
            (e.place.as_deref(), e.key.as_deref()),
            (Some("[broker]"), Some("queue_type"))
        );
    }

    #[test]
    fn resolves_path_flag_first() {
        assert_eq!(resolve_path(Some("x.toml".into())), PathBuf::from("x.toml"));
    }
}
