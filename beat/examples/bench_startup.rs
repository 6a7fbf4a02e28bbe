//! Beat start-up with many jobs, for `scripts/bench`:
//! `bench_startup [--jobs N] [--runs R] PATH/TO/drumline-beat [PATH/TO/other-drumline-beat …]`
//! (default 100,000 jobs, 3 runs).
//!
//! Writes a config of N `every` jobs (one task) in a namespace of its own, then measures, R
//! times each (median and min–max):
//! - parsing and checking that config in process, and what it costs on the heap: the bytes the
//!   checked config holds afterwards and the most that were live while it loaded (a counting
//!   allocator; VmRSS cannot tell, the C allocator keeps freed pages);
//! - loading every job's last instant from Redis with pipelined `MGET` batches
//!   ([`drumline_beat::progress::load_last`]), against one `GET` per job (how the beat used to
//!   do it; once, it takes seconds);
//! - each real binary: time from spawn until it logs "beat leading", its resident memory then
//!   and once it has settled (VmRSS), its peak (VmHWM), from /proc/PID/status; how long it
//!   stays busy after leading (a first start writes the new jobs' starts then: until a second
//!   in which it used at most one 10 ms tick of CPU) and the CPU it uses in the 2 s after
//!   that, while nothing is due (idle); on a first start (no progress in Redis) and resumed
//!   (every job's last instant persisted). With several binaries (say a build of an older
//!   commit) their runs are interleaved, so they share the machine's noise.
//!
//! - with `--status`, `drumline-beat status --json` of the whole config, every job's progress
//!   persisted (once per run, the first binary): time to its first job row and to its end,
//!   the bytes written and the peak memory seen while it wrote them.
//!
//! - with `--json-file PATH`, the first binary's medians written there as JSON too (for the
//!   targets table at the end of `scripts/bench`).
//!
//! Above 200,000 jobs the one-`GET`-per-job comparison is skipped (it takes minutes).
//!
//! Nothing comes due while it runs (daily jobs whose next instant is 12 h away). Its Redis keys,
//! queues and exchanges are deleted at the end, whatever happened.

use anyhow::{bail, ensure, Context, Result};
use chrono::{TimeDelta, Utc};
use drumline_beat::progress::load_last;
use drumline_shared::config::Config;
use drumline_shared::names::Names;
use drumline_shared::store::{last_instant_text, Store};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[path = "common/mod.rs"]
mod common;
use common::{cleanup, spawn_beat, write_config, SpawnedBeat};

#[path = "common/counting.rs"]
mod counting;

#[global_allocator]
static HEAP: counting::Counting = counting::Counting;

/// One start of a real binary.
struct Startup {
    until_started: Duration,
    rss_kib: u64,
    hwm_kib: u64,
    settled_rss_kib: u64,
    /// Whole seconds from leading until a second with at most one tick of CPU.
    busy: u64,
    /// CPU (user + system) used in the 2 s after that, in ms (10 ms ticks).
    idle_cpu_ms: u64,
}

/// The starts of one binary: first starts and resumed ones.
#[derive(Default)]
struct Starts {
    first: Vec<Startup>,
    resumed: Vec<Startup>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let usage = "usage: bench_startup [--jobs N] [--runs R] [--status] [--json-file PATH] \
         PATH/TO/drumline-beat [OTHER-BEAT …]";
    let (mut jobs, mut runs, mut status) = (100_000usize, 3usize, false);
    let mut json_file: Option<PathBuf> = None;
    let mut beats = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--jobs" => jobs = args.next().context(usage)?.parse().context("--jobs N")?,
            "--runs" => runs = args.next().context(usage)?.parse().context("--runs R")?,
            "--status" => status = true,
            "--json-file" => json_file = Some(args.next().context(usage)?.into()),
            _ => beats.push(PathBuf::from(arg)),
        }
    }
    ensure!(!beats.is_empty() && jobs > 0 && runs > 0, "{usage}");
    let ns = format!(
        "bench_{}_{}",
        std::process::id(),
        Utc::now().timestamp_millis()
    );
    let dir = std::env::temp_dir().join(&ns);
    std::fs::create_dir_all(&dir)?;
    let result = bench(&beats, (jobs, runs, status), &ns, &dir).await;
    let cleaned = cleanup(&ns).await;
    let _ = std::fs::remove_dir_all(&dir);
    let (report, figures) = result?;
    cleaned.context("cleanup")?;
    print!("{report}");
    if let Some(path) = json_file {
        std::fs::write(&path, serde_json::to_string_pretty(&figures)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

async fn bench(
    beats: &[PathBuf],
    (jobs, runs, status): (usize, usize, bool),
    ns: &str,
    dir: &Path,
) -> Result<(String, serde_json::Value)> {
    let config_path = dir.join("drumline.toml");
    write_config(&config_path, ns, jobs)?;
    let size_mib = std::fs::metadata(&config_path)?.len() as f64 / (1 << 20) as f64;

    // In process: time, and the heap the load needs and keeps.
    let mut parses = Vec::new();
    let (mut held, mut peak) = (0, 0);
    for _ in 0..runs {
        let before = counting::reset_peak();
        let parsing = Instant::now();
        let config = Config::load(&config_path).map_err(|e| anyhow::anyhow!("{e}"))?;
        parses.push(parsing.elapsed());
        held = counting::live() - before;
        peak = counting::peak() - before;
        drop(config);
    }
    let config = Config::load(&config_path).map_err(|e| anyhow::anyhow!("{e}"))?;

    let store = Store::connect(
        &config.redis_url,
        config.redis_ca_file.as_deref(),
        Names::new(ns),
    )
    .await?;

    let mut starts: Vec<Starts> = beats.iter().map(|_| Starts::default()).collect();
    let mut batched = Vec::new();
    let mut statuses: Vec<StatusRun> = Vec::new();
    // One GET per job takes minutes above this.
    let mut one_by_one = (jobs > 200_000).then_some(None);
    for _ in 0..runs {
        // First start: no job has progress yet (the last run's start is deleted).
        for (beat, starts) in beats.iter().zip(&mut starts) {
            cleanup(ns).await.context("cleanup between runs")?;
            starts.first.push(start_beat(beat, &config_path)?);
        }
        // Every job's last instant persisted, as after a restart.
        persist_progress(&store, &config).await?;
        if one_by_one.is_none() {
            let started = Instant::now();
            for job in &config.jobs {
                store.last_published(&job.name).await?;
            }
            one_by_one = Some(Some(started.elapsed()));
        }
        if status {
            statuses.push(status_run(&beats[0], &config_path)?);
        }
        let started = Instant::now();
        let loaded = load_last(&store, &config.jobs).await?;
        batched.push(started.elapsed());
        if loaded.iter().any(Option::is_none) {
            bail!("load_last missed some persisted instants");
        }
        for (beat, starts) in beats.iter().zip(&mut starts) {
            starts.resumed.push(start_beat(beat, &config_path)?);
        }
    }

    let figures = figures(jobs, &starts[0], &statuses);
    let mut out = String::new();
    writeln!(
        out,
        "beat start-up, {jobs} `every` jobs (config {size_mib:.1} MiB), {runs} runs: median (min–max)"
    )?;
    writeln!(out, "{:<56} {:>24}", "step", "result")?;
    let mib = |bytes: usize| format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64);
    let mut rows: Vec<(String, String)> = vec![
        (
            "parse + check the config (in process)".into(),
            spread(&parses, ms),
        ),
        ("  heap held by the checked config".into(), mib(held)),
        ("  heap peak while loading it".into(), mib(peak)),
        (
            "load last instants: one GET per job (old, once)".into(),
            match one_by_one {
                Some(Some(took)) => ms(took),
                Some(None) => "skipped".into(),
                None => "skipped (over 200,000 jobs)".into(),
            },
        ),
        (
            "load last instants: pipelined MGET batches".into(),
            spread(&batched, ms),
        ),
    ];
    for (beat, starts) in beats.iter().zip(&starts) {
        let name = if beats.len() == 1 {
            "binary".to_owned()
        } else {
            format!("{}", beat.display())
        };
        for (kind, runs) in [("first start", &starts.first), ("resumed", &starts.resumed)] {
            let of = |f: fn(&Startup) -> u64| runs.iter().map(f).collect::<Vec<u64>>();
            rows.extend([
                (
                    format!("{name}, {kind}: spawn -> \"beat leading\""),
                    spread(
                        &runs.iter().map(|s| s.until_started).collect::<Vec<_>>(),
                        ms,
                    ),
                ),
                (
                    format!("{name}, {kind}: VmRSS at start"),
                    spread(&of(|s| s.rss_kib), kib),
                ),
                (
                    format!("{name}, {kind}: VmRSS once settled"),
                    spread(&of(|s| s.settled_rss_kib), kib),
                ),
                (
                    format!("{name}, {kind}: VmHWM (peak)"),
                    spread(&of(|s| s.hwm_kib), kib),
                ),
                (
                    format!("{name}, {kind}: busy after leading"),
                    spread(&of(|s| s.busy), |v| format!("{v} s")),
                ),
                (
                    format!("{name}, {kind}: CPU in 2 s, settled"),
                    spread(&of(|s| s.idle_cpu_ms), |v| format!("{v} ms")),
                ),
            ]);
        }
    }
    if !statuses.is_empty() {
        let of = |f: fn(&StatusRun) -> u64| statuses.iter().map(f).collect::<Vec<u64>>();
        rows.extend([
            (
                "status --json: spawn -> first job row".into(),
                spread(&of(|s| s.first_row_ms), |v| format!("{v} ms")),
            ),
            (
                "status --json: spawn -> end".into(),
                spread(&of(|s| s.end_ms), |v| format!("{v} ms")),
            ),
            (
                "status --json: bytes written".into(),
                spread(&of(|s| s.bytes), |b| format!("{:.0} MB", b as f64 / 1e6)),
            ),
            (
                "status --json: VmHWM (peak) seen".into(),
                spread(&of(|s| s.hwm_kib), kib),
            ),
        ]);
    }
    for (step, result) in rows {
        writeln!(out, "{step:<56} {result:>24}")?;
    }
    Ok((out, figures))
}

/// The first binary's medians, as `--json-file` writes them.
fn figures(jobs: usize, starts: &Starts, statuses: &[StatusRun]) -> serde_json::Value {
    let starts_json = |runs: &[Startup]| {
        let of = |f: fn(&Startup) -> u64| median_u64(runs.iter().map(f).collect());
        serde_json::json!({
            "leading_ms": median_u64(runs.iter().map(|s| s.until_started.as_millis() as u64).collect()),
            "rss_kib": of(|s| s.rss_kib),
            "settled_rss_kib": of(|s| s.settled_rss_kib),
            "hwm_kib": of(|s| s.hwm_kib),
        })
    };
    let status = (!statuses.is_empty()).then(|| {
        let of = |f: fn(&StatusRun) -> u64| median_u64(statuses.iter().map(f).collect());
        serde_json::json!({
            "first_row_ms": of(|s| s.first_row_ms),
            "end_ms": of(|s| s.end_ms),
        })
    });
    serde_json::json!({
        "jobs": jobs,
        "first_start": starts_json(&starts.first),
        "resumed": starts_json(&starts.resumed),
        "status": status,
    })
}

/// The middle value (the upper one of an even count).
fn median_u64(mut values: Vec<u64>) -> u64 {
    values.sort_unstable();
    values.get(values.len() / 2).copied().unwrap_or(0)
}

/// One `status --json`.
struct StatusRun {
    first_row_ms: u64,
    end_ms: u64,
    bytes: u64,
    hwm_kib: u64,
}

/// Runs `beat status --json` on `config`, reading its output as it comes.
fn status_run(beat: &Path, config: &Path) -> Result<StatusRun> {
    use std::io::Read;
    let started = Instant::now();
    let mut child = Command::new(beat)
        .arg("--config")
        .arg(config)
        .args(["status", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let pid = child.id();
    let mut stdout = child.stdout.take().context("stdout")?;
    let mut buf = vec![0u8; 1 << 16];
    let (mut bytes, mut first_row, mut hwm_kib) = (0u64, None, 0);
    loop {
        let n = stdout.read(&mut buf)?;
        if n == 0 {
            break;
        }
        bytes += n as u64;
        if first_row.is_none() && buf[..n].windows(6).any(|w| w == b"\"job\":") {
            first_row = Some(started.elapsed());
        }
        if let Ok((_, hwm)) = memory(pid) {
            hwm_kib = hwm;
        }
    }
    let status = child.wait()?;
    let end = started.elapsed();
    ensure!(status.success(), "status --json exited with {status}");
    Ok(StatusRun {
        first_row_ms: first_row.context("no job row")?.as_millis() as u64,
        end_ms: end.as_millis() as u64,
        bytes,
        hwm_kib,
    })
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

fn kib(k: u64) -> String {
    format!("{:.1} MiB", k as f64 / 1024.0)
}

/// `median (min–max)` of `values`, each shown by `show`; just the value for one run.
fn spread<T: Ord + Copy>(values: &[T], show: fn(T) -> String) -> String {
    let mut sorted = values.to_vec();
    sorted.sort();
    match sorted.as_slice() {
        [] => String::new(),
        [one] => show(*one),
        all => format!(
            "{} ({}–{})",
            show(all[all.len() / 2]),
            show(all[0]),
            show(all[all.len() - 1])
        ),
    }
}

/// Sets every job's `{ns}:beat:last:{job}` to an hour ago.
async fn persist_progress(store: &Store, config: &Config) -> Result<()> {
    let last = last_instant_text(Utc::now() - TimeDelta::hours(1));
    let mut conn = store.connection();
    for batch in config.jobs.chunks(10_000) {
        let mut pipe = redis::pipe();
        for job in batch {
            pipe.set(store.names().beat_last(&job.name), &last).ignore();
        }
        pipe.query_async::<()>(&mut conn).await?;
    }
    Ok(())
}

/// Starts the beat, waits for "beat leading", samples its memory, stops it (SIGTERM).
fn start_beat(beat: &Path, config: &Path) -> Result<Startup> {
    let spawned = Instant::now();
    let SpawnedBeat {
        mut child,
        leading: started_rx,
        log_tail: reader,
    } = spawn_beat(beat, config)?;
    let pid = child.id();
    let started = started_rx.recv_timeout(Duration::from_secs(300));
    let (rss_kib, _) = memory(pid)?;
    // Busy until a second with at most one tick (a minute at most: then it is reported busy
    // for that long and the idle figure says what it was still doing).
    let mut ticks = cpu_ticks(pid)?;
    let mut busy = 0;
    while busy < 60 {
        std::thread::sleep(Duration::from_secs(1));
        let now = cpu_ticks(pid)?;
        let quiet = now - ticks <= 1;
        ticks = now;
        if quiet {
            break;
        }
        busy += 1;
    }
    std::thread::sleep(Duration::from_secs(2));
    let (settled_rss_kib, hwm_kib) = memory(pid)?;
    let idle_cpu_ms = (cpu_ticks(pid)? - ticks) * 10;
    Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status()?;
    let status = child.wait()?;
    let tail = reader.join().unwrap_or_default();
    let Ok(started) = started else {
        bail!("the beat never logged \"beat leading\" ({status})\n{tail}");
    };
    if !status.success() {
        bail!("the beat exited with {status}\n{tail}");
    }
    Ok(Startup {
        until_started: started - spawned,
        rss_kib,
        hwm_kib,
        settled_rss_kib,
        busy,
        idle_cpu_ms,
    })
}

/// CPU clock ticks (user + system, 10 ms each) process `pid` has used, from /proc/PID/stat.
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The fields after the command name (which may hold spaces); utime and stime are the 14th
    // and 15th overall.
    let rest = stat.rsplit_once(") ").context("a /proc stat line")?.1;
    let fields: Vec<&str> = rest.split(' ').collect();
    Ok(fields[11].parse::<u64>()? + fields[12].parse::<u64>()?)
}

/// (VmRSS, VmHWM) in KiB.
fn memory(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("no {name} in /proc/{pid}/status"))?;
        Ok(line.split_whitespace().nth(1).context("value")?.parse()?)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}
