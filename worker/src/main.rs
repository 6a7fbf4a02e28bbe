//! `drumline-worker`: parse the command line, set up logging, run the worker until SIGTERM or
//! SIGINT; map the outcome to an exit code (0 ok, 2 bad usage or config, 1 other).

use clap::{Parser, Subcommand};
use drumline_shared::config::{self, Config};
use drumline_shared::logging::{self, LogFormat};
use drumline_worker::{dlq, Worker, WorkerError};
use std::path::PathBuf;
use std::process::ExitCode;

/// Run a drumline worker: consume task messages, run each scheduled instance once.
#[derive(Parser, Debug)]
#[command(name = "drumline-worker", version)]
struct Cli {
    /// Config file [default: $DRUMLINE_CONFIG, else ./drumline.toml].
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Tasks run at once across all queues (overrides [worker] concurrency).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Comma-separated logical queues to consume (overrides [worker] queues).
    #[arg(long, value_delimiter = ',')]
    queues: Option<Vec<String>>,
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    log_format: LogFormat,
    /// Serve Prometheus metrics at /metrics and a health check at /healthz on HOST:PORT.
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The dead letters in {ns}.dead.
    Dlq {
        #[command(subcommand)]
        action: DlqAction,
    },
}

#[derive(Subcommand, Debug)]
enum DlqAction {
    /// List them: key, task, reason, runs made, when, last error.
    List {
        /// Machine-readable: [{key, task, job, reason, attempts, error, dead_at}].
        #[arg(long)]
        json: bool,
    },
    /// Publish fresh copies (attempt 0, no deadline) of the given keys, or of all.
    Replay {
        /// Keys to replay.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        keys: Vec<String>,
        /// Replay every dead letter.
        #[arg(long)]
        all: bool,
    },
    /// Delete every dead letter.
    Purge,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::init(cli.log_format);
    let path = config::resolve_path(cli.config);
    let config = match Config::load(&path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Runtime::new().expect("cannot start the tokio runtime");
    if let Some(Command::Dlq { action }) = cli.command {
        return runtime.block_on(dead_letters(&config, action));
    }
    let result = runtime.block_on(async move {
        let mut worker = Worker::new(config);
        if let Some(n) = cli.concurrency {
            if n == 0 {
                return Err(WorkerError::Config(
                    "--concurrency must be at least 1".into(),
                ));
            }
            worker = worker.concurrency(n);
        }
        if let Some(queues) = cli.queues {
            for q in &queues {
                config::check_name(q)
                    .map_err(|e| WorkerError::Config(format!("--queues: queue {e}")))?;
            }
            if queues.is_empty() {
                return Err(WorkerError::Config(
                    "--queues: name at least one queue".into(),
                ));
            }
            worker = worker.queues(queues);
        }
        let _metrics = match cli.metrics_addr {
            Some(addr) => {
                let stats = worker.stats();
                let mut registry = prometheus_client::registry::Registry::default();
                stats.register(&mut registry);
                let health = std::sync::Arc::new(move || stats.health());
                Some(
                    drumline_shared::metrics::serve(addr, registry, health)
                        .await
                        .map_err(|e| WorkerError::Config(format!("--metrics-addr {addr}: {e}")))?,
                )
            }
            None => None,
        };
        worker
            .run(drumline_shared::signals::shutdown(
                "finishing in-flight tasks",
            ))
            .await
    });
    // Dropping a runtime waits for its blocking tasks without limit; the worker has stopped in
    // order by now, so nothing left there may delay the exit.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(WorkerError::Config(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
        Err(WorkerError::Fatal(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

async fn dead_letters(config: &Config, action: DlqAction) -> ExitCode {
    let result = async {
        match action {
            DlqAction::List { json } => {
                let queue = dlq::DeadQueue::open(config).await?;
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
            }
            DlqAction::Replay { keys, all: _ } => {
                let store = drumline_shared::store::Store::connect(
                    &config.redis_url,
                    config.redis_ca_file.as_deref(),
                    drumline_shared::names::Names::new(config.namespace.clone()),
                )
                .await?;
                let queue = dlq::DeadQueue::open(config).await?;
                let (replayed, refused) = queue.replay(&store, &keys).await?;
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
                if !missing.is_empty() || !refused.is_empty() {
                    return Ok::<ExitCode, dlq::DlqError>(ExitCode::from(1));
                }
            }
            DlqAction::Purge => {
                let n = dlq::purge(config).await?;
                println!("purged {n} dead letters");
            }
        }
        Ok(ExitCode::SUCCESS)
    }
    .await;
    result.unwrap_or_else(|e| {
        eprintln!("error: {e}");
        ExitCode::from(1)
    })
}
