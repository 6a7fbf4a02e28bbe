//! The rule each job's progress was recorded under, `{ns}:beat:rule:{job}`
//! (docs/design.md#reload-on-a-standby): a leader that starts a job (a first start, an added
//! job, a rescheduled one) writes the job's start and its rule in one fenced script, so that
//! whichever beat leads next can tell whether the progress it finds belongs to the schedule it
//! runs or to one it replaced.

use super::leader::{fenced_script, FencedCall};
use super::{last_instant_text, Store, StoreError};
use crate::ProgressError;
use chrono::{DateTime, Utc};
use redis::{Script, ScriptInvocation};
use std::sync::LazyLock;
use std::time::Duration;

// START_FENCED
// KEYS[1]          -> {ns}:beat:leader        the lease that fences the write
// KEYS[2j], [2j+1] -> job j's {ns}:beat:last:{job} and {ns}:beat:rule:{job}
// ARGV[1]          -> token                   ARGV[2] -> most ms ahead of Redis TIME
// ARGV[3j], [3j+1], [3j+2] -> job j's instant as fixed-width RFC 3339 text (string order is
//                     time order), as Unix ms, and its rule
// Output: {0} the token does not hold the lease (nothing written) | {1, per job: 1 written
// (the progress moved forward only, never back; the rule set), 0 refused as ahead (nothing
// written), -1 its progress is not a string (nothing written)}.
static START_FENCED: LazyLock<Script> = LazyLock::new(|| {
    fenced_script(
        r#"
for j = 1, (#KEYS - 1) / 2 do
  local code = advance(KEYS[2 * j], ARGV[3 * j], tonumber(ARGV[3 * j + 1]), limit)
  if code == 1 then redis.call('SET', KEYS[2 * j + 1], ARGV[3 * j + 2]) end
  out[j + 1] = code
end
return out
"#,
    )
});

impl Store {
    /// Each job's recorded rule (`None`: none recorded, as for progress written before rules
    /// were) as `read(index in jobs, rule)` makes it, in `jobs` order. One pipelined round
    /// trip per `per_mget`·`per_trip` jobs.
    pub async fn progress_rules<T>(
        &self,
        jobs: &[&str],
        read: impl FnMut(usize, Option<String>) -> T,
        per_mget: usize,
        per_trip: usize,
    ) -> Result<Vec<T>, StoreError> {
        self.mget_per_job(
            jobs,
            |j| self.names.beat_rule(j),
            read,
            (per_mget, per_trip),
        )
        .await
    }

    /// Writes each `(job, instant, rule)` as the job's progress (never moving it back) and the
    /// rule it is recorded under, while `token` holds the leader lease and no instant is more
    /// than `max_ahead` past Redis `TIME`: as [`Store::advance_progress`], `per_call` jobs per
    /// script call, one round trip, one outcome per entry.
    pub async fn start_progress(
        &self,
        token: &str,
        starts: &[(&str, DateTime<Utc>, &str)],
        max_ahead: Duration,
        per_call: usize,
    ) -> Result<Vec<Result<(), ProgressError>>, ProgressError> {
        let call = FencedCall::new(&START_FENCED, "start", token, max_ahead, per_call);
        let add = |call: &mut ScriptInvocation, (job, at, rule): &(&str, DateTime<Utc>, &str)| {
            call.key(self.names.beat_last(job))
                .key(self.names.beat_rule(job))
                .arg(last_instant_text(*at))
                .arg(at.timestamp_millis())
                .arg(*rule);
        };
        let at = |(_, at, _): &(&str, DateTime<Utc>, &str)| *at;
        self.fenced_write(call, starts, add, at).await
    }
}
