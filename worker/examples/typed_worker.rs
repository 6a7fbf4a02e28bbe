//! A worker with two typed Rust handlers (docs/design.md#typed-rust-handlers):
//!
//! - `greet` (`{"name": "Ada"}`) appends `KEY ATTEMPT hello NAME` to `OUT/greetings`;
//! - `deposit` (`{"account": "acme", "cents": 500, "work_ms": 0}`) works for `work_ms`
//!   (stopping early when the run is cancelled: lease lost, timeout, shutdown), then writes
//!   the deposit through a [`FencedSink`]: a ledger that remembers the highest fencing token
//!   that wrote to it and refuses any lower one, so a run that lost its claim (a paused or
//!   partitioned worker that wakes up after another took over) cannot write late.
//!   Every run start is noted in `OUT/runs` as `start KEY FENCE ATTEMPT`.
//!
//! `cargo run -p drumline-worker --example typed_worker -- drumline.toml OUT_DIR`
//!
//! The config needs `[tasks.greet]` and `[tasks.deposit]` (no `command`: the handlers serve
//! them). Publish with `drumline-beat publish deposit --args '{"account":"acme","cents":500}'`.
//! The end-to-end tests run this program (`tests/tests/typed.rs`).

use drumline_shared::config::Config;
use drumline_worker::{HandlerError, TaskContext, Worker};
use serde::Deserialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `greet`'s arguments.
#[derive(Debug, Deserialize)]
struct Greet {
    name: String,
}

/// `deposit`'s arguments.
#[derive(Debug, Deserialize)]
struct Deposit {
    account: String,
    cents: i64,
    /// Simulated work before the write, in milliseconds.
    #[serde(default)]
    work_ms: u64,
}

/// A write refused because a newer claim has written already.
#[derive(Debug, thiserror::Error)]
#[error("stale fencing token {token}: the ledger has seen {seen}")]
struct Stale {
    token: u64,
    seen: u64,
}

/// An idempotent ledger guarded by fencing tokens: one file per account, a line
/// `FENCE KEY CENTS` per accepted write. A write with a token lower than the highest accepted
/// one is refused; a repeat of an accepted write (same key) is a no-op. (A database does the
/// same in one statement: `UPDATE … SET fence = $1 … WHERE fence <= $1`.)
#[derive(Debug, Clone)]
struct FencedSink {
    dir: PathBuf,
    lock: Arc<Mutex<()>>,
}

impl FencedSink {
    fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
            lock: Arc::default(),
        }
    }

    /// Records `cents` for `key` on `account` under fencing token `token`.
    fn write(&self, account: &str, key: &str, token: u64, cents: i64) -> Result<(), Stale> {
        let _one_at_a_time = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let path = self.dir.join(format!("ledger-{account}"));
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let entries: Vec<(u64, &str)> = text
            .lines()
            .filter_map(|line| {
                let mut parts = line.split(' ');
                Some((parts.next()?.parse().ok()?, parts.next()?))
            })
            .collect();
        let seen = entries.iter().map(|(fence, _)| *fence).max().unwrap_or(0);
        if token < seen {
            return Err(Stale { token, seen });
        }
        if entries.iter().any(|(_, k)| *k == key) {
            return Ok(());
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .expect("open the ledger");
        writeln!(file, "{token} {key} {cents}").expect("write the ledger");
        Ok(())
    }
}

/// Appends `line` to `path`.
fn note(path: &Path, line: &str) {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("open a note file");
    writeln!(file, "{line}").expect("write a note");
}

async fn greet(out: PathBuf, args: Greet, ctx: TaskContext) -> Result<(), HandlerError> {
    let line = format!("{} {} hello {}", ctx.key, ctx.attempt, args.name);
    note(&out.join("greetings"), &line);
    Ok(())
}

async fn deposit(
    out: PathBuf,
    sink: FencedSink,
    args: Deposit,
    ctx: TaskContext,
) -> Result<(), HandlerError> {
    let start = format!("start {} {} {}", ctx.key, ctx.fencing_token, ctx.attempt);
    note(&out.join("runs"), &start);
    tokio::select! {
        () = tokio::time::sleep(Duration::from_millis(args.work_ms)) => {}
        () = ctx.cancel.cancelled() => {
            note(&out.join("runs"), &format!("cancelled {} {}", ctx.key, ctx.fencing_token));
            return Err(HandlerError::retryable("cancelled"));
        }
    }
    sink.write(&args.account, &ctx.key, ctx.fencing_token, args.cents)
        .map_err(|e| HandlerError::permanent("the ledger refused the write").because(e))
}

#[tokio::main]
async fn main() {
    let mut argv = std::env::args().skip(1);
    let (Some(config), Some(out)) = (argv.next(), argv.next()) else {
        eprintln!("usage: typed_worker CONFIG OUT_DIR");
        std::process::exit(2);
    };
    drumline_shared::logging::init(drumline_shared::logging::LogFormat::Human);
    let config = Config::load(Path::new(&config)).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2);
    });
    let out = PathBuf::from(out);
    let sink = FencedSink::new(&out);
    let (greet_out, deposit_out) = (out.clone(), out);
    let worker = Worker::new(config)
        .typed_handler("greet", move |args: Greet, ctx| {
            greet(greet_out.clone(), args, ctx)
        })
        .typed_handler("deposit", move |args: Deposit, ctx| {
            deposit(deposit_out.clone(), sink.clone(), args, ctx)
        });
    let shutdown = drumline_shared::signals::shutdown("finishing the runs in flight");
    if let Err(e) = worker.run(shutdown).await {
        eprintln!("{e}");
        std::process::exit(if e.needs_a_fix() { 2 } else { 1 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sink_refuses_a_stale_token_and_ignores_a_repeat() {
        let dir = std::env::temp_dir().join(format!("fenced-sink-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sink = FencedSink::new(&dir);
        sink.write("acme", "k1", 7, 500).unwrap();
        sink.write("acme", "k1", 7, 500).unwrap();
        let stale = sink.write("acme", "k2", 6, 100).unwrap_err();
        assert_eq!((stale.token, stale.seen), (6, 7));
        sink.write("acme", "k2", 8, 100).unwrap();
        let ledger = std::fs::read_to_string(dir.join("ledger-acme")).unwrap();
        assert_eq!(ledger, "7 k1 500\n8 k2 100\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
