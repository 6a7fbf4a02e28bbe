//! Instances that end before any claim (docs/audit.md#the-journal): a message the worker
//! dead-lettered unrun because it could not take it (`unknown_task`, `malformed`, `oversize`)
//! is journaled `dead` under its key, so its instance does not read as pending forever.
//! (A message the broker expired goes through the claim script's expired branch instead.)

use super::journal::JOURNAL;
use super::{RunRecord, Store, StoreError, HISTORY_LEN};
use redis::Script;
use std::sync::LazyLock;
use std::time::Duration;

// DEAD_UNCLAIMED
// KEYS[1] -> {ns}:run:{key}            the run record
// KEYS[2] -> {ns}:history:{job}        the job's run records (only with ARGV[5])
// KEYS[3] -> {ns}:last_failure:{job}   (only with ARGV[5])
// KEYS[4] -> {ns}:journal              (JOURNAL)
// ARGV[1] -> the dead-letter reason: unknown_task | malformed | oversize
// ARGV[2] -> worker id                 ARGV[3] -> the copy's attempt
// ARGV[4] -> retention in ms           ARGV[5] -> the run record's JSON ('' for none)
// ARGV[6] -> history cap               ARGV[7] -> the record's end (RFC 3339)
// then the journal's ARGV (JOURNAL)
// Output: 1 recorded `dead` | 0 the key has a state already: nothing written.
// Only a key nobody recorded yet is marked: a finished, running or retrying instance keeps
// what its own copies decided, and a copy this worker cannot take does not change it.
static DEAD_UNCLAIMED: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{JOURNAL}{}",
        r#"
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'state', 'dead', 'worker', ARGV[2], 'attempt', ARGV[3],
  'reason', ARGV[1], 'at', redis.call('TIME')[1])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
jot('dead', ARGV[3], '', ARGV[2], 'r', ARGV[1])
if ARGV[5] ~= '' then
  redis.call('LPUSH', KEYS[2], ARGV[5])
  redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[6]) - 1)
  redis.call('SET', KEYS[3], ARGV[7], 'PX', ARGV[4])
end
return 1
"#
    ))
});

/// A message dead-lettered before any claim, as [`Store::dead_unclaimed`] records it.
#[derive(Debug, Clone, Copy)]
pub struct Unclaimed<'a> {
    /// The instance's key (checked by the caller: a key the message may not speak for is
    /// never passed).
    pub key: &'a str,
    /// `unknown_task`, `malformed` or `oversize`.
    pub reason: &'a str,
    /// The worker that dead-lettered it.
    pub worker: &'a str,
    /// The copy's attempt (0 when unknown).
    pub attempt: u32,
    /// How long the `dead` state (and the job's last failure) is kept.
    pub retention: Duration,
    /// A job's instance: the job and its run record (status `dead`).
    pub record: Option<(&'a str, &'a RunRecord)>,
}

impl Store {
    /// Marks `dead` (reason, worker, attempt) an instance that has no state yet, journals it
    /// `dead` with its reason and, for a job's instance, appends its run record and sets the
    /// job's last failure. `false`: the key had a state, nothing was written. A durable write.
    pub async fn dead_unclaimed(&self, what: &Unclaimed<'_>) -> Result<bool, StoreError> {
        let retention_ms = what.retention.as_millis().max(1) as u64;
        let job = what.record.map_or("", |(job, _)| job);
        let mut call = DEAD_UNCLAIMED.prepare_invoke();
        call.key(self.names.run_key(what.key))
            .key(self.names.history(job))
            .key(self.names.last_failure(job))
            .arg(what.reason)
            .arg(what.worker)
            .arg(what.attempt)
            .arg(retention_ms);
        match what.record {
            Some((_, record)) => {
                let json = serde_json::to_string(record).expect("a run record always serialises");
                call.arg(json).arg(HISTORY_LEN).arg(&record.finished_at);
            }
            None => {
                call.arg("").arg(HISTORY_LEN).arg("");
            }
        }
        self.journal_tail(&mut call, what.key);
        let written: i64 = self.durable(&DEAD_UNCLAIMED, &call).await?;
        Ok(written == 1)
    }
}
