//! What the leader writes for `after` jobs (docs/design.md#job-dependencies): an instance
//! skipped because its upstream did not succeed. Publishing a follower needs no write of its
//! own here: it is a confirmed publish, then the follower's progress (fenced, as any job's).

use super::journal::JOURNAL;
use super::leader::HELD_BY;
use super::{RunRecord, Store, StoreError, HISTORY_LEN};
use redis::Script;
use std::sync::LazyLock;
use std::time::Duration;

// SKIP_FOLLOWER
// KEYS[1] -> {ns}:beat:leader          the lease: only its holder writes
// KEYS[2] -> {ns}:run:{job}@{instant}  the follower's instance
// KEYS[3] -> {ns}:history:{job}        its run records
// ARGV[1] -> leader token   ARGV[2] -> retention in ms   ARGV[3] -> reason (`upstream`)
// ARGV[4] -> the run record's JSON   ARGV[5] -> history cap
// then the journal's tail (JOURNAL): the skip is journaled `skipped` with its reason in the
// same script, as every fate decision is (docs/design.md#journal).
// Output: 1 recorded `skipped` | 2 the instance has a record already (published before, or
// skipped before): left as it is | 0 the token does not hold the lease, nothing written.
// Only an instance nobody recorded is skipped, so a copy of it published before (by a leader
// that then died) keeps whatever its run wrote, and a later copy of a skipped instance is a
// duplicate at the claim.
static SKIP_FOLLOWER: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{HELD_BY}{JOURNAL}{}",
        r#"
if not held_by(KEYS[1], ARGV[1]) then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 2 end
local t = redis.call('TIME')
redis.call('HSET', KEYS[2], 'state', 'skipped', 'reason', ARGV[3], 'attempt', 0, 'at', t[1])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('LPUSH', KEYS[3], ARGV[4])
redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[5]) - 1)
jot('skipped', 0, '', 'leader', 'r', ARGV[3])
return 1
"#
    ))
});

/// What [`Store::skip_follower`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skipped {
    /// Recorded `skipped` now.
    Recorded,
    /// The instance had a record already; nothing written.
    Known,
    /// The token does not hold the leader lease; nothing written.
    NotLeading,
}

impl Store {
    /// Records `job`'s instance `record.key` `skipped` with `record.reason` (kept for
    /// `retention`, the worker's `done_ttl`) and appends `record` to the job's history, while
    /// `token` holds the leader lease and nothing is recorded for the instance yet.
    pub async fn skip_follower(
        &self,
        token: &str,
        job: &str,
        record: &RunRecord,
        retention: Duration,
    ) -> Result<Skipped, StoreError> {
        let json = serde_json::to_string(record).expect("a run record always serialises");
        let mut call = SKIP_FOLLOWER.prepare_invoke();
        call.key(self.names.beat_leader())
            .key(self.names.run_key(&record.key))
            .key(self.names.history(job))
            .arg(token)
            .arg((retention.as_millis() as u64).max(1))
            .arg(record.reason.as_deref().unwrap_or("upstream"))
            .arg(json)
            .arg(HISTORY_LEN);
        self.journal_tail(&mut call, &record.key);
        let code: i64 = self.durable(&SKIP_FOLLOWER, &call).await?;
        Ok(match code {
            1 => Skipped::Recorded,
            2 => Skipped::Known,
            _ => Skipped::NotLeading,
        })
    }
}
