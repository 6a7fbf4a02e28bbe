//! Schedules as data (docs/design.md#schedules-as-data), end to end with the real `drumline`
//! command and Redis: apply, get, list and delete, and the refusals (exit 2 naming the object
//! and key, nothing stored).

use drumline_e2e::cfg::{cron, every, shell, Cfg};
use drumline_e2e::probe::Scene;
use drumline_e2e::{setup, TestEnv};
use serde_json::Value;
use std::time::Duration;

/// Writes a config with task `report` and the file job `nightly`: its path.
fn config(env: &TestEnv) -> String {
    let job = cron("0 3 * * *").task("report");
    env.config_file(&Cfg::new().task("report", shell("true")).job("nightly", job))
}

/// A config with task `mark`, which appends its key to `effects`.
fn mark(env: &TestEnv) -> Cfg {
    Cfg::new().task("mark", env.appender("effects", 0.0))
}

/// A worker and a beat on `cfg`, once the beat leads.
async fn marking(env: &TestEnv, cfg: Cfg) -> Scene {
    let scene = env.start(&cfg, 1, 1).await;
    env.expect_leader(&scene.config, &scene.procs());
    scene
}

/// The names and sources `drumline schedules list` shows, sorted.
fn listed(env: &TestEnv, config: &str) -> Vec<(String, String)> {
    let listed = env.drumline_json(config, &["schedules", "list"]);
    let text = |s: &Value, key: &str| s[key].as_str().unwrap_or("").to_owned();
    let rows = listed["schedules"].as_array().expect("list").iter();
    let mut names: Vec<_> = rows.map(|s| (text(s, "name"), text(s, "source"))).collect();
    names.sort();
    names
}

#[test]
fn schedules_are_applied_shown_listed_and_deleted() {
    let env = setup("sched_crud");
    let c = &config(&env);
    let two = r#"[{"name": "acme", "task": "report", "every": "1h", "labels": {"tenant": "acme"}},
                  {"name": "zeta", "task": "report", "cron": "30 * * * *"}]"#;
    let (code, out, err) = env.apply(c, "schedules", "a.json", two);
    assert_eq!(
        (code, out.as_str()),
        (0, "created acme\ncreated zeta\n"),
        "{err}"
    );
    let edit = two.replace("\"1h\"", "\"2h\"");
    let (_, out, _) = env.apply(c, "schedules", "b.json", &edit);
    assert_eq!(out, "replaced acme\nunchanged zeta\n");

    let acme = env.drumline_json(c, &["schedules", "get", "acme"]);
    let (every, source) = (acme["every"].as_str(), acme["source"].as_str());
    assert_eq!((every, source), (Some("2h"), Some("api")));
    assert_eq!(acme["next"].as_array().map(Vec::len), Some(3));
    assert!(acme["created_at"].as_str() <= acme["updated_at"].as_str());
    let want = [("acme", "api"), ("nightly", "config"), ("zeta", "api")];
    let want: Vec<_> = want.map(|(n, s)| (n.to_owned(), s.to_owned())).to_vec();
    assert_eq!(listed(&env, c), want);
    let labelled = env.drumline_json(c, &["schedules", "list", "--label", "tenant=acme"]);
    assert_eq!(labelled["schedules"][0]["name"], "acme");

    let (code, out, _) = env.drumline_cmd(c, &["schedules", "delete", "acme"]);
    assert_eq!((code, out.as_str()), (0, "deleted acme\n"));
    assert_eq!(env.drumline_cmd(c, &["schedules", "get", "acme"]).0, 1);
    assert_eq!(env.drumline_cmd(c, &["schedules", "delete", "acme"]).0, 1);
}

#[test]
fn a_bad_apply_exits_2_names_object_and_key_and_stores_nothing() {
    let env = setup("sched_bad");
    let c = &config(&env);
    let cases = [
        (
            r#"[{"name": "ok", "task": "report", "every": "1m"},
             {"name": "bad", "task": "report", "every": "often"}]"#,
            "schedule 2 (\"bad\"): key `every`",
        ),
        (
            r#"{"name": "nightly", "task": "report", "every": "1m"}"#,
            "key `name`",
        ),
        (
            r#"{"name": "x", "task": "missing", "every": "1m"}"#,
            "key `task`",
        ),
        ("{ not json", "not JSON"),
    ];
    for (json, says) in cases {
        let (code, _, err) = env.apply(c, "schedules", "bad.json", json);
        assert_eq!(code, 2, "{json}: {err}");
        assert!(err.contains(says), "{json}: {err}");
    }
    assert_eq!(listed(&env, c).len(), 1, "only the file's job");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_schedule_applied_to_a_running_beat_runs_changes_and_stops_when_deleted() {
    let env = setup("sched_live");
    let scene = marking(&env, mark(&env)).await;
    let (c, runs) = (&scene.config, || env.runs_of("effects", "s"));
    let applied = chrono::Utc::now();
    let s = r#"{"name": "s", "task": "mark", "every": "1s"}"#;
    let (code, _, err) = env.apply(c, "schedules", "s.json", s);
    assert_eq!(code, 0, "{err}");
    scene.expect(Duration::from_secs(20), "three runs", || runs().len() >= 3);
    let first = runs()[0];
    assert!(
        first > applied,
        "caught up before it existed: {first} <= {applied}"
    );
    let soon = first - applied < chrono::TimeDelta::milliseconds(2_500);
    assert!(soon, "first run {first}, applied {applied}");

    let edited = chrono::Utc::now() + chrono::TimeDelta::seconds(1);
    env.apply(c, "schedules", "s2.json", &s.replace("1s", "2s"));
    scene.expect(Duration::from_secs(20), "the edit applied", || {
        let after: Vec<_> = runs().into_iter().filter(|t| *t > edited).collect();
        after.len() >= 2 && after.iter().all(|t| t.timestamp() % 2 == 0)
    });

    let status = env.drumline_json(c, &["status"]);
    assert_eq!(status["jobs"][0]["job"], "s", "{status}");
    let (code, out, err) = env.drumline_cmd(c, &["verify", "--since", "2m"]);
    assert_eq!(code, 0, "verify over the schedule and its edit: {out}{err}");
    assert_eq!(env.drumline_cmd(c, &["schedules", "delete", "s"]).0, 0);
    let deleted = chrono::Utc::now() + chrono::TimeDelta::seconds(1);
    let later = || runs().iter().any(|t| *t > deleted);
    let ran_on = drumline_e2e::wait_until(Duration::from_secs(5), later);
    assert!(!ran_on, "ran after its delete: {:?}", runs());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_calendar_date_skips_the_jobs_instants_visibly() {
    let env = setup("sched_calendar");
    let today = chrono::Utc::now().date_naive();
    let tomorrow = today.succ_opt().expect("a tomorrow");
    let cfg = mark(&env)
        .set(
            "calendars.today",
            "dates",
            &format!("[\"{today}\", \"{tomorrow}\"]"),
        )
        .job("j", every("1s").task("mark").with("exclude", "[\"today\"]"));
    let config = env.config_file(&cfg);
    let (_, out, _) = env.drumline_cmd(&config, &["next", "j", "--count", "1", "--json"]);
    assert!(out.contains("excluded: today"), "{out}");
    let scene = marking(&env, cfg).await;
    let calendar = |r: &Value| r["class"] == "skipped" && r["reason"] == "calendar";
    scene.expect(
        Duration::from_secs(30),
        "3 instants skipped for the calendar",
        || env.audit_count(&scene.config, "j", calendar) >= 3,
    );
    let ran = env.lines("effects");
    assert!(ran.is_empty(), "an excluded instant ran: {ran:?}");
    let (code, out, err) = env.drumline_cmd(&scene.config, &["verify", "--since", "5m"]);
    assert_eq!(code, 0, "{out}{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_calendar_applied_at_run_time_skips_a_schedules_instants_within_a_second() {
    let env = setup("sched_live_calendar");
    let scene = marking(&env, mark(&env)).await;
    let (c, runs) = (&scene.config, || env.runs_of("effects", "s"));
    let s = r#"{"name": "s", "task": "mark", "every": "1s", "exclude": ["off"]}"#;
    assert_eq!(env.apply(c, "schedules", "s.json", s).0, 0);
    scene.expect(Duration::from_secs(30), "two runs", || runs().len() >= 2);
    let today = chrono::Utc::now().date_naive();
    let tomorrow = today.succ_opt().expect("tomorrow");
    let off = format!(r#"{{"name": "off", "dates": ["{today}", "{tomorrow}"]}}"#);
    let (code, out, err) = env.apply(c, "calendars", "off.json", &off);
    assert_eq!((code, out.as_str()), (0, "created off\n"), "{err}");
    let applied = chrono::Utc::now() + chrono::TimeDelta::seconds(1);
    let calendar = |r: &Value| r["reason"] == "calendar";
    scene.expect(Duration::from_secs(10), "two instants skipped", || {
        env.audit_count(c, "s", calendar) >= 2
    });
    let late = runs().into_iter().filter(|t| *t > applied).count();
    assert_eq!(late, 0, "ran on an excluded date: {:?}", runs());
    env.drumline_json(c, &["calendars", "get", "off"]);
}
