//! Schedules as data (docs/design.md#schedules-as-data), end to end with the real `drumline`
//! command and Redis: apply, get, list and delete, and the refusals (exit 2 naming the object
//! and key, nothing stored).

use drumline_e2e::cfg::{cron, shell, Cfg, Keys};
use drumline_e2e::{counts, instant_of, setup, wait_until, TestEnv};
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

/// A config with task `report` and the file job `nightly`.
fn config(env: &TestEnv) -> PathBuf {
    let cfg = Cfg::new()
        .task("report", shell("true"))
        .job("nightly", cron("0 3 * * *").with("task", "\"report\""));
    env.write_config("drumline.toml", &cfg)
}

/// A config with task `mark` (appends its key to `effects`) and no file job.
fn marking(env: &TestEnv) -> PathBuf {
    let mark = Keys::default().with("command", &env.append_key_command("effects", 0.0));
    env.write_config("drumline.toml", &Cfg::new().task("mark", mark))
}

/// The instants schedule `name` ran, each asserted run once.
fn runs_of(env: &TestEnv, name: &str) -> Vec<chrono::DateTime<chrono::Utc>> {
    let lines: Vec<String> = env
        .lines("effects")
        .into_iter()
        .filter(|l| l.starts_with(&format!("{name}@")))
        .collect();
    let counts = counts(&lines);
    assert!(counts.values().all(|n| *n == 1), "run twice: {counts:?}");
    counts.keys().map(|k| instant_of(k)).collect()
}

/// `drumline --config CFG ARGS…`: (exit code, stdout, stderr).
fn drumline(env: &TestEnv, args: &[&str]) -> (i32, String, String) {
    let cfg = env.path("drumline.toml");
    let mut all = vec!["--config", cfg.to_str().expect("utf-8")];
    all.extend_from_slice(args);
    let (status, out, err) = env.run("drumline", &all);
    (status.code().unwrap_or(-1), out, err)
}

/// Writes `json` to FILE in the test's directory and applies it.
fn apply(env: &TestEnv, file: &str, json: &str) -> (i32, String, String) {
    let path = env.path(file);
    std::fs::write(&path, json).expect("write");
    drumline(env, &["schedules", "apply", path.to_str().expect("utf-8")])
}

fn get_json(env: &TestEnv, name: &str) -> Value {
    let (code, out, err) = drumline(env, &["schedules", "get", name, "--json"]);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).expect("json")
}

#[test]
fn schedules_are_applied_shown_listed_and_deleted() {
    let env = setup("sched_crud");
    config(&env);
    let two = r#"[{"name": "acme", "task": "report", "every": "1h", "labels": {"tenant": "acme"}},
                  {"name": "zeta", "task": "report", "cron": "30 * * * *"}]"#;
    let (code, out, err) = apply(&env, "a.json", two);
    assert_eq!(
        (code, out.as_str()),
        (0, "created acme\ncreated zeta\n"),
        "{err}"
    );
    let edit = two.replace("\"1h\"", "\"2h\"");
    let (_, out, _) = apply(&env, "b.json", &edit);
    assert_eq!(out, "replaced acme\nunchanged zeta\n");

    let acme = get_json(&env, "acme");
    assert_eq!(
        (acme["every"].as_str(), acme["source"].as_str()),
        (Some("2h"), Some("api"))
    );
    assert_eq!(acme["next"].as_array().map(Vec::len), Some(3));
    assert!(acme["created_at"].as_str() <= acme["updated_at"].as_str());
    let (_, out, _) = drumline(&env, &["schedules", "list", "--json"]);
    let listed: Value = serde_json::from_str(&out).expect("json");
    let mut names: Vec<(&str, &str)> = listed["schedules"]
        .as_array()
        .expect("list")
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap_or(""),
                s["source"].as_str().unwrap_or(""),
            )
        })
        .collect();
    names.sort();
    assert_eq!(
        names,
        [("acme", "api"), ("nightly", "config"), ("zeta", "api")]
    );
    let (_, out, _) = drumline(
        &env,
        &["schedules", "list", "--label", "tenant=acme", "--json"],
    );
    assert_eq!(
        serde_json::from_str::<Value>(&out).expect("json")["schedules"][0]["name"],
        "acme"
    );

    let (code, out, _) = drumline(&env, &["schedules", "delete", "acme"]);
    assert_eq!((code, out.as_str()), (0, "deleted acme\n"));
    assert_eq!(drumline(&env, &["schedules", "get", "acme"]).0, 1);
    assert_eq!(drumline(&env, &["schedules", "delete", "acme"]).0, 1);
}

#[test]
fn a_bad_apply_exits_2_names_object_and_key_and_stores_nothing() {
    let env = setup("sched_bad");
    config(&env);
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
        let (code, _, err) = apply(&env, "bad.json", json);
        assert_eq!(code, 2, "{json}: {err}");
        assert!(err.contains(says), "{json}: {err}");
    }
    let (_, out, _) = drumline(&env, &["schedules", "list", "--json"]);
    let listed: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(
        listed["schedules"].as_array().map(Vec::len),
        Some(1),
        "{out}"
    );
}

#[test]
fn a_schedule_applied_to_a_running_beat_runs_changes_and_stops_when_deleted() {
    let env = setup("sched_live");
    let path = marking(&env);
    let path = path.to_str().expect("utf-8");
    let _worker = env.worker("worker", &["--config", path]);
    let beat = env.beat("beat", &["--config", path]);
    let leading = wait_until(Duration::from_secs(30), || {
        let (_, out, _) = drumline(&env, &["status", "--json"]);
        serde_json::from_str::<Value>(&out).is_ok_and(|s| s["leader"].is_object())
    });
    assert!(leading, "no leader\n{}", beat.log_tail(20));
    let applied = chrono::Utc::now();
    let (code, _, err) = apply(
        &env,
        "s.json",
        r#"{"name": "s", "task": "mark", "every": "1s"}"#,
    );
    assert_eq!(code, 0, "{err}");
    let ran = wait_until(Duration::from_secs(20), || runs_of(&env, "s").len() >= 3);
    assert!(ran, "the schedule did not run\n{}", beat.log_tail(20));
    let first = runs_of(&env, "s")[0];
    assert!(
        first > applied,
        "caught up before it existed: {first} <= {applied}"
    );
    assert!(
        first - applied < chrono::TimeDelta::milliseconds(2_500),
        "first run {first}, applied {applied}"
    );

    let edited = chrono::Utc::now();
    apply(
        &env,
        "s2.json",
        r#"{"name": "s", "task": "mark", "every": "2s"}"#,
    );
    let two = |runs: &[chrono::DateTime<chrono::Utc>]| {
        let after: Vec<_> = runs
            .iter()
            .filter(|t| **t > edited + chrono::TimeDelta::seconds(1))
            .collect();
        after.len() >= 2 && after.iter().all(|t| t.timestamp() % 2 == 0)
    };
    assert!(
        wait_until(Duration::from_secs(20), || two(&runs_of(&env, "s"))),
        "the edit did not apply\n{}",
        beat.log_tail(20)
    );

    let (_, out, _) = drumline(&env, &["status", "--json"]);
    let status: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(status["jobs"][0]["job"], "s", "{out}");
    let (code, out, err) = drumline(&env, &["verify", "--since", "2m"]);
    assert_eq!(code, 0, "verify over the schedule and its edit: {out}{err}");
    let (code, _, _) = drumline(&env, &["schedules", "delete", "s"]);
    assert_eq!(code, 0);
    let deleted = chrono::Utc::now();
    let later = |runs: &[chrono::DateTime<chrono::Utc>]| {
        runs.iter()
            .any(|t| *t > deleted + chrono::TimeDelta::seconds(1))
    };
    let ran_on = wait_until(Duration::from_secs(5), || later(&runs_of(&env, "s")));
    assert!(!ran_on, "ran after its delete: {:?}", runs_of(&env, "s"));
}

#[test]
fn a_calendar_date_skips_the_jobs_instants_visibly() {
    let env = setup("sched_calendar");
    let today = chrono::Utc::now().date_naive();
    let dates = format!(
        "[\"{today}\", \"{}\"]",
        today.succ_opt().expect("a tomorrow")
    );
    let mark = Keys::default().with("command", &env.append_key_command("effects", 0.0));
    let cfg = Cfg::new()
        .set("calendars.today", "dates", &dates)
        .task("mark", mark)
        .job(
            "j",
            Keys::default()
                .with("task", "\"mark\"")
                .with("every", "\"1s\"")
                .with("exclude", "[\"today\"]"),
        );
    let path = env.write_config("drumline.toml", &cfg);
    let path = path.to_str().expect("utf-8");
    let (_, out, _) = drumline(&env, &["next", "j", "--count", "1", "--json"]);
    assert!(out.contains("excluded: today"), "{out}");
    let _worker = env.worker("worker", &["--config", path]);
    let beat = env.beat("beat", &["--config", path]);
    let skipped = wait_until(Duration::from_secs(30), || {
        let (_, out, _) = drumline(&env, &["audit", "j", "--json"]);
        let audit: Value = serde_json::from_str(&out).unwrap_or(Value::Null);
        let rows = audit["instants"].as_array().cloned().unwrap_or_default();
        rows.iter()
            .filter(|r| r["class"] == "skipped" && r["reason"] == "calendar")
            .count()
            >= 3
    });
    assert!(
        skipped,
        "no instant skipped for the calendar\n{}",
        beat.log_tail(20)
    );
    assert!(
        env.lines("effects").is_empty(),
        "an excluded instant ran: {:?}",
        env.lines("effects")
    );
    let (code, out, err) = drumline(&env, &["verify", "--since", "5m"]);
    assert_eq!(code, 0, "{out}{err}");
}

#[test]
fn a_calendar_applied_at_run_time_skips_a_schedules_instants_within_a_second() {
    let env = setup("sched_live_calendar");
    let path = marking(&env);
    let path = path.to_str().expect("utf-8");
    let _worker = env.worker("worker", &["--config", path]);
    let beat = env.beat("beat", &["--config", path]);
    let s = r#"{"name": "s", "task": "mark", "every": "1s", "exclude": ["off"]}"#;
    assert_eq!(apply(&env, "s.json", s).0, 0);
    let ran = wait_until(Duration::from_secs(30), || runs_of(&env, "s").len() >= 2);
    assert!(ran, "the schedule did not run\n{}", beat.log_tail(20));
    let today = chrono::Utc::now().date_naive();
    let off = format!(
        r#"{{"name": "off", "dates": ["{today}", "{}"]}}"#,
        today.succ_opt().expect("tomorrow")
    );
    let path = env.path("off.json");
    std::fs::write(&path, off).expect("write");
    let (code, out, err) = drumline(&env, &["calendars", "apply", path.to_str().expect("utf-8")]);
    assert_eq!((code, out.as_str()), (0, "created off\n"), "{err}");
    let applied = chrono::Utc::now();
    let skipping = wait_until(Duration::from_secs(10), || {
        let (_, out, _) = drumline(&env, &["audit", "s", "--json"]);
        let audit: Value = serde_json::from_str(&out).unwrap_or(Value::Null);
        let rows = audit["instants"].as_array().cloned().unwrap_or_default();
        rows.iter().filter(|r| r["reason"] == "calendar").count() >= 2
    });
    assert!(skipping, "nothing skipped\n{}", beat.log_tail(20));
    let late = runs_of(&env, "s")
        .into_iter()
        .filter(|t| *t > applied + chrono::TimeDelta::seconds(1))
        .count();
    assert_eq!(late, 0, "ran on an excluded date: {:?}", runs_of(&env, "s"));
    let (code, _, err) = drumline(&env, &["calendars", "get", "off", "--json"]);
    assert_eq!(code, 0, "{err}");
}
