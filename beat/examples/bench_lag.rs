//! Lag from a job's instant to its shell task's start, through the real binaries (issue 11).
//!
//! Starts the release `drumline-beat` and `drumline-worker` on a config of one job
//! `every = "200ms"` (`--every`) whose command is
//! `/bin/sh -c 'echo "$(date +%s.%N) $DRUMLINE_SCHEDULED_FOR" >> FILE'`, lets it run for
//! `--seconds` after a `--warmup` (instants before that are not counted), stops both with
//! SIGTERM and reads FILE: lag = the `date` stamp − the instant. The stamp comes after the
//! command's `sh` and `date` have started, so the cost of that measurement is measured too, in
//! the same run, with nothing else of ours running: the same command spawned directly from
//! this process (fork/exec of `sh`, then of `date`), stamp − the instant before the spawn.
//! The table gives the raw lag and the lag net of the measurement's median cost.
//!
//! `bench_lag PATH/TO/drumline-beat PATH/TO/drumline-worker [--every 200ms] [--seconds 30]
//!  [--warmup 2] [--runs 1] [--json]`
//!
//! Its own namespace and temporary directory, both deleted at the end; it stops only the two
//! processes it started. Asserts nothing about speed; it does check that no counted instant
//! was missed or ran twice.

mod common;
use anyhow::{bail, ensure, Context, Result};
use chrono::{DateTime, Utc};
use common::{amqp_url, cleanup, redis_url, spawn_beat};
use drumline_shared::envelope::Envelope;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The task's command: one line per run, the `date` stamp and the instant.
fn script(file: &Path) -> String {
    format!(
        "echo \"$(date +%s.%N) $DRUMLINE_SCHEDULED_FOR\" >> '{}'",
        file.display()
    )
}

/// Wall-clock ns since the epoch.
fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos() as i64
}

/// `secs.nanos` (as `date +%s.%N` prints it) in ns.
fn stamp_ns(text: &str) -> Result<i64> {
    let (s, n) = text.split_once('.').context("no '.' in the stamp")?;
    ensure!(n.len() == 9, "not 9 digits of ns: {text}");
    Ok(s.parse::<i64>()? * 1_000_000_000 + n.parse::<i64>()?)
}

/// The lines of `file`: (stamp ns, the instant's text).
fn read_stamps(file: &Path) -> Result<Vec<(i64, String)>> {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    text.lines()
        .map(|l| {
            let (stamp, instant) = l.split_once(' ').context("no ' '")?;
            Ok((stamp_ns(stamp)?, instant.to_owned()))
        })
        .collect()
}

/// What `date` costs: the command spawned directly `n` times, stamp − the instant just before
/// each spawn (ns).
fn measurement_cost(dir: &Path, n: usize) -> Result<Vec<i64>> {
    let file = dir.join("cost");
    let mut costs = Vec::with_capacity(n);
    for _ in 0..n {
        let _ = std::fs::remove_file(&file);
        let t0 = now_ns();
        let status = Command::new("/bin/sh")
            .arg("-c")
            .arg(script(&file))
            .env("DRUMLINE_SCHEDULED_FOR", "x")
            .status()?;
        ensure!(status.success(), "the command failed: {status}");
        let (stamp, _) = read_stamps(&file)?.pop().context("no stamp")?;
        costs.push(stamp - t0);
    }
    Ok(costs)
}

fn write_config(path: &Path, ns: &str, every: &str, file: &Path) -> Result<()> {
    let command = serde_json::to_string(&["/bin/sh", "-c", &script(file)])?;
    std::fs::write(
        path,
        format!(
            "namespace = \"{ns}\"\n\n[tasks.stamp]\ncommand = {command}\n\n\
             [[jobs]]\nname = \"tick\"\ntask = \"stamp\"\nevery = \"{every}\"\n"
        ),
    )?;
    Ok(())
}

/// SIGTERM, then up to 15 s for it to exit (SIGKILL after that).
fn stop(child: &mut Child) -> Result<std::process::ExitStatus> {
    Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()?;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return Ok(child.wait()?);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One run: the lags of the counted instants.
async fn run((beat, worker): (&Path, &Path), args: &Args, ns: &str, dir: &Path) -> Result<Lags> {
    let file = dir.join("stamps");
    let config = dir.join("bench.toml");
    write_config(&config, ns, &args.every, &file)?;
    let mut worker = Command::new(worker)
        .arg("--config")
        .arg(&config)
        .env("DRUMLINE_AMQP_URL", amqp_url())
        .env("DRUMLINE_REDIS_URL", redis_url())
        .env_remove("DRUMLINE_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start {}", worker.display()))?;
    let beat = spawn_beat(beat, &config);
    let mut beat = match beat {
        Ok(b) => b,
        Err(e) => {
            stop(&mut worker)?;
            return Err(e);
        }
    };
    let measured = async {
        beat.leading
            .recv_timeout(Duration::from_secs(30))
            .context("the beat never led")?;
        // The topology exists once the beat leads; the probe sees every message too.
        let probe = Probe::start(ns).await?;
        let from = now_ns() + (args.warmup * 1e9) as i64;
        let until = from + (args.seconds * 1e9) as i64;
        tokio::time::sleep(Duration::from_secs_f64(args.warmup + args.seconds + 1.0)).await;
        Ok::<_, anyhow::Error>((from, until, probe.stop().await))
    }
    .await;
    let beat_status = stop(&mut beat.child)?;
    let worker_status = stop(&mut worker)?;
    let tail = beat.log_tail.join().unwrap_or_default();
    let (from, until, probed) = measured.with_context(|| format!("beat log tail:\n{tail}"))?;
    ensure!(beat_status.success(), "the beat exited with {beat_status}");
    ensure!(
        worker_status.success(),
        "the worker exited with {worker_status}"
    );

    let delivered: Vec<i64> = probed
        .into_iter()
        .filter(|(at, _)| (from..until).contains(at))
        .map(|(at, received)| received - at)
        .collect();
    let mut lags = Vec::new();
    let mut instants = Vec::new();
    for (stamp, instant) in read_stamps(&file)? {
        let at = DateTime::parse_from_rfc3339(&instant)
            .with_context(|| format!("instant {instant:?}"))?
            .with_timezone(&Utc)
            .timestamp_nanos_opt()
            .context("instant out of range")?;
        if (from..until).contains(&at) {
            lags.push(stamp - at);
            instants.push(at);
        }
    }
    instants.sort_unstable();
    let every = humantime_ns(&args.every)?;
    let expected = (until - from) / every;
    ensure!(
        instants.windows(2).all(|w| w[1] - w[0] == every),
        "an instant ran twice or was missed"
    );
    ensure!(
        (instants.len() as i64 - expected).abs() <= 1,
        "{} instants ran, {expected} expected",
        instants.len()
    );
    Ok(Lags {
        task: lags,
        delivered,
    })
}

/// One run's lags (ns) over the counted instants.
struct Lags {
    /// Instant → the task's `date` stamp.
    task: Vec<i64>,
    /// Instant → the message delivered to the probe (the beat's and the broker's share).
    delivered: Vec<i64>,
}

/// A consumer of a queue of our own bound like the work queue, so it gets a copy of every
/// message the beat publishes: when each arrives says how much of the lag is the beat's and
/// the broker's. Auto-ack and exclusive (gone with its connection).
struct Probe {
    amqp: lapin::Connection,
    seen: Arc<Mutex<Vec<(i64, i64)>>>,
}

impl Probe {
    async fn start(ns: &str) -> Result<Self> {
        use lapin::options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
        use lapin::types::FieldTable;
        let amqp =
            lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default()).await?;
        let ch = amqp.create_channel().await?;
        let queue = format!("{ns}.lag-probe");
        let exclusive = QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        };
        ch.queue_declare(queue.as_str().into(), exclusive, FieldTable::default())
            .await?;
        let exchange = drumline_shared::names::Names::new(ns).tasks_exchange();
        ch.queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            "default".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        let no_ack = BasicConsumeOptions {
            no_ack: true,
            ..Default::default()
        };
        let consumer = ch
            .basic_consume(
                queue.as_str().into(),
                "probe".into(),
                no_ack,
                FieldTable::default(),
            )
            .await?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        consumer.set_delegate(move |delivery: lapin::message::DeliveryResult| {
            let received = now_ns();
            let s = s.clone();
            async move {
                let Ok(Some(d)) = delivery else { return };
                if let Ok(env) = Envelope::decode(&d.data) {
                    if let Some(at) = env.scheduled_for.timestamp_nanos_opt() {
                        s.lock().unwrap().push((at, received));
                    }
                }
            }
        });
        Ok(Probe { amqp, seen })
    }

    /// (instant, received) of every message seen, in ns.
    async fn stop(self) -> Vec<(i64, i64)> {
        let _ = self.amqp.close(200, "bench done".into()).await;
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

/// `every` in ns: `200ms`, `1s` (the forms this bench needs).
fn humantime_ns(every: &str) -> Result<i64> {
    let (digits, unit) = every.split_at(every.find(|c: char| !c.is_ascii_digit()).context("unit")?);
    let n: i64 = digits.parse()?;
    Ok(match unit {
        "ms" => n * 1_000_000,
        "s" => n * 1_000_000_000,
        _ => bail!("--every: write e.g. 200ms or 1s"),
    })
}

/// p50, p99 and max in ms.
#[derive(Clone, Copy)]
struct Percentiles {
    p50: f64,
    p99: f64,
    max: f64,
}

impl Percentiles {
    fn of(mut xs: Vec<i64>) -> Result<Self> {
        ensure!(!xs.is_empty(), "no samples");
        xs.sort_unstable();
        let at = |q: f64| {
            let i = ((xs.len() as f64 * q).ceil() as usize).clamp(1, xs.len()) - 1;
            xs[i] as f64 / 1e6
        };
        Ok(Percentiles {
            p50: at(0.5),
            p99: at(0.99),
            max: at(1.0),
        })
    }
    fn minus(self, ms: f64) -> Self {
        Percentiles {
            p50: self.p50 - ms,
            p99: self.p99 - ms,
            max: self.max - ms,
        }
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    let m = xs.len() / 2;
    if xs.len() % 2 == 1 {
        xs[m]
    } else {
        (xs[m - 1] + xs[m]) / 2.0
    }
}

/// Median (min–max) over the runs of one percentile.
fn spread(runs: &[Percentiles], f: fn(&Percentiles) -> f64) -> (f64, f64, f64) {
    let xs: Vec<f64> = runs.iter().map(f).collect();
    let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (median(xs), min, max)
}

fn json(runs: &[Percentiles]) -> serde_json::Value {
    let field = |f: fn(&Percentiles) -> f64| {
        let (m, lo, hi) = spread(runs, f);
        serde_json::json!({"median": round3(m), "min": round3(lo), "max": round3(hi)})
    };
    serde_json::json!({
        "p50_ms": field(|p| p.p50),
        "p99_ms": field(|p| p.p99),
        "max_ms": field(|p| p.max),
        "runs": runs.iter().map(|p| serde_json::json!({
            "p50_ms": round3(p.p50), "p99_ms": round3(p.p99), "max_ms": round3(p.max)
        })).collect::<Vec<_>>(),
    })
}

fn cell(runs: &[Percentiles], f: fn(&Percentiles) -> f64) -> String {
    let (m, lo, hi) = spread(runs, f);
    if runs.len() == 1 {
        format!("{m:.2}")
    } else {
        format!("{m:.2} ({lo:.2}–{hi:.2})")
    }
}

struct Args {
    beat: PathBuf,
    worker: PathBuf,
    every: String,
    seconds: f64,
    warmup: f64,
    runs: usize,
    json: bool,
}

fn args() -> Result<Args> {
    let usage = "usage: bench_lag PATH/TO/drumline-beat PATH/TO/drumline-worker [--every 200ms] \
                 [--seconds 30] [--warmup 2] [--runs 1] [--json]";
    let (mut every, mut seconds, mut warmup, mut runs, mut json) =
        ("200ms".to_owned(), 30.0, 2.0, 1, false);
    let mut paths = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().context(usage);
        match arg.as_str() {
            "--every" => every = value()?,
            "--seconds" => seconds = value()?.parse().context(usage)?,
            "--warmup" => warmup = value()?.parse().context(usage)?,
            "--runs" => runs = value()?.parse().context(usage)?,
            "--json" => json = true,
            _ if arg.starts_with("--") => bail!("{usage}"),
            _ => paths.push(PathBuf::from(arg)),
        }
    }
    let [beat, worker]: [PathBuf; 2] = paths.try_into().map_err(|_| anyhow::anyhow!(usage))?;
    humantime_ns(&every)?;
    ensure!(seconds > 0.0 && runs > 0, "{usage}");
    Ok(Args {
        beat,
        worker,
        every,
        seconds,
        warmup,
        runs,
        json,
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args = args()?;
    let (mut raw, mut net, mut costs, mut probe) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut counted = 0;
    for r in 0..args.runs {
        let ns = format!(
            "bench_lag_{}_{}_{r}",
            std::process::id(),
            Utc::now().timestamp_millis()
        );
        let dir = std::env::temp_dir().join(&ns);
        std::fs::create_dir_all(&dir)?;
        let measured = match measurement_cost(&dir, 200) {
            Ok(cost) => run((&args.beat, &args.worker), &args, &ns, &dir)
                .await
                .map(|lags| (cost, lags)),
            Err(e) => Err(e),
        };
        let cleaned = cleanup(&ns).await;
        let _ = std::fs::remove_dir_all(&dir);
        let (cost, lags) = measured?;
        cleaned.context("cleanup")?;
        counted = lags.task.len();
        let cost = Percentiles::of(cost)?;
        let lag = Percentiles::of(lags.task)?;
        let delivered = Percentiles::of(lags.delivered)?;
        eprintln!(
            "run {}: lag p50 {:.2} p99 {:.2} max {:.2} ms over {counted} instants; \
             measurement cost p50 {:.2} p99 {:.2} ms; to the probe p50 {:.2} p99 {:.2} ms",
            r + 1,
            lag.p50,
            lag.p99,
            lag.max,
            cost.p50,
            cost.p99,
            delivered.p50,
            delivered.p99
        );
        probe.push(delivered);
        raw.push(lag);
        net.push(lag.minus(cost.p50));
        costs.push(cost);
    }
    if args.json {
        let out = serde_json::json!({
            "every": args.every,
            "seconds": args.seconds,
            "instants_counted_per_run": counted,
            "runs": args.runs,
            "instant_to_task_start": json(&raw),
            "instant_to_task_start_net_of_measurement": json(&net),
            "measurement_cost": json(&costs),
            "instant_to_delivery_at_a_probe_consumer": json(&probe),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "a job every {} through beat and worker, {} s ({counted} instants) per run, {} run(s), ms",
            args.every, args.seconds, args.runs
        );
        println!("{:<48} {:>20} {:>20} {:>20}", "", "p50", "p99", "max");
        for (name, runs) in [
            ("instant → `date` in the task (raw)", &raw),
            ("measurement: spawn `sh -c 'date'` → stamp", &costs),
            ("instant → task start (raw − median cost)", &net),
            ("instant → delivered to a probe consumer", &probe),
        ] {
            println!(
                "{:<48} {:>20} {:>20} {:>20}",
                name,
                cell(runs, |p| p.p50),
                cell(runs, |p| p.p99),
                cell(runs, |p| p.max)
            );
        }
    }
    Ok(())
}
