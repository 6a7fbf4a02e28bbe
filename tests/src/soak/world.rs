//! The soak's world: a private RabbitMQ node, a private Redis Sentinel deployment (a primary,
//! two replicas, three Sentinels; every node behind a proxy that can cut one process off, see
//! [`SentinelSet::announced`]), two beats and three workers (the real binaries) on the
//! Sentinels' URL with `wait_replicas = 2` (every replica), and their config.

use crate::proxy::Fault;
use crate::sentinel::SentinelSet;
use crate::{toml_string, PrivateRabbit, Proc, TestEnv};
use std::process::{Command, Stdio};

/// `max_retries` of the failing task: each failing key runs attempts `0..=FAIL_RETRIES`.
pub const FAIL_RETRIES: u32 = 2;
/// The period of the catch-up job, in seconds.
pub const CATCHUP_EVERY: i64 = 3;

/// Beat or worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `drumline-beat`.
    Beat,
    /// `drumline-worker`.
    Worker,
}

/// One beat or worker slot: its process (restarted after a kill).
pub struct Member {
    /// `beat-1`, `worker-3`, …
    pub name: String,
    /// Beat or worker.
    pub role: Role,
    /// The running process (`None` while killed).
    pub proc: Option<Proc>,
    /// How many times it was started (names its log files).
    pub starts: u32,
}

impl Member {
    /// Starts (or restarts) the process with `config`, on Redis at `url`.
    pub fn start(&mut self, env: &TestEnv, config: &str, url: &str) {
        self.starts += 1;
        let label = format!("{}.{}", self.name, self.starts);
        let vars = [("DRUMLINE_REDIS_URL", url)];
        let args = ["--config", config];
        self.proc = Some(match self.role {
            Role::Beat => env.beat_with_env(&label, &args, &vars),
            Role::Worker => env.worker_with_env(&label, &args, &vars),
        });
    }

    /// Its pid while running.
    pub fn pid(&self) -> Option<i32> {
        self.proc.as_ref().map(Proc::pid)
    }
}

/// The servers and the five members.
pub struct World {
    /// The namespace, scratch directory and binaries.
    pub env: TestEnv,
    /// The private broker.
    pub rabbit: PrivateRabbit,
    /// The private Redis Sentinel deployment.
    pub redis: SentinelSet,
    /// Two beats, then three workers.
    pub members: Vec<Member>,
    /// The config every member reads.
    pub config: String,
}

impl World {
    /// Starts the servers and writes the config; the members are not started yet.
    pub fn new() -> Self {
        let env = crate::setup("soak");
        let (rabbit, redis) = std::thread::scope(|s| {
            let rabbit = s.spawn(|| PrivateRabbit::start("soak"));
            let redis = SentinelSet::announced();
            (rabbit.join().expect("rabbit boot"), redis)
        });
        let config = write_config(&env, &rabbit.url());
        let member = |name: String, role| Member {
            name,
            role,
            proc: None,
            starts: 0,
        };
        let mut members: Vec<Member> = (1..=2)
            .map(|i| member(format!("beat-{i}"), Role::Beat))
            .collect();
        members.extend((1..=3).map(|i| member(format!("worker-{i}"), Role::Worker)));
        Self {
            env,
            rabbit,
            redis,
            members,
            config,
        }
    }

    /// The Sentinels' URL every process uses.
    pub fn redis_url(&self) -> String {
        self.redis.url(0)
    }

    /// Starts (or restarts) member `i`.
    pub fn start(&mut self, i: usize) {
        let (config, url) = (self.config.clone(), self.redis_url());
        self.members[i].start(&self.env, &config, &url);
    }

    /// Cuts member `i`'s process `pid` off from Redis (its connections and new ones hang, on
    /// whichever node is primary), or heals it.
    pub fn partition(&self, pid: i32, cut: bool) {
        let fault = if cut { Fault::Blackhole } else { Fault::Pass };
        self.redis.set_for_process(pid, fault);
    }

    /// Environment for a one-shot command (`publish`, `verify`).
    pub fn command(&self, bin: &str) -> Command {
        let mut cmd = Command::new(crate::binary(bin));
        cmd.env_remove("DRUMLINE_CONFIG")
            .env_remove("DRUMLINE_AMQP_URL")
            .env("DRUMLINE_REDIS_URL", self.redis_url())
            .args(["--config", &self.config])
            .stdin(Stdio::null());
        cmd
    }
}

impl Default for World {
    fn default() -> Self {
        Self::new()
    }
}

/// A shell task that appends `KEY ATTEMPT FENCE` to `file` after `sleep` s, then exits `code`.
fn effect_task(env: &TestEnv, file: &str, sleep: &str, code: u8) -> String {
    let path = env.path(file);
    let script = format!(
        "sleep {sleep}; echo \"$DRUMLINE_KEY $DRUMLINE_ATTEMPT $DRUMLINE_FENCING_TOKEN\" >> {}; exit {code}",
        path.display()
    );
    format!("[\"/bin/sh\", \"-c\", {}]", toml_string(&script))
}

fn write_config(env: &TestEnv, amqp: &str) -> String {
    let body = format!(
        r#"
[broker]
url = {amqp}

[redis]
wait_replicas = 2

[beat]
leader_lease = "3s"

[worker]
concurrency = 4
lease = "4s"
shutdown_grace = "5s"

[[jobs]]
name = "tick"
task = "ok"
every = "1s"
misfire = "catch_up"
overlap = "allow"

[[jobs]]
name = "catchup"
task = "slow"
every = "{CATCHUP_EVERY}s"
misfire = "catch_up"
overlap = "queue"

[tasks.ok]
command = {ok}

[tasks.slow]
command = {slow}

[tasks.fail]
command = {fail}
max_retries = {FAIL_RETRIES}
retry_base = "200ms"
retry_max = "1s"
"#,
        amqp = toml_string(amqp),
        ok = effect_task(env, "effects", "0.1", 0),
        slow = effect_task(env, "effects", "0.5", 0),
        fail = effect_task(env, "failures", "0.1", 1),
    );
    let path = env.config("drumline.toml", &body);
    path.to_str().expect("utf-8 path").to_owned()
}
