//! The lease watchdog (DESIGN §4 step 5, §8): renews the claim every `lease/3` and cancels the
//! handler *before* the lease could expire when renewals fail. Validity is judged on the
//! monotonic clock from the last successful renewal, never on Redis's word alone.

use drumline_shared::store::Store;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Why the watchdog gave up the lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseLost {
    /// Redis says the claim is no longer ours (expired and taken, or deleted).
    Taken,
    /// Renewals kept failing; the lease would expire before the next chance.
    Unreachable(String),
}

/// Renews `key` (and the overlap lock of `job`, if it holds it) under `token` until `stop` fires. Returns `Some` (and fires `lost`) when the
/// lease is lost; `None` when stopped normally.
pub async fn watch(
    store: Store,
    key: String,
    job: Option<String>,
    token: String,
    lease: Duration,
    stop: CancellationToken,
    lost: CancellationToken,
) -> Option<LeaseLost> {
    let every = lease / 3;
    let mut last_ok = Instant::now();
    let mut next = last_ok + every;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return None,
            _ = tokio::time::sleep_until(next) => {}
        }
        let attempt =
            tokio::time::timeout(every / 2, store.renew(&key, job.as_deref(), &token, lease)).await;
        let outcome = match attempt {
            Ok(Ok(true)) => {
                last_ok = Instant::now();
                next = last_ok + every;
                continue;
            }
            Ok(Ok(false)) => Some(LeaseLost::Taken),
            Ok(Err(e)) => Some(LeaseLost::Unreachable(e.to_string())),
            Err(_) => Some(LeaseLost::Unreachable("renewal timed out".into())),
        };
        let reason = outcome.expect("only failures reach here");
        // Another try fits only if it would still land well inside the lease.
        let retry_at = Instant::now() + every / 2;
        if reason == LeaseLost::Taken || retry_at + every / 2 >= last_ok + lease {
            lost.cancel();
            return Some(reason);
        }
        tracing::warn!(key = %key, reason = ?reason, "lease renewal failed; retrying");
        next = retry_at;
    }
}
