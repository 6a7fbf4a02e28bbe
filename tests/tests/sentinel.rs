//! Redis Sentinel (docs/design.md "Scale-out"): the store follows a failover without a restart,
//! `wait_replicas` makes too few acknowledgements an error, and a beat with two workers loses
//! nothing and runs nothing twice when the primary is killed mid-stream. Uses the private
//! [`SentinelSet`] (primary + 2 replicas + 3 Sentinels), never the shared Redis.

use chrono::{DateTime, Utc};
use drumline_e2e::cfg::{every, shell, Cfg, Keys};
use drumline_e2e::probe::{expect, stop, tails};
use drumline_e2e::proxy::Fault;
use drumline_e2e::sentinel::{SentinelSet, FAR_SIDE};
use drumline_e2e::snoop::Snoop;
use drumline_e2e::{
    adhoc, assert_contiguous_exactly_once, counts, instant_of, metric, setup, toml_string,
    wait_until, Proc, StreamPublisher, TestEnv, AMQP_URL,
};
use drumline_shared::names::Names;
use drumline_shared::store::{
    Candidate, Claim, ClaimRequest, Ending, Final, LeaseMode, LeaseOutcome, OverlapMode,
    ProgressError, Store, StoreError, WaitReplicas,
};
use std::collections::{BTreeMap, BTreeSet};
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
    let store = Store::connect(&set.url(0), None, names.clone()).await;
    let store = store.expect("connect through the sentinels");
    let primary = set.primary().unwrap();
    let on_primary = Some(("127.0.0.1".to_owned(), primary));
    assert_eq!(store.connection().primary(), on_primary);

    // Both replicas acknowledge: the final state is on each of them when `finish` returns.
    let both = store.clone().with_wait(wait(2, Duration::from_secs(5)));
    assert!(claimed(&both, "k1").await);
    let (done, retention) = (Ending::Final(Final::Done), Duration::from_secs(600));
    let finished = both.finish("k1", None, "token", done, retention).await;
    assert!(finished.unwrap().ours);
    for replica in set.nodes.iter().filter(|p| **p != primary) {
        let state = hget(*replica, &names.run_key("k1"));
        assert_eq!(state.as_deref(), Some("done"), "replica {replica}");
    }
    // What the start-up advice on wait_replicas reads (docs/scaling.md).
    assert_eq!(store.connected_replicas().await.unwrap(), 2);

    // Three asked, two exist: never a success, for a claim, its renewal, a final state, a
    // retry hand-over, the leader lease or the beat's progress.
    let three = store.clone().with_wait(wait(3, Duration::from_millis(300)));
    two_of_three(three.claim(&request("k1b")).await.expect_err("a claim"));
    let retry = Ending::Retry {
        next_attempt: 1,
        hold: Duration::from_secs(5),
    };
    for (key, ending) in [("k2", Ending::Final(Final::Dead)), ("k3", retry)] {
        assert!(claimed(&store, key).await);
        let lease = Duration::from_secs(30);
        let renewed = three.renew(key, None, "token", lease).await;
        two_of_three(renewed.expect_err("a renewal"));
        let ended = three.finish(key, None, "token", ending, retention).await;
        two_of_three(ended.expect_err("an end"));
    }
    let who = Candidate {
        token: "beat".to_owned(),
        host: "test".to_owned(),
        pid: 1,
    };
    let lease = Duration::from_secs(10);
    let led = three.lead(&who, lease, LeaseMode::Acquire).await;
    two_of_three(led.expect_err("a lease"));
    // `WAIT` rolls nothing back: the primary has the lease, it only did not count.
    let lead = store.lead(&who, lease, LeaseMode::Renew).await.unwrap();
    assert!(
        matches!(lead.outcome, LeaseOutcome::Renewed { .. }),
        "{lead:?}"
    );
    let advance = |s: Store| async move {
        s.advance_progress("beat", &[("job", Utc::now())], Duration::from_secs(5), 10)
            .await
    };
    let progress = advance(three).await;
    let short = matches!(
        progress,
        Err(ProgressError::Redis(StoreError::TooFewReplicas { .. }))
    );
    assert!(short, "{progress:?}");
    // Without the wait the same write is a success.
    let out = advance(store).await.unwrap();
    assert!(out.iter().all(Result::is_ok), "{out:?}");
}

/// Wait for `replicas` acknowledgements, `timeout` at most.
fn wait(replicas: u32, timeout: Duration) -> WaitReplicas {
    WaitReplicas { replicas, timeout }
}

/// Whether `store` claims `key` (see [`request`]).
async fn claimed(store: &Store, key: &str) -> bool {
    matches!(
        store.claim(&request(key)).await.unwrap(),
        Claim::Claimed { .. }
    )
}

/// `e` says two replicas acknowledged where three were asked.
fn two_of_three(e: StoreError) {
    let short = matches!(
        e,
        StoreError::TooFewReplicas {
            acked: 2,
            wanted: 3,
            ..
        }
    );
    assert!(short, "{e}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_store_follows_a_failover_without_a_restart() {
    let mut set = SentinelSet::shared().await;
    let names = namespace("follow");
    let store = Store::connect(&set.url(0), None, names).await;
    let store = store.expect("connect through the sentinels");
    assert!(claimed(&store, "before").await);
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
        let waited = killed_at.elapsed();
        assert!(waited < WAIT, "the store never followed the failover");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let resumed = killed_at.elapsed();
    assert!(matches!(followed, Claim::Claimed { .. }), "{followed:?}");
    let (new, _) = set.wait_failover(old, killed_at, WAIT);
    let primary = store.connection().primary();
    assert_eq!(primary, Some(("127.0.0.1".to_owned(), new)));
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
    let cfg = sentinel_cfg(&env, set, wait_replicas, "1s", 0.1).job("tick", tick("queue"));
    let config = env.config_file(&cfg);
    let mut workers = [env.worker_on("w1", &config), env.worker_on("w2", &config)];
    env.wait_for_topology(&workers[0]).await;
    // What the beat publishes, recorded on the broker (not read from its log).
    let snoop = Snoop::start(&mut env, "default");
    let mut beat = env.beat_on("beat", &config);
    env.expect_lines("effects", 3, &[&beat]);

    // The stream: ADHOC tasks at about 40 a second, published as a producer would.
    let keys: Vec<String> = (0..ADHOC).map(|i| format!("adhoc-{i:04}")).collect();
    let stream = tokio::spawn({
        let (keys, names) = (keys.clone(), env.names());
        async move {
            let mut publisher = StreamPublisher::new(AMQP_URL);
            for key in &keys {
                publisher.publish(&names, &adhoc(key, "append"), WAIT).await;
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
    });
    let adhoc_ran = |env: &TestEnv| {
        let lines = env.lines("effects");
        lines.iter().filter(|l| l.starts_with("adhoc-")).count()
    };
    let procs = [&workers[0], &workers[1], &beat];
    expect(WAIT, &procs, "a third of the stream ran", || {
        adhoc_ran(&env) >= ADHOC / 3
    });

    let before = env.lines("effects").len();
    let killed_at = Instant::now();
    let old = set.kill_primary();
    let (_, failover) = set.wait_failover(old, killed_at, WAIT);
    // Resumed: more effects than the runs in flight at the kill could write (2 workers × 4).
    expect(WAIT, &procs, "no progress after the failover", || {
        env.lines("effects").len() >= before + 10
    });
    let resumed = killed_at.elapsed();
    stream.await.expect("publisher");
    let ticks_at_resume = env.lines("effects").len() - adhoc_ran(&env);
    expect(
        Duration::from_secs(90),
        &procs,
        "not every task ran",
        || {
            let lines = env.lines("effects");
            let ticks = lines.iter().filter(|l| l.starts_with("tick@")).count();
            let keys: BTreeSet<&String> = lines.iter().collect();
            ticks >= ticks_at_resume + 3
                && keys.iter().filter(|l| l.starts_with("adhoc-")).count() == ADHOC
        },
    );
    stop(&mut [&mut beat]);
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
    stop(&mut workers.iter_mut().collect::<Vec<_>>());

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
    let (started, ran) = (env.path("started"), env.path("ran"));
    let slow = format!(
        "echo $DRUMLINE_KEY >> {}; sleep 2; echo $DRUMLINE_KEY >> {}",
        started.display(),
        ran.display()
    );
    let cfg = sentinel_cfg(&env, &set, 2, "300ms", 0.0).task("slow", shell(&slow));
    let (worker, port) = env.worker_serving("worker", &env.config_file(&cfg));
    env.wait_for_topology(&worker).await;
    env.publish(&adhoc("k-stall", "slow")).await;
    expect(WAIT, &[&worker], "k-stall started", || {
        !env.lines("started").is_empty()
    });
    let primary = set.primary().expect("a primary");
    let replica = *set.nodes.iter().find(|p| **p != primary).unwrap();
    set.freeze(replica);
    // The fault's length, not a synchronisation: the stall outlasts the task, so `done` is
    // written while the replica cannot acknowledge.
    tokio::time::sleep(Duration::from_secs(3)).await;
    set.thaw(replica);

    let success = r#"drumline_worker_runs_total{task="slow",outcome="success"}"#;
    let lost = r#"drumline_worker_runs_total{task="slow",outcome="lease_lost"}"#;
    expect(WAIT, &[&worker], "success not counted", || {
        metric(port, success) == Some(1.0)
    });
    assert_eq!(metric(port, lost), None, "{}", tails(&[&worker]));
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
    let set = tokio::task::spawn_blocking(SentinelSet::behind_proxy).await;
    let set = set.expect("sentinel set");
    let front = set.front.as_ref().expect("a proxy in front of the primary");
    let mut env = setup("e2e_sentinel_cut");
    let cfg = sentinel_cfg(&env, &set, 1, "500ms", 0.0)
        .set("beat", "leader_lease", "\"3s\"")
        .set("worker", "lease", "\"6s\"");
    let config = env.config_file(&cfg.job("tick", tick("allow")));
    let names = env.names();
    let mut workers = vec![env.worker_on("w-before", &config)];
    env.wait_for_topology(&workers[0]).await;
    let snoop = Snoop::start(&mut env, "default");
    let (a, a_port) = env.beat_serving("beat-a", &config);
    let (b, b_port) = env.beat_serving("beat-b", &config);
    let mut beats = vec![a, b];
    let ports: Beats = Arc::new(Mutex::new(vec![
        ("beat-a".into(), a_port),
        ("beat-b".into(), b_port),
    ]));
    expect(WAIT, &[&beats[0]], "three ticks", || {
        env.lines("effects").len() >= 3
    });
    let stop_sampling = Arc::new(AtomicBool::new(false));
    let sampler = sample_leaders(ports.clone(), stop_sampling.clone());

    let cut_at = Instant::now();
    front.set_from(FAR_SIDE, Fault::Blackhole);
    let (new, failover) = set.wait_failover(front.port, cut_at, Duration::from_secs(30));
    let failed_over = Utc::now();
    // A beat and a worker that start now ask the Sentinels and find the new primary.
    let (c, c_port) = env.beat_serving("beat-c", &config);
    beats.push(c);
    ports.lock().unwrap().push(("beat-c".into(), c_port));
    workers.push(env.worker_on("w-after", &config));

    let ticks_after = |env: &TestEnv| {
        let lines = env.lines("effects");
        lines.iter().filter(|k| instant_of(k) > failed_over).count()
    };
    let pids: Vec<u64> = beats.iter().map(|b| b.pid() as u64).collect();
    let led = wait_until(Duration::from_secs(30), || {
        lease_on(new, &names).is_some_and(|(pid, _)| pids.contains(&pid)) && ticks_after(&env) >= 3
    });
    let resumed = cut_at.elapsed();
    stop_sampling.store(true, Ordering::Relaxed);
    let overlaps = sampler.join().expect("sampler");
    let all: Vec<&Proc> = beats.iter().chain(&workers).collect();
    assert!(
        overlaps.is_empty(),
        "two beats led at once after the primary was cut off from its replicas:\n{}\n{}",
        overlaps[..overlaps.len().min(5)].join("\n"),
        tails(&all)
    );
    assert!(
        led,
        "no leader on the new primary {new} resumed the ticks within 30 s of the failover \
         (lease there: {:?})\n{}",
        lease_on(new, &names),
        tails(&all)
    );
    println!(
        "primary cut off from its replicas: sentinels promoted {new} {failover:?} after the cut; \
         ticks resumed under a leader on it {resumed:?} after the cut"
    );
    stop(&mut beats.iter_mut().collect::<Vec<_>>());
    let published = snoop.settle();
    assert_terms_follow_one_another(&published);
    let keys: BTreeSet<String> = published.into_iter().map(|m| m.envelope.key).collect();
    let all: Vec<&Proc> = beats.iter().chain(&workers).collect();
    expect(WAIT, &all, "published instances did not all run", || {
        keys.is_subset(&env.lines("effects").into_iter().collect())
    });
    stop(&mut workers.iter_mut().collect::<Vec<_>>());
    assert_contiguous_exactly_once(&env.lines("effects"), 8);
}

/// The terms follow one another: each epoch's last decision comes before the next one's first
/// (the old leader may have published instants its progress could not record; the next one
/// publishes them again, and the workers dedupe them).
fn assert_terms_follow_one_another(published: &[drumline_e2e::snoop::Snooped]) {
    let mut terms: BTreeMap<i64, (DateTime<Utc>, DateTime<Utc>)> = BTreeMap::new();
    for m in published.iter().filter(|m| !m.via_delay) {
        let at = m.envelope.published_at;
        let term = terms.entry(m.epoch.unwrap_or(-1)).or_insert((at, at));
        (term.0, term.1) = (term.0.min(at), term.1.max(at));
    }
    let terms: Vec<_> = terms.into_iter().collect();
    for pair in terms.windows(2) {
        let ((epoch, (_, until)), (next, (from, _))) = (pair[0], pair[1]);
        assert!(
            until < from,
            "terms overlap: epoch {epoch} published until {until}, epoch {next} from {from}"
        );
    }
}

/// A config on `set`'s Sentinel URL with `wait_replicas` and `wait_timeout`, and an append
/// task that sleeps `sleep` s first.
fn sentinel_cfg(
    env: &TestEnv,
    set: &SentinelSet,
    wait_replicas: u32,
    timeout: &str,
    sleep: f64,
) -> Cfg {
    Cfg::new()
        .redis_url(&set.url(0))
        .set("redis", "wait_replicas", &wait_replicas.to_string())
        .set("redis", "wait_timeout", &toml_string(timeout))
        .task("append", env.appender("effects", sleep))
}

/// A 1 s `catch_up` job on the append task with `overlap`.
fn tick(overlap: &str) -> Keys {
    every("1s")
        .texts(&[("misfire", "catch_up"), ("overlap", overlap)])
        .task("append")
}
