//! Misfire policies end to end (docs/design.md): the real beat against the real broker and Redis,
//! no worker. A test writes the job's persisted last instant `{ns}:beat:last:{job}` in the past
//! (as a beat that was down, or a forward clock jump, would leave it), starts the beat, waits
//! until it has decided up to the newest missed instant, stops it, and reads back every message
//! in `{ns}.q.default`.
//!
//! Minute jobs use `every = "1m"` with an `anchor` 30 s ahead of the test's start, so the newest
//! missed instant is ~30 s old — far from the 5 s `misfire_threshold` on either side — and the
//! next one is ~30 s away. The expected set is computed from those instants, never hard-coded.

use chrono::{DateTime, DurationRound, TimeDelta, Timelike, Utc};
use drumline_e2e::cfg::{cron, every, Cfg, Keys};
use drumline_e2e::probe::expect;
use drumline_e2e::{setup, toml_string, wait_until, PrivateRabbit, Proc, TestEnv, AMQP_URL};
use drumline_shared::envelope::instance_key;
use drumline_shared::store::last_instant_text;
use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use std::path::Path;
use std::time::Duration;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// A config of `jobs`, each running task `t` (`/bin/true`).
fn jobs(jobs: Vec<(&str, Keys)>) -> Cfg {
    let cfg = Cfg::new().task("t", Keys::default().with("command", "[\"/bin/true\"]"));
    jobs.into_iter().fold(cfg, |cfg, (name, keys)| {
        cfg.job(name, keys.with("task", "\"t\""))
    })
}

/// `every = "1m"` from `anchor`.
fn each_minute_from(anchor: DateTime<Utc>) -> Keys {
    every("1m").with("anchor", &toml_string(&rfc3339(anchor)))
}

/// A one-minute timeline whose next instant is 30 s after `now`: (anchor, newest past instant).
fn minute_timeline(now: DateTime<Utc>) -> (DateTime<Utc>, DateTime<Utc>) {
    let anchor = now.duration_trunc(TimeDelta::seconds(1)).expect("trunc") + TimeDelta::seconds(30);
    (anchor, anchor - TimeDelta::minutes(1))
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
}

/// Sets `{ns}:beat:last:{job}` as the beat writes it.
fn set_last(env: &TestEnv, job: &str, at: DateTime<Utc>) {
    runtime().block_on(env.set_beat_last(job, at));
}

fn get_last(env: &TestEnv, job: &str) -> Option<String> {
    runtime().block_on(async {
        let mut conn = env.redis().await;
        redis::cmd("GET")
            .arg(env.names().beat_last(job))
            .query_async(&mut conn)
            .await
            .expect("GET")
    })
}

/// Waits (bounded) until the beat has decided `job` up to `at` (fixed-width text: string order
/// is time order).
fn wait_decided(env: &TestEnv, beat: &Proc, job: &str, at: DateTime<Utc>) {
    let want = last_instant_text(at);
    let ok = wait_until(Duration::from_secs(30), || {
        get_last(env, job).is_some_and(|last| last >= want)
    });
    assert!(
        ok,
        "{job} was not decided up to {want} (last = {:?})\n{}",
        get_last(env, job),
        beat.log_tail(40)
    );
}

fn queue_len(env: &TestEnv) -> u32 {
    queue_len_at(AMQP_URL, env)
}

/// Messages ready in `{ns}.q.default` on the broker at `url` (0 while it does not exist or the
/// broker is down).
fn queue_len_at(url: &str, env: &TestEnv) -> u32 {
    runtime().block_on(async {
        let Ok(conn) = Connection::connect(url, ConnectionProperties::default()).await else {
            return 0;
        };
        let mut len = 0;
        if let Ok(ch) = conn.create_channel().await {
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            if let Ok(q) = ch
                .queue_declare(
                    env.names().work_queue("default").as_str().into(),
                    passive,
                    FieldTable::default(),
                )
                .await
            {
                len = q.message_count();
            }
        }
        let _ = conn.close(200, "bye".into()).await;
        len
    })
}

/// One published message, as read back from the queue.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Message {
    job: String,
    key: String,
    scheduled_for: DateTime<Utc>,
}

/// Takes every message out of `{ns}.q.default`, in queue (= publish) order.
fn drain(env: &TestEnv) -> Vec<Message> {
    drain_at(AMQP_URL, env)
}

fn drain_at(url: &str, env: &TestEnv) -> Vec<Message> {
    runtime().block_on(async {
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .expect("amqp connection");
        let ch = conn.create_channel().await.expect("channel");
        let queue = env.names().work_queue("default");
        let mut out = Vec::new();
        while let Some(msg) = ch
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic_get")
        {
            let body: serde_json::Value =
                serde_json::from_slice(&msg.delivery.data).expect("a JSON envelope");
            let text = |field: &str| body[field].as_str().expect(field).to_owned();
            out.push(Message {
                job: text("job"),
                key: text("key"),
                scheduled_for: DateTime::parse_from_rfc3339(&text("scheduled_for"))
                    .expect("RFC 3339")
                    .with_timezone(&Utc),
            });
        }
        let _ = conn.close(200, "bye".into()).await;
        out
    })
}

fn start_beat(env: &TestEnv, label: &str, config: &Path) -> Proc {
    env.beat(label, &["--config", config.to_str().expect("utf-8 path")])
}

fn stop(beat: &mut Proc) {
    let status = beat.terminate(Duration::from_secs(15));
    assert!(
        status.success(),
        "beat exited with {status}\n{}",
        beat.log_tail(40)
    );
}

/// Keys of `job` at `instants`.
fn keys(job: &str, instants: impl IntoIterator<Item = DateTime<Utc>>) -> Vec<String> {
    instants.into_iter().map(|t| instance_key(job, t)).collect()
}

fn keys_of(messages: &[Message], job: &str) -> Vec<String> {
    messages
        .iter()
        .filter(|m| m.job == job)
        .map(|m| m.key.clone())
        .collect()
}

/// Instants of a one-minute timeline from `first` through `last`.
fn minutes_between(first: DateTime<Utc>, last: DateTime<Utc>) -> Vec<DateTime<Utc>> {
    let mut out = Vec::new();
    let mut t = first;
    while t <= last {
        out.push(t);
        t += TimeDelta::minutes(1);
    }
    out
}

/// What one beat run published.
struct Run {
    messages: Vec<Message>,
    log: String,
    /// Just before the SIGTERM.
    stopping: DateTime<Utc>,
    /// After the beat exited.
    stopped: DateTime<Utc>,
}

/// Starts a beat on `config`, waits until each `(job, instant)` is decided, stops it and reads
/// back what it published.
fn run_until_decided(env: &TestEnv, config: &Path, decided: &[(&str, DateTime<Utc>)]) -> Run {
    let mut beat = start_beat(env, "beat", config);
    for (job, at) in decided {
        wait_decided(env, &beat, job, *at);
    }
    let stopping = Utc::now();
    stop(&mut beat);
    Run {
        stopped: Utc::now(),
        stopping,
        messages: drain(env),
        log: beat.log(),
    }
}

/// Runs a beat with `job`'s last instant set 10 minutes before `newest` (its newest missed
/// instant) until it decided `newest`.
fn ten_minute_gap(env: &TestEnv, config: &Path, job: &str, newest: DateTime<Utc>) -> Run {
    set_last(env, job, newest - TimeDelta::minutes(10));
    run_until_decided(env, config, &[(job, newest)])
}

/// Asserts that `job` published exactly `missed` (in that order), followed by the on-time
/// instants of its one-minute timeline from `next` that came due while the beat ran. Those
/// happen only when the test ran slower than its 30 s of margin; one due in the last moments
/// before the SIGTERM may or may not have been published.
fn assert_published(run: &Run, job: &str, missed: Vec<DateTime<Utc>>, next: DateTime<Utc>) {
    let surely_due = run.stopping - TimeDelta::seconds(2);
    let mut want = missed;
    want.extend(minutes_between(next, surely_due));
    let maybe: Vec<_> = minutes_between(next, run.stopped)
        .into_iter()
        .filter(|t| *t > surely_due)
        .collect();
    let (want, maybe) = (keys(job, want), keys(job, maybe));
    let got = keys_of(&run.messages, job);
    let ok = got.len() >= want.len()
        && got[..want.len()] == want[..]
        && got.len() - want.len() <= maybe.len()
        && got[want.len()..] == maybe[..got.len() - want.len()];
    assert!(
        ok,
        "{job} published\n  {got:?}\nexpected\n  {want:?}\n(then possibly {maybe:?})\n{}",
        run.log
    );
}

/// Asserts that each of `instants` was reported as not published, with its key.
fn assert_logged_dropped(run: &Run, job: &str, instants: Vec<DateTime<Utc>>) {
    for key in keys(job, instants) {
        assert!(
            run.log.contains(&key),
            "{key} not reported as dropped\n{}",
            run.log
        );
    }
}

#[test]
fn run_once_publishes_only_the_latest_missed_instance() {
    let env = setup("misfire_run_once");
    let (anchor, newest) = minute_timeline(Utc::now());
    let config = env.write_config(
        "drumline.toml",
        &jobs(vec![("j", each_minute_from(anchor))]),
    );
    let run = ten_minute_gap(&env, &config, "j", newest);
    assert_published(&run, "j", vec![newest], anchor);
    // The nine older ones are each reported with their key.
    let older = minutes_between(
        newest - TimeDelta::minutes(9),
        newest - TimeDelta::minutes(1),
    );
    assert_eq!(older.len(), 9);
    assert_logged_dropped(&run, "j", older);
}

#[test]
fn catch_up_publishes_all_ten_missed_instances_oldest_first() {
    let env = setup("misfire_catch_up");
    let (anchor, newest) = minute_timeline(Utc::now());
    let catch_up = each_minute_from(anchor)
        .with("misfire", "\"catch_up\"")
        .with("overlap", "\"queue\"");
    let config = env.write_config("drumline.toml", &jobs(vec![("j", catch_up)]));
    let run = ten_minute_gap(&env, &config, "j", newest);
    let missed = minutes_between(newest - TimeDelta::minutes(9), newest);
    assert_eq!(missed.len(), 10);
    assert_published(&run, "j", missed, anchor);
}

#[test]
fn skip_publishes_none_of_the_missed_instances() {
    let env = setup("misfire_skip");
    let (anchor, newest) = minute_timeline(Utc::now());
    let skip = each_minute_from(anchor).with("misfire", "\"skip\"");
    let config = env.write_config("drumline.toml", &jobs(vec![("j", skip)]));
    let run = ten_minute_gap(&env, &config, "j", newest);
    assert_published(&run, "j", vec![], anchor);
    // Decided nonetheless (`ten_minute_gap` waited for the progress to reach `newest`, so a
    // restart does not look at them again), and each one reported with its key.
    assert_logged_dropped(
        &run,
        "j",
        minutes_between(newest - TimeDelta::minutes(9), newest),
    );
}

#[test]
fn cron_catch_up_publishes_the_ten_missed_minutes() {
    let env = setup("misfire_cron");
    // Cron instants sit on the minute: start well inside one, so that the current minute's
    // instant is already missed (> 5 s old) and the next one is far away.
    let inside = wait_until(Duration::from_secs(65), || {
        (8..=35).contains(&Utc::now().second())
    });
    assert!(inside, "the clock never reached seconds 8-35 of a minute");
    let minute = Utc::now()
        .duration_trunc(TimeDelta::minutes(1))
        .expect("trunc");
    let catch_up = cron("* * * * *")
        .with("misfire", "\"catch_up\"")
        .with("overlap", "\"queue\"");
    let config = env.write_config("drumline.toml", &jobs(vec![("j", catch_up)]));
    let run = ten_minute_gap(&env, &config, "j", minute);
    let missed = minutes_between(minute - TimeDelta::minutes(9), minute);
    assert_eq!(missed.len(), 10);
    assert_published(&run, "j", missed, minute + TimeDelta::minutes(1));
}

#[test]
fn instances_older_than_misfire_grace_are_never_published() {
    let env = setup("misfire_grace");
    let now = Utc::now();
    let (anchor, newest) = minute_timeline(now);
    // A ten-minute job whose newest instant is 8 minutes old, past a 5-minute grace.
    let slow_anchor =
        now.duration_trunc(TimeDelta::seconds(1)).expect("trunc") + TimeDelta::minutes(2);
    let slow_newest = slow_anchor - TimeDelta::minutes(10);
    let catch = each_minute_from(anchor)
        .with("misfire", "\"catch_up\"")
        .with("overlap", "\"queue\"")
        .with("misfire_grace", "\"5m\"");
    let once = every("10m")
        .with("anchor", &toml_string(&rfc3339(slow_anchor)))
        .with("misfire_grace", "\"5m\"");
    let config = env.write_config(
        "drumline.toml",
        &jobs(vec![("catch", catch), ("once", once)]),
    );
    set_last(&env, "catch", newest - TimeDelta::minutes(10));
    set_last(&env, "once", slow_newest - TimeDelta::minutes(30));
    let run = run_until_decided(&env, &config, &[("catch", newest), ("once", slow_newest)]);

    // catch: missed 9 … 0 minutes before `newest` (itself ~30 s old): at planning time those
    // 5.5 min and older are past the 5 min grace; the 5 younger ones are published.
    assert_published(
        &run,
        "catch",
        minutes_between(newest - TimeDelta::minutes(4), newest),
        anchor,
    );
    assert_logged_dropped(
        &run,
        "catch",
        minutes_between(
            newest - TimeDelta::minutes(9),
            newest - TimeDelta::minutes(5),
        ),
    );
    // once: run_once would publish the newest missed instance, but it is past grace too.
    assert_eq!(keys_of(&run.messages, "once"), Vec::<String>::new());
    assert_logged_dropped(
        &run,
        "once",
        vec![
            slow_newest - TimeDelta::minutes(20),
            slow_newest - TimeDelta::minutes(10),
            slow_newest,
        ],
    );
}

#[test]
fn a_restarted_beat_publishes_no_instant_twice_and_leaves_no_gap() {
    let env = setup("misfire_restart");
    let catch_up = every("1s")
        .with("misfire", "\"catch_up\"")
        .with("overlap", "\"queue\"");
    let config = env.write_config("drumline.toml", &jobs(vec![("j", catch_up)]));
    let started = Utc::now();
    let mut first = start_beat(&env, "beat-1", &config);
    expect(
        Duration::from_secs(30),
        &[&first],
        "three instants published",
        || queue_len(&env) >= 3,
    );
    stop(&mut first);
    let after_first = queue_len(&env);
    let mut second = start_beat(&env, "beat-2", &config);
    expect(
        Duration::from_secs(30),
        &[&second],
        "three more instants published",
        || queue_len(&env) >= after_first + 3,
    );
    stop(&mut second);

    let messages = drain(&env);
    let instants: Vec<DateTime<Utc>> = messages.iter().map(|m| m.scheduled_for).collect();
    let logs = format!("{}\n{}", first.log_tail(30), second.log_tail(30));
    assert!(instants.len() >= 6, "{instants:?}\n{logs}");
    // First start: nothing before it counts as missed.
    assert!(instants[0] > started, "{instants:?}");
    // Exactly one message per second, in order: no instant twice, none left out.
    for pair in instants.windows(2) {
        assert_eq!(
            pair[1] - pair[0],
            TimeDelta::seconds(1),
            "duplicate or gap around {}: {instants:?}\n{logs}",
            pair[0]
        );
    }
    assert_eq!(
        get_last(&env, "j"),
        Some(last_instant_text(*instants.last().expect("some")))
    );
}

#[test]
fn progress_ahead_of_the_clock_is_never_republished() {
    // What a backward wall-clock jump leaves behind: the persisted last instant is ahead of
    // the clock. Nothing up to it may be published again; the next instant follows it.
    let env = setup("misfire_backward");
    let config = env.write_config("drumline.toml", &jobs(vec![("j", every("1s"))]));
    let ahead = Utc::now()
        .duration_trunc(TimeDelta::seconds(1))
        .expect("trunc")
        + TimeDelta::seconds(4);
    set_last(&env, "j", ahead);
    let mut beat = start_beat(&env, "beat", &config);
    expect(
        Duration::from_secs(30),
        &[&beat],
        "two instants published",
        || queue_len(&env) >= 2,
    );
    stop(&mut beat);
    let instants: Vec<_> = drain(&env).iter().map(|m| m.scheduled_for).collect();
    assert_eq!(instants[0], ahead + TimeDelta::seconds(1), "{instants:?}");
    assert!(
        instants
            .windows(2)
            .all(|p| p[1] - p[0] == TimeDelta::seconds(1)),
        "{instants:?}"
    );
}

#[test]
fn a_broker_outage_is_a_misfire() {
    // A private broker, stopped for longer than `misfire_threshold` while a 1-second job runs
    // (`run_once`). Afterwards every instant in the run was either published exactly once or
    // reported as not published with its key, and the outage did drop some.
    let env = setup("misfire_outage");
    let mut rabbit = PrivateRabbit::start("misfire-outage");
    let url = rabbit.url();
    let cfg = jobs(vec![("j", every("1s"))]).set("broker", "url", &toml_string(&url));
    let config = env.write_config("drumline.toml", &cfg);
    let mut beat = start_beat(&env, "beat", &config);
    expect(
        Duration::from_secs(30),
        &[&beat],
        "three instants published",
        || queue_len_at(&url, &env) >= 3,
    );
    rabbit.stop();
    let down = Utc::now();
    // The outage itself (the fault being injected), longer than the 5 s threshold.
    assert!(wait_until(Duration::from_secs(20), || Utc::now()
        > down + TimeDelta::seconds(8)));
    rabbit.restart();
    let before = queue_len_at(&url, &env);
    expect(
        Duration::from_secs(60),
        &[&beat],
        "three more instants after the outage",
        || queue_len_at(&url, &env) >= before + 3,
    );
    stop(&mut beat);
    let log = beat.log();
    let published: Vec<_> = drain_at(&url, &env)
        .iter()
        .map(|m| m.scheduled_for)
        .collect();
    assert!(
        published.windows(2).all(|p| p[0] < p[1]),
        "published out of order or twice: {published:?}"
    );
    let (first, last) = (published[0], *published.last().expect("some"));
    let mut dropped = 0;
    let mut t = first;
    while t <= last {
        let key = instance_key("j", t);
        let was_published = published.contains(&t);
        let reported = log.contains(&format!("key={key} reason="));
        assert!(
            was_published != reported,
            "{key}: published {was_published}, reported dropped {reported}\n{log}"
        );
        dropped += usize::from(reported);
        t += TimeDelta::seconds(1);
    }
    assert!(dropped > 0, "an 8 s outage dropped nothing\n{log}");
}
