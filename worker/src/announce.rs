//! A running worker announces itself (docs/design.md#queues-and-workers): `{ns}:worker:{id}`
//! (host, pid, version, queues, concurrency, running, started), written through the store every
//! [`REFRESH`] with a TTL of [`TTL`], so a worker killed without a word drops off within the
//! TTL; a clean stop removes it at once.

use crate::stats::Stats;
use drumline_shared::config::Config;
use drumline_shared::store::{Store, WorkerInfo};
use std::sync::Arc;
use std::time::Duration;

/// How long an announcement outlives its last refresh.
pub const TTL: Duration = Duration::from_secs(30);

/// How often a worker refreshes its announcement.
pub const REFRESH: Duration = Duration::from_secs(10);

/// What worker `id` announces about itself, started now with `config`.
pub fn info(id: &str, config: &Config) -> WorkerInfo {
    WorkerInfo {
        id: id.to_owned(),
        host: drumline_shared::names::host_name(),
        pid: std::process::id(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        queues: config.worker.queues.clone(),
        concurrency: config.worker.concurrency as u32,
        running: 0,
        started: drumline_shared::envelope::format_instant(chrono::Utc::now()),
    }
}

/// Refreshes the announcement every [`REFRESH`], with the number of runs in progress, until
/// aborted; a failed write is logged and tried again at the next refresh.
pub async fn run(store: Store, mut info: WorkerInfo, stats: Arc<Stats>) {
    loop {
        info.running = u32::try_from(stats.running.get()).unwrap_or(0);
        if let Err(e) = store.announce_worker(&info, TTL).await {
            tracing::debug!(error = %e, "worker announcement not written");
        }
        tokio::time::sleep(REFRESH).await;
    }
}
