//! The Redis scripts against the real Redis (own namespace per test, keys deleted when the
//! test ends, passed or panicked).

use chrono::{TimeZone, Utc};
use drumline_shared::names::Names;
use drumline_shared::store::{
    Candidate, Claim, ClaimRequest, Ending, Final, LeaseMode, LeaseOutcome, OverlapMode,
    ProgressError, RunState, Store,
};
use std::time::Duration;

const REDIS: &str = "redis://127.0.0.1:6379/0";

/// A store on a fresh namespace whose keys are deleted when it goes out of scope, also when the
/// test panics half-way.
struct TestStore(Store);

impl std::ops::Deref for TestStore {
    type Target = Store;
    fn deref(&self) -> &Store {
        &self.0
    }
}

impl Drop for TestStore {
    fn drop(&mut self) {
        // Blocking client: `Drop` cannot await, and a panicking test's runtime may be gone.
        let pattern = format!("{}:*", self.0.names().namespace());
        let Ok(mut conn) = redis::Client::open(REDIS).and_then(|c| c.get_connection()) else {
            return;
        };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(pattern)
            .query(&mut conn)
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: redis::RedisResult<()> = redis::cmd("DEL").arg(keys).query(&mut conn);
        }
    }
}

async fn store(test: &str) -> TestStore {
    let ns = format!(
        "t_store_{test}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    TestStore(
        Store::connect(REDIS, None, Names::new(ns))
            .await
            .expect("redis"),
    )
}

fn req<'a>(key: &'a str, token: &'a str, overlap: OverlapMode<'a>) -> ClaimRequest<'a> {
    ClaimRequest {
        key,
        token,
        worker: "w",
        attempt: 0,
        lease: Duration::from_secs(5),
        overlap,
        retention: Duration::from_secs(60),
        expired: false,
    }
}

#[tokio::test]
async fn claim_is_exclusive_and_fences_increase() {
    let s = store("exclusive").await;
    let Claim::Claimed { fence: f1 } = s.claim(&req("k1", "a", OverlapMode::Allow)).await.unwrap()
    else {
        panic!("first claim must win")
    };
    match s.claim(&req("k1", "b", OverlapMode::Allow)).await.unwrap() {
        Claim::Busy { retry_in } => {
            assert!(retry_in <= Duration::from_secs(5) && retry_in > Duration::ZERO)
        }
        other => panic!("{other:?}"),
    }
    // Only the holder may renew, finish or release.
    assert!(!s
        .renew("k1", None, "b", Duration::from_secs(5))
        .await
        .unwrap());
    assert!(!s
        .finish(
            "k1",
            None,
            "b",
            Ending::Final(Final::Done),
            Duration::from_secs(60)
        )
        .await
        .unwrap());
    assert!(!s.release("k1", None, "b").await.unwrap());
    assert!(s
        .renew("k1", None, "a", Duration::from_secs(5))
        .await
        .unwrap());
    assert!(s
        .finish(
            "k1",
            None,
            "a",
            Ending::Final(Final::Done),
            Duration::from_secs(60)
        )
        .await
        .unwrap());
    assert_eq!(
        s.claim(&req("k1", "c", OverlapMode::Allow)).await.unwrap(),
        Claim::Duplicate {
            state: RunState::Done
        }
    );
    // A released claim can be taken again, with a larger fence.
    let Claim::Claimed { fence: f2 } = s.claim(&req("k2", "a", OverlapMode::Allow)).await.unwrap()
    else {
        panic!()
    };
    assert!(s.release("k2", None, "a").await.unwrap());
    let Claim::Claimed { fence: f3 } = s.claim(&req("k2", "b", OverlapMode::Allow)).await.unwrap()
    else {
        panic!()
    };
    assert!(f1 < f2 && f2 < f3, "{f1} {f2} {f3}");
}

#[tokio::test]
async fn an_expired_lease_can_be_taken_over() {
    let s = store("expiry").await;
    let mut short = req("k", "a", OverlapMode::Allow);
    short.lease = Duration::from_millis(150);
    assert!(matches!(
        s.claim(&short).await.unwrap(),
        Claim::Claimed { .. }
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(matches!(
        s.claim(&req("k", "b", OverlapMode::Allow)).await.unwrap(),
        Claim::Claimed { .. }
    ));
    // The old holder's late result is refused while another claim holds the key.
    assert!(!s
        .finish(
            "k",
            None,
            "a",
            Ending::Final(Final::Done),
            Duration::from_secs(60)
        )
        .await
        .unwrap());
    assert_eq!(s.run_state("k").await.unwrap().as_deref(), Some("running"));
}

#[tokio::test]
async fn overlap_lock_skips_or_queues_other_instances_of_the_job() {
    let s = store("overlap").await;
    assert!(matches!(
        s.claim(&req("j@1", "a", OverlapMode::Skip("j")))
            .await
            .unwrap(),
        Claim::Claimed { .. }
    ));
    assert_eq!(
        s.claim(&req("j@2", "b", OverlapMode::Skip("j")))
            .await
            .unwrap(),
        Claim::Skipped {
            running: "j@1".into()
        }
    );
    assert_eq!(
        s.run_state("j@2").await.unwrap().as_deref(),
        Some("skipped")
    );
    assert!(matches!(
        s.claim(&req("j@3", "c", OverlapMode::Queue("j")))
            .await
            .unwrap(),
        Claim::Waiting { .. }
    ));
    // Finishing frees the job for the next instance.
    assert!(s
        .finish(
            "j@1",
            Some("j"),
            "a",
            Ending::Final(Final::Done),
            Duration::from_secs(60)
        )
        .await
        .unwrap());
    assert!(matches!(
        s.claim(&req("j@3", "c", OverlapMode::Queue("j")))
            .await
            .unwrap(),
        Claim::Claimed { .. }
    ));
}

fn candidate(token: &str) -> Candidate {
    Candidate {
        token: token.to_owned(),
        host: "h".to_owned(),
        pid: 42,
    }
}

const LEASE: Duration = Duration::from_secs(5);

#[tokio::test]
async fn progress_moves_forward_only_under_the_lease() {
    let s = store("last").await;
    let t1 = Utc.with_ymd_and_hms(2026, 3, 8, 7, 0, 0).unwrap();
    let t2 = t1 + chrono::Duration::milliseconds(500);
    let far = Duration::from_secs(365 * 86400 * 100);
    assert_eq!(s.last_published("j").await.unwrap(), None);
    // Nobody leads: nothing moves.
    let refused = s.advance_progress("a", &[("j", t1)], far, 10).await;
    assert!(
        matches!(refused, Err(ProgressError::Deposed)),
        "{refused:?}"
    );
    assert_eq!(s.last_published("j").await.unwrap(), None);

    let lead = s
        .lead(&candidate("a"), LEASE, LeaseMode::Acquire)
        .await
        .unwrap();
    assert!(matches!(lead.outcome, LeaseOutcome::Acquired { .. }));
    let written = s
        .advance_progress("a", &[("j", t2), ("k", t1)], far, 1)
        .await
        .unwrap();
    assert!(written.iter().all(Result::is_ok), "{written:?}");
    s.advance_progress("a", &[("j", t1)], far, 10)
        .await
        .unwrap();
    assert_eq!(s.last_published("j").await.unwrap(), Some(t2));
    assert_eq!(s.last_published("k").await.unwrap(), Some(t1));

    // Another token moves nothing, even forward.
    let later = t2 + chrono::Duration::seconds(1);
    let refused = s.advance_progress("b", &[("j", later)], far, 10).await;
    assert!(
        matches!(refused, Err(ProgressError::Deposed)),
        "{refused:?}"
    );
    assert_eq!(s.last_published("j").await.unwrap(), Some(t2));
}

#[tokio::test]
async fn progress_ahead_of_redis_time_is_refused_per_job() {
    let s = store("ahead").await;
    s.lead(&candidate("a"), LEASE, LeaseMode::Acquire)
        .await
        .unwrap();
    let now = s.redis_time().await.unwrap();
    let threshold = Duration::from_secs(5);
    let near = now + chrono::Duration::seconds(2);
    let ahead = now + chrono::Duration::hours(1);
    let out = s
        .advance_progress("a", &[("near", near), ("ahead", ahead)], threshold, 10)
        .await
        .unwrap();
    assert!(out[0].is_ok(), "{out:?}");
    assert!(
        matches!(out[1], Err(ProgressError::Ahead { at }) if at == ahead),
        "{out:?}"
    );
    assert!(s.last_published("near").await.unwrap().is_some());
    assert_eq!(s.last_published("ahead").await.unwrap(), None);
}

#[tokio::test]
async fn the_lease_has_one_holder_and_each_acquisition_a_new_epoch() {
    let s = store("lease").await;
    let (a, b) = (candidate("a"), candidate("b"));
    let first = s.lead(&a, LEASE, LeaseMode::Acquire).await.unwrap();
    let LeaseOutcome::Acquired { epoch } = first.outcome else {
        panic!("{first:?}")
    };
    assert_eq!(
        s.lead(&b, LEASE, LeaseMode::Acquire).await.unwrap().outcome,
        LeaseOutcome::Refused { holder: epoch }
    );
    assert_eq!(
        s.lead(&b, LEASE, LeaseMode::Renew).await.unwrap().outcome,
        LeaseOutcome::Refused { holder: epoch }
    );
    assert_eq!(
        s.lead(&a, LEASE, LeaseMode::Renew).await.unwrap().outcome,
        LeaseOutcome::Renewed { epoch }
    );
    // What `status` reads: written by the script, from Redis's clock.
    let leader = s.leader().await.unwrap().expect("a leader");
    assert_eq!(
        (leader.host.as_str(), leader.pid, leader.epoch),
        ("h", 42, epoch)
    );
    let since = chrono::DateTime::parse_from_rfc3339(&leader.since).expect("RFC 3339");
    let skew = (since.with_timezone(&Utc) - first.redis_time).num_milliseconds();
    assert_eq!(
        skew, 0,
        "since {} vs TIME {}",
        leader.since, first.redis_time
    );

    // Only the holder releases; then the other acquires under the next epoch, and the old
    // holder cannot renew its way back.
    assert!(!s.resign_lead("b").await.unwrap());
    assert!(s.resign_lead("a").await.unwrap());
    assert_eq!(
        s.lead(&a, LEASE, LeaseMode::Renew).await.unwrap().outcome,
        LeaseOutcome::Refused { holder: 0 }
    );
    assert_eq!(
        s.lead(&b, LEASE, LeaseMode::Acquire).await.unwrap().outcome,
        LeaseOutcome::Acquired { epoch: epoch + 1 }
    );
}

#[tokio::test]
async fn a_lapsed_lease_is_free_and_renewing_it_is_refused() {
    let s = store("lapse").await;
    let a = candidate("a");
    s.lead(&a, Duration::from_millis(50), LeaseMode::Acquire)
        .await
        .unwrap();
    let mut conn = redis::Client::open(REDIS)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let gone = async {
        loop {
            let exists: bool = redis::cmd("EXISTS")
                .arg(s.names().beat_leader())
                .query_async(&mut conn)
                .await
                .unwrap();
            if !exists {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), gone)
        .await
        .expect("the lease expires with its TTL");
    assert_eq!(
        s.lead(&a, LEASE, LeaseMode::Renew).await.unwrap().outcome,
        LeaseOutcome::Refused { holder: 0 }
    );
    assert!(matches!(
        s.lead(&candidate("b"), LEASE, LeaseMode::Acquire)
            .await
            .unwrap()
            .outcome,
        LeaseOutcome::Acquired { .. }
    ));
}

#[tokio::test]
async fn a_retry_keeps_its_place_and_older_copies_are_duplicates() {
    let s = store("retrying").await;
    let Claim::Claimed { .. } = s
        .claim(&req("k", "a", OverlapMode::Skip("j")))
        .await
        .unwrap()
    else {
        panic!("first claim must win")
    };
    // Only the holder hands the instance to its retry; the job lock goes with it.
    assert!(!s
        .finish(
            "k",
            Some("j"),
            "b",
            Ending::Retry { next_attempt: 1 },
            Duration::from_secs(60)
        )
        .await
        .unwrap());
    assert!(s
        .finish(
            "k",
            Some("j"),
            "a",
            Ending::Retry { next_attempt: 1 },
            Duration::from_secs(60)
        )
        .await
        .unwrap());
    assert_eq!(s.run_state("k").await.unwrap().as_deref(), Some("retrying"));
    assert!(matches!(
        s.claim(&req("j@other", "x", OverlapMode::Skip("j")))
            .await
            .unwrap(),
        Claim::Claimed { .. }
    ));
    // A copy of attempt 0 (the other beat's, a redelivery) is a duplicate, expired or not.
    assert_eq!(
        s.claim(&req("k", "b", OverlapMode::Allow)).await.unwrap(),
        Claim::Duplicate {
            state: RunState::Retrying
        }
    );
    let mut late = req("k", "b", OverlapMode::Allow);
    late.expired = true;
    assert_eq!(
        s.claim(&late).await.unwrap(),
        Claim::Duplicate {
            state: RunState::Retrying
        }
    );
    // The retry's copy claims it; while it runs, older copies are still duplicates.
    let mut retry = req("k", "c", OverlapMode::Allow);
    retry.attempt = 1;
    assert!(matches!(
        s.claim(&retry).await.unwrap(),
        Claim::Claimed { .. }
    ));
    assert_eq!(
        s.claim(&req("k", "d", OverlapMode::Allow)).await.unwrap(),
        Claim::Duplicate {
            state: RunState::Running
        }
    );
}

#[tokio::test]
async fn an_expired_copy_takes_nothing_unless_it_is_a_duplicate() {
    let s = store("expired").await;
    let mut late = req("k", "a", OverlapMode::Skip("j"));
    late.expired = true;
    assert_eq!(s.claim(&late).await.unwrap(), Claim::Expired);
    assert_eq!(s.run_state("k").await.unwrap(), None, "nothing taken");
    assert!(
        matches!(
            s.claim(&req("j@2", "b", OverlapMode::Skip("j")))
                .await
                .unwrap(),
            Claim::Claimed { .. }
        ),
        "the job lock was not taken either"
    );
}

#[tokio::test]
async fn a_finished_run_is_recorded_even_when_its_lease_lapsed_unclaimed() {
    let s = store("lapsed").await;
    let mut short = req("k", "a", OverlapMode::Allow);
    short.lease = Duration::from_millis(100);
    assert!(matches!(
        s.claim(&short).await.unwrap(),
        Claim::Claimed { .. }
    ));
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(s.run_state("k").await.unwrap(), None);
    assert!(s
        .finish(
            "k",
            None,
            "a",
            Ending::Final(Final::Done),
            Duration::from_secs(60)
        )
        .await
        .unwrap());
    assert_eq!(
        s.claim(&req("k", "b", OverlapMode::Allow)).await.unwrap(),
        Claim::Duplicate {
            state: RunState::Done
        }
    );
}
