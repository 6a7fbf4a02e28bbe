//! The beat's loop and publisher against the real Redis and RabbitMQ (as `scripts/test` starts
//! them), each test in a namespace of its own whose keys, queues and exchanges are deleted at
//! the end. Here, not in `src/`, so `cargo test --lib` needs no services.

use chrono::{DateTime, DurationRound, SecondsFormat, TimeDelta, Utc};
use drumline_beat::publisher::Publisher;
use drumline_beat::scheduler::{run, BeatStats, BATCH_JOBS, BATCH_MESSAGES};
use drumline_e2e::{Namespace, AMQP_URL, REDIS_URL};
use drumline_shared::broker::{self, BrokerError};
use drumline_shared::config::Config;
use drumline_shared::envelope::{instance_key, Envelope};
use drumline_shared::names::Names;
use drumline_shared::store::{
    last_instant_text, parse_last_instant as parse_last, Candidate, LeaseMode, ProgressError, Store,
};
use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

/// A namespace of the test kit ([`Namespace`]: everything in it is deleted on drop), with the
/// beat's tests' config and store.
struct Ns(Namespace);

impl Ns {
    fn new(test: &str) -> Self {
        let mut ns = Namespace::new(&format!("beat_{test}"));
        for queue in ["a", "b"] {
            ns.forget_work_queue_later(queue);
        }
        Ns(ns)
    }

    fn name(&self) -> &str {
        self.0.name()
    }

    /// A config in this namespace: `body` plus task `t`.
    fn config(&self, body: &str) -> Config {
        let text = format!(
            "namespace = \"{}\"\n{body}\n[tasks.t]\ncommand = [\"/bin/true\"]\n",
            self.name()
        );
        Config::parse(&text, Path::new("test.toml"), |_| None)
            .unwrap_or_else(|e| panic!("bad test config: {e}"))
    }

    async fn store(&self) -> Store {
        Store::connect(REDIS_URL, None, Names::new(self.name()))
            .await
            .expect("redis")
    }
}

/// The namespace's work queue `default`, as the beat's messages land there.
impl Ns {
    /// A channel on the shared broker and the name of the work queue `default`.
    async fn default_queue(&self) -> (Connection, lapin::Channel, String) {
        let amqp = Connection::connect(AMQP_URL, ConnectionProperties::default());
        let amqp = amqp.await.unwrap();
        let ch = amqp.create_channel().await.unwrap();
        (amqp, ch, Names::new(self.name()).work_queue("default"))
    }

    /// Messages ready in the work queue `default`.
    async fn queued(&self) -> usize {
        let (amqp, ch, queue) = self.default_queue().await;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let declared = ch.queue_declare(queue.as_str().into(), passive, FieldTable::default());
        let count = declared.await.unwrap().message_count() as usize;
        let _ = amqp.close(200, "bye".into()).await;
        count
    }

    /// Every message of the work queue `default`, taken off it in order.
    async fn drain(&self) -> Vec<Envelope> {
        let (amqp, ch, queue) = self.default_queue().await;
        let mut out = Vec::new();
        let no_ack = BasicGetOptions { no_ack: true };
        while let Some(msg) = ch.basic_get(queue.as_str().into(), no_ack).await.unwrap() {
            out.push(Envelope::decode(&msg.delivery.data).unwrap());
        }
        let _ = amqp.close(200, "bye".into()).await;
        out
    }
}

/// `n` job names `{prefix}00000`, `{prefix}00001`, ….
fn numbered(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i:05}")).collect()
}

/// A `[[jobs]]` entry per name in `names`: task `t` every hour from `due`.
fn hourly(names: &[String], due: DateTime<Utc>) -> String {
    let entry = |name: &String| {
        let anchor = rfc3339(due);
        format!(
            "[[jobs]]\nname = \"{name}\"\ntask = \"t\"\nevery = \"1h\"\nanchor = \"{anchor}\"\n"
        )
    };
    names.iter().map(entry).collect()
}

/// Job `catch`: task `t` every minute from `anchor`, catching up at most `max` missed
/// instants, queued behind each other.
fn catching_up(anchor: DateTime<Utc>, max: usize) -> String {
    format!(
        "[[jobs]]\nname = \"catch\"\ntask = \"t\"\nevery = \"1m\"\nanchor = \"{}\"\n\
         misfire = \"catch_up\"\noverlap = \"queue\"\nmax_catch_up = {max}\n\
         misfire_grace = \"30d\"\n",
        rfc3339(anchor)
    )
}

/// How many of `jobs` have progress `want`.
async fn at_progress(store: &Store, jobs: &[&str], want: &str) -> usize {
    let lasts = lasts(store, jobs).await;
    lasts.iter().filter(|l| l.as_deref() == Some(want)).count()
}

/// `{ns}:beat:last:{job}` for each job.
async fn lasts(store: &Store, jobs: &[&str]) -> Vec<Option<String>> {
    let keys: Vec<String> = jobs.iter().map(|j| store.names().beat_last(j)).collect();
    redis::cmd("MGET")
        .arg(keys)
        .query_async(&mut store.connection())
        .await
        .expect("MGET")
}

/// Runs the beat on `config` until `done` holds (polled every 50 ms, at most 60 s).
async fn run_until<F, Fut>(config: Config, mut done: F) -> BeatStats
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let watch = async {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done().await {
            assert!(Instant::now() < deadline, "the beat never got there");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = stop.send(());
    };
    let beat = run(config, BeatStats::default(), async {
        let _ = stopped.await;
    });
    let (stats, ()) = tokio::join!(beat, watch);
    stats.expect("the beat failed")
}

fn at(text: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(text)
        .expect("test instant")
        .with_timezone(&Utc)
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::AutoSi, true)
}

/// Writes progress the way a leader does: under the lease (taken for the write, then released,
/// so the beat under test leads at once).
async fn save_progress(
    store: &Store,
    progress: &[(&str, DateTime<Utc>)],
) -> Result<Vec<Result<(), ProgressError>>, ProgressError> {
    lead_as(store, "seeder").await?;
    let out = store.advance_progress("seeder", progress, FAR, 2).await;
    store.resign_lead("seeder").await?;
    out
}

/// Far enough ahead of Redis `TIME` that no instant of a test is refused as ahead.
const FAR: Duration = Duration::from_secs(86400 * 365 * 100);

/// Takes the leader lease (10 s) as candidate `token`.
async fn lead_as(store: &Store, token: &str) -> Result<(), ProgressError> {
    let (host, pid) = ("test".to_owned(), std::process::id());
    let who = Candidate {
        token: token.to_owned(),
        host,
        pid,
    };
    store
        .lead(&who, Duration::from_secs(10), LeaseMode::Acquire)
        .await?;
    Ok(())
}

/// `start_progress` as the lease holder `holder`, one job per call.
async fn start_as_holder(
    store: &Store,
    starts: &[(&str, DateTime<Utc>, &str)],
    max_ahead: Duration,
) -> Vec<Result<(), ProgressError>> {
    store
        .start_progress("holder", starts, max_ahead, 1)
        .await
        .unwrap()
}

#[tokio::test]
async fn progress_writes_only_move_forward_and_fail_job_by_job() {
    let ns = Ns::new("save");
    let store = ns.store().await;
    let (t1, t2) = (at("2026-03-02T12:00:00Z"), at("2026-03-02T12:01:00Z"));
    let mut conn = store.connection();
    // `c` holds a hash: its write fails, the others' do not.
    let () = redis::cmd("HSET")
        .arg(store.names().beat_last("c"))
        .arg("f")
        .arg("v")
        .query_async(&mut conn)
        .await
        .unwrap();
    let out = save_progress(&store, &[("a", t2), ("c", t2), ("b", t1)])
        .await
        .unwrap();
    assert!(
        out[0].is_ok() && out[1].is_err() && out[2].is_ok(),
        "{out:?}"
    );
    // `a` does not move back; `b` moves forward.
    let out = save_progress(&store, &[("a", t1), ("b", t2)])
        .await
        .unwrap();
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    let text = |t| Some(last_instant_text(t));
    assert_eq!(lasts(&store, &["a", "b"]).await, vec![text(t2), text(t2)]);
}

#[tokio::test]
async fn a_start_records_its_rule_with_its_progress_and_only_for_the_lease_holder() {
    let ns = Ns::new("rules");
    let store = ns.store().await;
    let (t1, t2) = (at("2026-03-02T12:00:00Z"), at("2026-03-02T12:01:00Z"));
    let rules = |jobs: &'static [&'static str]| {
        let store = &store;
        async move {
            let rules = store.progress_rules(jobs, |_, rule| rule, 1, 1).await;
            rules.expect("rules")
        }
    };
    // Without the lease nothing is written.
    let a = [("a", t1, "r1")];
    let refused = store.start_progress("nobody", &a, FAR, 10).await;
    assert!(
        matches!(refused, Err(ProgressError::Deposed)),
        "{refused:?}"
    );
    assert_eq!(rules(&["a"]).await, vec![None]);
    lead_as(&store, "holder").await.unwrap();
    // With it: the progress (never moved back) and the rule, job by job, in calls of 1.
    let out = start_as_holder(&store, &[("a", t2, "r1"), ("b", t1, "r1")], FAR).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    let out = start_as_holder(&store, &[("a", t1, "r2")], FAR).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    let text = |t| Some(last_instant_text(t));
    assert_eq!(lasts(&store, &["a", "b"]).await, vec![text(t2), text(t1)]);
    let rule = |r: &str| Some(r.to_owned());
    assert_eq!(
        rules(&["a", "b", "c"]).await,
        vec![rule("r2"), rule("r1"), None]
    );
    // An instant too far ahead of Redis TIME writes neither.
    let ahead = Utc::now() + TimeDelta::hours(1);
    let out = start_as_holder(&store, &[("c", ahead, "r1")], Duration::from_secs(1)).await;
    assert!(
        matches!(out[0], Err(ProgressError::Ahead { .. })),
        "{out:?}"
    );
    assert_eq!(rules(&["c"]).await, vec![None]);
    store.resign_lead("holder").await.unwrap();
}

#[tokio::test]
async fn a_new_jobs_start_is_persisted_so_misses_before_its_first_instant_are_reported() {
    let ns = Ns::new("first_start");
    let store = ns.store().await;
    let started = Utc::now();
    // First instant 2-3 s after the start; missed 1 s after it.
    let first = started.duration_trunc(TimeDelta::seconds(1)).unwrap() + TimeDelta::seconds(3);
    let config = ns.config(&format!(
        "[beat]\nmisfire_threshold = \"1s\"\n[[jobs]]\nname = \"j\"\ntask = \"t\"\n\
         every = \"1h\"\nanchor = \"{}\"\nmisfire = \"skip\"",
        rfc3339(first)
    ));

    // A first start that stops before the first instant still leaves its start behind.
    let stats = run_until(config.clone(), || async {
        lasts(&store, &["j"]).await[0].is_some()
    })
    .await;
    assert_eq!(stats.published_total(), 0);
    let persisted = lasts(&store, &["j"]).await[0].clone().unwrap();
    let persisted = parse_last(&persisted).unwrap();
    assert!(persisted >= started && persisted < first, "{persisted}");

    // Down past the first instant and its threshold: the next start reports it missed.
    while Utc::now() < first + TimeDelta::milliseconds(1500) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let want = last_instant_text(first);
    let stats = run_until(config, || async {
        lasts(&store, &["j"]).await[0].as_ref() == Some(&want)
    })
    .await;
    assert_eq!(
        (stats.published_total(), stats.dropped_total()),
        (0, 1),
        "{stats:?}"
    );
}

#[tokio::test]
async fn jobs_due_together_are_published_in_batches_each_instant_once() {
    let ns = Ns::new("batches");
    let store = ns.store().await;
    let now = Utc::now().duration_trunc(TimeDelta::seconds(1)).unwrap();
    // More jobs than one batch takes, all due at `due`; and one job catching up more
    // messages than one batch holds.
    let (jobs, catch_up) = (BATCH_JOBS + 200, BATCH_MESSAGES + 200);
    let (due, anchor) = (now + TimeDelta::seconds(3), now + TimeDelta::seconds(30));
    let names = numbered("j", jobs);
    let config = ns.config(&(catching_up(anchor, catch_up) + &hourly(&names, due)));
    let missed_from = anchor - TimeDelta::minutes(catch_up as i64);
    let seed = [("catch", missed_from - TimeDelta::minutes(1))];
    assert!(save_progress(&store, &seed).await.unwrap()[0].is_ok());

    let want_catch = last_instant_text(anchor - TimeDelta::minutes(1));
    let (want_due, all) = (last_instant_text(due), names.iter().map(String::as_str));
    let all: Vec<&str> = all.collect();
    let stats = run_until(config, || async {
        at_progress(&store, &["catch"], &want_catch).await == 1
            && at_progress(&store, &all, &want_due).await == jobs
    })
    .await;
    let total = jobs + catch_up;
    assert_eq!(stats.published_total() as usize, total, "{stats:?}");
    let failed = (stats.dropped_total(), stats.publish_failures.get());
    assert_eq!(failed, (0, 0));

    // What the queue holds: each instant once, the catch-up oldest first.
    assert_eq!(ns.queued().await, total);
    let (catch, mut others): (Vec<Envelope>, Vec<Envelope>) = ns
        .drain()
        .await
        .into_iter()
        .partition(|e| e.job.as_deref() == Some("catch"));
    let catch: Vec<_> = catch.into_iter().map(|e| e.scheduled_for).collect();
    let want: Vec<_> = (0..catch_up as i64)
        .map(|k| missed_from + TimeDelta::minutes(k))
        .collect();
    assert!(catch == want, "catch-up out of order, doubled or missing");
    others.sort_by(|a, b| a.key.cmp(&b.key));
    let others: Vec<_> = others.into_iter().map(|e| e.key).collect();
    let want: Vec<_> = names.iter().map(|n| instance_key(n, due)).collect();
    assert!(others == want, "on-time instances doubled or missing");
}

/// A connected publisher for jobs `a` and `b` (queues `a` and `b`), whose queue `b` is deleted
/// after the topology was declared: its messages route nowhere.
async fn publisher_with_b_unroutable(ns: &Ns) -> Publisher {
    let config = ns.config(
        "[[jobs]]\nname = \"a\"\ntask = \"t\"\nevery = \"1h\"\nqueue = \"a\"\n\
         [[jobs]]\nname = \"b\"\ntask = \"t\"\nevery = \"1h\"\nqueue = \"b\"\n",
    );
    let mut publisher = Publisher::new(&config);
    publisher.connect().await.expect("broker");
    let names = Names::new(config.namespace.clone());
    let amqp = broker::connect(&config).await.unwrap();
    let ch = amqp.create_channel().await.unwrap();
    ch.queue_delete(
        names.work_queue("b").as_str().into(),
        QueueDeleteOptions::default(),
    )
    .await
    .unwrap();
    let _ = amqp.close(200, "bye".into()).await;
    publisher
}

/// Against the real RabbitMQ. The broker returns unroutable messages before it confirms
/// them, and may confirm several at once: each returned message is charged to its own
/// envelope, not to the confirm that happened to carry it.
#[tokio::test]
async fn unroutable_messages_fail_alone_in_a_batch() {
    let ns = Ns::new("unroutable");
    let mut publisher = publisher_with_b_unroutable(&ns).await;

    let at = Utc::now();
    let batch: Vec<Envelope> = (0..40)
        .map(|i| {
            let queue = if i % 4 == 1 { "b" } else { "a" };
            let t = at + chrono::TimeDelta::seconds(i);
            Envelope::scheduled(queue, "t", queue, serde_json::json!({}), t, None, at)
        })
        .collect();
    let outcomes = publisher
        .publish_batch(&batch, 0, || true)
        .await
        .expect("sent");
    for (env, outcome) in batch.iter().zip(&outcomes) {
        match (env.queue.as_str(), outcome) {
            ("a", Ok(())) | ("b", Err(BrokerError::Unroutable(_))) => {}
            _ => panic!("{}: {outcome:?}", env.key),
        }
    }
    publisher.close().await;
}

/// Batches in flight on one channel, as the beat sends them ([`Publisher::send_batch`], the
/// confirms read oldest first with the later batches given, [`Publisher::confirms`]): a
/// returned message may ride on the confirm of another batch's message, before or after its
/// own batch, and is still charged to its own envelope.
#[tokio::test]
async fn unroutable_messages_fail_alone_across_batches_in_flight() {
    let ns = Ns::new("unroutable_in_flight");
    let mut publisher = publisher_with_b_unroutable(&ns).await;

    let at = Utc::now();
    let mut n = 0;
    for round in 0..5 {
        let batches: Vec<Vec<Envelope>> = (0..4)
            .map(|_| {
                (0..50)
                    .map(|i| {
                        n += 1;
                        // Each batch ends with an unroutable message: a multiple ack that
                        // confirms it may confirm the next batch's first messages too.
                        let queue = if i == 49 || (i + round) % 5 == 1 {
                            "b"
                        } else {
                            "a"
                        };
                        let t = at + chrono::TimeDelta::seconds(n);
                        Envelope::scheduled(queue, "t", queue, serde_json::json!({}), t, None, at)
                    })
                    .collect()
            })
            .collect();
        let mut in_flight = std::collections::VecDeque::new();
        for batch in &batches {
            in_flight.push_back(publisher.send_batch(batch, 0, || true).await.expect("sent"));
        }
        let session = publisher.session();
        let mut returned = std::collections::HashSet::new();
        for batch in &batches {
            let sending = in_flight.pop_front().unwrap();
            let outcomes = publisher
                .confirms((sending, session), &mut returned, in_flight.iter_mut())
                .await;
            for (env, outcome) in batch.iter().zip(&outcomes) {
                match (env.queue.as_str(), outcome) {
                    ("a", Ok(())) | ("b", Err(BrokerError::Unroutable(_))) => {}
                    _ => panic!("round {round}, {}: {outcome:?}", env.key),
                }
            }
        }
    }
    publisher.close().await;
}

/// A stop asked for while batches are in flight finishes them first: every message the broker
/// holds has its job's progress written and no progress runs ahead of a message; the beat then
/// stops cleanly (it used to poll its finished shutdown future again and panic).
#[tokio::test]
async fn a_stop_while_batches_are_in_flight_finishes_them_first() {
    let ns = Ns::new("stop_in_flight");
    let store = ns.store().await;
    let now = Utc::now().duration_trunc(TimeDelta::seconds(1)).unwrap();
    let due = now + TimeDelta::seconds(3);
    let names = numbered("s", 12 * BATCH_JOBS);
    let config = ns.config(&hourly(&names, due));
    let all: Vec<&str> = names.iter().map(String::as_str).collect();
    let want = last_instant_text(due);
    // Stop as soon as the first batch's progress is written: later batches are in flight.
    let stats = run_until(config, || async {
        at_progress(&store, &all[..BATCH_JOBS], &want).await > 0
    })
    .await;
    let recorded = at_progress(&store, &all, &want).await;
    let queued = ns.queued().await;
    assert_eq!(
        recorded, queued,
        "progress and messages disagree: {stats:?}"
    );
    assert_eq!(stats.published_total() as usize, queued, "{stats:?}");
}
