//! `scripts/soak --for D --seed N` (docs/soak.md): two beats and three workers on private
//! servers, a 1 s job, a catch-up job, a failing task and ad-hoc traffic under random faults
//! drawn from a seeded generator; then the effect check and `drumline verify`.

pub mod check;
pub mod faults;
pub mod rng;
pub mod world;

use check::{Findings, Observed};
use chrono::{DateTime, Duration as Span, DurationRound, Utc};
use drumline_shared::envelope::instance_key;
use faults::Faults;
use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use world::{World, CATCHUP_EVERY, FAIL_RETRIES};

/// How the soak runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// From the members' start to the last fault (warm-up included).
    pub duration: Duration,
    /// Decides the fault schedule and the ad-hoc traffic.
    pub seed: u64,
}

/// Warm-up: no fault until the 1 s job has run for this long.
const WARM_UP: Duration = Duration::from_secs(5);
/// How long the settling may take before a key still unfinished counts as missed.
const SETTLE: Duration = Duration::from_secs(120);

/// The outcome.
#[derive(Debug)]
pub struct Verdict {
    /// Faults injected per kind.
    pub faults: BTreeMap<&'static str, usize>,
    /// The effect check's findings.
    pub findings: Findings,
    /// `drumline verify`: `None` when this build has none, else (holds, its JSON).
    pub verify: Option<(bool, String)>,
    /// Keys checked by the effect check.
    pub checked: usize,
}

impl Verdict {
    /// True when neither the effect check nor `verify` found a violation.
    pub fn holds(&self) -> bool {
        self.findings.violations.is_empty() && self.verify.as_ref().is_none_or(|(ok, _)| *ok)
    }
}

/// Ad-hoc keys whose `publish` was confirmed: (key, task).
type Published = Arc<Mutex<Vec<(String, &'static str)>>>;

/// Runs the soak (prints each fault as it is injected) and returns the verdict.
pub fn run(opts: &Options) -> Verdict {
    let began = Instant::now();
    let mut world = World::new();
    println!(
        "soak: seed {}, for {:?}, namespace {}, files in {}",
        opts.seed,
        opts.duration,
        world.env.ns,
        world.env.dir.display()
    );
    for i in 0..world.members.len() {
        world.start(i);
    }
    let first = crate::wait_until(Duration::from_secs(90), || {
        !world.env.lines("effects").is_empty()
    });
    assert!(
        first,
        "the 1 s job never ran; see {}",
        world.env.dir.display()
    );
    std::thread::sleep(WARM_UP);
    let warm_end = Utc::now();
    println!("soak: warm-up over at {warm_end}; faults begin");
    let stop = Arc::new(AtomicBool::new(false));
    let published: Published = Arc::default();
    let traffic = spawn_traffic(&world, opts.seed, stop.clone(), published.clone());
    let mut faults = Faults::new(opts.seed);
    let mut next = Instant::now();
    while began.elapsed() < opts.duration {
        faults.undo_due(&mut world, false);
        revive(&mut world);
        if Instant::now() >= next {
            faults.inject(&mut world);
            next = Instant::now() + faults.gap();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let fault_end = Utc::now();
    stop.store(true, Ordering::SeqCst);
    let _ = traffic.join();
    // Undo everything; a killed Redis primary comes back only once the Sentinels replaced it.
    crate::wait_until(Duration::from_secs(60), || {
        faults.undo_due(&mut world, true);
        !faults.pending()
    });
    revive(&mut world);
    println!("soak: faults over at {fault_end}; healing and settling");
    report_counts(&faults.counts);
    let published = published.lock().expect("traffic").clone();
    let verdict = settle_and_check(&mut world, warm_end, fault_end, &published);
    let since = began.elapsed() + Duration::from_secs(60);
    let verify = run_verify(&world, since);
    let verdict = Verdict {
        faults: faults.counts,
        verify,
        ..verdict
    };
    print_verdict(&verdict, began.elapsed());
    if !verdict.holds() {
        world.redis.keep();
        println!(
            "soak: the Redis set's logs are kept in {}",
            world.redis.dir().display()
        );
    }
    verdict
}

/// Restarts a member whose process exited by itself (a crash is worth saying).
fn revive(world: &mut World) {
    for i in 0..world.members.len() {
        let m = &mut world.members[i];
        if let Some(p) = m.proc.as_mut() {
            if !p.is_running() {
                println!(
                    "soak: {} exited by itself; restarting it\n{}",
                    m.name,
                    p.log_tail(10)
                );
                world.start(i);
            }
        }
    }
}

fn report_counts(counts: &BTreeMap<&'static str, usize>) {
    let total: usize = counts.values().sum();
    println!("soak: {total} faults injected");
    for kind in faults::KINDS {
        println!("  {kind:<26} {}", counts.get(kind).copied().unwrap_or(0));
    }
}

/// Publishes ad-hoc keys through `drumline publish` until `stop`: two of three run the
/// succeeding task, one the failing one. Only keys whose publish exited 0 are expected.
fn spawn_traffic(
    world: &World,
    seed: u64,
    stop: Arc<AtomicBool>,
    published: Published,
) -> std::thread::JoinHandle<()> {
    let bin = crate::binary("drumline");
    let config = world.config.clone();
    let redis = world.redis_url();
    let dir = world.env.path("publish.log");
    std::thread::spawn(move || {
        let mut rng = rng::Rng::new(seed ^ 0x5eed_0ad0);
        let mut n = 0u32;
        while !stop.load(Ordering::SeqCst) {
            n += 1;
            let task = if rng.below(3) == 0 { "fail" } else { "ok" };
            let key = format!("adhoc-{n}-{task}");
            let mut cmd = Command::new(&bin);
            cmd.args(["publish", "--config", &config, "--key", &key, task])
                .env_remove("DRUMLINE_CONFIG")
                .env_remove("DRUMLINE_AMQP_URL")
                .env("DRUMLINE_REDIS_URL", &redis)
                .stdin(Stdio::null());
            if run_bounded(cmd, &dir, Duration::from_secs(30)) {
                published.lock().expect("traffic").push((key, task));
            }
            std::thread::sleep(rng.between(Duration::from_millis(300), Duration::from_millis(900)));
        }
    })
}

/// Runs `cmd` (output appended to `log`), killed after `within`; true when it exited 0.
fn run_bounded(mut cmd: Command, log: &std::path::Path, within: Duration) -> bool {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("publish log");
    cmd.stdout(out.try_clone().expect("dup")).stderr(out);
    let Ok(mut child) = cmd.spawn() else {
        return false;
    };
    let mut status = None;
    crate::wait_until(within, || {
        status = child.try_wait().ok().flatten();
        status.is_some()
    });
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    status.is_some_and(|s| s.success())
}

/// The instants of a job due every `every` seconds in `[from, to]`.
fn instants(job: &str, every: i64, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<String> {
    let step = Span::seconds(every);
    let mut t = from.duration_trunc(step).expect("trunc") + step;
    let mut out = Vec::new();
    while t <= to {
        out.push(instance_key(job, t));
        t += step;
    }
    out
}

/// Waits until every expected key is finished (or [`SETTLE`] passes), stops the members and
/// checks the effects.
fn settle_and_check(
    world: &mut World,
    warm_end: DateTime<Utc>,
    fault_end: DateTime<Utc>,
    published: &[(String, &'static str)],
) -> Verdict {
    let mut seen = Observed {
        fail_retries: FAIL_RETRIES,
        ..Default::default()
    };
    seen.must_succeed
        .extend(instants("tick", 1, warm_end, fault_end));
    seen.must_succeed
        .extend(instants("catchup", CATCHUP_EVERY, warm_end, fault_end));
    for (key, task) in published {
        let set = if *task == "fail" {
            &mut seen.must_die
        } else {
            &mut seen.must_succeed
        };
        set.insert(key.clone());
    }
    let all: BTreeSet<String> = seen.must_succeed.union(&seen.must_die).cloned().collect();
    let started = Instant::now();
    let finished = crate::wait_until(SETTLE, || {
        revive(world);
        seen.states = states(world, &all);
        all.iter().all(|k| {
            matches!(
                seen.states.get(k).map(String::as_str),
                Some("done" | "dead")
            )
        })
    });
    println!(
        "soak: {} keys {} after {:.1}s",
        all.len(),
        if finished {
            "finished"
        } else {
            "NOT all finished"
        },
        started.elapsed().as_secs_f64()
    );
    // A late copy would show now: give it a lease and a little more.
    std::thread::sleep(Duration::from_secs(6));
    for m in &mut world.members {
        if let Some(mut p) = m.proc.take() {
            p.terminate(Duration::from_secs(30));
        }
    }
    seen.states = states(world, &all);
    let (successes, mut bad) = check::parse(&world.env.lines("effects"));
    let (failures, bad_f) = check::parse(&world.env.lines("failures"));
    bad.extend(bad_f);
    seen.successes = successes;
    seen.failures = failures;
    let mut findings = check::check(&seen);
    findings.violations.extend(bad);
    Verdict {
        faults: BTreeMap::new(),
        findings,
        verify: None,
        checked: all.len(),
    }
}

/// The run records' `state` of `keys`.
fn states(world: &World, keys: &BTreeSet<String>) -> BTreeMap<String, String> {
    let Some(mut conn) = world.redis.primary_connection() else {
        return BTreeMap::new();
    };
    let names = world.env.names();
    let mut pipe = redis::pipe();
    for k in keys {
        pipe.cmd("HGET").arg(names.run_key(k)).arg("state");
    }
    let got: Vec<Option<String>> = pipe.query(&mut conn).unwrap_or_default();
    keys.iter()
        .zip(got)
        .filter_map(|(k, s)| Some((k.clone(), s?)))
        .collect()
}

/// `drumline verify --since D --json` when this build has it.
fn run_verify(world: &World, since: Duration) -> Option<(bool, String)> {
    let help = world.command("drumline").arg("help").output().ok()?;
    let listed = String::from_utf8_lossy(&help.stdout)
        .lines()
        .any(|l| l.trim_start().starts_with("verify "));
    if !listed {
        println!("verify: not available in this build");
        return None;
    }
    let out = world
        .command("drumline")
        .args([
            "verify",
            "--since",
            &format!("{}s", since.as_secs()),
            "--json",
        ])
        .output()
        .expect("run drumline verify");
    let json = String::from_utf8_lossy(&out.stdout).into_owned();
    let holds = out.status.success()
        && serde_json::from_str::<serde_json::Value>(&json)
            .is_ok_and(|v| v["holds"] == serde_json::Value::Bool(true));
    println!("verify: exit {:?}, {}", out.status.code(), json.trim());
    if !out.stderr.is_empty() {
        println!(
            "verify stderr: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Some((holds, json))
}

fn print_verdict(v: &Verdict, took: Duration) {
    let f = &v.findings;
    println!(
        "soak: {} keys checked; {} dead (visible); {} repeated under a newer fencing token \
         (an unrecorded success taken over: the documented limit)",
        v.checked,
        f.dead.len(),
        f.superseded.len()
    );
    for s in &f.superseded {
        println!("  superseded {s}");
    }
    for violation in &f.violations {
        println!("  VIOLATION {violation}");
    }
    let verdict = if v.holds() { "HOLDS" } else { "VIOLATED" };
    println!(
        "soak: verdict {verdict} ({} effect violations, verify {}) in {:.0}s",
        f.violations.len(),
        match &v.verify {
            None => "not available",
            Some((true, _)) => "holds",
            Some((false, _)) => "VIOLATED",
        },
        took.as_secs_f64()
    );
}
