//! Workers announce themselves (docs/design.md#queues-and-workers): `{ns}:worker:{id}`, a hash
//! with a TTL that the worker refreshes, read by `status` and the status page.

use super::{Store, StoreError};
use redis::AsyncCommands;
use serde::Serialize;
use std::collections::HashMap;
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
        let mut pipe = redis::pipe();
        pipe.atomic()
            .hset_multiple(&key, &worker.fields())
            .ignore()
            .pexpire(&key, ms as i64)
            .ignore();
        Ok(pipe.query_async::<()>(&mut conn).await?)
    }

    /// Removes worker `id`'s announcement (a clean stop).
    pub async fn forget_worker(&self, id: &str) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        Ok(conn.del(self.names.worker(id)).await?)
    }

    /// The workers announced now (at most [`WORKERS_SHOWN`]), sorted by id.
    pub async fn workers(&self) -> Result<Vec<WorkerInfo>, StoreError> {
        let mut conn = self.conn.clone();
        let prefix = self.names.worker("");
        let keys: Vec<String> = {
            let mut iter: redis::AsyncIter<String> =
                conn.scan_match(self.names.workers_pattern()).await?;
            let mut keys = Vec::new();
            while let Some(key) = iter.next_item().await {
                keys.push(key?);
                if keys.len() == WORKERS_SHOWN {
                    break;
                }
            }
            keys
        };
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for key in &keys {
            pipe.hgetall(key);
        }
        let hashes: Vec<HashMap<String, String>> = pipe.query_async(&mut conn).await?;
        let mut workers: Vec<WorkerInfo> = keys
            .iter()
            .zip(hashes)
            .filter_map(|(key, fields)| WorkerInfo::from_fields(&key[prefix.len()..], fields))
            .collect();
        workers.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(workers)
    }
}
