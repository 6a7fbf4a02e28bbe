//! Leadership (docs/design.md, issue 8): start several beats, one leads; a dead, stopped, paused or
//! clock-skewed leader is replaced without missing or doubling an instance. Real beats and
//! workers, real RabbitMQ and Redis. A "snoop" queue bound like the work queue sees every
//! message with its `x-drumline-epoch` and its arrival time; effects are the keys the task
//! appends (one line per execution); leadership is read from Redis `{ns}:beat:leader` and the
//! beats' metrics.

use chrono::{DateTime, Utc};
use drumline_e2e::proxy::{Fault, Proxy};
use drumline_e2e::snoop::{Snoop, Snooped};
use drumline_e2e::suspend::Suspender;
use drumline_e2e::{
    assert_contiguous_exactly_once, faketime_ahead, instant_of, metric, setup, wait_until,
    with_metrics, Proc, TestEnv, REDIS_URL,
};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);
const IS_LEADER: &str = "drumline_beat_is_leader";
const LEADER_EPOCH: &str = "drumline_beat_leader_epoch";
const PUBLISHED: &str = r#"drumline_beat_published_total{job="tick"}"#;

/// A 1 s `catch_up` job whose task appends its key to `effects`; `beat` is the `[beat]` body.
fn config(env: &TestEnv, beat: &str) -> String {
    let path = env.config(
        "drumline.toml",
        &format!(
            r#"
[beat]
{beat}

[worker]
concurrency = 4
lease = "3s"
shutdown_grace = "10s"

[[jobs]]
name = "tick"
task = "append"
every = "1s"
misfire = "catch_up"
overlap = "allow"

[tasks.append]
command = {}
"#,
            env.append_key_command("effects", 0.0)
        ),
    );
    path.to_str().expect("utf-8 path").to_owned()
}

/// A beat with its metrics port and its pid (kept after it exits).
struct Beat {
    proc: Proc,
    port: u16,
    pid: u64,
}

impl Beat {
    fn start(env: &TestEnv, label: &str, cfg: &str, vars: &[(&str, &str)]) -> Self {
        let (args, port) = with_metrics(&["--config", cfg]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let proc = env.beat_with_env(label, &args, vars);
        let pid = proc.pid() as u64;
        Self { proc, port, pid }
    }

    fn metric(&self, name: &str) -> Option<f64> {
        metric(self.port, name)
    }
}

/// Starts `n` workers and waits for the topology.
async fn workers(env: &TestEnv, cfg: &str, n: usize) -> Vec<Proc> {
    let workers: Vec<Proc> = (1..=n)
        .map(|i| env.worker(&format!("worker-{i}"), &["--config", cfg]))
        .collect();
    env.wait_for_topology(&workers[0]).await;
    workers
}

fn redis_sync() -> redis::Connection {
    redis::Client::open(REDIS_URL)
        .expect("redis url")
        .get_connection()
        .expect("redis connection")
}

/// What `{ns}:beat:leader` names.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Lease {
    pid: u64,
    epoch: u64,
}

fn lease(env: &TestEnv, redis: &mut redis::Connection) -> Option<Lease> {
    let text: Option<String> = redis::cmd("GET")
        .arg(env.names().beat_leader())
        .query(redis)
        .expect("redis GET");
    let value: serde_json::Value = serde_json::from_str(&text?).ok()?;
    Some(Lease {
        pid: value["pid"].as_u64()?,
        epoch: value["epoch"].as_u64()?,
    })
}

/// Waits for a lease with an epoch above `above` (0: any lease).
fn wait_leader(env: &TestEnv, above: u64, within: Duration, beats: &[&Beat]) -> Lease {
    let mut redis = redis_sync();
    let mut found = None;
    wait_until(within, || {
        found = lease(env, &mut redis).filter(|l| l.epoch > above);
        found.is_some()
    });
    found.unwrap_or_else(|| {
        panic!(
            "no leader with an epoch above {above} within {within:?}\n{}",
            beats
                .iter()
                .map(|b| b.proc.log_tail(15))
                .collect::<Vec<_>>()
                .join("\n")
        )
    })
}

/// The beat holding `lease`.
/// Two beats on `cfg`, once one leads: (the beats, its lease, the leader's index, the other's).
fn two_beats(env: &TestEnv, cfg: &str) -> (Vec<Beat>, Lease, usize, usize) {
    let beats = vec![
        Beat::start(env, "beat-1", cfg, &[]),
        Beat::start(env, "beat-2", cfg, &[]),
    ];
    let first = wait_leader(env, 0, WAIT, &beats.iter().collect::<Vec<_>>());
    let old = holder(&beats, first);
    (beats, first, old, 1 - old)
}

fn holder(beats: &[Beat], lease: Lease) -> usize {
    beats
        .iter()
        .position(|b| b.pid == lease.pid)
        .unwrap_or_else(|| panic!("the lease names pid {}, not one of our beats", lease.pid))
}

/// Snooped messages with epoch `epoch`.
fn of_epoch(snoop: &Snoop, epoch: u64) -> Vec<Snooped> {
    snoop
        .messages()
        .into_iter()
        .filter(|m| m.epoch == Some(epoch as i64))
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
fn settle_and_check(env: &TestEnv, snoop: &Snoop, workers: &mut [Proc], at_least: usize) {
    let published: BTreeSet<String> = snoop
        .messages()
        .into_iter()
        .map(|m| m.envelope.key)
        .collect();
    let all_ran = wait_until(WAIT, || {
        let ran: BTreeSet<String> = env.lines("effects").into_iter().collect();
        published.is_subset(&ran)
    });
    for w in workers.iter_mut() {
        assert!(
            w.terminate(Duration::from_secs(20)).success(),
            "{}",
            w.log_tail(20)
        );
    }
    let lines = env.lines("effects");
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

    fn samples(&self) -> Vec<T> {
        self.samples.lock().expect("sampler lock").clone()
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

fn progress_sampler(env: &TestEnv) -> Sampler<ProgressSample> {
    let key = env.names().beat_last("tick");
    let mut redis = redis_sync();
    Sampler::start(Duration::from_millis(50), move || {
        let (last, (secs, micros)): (Option<String>, (i64, i64)) = redis::pipe()
            .cmd("GET")
            .arg(&key)
            .cmd("TIME")
            .query(&mut redis)
            .ok()?;
        Some(ProgressSample {
            last: last.map(|t| {
                DateTime::parse_from_rfc3339(&t)
                    .unwrap_or_else(|e| panic!("progress {t:?} is not RFC 3339: {e}"))
                    .with_timezone(&Utc)
            }),
            redis_time: DateTime::from_timestamp(secs, (micros * 1000) as u32).expect("redis TIME"),
        })
    })
}

/// Progress never moves backwards.
fn assert_progress_monotonic(samples: &[ProgressSample]) {
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

#[tokio::test(flavor = "multi_thread")]
async fn kill9_the_leader_twice_every_instant_runs_exactly_once() {
    let mut env = setup("lead_kill9");
    let cfg = config(&env, "leader_lease = \"3s\"");
    let mut workers = workers(&env, &cfg, 2).await;
    let snoop = Snoop::start(&mut env, "default");
    let mut beats: Vec<Beat> = (1..=3)
        .map(|i| Beat::start(&env, &format!("beat-{i}"), &cfg, &[]))
        .collect();
    let window = Instant::now();

    let mut leases = vec![wait_leader(
        &env,
        0,
        WAIT,
        &beats.iter().collect::<Vec<_>>(),
    )];
    let mut kills = Vec::new();
    for round in 0..2 {
        let current = *leases.last().expect("a lease");
        // Let the current leader publish a while (8 instances, caught-up ones included).
        let enough = wait_until(WAIT, || of_epoch(&snoop, current.epoch).len() >= 8);
        assert!(
            enough,
            "leader epoch {} published {} messages\n{}",
            current.epoch,
            of_epoch(&snoop, current.epoch).len(),
            beats[holder(&beats, current)].proc.log_tail(20)
        );
        let i = holder(&beats, current);
        let killed_at = Instant::now();
        beats[i].proc.kill9();
        kills.push(killed_at);
        let alive: Vec<&Beat> = beats.iter().filter(|b| b.pid != current.pid).collect();
        let next = wait_leader(&env, current.epoch, Duration::from_secs(20), &alive);
        assert_ne!(
            next.pid, current.pid,
            "round {round}: a killed beat cannot lead"
        );
        holder(&beats, next);
        leases.push(next);
    }
    let last = *leases.last().expect("a lease");
    let survivor = holder(&beats, last);
    // The last leader leads visibly and publishes until the window spans at least 30 s.
    assert!(
        wait_until(Duration::from_secs(10), || beats[survivor]
            .metric(IS_LEADER)
            == Some(1.0)
            && beats[survivor].metric(LEADER_EPOCH) == Some(last.epoch as f64)),
        "the survivor's metrics do not show it leading with epoch {}",
        last.epoch
    );
    let long_enough = wait_until(WAIT, || {
        let keys: BTreeSet<String> = env.lines("effects").into_iter().collect();
        let instants: Vec<DateTime<Utc>> = keys.iter().map(|k| instant_of(k)).collect();
        match (instants.first(), instants.last()) {
            (Some(a), Some(b)) => {
                (*b - *a).num_seconds() >= 32 && of_epoch(&snoop, last.epoch).len() >= 3
            }
            _ => false,
        }
    });
    assert!(long_enough, "{}", beats[survivor].proc.log_tail(20));
    assert!(
        beats[survivor]
            .proc
            .terminate(Duration::from_secs(10))
            .success(),
        "{}",
        beats[survivor].proc.log_tail(20)
    );
    println!("kill -9 window: {:?}", window.elapsed());
    for (pair, killed_at) in leases.windows(2).zip(&kills) {
        let (old, new) = (pair[0], pair[1]);
        let first_new = of_epoch(&snoop, new.epoch)
            .iter()
            .map(|m| m.arrived_at)
            .min()
            .expect("the new leader published");
        println!(
            "kill -9 failover epoch {} -> {}: old leader's last publish -> new leader's first {:?} \
             (kill -> new leader's first publish {:?}); new leader published {} messages",
            old.epoch,
            new.epoch,
            failover(&snoop, old.epoch, new.epoch),
            first_new.saturating_duration_since(*killed_at),
            of_epoch(&snoop, new.epoch).len()
        );
    }
    settle_and_check(&env, &snoop, &mut workers, 30);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_leader_stopped_past_its_lease_publishes_nothing_it_decides_after_resuming() {
    let mut env = setup("lead_sigstop");
    let cfg = config(&env, "leader_lease = \"3s\"");
    let mut workers = workers(&env, &cfg, 2).await;
    let snoop = Snoop::start(&mut env, "default");
    let (mut beats, first, old, new) = two_beats(&env, &cfg);
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, first.epoch).len() >= 5
            && beats[old].metric(IS_LEADER) == Some(1.0)),
        "{}",
        beats[old].proc.log_tail(20)
    );
    let progress = progress_sampler(&env);

    beats[old].proc.signal(libc::SIGSTOP);
    // `kill` has returned: the process is stopped. Anything it decided later than this (plus
    // a little, for the signal reaching every thread) was decided after resuming.
    let stopped = Utc::now();
    let stopped_at = Instant::now();
    let second = wait_leader(&env, first.epoch, Duration::from_secs(20), &[&beats[new]]);
    assert_eq!(second.pid, beats[new].pid, "the standby took over");
    let took_over = stopped_at.elapsed();
    // Keep the old leader stopped past its whole lease (3 s) and its renewal deadlines, until
    // the new one has published a few instances.
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, second.epoch).len() >= 3
            && stopped_at.elapsed() >= Duration::from_secs(5)),
        "{}",
        beats[new].proc.log_tail(20)
    );
    let stop_length = stopped_at.elapsed();
    beats[old].proc.signal(libc::SIGCONT);
    let resumed_at = Instant::now();

    // The resumed beat finds it lost the lease: standby again, and it stays one.
    let mut stepped_down = None;
    assert!(
        wait_until(Duration::from_secs(10), || {
            let standby = beats[old].metric(IS_LEADER) == Some(0.0);
            if standby && stepped_down.is_none() {
                stepped_down = Some(resumed_at.elapsed());
            }
            standby
        }),
        "the resumed beat still says it leads\n{}",
        beats[old].proc.log_tail(20)
    );
    let old_published = beats[old].metric(PUBLISHED).expect("published_total");
    let resumed_len = of_epoch(&snoop, second.epoch).len();
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, second.epoch).len()
            >= resumed_len + 5),
        "{}",
        beats[new].proc.log_tail(20)
    );
    assert_eq!(
        beats[old].metric(PUBLISHED),
        Some(old_published),
        "the deposed leader kept publishing"
    );
    assert_eq!(beats[old].metric(IS_LEADER), Some(0.0));
    assert_eq!(
        lease(&env, &mut redis_sync()),
        Some(second),
        "the new leader keeps its lease"
    );

    for b in [old, new] {
        assert!(
            beats[b].proc.terminate(Duration::from_secs(10)).success(),
            "{}",
            beats[b].proc.log_tail(20)
        );
    }
    let samples = progress.samples();
    drop(progress);

    println!(
        "SIGSTOP: standby led {took_over:?} after the stop (lease 3 s); old leader stopped for \
         {stop_length:?}; stepped down {stepped_down:?} after SIGCONT; old leader's last publish -> \
         new leader's first {:?}",
        failover(&snoop, first.epoch, second.epoch)
    );
    // Nothing the old leader decided after the stop was published: every copy with its epoch
    // was decided (published_at, its own wall clock = the test's) before the stop.
    let allowance = chrono::Duration::milliseconds(20);
    let late: Vec<_> = of_epoch(&snoop, first.epoch)
        .into_iter()
        .filter(|m| m.envelope.published_at > stopped + allowance)
        .map(|m| (m.envelope.key, m.envelope.published_at, m.arrived))
        .collect();
    assert!(
        late.is_empty(),
        "the deposed leader published what it decided after the stop at {stopped}: {late:?}"
    );
    let after_stop = of_epoch(&snoop, first.epoch)
        .iter()
        .filter(|m| m.arrived_at > stopped_at)
        .count();
    println!(
        "SIGSTOP: {after_stop} copies of the old epoch arrived after the stop (decided before it)"
    );
    // What was handed to the broker before the stop reaches it while the process is stopped
    // (the kernel sends it); a copy of the old epoch arriving after SIGCONT, seconds later, was
    // handed over after resuming, before the beat checked its lease.
    let after_resume: Vec<_> = of_epoch(&snoop, first.epoch)
        .into_iter()
        .filter(|m| m.arrived_at > resumed_at)
        .map(|m| (m.envelope.key, m.envelope.published_at, m.arrived))
        .collect();
    assert!(
        after_resume.is_empty(),
        "the deposed leader handed these to the broker after resuming: {after_resume:?}"
    );
    // Progress: never backwards (a deposed leader writing its stale instant would move it
    // back), and in the end exactly the newest instant published.
    assert!(samples.len() > 20, "{} progress samples", samples.len());
    assert_progress_monotonic(&samples);
    let newest = snoop
        .messages()
        .iter()
        .map(|m| m.envelope.scheduled_for)
        .max()
        .expect("messages");
    let mut redis = redis_sync();
    let last: String = redis::cmd("GET")
        .arg(env.names().beat_last("tick"))
        .query(&mut redis)
        .expect("progress");
    assert_eq!(
        DateTime::parse_from_rfc3339(&last).expect("rfc3339"),
        newest,
        "the progress is the newest instant published"
    );
    settle_and_check(&env, &snoop, &mut workers, 10);
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
    let mut env = setup("lead_suspend");
    let cfg = config(&env, "leader_lease = \"3s\"");
    let mut workers = workers(&env, &cfg, 1).await;
    let snoop = Snoop::start(&mut env, "default");
    let proxy = Proxy::start("127.0.0.1:6379".parse().expect("addr"));
    let suspender = Suspender::new(&env.dir);
    let mut vars = suspender.env();
    vars.push(("DRUMLINE_REDIS_URL", proxy.redis_url()));
    let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut beats = vec![Beat::start(&env, "beat-suspended", &cfg, &vars)];
    let first = wait_leader(&env, 0, WAIT, &[&beats[0]]);
    assert_eq!(first.pid, beats[0].pid);
    beats.push(Beat::start(&env, "beat-standby", &cfg, &[]));
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, first.epoch).len() >= 3
            && beats[1].metric(IS_LEADER) == Some(0.0)),
        "{}",
        beats[0].proc.log_tail(20)
    );

    // Suspended just after a renewal landed, with its whole window (2 s) ahead by its clocks.
    let mut redis = redis_sync();
    let renewed_deadline = Instant::now() + WAIT;
    loop {
        let pttl: i64 = redis::cmd("PTTL")
            .arg(env.names().beat_leader())
            .query(&mut redis)
            .expect("PTTL");
        if (2800..2950).contains(&pttl) {
            break;
        }
        assert!(
            Instant::now() < renewed_deadline,
            "the lease is not renewed"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let asleep = suspender.suspend(beats[0].pid as i32);
    // Stopped: whatever it decides later than this (its wall clock is the test's), it decided
    // after resuming.
    let suspended = Utc::now();
    let second = wait_leader(&env, first.epoch, Duration::from_secs(20), &[&beats[1]]);
    assert_eq!(second.pid, beats[1].pid, "the standby took over");
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, second.epoch).len() >= 2),
        "{}",
        beats[1].proc.log_tail(20)
    );
    drop(proxy);
    let slept = asleep.resume();
    let resumed_at = Instant::now();
    // It stands by, and hands nothing to the broker for longer than its window (2 s) as its
    // monotonic clock would count it from its last renewal.
    let stood_by = wait_until(Duration::from_secs(5), || {
        beats[0].metric(IS_LEADER) == Some(0.0)
    });
    let quiet_until = resumed_at + Duration::from_secs(4);
    while Instant::now() < quiet_until {
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = beats[0].proc.log_tail(20);
    for b in beats.iter_mut() {
        assert!(
            b.proc.terminate(Duration::from_secs(10)).success(),
            "{}",
            b.proc.log_tail(20)
        );
    }
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
    settle_and_check(&env, &snoop, &mut workers, 6);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_hands_leadership_over_within_a_third_of_the_lease() {
    let mut env = setup("lead_sigterm");
    // A 6 s lease: standbys try every 2 s, so a release is taken within 2 s; waiting out the
    // lease would take up to 6 s.
    let lease_len = Duration::from_secs(6);
    let cfg = config(&env, "leader_lease = \"6s\"");
    let mut workers = workers(&env, &cfg, 1).await;
    let snoop = Snoop::start(&mut env, "default");
    let (mut beats, first, old, new) = two_beats(&env, &cfg);
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, first.epoch).len() >= 4
            && beats[new].metric(IS_LEADER) == Some(0.0)),
        "{}\n{}",
        beats[old].proc.log_tail(20),
        beats[new].proc.log_tail(20)
    );
    let healthz = |b: &Beat| {
        let (status, body) = drumline_e2e::http_get(b.port, "/healthz").expect("healthz");
        (status, body.trim().to_owned())
    };
    assert_eq!(healthz(&beats[new]), (200, "standby".to_owned()));
    assert_eq!(healthz(&beats[old]), (200, "ok".to_owned()));
    assert_eq!(beats[old].metric(LEADER_EPOCH), Some(first.epoch as f64));
    // `status --json` names the leader.
    let (ok, out, err) = env.run("drumline-beat", &["--config", &cfg, "status", "--json"]);
    assert!(ok.success(), "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).expect("status --json");
    assert_eq!(status["leader"]["pid"].as_u64(), Some(first.pid), "{out}");
    assert_eq!(
        status["leader"]["epoch"].as_u64(),
        Some(first.epoch),
        "{out}"
    );
    assert!(status["leader"]["host"].is_string(), "{out}");
    assert!(status["leader"]["since"].is_string(), "{out}");

    // A standby's clean stop releases nothing: the lease is compared by token.
    let mut extra = Beat::start(&env, "beat-3", &cfg, &[]);
    assert!(
        wait_until(WAIT, || extra.metric(IS_LEADER) == Some(0.0)),
        "{}",
        extra.proc.log_tail(20)
    );
    assert!(extra.proc.terminate(Duration::from_secs(10)).success());
    assert_eq!(
        lease(&env, &mut redis_sync()),
        Some(first),
        "a standby's stop touched the lease"
    );

    let term_at = Instant::now();
    beats[old].proc.signal(libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(10);
    while beats[old].proc.is_running() {
        assert!(
            Instant::now() < deadline,
            "{}",
            beats[old].proc.log_tail(20)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let exited_at = Instant::now();
    let status = beats[old].proc.wait(Duration::from_secs(1));
    assert!(status.success(), "{}", beats[old].proc.log_tail(20));
    let mut redis = redis_sync();
    let mut second = None;
    while second.is_none() && exited_at.elapsed() < Duration::from_secs(15) {
        second = lease(&env, &mut redis).filter(|l| l.epoch > first.epoch);
        std::thread::sleep(Duration::from_millis(10));
    }
    let handover = exited_at.elapsed();
    let second = second.expect("no new leader within 15 s");
    assert_eq!(second.pid, beats[new].pid);
    println!(
        "SIGTERM: new leader {handover:?} after the old one exited ({:?} after SIGTERM; lease {lease_len:?})",
        term_at.elapsed()
    );
    assert!(
        wait_until(Duration::from_secs(5), || beats[new].metric(IS_LEADER)
            == Some(1.0)),
        "{}",
        beats[new].proc.log_tail(20)
    );
    let allowed = lease_len / 3 + Duration::from_millis(500);
    assert!(
        handover <= allowed,
        "the standby took {handover:?} to lead after a clean stop (allowed {allowed:?}: one try)"
    );
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, second.epoch).len() >= 3),
        "{}",
        beats[new].proc.log_tail(20)
    );
    println!(
        "SIGTERM: old leader's last publish -> new leader's first {:?}",
        failover(&snoop, first.epoch, second.epoch)
    );
    assert!(beats[new].proc.terminate(Duration::from_secs(10)).success());
    settle_and_check(&env, &snoop, &mut workers, 6);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_beat_an_hour_ahead_neither_publishes_early_nor_loses_instances() {
    let mut env = setup("lead_faketime");
    let threshold = chrono::Duration::seconds(2);
    let cfg = config(&env, "leader_lease = \"3s\"\nmisfire_threshold = \"2s\"");
    let mut workers = workers(&env, &cfg, 2).await;
    let snoop = Snoop::start(&mut env, "default");
    let progress = progress_sampler(&env);
    let ahead = faketime_ahead("+1h");
    let ahead: Vec<(&str, &str)> = ahead.iter().map(|(k, v)| (*k, v.as_str())).collect();

    // 1. The fast beat starts alone, so it leads from the job's very first start.
    let mut beats = vec![Beat::start(&env, "beat-fast-1", &cfg, &ahead)];
    let fast1 = wait_leader(&env, 0, WAIT, &[&beats[0]]);
    assert_eq!(fast1.pid, beats[0].pid);
    beats.push(Beat::start(&env, "beat-normal", &cfg, &[]));
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, fast1.epoch).len() >= 6),
        "the fast leader published {} messages\n{}",
        of_epoch(&snoop, fast1.epoch).len(),
        beats[0].proc.log_tail(20)
    );
    // 2. It stops; the normal beat resumes from the progress the fast one recorded.
    assert!(beats[0].proc.terminate(Duration::from_secs(10)).success());
    let normal = wait_leader(&env, fast1.epoch, Duration::from_secs(20), &[&beats[1]]);
    assert_eq!(normal.pid, beats[1].pid);
    beats.push(Beat::start(&env, "beat-fast-2", &cfg, &ahead));
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, normal.epoch).len() >= 6),
        "{}",
        beats[1].proc.log_tail(20)
    );
    // 3. The normal leader dies; the fast standby takes over from its progress.
    beats[1].proc.kill9();
    let fast2 = wait_leader(&env, normal.epoch, Duration::from_secs(20), &[&beats[2]]);
    assert_eq!(fast2.pid, beats[2].pid);
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, fast2.epoch).len() >= 6),
        "the fast leader published {} messages\n{}",
        of_epoch(&snoop, fast2.epoch).len(),
        beats[2].proc.log_tail(20)
    );
    assert!(beats[2].proc.terminate(Duration::from_secs(10)).success());
    let samples = progress.samples();
    drop(progress);

    // No instance published early: none arrived more than misfire_threshold before its
    // instant (by the test's clock, which is Redis's: same host).
    let messages = snoop.messages();
    let earliest = messages
        .iter()
        .map(|m| m.envelope.scheduled_for - m.arrived)
        .max()
        .expect("messages");
    println!(
        "faketime: {} messages; the earliest arrived {} ms before its instant (threshold {} ms)",
        messages.len(),
        earliest.num_milliseconds(),
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
    assert!(samples.len() > 100, "{} progress samples", samples.len());
    let most_ahead = samples
        .iter()
        .filter_map(|s| Some(s.last? - s.redis_time))
        .max()
        .expect("progress samples");
    println!(
        "faketime: progress at most {} ms ahead of Redis TIME ({} samples)",
        most_ahead.num_milliseconds(),
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
    assert_progress_monotonic(&samples);
    let per_leader: Vec<usize> = [fast1, normal, fast2]
        .iter()
        .map(|l| of_epoch(&snoop, l.epoch).len())
        .collect();
    println!("faketime: published per leader (fast, normal, fast): {per_leader:?}");
    settle_and_check(&env, &snoop, &mut workers, 15);
}

/// A leader whose clock runs an hour *behind* Redis's still publishes — at most about the
/// threshold late — instead of holding the lease and publishing nothing for an hour.
#[tokio::test(flavor = "multi_thread")]
async fn a_leader_an_hour_behind_publishes_at_most_the_threshold_late() {
    let mut env = setup("lead_behind");
    let threshold = chrono::Duration::seconds(2);
    let cfg = config(&env, "leader_lease = \"3s\"\nmisfire_threshold = \"2s\"");
    let mut workers = workers(&env, &cfg, 1).await;
    let snoop = Snoop::start(&mut env, "default");
    let behind = faketime_ahead("-1h");
    let behind: Vec<(&str, &str)> = behind.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut beat = Beat::start(&env, "beat-slow", &cfg, &behind);
    let lease = wait_leader(&env, 0, WAIT, &[&beat]);
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, lease.epoch).len() >= 6),
        "the slow leader published {} messages\n{}",
        of_epoch(&snoop, lease.epoch).len(),
        beat.proc.log_tail(20)
    );
    assert!(beat.proc.terminate(Duration::from_secs(10)).success());
    let latest = snoop
        .messages()
        .iter()
        .map(|m| m.arrived - m.envelope.scheduled_for)
        .max()
        .expect("messages");
    println!(
        "behind: the latest message arrived {} ms after its instant (threshold {} ms)",
        latest.num_milliseconds(),
        threshold.num_milliseconds()
    );
    // Bounded by the threshold plus scheduling noise; an hour is what this guards against.
    assert!(latest < threshold * 10, "published {latest} late");
    settle_and_check(&env, &snoop, &mut workers, 6);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_leader_whose_lease_is_taken_moves_no_progress_and_steps_down() {
    let mut env = setup("lead_stolen");
    let cfg = config(&env, "leader_lease = \"3s\"");
    let mut workers = workers(&env, &cfg, 1).await;
    let snoop = Snoop::start(&mut env, "default");
    let mut beat = Beat::start(&env, "beat", &cfg, &[]);
    let first = wait_leader(&env, 0, WAIT, &[&beat]);
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, first.epoch).len() >= 4),
        "{}",
        beat.proc.log_tail(20)
    );

    // Another holder appears (as after a lease lost in Redis and taken by some other beat):
    // the lease names a foreign token, and its TTL outlasts the observation.
    let mut redis = redis_sync();
    let thief = serde_json::json!({
        "host": "elsewhere", "pid": 1, "epoch": first.epoch + 100,
        "since": Utc::now().to_rfc3339(), "token": "not-the-beats"
    })
    .to_string();
    let (at_steal,): (Option<String>,) = redis::pipe()
        .atomic()
        .cmd("SET")
        .arg(env.names().beat_leader())
        .arg(&thief)
        .arg("PX")
        .arg(60_000)
        .ignore()
        .cmd("GET")
        .arg(env.names().beat_last("tick"))
        .query(&mut redis)
        .expect("steal the lease");
    let stolen = Utc::now();
    let stolen_at = Instant::now();
    let at_steal = DateTime::parse_from_rfc3339(&at_steal.expect("progress before the steal"))
        .expect("rfc3339")
        .with_timezone(&Utc);
    let progress = progress_sampler(&env);

    // It notices at its next renewal (within lease/3) and stands by.
    assert!(
        wait_until(Duration::from_secs(5), || beat.metric(IS_LEADER)
            == Some(0.0)),
        "the beat still leads under a foreign lease\n{}",
        beat.proc.log_tail(20)
    );
    let stepped_down = stolen_at.elapsed();
    let published_then = snoop.messages().len();
    // Standing by for a while: it neither takes the foreign lease nor publishes.
    let quiet_until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < quiet_until {
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(beat.metric(IS_LEADER), Some(0.0));
    }
    assert_eq!(
        snoop.messages().len(),
        published_then,
        "the standby published"
    );
    let held: Option<String> = redis::cmd("GET")
        .arg(env.names().beat_leader())
        .query(&mut redis)
        .expect("GET lease");
    assert_eq!(
        held.as_deref(),
        Some(thief.as_str()),
        "the foreign lease was touched"
    );
    let frozen = progress.samples();
    drop(progress);

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
    let late: Vec<_> = of_epoch(&snoop, first.epoch)
        .into_iter()
        .filter(|m| m.envelope.published_at > stolen + chrono::Duration::seconds(2))
        .map(|m| (m.envelope.key, m.envelope.published_at))
        .collect();
    assert!(
        late.is_empty(),
        "published after lease − lease/3 without a renewal: {late:?}"
    );
    let after_steal = of_epoch(&snoop, first.epoch)
        .iter()
        .filter(|m| m.arrived_at > stolen_at)
        .count();
    println!(
        "stolen lease: stepped down {stepped_down:?} after the steal; {after_steal} messages \
         published after it (their progress fenced)"
    );

    // The foreign lease goes away: the beat leads again under a new epoch and resumes from the
    // fenced progress, so nothing is missed (what it published unrecorded comes again).
    let _: () = redis::cmd("DEL")
        .arg(env.names().beat_leader())
        .query(&mut redis)
        .expect("DEL");
    let second = wait_leader(&env, first.epoch, Duration::from_secs(5), &[&beat]);
    assert_eq!(second.pid, beat.pid);
    assert!(
        second.epoch < first.epoch + 100,
        "epochs come from the counter"
    );
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, second.epoch).len() >= 4),
        "{}",
        beat.proc.log_tail(20)
    );
    assert!(beat.proc.terminate(Duration::from_secs(10)).success());
    let republished: BTreeSet<String> = of_epoch(&snoop, second.epoch)
        .into_iter()
        .map(|m| m.envelope.key)
        .collect();
    let again = of_epoch(&snoop, first.epoch)
        .iter()
        .filter(|m| republished.contains(&m.envelope.key))
        .count();
    println!("stolen lease: {again} instances published again by the new term");
    settle_and_check(&env, &snoop, &mut workers, 8);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_leader_cut_off_from_redis_stops_publishing_before_a_standby_takes_over() {
    let mut env = setup("lead_partition");
    let cfg = config(&env, "leader_lease = \"3s\"");
    let mut workers = workers(&env, &cfg, 1).await;
    let snoop = Snoop::start(&mut env, "default");
    // The first beat reaches Redis through a proxy the test can cut; it starts alone, so it
    // leads. The broker stays reachable: a leader partitioned from Redis only.
    let proxy = Proxy::start("127.0.0.1:6379".parse().expect("addr"));
    let via_proxy = proxy.redis_url();
    let mut beats = vec![Beat::start(
        &env,
        "beat-cut",
        &cfg,
        &[("DRUMLINE_REDIS_URL", via_proxy.as_str())],
    )];
    let first = wait_leader(&env, 0, WAIT, &[&beats[0]]);
    assert_eq!(first.pid, beats[0].pid);
    beats.push(Beat::start(&env, "beat-standby", &cfg, &[]));
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, first.epoch).len() >= 4
            && beats[1].metric(IS_LEADER) == Some(0.0)),
        "{}",
        beats[0].proc.log_tail(20)
    );

    proxy.set(Fault::Blackhole);
    let cut = Utc::now();
    let cut_at = Instant::now();
    let second = wait_leader(&env, first.epoch, Duration::from_secs(20), &[&beats[1]]);
    assert_eq!(second.pid, beats[1].pid);
    let took_over = cut_at.elapsed();
    assert!(
        wait_until(WAIT, || of_epoch(&snoop, second.epoch).len() >= 4),
        "{}",
        beats[1].proc.log_tail(20)
    );
    // The cut-off beat knows it does not lead (it cannot renew), while still cut off.
    let standby_while_cut = wait_until(Duration::from_secs(5), || {
        beats[0].metric(IS_LEADER) == Some(0.0)
    });
    let cut_for = cut_at.elapsed();
    let cut_log = beats[0].proc.log_tail(20);
    let cut_view = format!(
        "cut-off beat: is_leader {:?}, /healthz {:?}; new leader: is_leader {:?}",
        beats[0].metric(IS_LEADER),
        drumline_e2e::http_get(beats[0].port, "/healthz"),
        beats[1].metric(IS_LEADER)
    );

    // Healed: what the cut-off beat sent meanwhile reaches Redis now, and is refused.
    proxy.set(Fault::Pass);
    let healed_at = Instant::now();
    let quiet_until = Instant::now() + Duration::from_secs(4);
    let old_published = beats[0].metric(PUBLISHED);
    while Instant::now() < quiet_until {
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            beats[0].metric(IS_LEADER),
            Some(0.0),
            "the healed beat leads"
        );
    }
    assert_eq!(beats[0].metric(PUBLISHED), old_published);
    assert_eq!(lease(&env, &mut redis_sync()), Some(second));
    for b in beats.iter_mut() {
        assert!(
            b.proc.terminate(Duration::from_secs(10)).success(),
            "{}",
            b.proc.log_tail(20)
        );
    }

    // The two terms do not overlap: the old leader decided its last message before the new one
    // decided its first, and within lease − lease/3 of the cut (its last renewal was before).
    let old = of_epoch(&snoop, first.epoch);
    let new = of_epoch(&snoop, second.epoch);
    let old_last = old
        .iter()
        .map(|m| m.envelope.published_at)
        .max()
        .expect("old");
    let new_first = new
        .iter()
        .map(|m| m.envelope.published_at)
        .min()
        .expect("new");
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
    settle_and_check(&env, &snoop, &mut workers, 8);
    assert!(
        standby_while_cut,
        "a beat cut off from Redis for {cut_for:?} (lease 3 s; it stopped publishing after \
         2 s) still says it leads: {cut_view}\n{cut_log}"
    );
}
