//! Typed Rust handlers (docs/design.md#typed-rust-handlers): args arrive decoded into the
//! handler's type, args that do not decode are dead-lettered naming the field, a handler's
//! "retry after" is honoured, a panic is retried while other runs go on, cancellation reaches a
//! long handler, and fencing tokens strictly increase across a takeover (the example worker,
//! `worker/examples/typed_worker.rs`, killed with SIGKILL mid-run).
//!
//! The handlers write a line per execution (the effect the tests read); messages are published
//! with the producer client, `drumline_shared::client`.

use drumline_e2e::cfg::{Cfg, Keys};
use drumline_e2e::probe::expect;
use drumline_e2e::proxy::{Fault, Proxy};
use drumline_e2e::{setup, wait_until, wait_until_async, TestEnv, AMQP_URL, REDIS_URL};
use drumline_shared::broker::header_str;
use drumline_shared::client::{Message, Producer};
use drumline_shared::config::{Config, ENV_AMQP_URL, ENV_REDIS_URL};
use drumline_worker::{HandlerError, TaskContext, Worker};
use lapin::options::{BasicAckOptions, BasicGetOptions};
use serde::Deserialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const WAIT: Duration = Duration::from_secs(30);

/// A task served by a Rust handler: no `command`.
fn rust_task() -> Keys {
    Keys::default()
}

/// `cfg` written for `env`, loaded with Redis at `redis` and the shared broker.
fn load(env: &TestEnv, cfg: &Cfg, redis: &str) -> Config {
    let path = env.write_config("drumline.toml", cfg);
    let text = std::fs::read_to_string(&path).unwrap();
    Config::parse(&text, &path, |name| match name {
        ENV_REDIS_URL => Some(redis.to_owned()),
        ENV_AMQP_URL => Some(AMQP_URL.to_owned()),
        _ => None,
    })
    .unwrap()
}

/// An in-process worker, stopped when dropped.
struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.stop.take().map(|stop| stop.send(()));
        self.task.abort();
    }
}

/// Runs `worker` in this process until the returned guard is dropped; returns once it consumes.
async fn start(env: &TestEnv, worker: Worker) -> Running {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let _ = worker
            .run(async move {
                let _ = rx.await;
            })
            .await;
    });
    let queue = env.names().work_queue("default");
    let up = wait_until_async(WAIT, || async {
        env.queue_consumers(&queue).await.is_some_and(|n| n > 0)
    })
    .await;
    assert!(up, "the in-process worker never consumed");
    Running {
        stop: Some(tx),
        task,
    }
}

/// Appends `line` to `path`: a handler's effect.
fn note(path: &Path, line: &str) {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    writeln!(file, "{line}").unwrap();
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

async fn producer(env: &TestEnv) -> Producer {
    Producer::connect(AMQP_URL, &env.ns).await.unwrap()
}

/// Every dead letter of the namespace, taken off `{ns}.dead`: (key, reason, error).
async fn dead_letters(env: &TestEnv) -> Vec<(String, String, String)> {
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    let dead = env.names().dead();
    let mut out = Vec::new();
    while let Some(msg) = ch
        .basic_get(dead.as_str().into(), BasicGetOptions::default())
        .await
        .unwrap()
    {
        let props = &msg.delivery.properties;
        let h = props.headers().as_ref();
        out.push((
            props.message_id().as_ref().map(|m| m.to_string()).unwrap(),
            header_str(h, "x-drumline-reason").unwrap_or_default(),
            header_str(h, "x-drumline-error").unwrap_or_default(),
        ));
        msg.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    let _ = conn.close(200, "bye".into()).await;
    out
}

#[derive(Debug, Deserialize)]
struct Resize {
    image: String,
    size: Size,
}

#[derive(Debug, Deserialize)]
struct Size {
    width: u32,
}

#[tokio::test(flavor = "multi_thread")]
async fn args_arrive_typed_and_wrong_shapes_are_dead_lettered_naming_the_field() {
    let env = setup("e2e_typed_args");
    let config = load(&env, &Cfg::new().task("resize", rust_task()), REDIS_URL);
    let runs = env.path("runs");
    let worker = Worker::new(config).typed_handler("resize", move |r: Resize, ctx: TaskContext| {
        let runs = runs.clone();
        async move {
            note(&runs, &format!("{} {} {}", ctx.key, r.image, r.size.width));
            Ok::<(), HandlerError>(())
        }
    });
    let _worker = start(&env, worker).await;
    let producer = producer(&env).await;
    let good = serde_json::json!({"image": "cat.png", "size": {"width": 640}});
    let bad = serde_json::json!({"image": "cat.png", "size": {"width": "wide"}});
    for (key, args) in [("good", good), ("bad", bad)] {
        let message = Message::new("resize").key(key).args(args);
        producer.publish(&message).await.unwrap();
    }
    let good_ran = wait_until(WAIT, || env.lines("runs") == ["good cat.png 640"]);
    assert!(good_ran, "{:?}", env.lines("runs"));
    // The wrong-shaped message is dead-lettered.
    env.expect_state("bad", "dead", &[]).await;
    let letters = dead_letters(&env).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    let (key, reason, error) = &letters[0];
    assert_eq!((key.as_str(), reason.as_str()), ("bad", "permanent"));
    let named = "args.size.width: invalid type: string \"wide\", expected u32";
    assert!(error.contains(named), "{error}");
    assert_eq!(env.lines("runs").len(), 1, "the bad message never ran");
    producer.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_typed_handlers_retry_after_is_honoured() {
    let env = setup("e2e_typed_retry_after");
    let config = load(&env, &Cfg::new().task("later", rust_task()), REDIS_URL);
    let runs = env.path("runs");
    let worker = Worker::new(config).typed_handler(
        "later",
        move |_: serde_json::Value, ctx: TaskContext| {
            let runs = runs.clone();
            async move {
                note(&runs, &format!("{} {}", ctx.attempt, now_ms()));
                if ctx.attempt == 0 {
                    return Err(HandlerError::retry_after("busy", Duration::from_secs(2)));
                }
                Ok(())
            }
        },
    );
    let _worker = start(&env, worker).await;
    let producer = producer(&env).await;
    producer
        .publish(&Message::new("later").key("k"))
        .await
        .unwrap();
    assert!(wait_until(WAIT, || env.lines("runs").len() == 2));
    env.expect_state("k", "done", &[]).await;
    let stamp = |line: &String| -> (u32, u128) {
        let (attempt, ms) = line.split_once(' ').unwrap();
        (attempt.parse().unwrap(), ms.parse().unwrap())
    };
    let stamps: Vec<(u32, u128)> = env.lines("runs").iter().map(stamp).collect();
    assert_eq!((stamps[0].0, stamps[1].0), (0, 1));
    let waited = stamps[1].1 - stamps[0].1;
    assert!(
        waited >= 2000,
        "the retry ran {waited} ms after the first run"
    );
    eprintln!("the retry ran {waited} ms after the first run (asked: 2000 ms)");
    producer.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_panic_is_retried_while_other_runs_continue() {
    let env = setup("e2e_typed_panic");
    let cfg = Cfg::new()
        .set("worker", "concurrency", "2")
        .task("flaky", rust_task().with("retry_base", "\"200ms\""))
        .task("steady", rust_task());
    let config = load(&env, &cfg, REDIS_URL);
    let (flaky_runs, steady_runs) = (env.path("flaky"), env.path("steady"));
    let worker = Worker::new(config)
        .typed_handler("flaky", move |_: serde_json::Value, ctx: TaskContext| {
            let runs = flaky_runs.clone();
            async move {
                note(&runs, &format!("{} {}", ctx.key, ctx.attempt));
                if ctx.attempt == 0 {
                    panic!("the handler panics on purpose");
                }
                Ok::<(), HandlerError>(())
            }
        })
        .typed_handler("steady", move |_: serde_json::Value, ctx: TaskContext| {
            let runs = steady_runs.clone();
            async move {
                note(&runs, &ctx.key);
                Ok::<(), HandlerError>(())
            }
        });
    let stats = worker.stats();
    let _worker = start(&env, worker).await;
    let producer = producer(&env).await;
    producer
        .publish(&Message::new("flaky").key("boom"))
        .await
        .unwrap();
    for i in 0..5 {
        let message = Message::new("steady").key(format!("s{i}"));
        producer.publish(&message).await.unwrap();
    }
    assert!(
        wait_until(WAIT, || env.lines("flaky") == ["boom 0", "boom 1"]),
        "{:?}",
        env.lines("flaky")
    );
    assert!(wait_until(WAIT, || env.lines("steady").len() == 5));
    let done = wait_until_async(WAIT, || async {
        env.run_state("boom").await.as_deref() == Some("done")
    })
    .await;
    assert!(done);
    assert_eq!(stats.panics.get(), 1, "the panic was counted");
    // The worker kept running: a message published after the panic runs too.
    producer
        .publish(&Message::new("steady").key("after"))
        .await
        .unwrap();
    assert!(wait_until(WAIT, || env.lines("steady").len() == 6));
    producer.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn cancellation_reaches_a_long_handler_on_timeout_and_on_lease_loss() {
    let env = setup("e2e_typed_cancel");
    let proxy = Proxy::start("127.0.0.1:6379".parse().unwrap());
    let cfg = Cfg::new()
        .set("worker", "concurrency", "2")
        .set("worker", "lease", "\"3s\"")
        .task(
            "timed",
            rust_task()
                .with("timeout", "\"1s\"")
                .with("max_retries", "0"),
        )
        .task("long", rust_task());
    let config = load(&env, &cfg, &proxy.redis_url());
    let runs = env.path("runs");
    let long = move |_: serde_json::Value, ctx: TaskContext| {
        let runs = runs.clone();
        async move {
            note(&runs, &format!("start {}", ctx.key));
            ctx.cancel.cancelled().await;
            note(&runs, &format!("cancelled {}", ctx.key));
            Err::<(), _>(HandlerError::retryable("cancelled"))
        }
    };
    let worker = Worker::new(config)
        .typed_handler("timed", long.clone())
        .typed_handler("long", long);
    let _worker = start(&env, worker).await;
    let producer = producer(&env).await;

    // The task's timeout: the handler is told, and the run fails "timed out".
    producer
        .publish(&Message::new("timed").key("t1"))
        .await
        .unwrap();
    assert!(
        wait_until(WAIT, || env.lines("runs") == ["start t1", "cancelled t1"]),
        "{:?}",
        env.lines("runs")
    );
    let dead = wait_until_async(WAIT, || async {
        env.run_state("t1").await.as_deref() == Some("dead")
    })
    .await;
    assert!(dead);
    let letters = dead_letters(&env).await;
    assert!(letters[0].2.contains("timed out after 1s"), "{letters:?}");

    // Lease loss: Redis goes silent under the run; the handler hears of it before the lease
    // could be taken.
    producer
        .publish(&Message::new("long").key("l1"))
        .await
        .unwrap();
    assert!(wait_until(WAIT, || env.lines("runs").len() == 3));
    proxy.set(Fault::Blackhole);
    assert!(
        wait_until(Duration::from_secs(10), || env
            .lines("runs")
            .contains(&"cancelled l1".to_owned())),
        "{:?}",
        env.lines("runs")
    );
    proxy.set(Fault::Pass);
    producer.close().await;
}

/// `start KEY FENCE ATTEMPT` lines of the example worker's `runs` file: (fence, attempt).
fn starts(out: &Path, key: &str) -> Vec<(u64, u32)> {
    let text = std::fs::read_to_string(out.join("runs")).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("start ")?.strip_prefix(key)?;
            let mut parts = rest.split_whitespace();
            Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn fencing_tokens_strictly_increase_across_a_takeover() {
    let env = setup("e2e_typed_fencing");
    let cfg = Cfg::new()
        .set("worker", "lease", "\"2s\"")
        .task("greet", rust_task())
        .task("deposit", rust_task());
    let config = env.write_config("drumline.toml", &cfg);
    let out: PathBuf = env.path("out");
    std::fs::create_dir_all(&out).unwrap();
    let (config, out_arg) = (config.to_str().unwrap(), out.to_str().unwrap());
    let mut first = env.program("typed-worker", "first", &[config, out_arg]);
    env.wait_for_topology(&first).await;
    let producer = producer(&env).await;
    let args = serde_json::json!({"account": "acme", "cents": 500, "work_ms": 3000});
    let message = Message::new("deposit").key("dep-1").args(args);
    producer.publish(&message).await.unwrap();
    let greeting = Message::new("greet")
        .key("hi")
        .args(serde_json::json!({"name": "Ada"}));
    producer.publish(&greeting).await.unwrap();
    expect(WAIT, &[&first], "dep-1 started once", || {
        starts(&out, "dep-1").len() == 1
    });
    first.kill9();

    let second = env.program("typed-worker", "second", &[config, out_arg]);
    let ledger = out.join("ledger-acme");
    let written = wait_until(WAIT, || ledger.exists());
    assert!(written, "{}", second.log_tail(30));
    let runs = starts(&out, "dep-1");
    assert_eq!(runs.len(), 2, "{runs:?}");
    let ((old, attempt), (new, again)) = (runs[0], runs[1]);
    assert!(new > old, "the takeover's token {new} is not above {old}");
    assert_eq!(attempt, again, "a takeover repeats the interrupted attempt");
    let line = std::fs::read_to_string(&ledger).unwrap();
    assert_eq!(line, format!("{new} dep-1 500\n"));
    let done = wait_until_async(WAIT, || async {
        env.run_state("dep-1").await.as_deref() == Some("done")
    })
    .await;
    assert!(done, "{}", second.log_tail(30));
    assert!(wait_until(WAIT, || std::fs::read_to_string(
        out.join("greetings")
    )
    .is_ok_and(|g| g.contains("hi 0 hello Ada"))));
    producer.close().await;
}
