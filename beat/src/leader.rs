//! Leadership (docs/design.md#leadership): any number of beats run, one leads. A background
//! task holds or seeks the leader lease through the [`Store`] — a standby tries every
//! `leader_lease/3`, the leader renews every `leader_lease/3` — and publishes what it knows as
//! a [`Lead`]. The scheduler publishes only under a [`Term`] that [`Term::holds`]: the lease
//! was renewed less than `leader_lease − leader_lease/3` ago, counted from when the renewal was
//! *sent*, on [`WINDOW_CLOCK`] — a clock that counts the time a suspended host slept. So the
//! leader stops before any other beat can take over, and a leader resumed after SIGSTOP or a
//! suspend of its host publishes nothing until a renewal went through. Progress writes are
//! fenced in Redis by the lease's token besides (a deposed leader moves nothing).
//!
//! The pure rules — how long a reply lets a leader publish, whether a term may publish now,
//! which clock a leader plans with — are functions of their inputs ([`publish_until`],
//! [`Lead::publishes`], [`planning_now`]); clocks are read through [`Clocks`], so tests can play
//! a suspend; the task is their only effect, and touches Redis only through the [`Store`].

use crate::stats::{BeatStats, RedisContact};
use chrono::{DateTime, TimeDelta, Utc};
use drumline_shared::store::{Candidate, LeaseMode, LeaseOutcome, Store};
use nix::time::{clock_gettime, ClockId};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

/// Longest wait for Redis when a stopping leader releases its lease.
const RESIGN_TIMEOUT: Duration = Duration::from_secs(2);

/// The clock a publish window is measured on. `CLOCK_MONOTONIC` (tokio's and std's `Instant`)
/// stops while the host is suspended: a host resumed after a suspend longer than the lease would
/// find its window still open, while Redis let the lease lapse and another beat leads.
/// `CLOCK_BOOTTIME` is the same clock but for counting the suspend.
pub const WINDOW_CLOCK: ClockId = ClockId::CLOCK_BOOTTIME;

/// A reading of [`WINDOW_CLOCK`]: the time since its origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stamp(Duration);

impl Stamp {
    /// The reading `d` after this one.
    pub fn after(self, d: Duration) -> Stamp {
        Stamp(self.0 + d)
    }

    /// How long from this reading to `later` (zero when it is not later).
    pub fn until(self, later: Stamp) -> Duration {
        later.0.saturating_sub(self.0)
    }
}

/// The host's clocks, read by id: the beat reads the kernel's ([`Kernel`]); tests play a host
/// whose clocks a suspend moves apart.
pub trait Clocks: Send + Sync {
    /// What `clock` reads now: the time since its origin.
    fn read(&self, clock: ClockId) -> Duration;

    /// [`WINDOW_CLOCK`] now.
    fn now(&self) -> Stamp {
        Stamp(self.read(WINDOW_CLOCK))
    }
}

/// The kernel's clocks (`clock_gettime`).
pub struct Kernel;

impl Clocks for Kernel {
    fn read(&self, clock: ClockId) -> Duration {
        // Fails only for a clock the kernel lacks (CLOCK_BOOTTIME exists since Linux 2.6.39).
        clock_gettime(clock)
            .map(Duration::from)
            .expect("the kernel keeps this clock")
    }
}

/// What this beat knows of the lease, as of the last reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lead {
    /// Our epoch while we hold the lease; `None` on a standby.
    pub epoch: Option<u64>,
    /// When publishing stops unless a renewal moves it.
    pub valid_until: Stamp,
    /// Redis `TIME` at the last reply, with the reading of [`WINDOW_CLOCK`] when the reply
    /// arrived (`None` before one): Redis's clock now is the reading plus the time since,
    /// whatever this host's wall clock does meanwhile (an NTP step cannot move it, a suspend is
    /// counted).
    pub redis_clock: Option<(DateTime<Utc>, Stamp)>,
}

impl Lead {
    /// Redis `TIME` at `now`, as the last reading and the time since tell it. Measured from the
    /// reply's arrival, the latest instant the reading can stand for, so it never runs ahead of
    /// Redis however the round trip split.
    pub fn redis_now(&self, now: Stamp) -> Option<DateTime<Utc>> {
        self.redis_clock.map(|(reading, received)| {
            reading + TimeDelta::from_std(received.until(now)).unwrap_or_default()
        })
    }

    /// Whether the term of `epoch` may publish at `now`: it still holds the lease, and the
    /// window its last grant opened has not closed.
    pub fn publishes(&self, epoch: u64, now: Stamp) -> bool {
        self.epoch == Some(epoch) && now < self.valid_until
    }
}

/// How long a lease try sent at `sent` and granted lets this beat publish: `lease − lease/3`,
/// a third of the lease before any other beat can acquire it (the lease's TTL started at
/// the earliest when the try was sent).
pub fn publish_until(sent: Stamp, lease: Duration) -> Stamp {
    sent.after(lease - lease / 3)
}

/// The instant a leader plans with: its own wall clock, kept within `threshold` of Redis `TIME`
/// (`redis`, [`Lead::redis_now`]). A beat whose clock runs ahead publishes nothing early and
/// records no progress in the future; one whose clock runs behind publishes at most `threshold`
/// late rather than not at all while it holds the lease.
pub fn planning_now(
    local: DateTime<Utc>,
    redis: Option<DateTime<Utc>>,
    threshold: Duration,
) -> DateTime<Utc> {
    let threshold = TimeDelta::from_std(threshold).unwrap_or(TimeDelta::MAX);
    match redis {
        Some(redis) => local.clamp(redis - threshold, redis + threshold),
        None => local,
    }
}

/// The lease task and the view of it the scheduler reads.
pub struct Leadership {
    store: Store,
    candidate: Arc<Candidate>,
    lead: watch::Receiver<Lead>,
    tx: Arc<watch::Sender<Lead>>,
    task: JoinHandle<()>,
    threshold: Duration,
    clocks: Arc<dyn Clocks>,
}

/// One leadership term: what the scheduler publishes under, from a gain to its loss.
#[derive(Clone)]
pub struct Term {
    /// The term's epoch, carried by every message as `x-drumline-epoch`.
    pub epoch: u64,
    lead: watch::Receiver<Lead>,
    tx: Arc<watch::Sender<Lead>>,
    candidate: Arc<Candidate>,
    threshold: Duration,
    clocks: Arc<dyn Clocks>,
}

impl Leadership {
    /// Starts seeking the lease for `lease` in the background, reporting to `stats`.
    pub fn start(store: Store, lease: Duration, threshold: Duration, stats: BeatStats) -> Self {
        let candidate = Arc::new(Candidate {
            token: uuid::Uuid::new_v4().simple().to_string(),
            host: drumline_shared::names::host_name(),
            pid: std::process::id(),
        });
        let clocks: Arc<dyn Clocks> = Arc::new(Kernel);
        let (tx, lead) = watch::channel(Lead {
            epoch: None,
            valid_until: clocks.now(),
            redis_clock: None,
        });
        let tx = Arc::new(tx);
        let task = tokio::spawn(keep(
            store.clone(),
            candidate.clone(),
            (lease, threshold),
            (tx.clone(), clocks.clone()),
            stats,
        ));
        Leadership {
            store,
            candidate,
            lead,
            tx,
            task,
            threshold,
            clocks,
        }
    }

    /// Waits until this beat holds the lease with time left to publish; its term.
    pub async fn next_term(&mut self) -> Term {
        loop {
            let lead = *self.lead.borrow_and_update();
            let now = self.clocks.now();
            if let Some(epoch) = lead.epoch.filter(|epoch| lead.publishes(*epoch, now)) {
                return Term {
                    epoch,
                    lead: self.lead.clone(),
                    tx: self.tx.clone(),
                    candidate: self.candidate.clone(),
                    threshold: self.threshold,
                    clocks: self.clocks.clone(),
                };
            }
            // The task only ever drops the sender when this beat stops.
            if self.lead.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Stops seeking the lease and releases it if we hold it, so a standby leads at its next
    /// try rather than after a whole lease.
    pub async fn resign(self) {
        self.task.abort();
        let _ = self.task.await;
        let Some(epoch) = self.lead.borrow().epoch else {
            return;
        };
        let released = self.store.resign_lead(&self.candidate.token);
        match tokio::time::timeout(RESIGN_TIMEOUT, released).await {
            Ok(Ok(true)) => info!(epoch, "leadership released"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => {
                warn!(epoch, error = %e, "cannot release the leader lease; it lapses by itself")
            }
            Err(_) => warn!(
                epoch,
                "redis did not answer; the leader lease lapses by itself"
            ),
        }
    }
}

impl Term {
    /// Whether this beat may publish now: it still holds the lease of this term, renewed
    /// recently enough that no other beat can have taken it.
    pub fn holds(&self) -> bool {
        self.lead.borrow().publishes(self.epoch, self.clocks.now())
    }

    /// Whether the term is over (the task saw the lease lost or taken): `holds` can be false
    /// for a while before (a renewal late), and then true again.
    pub fn ended(&self) -> bool {
        self.lead.borrow().epoch != Some(self.epoch)
    }

    /// Waits until [`ended`](Self::ended) or [`holds`](Self::holds) may have changed (at once
    /// when either already says so: a renewal that landed since the caller looked).
    pub async fn changed(&mut self) {
        let until = self.lead.borrow_and_update().valid_until;
        if self.holds() || self.ended() {
            return;
        }
        let left = self.clocks.now().until(until);
        tokio::select! {
            r = self.lead.changed() => {
                if r.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            _ = tokio::time::sleep(left), if !left.is_zero() => {}
        }
    }

    /// The token progress writes are fenced with.
    pub fn token(&self) -> &str {
        &self.candidate.token
    }

    /// How far past Redis `TIME` progress may be recorded (`misfire_threshold`).
    pub fn max_ahead(&self) -> Duration {
        self.threshold
    }

    /// The instant to plan with now ([`planning_now`]).
    pub fn now(&self) -> DateTime<Utc> {
        let redis = self.lead.borrow().redis_now(self.clocks.now());
        planning_now(Utc::now(), redis, self.threshold)
    }

    /// Redis refused a progress write of this term: the lease is someone else's. Ends the term
    /// at once, rather than at the next renewal.
    pub fn deposed(&self) {
        let epoch = self.epoch;
        let ended = self.tx.send_if_modified(|lead| {
            if lead.epoch != Some(epoch) {
                return false;
            }
            lead.epoch = None;
            true
        });
        if ended {
            warn!(epoch, "leadership lost: redis refused this beat's progress (another beat holds the lease)");
        }
    }
}

/// The lease task: acquire (standby) or renew (leader) every `lease/3`, sooner after a Redis
/// error; reports each change through `tx` and the gauges. A leader's renewal waits for Redis
/// no longer than its window to publish: when that passes without an answer (Redis down, or
/// this beat cut off from it), the term ends here — the beat says it is a standby instead of
/// claiming a lease it can no longer show it holds — and it comes back through `acquire`.
/// Deadlines are read on [`WINDOW_CLOCK`]; tokio's timers only pace the tries.
async fn keep(
    store: Store,
    who: Arc<Candidate>,
    (lease, threshold): (Duration, Duration),
    (tx, clocks): (Arc<watch::Sender<Lead>>, Arc<dyn Clocks>),
    stats: BeatStats,
) {
    let every = lease / 3;
    let retry = every / 4;
    let mut clock_off = false;
    loop {
        let Lead {
            epoch: leading,
            valid_until,
            ..
        } = *tx.borrow();
        let paced = Instant::now();
        let sent = clocks.now();
        let local = Utc::now();
        let (mode, answer_by) = match leading {
            None => (LeaseMode::Acquire, sent.after(every)),
            Some(_) => (LeaseMode::Renew, valid_until.max(sent.after(retry))),
        };
        let reply =
            tokio::time::timeout(sent.until(answer_by), store.lead(&who, lease, mode)).await;
        let pause = match reply {
            Ok(Ok(reply)) => {
                let received = clocks.now();
                let local_then =
                    local + TimeDelta::from_std(sent.until(received)).unwrap_or_default();
                clock_off = warn_clock(reply.redis_time - local_then, threshold, clock_off);
                report(leading, reply.outcome, &stats);
                tx.send_modify(|lead| {
                    lead.redis_clock = Some((reply.redis_time, received));
                    apply(lead, reply.outcome, sent, lease);
                });
                every
            }
            failed => {
                let contact = match failed {
                    Ok(Err(e)) => RedisContact::Failed(e.to_string()),
                    _ => RedisContact::NoAnswer,
                };
                warn!(error = %contact, leading = leading.is_some(), "cannot reach redis for the leader lease; retrying");
                stats.redis(contact);
                if let Some(epoch) = leading.filter(|_| clocks.now() >= valid_until) {
                    warn!(epoch, "leadership lost: no renewal within the lease's publishing window; standing by");
                    stats.set_leader(false, 0);
                    tx.send_modify(|lead| lead.epoch = None);
                }
                retry
            }
        };
        tokio::time::sleep_until(paced + pause).await;
    }
}

/// Warns once when this beat's clock is further than `threshold` from Redis `TIME` (and once
/// when it is back); returns whether it is off now.
fn warn_clock(skew: TimeDelta, threshold: Duration, was_off: bool) -> bool {
    let off = skew.abs().to_std().unwrap_or(Duration::MAX) > threshold;
    if off && !was_off {
        warn!(redis_minus_local_ms = skew.num_milliseconds(),
            "this beat's clock is further from redis TIME than misfire_threshold; it plans with redis TIME ± misfire_threshold (fix the clock: NTP)");
    } else if was_off && !off {
        info!("this beat's clock is back within misfire_threshold of redis TIME");
    }
    off
}

/// The new [`Lead`] after a lease try sent at `sent` answered `outcome`.
fn apply(lead: &mut Lead, outcome: LeaseOutcome, sent: Stamp, lease: Duration) {
    match outcome {
        LeaseOutcome::Acquired { epoch } | LeaseOutcome::Renewed { epoch } => {
            lead.epoch = Some(epoch);
            lead.valid_until = publish_until(sent, lease);
        }
        LeaseOutcome::Refused { .. } => lead.epoch = None,
    }
}

/// Logs gains and losses, sets the gauges and records that Redis answered.
fn report(leading: Option<u64>, outcome: LeaseOutcome, stats: &BeatStats) {
    stats.redis(RedisContact::Answered);
    match (leading, outcome) {
        (_, LeaseOutcome::Acquired { epoch }) => {
            info!(epoch, "leadership gained: this beat publishes");
            stats.set_leader(true, epoch);
        }
        (None, LeaseOutcome::Renewed { epoch }) => {
            info!(
                epoch,
                "leadership gained again: this beat's lease outlived its silence"
            );
            stats.set_leader(true, epoch);
        }
        (Some(_), LeaseOutcome::Renewed { epoch }) => stats.set_leader(true, epoch),
        (Some(epoch), LeaseOutcome::Refused { holder }) => {
            warn!(
                epoch,
                holder, "leadership lost: the lease lapsed or another beat holds it; standing by"
            );
            stats.set_leader(false, holder);
        }
        (None, LeaseOutcome::Refused { holder }) => stats.set_leader(false, holder),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    const LEASE: Duration = Duration::from_secs(9);

    /// A host whose clocks the test moves: running moves both, a suspend only the boot clock
    /// (the kernel stops `CLOCK_MONOTONIC` while it sleeps; `CLOCK_BOOTTIME` counts the sleep).
    #[derive(Default)]
    struct Host {
        monotonic: Mutex<Duration>,
        boottime: Mutex<Duration>,
    }

    impl Host {
        fn run(&self, d: Duration) {
            *self.monotonic.lock().unwrap() += d;
            *self.boottime.lock().unwrap() += d;
        }

        fn suspend(&self, d: Duration) {
            *self.boottime.lock().unwrap() += d;
        }
    }

    impl Clocks for Host {
        fn read(&self, clock: ClockId) -> Duration {
            if clock == ClockId::CLOCK_MONOTONIC {
                *self.monotonic.lock().unwrap()
            } else if clock == ClockId::CLOCK_BOOTTIME {
                *self.boottime.lock().unwrap()
            } else {
                panic!("the host keeps no {clock:?}")
            }
        }
    }

    /// A term of `epoch` on `host`, and the sender the lease task would move it with.
    fn term(host: &Arc<Host>, epoch: u64, lead: Lead) -> (Arc<watch::Sender<Lead>>, Term) {
        let (tx, rx) = watch::channel(lead);
        let tx = Arc::new(tx);
        let term = Term {
            epoch,
            lead: rx,
            tx: tx.clone(),
            candidate: Arc::new(Candidate {
                token: "t".into(),
                host: "h".into(),
                pid: 1,
            }),
            threshold: Duration::from_secs(5),
            clocks: host.clone(),
        };
        (tx, term)
    }

    fn standby(host: &Host) -> Lead {
        Lead {
            epoch: None,
            valid_until: host.now(),
            redis_clock: None,
        }
    }

    #[test]
    fn a_grant_lets_the_leader_publish_for_two_thirds_of_the_lease_from_the_send() {
        let host = Host::default();
        host.run(Duration::from_secs(100));
        let sent = host.now();
        assert_eq!(
            publish_until(sent, LEASE),
            sent.after(Duration::from_secs(6))
        );
        let mut lead = standby(&host);
        apply(&mut lead, LeaseOutcome::Acquired { epoch: 7 }, sent, LEASE);
        assert_eq!(
            (lead.epoch, lead.valid_until),
            (Some(7), sent.after(Duration::from_secs(6)))
        );
        let later = sent.after(Duration::from_secs(3));
        apply(&mut lead, LeaseOutcome::Renewed { epoch: 7 }, later, LEASE);
        assert_eq!(lead.valid_until, later.after(Duration::from_secs(6)));
        assert!(lead.publishes(7, later.after(Duration::from_millis(5999))));
        assert!(!lead.publishes(7, later.after(Duration::from_secs(6))));
        assert!(!lead.publishes(8, later));
        apply(&mut lead, LeaseOutcome::Refused { holder: 8 }, later, LEASE);
        assert_eq!(lead.epoch, None);
    }

    // See: issues/16 (item 7)
    #[test]
    fn a_host_resumed_from_a_suspend_finds_its_window_over() {
        let host = Arc::new(Host::default());
        let (tx, term) = term(&host, 3, standby(&host));
        let granted = host.now();
        let reading: DateTime<Utc> = "2026-03-02T12:00:00Z".parse().unwrap();
        tx.send_modify(|l| {
            apply(l, LeaseOutcome::Acquired { epoch: 3 }, granted, LEASE);
            l.redis_clock = Some((reading, granted));
        });
        host.run(Duration::from_secs(1));
        assert!(term.holds());
        // The host sleeps for a minute: Redis lets the lease (9 s) lapse, another beat leads.
        // Its monotonic clock stood still meanwhile; its boot clock did not.
        host.suspend(Duration::from_secs(60));
        assert!(
            !term.holds(),
            "a host resumed from a suspend publishes on a lapsed lease"
        );
        // Over until a renewal comes back (refused: the term ends), not ended by the clock.
        assert!(!term.ended());
        // Redis TIME, as this beat estimates it, counts the minute too.
        assert_eq!(
            tx.borrow().redis_now(host.now()),
            Some(reading + TimeDelta::seconds(61))
        );
    }

    #[test]
    fn a_clock_off_redis_time_plans_within_the_threshold_of_it() {
        let local: DateTime<Utc> = "2026-03-02T13:00:00Z".parse().unwrap();
        let threshold = Duration::from_secs(5);
        // Our clock is an hour ahead of Redis's.
        let redis = |offset: TimeDelta| Some(local + offset);
        assert_eq!(
            planning_now(local, redis(TimeDelta::hours(-1)), threshold),
            "2026-03-02T12:00:05Z".parse::<DateTime<Utc>>().unwrap()
        );
        // An hour behind: at most the threshold late, rather than an hour.
        assert_eq!(
            planning_now(local, redis(TimeDelta::hours(1)), threshold),
            "2026-03-02T13:59:55Z".parse::<DateTime<Utc>>().unwrap()
        );
        // Within the threshold either way, or no reading yet: our own clock.
        for reading in [
            redis(TimeDelta::seconds(3)),
            redis(TimeDelta::seconds(-5)),
            None,
        ] {
            assert_eq!(planning_now(local, reading, threshold), local);
        }
    }

    #[test]
    fn a_term_stops_holding_when_its_renewal_is_late_and_ends_when_refused() {
        let host = Arc::new(Host::default());
        let (tx, term) = term(&host, 3, standby(&host));
        let now = || host.now();
        tx.send_modify(|l| apply(l, LeaseOutcome::Acquired { epoch: 3 }, now(), LEASE));
        assert!(term.holds() && !term.ended());
        // A SIGSTOP or a slow Redis: no renewal for two thirds of the lease.
        host.run(Duration::from_secs(6));
        assert!(!term.holds() && !term.ended());
        // The renewal, when it comes, is refused: the term is over.
        tx.send_modify(|l| apply(l, LeaseOutcome::Refused { holder: 4 }, now(), LEASE));
        assert!(term.ended());
        // A later acquisition is another term, not this one.
        tx.send_modify(|l| apply(l, LeaseOutcome::Acquired { epoch: 5 }, now(), LEASE));
        assert!(!term.holds() && term.ended());
    }

    #[test]
    fn progress_refused_by_redis_ends_the_term_at_once() {
        let host = Arc::new(Host::default());
        let lead = Lead {
            epoch: Some(3),
            valid_until: host.now().after(LEASE),
            redis_clock: None,
        };
        let (_tx, term) = term(&host, 3, lead);
        term.deposed();
        assert!(term.ended() && !term.holds());
    }

    #[test]
    fn redis_time_runs_on_the_window_clock_from_the_last_reading() {
        let host = Host::default();
        let reading: DateTime<Utc> = "2026-03-02T12:00:00Z".parse().unwrap();
        let lead = Lead {
            epoch: Some(1),
            valid_until: host.now().after(LEASE),
            redis_clock: Some((reading, host.now())),
        };
        host.run(Duration::from_millis(2500));
        // Whatever this host's wall clock says (an NTP step included), Redis's clock is the
        // reading plus the time since it arrived.
        assert_eq!(
            lead.redis_now(host.now()),
            Some(reading + TimeDelta::milliseconds(2500))
        );
        let stepped: DateTime<Utc> = "2026-03-02T13:00:02.5Z".parse().unwrap();
        assert_eq!(
            planning_now(stepped, lead.redis_now(host.now()), Duration::from_secs(5)),
            "2026-03-02T12:00:07.5Z".parse::<DateTime<Utc>>().unwrap()
        );
    }
}
