//! Faults that must not break the promise: Redis going away makes workers fail closed (nothing
//! runs without its claim) and resume by themselves when it is back. Uses a private
//! `redis-server` on a free port, never the shared one.

use chrono::Utc;
use drumline_e2e::{setup, toml_string, wait_until, wait_until_async, TestEnv};
use drumline_shared::envelope::Envelope;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);

struct PrivateRedis {
    port: u16,
    child: Child,
}

impl PrivateRedis {
    fn start(port: u16) -> Self {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (scripts/services installs it)");
        let up = wait_until(Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        assert!(up, "private redis-server on {port} did not start");
        Self { port, child }
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn adhoc(key: &str) -> Envelope {
    let now = Utc::now();
    Envelope {
        v: 1,
        id: uuid::Uuid::new_v4(),
        key: key.to_owned(),
        task: "append".to_owned(),
        job: None,
        args: serde_json::json!({}),
        scheduled_for: now,
        published_at: now,
        expires_at: None,
        attempt: 0,
        queue: "default".to_owned(),
    }
}

async fn publish(env: &TestEnv, e: &Envelope) {
    env.publish_raw("default", &e.encode(), e.properties(Utc::now(), None))
        .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_outage_fails_closed_and_resumes() {
    let env = setup("e2e_redis_down");
    let port = free_port();
    let mut redis = PrivateRedis::start(port);
    let cfg = env.config(
        "drumline.toml",
        &format!(
            "[redis]\nurl = {}\n[worker]\nlease = \"3s\"\n[tasks.append]\ncommand = {}\n",
            toml_string(&format!("redis://127.0.0.1:{}/0", redis.port)),
            env.append_key_command("effects", 0.0)
        ),
    );
    let mut worker = env.worker("worker", &["--config", cfg.to_str().unwrap()]);
    assert!(
        wait_until_async(WAIT, || async {
            env.queue_len(&format!("{}.q.default", env.ns))
                .await
                .is_some()
        })
        .await,
        "{}",
        worker.log_tail(20)
    );
    publish(&env, &adhoc("k-before")).await;
    assert!(
        wait_until(WAIT, || env.lines("effects").len() == 1),
        "{}",
        worker.log_tail(20)
    );

    redis.stop();
    publish(&env, &adhoc("k-during")).await;
    // While Redis is gone nothing may run: watch for a while (no claim, no run).
    let watch_until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < watch_until {
        assert_eq!(
            env.lines("effects"),
            vec!["k-before"],
            "ran without its claim"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        worker.is_running(),
        "the worker waits for Redis, it does not die"
    );

    let _redis = PrivateRedis::start(port);
    assert!(
        wait_until(WAIT, || env.lines("effects").len() == 2),
        "did not resume\n{}",
        worker.log_tail(30)
    );
    assert!(worker.terminate(Duration::from_secs(20)).success());
    assert_eq!(env.lines("effects"), vec!["k-before", "k-during"]);
    assert_eq!(
        env.queue_len(&format!("{}.q.default", env.ns)).await,
        Some(0)
    );
}
