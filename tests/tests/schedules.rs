//! Schedules as data (docs/design.md#schedules-as-data), end to end with the real `drumline`
//! command and Redis: apply, get, list and delete, and the refusals (exit 2 naming the object
//! and key, nothing stored).

use drumline_e2e::cfg::{cron, shell, Cfg};
use drumline_e2e::{setup, TestEnv};
use serde_json::Value;
use std::path::PathBuf;

/// A config with task `report` and the file job `nightly`.
fn config(env: &TestEnv) -> PathBuf {
    let cfg = Cfg::new()
        .task("report", shell("true"))
        .job("nightly", cron("0 3 * * *").with("task", "\"report\""));
    env.write_config("drumline.toml", &cfg)
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
