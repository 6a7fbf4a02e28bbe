//! The soak's world: a private RabbitMQ node, a private Redis (AOF, fsync always, so that a
//! clean restart loses nothing), one TCP proxy per process in front of Redis (to partition one
//! process at a time), two beats and three workers (the real binaries), and their configs.

use crate::proxy::{Fault, Proxy};
use crate::{free_port, toml_string, wait_until, PrivateRabbit, Proc, TestEnv};
use std::fs::{self, File};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// `max_retries` of the failing task: each failing key runs attempts `0..=FAIL_RETRIES`.
pub const FAIL_RETRIES: u32 = 2;
/// The period of the catch-up job, in seconds.
pub const CATCHUP_EVERY: i64 = 3;

/// A private `redis-server` on a free port with its own data directory.
pub struct SoakRedis {
    /// Its port.
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl SoakRedis {
    /// Starts it and waits until it answers.
    pub fn start(dir: PathBuf) -> Self {
        fs::create_dir_all(&dir).expect("mkdir redis dir");
        let mut redis = Self {
            port: free_port(),
            dir,
            child: None,
        };
        redis.boot();
        redis
    }

    fn boot(&mut self) {
        let log = File::create(self.dir.join("redis.out")).expect("redis log");
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup"))
            .stderr(log)
            .spawn()
            .expect("redis-server must be installed (scripts/services installs it)");
        self.child = Some(child);
        let port = self.port;
        let up = wait_until(Duration::from_secs(20), || self.ping().is_some());
        assert!(up, "private redis-server on {port} did not start");
    }

    /// A plain connection, if it answers.
    pub fn connection(&self) -> Option<redis::Connection> {
        redis::Client::open(self.url())
            .ok()?
            .get_connection_with_timeout(Duration::from_secs(2))
            .ok()
    }

    fn ping(&self) -> Option<String> {
        redis::cmd("PING").query(&mut self.connection()?).ok()
    }

    /// Its URL (no proxy).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// A clean restart: `SHUTDOWN` (the AOF is complete), then the same port and directory.
    pub fn restart(&mut self) {
        if let Some(mut conn) = self.connection() {
            let _: redis::RedisResult<()> = redis::cmd("SHUTDOWN").query(&mut conn);
        }
        if let Some(mut child) = self.child.take() {
            let exited = wait_until(Duration::from_secs(20), || {
                child.try_wait().ok().flatten().is_some()
            });
            if !exited {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        self.boot();
    }
}

impl Drop for SoakRedis {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Beat or worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `drumline-beat`.
    Beat,
    /// `drumline-worker`.
    Worker,
}

/// One beat or worker slot: its process (restarted after a kill) and its own Redis proxy.
pub struct Member {
    /// `beat-1`, `worker-3`, …
    pub name: String,
    /// Beat or worker.
    pub role: Role,
    /// The running process (`None` while killed).
    pub proc: Option<Proc>,
    /// How many times it was started (names its log files).
    pub starts: u32,
    /// Its path to Redis.
    pub proxy: Proxy,
}

impl Member {
    /// Starts (or restarts) the process with `config`.
    pub fn start(&mut self, env: &TestEnv, config: &str) {
        self.starts += 1;
        let label = format!("{}.{}", self.name, self.starts);
        let url = self.proxy.redis_url();
        let vars = [("DRUMLINE_REDIS_URL", url.as_str())];
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

    /// Cuts it off from Redis (its connections and new ones hang), or heals it.
    pub fn partition(&self, cut: bool) {
        self.proxy
            .set(if cut { Fault::Blackhole } else { Fault::Pass });
    }
}

/// The servers and the five members.
pub struct World {
    /// The namespace, scratch directory and binaries.
    pub env: TestEnv,
    /// The private broker.
    pub rabbit: PrivateRabbit,
    /// The private Redis.
    pub redis: SoakRedis,
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
            let redis = SoakRedis::start(env.path("redis"));
            (rabbit.join().expect("rabbit boot"), redis)
        });
        let config = write_config(&env, &rabbit.url());
        let target = ([127, 0, 0, 1], redis.port).into();
        let member = |name: String, role| Member {
            name,
            role,
            proc: None,
            starts: 0,
            proxy: Proxy::start(target),
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

    /// Environment for a one-shot command (`publish`, `verify`): Redis without a proxy.
    pub fn command(&self, bin: &str) -> Command {
        let mut cmd = Command::new(crate::binary(bin));
        cmd.env_remove("DRUMLINE_CONFIG")
            .env_remove("DRUMLINE_AMQP_URL")
            .env("DRUMLINE_REDIS_URL", self.redis.url())
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
