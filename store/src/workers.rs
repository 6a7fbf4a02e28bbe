//! Workers announce themselves (docs/design.md#queues-and-workers): `{ns}:worker:{id}`, a hash
//! with a TTL that the worker refreshes, its id in the set `{ns}:workers`, read by `status` and
//! the status page in two round trips whatever else the Redis holds (a `SCAN` walked the whole
//! keyspace: thousands of round trips beside a million jobs' progress).

use super::{Store, StoreError};
use redis::{AsyncCommands, Script};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;

/// Most announcements read by [`Store::workers`] (a namespace has a few hundred at most).
pub const WORKERS_SHOWN: usize = 1000;

/// One worker's announcement, as read back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WorkerInfo {
    /// The worker's id (`host:pid:suffix`).
    pub id: String,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// drumline version.
    pub version: String,
    /// The logical queues it consumes.
    pub queues: Vec<String>,
    /// Tasks it runs at once at most.
    pub concurrency: u32,
    /// Tasks running at its last refresh.
    pub running: u32,
    /// When it started (RFC 3339).
    pub started: String,
}

impl WorkerInfo {
    /// The hash's fields.
    fn fields(&self) -> Vec<(&'static str, String)> {
        vec![
            ("host", self.host.clone()),
            ("pid", self.pid.to_string()),
            ("version", self.version.clone()),
            ("queues", self.queues.join(",")),
            ("concurrency", self.concurrency.to_string()),
            ("running", self.running.to_string()),
            ("started", self.started.clone()),
        ]
    }

    /// Reads a hash back (`None` when it is gone or not an announcement).
    pub fn from_fields(id: &str, mut f: HashMap<String, String>) -> Option<Self> {
        let mut take = |k: &str| f.remove(k);
        let number = |v: Option<String>| v.and_then(|v| v.parse().ok());
        Some(WorkerInfo {
            id: id.to_owned(),
            host: take("host")?,
            pid: number(take("pid"))?,
            version: take("version").unwrap_or_default(),
            queues: take("queues")
                .map(|q| {
                    q.split(',')
                        .filter(|q| !q.is_empty())
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
            concurrency: number(take("concurrency")).unwrap_or(0),
            running: number(take("running")).unwrap_or(0),
            started: take("started").unwrap_or_default(),
        })
    }
}

// FORGET_GONE
// KEYS[1]   -> {ns}:workers            the set of announced ids
// KEYS[i+1] -> {ns}:worker:{ARGV[i]}   an announcement read as gone
// Output: none. Each id whose announcement is (still) gone leaves the set.
static FORGET_GONE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
for i, id in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then redis.call('SREM', KEYS[1], id) end
end
"#,
    )
});

impl Store {
    /// Writes (or refreshes) `worker`'s announcement, kept for `ttl`.
    pub async fn announce_worker(
        &self,
        worker: &WorkerInfo,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let key = self.names.worker(&worker.id);
        let ms = (ttl.as_millis() as u64).max(1);
        let index = self.names.workers();
        let mut pipe = redis::pipe();
        // The set lives as long as the longest-lived announcement (`NX` gives a new set its
        // TTL, `GT` only ever extends it): with every worker gone, it goes.
        pipe.atomic()
            .hset_multiple(&key, &worker.fields())
            .ignore()
            .pexpire(&key, ms as i64)
            .ignore()
            .sadd(&index, &worker.id)
            .ignore();
        for flag in ["NX", "GT"] {
            pipe.cmd("PEXPIRE").arg(&index).arg(ms).arg(flag).ignore();
        }
        Ok(pipe.query_async::<()>(&mut conn).await?)
    }

    /// Removes worker `id`'s announcement (a clean stop).
    pub async fn forget_worker(&self, id: &str) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        pipe.atomic()
            .del(self.names.worker(id))
            .ignore()
            .srem(self.names.workers(), id)
            .ignore();
        Ok(pipe.query_async::<()>(&mut conn).await?)
    }

    /// The workers announced now (at most [`WORKERS_SHOWN`], the first by id), sorted by id.
    /// Ids whose announcement expired (a worker killed without a word) leave the set here.
    pub async fn workers(&self) -> Result<Vec<WorkerInfo>, StoreError> {
        let mut conn = self.conn.clone();
        let index = self.names.workers();
        let mut ids: Vec<String> = conn.smembers(&index).await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        ids.sort();
        let mut pipe = redis::pipe();
        for id in &ids {
            pipe.hgetall(self.names.worker(id));
        }
        let hashes: Vec<HashMap<String, String>> = pipe.query_async(&mut conn).await?;
        let mut gone = Vec::new();
        let mut workers = Vec::new();
        for (id, fields) in ids.iter().zip(hashes) {
            if fields.is_empty() {
                gone.push(id);
            } else if let Some(worker) = WorkerInfo::from_fields(id, fields) {
                if workers.len() < WORKERS_SHOWN {
                    workers.push(worker);
                }
            }
        }
        if !gone.is_empty() {
            // Best effort (a read-only user still gets the list), and only ids whose
            // announcement is still gone: one may have come back since it was read.
            let mut forget = FORGET_GONE.prepare_invoke();
            forget.key(&index);
            for id in gone {
                forget.key(self.names.worker(id)).arg(id);
            }
            if let Err(e) = forget.invoke_async::<()>(&mut conn).await {
                tracing::debug!(error = %e, "cannot drop expired workers from their set");
            }
        }
        Ok(workers)
    }
}
