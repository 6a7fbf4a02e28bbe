//! What operators change at run time (docs/design.md "Operations at run time"): the set of paused
//! jobs, `{ns}:paused`. The leader reads it about once a second. And what `trigger` looks at
//! first: whether the job's overlap lock is held.

use super::{Store, StoreError};
use redis::AsyncCommands;
use std::collections::HashSet;

impl Store {
    /// The jobs paused now.
    pub async fn paused(&self) -> Result<HashSet<String>, StoreError> {
        let mut conn = self.conn.clone();
        Ok(conn.smembers(self.names.paused()).await?)
    }

    /// Pauses (`true`) or resumes (`false`) `jobs`; returns how many changed state.
    pub async fn set_paused(&self, jobs: &[&str], pause: bool) -> Result<u64, StoreError> {
        if jobs.is_empty() {
            return Ok(0);
        }
        let mut conn = self.conn.clone();
        let key = self.names.paused();
        if pause {
            Ok(conn.sadd(key, jobs).await?)
        } else {
            Ok(conn.srem(key, jobs).await?)
        }
    }

    /// The key of the instance holding `job`'s overlap lock (`{ns}:job:{job}:running`), if
    /// one does: a `skip` job's copy claimed meanwhile is skipped. The lock lapses with its
    /// holder's lease, so a dead worker's run stops counting.
    pub async fn overlap_holder(&self, job: &str) -> Result<Option<String>, StoreError> {
        let mut conn = self.conn.clone();
        Ok(conn.hget(self.names.job_running(job), "key").await?)
    }
}
