//! What one round of the randomized checker runs, drawn from its seed (docs/soak.md#the-randomized-checker):
//! jobs (period, overlap mode, task duration against the period, failure and permanent-exit
//! rates, retries, `expires`, jitter), operator actions (pause and resume, a backfill, a
//! trigger, a reload that changes a job's period), schedules applied at run time and what is done
//! to them ([`super::schedules`]) and faults (kill -9 or a short SIGSTOP of a worker, kill -9 of
//! a beat).

use super::schedules::{self, ScheduleDraw};
use crate::cfg::{every, shell, Cfg, Keys};
use crate::soak::rng::Rng;
use crate::toml_string;
use std::path::Path;
use std::time::Duration;

/// The retry delay of every drawn task (`retry_base = retry_max`).
pub const RETRY_DELAY: Duration = Duration::from_secs(1);
/// `[worker] lease` of every round: a drawn freeze stays under a third of it, so no lease
/// lapses under a frozen worker (a longer freeze is a known gap: docs/soak.md).
pub const LEASE: Duration = Duration::from_secs(6);
/// The exit code a task's permanent failure uses (`permanent_exit_codes`).
pub const PERMANENT: i32 = 3;

/// One drawn job and the task only it runs.
#[derive(Debug, Clone, PartialEq)]
pub struct JobDraw {
    /// `j0`, `j1`, …
    pub name: String,
    /// `every`, whole seconds.
    pub every_s: u32,
    /// `skip`, `queue` or `allow`.
    pub overlap: &'static str,
    /// How long each run sleeps.
    pub run: Duration,
    /// Percent of attempts that fail retryably (exit 1).
    pub fail_pct: u32,
    /// Percent of attempts that fail for good (exit [`PERMANENT`]).
    pub permanent_pct: u32,
    /// `max_retries`.
    pub max_retries: u32,
    /// `expires`, whole seconds.
    pub expires_s: Option<u32>,
    /// `jitter`, whole seconds.
    pub jitter_s: Option<u32>,
    /// `after`: the job (an index) whose instance for the same instant must succeed first; the
    /// job then has no schedule of its own, `overlap = "allow"` and [`AFTER_TIMEOUT`].
    pub after: Option<usize>,
}

/// `after_timeout` of every drawn follower: long enough for its upstream's retries.
pub const AFTER_TIMEOUT: Duration = Duration::from_secs(30);

/// An operator action or a fault, `at` after the round's start.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// `drumline pause JOB`, and `resume` `for_` later.
    Pause { job: usize, for_: Duration },
    /// `drumline backfill JOB` of the ten instants ending 30 s before the round began.
    Backfill { job: usize },
    /// kill -9 of worker `i`, started again a second later.
    KillWorker { i: usize },
    /// SIGSTOP of worker `i` for `for_`, then SIGCONT.
    FreezeWorker { i: usize, for_: Duration },
    /// kill -9 of beat `i`, started again two seconds later.
    KillBeat { i: usize },
    /// `drumline trigger JOB`.
    Trigger { job: usize },
    /// The job's `every` becomes `every_s` in the config file, then SIGHUP to every member.
    Reload { job: usize, every_s: u32 },
    /// Schedule `s` stored: `drumline schedules apply FILE`, or `PUT /api/v1/schedules/NAME`
    /// on beat `api`'s API (the CLI when that beat does not answer).
    Apply { s: usize, api: Option<usize> },
    /// Schedule `s` stored again with `every` = `every_s`, the same way.
    Edit {
        s: usize,
        every_s: u32,
        api: Option<usize>,
    },
    /// Schedule `s` deleted: `drumline schedules delete NAME` or `DELETE` on the API.
    Delete { s: usize, api: Option<usize> },
    /// Schedule `s`'s calendar applied (`drumline calendars apply`) holding today's local date
    /// in the schedule's zone.
    Exclude { s: usize },
    /// Schedule `s`'s calendar no longer holds today: deleted, or applied with another date.
    Include { s: usize, delete: bool },
}

/// One round.
#[derive(Debug, Clone, PartialEq)]
pub struct Round {
    /// The seed it was drawn from (the task's failures hash it too).
    pub seed: u64,
    /// Its jobs.
    pub jobs: Vec<JobDraw>,
    /// Its schedules applied at run time (`s0`, `s1`, …; their events name them by index).
    pub schedules: Vec<ScheduleDraw>,
    /// Its actions and faults, in time order.
    pub events: Vec<(Duration, Event)>,
    /// From the members' start to the last event's end.
    pub length: Duration,
}

/// Workers in a round.
pub const WORKERS: usize = 3;
/// Beats in a round.
pub const BEATS: usize = 2;

/// Draws one round of `length` from `seed`.
pub fn round(seed: u64, length: Duration) -> Round {
    let mut rng = Rng::new(seed);
    let count = 1 + rng.below(3);
    let jobs: Vec<JobDraw> = (0..count).map(|i| job(&mut rng, i)).collect();
    let mut events = Vec::new();
    // Nothing in the first 5 s (the beats start and elect) nor the last 3 s.
    let span = length
        .saturating_sub(Duration::from_secs(8))
        .max(Duration::from_secs(1));
    for _ in 0..(length.as_secs() / 6).max(1) {
        let at = Duration::from_secs(5) + rng.between(Duration::ZERO, span);
        events.push((at, event(&mut rng, &jobs)));
    }
    // Triggers and reloads come from a stream of their own, so that a seed draws the same
    // jobs and faults as before they existed.
    let mut more = Rng::new(seed ^ 0x7269_6767_6572);
    for _ in 0..(length.as_secs() / 15).max(1) {
        let at = Duration::from_secs(5) + more.between(Duration::ZERO, span);
        let job = more.below(jobs.len());
        let e = match more.below(2) {
            0 => Event::Trigger { job },
            _ => Event::Reload { job, every_s: 0 },
        };
        events.push((at, e));
    }
    let schedules = schedules::draw(seed, length, &mut events);
    events.sort_by_key(|(at, _)| *at);
    let mut jobs = jobs;
    follow(&mut more, &mut jobs, &mut events);
    periods_for_reloads(&jobs, &mut events, &mut more);
    Round {
        seed,
        jobs,
        schedules,
        events,
        length,
    }
}

/// Job `j<i>`, drawn.
pub(crate) fn job(rng: &mut Rng, i: usize) -> JobDraw {
    let every_s = [1, 2, 3][rng.below(3)];
    let overlap = ["skip", "queue", "allow"][rng.below(3)];
    let period = Duration::from_secs(every_s.into());
    // A queue job's backlog must drain: its runs stay under the period.
    let longest = if overlap == "queue" {
        period * 6 / 10
    } else {
        period * 3 / 2
    };
    let run = rng.between(Duration::from_millis(50), longest);
    let mut fail_pct = [0, 25, 60][rng.below(3)];
    let permanent_pct = [0, 0, 10][rng.below(3)];
    let max_retries = rng.below(4) as u32;
    // A queue job's instance holds the job through its retries: what it holds on average
    // must fit the period too, or the backlog never drains.
    if overlap == "queue" && held_for(run, fail_pct, max_retries) > period * 6 / 10 {
        fail_pct = 0;
    }
    JobDraw {
        name: format!("j{i}"),
        every_s,
        overlap,
        run,
        fail_pct,
        permanent_pct,
        max_retries,
        expires_s: [None, Some(60)][rng.below(2)],
        // `check` refuses a jitter not below the period.
        jitter_s: [None, None, Some(1)][rng.below(3)].filter(|_| every_s > 1),
        after: None,
    }
}

/// Makes the last of `jobs` (when there are two or more) follow the first, one round in two,
/// and points the events drawn for it at the first: a follower has no schedule to pause,
/// backfill or reload of its own.
fn follow(rng: &mut Rng, jobs: &mut [JobDraw], events: &mut [(Duration, Event)]) {
    let last = jobs.len() - 1;
    if last == 0 || rng.below(2) == 0 {
        return;
    }
    let follower = &mut jobs[last];
    follower.after = Some(0);
    follower.overlap = "allow";
    follower.expires_s = None;
    follower.jitter_s = None;
    for (_, e) in events.iter_mut() {
        match e {
            Event::Pause { job, .. }
            | Event::Backfill { job }
            | Event::Trigger { job }
            | Event::Reload { job, .. }
                if *job == last =>
            {
                *job = 0;
            }
            _ => {}
        }
    }
}

/// Gives each reload, in time order, a period its job's runs fit and different from the one in
/// force; a reload with none becomes a trigger.
fn periods_for_reloads(jobs: &[JobDraw], events: &mut [(Duration, Event)], rng: &mut Rng) {
    let mut now: Vec<u32> = jobs.iter().map(|j| j.every_s).collect();
    for (_, e) in events.iter_mut() {
        let Event::Reload { job, every_s } = e else {
            continue;
        };
        let job = *job;
        let fits: Vec<u32> = [1, 2, 3]
            .into_iter()
            .filter(|p| *p != now[job] && jobs[job].fits(*p))
            .collect();
        if fits.is_empty() {
            *e = Event::Trigger { job };
        } else {
            *every_s = fits[rng.below(fits.len())];
            now[job] = *every_s;
        }
    }
}

/// How long an instance holds its job on average: its first run, then each retry (its delay,
/// jitter included, and its run) as likely as every attempt before it failing.
fn held_for(run: Duration, fail_pct: u32, max_retries: u32) -> Duration {
    let p = f64::from(fail_pct) / 100.0;
    let retries: f64 = (1..=max_retries).map(|k| p.powi(k as i32)).sum();
    run + (run + RETRY_DELAY * 6 / 5).mul_f64(retries)
}

fn event(rng: &mut Rng, jobs: &[JobDraw]) -> Event {
    let job = rng.below(jobs.len());
    match rng.weighted(&[2, 1, 3, 3, 2]) {
        0 => Event::Pause {
            job,
            for_: rng.between(Duration::from_secs(2), Duration::from_secs(6)),
        },
        1 => Event::Backfill { job },
        2 => Event::KillWorker {
            i: rng.below(WORKERS),
        },
        3 => Event::FreezeWorker {
            i: rng.below(WORKERS),
            for_: rng.between(Duration::from_millis(200), LEASE / 3),
        },
        _ => Event::KillBeat {
            i: rng.below(BEATS),
        },
    }
}

impl JobDraw {
    /// Whether its runs fit a period of `every_s`: a `queue` job's average hold under 0.6 of
    /// it, any other run under 1.5 of it, and its jitter below it (as `check` wants).
    pub fn fits(&self, every_s: u32) -> bool {
        let period = Duration::from_secs(every_s.into());
        let held = if self.overlap == "queue" {
            held_for(self.run, self.fail_pct, self.max_retries) <= period * 6 / 10
        } else {
            self.run <= period * 3 / 2
        };
        held && self.jitter_s.is_none_or(|s| s < every_s)
    }

    /// The task's command: a start line, the run, an end line with the exit code, each with
    /// key, attempt and wall time in ms, appended to `log`; whether an attempt fails is a hash
    /// of its key, attempt and the round's seed.
    pub fn script(&self, log: &Path, seed: u64) -> String {
        let fail = self.fail_pct;
        let permanent = fail + self.permanent_pct;
        format!(
            "log={log}; echo \"start $DRUMLINE_KEY $DRUMLINE_ATTEMPT $(date +%s%3N)\" >> $log; \
             sleep {run:.3}; \
             h=$(printf '%s' \"$DRUMLINE_KEY $DRUMLINE_ATTEMPT {seed}\" | cksum | cut -d' ' -f1); \
             r=$((h % 100)); code=0; \
             if [ $r -lt {fail} ]; then code=1; elif [ $r -lt {permanent} ]; then code={PERMANENT}; fi; \
             echo \"end $DRUMLINE_KEY $DRUMLINE_ATTEMPT $(date +%s%3N) $code\" >> $log; exit $code",
            log = log.display(),
            run = self.run.as_secs_f64(),
        )
    }

    /// Its `[tasks.NAME]` keys.
    pub fn task(&self, log: &Path, seed: u64) -> Keys {
        shell(&self.script(log, seed))
            .with("max_retries", &self.max_retries.to_string())
            .with("retry_base", &toml_string("1s"))
            .with("retry_max", &toml_string("1s"))
            .with("permanent_exit_codes", &format!("[{PERMANENT}]"))
    }

    /// Its `[[jobs]]` keys.
    pub fn job(&self) -> Keys {
        if let Some(up) = self.after {
            return Keys::default()
                .with("after", &toml_string(&format!("j{up}")))
                .with(
                    "after_timeout",
                    &toml_string(&format!("{}s", AFTER_TIMEOUT.as_secs())),
                )
                .with("overlap", &toml_string(self.overlap))
                .with("task", &toml_string(&self.name));
        }
        let mut keys = every(&format!("{}s", self.every_s))
            .with("overlap", &toml_string(self.overlap))
            .with("task", &toml_string(&self.name));
        if let Some(s) = self.expires_s {
            keys = keys.with("expires", &toml_string(&format!("{s}s")));
        }
        if let Some(s) = self.jitter_s {
            keys = keys.with("jitter", &toml_string(&format!("{s}s")));
        }
        keys
    }
}

impl Round {
    /// The round's config, its tasks appending to `log`.
    pub fn config(&self, log: &Path) -> Cfg {
        let periods: Vec<u32> = self.jobs.iter().map(|j| j.every_s).collect();
        self.config_with(log, &periods)
    }

    /// The round's config with each job's `every` from `periods` (after reloads).
    pub fn config_with(&self, log: &Path, periods: &[u32]) -> Cfg {
        let lease = toml_string(&format!("{}s", LEASE.as_secs()));
        let mut cfg = Cfg::new().set("worker", "lease", &lease);
        for (j, every_s) in self.jobs.iter().zip(periods) {
            let now = JobDraw {
                every_s: *every_s,
                ..j.clone()
            };
            cfg = cfg
                .task(&j.name, j.task(log, self.seed))
                .job(&j.name, now.job());
        }
        for s in &self.schedules {
            cfg = cfg.task(&s.job.name, s.job.task(log, self.seed));
        }
        cfg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_seed_one_round_and_queue_runs_fit_their_period() {
        let length = Duration::from_secs(40);
        assert_eq!(round(5, length), round(5, length));
        let (mut reloads, mut triggers) = (0, 0);
        for seed in 0..200 {
            let r = round(seed, length);
            assert!(!r.jobs.is_empty() && r.jobs.len() <= 3);
            assert!(!r.events.is_empty());
            for j in r.jobs.iter().filter(|j| j.overlap == "queue") {
                let period = Duration::from_secs(j.every_s.into());
                assert!(held_for(j.run, j.fail_pct, j.max_retries) <= period * 6 / 10);
            }
            for j in &r.jobs {
                assert!(j.jitter_s.is_none_or(|s| s < j.every_s));
            }
            assert!(r.events.iter().all(|(at, _)| *at >= Duration::from_secs(5)));
            let mut now: Vec<u32> = r.jobs.iter().map(|j| j.every_s).collect();
            for (_, e) in &r.events {
                if let Event::Reload { job, every_s } = e {
                    assert!(
                        *every_s != now[*job] && r.jobs[*job].fits(*every_s),
                        "{e:?}"
                    );
                    now[*job] = *every_s;
                    reloads += 1;
                }
                triggers += usize::from(matches!(e, Event::Trigger { .. }));
            }
        }
        assert!(
            reloads > 50 && triggers > 50,
            "{reloads} reloads, {triggers} triggers"
        );
    }
}
