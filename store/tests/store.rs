//! The Redis scripts against the real Redis (own namespace per test, keys deleted when the
//! test ends, passed or panicked).

use chrono::{TimeZone, Utc};
use drumline_core::names::Names;
use drumline_e2e::{Namespace, REDIS_URL};
use drumline_store::{
    Candidate, Claim, ClaimRequest, Ending, Final, LeaseMode, LeaseOutcome, OverlapMode,
    ProgressError, RunRecord, RunState, Skipped, Store, Unclaimed, LUA_RFC3339,
};
use std::time::{Duration, Instant};

/// A store on a namespace of the test kit ([`Namespace`]), whose keys are deleted when it goes
/// out of scope, also when the test panics half-way.
struct TestStore {
    store: Store,
    _namespace: Namespace,
}

impl std::ops::Deref for TestStore {
    type Target = Store;
    fn deref(&self) -> &Store {
        &self.store
    }
}

/// The endings the tests give most: done, dead, and a retry held for 5 s.
const DONE: Ending = Ending::Final(Final::Done);
const DEAD: Ending = Ending::Final(Final::Dead);
const RETRY: Ending = Ending::Retry {
    next_attempt: 1,
    hold: Duration::from_secs(5),
};

/// What a claim of a copy of an instance in `state` answers.
fn duplicate(state: RunState) -> Claim {
    Claim::Duplicate { state }
}

/// The calls most tests repeat, each reduced to what they assert.
impl TestStore {
    /// True when `request` is claimed.
    async fn claimed(&self, request: &ClaimRequest<'_>) -> bool {
        matches!(self.claim(request).await.unwrap(), Claim::Claimed { .. })
    }

    /// `renew` for `secs` seconds: true when `token` held the lease.
    async fn renews(&self, key: &str, job: Option<&str>, token: &str, secs: u64) -> bool {
        let lease = Duration::from_secs(secs);
        self.renew(key, job, token, lease).await.unwrap()
    }

    /// `finish` with a 60 s retention: true when `token` held the lease.
    async fn ends(&self, key: &str, job: Option<&str>, token: &str, ending: Ending) -> bool {
        let retention = Duration::from_secs(60);
        self.finish(key, job, token, ending, retention)
            .await
            .unwrap()
            .ours
    }

    /// `finish_recorded` of instance `key` of job `j` with `record` and a 60 s retention:
    /// true when `token` held the lease.
    async fn records(&self, key: &str, token: &str, end: Final, record: &RunRecord) -> bool {
        let (job, retention) = (Some("j"), Duration::from_secs(60));
        let ours = self.finish_recorded(key, job, token, end, retention, Some(record));
        ours.await.unwrap().ours
    }

    /// The run state of instance `key`.
    async fn state(&self, key: &str) -> Option<String> {
        self.run_state(key).await.unwrap()
    }

    /// The length of Redis list `key`.
    async fn llen(&self, key: &str) -> i64 {
        self.integer("LLEN", key).await
    }

    /// The time to live of Redis key `key`, in ms.
    async fn pttl(&self, key: &str) -> i64 {
        self.integer("PTTL", key).await
    }

    /// Redis command `command` on `key`, answering an integer.
    async fn integer(&self, command: &str, key: &str) -> i64 {
        let mut conn = self.connection();
        redis::cmd(command)
            .arg(key)
            .query_async(&mut conn)
            .await
            .unwrap()
    }
}

async fn store(test: &str) -> TestStore {
    let namespace = Namespace::new(&format!("store_{test}"));
    let store = Store::connect(REDIS_URL, None, Names::new(namespace.name()))
        .await
        .expect("redis");
    TestStore {
        store,
        _namespace: namespace,
    }
}

/// A claim of `key`; an overlap mode with a job makes it an instance of that job.
fn req<'a>(key: &'a str, token: &'a str, overlap: OverlapMode<'a>) -> ClaimRequest<'a> {
    let job = match overlap {
        OverlapMode::Allow => None,
        OverlapMode::Skip(job) | OverlapMode::Queue(job) => Some(job),
    };
    ClaimRequest {
        key,
        token,
        worker: "w",
        job,
        attempt: 0,
        lease: Duration::from_secs(5),
        overlap,
        retention: Duration::from_secs(60),
        expired: false,
        limit: None,
        epoch: 0,
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
        Claim::Busy { retry_in, handover } => {
            assert!(!handover);
            assert!(retry_in <= Duration::from_secs(5) && retry_in > Duration::ZERO)
        }
        other => panic!("{other:?}"),
    }
    // Only the holder may renew, finish or release.
    assert!(!s.renews("k1", None, "b", 5).await);
    assert!(!s.ends("k1", None, "b", DONE).await);
    assert!(!s.release("k1", None, "b").await.unwrap().ours);
    assert!(s.renews("k1", None, "a", 5).await);
    assert!(s.ends("k1", None, "a", DONE).await);
    let copy = s.claim(&req("k1", "c", OverlapMode::Allow)).await.unwrap();
    assert_eq!(copy, duplicate(RunState::Done));
    // A released claim can be taken again, with a larger fence.
    let Claim::Claimed { fence: f2 } = s.claim(&req("k2", "a", OverlapMode::Allow)).await.unwrap()
    else {
        panic!()
    };
    assert!(s.release("k2", None, "a").await.unwrap().ours);
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
    assert!(s.claimed(&short).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(s.claimed(&req("k", "b", OverlapMode::Allow)).await);
    // The old holder's late result is refused while another claim holds the key.
    assert!(!s.ends("k", None, "a", DONE).await);
    assert_eq!(s.run_state("k").await.unwrap().as_deref(), Some("running"));
}

#[tokio::test]
async fn overlap_lock_skips_or_queues_other_instances_of_the_job() {
    let s = store("overlap").await;
    assert!(s.claimed(&req("j@1", "a", OverlapMode::Skip("j"))).await);
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
    assert!(s.ends("j@1", Some("j"), "a", DONE).await);
    assert!(s.claimed(&req("j@3", "c", OverlapMode::Queue("j"))).await);
}

/// docs/guarantees.md#overlap: an instance holds its job through its retry delay, a newer
/// instance is skipped meanwhile, and a started instance is never skipped, only kept waiting.
#[tokio::test]
async fn a_retrying_instance_keeps_its_job_and_is_never_skipped() {
    let s = store("overlap_retry").await;
    s.claim(&req("j@1", "a", OverlapMode::Skip("j")))
        .await
        .unwrap();
    let retry = Ending::Retry {
        next_attempt: 1,
        hold: Duration::from_secs(5),
    };
    assert!(s.ends("j@1", Some("j"), "a", retry).await);
    // The newer instance is skipped while the older one waits for its retry.
    assert_eq!(
        s.claim(&req("j@2", "b", OverlapMode::Skip("j")))
            .await
            .unwrap(),
        Claim::Skipped {
            running: "j@1".into()
        }
    );
    // The retry claims its job again.
    let mut again = req("j@1", "c", OverlapMode::Skip("j"));
    again.attempt = 1;
    assert!(s.claimed(&again).await);
    // Released by shutdown, its lock taken by a newer instance meanwhile: the requeued copy of
    // the started instance waits for the lock; it is not skipped.
    assert!(s.release("j@1", Some("j"), "c").await.unwrap().ours);
    assert!(s.claimed(&req("j@3", "d", OverlapMode::Skip("j"))).await);
    let mut requeued = req("j@1", "e", OverlapMode::Skip("j"));
    requeued.attempt = 1;
    assert!(matches!(
        s.claim(&requeued).await.unwrap(),
        Claim::Waiting { running, .. } if running == "j@3"
    ));
    assert_eq!(
        s.run_state("j@1").await.unwrap().as_deref(),
        Some("running")
    );
}

/// The hold of a retry whose message was lost ends at its deadline: the job is free again.
#[tokio::test]
async fn a_retrys_hold_on_its_job_ends_at_its_deadline() {
    let s = store("overlap_hold").await;
    s.claim(&req("j@1", "a", OverlapMode::Skip("j")))
        .await
        .unwrap();
    let retry = Ending::Retry {
        next_attempt: 1,
        hold: Duration::from_millis(300),
    };
    assert!(s.ends("j@1", Some("j"), "a", retry).await);
    let freed = eventually(Duration::from_secs(5), || async {
        matches!(
            s.claim(&req("j@2", "b", OverlapMode::Queue("j")))
                .await
                .unwrap(),
            Claim::Claimed { .. }
        )
    })
    .await;
    assert!(freed, "the job stayed held past the retry's deadline");
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
    let mut conn = redis::Client::open(REDIS_URL)
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
    assert!(
        s.claimed(&req("k", "a", OverlapMode::Skip("j"))).await,
        "first claim must win"
    );
    // Only the holder hands the instance to its retry; the job lock goes with it.
    assert!(!s.ends("k", Some("j"), "b", RETRY).await);
    assert!(s.ends("k", Some("j"), "a", RETRY).await);
    assert_eq!(s.run_state("k").await.unwrap().as_deref(), Some("retrying"));
    // The retrying instance keeps its job: a newer one is skipped (docs/guarantees.md#overlap).
    let newer = s.claim(&req("j@other", "x", OverlapMode::Skip("j"))).await;
    assert_eq!(
        newer.unwrap(),
        Claim::Skipped {
            running: "k".into()
        }
    );
    // A copy of attempt 0 (the other beat's, a redelivery) is a duplicate, expired or not.
    let retrying = duplicate(RunState::Retrying);
    let copy = s.claim(&req("k", "b", OverlapMode::Allow)).await.unwrap();
    assert_eq!(copy, retrying);
    let mut late = req("k", "b", OverlapMode::Allow);
    late.expired = true;
    assert_eq!(s.claim(&late).await.unwrap(), retrying);
    // The retry's copy claims it; while it runs, older copies are still duplicates.
    let mut retry = req("k", "c", OverlapMode::Allow);
    retry.attempt = 1;
    assert!(s.claimed(&retry).await);
    let older = s.claim(&req("k", "d", OverlapMode::Allow)).await.unwrap();
    assert_eq!(older, duplicate(RunState::Running));
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

/// A retry that expires before it runs ends its instance: the job it held is free at once.
#[tokio::test]
async fn an_expired_retry_frees_the_job_it_held() {
    let s = store("expired_retry").await;
    s.claim(&req("j@1", "a", OverlapMode::Queue("j")))
        .await
        .unwrap();
    let retry = Ending::Retry {
        next_attempt: 1,
        hold: Duration::from_secs(60),
    };
    assert!(s.ends("j@1", Some("j"), "a", retry).await);
    let mut late = req("j@1", "b", OverlapMode::Queue("j"));
    (late.attempt, late.expired) = (1, true);
    assert_eq!(s.claim(&late).await.unwrap(), Claim::Expired);
    assert!(s.claimed(&req("j@2", "c", OverlapMode::Queue("j"))).await);
}

#[tokio::test]
async fn a_finished_run_is_recorded_even_when_its_lease_lapsed_unclaimed() {
    let s = store("lapsed").await;
    let mut short = req("k", "a", OverlapMode::Allow);
    short.lease = Duration::from_millis(100);
    assert!(s.claimed(&short).await);
    tokio::time::sleep(Duration::from_millis(250)).await;
    // The record outlives its lease (docs/design.md#attempts-outlive-the-lease).
    assert_eq!(s.run_state("k").await.unwrap().as_deref(), Some("running"));
    assert!(s.ends("k", None, "a", DONE).await);
    assert_eq!(
        s.claim(&req("k", "b", OverlapMode::Allow)).await.unwrap(),
        duplicate(RunState::Done)
    );
}

/// A claim of `key` at `attempt` with a lease of `lease_ms`.
fn at_attempt<'a>(key: &'a str, token: &'a str, attempt: u32, lease_ms: u64) -> ClaimRequest<'a> {
    ClaimRequest {
        attempt,
        lease: Duration::from_millis(lease_ms),
        ..req(key, token, OverlapMode::Allow)
    }
}

/// See: issues/16. After attempt 1's lease lapses, a copy of attempt 0 is a duplicate; attempt
/// 1's own copy takes the instance over with a new fence, and the record (attempt included) is
/// kept for the retention, not the lease.
#[tokio::test]
async fn a_lapsed_lease_keeps_its_attempt() {
    let s = store("lapsed_attempt").await;
    let Claim::Claimed { fence: f1 } = s.claim(&at_attempt("k", "a", 1, 100)).await.unwrap() else {
        panic!("claimed")
    };
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(!s.renews("k", None, "a", 5).await);
    assert_eq!(
        s.claim(&at_attempt("k", "b", 0, 5000)).await.unwrap(),
        duplicate(RunState::Running)
    );
    let Claim::Claimed { fence: f2 } = s.claim(&at_attempt("k", "c", 1, 5000)).await.unwrap()
    else {
        panic!("the recorded attempt takes over")
    };
    assert!(f2 > f1);
    let ttl: i64 = redis::cmd("PTTL")
        .arg(s.names().run_key("k"))
        .query_async(&mut s.connection())
        .await
        .unwrap();
    assert!(ttl > 5000, "kept for the retention: {ttl}");

    // A release (shutdown abandoned the run) keeps the attempt too, and frees the lease.
    assert!(s.release("k", None, "c").await.unwrap().ours);
    assert_eq!(
        s.claim(&at_attempt("k", "d", 0, 5000)).await.unwrap(),
        duplicate(RunState::Running)
    );
    assert!(s.claimed(&at_attempt("k", "e", 1, 5000)).await);
}

/// See: issues/16 "Outcome writes are not idempotent". Repeating `done`, `dead` or the retry
/// hand-over with the same token (its first reply lost) reports it recorded and writes
/// nothing twice; another token's repeat is refused.
#[tokio::test]
async fn outcome_writes_repeat_by_their_own_token() {
    let s = store("idempotent").await;
    assert!(s.claimed(&of_job("j@1", "a", "j")).await);
    let record = run("j@1", "done", "2026-03-08T07:00:01Z");
    for _ in 0..2 {
        assert!(s.records("j@1", "a", Final::Done, &record).await);
    }
    assert_eq!(
        s.llen(&s.names().history("j")).await,
        1,
        "one history entry, not two"
    );
    assert!(!s.ends("j@1", None, "b", DONE).await);
    assert!(s.claimed(&req("k", "a", OverlapMode::Allow)).await);
    assert!(s.ends("k", None, "a", RETRY).await);
    assert!(s.ends("k", None, "a", RETRY).await);
    assert!(!s.ends("k", None, "b", RETRY).await);
    // The retry copy claims as usual, and the hand-over's token no longer finishes anything.
    assert!(s.claimed(&at_attempt("k", "c", 1, 5000)).await);
    assert!(!s.ends("k", None, "a", RETRY).await);
    assert!(!s.ends("k", None, "a", DONE).await);
}

/// A claim of `key` as an instance of `job` with overlap `allow`.
fn of_job<'a>(key: &'a str, token: &'a str, job: &'a str) -> ClaimRequest<'a> {
    ClaimRequest {
        job: Some(job),
        ..req(key, token, OverlapMode::Allow)
    }
}

/// `{ns}:running:{job}` as stored: (member, score in ms), lowest score first.
async fn running_set(s: &Store, job: &str) -> Vec<(String, f64)> {
    let mut conn = s.connection();
    redis::cmd("ZRANGE")
        .arg(s.names().running(job))
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// The score of `key` in `job`'s running set, if it is there.
async fn score(s: &Store, job: &str, key: &str) -> Option<f64> {
    let set = running_set(s, job).await;
    set.into_iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// What `status` reads as the number of `job`'s instances running now.
async fn running(s: &Store, job: &str) -> u64 {
    s.job_histories(&[job]).await.unwrap()[0].running
}

/// Redis `TIME` in ms.
async fn redis_ms(s: &Store) -> f64 {
    let mut conn = s.connection();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    (secs * 1000 + micros / 1000) as f64
}

/// Polls `check` every 20 ms until it holds or `within` has passed.
async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn running_set_follows_claim_renew_and_every_ending() {
    let s = store("running").await;
    // A claim adds its key, scored by its lease expiry on the Redis clock.
    let before = redis_ms(&s).await;
    assert!(s.claimed(&req("j@1", "a", OverlapMode::Skip("j"))).await);
    let after = redis_ms(&s).await;
    let first = score(&s, "j", "j@1").await.expect("claimed: in the set");
    let on_time = first >= before + 5000.0 && first <= after + 5000.0;
    assert!(on_time, "{before} {first} {after}");
    assert_eq!(running(&s, "j").await, 1);
    let ttl = s.pttl(&s.names().running("j")).await;
    let expires = ttl > 0 && ttl <= 5000;
    assert!(expires, "the set expires with its newest lease: {ttl}");

    // A skipped claim never enters the set; nor does an ad-hoc one, anywhere.
    let skipped = s.claim(&req("j@2", "b", OverlapMode::Skip("j"))).await;
    assert!(matches!(skipped.unwrap(), Claim::Skipped { .. }));
    assert!(s.claimed(&req("adhoc", "c", OverlapMode::Allow)).await);
    assert_eq!(running_set(&s, "j").await.len(), 1);
    assert!(running_set(&s, "").await.is_empty());

    // Renewing moves the score with the lease; someone else's renewal moves nothing.
    assert!(!s.renews("j@1", Some("j"), "x", 60).await);
    assert_eq!(score(&s, "j", "j@1").await, Some(first));
    assert!(s.renews("j@1", Some("j"), "a", 60).await);
    let renewed = score(&s, "j", "j@1").await.unwrap();
    assert!(renewed >= first + 55_000.0, "{first} -> {renewed}");

    // Finish, retry and release each take the key out; an instance with `overlap = allow` is
    // counted as well.
    assert!(s.ends("j@1", Some("j"), "a", DONE).await);
    assert!(score(&s, "j", "j@1").await.is_none());
    for (key, token) in [("j@3", "d"), ("j@4", "e"), ("j@5", "f")] {
        assert!(s.claimed(&of_job(key, token, "j")).await, "{key}");
    }
    assert_eq!(running(&s, "j").await, 3);
    assert!(s.ends("j@3", Some("j"), "d", RETRY).await);
    assert!(s.release("j@4", Some("j"), "e").await.unwrap().ours);
    assert!(s.ends("j@5", Some("j"), "f", DEAD).await);
    assert_eq!(running_set(&s, "j").await, vec![]);
    assert_eq!(running(&s, "j").await, 0);
    // The retry's claim counts again.
    let mut next = of_job("j@3", "g", "j");
    next.attempt = 1;
    assert!(s.claimed(&next).await);
    assert_eq!(running(&s, "j").await, 1);
}

#[tokio::test]
async fn an_expired_lease_is_not_counted_and_the_next_writer_drops_it() {
    let s = store("running_expiry").await;
    let mut killed = of_job("j@1", "a", "j");
    killed.lease = Duration::from_millis(200);
    assert!(s.claimed(&killed).await);
    assert!(s.claimed(&of_job("j@2", "b", "j")).await);
    assert_eq!(running(&s, "j").await, 2);
    // Its worker "died": nobody renews it. Once its lease expires it is no longer counted,
    // though readers leave it in place...
    assert!(
        eventually(Duration::from_secs(5), || async {
            running(&s, "j").await == 1
        })
        .await
    );
    assert_eq!(running_set(&s, "j").await.len(), 2);
    // ...until the next claim trims it.
    assert!(s.claimed(&of_job("j@3", "c", "j")).await);
    let keys: Vec<String> = running_set(&s, "j")
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(keys, ["j@2", "j@3"]);
    assert_eq!(running(&s, "j").await, 2);

    // A worker that takes the lapsed instance over enters it again, and the old holder's late
    // ending leaves the new claim's entry alone.
    assert!(s.claimed(&of_job("j@1", "d", "j")).await);
    let done = Ending::Final(Final::Done);
    assert!(!s.ends("j@1", Some("j"), "a", done).await);
    assert!(!s.release("j@1", Some("j"), "a").await.unwrap().ours);
    assert!(score(&s, "j", "j@1").await.is_some());
    assert_eq!(running(&s, "j").await, 3);
}

fn run(key: &str, status: &str, finished_at: &str) -> RunRecord {
    RunRecord {
        key: key.to_owned(),
        scheduled_for: "2026-03-08T07:00:00Z".to_owned(),
        status: status.to_owned(),
        attempt: 0,
        worker: "w".to_owned(),
        started_at: None,
        finished_at: finished_at.to_owned(),
        error: None,
        reason: None,
    }
}

#[tokio::test]
async fn status_reads_success_failure_running_and_oldest_per_job() {
    let s = store("histories").await;
    let retention = Duration::from_secs(60);
    s.record(
        "j",
        &run("j@1", "failed", "2026-03-08T07:00:01.500Z"),
        retention,
    )
    .await
    .unwrap();
    s.record("j", &run("j@1", "done", "2026-03-08T07:00:03Z"), retention)
        .await
        .unwrap();
    // A skipped run is neither a success nor a failure.
    s.record(
        "j",
        &run("j@2", "skipped", "2026-03-08T07:00:04Z"),
        retention,
    )
    .await
    .unwrap();
    s.record(
        "k",
        &run("k@1", "expired", "2026-03-08T07:00:05Z"),
        retention,
    )
    .await
    .unwrap();
    assert!(s.claimed(&of_job("j@3", "a", "j")).await);
    let ttl: i64 = redis::cmd("PTTL")
        .arg(s.names().last_failure("j"))
        .query_async(&mut s.connection())
        .await
        .unwrap();
    assert!(
        ttl > 0 && ttl <= 60_000,
        "last_failure lives as long as done_ttl: {ttl}"
    );

    let at = |text: &str| drumline_core::envelope::parse_instant(text);
    let h = s.job_histories(&["j", "k", "none"]).await.unwrap();
    assert_eq!(h.len(), 3);
    assert_eq!(h[0].last_success, at("2026-03-08T07:00:03Z"));
    assert_eq!(h[0].last_failure, at("2026-03-08T07:00:01.500Z"));
    assert_eq!(h[0].running, 1);
    assert_eq!(
        h[0].oldest.as_ref().map(|r| r.status.as_str()),
        Some("failed")
    );
    assert_eq!(
        (h[1].last_success, h[1].last_failure),
        (None, at("2026-03-08T07:00:05Z"))
    );
    assert_eq!(h[1].running, 0);
    assert_eq!(h[2].last_failure, None);
    assert_eq!(h[2].oldest, None);
}

#[tokio::test]
async fn status_reads_the_newest_runs_newest_first_at_most_recent_runs() {
    let s = store("recent").await;
    let retention = Duration::from_secs(60);
    for i in 1..=8 {
        let finished = format!("2026-03-08T07:00:0{i}Z");
        s.record("j", &run(&format!("j@{i}"), "failed", &finished), retention)
            .await
            .unwrap();
    }
    s.record("k", &run("k@1", "done", "2026-03-08T07:00:09Z"), retention)
        .await
        .unwrap();
    let h = s.job_histories(&["j", "k", "none"]).await.unwrap();
    let keys = |i: usize| -> Vec<&str> { h[i].recent.iter().map(|r| r.key.as_str()).collect() };
    assert_eq!(drumline_store::RECENT_RUNS, 5);
    assert_eq!(keys(0), ["j@8", "j@7", "j@6", "j@5", "j@4"]);
    assert_eq!(h[0].newest.as_ref().map(|r| r.key.as_str()), Some("j@8"));
    assert_eq!(h[0].oldest.as_ref().map(|r| r.key.as_str()), Some("j@1"));
    assert_eq!(keys(1), ["k@1"]);
    assert!(h[2].recent.is_empty() && h[2].newest.is_none());
}

#[tokio::test]
async fn a_final_state_and_its_run_record_land_in_one_call_and_only_for_the_holder() {
    let s = store("finish_recorded").await;
    let at = |text: &str| drumline_core::envelope::parse_instant(text);
    let history = s.names().history("j");
    let history_len = || s.llen(&history);
    assert!(s.claimed(&of_job("j@1", "a", "j")).await);
    let done = run("j@1", "done", "2026-03-08T07:00:03Z");
    assert!(s.records("j@1", "a", Final::Done, &done).await);
    assert_eq!(s.state("j@1").await.as_deref(), Some("done"));
    let h = s.job_histories(&["j"]).await.unwrap();
    assert_eq!(h[0].last_success, at("2026-03-08T07:00:03Z"));
    assert_eq!(h[0].running, 0);
    assert_eq!(h[0].oldest.as_ref().map(|r| r.key.as_str()), Some("j@1"));
    assert_eq!(history_len().await, 1);

    // Not the holder: neither the state nor the record is written.
    assert!(s.claimed(&of_job("j@2", "b", "j")).await);
    let stolen = run("j@2", "dead", "2026-03-08T07:00:04Z");
    assert!(!s.records("j@2", "x", Final::Dead, &stolen).await);
    assert_eq!(s.state("j@2").await.as_deref(), Some("running"));
    assert_eq!(history_len().await, 1);
    assert_eq!(s.job_histories(&["j"]).await.unwrap()[0].last_failure, None);

    // The holder's dead run: the last failure, kept for the retention.
    let dead = run("j@2", "dead", "2026-03-08T07:00:05Z");
    assert!(s.records("j@2", "b", Final::Dead, &dead).await);
    let h = s.job_histories(&["j"]).await.unwrap();
    assert_eq!(h[0].last_failure, at("2026-03-08T07:00:05Z"));
    assert_eq!(h[0].last_success, at("2026-03-08T07:00:03Z"));
    assert_eq!(history_len().await, 2);
    let ttl = s.pttl(&s.names().last_failure("j")).await;
    let kept = ttl > 0 && ttl <= 60_000;
    assert!(kept, "last_failure lives as long as done_ttl: {ttl}");
}

/// The lease's `since` is formatted by the script from Redis `TIME`; its date arithmetic,
/// run by the real Redis on the dates that break naive formulas, against chrono.
#[tokio::test]
async fn the_scripts_rfc3339_matches_chrono_across_the_calendar() {
    let mut conn = redis::Client::open(REDIS_URL)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    let script = redis::Script::new(&format!("{LUA_RFC3339}return rfc3339(tonumber(ARGV[1]))"));
    for text in [
        "1970-01-01T00:00:00.000Z",
        "2000-02-29T23:59:59.999Z",
        "2024-12-31T12:34:56.789Z",
        "2026-03-01T00:00:00.001Z",
        "2026-11-30T21:15:07.250Z",
        "2100-03-01T08:00:00.000Z",
    ] {
        let ms = chrono::DateTime::parse_from_rfc3339(text)
            .unwrap()
            .timestamp_millis();
        let formatted: String = script.arg(ms).invoke_async(&mut conn).await.unwrap();
        assert_eq!(formatted, text, "{ms}");
    }
}

#[tokio::test]
async fn each_decision_is_journaled_by_its_own_script_and_none_when_off() {
    let s = store("journal").await;
    s.claim(&req("k", "a", OverlapMode::Allow)).await.unwrap();
    s.claim(&req("k", "b", OverlapMode::Allow)).await.unwrap(); // busy: not a decision
    let retry = Ending::Retry {
        next_attempt: 1,
        hold: Duration::from_secs(5),
    };
    let retention = Duration::from_secs(60);
    s.finish("k", None, "a", retry, retention).await.unwrap();
    let mut second = req("k", "c", OverlapMode::Allow);
    second.attempt = 1;
    s.claim(&second).await.unwrap();
    let done = Ending::Final(Final::Done);
    s.finish("k", None, "c", done, retention).await.unwrap();
    s.finish("k", None, "c", done, retention).await.unwrap(); // a repeat: recorded once
    s.claim(&second).await.unwrap(); // a duplicate
    let entries = s.journal_since(0, |k| k == "k").await.unwrap();
    let seen: Vec<(&str, Option<u32>, &str)> = entries
        .iter()
        .map(|e| (e.event.as_str(), e.attempt, e.token.as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            ("claim", Some(0), "a"),
            ("retry", Some(0), "a"),
            ("claim", Some(1), "c"),
            ("success", Some(1), "c"),
            ("duplicate", Some(1), "c"),
        ]
    );
    assert_eq!(
        (entries[0].worker.as_str(), entries[0].fence),
        ("w", Some(1))
    );
    assert_eq!(entries[1].next, Some(1));

    let off = drumline_core::config::JournalConfig {
        enabled: false,
        ..Default::default()
    };
    let quiet = s.store.clone().with_journal(off);
    quiet
        .claim(&req("q", "a", OverlapMode::Allow))
        .await
        .unwrap();
    assert!(s.journal_since(0, |k| k == "q").await.unwrap().is_empty());
}

/// The shared test Redis is a primary without replicas.
#[tokio::test]
async fn the_primarys_replicas_are_counted() {
    let s = store("replicas").await;
    assert_eq!(s.connected_replicas().await.unwrap(), 0);
}

/// `keep` trims: with a retention of 1 ms, appends keep trimming the journal's older entries
/// (whole stream nodes, `MINID ~`), however often a trim is sent; with the default they stay.
#[tokio::test]
async fn the_journal_keeps_entries_for_keep_and_no_longer() {
    let s = store("journal_keep").await;
    let short = drumline_core::config::JournalConfig {
        keep: Duration::from_millis(1),
        ..Default::default()
    };
    let brief = s.store.clone().with_journal(short);
    let mut conn = s.connection();
    let journal = s.names().journal();
    let (mut written, mut trimmed) = (0_u64, false);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !trimmed && Instant::now() < deadline {
        let key = format!("brief-{written}");
        brief
            .claim(&req(&key, "a", OverlapMode::Allow))
            .await
            .unwrap();
        written += 1;
        let len: u64 = redis::cmd("XLEN")
            .arg(&journal)
            .query_async(&mut conn)
            .await
            .unwrap();
        trimmed = len < written;
    }
    assert!(trimmed, "{written} entries, none trimmed");

    let before: u64 = redis::cmd("XLEN")
        .arg(&journal)
        .query_async(&mut conn)
        .await
        .unwrap();
    for i in 0..300 {
        s.claim(&req(&format!("kept-{i}"), "a", OverlapMode::Allow))
            .await
            .unwrap();
    }
    let after: u64 = redis::cmd("XLEN")
        .arg(&journal)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        after >= 300,
        "{before} then {after}: the default keep trimmed fresh entries"
    );
}

/// The status page's read (docs/design.md#bounded-work): the newest `n` journal entries, oldest
/// first, in one `XREVRANGE ... COUNT n`, never a scan of the whole stream.
#[tokio::test]
async fn the_newest_journal_entries_are_read_capped_oldest_first() {
    let s = store("journal_newest").await;
    assert!(
        s.journal_newest(5).await.unwrap().is_empty(),
        "no stream yet"
    );
    for i in 0..8 {
        s.claim(&req(&format!("n-{i}"), "a", OverlapMode::Allow))
            .await
            .unwrap();
    }
    let keys = |entries: Vec<drumline_store::JournalEntry>| -> Vec<String> {
        entries.into_iter().map(|e| e.key).collect()
    };
    assert_eq!(
        keys(s.journal_newest(3).await.unwrap()),
        ["n-5", "n-6", "n-7"]
    );
    let want: Vec<String> = (0..8).map(|i| format!("n-{i}")).collect();
    assert_eq!(
        keys(s.journal_newest(100).await.unwrap()),
        want,
        "fewer than asked: the whole stream"
    );
    assert!(s.journal_newest(0).await.unwrap().is_empty());
}

/// A worker's entries name the epoch of the leader that published the copy, so `audit` can
/// tell which leadership a run came from (0: ad-hoc or unknown).
#[tokio::test]
async fn a_claims_entries_carry_the_publishing_leaders_epoch() {
    let s = store("journal_epoch").await;
    let mut first = req("e", "a", OverlapMode::Allow);
    first.epoch = 7;
    s.claim(&first).await.unwrap();
    let done = Ending::Final(Final::Done);
    s.finish("e", None, "a", done, Duration::from_secs(60))
        .await
        .unwrap();
    let mut copy = req("e", "b", OverlapMode::Allow);
    copy.epoch = 8;
    s.claim(&copy).await.unwrap(); // a duplicate from a later leader
    let entries = s.journal_since(0, |k| k == "e").await.unwrap();
    let seen: Vec<(&str, Option<u64>)> = entries
        .iter()
        .map(|e| (e.event.as_str(), e.epoch))
        .collect();
    assert_eq!(
        seen,
        [
            ("claim", Some(7)),
            ("success", None),
            ("duplicate", Some(8))
        ]
    );
}

/// A holder that says when its run ended (`with_ended`) has the outcome's entry carry how
/// long before the write that was (`ago`), so a late write does not stretch the run
/// (docs/design.md#journal); a retry's and a release's too. Without it, none.
#[tokio::test]
async fn an_outcome_entry_says_how_long_ago_the_run_ended() {
    let s = store("journal_ago").await;
    let ttl = Duration::from_secs(60);
    let ended = tokio::time::Instant::now() - Duration::from_millis(1_500);
    let holder = s.with_ended(Some(ended));
    s.claim(&req("a", "t1", OverlapMode::Allow)).await.unwrap();
    holder
        .finish("a", None, "t1", Ending::Final(Final::Done), ttl)
        .await
        .unwrap();
    s.claim(&req("b", "t2", OverlapMode::Allow)).await.unwrap();
    holder
        .finish(
            "b",
            None,
            "t2",
            Ending::Retry {
                next_attempt: 1,
                hold: Duration::from_secs(5),
            },
            ttl,
        )
        .await
        .unwrap();
    s.claim(&req("c", "t3", OverlapMode::Allow)).await.unwrap();
    holder.release("c", None, "t3").await.unwrap();
    s.claim(&req("d", "t4", OverlapMode::Allow)).await.unwrap();
    s.finish("d", None, "t4", Ending::Final(Final::Dead), ttl)
        .await
        .unwrap();
    let entries = s.journal_since(0, |_| true).await.unwrap();
    let ago: Vec<(&str, &str, Option<u64>)> = entries
        .iter()
        .filter(|e| e.event != "claim")
        .map(|e| (e.key.as_str(), e.event.as_str(), e.ago.map(|ms| ms / 1_000)))
        .collect();
    assert_eq!(
        ago,
        [
            ("a", "success", Some(1)),
            ("b", "retry", Some(1)),
            ("c", "release", Some(1)),
            ("d", "dead", None)
        ]
    );
    let a = entries.iter().find(|e| e.event == "success").unwrap();
    assert_eq!(a.ended_ms(), a.at_ms - a.ago.unwrap() as i64);
}

/// An `after` job's skip (docs/design.md#job-dependencies): written only by the lease's holder,
/// only on an instance nobody recorded, with its reason and a history entry; a copy of a
/// skipped instance is then a duplicate at the claim.
#[tokio::test]
async fn a_follower_skip_is_fenced_and_never_overwrites_a_record() {
    let s = store("follower_skip").await;
    let ttl = Duration::from_secs(60);
    let mut skip = run("f@1", "skipped", "2026-03-08T07:00:01Z");
    skip.reason = Some("upstream".into());
    let st = &s;
    let skips =
        |leader, skip| async move { st.skip_follower(leader, "f", skip, ttl).await.unwrap() };
    // Nobody leads: nothing is written.
    assert_eq!(skips("a", &skip).await, Skipped::NotLeading);
    assert_eq!(s.state("f@1").await, None);
    s.lead(&candidate("a"), LEASE, LeaseMode::Acquire)
        .await
        .unwrap();
    assert_eq!(skips("b", &skip).await, Skipped::NotLeading);
    assert_eq!(skips("a", &skip).await, Skipped::Recorded);
    assert_eq!(s.state("f@1").await.as_deref(), Some("skipped"));
    assert_eq!(skips("a", &skip).await, Skipped::Known);
    let history = s.job_histories(&["f"]).await.unwrap();
    let reason = history[0].newest.as_ref().unwrap().reason.as_deref();
    assert_eq!(reason, Some("upstream"));
    let copy = s.claim(&req("f@1", "w1", OverlapMode::Skip("f"))).await;
    assert_eq!(copy.unwrap(), duplicate(RunState::Skipped));
    // An instance a copy already ran (published by a leader that died before its progress
    // write) keeps its outcome.
    assert!(
        s.claimed(&req("f@2", "w1", OverlapMode::Allow)).await,
        "not claimed"
    );
    s.finish("f@2", None, "w1", DONE, ttl).await.unwrap();
    let mut skip2 = skip.clone();
    skip2.key = "f@2".into();
    assert_eq!(skips("a", &skip2).await, Skipped::Known);
    assert_eq!(s.state("f@2").await.as_deref(), Some("done"));
}

/// `status` and the status page list the workers in a few round trips, however many keys the
/// Redis holds: a million jobs' progress beside them made a `SCAN` of the whole keyspace
/// (thousands of round trips) miss the page's 4 s deadline. Here 50,000 keys and a link
/// that holds each chunk 2 ms: a scan takes thousands of those round trips.
#[tokio::test(flavor = "multi_thread")]
async fn workers_are_listed_in_a_few_round_trips_beside_many_keys() {
    use drumline_e2e::proxy::{Fault, Proxy};
    use drumline_store::WorkerInfo;
    let s = store("workers_many_keys").await;
    let names = s.names().clone();
    let mut conn = redis::Client::open(REDIS_URL)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    for chunk in (0..50_000).collect::<Vec<u32>>().chunks(5_000) {
        let mut pipe = redis::pipe();
        for i in chunk {
            pipe.set(names.beat_last(&format!("job-{i}")), "x").ignore();
        }
        let () = pipe.query_async(&mut conn).await.unwrap();
    }
    let worker = |id: &str| WorkerInfo {
        id: id.into(),
        host: "h".into(),
        pid: 1,
        version: "v".into(),
        queues: vec!["default".into()],
        concurrency: 8,
        running: 0,
        started: "2026-12-04T00:00:00Z".into(),
    };
    for id in ["h:1:a", "h:2:b", "h:3:c"] {
        s.announce_worker(&worker(id), Duration::from_secs(60))
            .await
            .unwrap();
    }
    s.forget_worker("h:2:b").await.unwrap();

    let proxy = Proxy::start("127.0.0.1:6379".parse().unwrap());
    proxy.set(Fault::Delay(Duration::from_millis(2)));
    let slow = Store::connect(&proxy.redis_url(), None, names.clone())
        .await
        .expect("redis through the proxy");
    let listed = tokio::time::timeout(Duration::from_secs(4), slow.workers())
        .await
        .expect("the workers within the page's deadline")
        .unwrap();
    let ids: Vec<&str> = listed.iter().map(|w| w.id.as_str()).collect();
    assert_eq!(ids, ["h:1:a", "h:3:c"]);
    assert_eq!(listed[0], worker("h:1:a"));
}

/// A copy of `key` dead-lettered unrun for an unknown task (`record`: a job's instance).
fn unclaimed<'a>(key: &'a str, record: Option<(&'a str, &'a RunRecord)>) -> Unclaimed<'a> {
    Unclaimed {
        key,
        reason: "unknown_task",
        worker: "w",
        attempt: 0,
        retention: Duration::from_secs(60),
        record,
    }
}

#[tokio::test]
async fn a_copy_dead_lettered_unrun_is_recorded_only_where_nothing_is() {
    let s = store("dead_unclaimed").await;
    let record = RunRecord {
        key: "j@2026-03-08T07:30:00Z".into(),
        scheduled_for: "2026-03-08T07:30:00Z".into(),
        status: "dead".into(),
        attempt: 0,
        worker: "w".into(),
        started_at: None,
        finished_at: "2026-03-08T07:30:01Z".into(),
        error: Some("unknown_task: no task named \"t\" in this worker's config".into()),
        reason: None,
    };
    let record = &record;
    let key = "j@2026-03-08T07:30:00Z";
    assert!(s
        .dead_unclaimed(&unclaimed(key, Some(("j", record))))
        .await
        .unwrap());
    assert_eq!(s.run_state(key).await.unwrap().as_deref(), Some("dead"));
    assert_eq!(s.history_all("j").await.unwrap(), vec![record.clone()]);
    // Recorded once: a repeat, or a key with a state of its own, writes nothing.
    assert!(!s
        .dead_unclaimed(&unclaimed(key, Some(("j", record))))
        .await
        .unwrap());
    assert_eq!(s.history_all("j").await.unwrap().len(), 1);
    let Claim::Claimed { .. } = s.claim(&req("k", "a", OverlapMode::Allow)).await.unwrap() else {
        panic!("claimed")
    };
    assert!(!s.dead_unclaimed(&unclaimed("k", None)).await.unwrap());
    assert_eq!(s.run_state("k").await.unwrap().as_deref(), Some("running"));
    let dead: Vec<_> = s
        .journal_since(0, |_| true)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.event == "dead")
        .map(|e| (e.key, e.reason))
        .collect();
    assert_eq!(dead, vec![(key.to_owned(), "unknown_task".to_owned())]);
}

#[tokio::test]
async fn objects_put_get_page_and_delete_with_one_feed_entry_per_change() {
    use drumline_store::{Applied, FeedRead, ObjectKind::Schedule};
    let store = store("objects").await;
    let head = store.feed_head().await.expect("head");
    let put = |json: &str| vec![("a".to_owned(), json.to_owned()), ("b".into(), "{}".into())];
    let first = store.put_objects(Schedule, &put("{\"v\":1}"), 1_000).await;
    assert_eq!(first.expect("put"), [Applied::Created, Applied::Created]);
    let again = store.put_objects(Schedule, &put("{\"v\":2}"), 2_000).await;
    assert_eq!(again.expect("put"), [Applied::Replaced, Applied::Unchanged]);
    let a = store.object(Schedule, "a").await.expect("get").expect("a");
    assert_eq!(
        (a.json.as_str(), a.created_ms, a.updated_ms),
        ("{\"v\":2}", 1_000, 2_000)
    );
    let (next, page) = store.objects_page(Schedule, 0, 100).await.expect("page");
    assert_eq!((next, page.len()), (0, 2));
    let (next, mut bodies) = store
        .object_bodies_page(Schedule, 0, 100)
        .await
        .expect("page");
    bodies.sort();
    let expected = [("a", "{\"v\":2}"), ("b", "{}")].map(|(n, j)| (n.to_owned(), j.to_owned()));
    assert_eq!((next, bodies), (0, expected.to_vec()));
    assert_eq!(
        store
            .delete_objects(Schedule, &["a", "zz"])
            .await
            .expect("delete"),
        [true, false]
    );
    assert_eq!(store.object(Schedule, "a").await.expect("get"), None);
    let FeedRead::Changes(changes) = store.feed_since(&head, 100, 0).await.expect("feed") else {
        panic!("a gap in a fresh feed");
    };
    let seen: Vec<(&str, bool)> = changes
        .iter()
        .map(|c| (c.name.as_str(), c.deleted))
        .collect();
    assert_eq!(
        seen,
        [("a", false), ("b", false), ("a", false), ("a", true)]
    );
    let last = &changes[3].id;
    let none = store.feed_since(last, 100, 0).await.expect("feed");
    assert_eq!(none, FeedRead::Changes(Vec::new()));
}

/// The answer to a claim of `key` by `token` under `overlap`, as text.
fn claim_text<'s>(
    s: &'s Store,
    key: &'static str,
    token: &'static str,
    overlap: OverlapMode<'static>,
) -> Call<'s> {
    Box::pin(async move { format!("{:?}", s.claim(&req(key, token, overlap)).await) })
}

/// A call of [`mixed_calls`], its answer as text.
type Call<'s> = std::pin::Pin<Box<dyn std::future::Future<Output = String> + 's>>;

/// The calls of [`the_same_calls_batched_answer_as_one_by_one`], in order, each answer as text.
fn mixed_calls(s: &Store) -> Vec<Call<'_>> {
    let retention = Duration::from_secs(60);
    let expired = ClaimRequest {
        expired: true,
        ..req("expired", "t1", OverlapMode::Allow)
    };
    vec![
        claim_text(s, "done", "t1", OverlapMode::Allow),
        claim_text(s, "busy", "t1", OverlapMode::Allow),
        claim_text(s, "fresh", "t1", OverlapMode::Allow),
        claim_text(s, "skip", "t1", OverlapMode::Skip("j")),
        Box::pin(async move { format!("{:?}", s.claim(&expired).await) }),
        Box::pin(async move {
            format!(
                "{:?}",
                s.claim(&req("bad", "t1", OverlapMode::Allow))
                    .await
                    .is_err()
            )
        }),
        Box::pin(async move {
            format!(
                "{:?}",
                s.renew("busy", None, "t0", Duration::from_secs(5)).await
            )
        }),
        Box::pin(
            async move { format!("{:?}", s.finish("busy", None, "t0", DONE, retention).await) },
        ),
        claim_text(s, "fresh", "t2", OverlapMode::Allow),
        Box::pin(async move {
            format!(
                "{:?}",
                s.finish("fresh", None, "t1", RETRY, retention).await
            )
        }),
        Box::pin(async move { format!("{:?}", s.release("holder", Some("j"), "t0").await) }),
    ]
}

/// The state [`mixed_calls`] starts from: `done` finished, `busy` claimed by t0, job j's lock
/// held by t0's claim of `holder`, and `bad` a key of the wrong type.
async fn mixed_start(s: &TestStore) {
    let retention = Duration::from_secs(60);
    assert!(s.claimed(&req("done", "t0", OverlapMode::Allow)).await);
    s.finish("done", None, "t0", DONE, retention).await.unwrap();
    assert!(s.claimed(&req("busy", "t0", OverlapMode::Allow)).await);
    assert!(
        s.claimed(&req("holder", "t0", OverlapMode::Skip("j")))
            .await
    );
    let mut conn = s.connection();
    let bad = s.names().run_key("bad");
    let _: () = redis::cmd("SET")
        .arg(&bad)
        .arg("x")
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// `answer` without its wait (`retry_in`), which depends on when it was asked.
fn untimed(answer: String) -> String {
    match answer.split_once("retry_in: ") {
        Some((head, tail)) => format!("{head}{}", tail.split_once(", ").map_or("", |t| t.1)),
        None => answer,
    }
}

/// The journal of `s` as (event, key, attempt, token, reason, fence).
async fn journal_of(s: &Store) -> Vec<(String, String, Option<u32>, String, String, Option<u64>)> {
    let entries = s.journal_since(0, |_| true).await.unwrap();
    let entry =
        |e: drumline_store::JournalEntry| (e.event, e.key, e.attempt, e.token, e.reason, e.fence);
    entries.into_iter().map(entry).collect()
}

/// Calls that arrive together go as one script call (docs/design.md#batched-writes) and each
/// answers — and journals — exactly as it does alone, in order: a claim of a key claimed earlier
/// in the same batch is busy; a call Redis refuses (a key of the wrong type) fails alone.
#[tokio::test]
async fn the_same_calls_batched_answer_as_one_by_one() {
    let alone = store("batch_alone").await;
    mixed_start(&alone).await;
    let mut one_by_one = Vec::new();
    for call in mixed_calls(&alone) {
        one_by_one.push(untimed(call.await));
    }

    let together = store("batch_together").await;
    mixed_start(&together).await;
    let sizes = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = sizes.clone();
    let batching = together
        .store
        .clone()
        .batching(std::sync::Arc::new(move |n| seen.lock().unwrap().push(n)));
    // On this test's one thread every call is queued before the batching task first runs.
    let batched = futures_util::future::join_all(mixed_calls(&batching)).await;
    let batched: Vec<String> = batched.into_iter().map(untimed).collect();

    assert_eq!(
        *sizes.lock().unwrap(),
        [11],
        "one script call for all eleven"
    );
    assert_eq!(batched, one_by_one);
    assert!(one_by_one[2].contains("Claimed") && one_by_one[8].contains("Busy"));
    assert_eq!(one_by_one[5], "true", "the wrong-type key's claim failed");
    assert_eq!(journal_of(&together).await, journal_of(&alone).await);
}

/// A call whose caller stopped waiting before its batch went (a renewal that timed out behind
/// a slow batch) is not sent: it would only act for someone who no longer holds the answer.
#[tokio::test]
async fn a_call_given_up_before_its_batch_left_is_not_sent() {
    use futures_util::FutureExt;
    let s = store("batch_given_up").await;
    let sizes = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = sizes.clone();
    let batching = s
        .store
        .clone()
        .batching(std::sync::Arc::new(move |n| seen.lock().unwrap().push(n)));
    // Queued, then dropped before the batching task first ran (this test has one thread).
    let request = req("given-up", "t1", OverlapMode::Allow);
    assert!(batching.claim(&request).now_or_never().is_none());
    let kept = batching.claim(&req("kept", "t1", OverlapMode::Allow)).await;
    assert!(matches!(kept.unwrap(), Claim::Claimed { .. }));
    assert_eq!(
        *sizes.lock().unwrap(),
        [1],
        "only the call still awaited went"
    );
    assert_eq!(s.state("given-up").await, None);
}
