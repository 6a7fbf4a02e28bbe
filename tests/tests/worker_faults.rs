//! The broker side of a worker under faults: its concurrency holds across reconnects, a closed
//! publisher channel is reopened without spinning, a topology mismatch on reconnect lets the
//! runs in flight finish, SIGTERM ends it in time whatever state its channels are in, and a
//! queue deleted under it is declared and consumed again while `/healthz` says so.
//! Destructive faults use a private RabbitMQ node, never the shared one.

use drumline_e2e::cfg::{shell, Cfg, Keys};
use drumline_e2e::probe::{expect, stop, stop_within, tails};
use drumline_e2e::{
    adhoc, http_get, setup, wait_until, wait_until_async, PrivateRabbit, Proc, StreamPublisher,
    TestEnv,
};
use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);

/// Publishes `envelope` to `{ns}.tasks` on the broker at `url`, waiting for the confirm.
async fn publish_to(url: &str, ns: &str, envelope: &drumline_shared::envelope::Envelope) {
    let names = drumline_shared::names::Names::new(ns);
    StreamPublisher::new(url)
        .publish(&names, envelope, WAIT)
        .await;
}

/// Waits until the worker declared `{ns}.q.default` on the broker at `url`.
async fn wait_for_queue(url: &str, queue: &str) -> bool {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if let Ok(conn) = Connection::connect(url, ConnectionProperties::default()).await {
            let ch = conn.create_channel().await.expect("channel");
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let exists = ch
                .queue_declare(queue.into(), passive, FieldTable::default())
                .await
                .is_ok();
            let _ = conn.close(200, "bye".into()).await;
            if exists {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// A shell command (TOML array) that logs `start KEY T` and `end KEY T` (T in seconds since the
/// epoch, with nanoseconds) to `file` around `sleep` seconds.
fn timed_command(file: &std::path::Path, sleep: u32) -> Keys {
    let f = file.display();
    shell(&format!(
        "echo \"start $DRUMLINE_KEY $(date +%s.%N)\" >> {f}; sleep {sleep}; echo \"end $DRUMLINE_KEY $(date +%s.%N)\" >> {f}"
    ))
}

/// A worker on the private broker `rabbit` (`cfg` with its `[broker] url`), once it declared
/// its work queue there.
async fn worker_on_rabbit(env: &TestEnv, rabbit: &PrivateRabbit, cfg: Cfg) -> Proc {
    let worker = env.worker_on("worker", &env.config_file(&cfg.broker_url(&rabbit.url())));
    let declared = wait_for_queue(&rabbit.url(), &env.names().work_queue("default")).await;
    assert!(declared, "{}", tails(&[&worker]));
    worker
}

/// `start`/`end` events per key from a [`timed_command`] file.
fn runs(lines: &[String]) -> BTreeMap<String, (Vec<f64>, Vec<f64>)> {
    let mut map: BTreeMap<String, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    for line in lines {
        let mut parts = line.split(' ');
        let (Some(kind), Some(key), Some(t)) = (parts.next(), parts.next(), parts.next()) else {
            panic!("bad event line {line:?}");
        };
        let t: f64 = t.parse().expect("timestamp");
        let entry = map.entry(key.to_owned()).or_default();
        match kind {
            "start" => entry.0.push(t),
            "end" => entry.1.push(t),
            other => panic!("bad event {other:?}"),
        }
    }
    map
}

/// The most runs that were in progress at one instant. Each run is measured from inside the
/// task, so the measured intervals lie within the real ones and never overstate the overlap.
fn max_overlap(lines: &[String]) -> usize {
    let mut events: Vec<(f64, i32)> = Vec::new();
    for line in lines {
        let mut parts = line.split(' ');
        let kind = parts.next().unwrap();
        let t: f64 = parts.nth(1).unwrap().parse().unwrap();
        // Ends sort before starts at the same instant: touching runs do not overlap.
        events.push((t, if kind == "start" { 1 } else { -1 }));
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut now, mut max) = (0i32, 0i32);
    for (_, delta) in events {
        now += delta;
        max = max.max(now);
    }
    max as usize
}

/// A counter or gauge from the worker's `/metrics`.
fn metric(port: u16, name: &str) -> Option<u64> {
    let (_, body) = http_get(port, "/metrics")?;
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reconnect_does_not_add_runs_beyond_concurrency() {
    let env = setup("e2e_reconnect_concurrency");
    let rabbit = PrivateRabbit::start("concurrency");
    let events = env.path("events");
    let cfg = Cfg::new().set("worker", "concurrency", "2");
    let mut worker =
        worker_on_rabbit(&env, &rabbit, cfg.task("slow", timed_command(&events, 10))).await;
    let keys: Vec<String> = (0..4).map(|i| format!("k{i}")).collect();
    for key in &keys {
        publish_to(&rabbit.url(), &env.ns, &adhoc(key, "slow")).await;
    }
    // Two runs in flight, none finished: now the broker drops the connection.
    env.expect_lines("events", 2, &[&worker]);
    rabbit.close_connections();
    assert_eq!(
        env.lines("events").len(),
        2,
        "the runs ended before the connection was closed: {:?}",
        env.lines("events")
    );

    let ended = || {
        runs(&env.lines("events"))
            .values()
            .filter(|(_, e)| !e.is_empty())
            .count()
    };
    expect(WAIT, &[&worker], "every run ended", || {
        ended() == keys.len()
    });
    let lines = env.lines("events");
    assert!(
        max_overlap(&lines) <= 2,
        "more than `concurrency` runs at once after the reconnect: {lines:#?}"
    );
    for (key, (starts, ends)) in runs(&lines) {
        assert_eq!(
            (starts.len(), ends.len()),
            (1, 1),
            "{key} ran more than once"
        );
    }
    stop(&mut [&mut worker]);
}

/// Deletes `{ns}.dead` (the exchange): the worker's next dead-letter publish makes the broker
/// close its publisher channel (404 NOT_FOUND).
async fn break_dead_exchange(env: &drumline_e2e::TestEnv) {
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.expect("channel");
    ch.exchange_delete(
        env.names().dead().as_str().into(),
        ExchangeDeleteOptions::default(),
    )
    .await
    .expect("exchange.delete");
    let _ = conn.close(200, "bye".into()).await;
}

/// Puts `{ns}.dead` (the exchange and its binding to the queue) back.
async fn repair_dead_exchange(env: &drumline_e2e::TestEnv) {
    let dead = env.names().dead();
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.expect("channel");
    ch.exchange_declare(
        dead.as_str().into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("exchange.declare");
    ch.queue_bind(
        dead.as_str().into(),
        dead.as_str().into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("queue.bind");
    let _ = conn.close(200, "bye".into()).await;
}

/// A worker (with `/metrics` on the returned port, `[tasks.append]` and `worker_toml`) whose
/// only way out for a delivery fails: `{ns}.dead` is broken and an undecodable message is
/// queued, so its dead-letter publish closes the publisher channel.
async fn worker_with_a_failing_dead_letter(env: &TestEnv, cfg: Cfg) -> (Proc, u16) {
    let config = env.config_file(&cfg.task("append", env.appender("effects", 0.0)));
    let (worker, metrics) = env.worker_serving("worker", &config);
    env.wait_for_topology(&worker).await;
    break_dead_exchange(env).await;
    env.publish_raw("default", b"not json", BasicProperties::default())
        .await;
    (worker, metrics)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_closed_publisher_channel_is_reopened_and_requeues_are_paced() {
    let env = setup("e2e_publisher_reopen");
    let (mut worker, metrics) = worker_with_a_failing_dead_letter(&env, Cfg::new()).await;

    let requeued = |at_least: u64| {
        wait_until(WAIT, || {
            metric(metrics, "drumline_worker_requeued_total").is_some_and(|n| n >= at_least)
        })
    };
    assert!(requeued(1), "{}", worker.log_tail(30));
    // Watch the failure repeat for a while: it must back off, not spin.
    let window = Duration::from_secs(5);
    let watch_until = Instant::now() + window;
    while Instant::now() < watch_until {
        std::thread::sleep(Duration::from_millis(100));
    }
    let in_window = metric(metrics, "drumline_worker_requeued_total").unwrap();
    assert!(
        (2..=8).contains(&in_window),
        "{in_window} requeues within {window:?} of the first (paced: 0.2 s, 0.4 s, 0.8 s, ...)\n{}",
        worker.log_tail(30)
    );

    repair_dead_exchange(&env).await;
    let dead = env.names().dead();
    let dead_lettered =
        drumline_e2e::wait_until_async(WAIT, || async { env.queue_len(&dead).await == Some(1) })
            .await;
    assert!(
        dead_lettered,
        "the worker never recovered its publisher channel\n{}",
        worker.log_tail(30)
    );
    env.publish(&adhoc("k-after", "append")).await;
    expect(WAIT, &[&worker], "k-after ran", || {
        env.lines("effects") == vec!["k-after"]
    });
    stop(&mut [&mut worker]);
    assert_eq!(env.queue_len(&dead).await, Some(1));
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_ends_a_worker_whose_publisher_channel_keeps_failing() {
    let env = setup("e2e_sigterm_failing_channel");
    let grace = Duration::from_secs(3);
    let (mut worker, metrics) = worker_with_a_failing_dead_letter(
        &env,
        Cfg::new().set("worker", "shutdown_grace", "\"3s\""),
    )
    .await;
    expect(WAIT, &[&worker], "two requeues", || {
        metric(metrics, "drumline_worker_requeued_total").is_some_and(|n| n >= 2)
    });
    stop_within(&mut worker, grace + Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_ends_a_worker_whose_broker_died_mid_run() {
    let env = setup("e2e_sigterm_broker_died");
    let rabbit = PrivateRabbit::start("died");
    let events = env.path("events");
    let grace = Duration::from_secs(3);
    // `short` ends after the broker is gone (its ack has nowhere to go); `long` outlives the
    // grace and must be cancelled.
    let cfg = Cfg::new().set("worker", "concurrency", "2");
    let cfg = cfg.set("worker", "shutdown_grace", "\"3s\"");
    let (short, long) = (timed_command(&events, 2), timed_command(&events, 60));
    let cfg = cfg.task("short", short).task("long", long);
    let mut worker = worker_on_rabbit(&env, &rabbit, cfg).await;
    publish_to(&rabbit.url(), &env.ns, &adhoc("long", "long")).await;
    publish_to(&rabbit.url(), &env.ns, &adhoc("short", "short")).await;
    expect(WAIT, &[&worker], "both runs started", || {
        runs(&env.lines("events")).len() == 2
    });
    rabbit.kill9();
    expect(WAIT, &[&worker], "the short run ended", || {
        runs(&env.lines("events"))
            .get("short")
            .is_some_and(|(_, ends)| ends.len() == 1)
    });
    stop_within(&mut worker, grace + Duration::from_secs(5));
    let long = &runs(&env.lines("events"))["long"];
    assert!(long.1.is_empty(), "the long run was not cancelled");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_topology_mismatch_on_reconnect_lets_in_flight_runs_finish() {
    let env = setup("e2e_mismatch_reconnect");
    let rabbit = PrivateRabbit::start("mismatch");
    let events = env.path("events");
    let cfg = Cfg::new().task("slow", timed_command(&events, 10));
    let mut worker = worker_on_rabbit(&env, &rabbit, cfg).await;
    publish_to(&rabbit.url(), &env.ns, &adhoc("k", "slow")).await;
    expect(WAIT, &[&worker], "one event", || {
        env.lines("events").len() == 1
    });
    // Someone redeclares the dead-letter queue with other arguments; the worker finds out when
    // it redeclares its topology after the connection drops.
    let dead = env.names().dead();
    let conn = Connection::connect(&rabbit.url(), ConnectionProperties::default())
        .await
        .expect("amqp connection");
    let ch = conn.create_channel().await.expect("channel");
    ch.queue_delete(dead.as_str().into(), QueueDeleteOptions::default())
        .await
        .expect("queue.delete");
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(1234));
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let declared = ch.queue_declare(dead.as_str().into(), durable, args).await;
    declared.expect("queue.declare");
    let _ = conn.close(200, "bye".into()).await;
    rabbit.close_connections();
    assert_eq!(
        env.lines("events").len(),
        1,
        "the run ended before the connection was closed"
    );

    let status = worker.wait(WAIT);
    // Read at once: a run that was dropped, not finished, may still write its end line later
    // from an orphaned process.
    let run = runs(&env.lines("events"));
    assert_eq!(status.code(), Some(2), "{}", tails(&[&worker]));
    let finished = run["k"].1.len();
    assert_eq!(
        finished,
        1,
        "the worker exited before its run in flight finished\n{}",
        tails(&[&worker])
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_ends_a_worker_whose_broker_froze() {
    let env = setup("e2e_sigterm_broker_froze");
    let rabbit = PrivateRabbit::start("froze");
    let events = env.path("events");
    let grace = Duration::from_secs(3);
    // The run fails after the broker froze: its retry publish gets no answer, ever.
    let script = format!(
        "echo \"start $DRUMLINE_KEY 0\" >> {f}; sleep 2; echo \"end $DRUMLINE_KEY 0\" >> {f}; exit 1",
        f = events.display()
    );
    let fails = shell(&script).with("max_retries", "3");
    let cfg = Cfg::new()
        .set("worker", "shutdown_grace", "\"3s\"")
        .task("fails", fails);
    let mut worker = worker_on_rabbit(&env, &rabbit, cfg).await;
    publish_to(&rabbit.url(), &env.ns, &adhoc("k", "fails")).await;
    expect(WAIT, &[&worker], "one event", || {
        env.lines("events").len() == 1
    });
    rabbit.freeze();
    expect(WAIT, &[&worker], "two events", || {
        env.lines("events").len() == 2
    });
    let asked = Instant::now();
    worker.signal(libc::SIGTERM);
    let exited = wait_until(grace + Duration::from_secs(5), || !worker.is_running());
    rabbit.thaw();
    assert!(
        exited,
        "still running {:?} after SIGTERM\n{}",
        asked.elapsed(),
        worker.log_tail(20)
    );
    let status = worker.wait(Duration::from_secs(1));
    assert!(status.success(), "{status:?}\n{}", worker.log_tail(20));
}

/// Consumers of queue `name` on the shared broker (passive declare); `None` while it does not
/// exist.
async fn consumers_of(env: &TestEnv, name: &str) -> Option<u32> {
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.expect("channel");
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let count = ch
        .queue_declare(name.into(), passive, FieldTable::default())
        .await
        .ok()
        .map(|q| q.consumer_count());
    let _ = conn.close(200, "bye".into()).await;
    count
}

/// Deletes queue `name` as an operator would (a `queue_type` migration starts so).
async fn delete_queue(env: &TestEnv, name: &str) {
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.expect("channel");
    ch.queue_delete(name.into(), QueueDeleteOptions::default())
        .await
        .expect("queue.delete");
    let _ = conn.close(200, "bye".into()).await;
}

/// Deletes queue `name` and declares it at once as `options` and `args` say, on `conn`, before
/// the worker that consumed it declares it again: the channel is open before the delete, so
/// the declare follows it by one round trip, while the worker needs a channel of its own and two
/// declares. Tried again while the worker is first.
async fn replace_queue(
    conn: &Connection,
    name: &str,
    options: QueueDeclareOptions,
    args: FieldTable,
) -> bool {
    wait_until_async(WAIT, || async {
        let ch = conn.create_channel().await.expect("channel");
        let _ = ch
            .queue_delete(name.into(), QueueDeleteOptions::default())
            .await;
        ch.queue_declare(name.into(), options, args.clone())
            .await
            .is_ok()
    })
    .await
}

/// A worker consuming `qa` and `qb` (task `append` writes its key to `effects`), with
/// `/metrics` on the returned port, once both queues have its consumer.
async fn worker_on_two_queues(env: &mut TestEnv) -> (Proc, u16, String) {
    let names = env.names();
    env.forget_queue_later(names.work_queue("qa"));
    env.forget_queue_later(names.work_queue("qb"));
    let cfg = Cfg::new().set("worker", "queues", "[\"qa\", \"qb\"]");
    let config = env.config_file(&cfg.task("append", env.appender("effects", 0.0)));
    let (worker, port) = env.worker_serving("worker", &config);
    let up = wait_until_async(WAIT, || async {
        consumers_of(env, &names.work_queue("qa")).await == Some(1)
            && consumers_of(env, &names.work_queue("qb")).await == Some(1)
    })
    .await;
    assert!(
        up,
        "the worker never consumed both queues\n{}",
        tails(&[&worker])
    );
    (worker, port, config)
}

/// An ad-hoc task `append` with key `key` for logical queue `queue`.
fn append_on(key: &str, queue: &str) -> drumline_shared::envelope::Envelope {
    let mut envelope = adhoc(key, "append");
    envelope.queue = queue.to_owned();
    envelope
}

// See: issues/16 (a worker consuming two queues silently stopped consuming one)
#[tokio::test(flavor = "multi_thread")]
async fn a_queue_deleted_under_the_worker_is_declared_again_and_consumed() {
    let mut env = setup("e2e_queue_deleted");
    let (mut worker, _port, cfg) = worker_on_two_queues(&mut env).await;
    let qa = env.names().work_queue("qa");

    delete_queue(&env, &qa).await;
    let deleted = Instant::now();
    let back = wait_until_async(Duration::from_secs(5), || async {
        consumers_of(&env, &qa).await == Some(1)
    })
    .await;
    assert!(
        back,
        "{qa} has no consumer 5 s after it was deleted (consumers: {:?})\n{}",
        consumers_of(&env, &qa).await,
        worker.log_tail(20)
    );
    eprintln!(
        "{qa} consumed again {:?} after it was deleted",
        deleted.elapsed()
    );
    // Declared again as at start: the worker's own declare of it is accepted as equivalent.
    let config = drumline_shared::config::Config::load(std::path::Path::new(&cfg)).expect("config");
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.expect("channel");
    let same = drumline_shared::broker::declare(
        &ch,
        &env.names(),
        &["qa".to_owned()],
        config.worker.dead_ttl,
        config.broker.queue_type,
    )
    .await;
    assert!(
        same.is_ok(),
        "{qa} was declared with other arguments: {same:?}"
    );
    let _ = conn.close(200, "bye".into()).await;

    env.publish(&append_on("k-a", "qa")).await;
    env.publish(&append_on("k-b", "qb")).await;
    let both = wait_until(WAIT, || {
        let mut lines = env.lines("effects");
        lines.sort();
        lines == ["k-a", "k-b"]
    });
    assert!(both, "{:?}\n{}", env.lines("effects"), worker.log_tail(20));
    stop(&mut [&mut worker]);
}

// See: issues/16
#[tokio::test(flavor = "multi_thread")]
async fn healthz_is_503_while_a_configured_queue_has_no_consumer() {
    let mut env = setup("e2e_queue_unconsumed");
    let (mut worker, port, _cfg) = worker_on_two_queues(&mut env).await;
    assert_eq!(http_get(port, "/healthz").map(|r| r.0), Some(200));
    let qa = env.names().work_queue("qa");

    // Hold `qa` away from the worker: deleted, then declared exclusive to the test's own
    // connection before the worker declares it again.
    let holder = env.amqp().await;
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    let held = replace_queue(&holder, &qa, exclusive, FieldTable::default()).await;
    assert!(held, "could never take {qa} away from the worker");

    let healthz = |code: u16, body: &str| {
        http_get(port, "/healthz").is_some_and(|(c, b)| c == code && b.contains(body))
    };
    let what = format!("/healthz 503 naming qa while {qa} has no consumer of the worker");
    expect(WAIT, &[&worker], what, || healthz(503, "qa"));
    let consumers = |queue: &str| {
        let series = format!("drumline_worker_consumers{{queue=\"{queue}\"}}");
        drumline_e2e::metric(port, &series)
    };
    assert_eq!((consumers("qa"), consumers("qb")), (Some(0.0), Some(1.0)));
    // The other queue is served meanwhile.
    env.publish(&append_on("k-b", "qb")).await;
    let ran = |keys: &[&str]| env.lines("effects") == keys;
    expect(WAIT, &[&worker], "k-b ran", || ran(&["k-b"]));

    // Released (the exclusive queue goes with its connection): consumed again within 5 s.
    let _ = holder.close(200, "bye".into()).await;
    let released = Instant::now();
    let what = format!("/healthz 200 5 s after {qa} could be declared again");
    expect(Duration::from_secs(5), &[&worker], what, || {
        healthz(200, "")
    });
    eprintln!(
        "/healthz ok {:?} after {qa} was released",
        released.elapsed()
    );
    assert_eq!(consumers("qa"), Some(1.0));
    env.publish(&append_on("k-a", "qa")).await;
    expect(WAIT, &[&worker], "k-b, then k-a ran", || {
        ran(&["k-b", "k-a"])
    });
    stop(&mut [&mut worker]);
}

// See: issues/16
#[tokio::test(flavor = "multi_thread")]
async fn a_queue_recreated_as_another_type_under_the_worker_ends_it_with_exit_2() {
    let mut env = setup("e2e_queue_retyped");
    let (mut worker, _port, _cfg) = worker_on_two_queues(&mut env).await;
    let qa = env.names().work_queue("qa");
    // Re-created as a quorum queue before the worker declares it again, as a `queue_type`
    // migration done under a running worker would.
    let conn = env.amqp().await;
    let mut quorum = FieldTable::default();
    quorum.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let retyped = replace_queue(&conn, &qa, durable, quorum).await;
    let _ = conn.close(200, "bye".into()).await;
    assert!(retyped, "could never re-create {qa} as a quorum queue");
    let status = worker.wait(WAIT);
    assert_eq!(status.code(), Some(2), "{}", worker.log_tail(20));
}
