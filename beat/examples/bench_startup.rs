//! Beat start-up with many jobs, for `scripts/bench`:
//! `bench_startup PATH/TO/drumline-beat [JOBS]` (default 100,000).
//!
//! Writes a config of JOBS `every` jobs (one task) in a namespace of its own, then measures:
//! - parsing and checking that config (in process);
//! - loading every job's last instant from Redis, one `GET` per job (how the beat used to do
//!   it) against pipelined `MGET` batches ([`drumline_beat::progress::load_last`]);
//! - the real binary: time from spawn until it logs "beat leading", and its resident memory
//!   (VmRSS, and the peak VmHWM, from /proc/PID/status), on a first start and resumed with
//!   every job's last instant persisted.
//!
//! Nothing comes due while it runs (daily jobs whose next instant is 12 h away). Its Redis keys,
//! queues and exchanges are deleted at the end, whatever happened.

use anyhow::{bail, Context, Result};
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

/// One start of the real binary.
struct Startup {
    until_started: Duration,
    rss_kib: u64,
    hwm_kib: u64,
    settled_rss_kib: u64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let beat = PathBuf::from(
        args.next()
            .context("usage: bench_startup PATH/TO/drumline-beat [JOBS]")?,
    );
    let jobs: usize = match args.next() {
        Some(n) => n.parse().context("JOBS must be a number")?,
        None => 100_000,
    };
    let ns = format!(
        "bench_{}_{}",
        std::process::id(),
        Utc::now().timestamp_millis()
    );
    let dir = std::env::temp_dir().join(&ns);
    std::fs::create_dir_all(&dir)?;
    let result = bench(&beat, jobs, &ns, &dir).await;
    let cleaned = cleanup(&ns).await;
    let _ = std::fs::remove_dir_all(&dir);
    let report = result?;
    cleaned.context("cleanup")?;
    print!("{report}");
    Ok(())
}

async fn bench(beat: &Path, jobs: usize, ns: &str, dir: &Path) -> Result<String> {
    let config_path = dir.join("drumline.toml");
    write_config(&config_path, ns, jobs)?;
    let size_mib = std::fs::metadata(&config_path)?.len() as f64 / (1 << 20) as f64;

    let parsing = Instant::now();
    let config = Config::load(&config_path).map_err(|e| anyhow::anyhow!("{e}"))?;
    let parse = parsing.elapsed();

    let store = Store::connect(
        &config.redis_url,
        config.redis_ca_file.as_deref(),
        Names::new(ns),
    )
    .await?;

    // Binary, first start: no job has progress yet.
    let first = start_beat(beat, &config_path)?;

    // Every job's last instant persisted, as after a restart.
    let last = last_instant_text(Utc::now() - TimeDelta::hours(1));
    let mut conn = store.connection();
    for batch in config.jobs.chunks(10_000) {
        let mut pipe = redis::pipe();
        for job in batch {
            pipe.set(store.names().beat_last(&job.name), &last).ignore();
        }
        pipe.query_async::<()>(&mut conn).await?;
    }

    let one_by_one = Instant::now();
    for job in &config.jobs {
        store.last_published(&job.name).await?;
    }
    let one_by_one = one_by_one.elapsed();

    let batched = Instant::now();
    let loaded = load_last(&store, &config.jobs).await?;
    let batched = batched.elapsed();
    if loaded.iter().any(Option::is_none) {
        bail!("load_last missed some persisted instants");
    }

    let resumed = start_beat(beat, &config_path)?;

    let mut out = String::new();
    writeln!(
        out,
        "beat start-up, {jobs} `every` jobs (config {size_mib:.1} MiB)"
    )?;
    writeln!(out, "{:<52} {:>12}", "step", "result")?;
    let ms = |d: Duration| format!("{:.0} ms", d.as_secs_f64() * 1000.0);
    let mib = |kib: u64| format!("{:.1} MiB", kib as f64 / 1024.0);
    let rows = [
        ("parse + check the config (in process)", ms(parse)),
        ("load last instants: one GET per job (old)", ms(one_by_one)),
        (
            "load last instants: pipelined MGET batches (new)",
            ms(batched),
        ),
        (
            "binary, first start: spawn -> \"beat leading\"",
            ms(first.until_started),
        ),
        ("binary, first start: VmRSS at start", mib(first.rss_kib)),
        (
            "binary, first start: VmRSS 2 s later (broker up)",
            mib(first.settled_rss_kib),
        ),
        ("binary, first start: VmHWM (peak)", mib(first.hwm_kib)),
        (
            "binary, resumed: spawn -> \"beat leading\"",
            ms(resumed.until_started),
        ),
        ("binary, resumed: VmRSS at start", mib(resumed.rss_kib)),
        (
            "binary, resumed: VmRSS 2 s later (broker up)",
            mib(resumed.settled_rss_kib),
        ),
        ("binary, resumed: VmHWM (peak)", mib(resumed.hwm_kib)),
    ];
    for (step, result) in rows {
        writeln!(out, "{step:<52} {result:>12}")?;
    }
    Ok(out)
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
    std::thread::sleep(Duration::from_secs(2));
    let (settled_rss_kib, hwm_kib) = memory(pid)?;
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
    })
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
