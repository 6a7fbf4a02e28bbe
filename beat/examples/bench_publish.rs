//! Publishing many instances due at once, for `scripts/bench`:
//! `bench_publish [--jobs N] [--runs R] [--json-file PATH] PATH/TO/drumline-beat
//! [PATH/TO/other-drumline-beat …]` (default 10,000 jobs, 3 runs; each run measures every beat
//! and then the bare broker, and the report gives the median and min–max of each, and the ratio
//! per run; `--json-file` also writes the times, in ms, as JSON to PATH, so `scripts/bench` can
//! set a peer's figure beside them from one run).
//!
//! For each beat binary, in a namespace of its own: a config of N `every = "1m"` jobs whose
//! `anchor` puts one instant of every job at the same instant T, a few seconds after the beat
//! started; the measure is the time from T until `{ns}.q.default` holds N messages (polled with
//! a passive declare every 10 ms), checked afterwards: exactly N messages, and every job's
//! progress `{ns}:beat:last:{job}` persisted at T. Give a build of an older commit as a second
//! binary to compare.
//!
//! Then, in the same run, the bare broker: N envelopes of the same size published by one
//! connection to the same exchange and queue, every publish sent before the first confirm is
//! awaited (mandatory, persistent, confirms awaited in order); measured from the first publish
//! until the last confirm. The ratio beat / bare broker is what the beat adds.
//!
//! Everything a namespace created (Redis keys, queues, exchanges) is deleted at the end,
//! whatever happened.

use anyhow::{bail, ensure, Context, Result};
use chrono::{DateTime, DurationRound, SecondsFormat, TimeDelta, Utc};
use drumline_shared::envelope::Envelope;
use drumline_shared::names::Names;
use drumline_shared::store::last_instant_text;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::Confirmation;
use lapin::{Channel, Connection, ConnectionProperties};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[path = "common/mod.rs"]
mod common;
use common::{amqp_url, cleanup, redis_url, spawn_beat, SpawnedBeat};

/// How long after the beat is spawned the common instant T falls: start-up with 100,000 jobs
/// takes about a second.
const LEAD: TimeDelta = TimeDelta::seconds(5);

/// Gives up waiting for the N messages after this long past T.
const PATIENCE: Duration = Duration::from_secs(600);

/// One beat run.
struct BeatRun {
    /// From T until the queue held N messages.
    all_queued: Duration,
    /// From T until the first message was seen.
    first_seen: Duration,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let usage = "usage: bench_publish [--jobs N] [--runs R] [--json-file PATH] \
                 PATH/TO/drumline-beat [OTHER-BEAT …]";
    let (mut jobs, mut runs) = (10_000usize, 3usize);
    let mut json_file: Option<PathBuf> = None;
    let mut beats = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--jobs" => jobs = args.next().context(usage)?.parse().context("--jobs N")?,
            "--runs" => runs = args.next().context(usage)?.parse().context("--runs R")?,
            "--json-file" => json_file = Some(args.next().context(usage)?.into()),
            _ => beats.push(PathBuf::from(arg)),
        }
    }
    ensure!(!beats.is_empty() && jobs > 0 && runs > 0, "{usage}");

    let base = format!(
        "bench_pub_{}_{}",
        std::process::id(),
        Utc::now().timestamp_millis()
    );
    // Interleaved: each run measures every beat, then the bare broker, so they share the
    // machine's noise.
    let mut beat_runs: Vec<Vec<BeatRun>> = beats.iter().map(|_| Vec::new()).collect();
    let mut bare_runs = Vec::new();
    for run in 0..runs {
        for (i, beat) in beats.iter().enumerate() {
            let ns = format!("{base}_{run}_{i}");
            let dir = std::env::temp_dir().join(&ns);
            std::fs::create_dir_all(&dir)?;
            let result = bench_beat(beat, jobs, &ns, &dir).await;
            let cleaned = cleanup(&ns).await;
            let _ = std::fs::remove_dir_all(&dir);
            let measured = result.with_context(|| format!("beat {}", beat.display()))?;
            cleaned.context("cleanup")?;
            beat_runs[i].push(measured);
        }
        let ns = format!("{base}_{run}_bare");
        let bare = bench_bare(jobs, &ns).await;
        let cleaned = cleanup(&ns).await;
        bare_runs.push(bare.context("bare broker")?);
        cleaned.context("cleanup")?;
    }

    let mut out = String::new();
    writeln!(
        out,
        "publishing one instance of each of {jobs} jobs due at the same instant, {runs} runs: \
         median (min–max)"
    )?;
    writeln!(out, "{:<52} {:>26} {:>8}", "", "time", "msg/s")?;
    let row = |out: &mut String, what: &str, times: &[Duration]| {
        let median = median(times);
        let _ = writeln!(
            out,
            "{what:<52} {:>26} {:>8.0}",
            spread(times),
            jobs as f64 / median.as_secs_f64()
        );
    };
    for (beat, runs) in beats.iter().zip(&beat_runs) {
        let all: Vec<Duration> = runs.iter().map(|r| r.all_queued).collect();
        let first: Vec<Duration> = runs.iter().map(|r| r.first_seen).collect();
        row(
            &mut out,
            &format!("beat {}: T -> all N queued", name(beat)),
            &all,
        );
        writeln!(
            out,
            "{:<52} {:>26}",
            "  (T -> first message seen)",
            spread(&first)
        )?;
    }
    row(
        &mut out,
        "bare broker: N pipelined publishes -> last confirm",
        &bare_runs,
    );
    for (beat, runs) in beats.iter().zip(&beat_runs) {
        // Per run, against the bare broker of the same run.
        let mut ratios: Vec<f64> = runs
            .iter()
            .zip(&bare_runs)
            .map(|(r, b)| r.all_queued.as_secs_f64() / b.as_secs_f64())
            .collect();
        ratios.sort_by(f64::total_cmp);
        let all: Vec<Duration> = runs.iter().map(|r| r.all_queued).collect();
        writeln!(
            out,
            "ratio beat / bare broker ({}): {:.2} of the medians (per run {:.2}–{:.2})",
            name(beat),
            median(&all).as_secs_f64() / median(&bare_runs).as_secs_f64(),
            ratios[0],
            ratios[ratios.len() - 1]
        )?;
    }
    print!("{out}");
    if let Some(path) = json_file {
        let json = report_json(jobs, &beats, &beat_runs, &bare_runs);
        std::fs::write(&path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("--json-file {}", path.display()))?;
    }
    Ok(())
}

/// The runs' times in ms, each as median, min, max and the runs in order.
fn report_json(
    jobs: usize,
    beats: &[PathBuf],
    beat_runs: &[Vec<BeatRun>],
    bare_runs: &[Duration],
) -> serde_json::Value {
    let ms = |times: Vec<Duration>| {
        let runs: Vec<f64> = times.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
        let mut sorted = runs.clone();
        sorted.sort_by(f64::total_cmp);
        serde_json::json!({
            "median": sorted[sorted.len() / 2],
            "min": sorted[0],
            "max": sorted[sorted.len() - 1],
            "runs": runs,
        })
    };
    let beats: Vec<_> = beats
        .iter()
        .zip(beat_runs)
        .map(|(beat, runs)| {
            serde_json::json!({
                "beat": name(beat),
                "all_queued_ms": ms(runs.iter().map(|r| r.all_queued).collect()),
                "first_seen_ms": ms(runs.iter().map(|r| r.first_seen).collect()),
            })
        })
        .collect();
    serde_json::json!({
        "jobs": jobs,
        "runs": bare_runs.len(),
        "beats": beats,
        "bare_ms": ms(bare_runs.to_vec()),
    })
}

/// The binary's file name and its directory's, enough to tell builds apart.
fn name(beat: &Path) -> String {
    let mut parts: Vec<_> = beat.iter().rev().take(3).collect();
    parts.reverse();
    parts.iter().collect::<PathBuf>().display().to_string()
}

fn median(times: &[Duration]) -> Duration {
    let mut sorted = times.to_vec();
    sorted.sort();
    sorted[sorted.len() / 2]
}

/// `median (min–max)` in ms; just the value for one run.
fn spread(times: &[Duration]) -> String {
    let ms = |d: Duration| format!("{:.0}", d.as_secs_f64() * 1000.0);
    let mut sorted = times.to_vec();
    sorted.sort();
    match sorted.as_slice() {
        [one] => format!("{} ms", ms(*one)),
        all => format!(
            "{} ms ({}–{})",
            ms(all[all.len() / 2]),
            ms(all[0]),
            ms(all[all.len() - 1])
        ),
    }
}

async fn bench_beat(beat: &Path, jobs: usize, ns: &str, dir: &Path) -> Result<BeatRun> {
    let due = Utc::now().duration_trunc(TimeDelta::seconds(1))? + LEAD;
    let config = dir.join("drumline.toml");
    write_config(&config, ns, jobs, due)?;
    let names = Names::new(ns);
    let queue = names.work_queue("default");

    let SpawnedBeat {
        mut child,
        leading: started_rx,
        log_tail: reader,
    } = spawn_beat(beat, &config)?;
    let pid = child.id();

    let measured = async {
        started_rx
            .recv_timeout(Duration::from_secs(60))
            .context("the beat never logged \"beat leading\"")?;
        ensure!(
            Utc::now() < due,
            "the beat started after the common instant; raise LEAD"
        );
        let amqp = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
        let mut channel = amqp.create_channel().await?;
        let mut first_seen = None;
        let until = Utc::now() + TimeDelta::from_std(PATIENCE)?;
        let all_queued = loop {
            let count = match queue_len(&channel, &queue).await {
                Some(n) => n as usize,
                None => {
                    // Not declared yet: the broker closed the channel (404).
                    channel = amqp.create_channel().await?;
                    0
                }
            };
            let since_due = (Utc::now() - due).to_std().unwrap_or_default();
            if count > 0 && first_seen.is_none() {
                first_seen = Some(since_due);
            }
            if count >= jobs {
                break since_due;
            }
            if Utc::now() > until {
                bail!("only {count} of {jobs} messages after {PATIENCE:?}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let _ = amqp.close(200, "bench".into()).await;
        Ok(BeatRun {
            all_queued,
            first_seen: first_seen.unwrap_or_default(),
        })
    }
    .await;
    Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status()?;
    let status = child.wait()?;
    let tail = reader.join().unwrap_or_default();
    let run = measured.with_context(|| format!("log tail:\n{tail}"))?;
    ensure!(status.success(), "the beat exited with {status}\n{tail}");

    // Exactly one message per job, and every job's progress persisted at T.
    let amqp = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
    let count = queue_len(&amqp.create_channel().await?, &queue)
        .await
        .context("queue")?;
    let _ = amqp.close(200, "bench".into()).await;
    ensure!(count as usize == jobs, "{count} messages for {jobs} jobs");
    let persisted = count_progress(&names, jobs, due).await?;
    ensure!(
        persisted == jobs,
        "{persisted} of {jobs} jobs have their progress persisted at {due}"
    );
    Ok(run)
}

fn write_config(path: &Path, ns: &str, jobs: usize, due: DateTime<Utc>) -> Result<()> {
    let anchor = due.to_rfc3339_opts(SecondsFormat::Secs, true);
    let mut text = format!("namespace = \"{ns}\"\n\n[tasks.t]\ncommand = [\"/bin/true\"]\n");
    for i in 0..jobs {
        write!(
            text,
            "\n[[jobs]]\nname = \"job-{i:06}\"\ntask = \"t\"\nevery = \"1m\"\nanchor = \"{anchor}\"\n"
        )?;
    }
    std::fs::write(path, text)?;
    Ok(())
}

/// Messages in `queue` (passive declare), `None` while it does not exist.
async fn queue_len(channel: &Channel, queue: &str) -> Option<u32> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .ok()
        .map(|q| q.message_count())
}

/// Jobs whose `{ns}:beat:last:{job}` is exactly `at`.
async fn count_progress(names: &Names, jobs: usize, at: DateTime<Utc>) -> Result<usize> {
    let client = redis::Client::open(redis_url())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let want = last_instant_text(at);
    let mut found = 0;
    let all: Vec<usize> = (0..jobs).collect();
    for batch in all.chunks(1000) {
        let keys: Vec<String> = batch
            .iter()
            .map(|i| names.beat_last(&format!("job-{i:06}")))
            .collect();
        let values: Vec<Option<String>> =
            redis::cmd("MGET").arg(keys).query_async(&mut conn).await?;
        found += values
            .iter()
            .filter(|v| v.as_deref() == Some(want.as_str()))
            .count();
    }
    Ok(found)
}

/// N envelopes like the beat's, published with every confirm outstanding at once; the time
/// from the first publish to the last confirm.
async fn bench_bare(jobs: usize, ns: &str) -> Result<Duration> {
    let names = Names::new(ns);
    let amqp = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
    let channel = amqp.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    drumline_shared::broker::declare(
        &channel,
        &names,
        &["default".to_owned()],
        Duration::from_secs(7 * 86_400),
        drumline_shared::config::QueueType::Classic,
    )
    .await?;
    let queue = names.work_queue("default");
    channel
        .queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
        .await?;
    let due = Utc::now().duration_trunc(TimeDelta::seconds(1))?;
    let envelopes: Vec<Envelope> = (0..jobs)
        .map(|i| {
            Envelope::scheduled(
                &format!("job-{i:06}"),
                "t",
                "default",
                serde_json::json!({}),
                due,
                None,
                Utc::now(),
            )
        })
        .collect();
    let exchange = names.tasks_exchange();
    let started = Instant::now();
    let mut confirms = Vec::with_capacity(jobs);
    for env in &envelopes {
        let now = Utc::now();
        confirms.push(
            channel
                .basic_publish(
                    exchange.as_str().into(),
                    "default".into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &env.encode(),
                    drumline_shared::broker::properties(env, now, 0),
                )
                .await?,
        );
    }
    for confirm in confirms {
        ensure!(
            confirm.await? == Confirmation::Ack(None),
            "not acked, or unroutable"
        );
    }
    let elapsed = started.elapsed();
    let count = queue_len(&channel, &queue).await.context("queue")?;
    ensure!(
        count as usize == jobs,
        "{count} messages for {jobs} published"
    );
    let _ = amqp.close(200, "bench".into()).await;
    Ok(elapsed)
}
