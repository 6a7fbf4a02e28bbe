//! The processor in force and its replacement on SIGHUP: the file's `[tasks.*]` and `[[jobs]]`
//! apply to the deliveries that follow, runs in flight finish under the config they started
//! with (docs/operations.md, "Reload").

use crate::processor::{self, Processor};
use crate::Handler;
use drumline_shared::config::WorkerConfig;
use drumline_shared::signals::Hangups;
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use tracing::{error, info, warn};

/// The processor new deliveries go to; replaced as a whole on reload, so a delivery is decided
/// and run under one config from start to end.
pub(crate) struct Current(RwLock<Arc<Processor>>);

impl Current {
    pub(crate) fn new(processor: Arc<Processor>) -> Self {
        Self(RwLock::new(processor))
    }

    pub(crate) fn get(&self) -> Arc<Processor> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn set(&self, processor: Arc<Processor>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = processor;
    }
}

/// What a reload needs besides the file: the Rust handlers registered in code, and `[worker]`
/// as the file had it before command-line overrides (to tell a changed file from a flag).
pub struct Reload {
    /// Handlers registered with [`Worker::handler`](crate::Worker::handler).
    pub custom: HashMap<String, Arc<dyn Handler>>,
    /// The file's `[worker]` at start.
    pub file_worker: WorkerConfig,
}

/// SIGHUP: re-reads the config file; its `[tasks.*]` and `[[jobs]]` apply to the deliveries
/// that follow (in-flight runs are untouched). A file that does not load, or names a task with
/// no command and no handler, is refused and the running config stays.
pub(crate) async fn reload_on_hangup(
    current: Arc<Current>,
    mut reload: Reload,
    mut hangups: Hangups,
) {
    loop {
        hangups.recv().await;
        let running = current.get();
        let (mut new, mut restart) = match running.config.reload() {
            Ok(loaded) => loaded,
            Err(e) => {
                error!(error = %e, "reload refused: the file does not load; the running config stays");
                continue;
            }
        };
        restart.retain(|what| *what != "[worker]");
        if new.worker != reload.file_worker {
            restart.push("[worker]");
            reload.file_worker = new.worker.clone();
        }
        new.worker = running.config.worker.clone();
        let handlers = match processor::resolve_handlers(&new, &reload.custom) {
            Ok(handlers) => handlers,
            Err(e) => {
                error!(error = %e, "reload refused; the running config stays");
                continue;
            }
        };
        if !restart.is_empty() {
            warn!(changed = ?restart, "reloaded tasks and jobs; these changes take a restart of the worker");
        }
        info!(
            tasks = new.tasks.len(),
            jobs = new.jobs.len(),
            "reloaded tasks and jobs (SIGHUP)"
        );
        current.set(Arc::new(running.reloaded(Arc::new(new), handlers)));
    }
}
