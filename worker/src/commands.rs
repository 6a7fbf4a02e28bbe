//! The bodies of `drumline-worker`'s commands (feature `cli`): each takes a loaded config,
//! prints its output and returns `Ok` or a [`Failure`] that carries the exit code. `main.rs`
//! only parses and dispatches.

use crate::{dlq, Worker, WorkerError};
use drumline_shared::config::{self, Config};
use drumline_shared::exit::Failure;
use std::net::SocketAddr;

/// The command-line overrides of a running worker: the flags of `drumline worker` and of
/// `drumline-worker`.
#[derive(clap::Args, Debug, Default)]
pub struct Options {
    /// Tasks run at once across all queues (overrides `[worker] concurrency`).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Comma-separated logical queues to consume (overrides `[worker] queues`).
    #[arg(long, value_delimiter = ',')]
    pub queues: Option<Vec<String>>,
    /// Serve Prometheus metrics at /metrics and a health check at /healthz on HOST:PORT.
    #[arg(long, value_parser = drumline_shared::metrics::parse_addr)]
    pub metrics_addr: Option<SocketAddr>,
}

/// `dlq …`: what to do with the dead letters.
#[derive(Debug)]
pub enum DlqCommand {
    /// List them, as a table or as JSON.
    List {
        /// As JSON, not a table.
        json: bool,
    },
    /// Publish fresh copies of these keys (every one with `dlq replay --all`).
    Replay {
        /// The keys (none: every one).
        keys: Vec<String>,
    },
    /// Delete every dead letter.
    Purge,
}

impl From<WorkerError> for Failure {
    fn from(e: WorkerError) -> Self {
        if e.needs_a_fix() {
            Failure::Usage(e.to_string())
        } else {
            Failure::Other(e.to_string())
        }
    }
}

/// No command: run the worker with `options` until SIGTERM or SIGINT.
pub async fn run(config: Config, options: Options) -> Result<(), Failure> {
    let namespace = config.namespace.clone();
    let mut worker = Worker::new(config).reload_on_sighup();
    if let Some(n) = options.concurrency {
        if n == 0 {
            return Err(Failure::usage("--concurrency must be at least 1"));
        }
        worker = worker.concurrency(n);
    }
    if let Some(queues) = options.queues {
        for q in &queues {
            config::check_name(q).map_err(|e| Failure::usage(format!("--queues: queue {e}")))?;
        }
        if queues.is_empty() {
            return Err(Failure::usage("--queues: name at least one queue"));
        }
        worker = worker.queues(queues);
    }
    let _metrics = match options.metrics_addr {
        Some(addr) => {
            let stats = worker.stats();
            let mut registry = prometheus_client::registry::Registry::default();
            stats.register(&mut registry);
            drumline_shared::process_metrics::register(&mut registry, "worker", &namespace);
            let health = std::sync::Arc::new(move || stats.health().map(|()| "ok"));
            Some(
                drumline_shared::metrics::serve(addr, registry, health)
                    .await
                    .map_err(|e| Failure::usage(format!("--metrics-addr {addr}: {e}")))?,
            )
        }
        None => None,
    };
    // Listening before READY=1: a stop from then on is orderly (docs/operations.md#systemd).
    let stopping = drumline_shared::signals::Shutdown::listen();
    let _watchdog = drumline_shared::systemd::ready();
    worker
        .run(stopping.wait("finishing in-flight tasks"))
        .await?;
    Ok(())
}

/// `dlq list | replay | purge`.
pub async fn dead_letters(config: &Config, command: DlqCommand) -> Result<(), Failure> {
    match command {
        DlqCommand::List { json } => list(config, json).await,
        DlqCommand::Replay { keys } => replay(config, &keys).await,
        DlqCommand::Purge => {
            let n = dlq::purge(config).await.map_err(Failure::other)?;
            println!("purged {n} dead letters");
            Ok(())
        }
    }
}

async fn list(config: &Config, json: bool) -> Result<(), Failure> {
    let queue = dlq::DeadQueue::open(config).await.map_err(Failure::other)?;
    let letters: Vec<_> = queue.messages.iter().map(dlq::describe).collect();
    queue.close().await;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&letters).expect("serialisable")
        );
    } else {
        print!("{}", dlq::table(&letters));
    }
    Ok(())
}

/// Replay `keys`; a key not found, or not a task envelope, is told on stderr and fails the
/// command (exit code 1) once the others are replayed.
async fn replay(config: &Config, keys: &[String]) -> Result<(), Failure> {
    let store = drumline_shared::store::Store::connect(
        &config.redis_url,
        config.redis_ca_file.as_deref(),
        drumline_shared::names::Names::new(config.namespace.clone()),
    )
    .await
    .map_err(|e| Failure::other(dlq::DlqError::from(e)))?;
    let queue = dlq::DeadQueue::open(config).await.map_err(Failure::other)?;
    let (replayed, refused) = queue.replay(&store, keys).await.map_err(Failure::other)?;
    queue.close().await;
    for key in &replayed {
        println!("replayed {key}");
    }
    for key in &refused {
        eprintln!("not replayed (not a task envelope): {key}");
    }
    let missing: Vec<&String> = keys
        .iter()
        .filter(|k| !replayed.contains(k) && !refused.contains(k))
        .collect();
    for key in &missing {
        eprintln!("not found in the dead letters: {key}");
    }
    if missing.is_empty() && refused.is_empty() {
        Ok(())
    } else {
        Err(Failure::Reported)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_error_keeps_its_exit_code_at_the_edge() {
        let missing = WorkerError::NoHandler {
            path: "w.toml".into(),
            task: "t".into(),
        };
        assert_eq!(Failure::from(missing).code(), 2);
        let fatal = WorkerError::NotDumpable(std::io::Error::other("no prctl"));
        assert_eq!(Failure::from(fatal).code(), 1);
    }
}
