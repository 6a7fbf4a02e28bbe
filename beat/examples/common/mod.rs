//! What the beat's benches share: where the services are, starting a beat, and deleting a
//! bench namespace. Each bench includes this file and uses part of it.
#![allow(dead_code)]

use anyhow::Result;
use drumline_shared::names::Names;
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::{Connection, ConnectionProperties};

/// `DRUMLINE_AMQP_URL`, else the local broker.
pub fn amqp_url() -> String {
    std::env::var("DRUMLINE_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// `DRUMLINE_REDIS_URL`, else the local Redis.
pub fn redis_url() -> String {
    std::env::var("DRUMLINE_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/0".into())
}

/// Deletes everything a bench namespace created: Redis keys, queues, exchanges.
pub async fn cleanup(ns: &str) -> Result<()> {
    let names = Names::new(ns);
    let client = redis::Client::open(redis_url())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{ns}:*"))
            .arg("COUNT")
            .arg(10_000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            redis::cmd("UNLINK")
                .arg(keys)
                .query_async::<()>(&mut conn)
                .await?;
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
    let amqp = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
    // A channel per deletion: one that fails (already gone) closes its channel.
    for queue in [
        names.work_queue("default"),
        names.dead(),
        names.dead_watch(),
    ] {
        let ch = amqp.create_channel().await?;
        let _ = ch
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    for exchange in [names.tasks_exchange(), names.dead()] {
        let ch = amqp.create_channel().await?;
        let _ = ch
            .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await;
    }
    let _ = amqp.close(200, "bench done".into()).await;
    Ok(())
}

/// A beat started by a bench: its process, the instant it logged that it leads (once), and the
/// thread draining its log (so it never blocks on a full pipe), which returns the log's tail.
pub struct SpawnedBeat {
    pub child: std::process::Child,
    pub leading: std::sync::mpsc::Receiver<std::time::Instant>,
    pub log_tail: std::thread::JoinHandle<String>,
}

/// Starts `beat --config config` with its log on a pipe.
pub fn spawn_beat(beat: &std::path::Path, config: &std::path::Path) -> Result<SpawnedBeat> {
    use anyhow::Context;
    use std::io::{BufRead, BufReader};
    let mut child = std::process::Command::new(beat)
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "info")
        .env_remove("DRUMLINE_CONFIG")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {}", beat.display()))?;
    let stderr = child.stderr.take().expect("piped");
    let (leading_tx, leading) = std::sync::mpsc::channel();
    let log_tail = std::thread::spawn(move || {
        let mut tail = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("beat leading") {
                let _ = leading_tx.send(std::time::Instant::now());
            }
            tail.push(line);
            if tail.len() > 20 {
                tail.remove(0);
            }
        }
        tail.join("\n")
    });
    Ok(SpawnedBeat {
        child,
        leading,
        log_tail,
    })
}

/// Writes a config of `jobs` daily jobs (`job-000000`, …) whose next instant is 12 h away, so
/// nothing comes due while a bench runs.
pub fn write_config(path: &std::path::Path, ns: &str, jobs: usize) -> Result<()> {
    use chrono::{SecondsFormat, TimeDelta, Utc};
    use std::fmt::Write as _;
    let anchor = (Utc::now() + TimeDelta::hours(12)).to_rfc3339_opts(SecondsFormat::Secs, true);
    let mut text = format!("namespace = \"{ns}\"\n\n[tasks.t]\ncommand = [\"/bin/true\"]\n");
    for i in 0..jobs {
        write!(
            text,
            "\n[[jobs]]\nname = \"job-{i:06}\"\ntask = \"t\"\nevery = \"1d\"\nanchor = \"{anchor}\"\n"
        )?;
    }
    std::fs::write(path, text)?;
    Ok(())
}
