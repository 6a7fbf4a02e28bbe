//! Redis Sentinel (docs/design.md "Scale-out"): the store follows a failover without a restart,
//! `wait_replicas` makes too few acknowledgements an error, and a beat with two workers loses
//! nothing and runs nothing twice when the primary is killed mid-stream. Uses the private
//! [`SentinelSet`] (primary + 2 replicas + 3 Sentinels), never the shared Redis.

use chrono::Utc;
use drumline_e2e::proxy::Fault;
use drumline_e2e::sentinel::{SentinelSet, FAR_SIDE};
use drumline_e2e::snoop::Snoop;
use drumline_e2e::{
    adhoc, assert_contiguous_exactly_once, counts, instant_of, metric, setup, toml_string,
    wait_until, with_metrics, Proc, AMQP_URL,
};
use drumline_shared::names::Names;
use drumline_shared::store::{
    Candidate, Claim, ClaimRequest, Ending, Final, LeaseMode, LeaseOutcome, OverlapMode,
    ProgressError, Store, StoreError, WaitReplicas,
};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{Connection, ConnectionProperties};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);

fn namespace(test: &str) -> Names {
    Names::new(format!(
        "t_{test}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ))
}

fn request(key: &str) -> ClaimRequest<'_> {
    ClaimRequest {
        key,
        token: "token",
        worker: "test",
        job: None,
        attempt: 0,
        lease: Duration::from_secs(30),
        overlap: OverlapMode::Allow,
        retention: Duration::from_secs(600),
        expired: false,
        limit: None,
        epoch: 0,
    }
}

fn hget(port: u16, key: &str) -> Option<String> {
    let mut conn = redis::Client::open(SentinelSet::node_url(port))
        .unwrap()
        .get_connection()
        .unwrap();
    redis::cmd("HGET")
        .arg(key)
        .arg("state")
        .query(&mut conn)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn wait_replicas_counts_acknowledgements_and_fails_closed() {
    let set = SentinelSet::shared().await;
    let names = namespace("wait");
    let store = Store::connect(&set.url(0), None, names.clone())
        .await
        .expect("connect through the sentinels");
    let primary = set.primary().unwrap();
    assert_eq!(
        store.connection().primary(),
        Some(("127.0.0.1".to_owned(), primary))
    );

    // Both replicas acknowledge: the final state is on each of them when `finish` returns.
    let both = store.clone().with_wait(WaitReplicas {
        replicas: 2,
        timeout: Duration::from_secs(5),
    });
    assert!(matches!(
        both.claim(&request("k1")).await.unwrap(),
        Claim::Claimed { .. }
    ));
    let done = Ending::Final(Final::Done);
    let retention = Duration::from_secs(600);
    assert!(
        both.finish("k1", None, "token", done, retention)
            .await
            .unwrap()
            .ours
    );
    for replica in set.nodes.iter().filter(|p| **p != primary) {
        assert_eq!(
            hget(*replica, &names.run_key("k1")).as_deref(),
            Some("done"),
            "replica {replica}"
        );
    }
    // What the start-up advice on wait_replicas reads (docs/scaling.md).
    assert_eq!(store.connected_replicas().await.unwrap(), 2);

    // Three asked, two exist: never a success, for a claim, its renewal, a final state, a
    // retry hand-over, the leader lease or the beat's progress.
    let three = store.clone().with_wait(WaitReplicas {
        replicas: 3,
        timeout: Duration::from_millis(300),
    });
    let short = |e: StoreError| {
        assert!(
            matches!(
                e,
                StoreError::TooFewReplicas {
                    acked: 2,
                    wanted: 3,
                    ..
                }
            ),
            "{e}"
        )
    };
    short(three.claim(&request("k1b")).await.expect_err("a claim"));
    for (key, ending) in [
        ("k2", Ending::Final(Final::Dead)),
        (
            "k3",
            Ending::Retry {
                next_attempt: 1,
                hold: Duration::from_secs(5),
            },
        ),
    ] {
        assert!(matches!(
            store.claim(&request(key)).await.unwrap(),
            Claim::Claimed { .. }
        ));
        let lease = Duration::from_secs(30);
        short(
            three
                .renew(key, None, "token", lease)
                .await
                .expect_err("a renewal"),
        );
        short(
            three
                .finish(key, None, "token", ending, retention)
                .await
                .expect_err("an end"),
        );
    }
    let who = Candidate {
        token: "beat".to_owned(),
        host: "test".to_owned(),
        pid: 1,
    };
    let lease = Duration::from_secs(10);
    short(
        three
            .lead(&who, lease, LeaseMode::Acquire)
            .await
            .expect_err("a lease"),
    );
    // `WAIT` rolls nothing back: the primary has the lease, it only did not count.
    let lead = store.lead(&who, lease, LeaseMode::Renew).await.unwrap();
    assert!(
        matches!(lead.outcome, LeaseOutcome::Renewed { .. }),
        "{lead:?}"
    );
    let progress = three
        .advance_progress("beat", &[("job", Utc::now())], Duration::from_secs(5), 10)
        .await;
    assert!(
        matches!(
            progress,
            Err(ProgressError::Redis(StoreError::TooFewReplicas { .. }))
        ),
        "{progress:?}"
    );
    // Without the wait the same write is a success.
    let out = store
        .advance_progress("beat", &[("job", Utc::now())], Duration::from_secs(5), 10)
        .await
        .unwrap();
    assert!(out.iter().all(Result::is_ok), "{out:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_store_follows_a_failover_without_a_restart() {
    let mut set = SentinelSet::shared().await;
    let names = namespace("follow");
    let store = Store::connect(&set.url(0), None, names)
        .await
        .expect("connect through the sentinels");
    assert!(matches!(
        store.claim(&request("before")).await.unwrap(),
        Claim::Claimed { .. }
    ));
    let killed_at = Instant::now();
    let old = set.kill_primary();
    // Calls fail (fail closed) until the store follows the new primary.
    let mut errors = 0;
    let mut i = 0;
    let followed = loop {
        i += 1;
        let key = format!("after-{i}");
        match store.claim(&request(&key)).await {
            Ok(claim) => break claim,
            Err(_) => errors += 1,
        }
        assert!(
            killed_at.elapsed() < WAIT,
            "the store never followed the failover"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let resumed = killed_at.elapsed();
    assert!(matches!(followed, Claim::Claimed { .. }), "{followed:?}");
    let (new, _) = set.wait_failover(old, killed_at, WAIT);
    assert_eq!(
        store.connection().primary(),
        Some(("127.0.0.1".to_owned(), new))
    );
    assert!(errors > 0, "no call failed while the primary was down");
    println!("store writes again {resumed:?} after kill -9 of the primary ({errors} calls failed)");
    set.heal();
}

/// What one failover run saw.
struct Outcome {
    failover: Duration,
    resumed: Duration,
    duplicates: Vec<(String, usize)>,
    lost: Vec<String>,
    ticks: usize,
    adhoc: usize,
}

const ADHOC: usize = 400;

/// A beat and two workers on the Sentinel URL, a 1 s `catch_up` job and a stream of ad-hoc
/// tasks; the primary is killed with -9 mid-stream.
async fn failover_under_load(set: &mut SentinelSet, test: &str, wait_replicas: u32) -> Outcome {
    let mut env = setup(test);
    let cfg = env.config(
        "drumline.toml",
        &format!(
            r#"
[redis]
url = {url}
wait_replicas = {wait_replicas}
wait_timeout = "1s"

[[jobs]]
name = "tick"
task = "append"
every = "1s"
misfire = "catch_up"
overlap = "queue"

[tasks.append]
command = {cmd}
"#,
            url = toml_string(&set.url(0)),
            cmd = env.append_key_command("effects", 0.1)
        ),
    );
    let cfg = cfg.to_str().unwrap();
    let mut workers = [
        env.worker("w1", &["--config", cfg]),
        env.worker("w2", &["--config", cfg]),
    ];
    env.wait_for_topology(&workers[0]).await;
    // What the beat publishes, recorded on the broker (not read from its log).
    let snoop = Snoop::start(&mut env, "default");
    let mut beat = env.beat("beat", &["--config", cfg]);
    assert!(
        wait_until(WAIT, || env.lines("effects").len() >= 3),
        "{}",
        beat.log_tail(20)
    );

    // The stream: ADHOC tasks at about 40 a second, published as a producer would.
    let exchange = env.names().tasks_exchange();
    let keys: Vec<String> = (0..ADHOC).map(|i| format!("adhoc-{i:04}")).collect();
    let stream = tokio::spawn({
        let keys = keys.clone();
        async move {
            let conn = Connection::connect(AMQP_URL, ConnectionProperties::default())
                .await
                .expect("amqp");
            let ch = conn.create_channel().await.expect("channel");
            ch.confirm_select(ConfirmSelectOptions::default())
                .await
                .expect("confirm");
            for key in &keys {
                let e = adhoc(key, "append");
                ch.basic_publish(
                    exchange.as_str().into(),
                    e.queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &e.encode(),
                    drumline_shared::broker::properties(&e, Utc::now(), 0),
                )
                .await
                .expect("publish")
                .await
                .expect("confirm");
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            let _ = conn.close(200, "bye".into()).await;
        }
    });
    let adhoc_ran = |env: &drumline_e2e::TestEnv| {
        env.lines("effects")
            .iter()
            .filter(|l| l.starts_with("adhoc-"))
            .count()
    };
    assert!(
        wait_until(WAIT, || adhoc_ran(&env) >= ADHOC / 3),
        "{}",
        workers[0].log_tail(20)
    );

    let before = env.lines("effects").len();
    let killed_at = Instant::now();
    let old = set.kill_primary();
    let (_, failover) = set.wait_failover(old, killed_at, WAIT);
    // Resumed: more effects than the runs in flight at the kill could write (2 workers × 4).
    assert!(
        wait_until(WAIT, || env.lines("effects").len() >= before + 10),
        "no progress after the failover\n{}\n{}",
        workers[0].log_tail(30),
        beat.log_tail(30)
    );
    let resumed = killed_at.elapsed();
    stream.await.expect("publisher");
    let ticks_at_resume = env.lines("effects").len() - adhoc_ran(&env);
    assert!(
        wait_until(Duration::from_secs(90), || {
            let lines = env.lines("effects");
            let ticks = lines.iter().filter(|l| l.starts_with("tick@")).count();
            let keys: BTreeSet<&String> = lines.iter().collect();
            ticks >= ticks_at_resume + 3
                && keys.iter().filter(|l| l.starts_with("adhoc-")).count() == ADHOC
        }),
        "not every task ran\n{}\n{}",
        workers[0].log_tail(30),
        workers[1].log_tail(30)
    );
    assert!(
        beat.terminate(Duration::from_secs(15)).success(),
        "{}",
        beat.log_tail(20)
    );
    let published: BTreeSet<String> = snoop
        .published_keys()
        .into_iter()
        .filter(|k| k.starts_with("tick@"))
        .collect();
    assert!(
        wait_until(WAIT, || {
            let ran: BTreeSet<String> = env.lines("effects").into_iter().collect();
            published.is_subset(&ran)
        }),
        "published instances did not all run"
    );
    for w in &mut workers {
        assert!(
            w.terminate(Duration::from_secs(30)).success(),
            "{}",
            w.log_tail(20)
        );
    }

    let lines = env.lines("effects");
    let counted = counts(&lines);
    let duplicates: Vec<(String, usize)> = counted
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(k, n)| (k.clone(), *n))
        .collect();
    let mut lost: Vec<String> = keys
        .iter()
        .filter(|k| !counted.contains_key(*k))
        .cloned()
        .collect();
    // Every instant from the first to the last tick ran: catch_up loses none.
    let ticks: Vec<_> = counted
        .keys()
        .filter(|k| k.starts_with("tick@"))
        .map(|k| instant_of(k))
        .collect();
    for pair in ticks.windows(2) {
        let mut t = pair[0] + chrono::TimeDelta::seconds(1);
        while t < pair[1] {
            lost.push(format!("tick@{}", t.to_rfc3339()));
            t += chrono::TimeDelta::seconds(1);
        }
    }
    Outcome {
        failover,
        resumed,
        duplicates,
        lost,
        ticks: ticks.len(),
        adhoc: ADHOC,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_primary_failover_with_wait_replicas_loses_nothing_and_doubles_nothing() {
    let mut set = SentinelSet::shared().await;
    let out = failover_under_load(&mut set, "e2e_sentinel_wait", 1).await;
    println!(
        "wait_replicas = 1: sentinel failover {:?}, work resumed {:?} after kill -9; {} ticks, {} ad-hoc; {} duplicates, {} lost",
        out.failover,
        out.resumed,
        out.ticks,
        out.adhoc,
        out.duplicates.len(),
        out.lost.len()
    );
    assert!(out.duplicates.is_empty(), "ran twice: {:?}", out.duplicates);
    assert!(out.lost.is_empty(), "lost: {:?}", out.lost);
    assert!(out.ticks >= 8, "only {} ticks ran", out.ticks);
    set.heal();
}

/// Without `wait_replicas` a failover may drop acknowledged writes (`done`, progress) that
/// had not reached a replica yet; this run reports what it cost, it does not assert it.
#[tokio::test(flavor = "multi_thread")]
async fn a_primary_failover_without_wait_replicas_is_reported() {
    let mut set = SentinelSet::shared().await;
    let out = failover_under_load(&mut set, "e2e_sentinel_nowait", 0).await;
    assert!(out.lost.is_empty(), "lost: {:?}", out.lost);
    println!(
        "wait_replicas = 0: sentinel failover {:?}, work resumed {:?} after kill -9; {} ticks, {} ad-hoc; {} duplicates {:?}, {} lost {:?}",
        out.failover,
        out.resumed,
        out.ticks,
        out.adhoc,
        out.duplicates.len(),
        out.duplicates,
        out.lost.len(),
        out.lost
    );
    set.heal();
}

/// See: issues/16 "Outcome writes are not idempotent". `wait_replicas = 2` and one replica
/// stalls (SIGSTOP) for 3 s around the end of a 2 s task: `done` lands on the primary but
/// `WAIT` falls short, so the write is repeated until both replicas have it. The repeat must
/// find its own token's `done` and count a success: never `lease_lost`, never a second run.
#[tokio::test(flavor = "multi_thread")]
async fn a_repeated_outcome_write_finds_its_own_result() {
    let set = SentinelSet::shared().await;
    let env = setup("e2e_wait_repeat");
    let cfg = env.config(
        "drumline.toml",
        &format!(
            "[redis]\nurl = {url}\nwait_replicas = 2\nwait_timeout = \"300ms\"\n\n\
             [tasks.slow]\ncommand = [\"/bin/sh\", \"-c\", {cmd}]\n",
            url = toml_string(&set.url(0)),
            cmd = toml_string(&format!(
                "echo $DRUMLINE_KEY >> {started}; sleep 2; echo $DRUMLINE_KEY >> {ran}",
                started = env.path("started").display(),
                ran = env.path("ran").display()
            )),
        ),
    );
    let (args, port) = drumline_e2e::with_metrics(&["--config", cfg.to_str().unwrap()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let worker = env.worker("worker", &args);
    env.wait_for_topology(&worker).await;
    env.publish(&adhoc("k-stall", "slow")).await;
    assert!(
        wait_until(WAIT, || !env.lines("started").is_empty()),
        "{}",
        worker.log_tail(20)
    );
    let primary = set.primary().expect("a primary");
    let replica = *set.nodes.iter().find(|p| **p != primary).unwrap();
    set.freeze(replica);
    // The fault's length, not a synchronisation: the stall outlasts the task, so `done` is
    // written while the replica cannot acknowledge.
    tokio::time::sleep(Duration::from_secs(3)).await;
    set.thaw(replica);

    let success = r#"drumline_worker_runs_total{task="slow",outcome="success"}"#;
    let counted = wait_until(WAIT, || drumline_e2e::metric(port, success) == Some(1.0));
    let lost = r#"drumline_worker_runs_total{task="slow",outcome="lease_lost"}"#;
    assert!(
        counted,
        "success not counted; lease_lost = {:?}\n{}",
        drumline_e2e::metric(port, lost),
        worker.log_tail(30)
    );
    assert_eq!(
        drumline_e2e::metric(port, lost),
        None,
        "{}",
        worker.log_tail(30)
    );
    assert_eq!(env.lines("ran"), ["k-stall"]);
    assert_eq!(env.lines("started"), ["k-stall"]);
}

/// A beat's metrics port, by label, for the leader sampler.
type Beats = Arc<Mutex<Vec<(String, u16)>>>;

/// Every `IS_LEADER` sample in which two beats said they led at once, until `stop` is set.
fn sample_leaders(beats: Beats, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Vec<String>> {
    std::thread::spawn(move || {
        let mut overlaps = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let ports = beats.lock().expect("beats").clone();
            let leading: Vec<String> = ports
                .iter()
                .filter(|(_, port)| metric(*port, "drumline_beat_is_leader") == Some(1.0))
                .map(|(label, port)| {
                    let epoch = metric(*port, "drumline_beat_leader_epoch").unwrap_or(-1.0);
                    format!("{label} (epoch {epoch})")
                })
                .collect();
            if leading.len() > 1 {
                overlaps.push(format!(
                    "{} ms: {}",
                    Utc::now().timestamp_millis(),
                    leading.join(", ")
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        overlaps
    })
}

/// `{ns}:beat:leader` on data node `port`, as `(pid, epoch)`.
fn lease_on(port: u16, names: &Names) -> Option<(u64, u64)> {
    let mut conn = redis::Client::open(SentinelSet::node_url(port))
        .ok()?
        .get_connection_with_timeout(Duration::from_millis(500))
        .ok()?;
    let text: Option<String> = redis::cmd("GET")
        .arg(names.beat_leader())
        .query(&mut conn)
        .ok()?;
    let lease: serde_json::Value = serde_json::from_str(&text?).ok()?;
    Some((lease["pid"].as_u64()?, lease["epoch"].as_u64()?))
}

// See: issues/16 (item 7)
/// The primary is cut off from its replicas and Sentinels (at the proxy in front of it) but
/// not from the beats and workers; the Sentinels promote a replica. With `wait_replicas = 1`
/// the lease and the claims carry `WAIT`, so the cut-off primary keeps no leader and takes no
/// claim: its clients ask the Sentinels again and follow the new primary. Never two beats
/// leading at once (their gauges, sampled), the publishing terms do not overlap (the broker's
/// copies), a leader on the new primary resumes the ticks, and every instant runs once.
#[tokio::test(flavor = "multi_thread")]
async fn a_primary_cut_off_from_its_replicas_keeps_no_leader_and_takes_no_claim() {
    let set = tokio::task::spawn_blocking(SentinelSet::behind_proxy)
        .await
        .expect("sentinel set");
    let front = set.front.as_ref().expect("a proxy in front of the primary");
    let mut env = setup("e2e_sentinel_cut");
    let cfg = env.config(
        "drumline.toml",
        &format!(
            r#"
[redis]
url = {url}
wait_replicas = 1
wait_timeout = "500ms"

[beat]
leader_lease = "3s"

[worker]
lease = "6s"

[[jobs]]
name = "tick"
task = "append"
every = "1s"
misfire = "catch_up"
overlap = "allow"

[tasks.append]
command = {cmd}
"#,
            url = toml_string(&set.url(0)),
            cmd = env.append_key_command("effects", 0.0)
        ),
    );
    let cfg = cfg.to_str().unwrap();
    let names = env.names();
    let mut workers = vec![env.worker("w-before", &["--config", cfg])];
    env.wait_for_topology(&workers[0]).await;
    let snoop = Snoop::start(&mut env, "default");
    let beat = |label: &str| {
        let (args, port) = with_metrics(&["--config", cfg]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        (env.beat(label, &args), port)
    };
    let (a, a_port) = beat("beat-a");
    let (b, b_port) = beat("beat-b");
    let mut beats = vec![a, b];
    let ports: Beats = Arc::new(Mutex::new(vec![
        ("beat-a".into(), a_port),
        ("beat-b".into(), b_port),
    ]));
    assert!(
        wait_until(WAIT, || env.lines("effects").len() >= 3),
        "{}",
        beats[0].log_tail(20)
    );
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_leaders(ports.clone(), stop.clone());

    let cut_at = Instant::now();
    front.set_from(FAR_SIDE, Fault::Blackhole);
    let (new, failover) = set.wait_failover(front.port, cut_at, Duration::from_secs(30));
    let failed_over = Utc::now();
    // A beat and a worker that start now ask the Sentinels and find the new primary.
    let (c, c_port) = beat("beat-c");
    beats.push(c);
    ports.lock().unwrap().push(("beat-c".into(), c_port));
    workers.push(env.worker("w-after", &["--config", cfg]));

    let ticks_after = |env: &drumline_e2e::TestEnv| {
        env.lines("effects")
            .iter()
            .filter(|k| instant_of(k) > failed_over)
            .count()
    };
    let pids: Vec<u64> = beats.iter().map(|b| b.pid() as u64).collect();
    let led = wait_until(Duration::from_secs(30), || {
        lease_on(new, &names).is_some_and(|(pid, _)| pids.contains(&pid)) && ticks_after(&env) >= 3
    });
    let resumed = cut_at.elapsed();
    stop.store(true, Ordering::Relaxed);
    let overlaps = sampler.join().expect("sampler");
    let logs = |beats: &[Proc], workers: &[Proc]| {
        beats
            .iter()
            .chain(workers)
            .map(|p| p.log_tail(12))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert!(
        overlaps.is_empty(),
        "two beats led at once after the primary was cut off from its replicas:\n{}\n{}",
        overlaps[..overlaps.len().min(5)].join("\n"),
        logs(&beats, &workers)
    );
    assert!(
        led,
        "no leader on the new primary {new} resumed the ticks within 30 s of the failover \
         (lease there: {:?})\n{}",
        lease_on(new, &names),
        logs(&beats, &workers)
    );
    println!(
        "primary cut off from its replicas: sentinels promoted {new} {failover:?} after the cut; \
         ticks resumed under a leader on it {resumed:?} after the cut"
    );

    for b in &mut beats {
        assert!(
            b.terminate(Duration::from_secs(15)).success(),
            "{}",
            b.log_tail(20)
        );
    }
    let published = snoop.settle();
    // The terms follow one another: each epoch's last decision comes before the next one's
    // first (the old leader may have published instants its progress could not record; the
    // next one publishes them again, and the workers dedupe them).
    let mut terms: std::collections::BTreeMap<i64, (chrono::DateTime<Utc>, chrono::DateTime<Utc>)> =
        Default::default();
    for m in published.iter().filter(|m| !m.via_delay) {
        let at = m.envelope.published_at;
        let term = terms.entry(m.epoch.unwrap_or(-1)).or_insert((at, at));
        term.0 = term.0.min(at);
        term.1 = term.1.max(at);
    }
    let terms: Vec<_> = terms.into_iter().collect();
    for pair in terms.windows(2) {
        assert!(
            pair[0].1 .1 < pair[1].1 .0,
            "terms overlap: epoch {} published until {}, epoch {} from {}",
            pair[0].0,
            pair[0].1 .1,
            pair[1].0,
            pair[1].1 .0
        );
    }
    let keys: BTreeSet<String> = published.into_iter().map(|m| m.envelope.key).collect();
    assert!(
        wait_until(WAIT, || {
            let ran: BTreeSet<String> = env.lines("effects").into_iter().collect();
            keys.is_subset(&ran)
        }),
        "published instances did not all run\n{}",
        logs(&beats, &workers)
    );
    for w in &mut workers {
        assert!(
            w.terminate(Duration::from_secs(30)).success(),
            "{}",
            w.log_tail(20)
        );
    }
    assert_contiguous_exactly_once(&env.lines("effects"), 8);
}
