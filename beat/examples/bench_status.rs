//! `status` with many run records, for `scripts/bench`:
//! `bench_status PATH/TO/drumline-beat [RECORDS] [JOBS]` (default 600,000 and 100).
//!
//! In a namespace of its own: a config of JOBS daily jobs, its topology declared, and Redis
//! filled (pipelined) as a busy schedule leaves it: RECORDS run records `{ns}:run:{job}@{instant}`
//! (`done`, spread over the jobs; a 1 s job keeps about 600,000 under the default 7-day
//! `done_ttl`), every job's full history (1,000 records), progress, last success and last
//! failure, and [`RUNNING_PER_JOB`] instances of each job claimed through the real claim script.
//! Then it measures:
//! - the real binary, `drumline-beat status --json`, [`RUNS`] times: median and spread; every
//!   run's output is checked (JOBS jobs, each with its running instances, a last success and
//!   failure, `dead_letters` 0);
//! - in process, the same read ([`Store::job_histories`]);
//! - in process, the old way for comparison: one `SCAN` over `{ns}:run:*`, then every key's
//!   `state` pipelined (what `status` did before `{ns}:running:{job}`).
//!
//! Its Redis keys, queues and exchanges are deleted at the end, whatever happened.

use anyhow::{ensure, Context, Result};
use chrono::{TimeDelta, Utc};
use drumline_shared::broker;
use drumline_shared::config::Config;
use drumline_shared::names::Names;
use drumline_shared::store::{last_instant_text, Claim, ClaimRequest, OverlapMode, Store};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "common/mod.rs"]
mod common;
use common::{cleanup, write_config};

/// Timed runs of the binary.
const RUNS: usize = 3;

/// Instances of each job claimed (running) while `status` is timed.
const RUNNING_PER_JOB: u64 = 2;

/// Run records kept per job's history (`HISTORY_LEN`).
const HISTORY: usize = 1000;

/// Commands per pipelined round trip while filling Redis.
const FILL_BATCH: usize = 10_000;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let beat = PathBuf::from(
        args.next()
            .context("usage: bench_status PATH/TO/drumline-beat [RECORDS] [JOBS]")?,
    );
    let number = |text: Option<String>, default: usize| -> Result<usize> {
        text.map_or(Ok(default), |t| t.parse().context("not a number"))
    };
    let records = number(args.next(), 600_000)?;
    let jobs = number(args.next(), 100)?.max(1);
    let ns = format!(
        "bench_status_{}_{}",
        std::process::id(),
        Utc::now().timestamp_millis()
    );
    let dir = std::env::temp_dir().join(&ns);
    std::fs::create_dir_all(&dir)?;
    let result = bench(&beat, records, jobs, &ns, &dir).await;
    let cleaned = cleanup(&ns).await;
    let _ = std::fs::remove_dir_all(&dir);
    let report = result?;
    cleaned.context("cleanup")?;
    print!("{report}");
    Ok(())
}

async fn bench(beat: &Path, records: usize, jobs: usize, ns: &str, dir: &Path) -> Result<String> {
    let config_path = dir.join("drumline.toml");
    write_config(&config_path, ns, jobs)?;
    let config = Config::load(&config_path).map_err(|e| anyhow::anyhow!("{e}"))?;
    let names = Names::new(ns);
    let (conn, _) = broker::open_channel(
        &config,
        &names,
        &["default".to_owned()],
        config.worker.dead_ttl,
    )
    .await?;
    let _ = conn.close(200, "topology declared".into()).await;
    let store = Store::connect(&config.redis_url, config.redis_ca_file.as_deref(), names).await?;
    let job_names: Vec<&str> = config.jobs.iter().map(|j| j.name.as_str()).collect();

    let filling = Instant::now();
    fill(&store, &job_names, records).await?;
    let filled = filling.elapsed();

    let mut binary = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        binary.push(run_status(beat, &config_path, jobs)?);
    }
    binary.sort();

    let reading = Instant::now();
    let histories = store.job_histories(&job_names).await?;
    let in_process = reading.elapsed();
    ensure!(
        histories.iter().all(|h| h.running == RUNNING_PER_JOB),
        "job_histories: wrong running counts"
    );

    let scanning = Instant::now();
    let (scanned, running) = old_running_counts(&store).await?;
    let old = scanning.elapsed();
    ensure!(
        running == RUNNING_PER_JOB * jobs as u64,
        "old way: {running} running"
    );

    let mut out = String::new();
    writeln!(
        out,
        "status with {records} run records ({scanned} run keys in all), {jobs} jobs; Redis filled in {:.1} s",
        filled.as_secs_f64()
    )?;
    writeln!(out, "{:<62} {:>20}", "step", "result")?;
    let ms = |d: Duration| format!("{:.0} ms", d.as_secs_f64() * 1000.0);
    let median = binary[RUNS / 2];
    let spread = format!(
        "{} (min {} max {})",
        ms(median),
        ms(binary[0]),
        ms(binary[RUNS - 1])
    );
    let rows = [
        (
            format!("binary: `drumline-beat status --json`, median of {RUNS}"),
            spread,
        ),
        (
            "in process: Store::job_histories (all jobs)".to_owned(),
            ms(in_process),
        ),
        (
            "in process, old way: SCAN {ns}:run:* + HGET state".to_owned(),
            ms(old),
        ),
    ];
    for (step, result) in rows {
        writeln!(out, "{step:<62} {result:>20}")?;
    }
    Ok(out)
}

/// Fills Redis as a busy schedule leaves it (see the module doc).
async fn fill(store: &Store, jobs: &[&str], records: usize) -> Result<()> {
    let names = store.names();
    let mut conn = store.connection();
    let start = Utc::now() - TimeDelta::days(7);
    let instant = |i: usize| last_instant_text(start + TimeDelta::seconds(i as i64));
    let week_ms = 7 * 24 * 3600 * 1000_u64;
    // Run records, round-robin over the jobs, one second apart per job.
    for from in (0..records).step_by(FILL_BATCH) {
        let mut pipe = redis::pipe();
        for i in from..(from + FILL_BATCH).min(records) {
            let job = jobs[i % jobs.len()];
            let key = names.run_key(&format!("{job}@{}", instant(i / jobs.len())));
            pipe.hset_multiple(
                &key,
                &[
                    ("state", "done"),
                    ("token", "bench"),
                    ("worker", "bench-worker"),
                    ("attempt", "0"),
                ],
            )
            .ignore()
            .pexpire(&key, week_ms as i64)
            .ignore();
        }
        pipe.query_async::<()>(&mut conn).await?;
    }
    // Per job: a full history, progress, last success and failure.
    for job in jobs {
        let history: Vec<String> = (0..HISTORY)
            .map(|i| {
                serde_json::json!({
                    "key": format!("{job}@{}", instant(i)),
                    "scheduled_for": instant(i),
                    "status": if i % 10 == 0 { "failed" } else { "done" },
                    "attempt": 0,
                    "worker": "bench-worker",
                    "started_at": instant(i),
                    "finished_at": instant(i),
                    "error": null,
                })
                .to_string()
            })
            .collect();
        let now = last_instant_text(Utc::now());
        redis::pipe()
            .lpush(names.history(job), history)
            .ignore()
            .set(names.beat_last(job), &now)
            .ignore()
            .set(names.last_success(job), &now)
            .ignore()
            .set(names.last_failure(job), &now)
            .ignore()
            .query_async::<()>(&mut conn)
            .await?;
    }
    // Instances running now, claimed as a worker claims them.
    for job in jobs {
        for n in 0..RUNNING_PER_JOB {
            let key = format!("{job}@running-{n}");
            let claim = store
                .claim(&ClaimRequest {
                    key: &key,
                    token: "bench",
                    worker: "bench-worker",
                    job: Some(job),
                    attempt: 0,
                    lease: Duration::from_secs(600),
                    overlap: OverlapMode::Allow,
                    retention: Duration::from_secs(600),
                    expired: false,
                    limit: None,
                    epoch: 0,
                })
                .await?;
            ensure!(matches!(claim, Claim::Claimed { .. }), "{key}: {claim:?}");
        }
    }
    Ok(())
}

/// Runs `status --json` once; checks what it printed; returns how long it took.
fn run_status(beat: &Path, config: &Path, jobs: usize) -> Result<Duration> {
    let started = Instant::now();
    let out = Command::new(beat)
        .arg("--config")
        .arg(config)
        .args(["status", "--json"])
        .env("RUST_LOG", "warn")
        .env_remove("DRUMLINE_CONFIG")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot start {}", beat.display()))?;
    let took = started.elapsed();
    ensure!(
        out.status.success(),
        "status exited with {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let status: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let listed = status["jobs"].as_array().context("no jobs in the output")?;
    ensure!(listed.len() == jobs, "{} jobs listed", listed.len());
    ensure!(
        status["dead_letters"] == 0,
        "dead_letters: {}",
        status["dead_letters"]
    );
    for job in listed {
        ensure!(
            job["running"] == RUNNING_PER_JOB
                && job["last_success"].is_string()
                && job["last_failure"].is_string(),
            "{job}"
        );
    }
    Ok(took)
}

/// What `status` did before `{ns}:running:{job}`: every run key found by one `SCAN`, then
/// their states pipelined, 1,000 per round trip. Returns (keys scanned, running instances).
async fn old_running_counts(store: &Store) -> Result<(usize, u64)> {
    let mut conn = store.connection();
    let pattern = format!("{}*", store.names().run_key(""));
    let mut keys = Vec::new();
    {
        let mut iter: redis::AsyncIter<String> =
            redis::AsyncCommands::scan_match(&mut conn, pattern).await?;
        while let Some(key) = iter.next_item().await {
            keys.push(key?);
        }
    }
    let mut running = 0;
    for chunk in keys.chunks(1000) {
        let mut pipe = redis::pipe();
        for key in chunk {
            pipe.hget(key, "state");
        }
        let states: Vec<Option<String>> = pipe.query_async(&mut conn).await?;
        running += states
            .iter()
            .filter(|s| s.as_deref() == Some("running"))
            .count() as u64;
    }
    Ok((keys.len(), running))
}
