//! Leadership (docs/design.md, issue 8): start several beats, one leads; a dead, stopped, paused or
//! clock-skewed leader is replaced without missing or doubling an instance. Real beats and
//! workers, real RabbitMQ and Redis. A "snoop" queue bound like the work queue sees every
//! message with its `x-drumline-epoch` and its arrival time; effects are the keys the task
//! appends (one line per execution); leadership is read from Redis `{ns}:beat:leader` and the
//! beats' metrics.

use chrono::{DateTime, Utc};
use drumline_e2e::cfg::{every, Cfg};
use drumline_e2e::proxy::{Fault, Proxy};
use drumline_e2e::scenario::{
    appends, check, leader, parse_instant, progress, redis_sync, stop, wait_for, Leader, Scenario,
};
use drumline_e2e::snoop::{Snoop, Snooped};
use drumline_e2e::suspend::Suspender;
use drumline_e2e::{
    assert_contiguous_exactly_once, faketime_ahead, http_get, instant_of, metric, wait_until,
    with_metrics, Proc,
};
use std::collections::BTreeSet;
use std::fmt::Display;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);
const SECOND: Duration = Duration::from_secs(1);
const IS_LEADER: &str = "drumline_beat_is_leader";
const LEADER_EPOCH: &str = "drumline_beat_leader_epoch";
/// `[beat]` for the clock-skew tests: a 3 s lease, a 2 s misfire threshold.
const SKEWED: [(&str, &str); 2] = [("leader_lease", "\"3s\""), ("misfire_threshold", "\"2s\"")];
const PUBLISHED: &str = r#"drumline_beat_published_total{job="tick"}"#;

/// A 1 s `catch_up` job `tick` whose task appends its key to `effects`, with `[beat]` keys
/// `beat` (`leader_lease` first); `workers` workers running and a snoop on the work queue.
async fn scenario(test: &str, beat: &[(&str, &str)], workers: usize) -> (Scenario, Snoop) {
    let mut sc = Scenario::start(test, 0, workers, |env| {
        let cfg = Cfg::new()
            .set("worker", "concurrency", "4")
            .set("worker", "lease", "\"3s\"")
            .set("worker", "shutdown_grace", "\"10s\"");
        let tick = every("1s")
            .with("task", "\"append\"")
            .with("misfire", "\"catch_up\"")
            .with("overlap", "\"allow\"");
        let cfg = beat.iter().fold(cfg, |c, (k, v)| c.set("beat", k, v));
        cfg.job("tick", tick)
            .task("append", appends(env, "effects"))
    })
    .await;
    let snoop = Snoop::start(&mut sc, "default");
    (sc, snoop)
}

/// A beat with its metrics port and its pid (kept after it exits).
struct Beat {
    proc: Proc,
    port: u16,
    pid: u64,
}

impl Beat {
    fn start(sc: &Scenario, label: &str, vars: &[(&str, &str)]) -> Self {
        let (args, port) = with_metrics(&["--config", sc.cfg()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let proc = sc.beat_with_env(label, &args, vars);
        let pid = proc.pid() as u64;
        Self { proc, port, pid }
    }

    fn metric(&self, name: &str) -> Option<f64> {
        metric(self.port, name)
    }

    /// Its `/metrics` say it stands by.
    fn stands_by(&self) -> bool {
        self.metric(IS_LEADER) == Some(0.0)
    }
}

/// The processes of `beats`, for failure reports.
fn procs<'a>(beats: &[&'a Beat]) -> Vec<&'a Proc> {
    beats.iter().map(|b| &b.proc).collect()
}

/// Waits until `condition`, or panics with `what` and `beats`' log tails.
fn wait_beats(within: Duration, beats: &[&Beat], what: impl Display, cond: impl FnMut() -> bool) {
    wait_for(within, &procs(beats), what, cond);
}

/// Waits until `beats[0]` (epoch `epoch`) has published at least `n` messages while
/// `beats[1]` stands by.
fn leads_beside_a_standby(snoop: &Snoop, beats: &[Beat], epoch: u64, n: usize) {
    let (leader, standby) = (&beats[0], &beats[1]);
    let what = "the leader publishes, the other stands by";
    wait_beats(WAIT, &[leader], what, || {
        of_epoch(snoop, epoch).len() >= n && standby.stands_by()
    });
}

/// Stops `beats` (SIGTERM), each of which must exit cleanly.
fn stop_beats<'a>(beats: impl IntoIterator<Item = &'a mut Beat>) {
    stop(&mut beats.into_iter().map(|b| &mut b.proc).collect::<Vec<_>>());
}

/// Waits until epoch `epoch` has published at least `n` messages.
fn published(snoop: &Snoop, epoch: u64, n: usize, beats: &[&Beat]) {
    let what = || format!("epoch {epoch} published {}", of_epoch(snoop, epoch).len());
    check(
        wait_until(WAIT, || of_epoch(snoop, epoch).len() >= n),
        &procs(beats),
        what(),
    );
}

/// Waits for a lease with an epoch above `above` (0: any lease).
fn wait_leader(sc: &Scenario, above: u64, within: Duration, beats: &[&Beat]) -> Leader {
    let mut found = None;
    wait_until(within, || {
        found = leader(sc).filter(|l| l.epoch > above);
        found.is_some()
    });
    let what = format!("no leader with an epoch above {above} within {within:?}");
    check(found.is_some(), &procs(beats), what);
    found.expect("checked")
}

/// Two beats, once one leads: (the beats, its lease, the leader's index, the other's).
fn two_beats(sc: &Scenario) -> (Vec<Beat>, Leader, usize, usize) {
    let beats = vec![
        Beat::start(sc, "beat-1", &[]),
        Beat::start(sc, "beat-2", &[]),
    ];
    let first = wait_leader(sc, 0, WAIT, &beats.iter().collect::<Vec<_>>());
    let old = holder(&beats, first);
    (beats, first, old, 1 - old)
}

/// A first beat started alone (so it leads, with `vars`), then a standby: (the beats, the lease).
fn leader_then_standby(sc: &Scenario, label: &str, vars: &[(&str, &str)]) -> (Vec<Beat>, Leader) {
    let first = Beat::start(sc, label, vars);
    let lease = wait_leader(sc, 0, WAIT, &[&first]);
    assert_eq!(lease.pid, first.pid);
    (vec![first, Beat::start(sc, "beat-standby", &[])], lease)
}

/// The beat holding `lease`.
fn holder(beats: &[Beat], lease: Leader) -> usize {
    beats
        .iter()
        .position(|b| b.pid == lease.pid)
        .unwrap_or_else(|| panic!("the lease names pid {}, not one of our beats", lease.pid))
}

/// Asserts for 4 s, every 200 ms, that `beat` stands by.
fn stays_standby(beat: &Beat, what: &str) {
    let quiet_until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < quiet_until {
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(beat.metric(IS_LEADER), Some(0.0), "{what}");
    }
}

/// Another holder's lease (a foreign token, epoch `epoch`, a TTL that outlasts the test), set
/// atomically with a read of the progress: (the lease's text, the progress then).
fn steal_lease(sc: &Scenario, epoch: u64) -> (String, DateTime<Utc>) {
    let thief = serde_json::json!({
        "host": "elsewhere", "pid": 1, "epoch": epoch,
        "since": Utc::now().to_rfc3339(), "token": "not-the-beats"
    })
    .to_string();
    let (at_steal,): (Option<String>,) = redis::pipe()
        .atomic()
        .cmd("SET")
        .arg(sc.names().beat_leader())
        .arg(&thief)
        .arg("PX")
        .arg(60_000)
        .ignore()
        .cmd("GET")
        .arg(sc.names().beat_last("tick"))
        .query(&mut redis_sync())
        .expect("steal the lease");
    (
        thief,
        parse_instant(&at_steal.expect("progress before the steal")),
    )
}

/// `{ns}:beat:leader` as stored.
fn lease_text(sc: &Scenario) -> Option<String> {
    let lease = sc.names().beat_leader();
    redis::cmd("GET")
        .arg(lease)
        .query(&mut redis_sync())
        .expect("GET lease")
}

/// Snooped messages with epoch `epoch`.
fn of_epoch(snoop: &Snoop, epoch: u64) -> Vec<Snooped> {
    snoop
        .messages()
        .into_iter()
        .filter(|m| m.epoch == Some(epoch as i64))
        .collect()
}

/// When each of `copies` was decided (`published_at`, the beat's wall clock).
fn decided(copies: &[Snooped]) -> impl Iterator<Item = DateTime<Utc>> + '_ {
    copies.iter().map(|m| m.envelope.published_at)
}

/// Epoch `epoch`'s copies decided (`published_at`, the beat's wall clock) after `t`:
/// (key, decided, arrived).
fn decided_after(
    snoop: &Snoop,
    epoch: u64,
    t: DateTime<Utc>,
) -> Vec<(String, DateTime<Utc>, DateTime<Utc>)> {
    copies(snoop, epoch, |m| m.envelope.published_at > t)
}

/// Epoch `epoch`'s copies that reached the snoop queue after `at`: (key, decided, arrived).
fn arrived_after(
    snoop: &Snoop,
    epoch: u64,
    at: Instant,
) -> Vec<(String, DateTime<Utc>, DateTime<Utc>)> {
    copies(snoop, epoch, |m| m.arrived_at > at)
}

fn copies(
    snoop: &Snoop,
    epoch: u64,
    which: impl Fn(&Snooped) -> bool,
) -> Vec<(String, DateTime<Utc>, DateTime<Utc>)> {
    of_epoch(snoop, epoch)
        .into_iter()
        .filter(|m| which(m))
        .map(|m| (m.envelope.key, m.envelope.published_at, m.arrived))
        .collect()
}

/// Old leader's last publish → new leader's first (arrival times on the snoop queue).
fn failover(snoop: &Snoop, old: u64, new: u64) -> Duration {
    let last_old = of_epoch(snoop, old)
        .iter()
        .map(|m| m.arrived_at)
        .max()
        .expect("the old leader published");
    let first_new = of_epoch(snoop, new)
        .iter()
        .map(|m| m.arrived_at)
        .min()
        .expect("the new leader published");
    first_new.saturating_duration_since(last_old)
}

/// Stops the workers once every snooped instance has run, then checks that every instant of
/// the window ran exactly once (and that what ran is what was published).
fn settle_and_check(sc: &mut Scenario, snoop: &Snoop, at_least: usize) {
    let published: BTreeSet<String> = snoop
        .messages()
        .into_iter()
        .map(|m| m.envelope.key)
        .collect();
    let all_ran = wait_until(WAIT, || {
        let ran: BTreeSet<String> = sc.lines("effects").into_iter().collect();
        published.is_subset(&ran)
    });
    sc.stop();
    let lines = sc.lines("effects");
    let ran: BTreeSet<String> = lines.iter().cloned().collect();
    assert!(
        all_ran,
        "published but never ran: {:?}",
        published.difference(&ran).collect::<Vec<_>>()
    );
    assert_eq!(ran, published, "what ran is what was published");
    assert_contiguous_exactly_once(&lines, at_least);
    // Every copy carries the epoch of a leader.
    let unfenced: Vec<_> = snoop
        .messages()
        .into_iter()
        .filter(|m| m.epoch.is_none_or(|e| e < 1))
        .map(|m| (m.envelope.key, m.epoch))
        .collect();
    assert!(
        unfenced.is_empty(),
        "messages without a leader epoch: {unfenced:?}"
    );
}

/// Samples something every `every` on its own thread until dropped.
struct Sampler<T: Send + 'static> {
    samples: Arc<Mutex<Vec<T>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl<T: Send + Clone + 'static> Sampler<T> {
    fn start(every: Duration, mut sample: impl FnMut() -> Option<T> + Send + 'static) -> Self {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (sink, stopped) = (samples.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                if let Some(s) = sample() {
                    sink.lock().expect("sampler lock").push(s);
                }
                std::thread::sleep(every);
            }
        });
        Self {
            samples,
            stop,
            thread: Some(thread),
        }
    }

    /// Stops sampling: everything sampled.
    fn finish(self) -> Vec<T> {
        let samples = self.samples.lock().expect("sampler lock").clone();
        drop(self);
        samples
    }
}

impl<T: Send + 'static> Drop for Sampler<T> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One reading of the job's progress `{ns}:beat:last:tick` and Redis `TIME`, in one round trip
/// (the progress is read first, so it is no newer than the time).
#[derive(Debug, Clone)]
struct ProgressSample {
    last: Option<DateTime<Utc>>,
    redis_time: DateTime<Utc>,
}

fn progress_sampler(sc: &Scenario) -> Sampler<ProgressSample> {
    let key = sc.names().beat_last("tick");
    let mut redis = redis_sync();
    Sampler::start(Duration::from_millis(50), move || {
        let (last, (secs, micros)): (Option<String>, (i64, i64)) = redis::pipe()
            .cmd("GET")
            .arg(&key)
            .cmd("TIME")
            .query(&mut redis)
            .ok()?;
        Some(ProgressSample {
            last: last.as_deref().map(parse_instant),
            redis_time: DateTime::from_timestamp(secs, (micros * 1000) as u32).expect("redis TIME"),
        })
    })
}

/// Progress never moves backwards, over more than `at_least` samples.
fn assert_progress_monotonic(samples: &[ProgressSample], at_least: usize) {
    assert!(
        samples.len() > at_least,
        "{} progress samples",
        samples.len()
    );
    let values: Vec<DateTime<Utc>> = samples.iter().filter_map(|s| s.last).collect();
    for pair in values.windows(2) {
        assert!(
            pair[1] >= pair[0],
            "progress went backwards: {} then {}",
            pair[0],
            pair[1]
        );
    }
}

/// Environment variables as `(&str, &str)` pairs.
fn vars<'a>(owned: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    owned.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn kill9_the_leader_twice_every_instant_runs_exactly_once() {
    let (mut sc, snoop) = scenario("lead_kill9", &[("leader_lease", "\"3s\"")], 2).await;
    let mut beats: Vec<Beat> = (1..=3)
        .map(|i| Beat::start(&sc, &format!("beat-{i}"), &[]))
        .collect();
    let window = Instant::now();
    let mut leases = vec![wait_leader(&sc, 0, WAIT, &beats.iter().collect::<Vec<_>>())];
    let mut kills = Vec::new();
    for round in 0..2 {
        let current = *leases.last().expect("a lease");
        // Let the current leader publish a while (8 instances, caught-up ones included).
        let i = holder(&beats, current);
        published(&snoop, current.epoch, 8, &[&beats[i]]);
        kills.push(Instant::now());
        beats[i].proc.kill9();
        let alive: Vec<&Beat> = beats.iter().filter(|b| b.pid != current.pid).collect();
        let next = wait_leader(&sc, current.epoch, Duration::from_secs(20), &alive);
        assert_ne!(
            next.pid, current.pid,
            "round {round}: a killed beat cannot lead"
        );
        holder(&beats, next);
        leases.push(next);
    }
    let last = *leases.last().expect("a lease");
    let survivor = holder(&beats, last);
    let s = &beats[survivor];
    // The last leader leads visibly and publishes until the window spans at least 30 s.
    let what = format!(
        "the survivor's metrics do not show it leading with epoch {}",
        last.epoch
    );
    wait_beats(Duration::from_secs(10), &[s], what, || {
        s.metric(IS_LEADER) == Some(1.0) && s.metric(LEADER_EPOCH) == Some(last.epoch as f64)
    });
    wait_beats(WAIT, &[s], "a 32 s window", || {
        let keys: BTreeSet<String> = sc.lines("effects").into_iter().collect();
        let instants: Vec<DateTime<Utc>> = keys.iter().map(|k| instant_of(k)).collect();
        match (instants.first(), instants.last()) {
            (Some(a), Some(b)) => {
                (*b - *a).num_seconds() >= 32 && of_epoch(&snoop, last.epoch).len() >= 3
            }
            _ => false,
        }
    });
    stop_beats([&mut beats[survivor]]);
    println!("kill -9 window: {:?}", window.elapsed());
    for (pair, killed_at) in leases.windows(2).zip(&kills) {
        let (old, new) = (pair[0].epoch, pair[1].epoch);
        let first_new = of_epoch(&snoop, new).iter().map(|m| m.arrived_at).min();
        println!(
            "kill -9 failover epoch {old} -> {new}: old leader's last publish -> new leader's \
             first {:?} (kill -> new leader's first publish {:?}); new leader published {}",
            failover(&snoop, old, new),
            first_new
                .expect("the new leader published")
                .saturating_duration_since(*killed_at),
            of_epoch(&snoop, new).len()
        );
    }
    settle_and_check(&mut sc, &snoop, 30);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_leader_stopped_past_its_lease_publishes_nothing_it_decides_after_resuming() {
    let (mut sc, snoop) = scenario("lead_sigstop", &[("leader_lease", "\"3s\"")], 2).await;
    let (mut beats, first, old, new) = two_beats(&sc);
    let (o, n) = (&beats[old], &beats[new]);
    wait_beats(WAIT, &[o], "the first leader leads", || {
        of_epoch(&snoop, first.epoch).len() >= 5 && o.metric(IS_LEADER) == Some(1.0)
    });
    let sampler = progress_sampler(&sc);

    o.proc.signal(libc::SIGSTOP);
    // `kill` has returned: the process is stopped. Anything it decided later than this (plus
    // a little, for the signal reaching every thread) was decided after resuming.
    let (stopped, stopped_at) = (Utc::now(), Instant::now());
    let second = wait_leader(&sc, first.epoch, Duration::from_secs(20), &[n]);
    assert_eq!(second.pid, n.pid, "the standby took over");
    let took_over = stopped_at.elapsed();
    // Keep the old leader stopped past its whole lease (3 s) and its renewal deadlines, until
    // the new one has published a few instances.
    wait_beats(WAIT, &[n], "the new leader publishes", || {
        of_epoch(&snoop, second.epoch).len() >= 3 && stopped_at.elapsed() >= 5 * SECOND
    });
    let stop_length = stopped_at.elapsed();
    o.proc.signal(libc::SIGCONT);
    let resumed_at = Instant::now();

    // The resumed beat finds it lost the lease: standby again, and it stays one.
    let what = "the resumed beat still leads";
    wait_beats(10 * SECOND, &[o], what, || o.stands_by());
    let stepped_down = resumed_at.elapsed();
    let old_published = o.metric(PUBLISHED).expect("published_total");
    let more = of_epoch(&snoop, second.epoch).len() + 5;
    published(&snoop, second.epoch, more, &[n]);
    let kept = o.metric(PUBLISHED);
    assert_eq!(
        kept,
        Some(old_published),
        "the deposed leader kept publishing"
    );
    assert_eq!(o.metric(IS_LEADER), Some(0.0));
    assert_eq!(leader(&sc), Some(second), "the new leader keeps its lease");
    stop_beats(&mut beats);
    let samples = sampler.finish();

    println!(
        "SIGSTOP: standby led {took_over:?} after the stop (lease 3 s); old leader stopped for \
         {stop_length:?}; stepped down within {stepped_down:?} after SIGCONT; old leader's last \
         publish -> new leader's first {:?}",
        failover(&snoop, first.epoch, second.epoch)
    );
    // Nothing the old leader decided after the stop was published: every copy with its epoch
    // was decided (published_at, its own wall clock = the test's) before the stop.
    let allowance = chrono::Duration::milliseconds(20);
    let late = decided_after(&snoop, first.epoch, stopped + allowance);
    let what = format!("the deposed leader published what it decided after the stop at {stopped}");
    assert!(late.is_empty(), "{what}: {late:?}");
    let after_stop = arrived_after(&snoop, first.epoch, stopped_at).len();
    println!("SIGSTOP: {after_stop} old-epoch copies arrived after the stop (decided before)");
    // What was handed to the broker before the stop reaches it while the process is stopped
    // (the kernel sends it); a copy of the old epoch arriving after SIGCONT, seconds later, was
    // handed over after resuming, before the beat checked its lease.
    let after_resume = arrived_after(&snoop, first.epoch, resumed_at);
    let what = "the deposed leader handed these to the broker after resuming";
    assert!(after_resume.is_empty(), "{what}: {after_resume:?}");
    // Progress: never backwards (a deposed leader writing its stale instant would move it
    // back), and in the end exactly the newest instant published.
    assert_progress_monotonic(&samples, 20);
    let newest = snoop
        .messages()
        .into_iter()
        .map(|m| m.envelope.scheduled_for);
    let newest = newest.max().expect("messages");
    let what = "the progress is the newest instant published";
    assert_eq!(progress(&sc, "tick"), Some(newest), "{what}");
    settle_and_check(&mut sc, &snoop, 10);
}

// See: issues/16 (item 7)
/// A leader's host suspended past its lease, played by [`Suspender`]: SIGSTOP, then SIGCONT with
/// the beat's `CLOCK_MONOTONIC` held back by the stop, so that after resuming its monotonic
/// clock says almost no time passed while its boot clock and wall clock say seconds did. A
/// standby leads meanwhile. The resumed beat's Redis connections are closed and Redis refuses
/// new ones (as after a suspend long enough to break them), so every call fails at once and
/// what it does next it decides on its own clocks: it must find its publish window over and
/// hand nothing to the broker under its old epoch.
#[tokio::test(flavor = "multi_thread")]
async fn a_leader_resumed_from_a_host_suspend_publishes_nothing_on_its_lapsed_lease() {
    let (mut sc, snoop) = scenario("lead_suspend", &[("leader_lease", "\"3s\"")], 1).await;
    let proxy = Proxy::start("127.0.0.1:6379".parse().expect("addr"));
    let suspender = Suspender::new(&sc.dir);
    let mut env = suspender.env();
    env.push(("DRUMLINE_REDIS_URL", proxy.redis_url()));
    let (mut beats, first) = leader_then_standby(&sc, "beat-suspended", &vars(&env));
    leads_beside_a_standby(&snoop, &beats, first.epoch, 3);

    // Suspended just after a renewal landed, with its whole window (2 s) ahead by its clocks.
    let mut redis = redis_sync();
    let mut pttl = || -> i64 {
        let leader = sc.names().beat_leader();
        redis::cmd("PTTL")
            .arg(leader)
            .query(&mut redis)
            .expect("PTTL")
    };
    let renewed = wait_until_fine(WAIT, || (2800..2950).contains(&pttl()));
    assert!(renewed, "the lease is not renewed");
    let asleep = suspender.suspend(beats[0].pid as i32);
    // Stopped: whatever it decides later than this (its wall clock is the test's), it decided
    // after resuming.
    let suspended = Utc::now();
    let second = wait_leader(&sc, first.epoch, Duration::from_secs(20), &[&beats[1]]);
    assert_eq!(second.pid, beats[1].pid, "the standby took over");
    published(&snoop, second.epoch, 2, &[&beats[1]]);
    drop(proxy);
    let slept = asleep.resume();
    let resumed_at = Instant::now();
    // It stands by, and hands nothing to the broker for longer than its window (2 s) as its
    // monotonic clock would count it from its last renewal.
    let stood_by = wait_until(Duration::from_secs(5), || beats[0].stands_by());
    std::thread::sleep(
        (resumed_at + Duration::from_secs(4)).saturating_duration_since(Instant::now()),
    );
    let log = beats[0].proc.log_tail(20);
    stop_beats(&mut beats);
    let after_resume: Vec<_> = snoop
        .settle()
        .into_iter()
        .filter(|m| m.epoch == Some(first.epoch as i64) && m.envelope.published_at > suspended)
        .map(|m| m.envelope.key)
        .collect();
    println!(
        "suspend: the leader slept {slept:?} (lease 3 s); after resuming it published {} \
         copies under its old epoch",
        after_resume.len()
    );
    assert!(
        after_resume.is_empty(),
        "the resumed leader published on its lapsed lease (it slept {slept:?}, lease 3 s): \
         {after_resume:?}\n{log}"
    );
    assert!(stood_by, "the resumed leader still says it leads\n{log}");
    settle_and_check(&mut sc, &snoop, 6);
}

/// Polls `condition` every 5 ms until it holds or `within` passes.
fn wait_until_fine(within: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while !condition() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_hands_leadership_over_within_a_third_of_the_lease() {
    // A 6 s lease: standbys try every 2 s, so a release is taken within 2 s; waiting out the
    // lease would take up to 6 s.
    let lease_len = Duration::from_secs(6);
    let (mut sc, snoop) = scenario("lead_sigterm", &[("leader_lease", "\"6s\"")], 1).await;
    let (mut beats, first, old, new) = two_beats(&sc);
    wait_beats(
        WAIT,
        &[&beats[old], &beats[new]],
        "one leads, one stands by",
        || of_epoch(&snoop, first.epoch).len() >= 4 && beats[new].stands_by(),
    );
    let healthz = |b: &Beat| {
        let (status, body) = http_get(b.port, "/healthz").expect("healthz");
        (status, body.trim().to_owned())
    };
    assert_eq!(healthz(&beats[new]), (200, "standby".to_owned()));
    assert_eq!(healthz(&beats[old]), (200, "ok".to_owned()));
    assert_eq!(beats[old].metric(LEADER_EPOCH), Some(first.epoch as f64));
    // `status --json` names the leader.
    let status = sc.status_json();
    let leader_of = &status["leader"];
    assert_eq!(leader_of["pid"].as_u64(), Some(first.pid), "{status}");
    assert_eq!(leader_of["epoch"].as_u64(), Some(first.epoch), "{status}");
    assert!(
        leader_of["host"].is_string() && leader_of["since"].is_string(),
        "{status}"
    );

    // A standby's clean stop releases nothing: the lease is compared by token.
    let mut extra = Beat::start(&sc, "beat-3", &[]);
    wait_beats(WAIT, &[&extra], "the third beat stands by", || {
        extra.stands_by()
    });
    stop_beats([&mut extra]);
    assert_eq!(
        leader(&sc),
        Some(first),
        "a standby's stop touched the lease"
    );

    let term_at = Instant::now();
    beats[old].proc.signal(libc::SIGTERM);
    let exited = wait_until_fine(Duration::from_secs(10), || !beats[old].proc.is_running());
    check(
        exited,
        &[&beats[old].proc],
        "the leader did not exit within 10 s",
    );
    let exited_at = Instant::now();
    let status = beats[old].proc.wait(Duration::from_secs(1));
    check(status.success(), &[&beats[old].proc], status);
    let mut second = None;
    wait_until_fine(Duration::from_secs(15), || {
        second = leader(&sc).filter(|l| l.epoch > first.epoch);
        second.is_some()
    });
    let handover = exited_at.elapsed();
    let second = second.expect("no new leader within 15 s");
    assert_eq!(second.pid, beats[new].pid);
    let since_term = term_at.elapsed();
    println!("SIGTERM: new leader {handover:?} after the old one exited ({since_term:?} after SIGTERM; lease {lease_len:?})");
    wait_beats(
        Duration::from_secs(5),
        &[&beats[new]],
        "the new leader's metrics",
        || beats[new].metric(IS_LEADER) == Some(1.0),
    );
    let allowed = lease_len / 3 + Duration::from_millis(500);
    assert!(
        handover <= allowed,
        "the standby took {handover:?} to lead after a clean stop (allowed {allowed:?}: one try)"
    );
    published(&snoop, second.epoch, 3, &[&beats[new]]);
    let failover = failover(&snoop, first.epoch, second.epoch);
    println!("SIGTERM: old leader's last publish -> new leader's first {failover:?}");
    stop_beats([&mut beats[new]]);
    settle_and_check(&mut sc, &snoop, 6);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_beat_an_hour_ahead_neither_publishes_early_nor_loses_instances() {
    let threshold = chrono::Duration::seconds(2);
    let (mut sc, snoop) = scenario("lead_faketime", &SKEWED, 2).await;
    let progress = progress_sampler(&sc);
    let ahead = faketime_ahead("+1h");
    let ahead = vars(&ahead);

    // 1. The fast beat starts alone, so it leads from the job's very first start.
    let mut beats = vec![Beat::start(&sc, "beat-fast-1", &ahead)];
    let fast1 = wait_leader(&sc, 0, WAIT, &[&beats[0]]);
    assert_eq!(fast1.pid, beats[0].pid);
    beats.push(Beat::start(&sc, "beat-normal", &[]));
    published(&snoop, fast1.epoch, 6, &[&beats[0]]);
    // 2. It stops; the normal beat resumes from the progress the fast one recorded.
    stop_beats([&mut beats[0]]);
    let normal = wait_leader(&sc, fast1.epoch, Duration::from_secs(20), &[&beats[1]]);
    assert_eq!(normal.pid, beats[1].pid);
    beats.push(Beat::start(&sc, "beat-fast-2", &ahead));
    published(&snoop, normal.epoch, 6, &[&beats[1]]);
    // 3. The normal leader dies; the fast standby takes over from its progress.
    beats[1].proc.kill9();
    let fast2 = wait_leader(&sc, normal.epoch, Duration::from_secs(20), &[&beats[2]]);
    assert_eq!(fast2.pid, beats[2].pid);
    published(&snoop, fast2.epoch, 6, &[&beats[2]]);
    stop_beats([&mut beats[2]]);
    let samples = progress.finish();

    // No instance published early: none arrived more than misfire_threshold before its
    // instant (by the test's clock, which is Redis's: same host).
    let messages = snoop.messages();
    let earliest = messages
        .iter()
        .map(|m| m.envelope.scheduled_for - m.arrived)
        .max();
    println!(
        "faketime: {} messages; the earliest arrived {} ms before its instant (threshold {} ms)",
        messages.len(),
        earliest.expect("messages").num_milliseconds(),
        threshold.num_milliseconds()
    );
    let early: Vec<_> = messages
        .iter()
        .filter(|m| m.envelope.scheduled_for > m.arrived + threshold)
        .map(|m| (m.envelope.key.clone(), m.epoch, m.arrived))
        .collect();
    assert!(early.is_empty(), "published early: {early:?}");
    // Progress never ahead of Redis TIME by more than the threshold. Each sample reads the
    // progress before TIME in one round trip, so a write checked against Redis's own clock
    // (as it must be) can never exceed this bound: no slack.
    assert_progress_monotonic(&samples, 100);
    let most_ahead = samples
        .iter()
        .filter_map(|s| Some(s.last? - s.redis_time))
        .max();
    println!(
        "faketime: progress at most {} ms ahead of Redis TIME ({} samples)",
        most_ahead.expect("progress samples").num_milliseconds(),
        samples.len()
    );
    let ahead_of_time: Vec<_> = samples
        .iter()
        .filter(|s| s.last.is_some_and(|l| l > s.redis_time + threshold))
        .take(5)
        .collect();
    assert!(
        ahead_of_time.is_empty(),
        "progress more than {threshold} ahead of Redis TIME: {ahead_of_time:?}"
    );
    let per_leader: Vec<usize> = [fast1, normal, fast2]
        .iter()
        .map(|l| of_epoch(&snoop, l.epoch).len())
        .collect();
    println!("faketime: published per leader (fast, normal, fast): {per_leader:?}");
    settle_and_check(&mut sc, &snoop, 15);
}

/// A leader whose clock runs an hour *behind* Redis's still publishes — at most about the
/// threshold late — instead of holding the lease and publishing nothing for an hour.
#[tokio::test(flavor = "multi_thread")]
async fn a_leader_an_hour_behind_publishes_at_most_the_threshold_late() {
    let threshold = chrono::Duration::seconds(2);
    let (mut sc, snoop) = scenario("lead_behind", &SKEWED, 1).await;
    let behind = faketime_ahead("-1h");
    let mut beat = Beat::start(&sc, "beat-slow", &vars(&behind));
    let lease = wait_leader(&sc, 0, WAIT, &[&beat]);
    published(&snoop, lease.epoch, 6, &[&beat]);
    stop_beats([&mut beat]);
    let latest = snoop
        .messages()
        .iter()
        .map(|m| m.arrived - m.envelope.scheduled_for)
        .max();
    let latest = latest.expect("messages");
    println!(
        "behind: the latest message arrived {} ms after its instant (threshold {} ms)",
        latest.num_milliseconds(),
        threshold.num_milliseconds()
    );
    // Bounded by the threshold plus scheduling noise; an hour is what this guards against.
    assert!(latest < threshold * 10, "published {latest} late");
    settle_and_check(&mut sc, &snoop, 6);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_leader_whose_lease_is_taken_moves_no_progress_and_steps_down() {
    let (mut sc, snoop) = scenario("lead_stolen", &[("leader_lease", "\"3s\"")], 1).await;
    let mut beat = Beat::start(&sc, "beat", &[]);
    let first = wait_leader(&sc, 0, WAIT, &[&beat]);
    published(&snoop, first.epoch, 4, &[&beat]);

    let (thief, at_steal) = steal_lease(&sc, first.epoch + 100);
    let (stolen, stolen_at) = (Utc::now(), Instant::now());
    let progress = progress_sampler(&sc);

    // It notices at its next renewal (within lease/3) and stands by.
    let what = "the beat still leads under a foreign lease";
    wait_beats(Duration::from_secs(5), &[&beat], what, || beat.stands_by());
    let stepped_down = stolen_at.elapsed();
    let published_then = snoop.messages().len();
    // Standing by for a while: it neither takes the foreign lease nor publishes.
    stays_standby(&beat, "the beat leads under a foreign lease");
    assert_eq!(
        snoop.messages().len(),
        published_then,
        "the standby published"
    );
    let held = lease_text(&sc);
    assert_eq!(
        held.as_deref(),
        Some(thief.as_str()),
        "the foreign lease was touched"
    );
    let frozen = progress.finish();

    // Under the foreign lease no progress moved, whatever the beat still published.
    assert!(frozen.len() > 20, "{} samples", frozen.len());
    let moved: Vec<_> = frozen
        .iter()
        .filter(|s| s.last != Some(at_steal))
        .take(3)
        .collect();
    assert!(
        moved.is_empty(),
        "progress moved from {at_steal} under a lease the beat does not hold: {moved:?}"
    );
    let late = decided_after(&snoop, first.epoch, stolen + chrono::Duration::seconds(2));
    let what = "published after lease − lease/3 without a renewal";
    assert!(late.is_empty(), "{what}: {late:?}");
    let after_steal = arrived_after(&snoop, first.epoch, stolen_at).len();
    println!(
        "stolen lease: stepped down {stepped_down:?} after the steal; {after_steal} messages \
         published after it (their progress fenced)"
    );

    // The foreign lease goes away: the beat leads again under a new epoch and resumes from the
    // fenced progress, so nothing is missed (what it published unrecorded comes again).
    let _: () = redis::cmd("DEL")
        .arg(sc.names().beat_leader())
        .query(&mut redis_sync())
        .expect("DEL");
    let second = wait_leader(&sc, first.epoch, Duration::from_secs(5), &[&beat]);
    assert_eq!(second.pid, beat.pid);
    assert!(
        second.epoch < first.epoch + 100,
        "epochs come from the counter"
    );
    published(&snoop, second.epoch, 4, &[&beat]);
    stop_beats([&mut beat]);
    let republished: BTreeSet<String> = of_epoch(&snoop, second.epoch)
        .into_iter()
        .map(|m| m.envelope.key)
        .collect();
    let again = of_epoch(&snoop, first.epoch)
        .iter()
        .filter(|m| republished.contains(&m.envelope.key))
        .count();
    println!("stolen lease: {again} instances published again by the new term");
    settle_and_check(&mut sc, &snoop, 8);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_leader_cut_off_from_redis_stops_publishing_before_a_standby_takes_over() {
    let (mut sc, snoop) = scenario("lead_partition", &[("leader_lease", "\"3s\"")], 1).await;
    // The first beat reaches Redis through a proxy the test can cut; it starts alone, so it
    // leads. The broker stays reachable: a leader partitioned from Redis only.
    let proxy = Proxy::start("127.0.0.1:6379".parse().expect("addr"));
    let via_proxy = [("DRUMLINE_REDIS_URL", proxy.redis_url())];
    let (mut beats, first) = leader_then_standby(&sc, "beat-cut", &vars(&via_proxy));
    leads_beside_a_standby(&snoop, &beats, first.epoch, 4);

    proxy.set(Fault::Blackhole);
    let (cut, cut_at) = (Utc::now(), Instant::now());
    let second = wait_leader(&sc, first.epoch, Duration::from_secs(20), &[&beats[1]]);
    assert_eq!(second.pid, beats[1].pid);
    let took_over = cut_at.elapsed();
    published(&snoop, second.epoch, 4, &[&beats[1]]);
    // The cut-off beat knows it does not lead (it cannot renew), while still cut off.
    let standby_while_cut = wait_until(Duration::from_secs(5), || beats[0].stands_by());
    let cut_for = cut_at.elapsed();
    let cut_log = beats[0].proc.log_tail(20);
    let cut_view = format!(
        "cut-off beat: is_leader {:?}, /healthz {:?}; new leader: is_leader {:?}",
        beats[0].metric(IS_LEADER),
        http_get(beats[0].port, "/healthz"),
        beats[1].metric(IS_LEADER)
    );

    // Healed: what the cut-off beat sent meanwhile reaches Redis now, and is refused.
    proxy.set(Fault::Pass);
    let healed_at = Instant::now();
    let old_published = beats[0].metric(PUBLISHED);
    stays_standby(&beats[0], "the healed beat leads");
    assert_eq!(beats[0].metric(PUBLISHED), old_published);
    assert_eq!(leader(&sc), Some(second));
    stop_beats(&mut beats);

    // The two terms do not overlap: the old leader decided its last message before the new one
    // decided its first, and within lease − lease/3 of the cut (its last renewal was before).
    let old = of_epoch(&snoop, first.epoch);
    let old_last = decided(&old).max().expect("old");
    let new_first = decided(&of_epoch(&snoop, second.epoch)).min().expect("new");
    println!(
        "Redis cut: standby led {took_over:?} after the cut; old term's last decision {} ms after \
         the cut, new term's first {} ms after it",
        (old_last - cut).num_milliseconds(),
        (new_first - cut).num_milliseconds()
    );
    assert!(
        old_last < new_first,
        "the terms overlap: old leader published at {old_last}, new one from {new_first}"
    );
    assert!(
        old_last <= cut + chrono::Duration::seconds(2),
        "the cut-off leader published {old_last}, more than lease − lease/3 after the cut {cut}"
    );
    let after_heal = old.iter().filter(|m| m.arrived_at > healed_at).count();
    assert_eq!(after_heal, 0, "old-epoch messages arrived after the heal");
    settle_and_check(&mut sc, &snoop, 8);
    assert!(
        standby_while_cut,
        "a beat cut off from Redis for {cut_for:?} (lease 3 s; it stopped publishing after \
         2 s) still says it leads: {cut_view}\n{cut_log}"
    );
}
