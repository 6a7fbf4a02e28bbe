//! `drumline inspect KEY` and `GET /api/v1/keys/{key}` (docs/api.md): what became of one key,
//! ad hoc or scheduled, from the real worker's records; exit 1 (404) when there is no trace.

use drumline_e2e::cfg::{Cfg, Keys};
use drumline_e2e::probe::api_request;
use drumline_e2e::{adhoc, setup, wait_until, TestEnv};
use serde_json::{json, Value};
use std::time::Duration;

/// A worker for task `ok` (appends its key) and `bad` (exits 3, permanent) that ran `k-ok`
/// and `k-bad`: the config's path.
async fn ran_two(env: &TestEnv) -> String {
    let append = Keys::default().with("command", &env.append_key_command("effects", 0.0));
    let fail = Keys::default()
        .with("command", "[\"/bin/sh\", \"-c\", \"exit 3\"]")
        .with("permanent_exit_codes", "[3]");
    let cfg = Cfg::new().task("ok", append).task("bad", fail);
    let path = env
        .write_config("drumline.toml", &cfg)
        .to_str()
        .expect("utf-8")
        .to_owned();
    let worker = env.worker("worker", &["--config", &path]);
    env.wait_for_topology(&worker).await;
    env.publish(&adhoc("k-ok", "ok")).await;
    env.publish(&adhoc("k-bad", "bad")).await;
    let ended = wait_until(Duration::from_secs(30), || {
        inspect(env, &path, "k-ok").1["state"] == "done"
            && inspect(env, &path, "k-bad").1["state"] == "dead"
    });
    assert!(
        ended,
        "{:?}\n{}",
        inspect(env, &path, "k-bad"),
        worker.log_tail(20)
    );
    path
}

fn inspect(env: &TestEnv, path: &str, key: &str) -> (i32, Value) {
    let (status, out, _) = env.run("drumline", &["--config", path, "inspect", key, "--json"]);
    (
        status.code().unwrap_or(-1),
        serde_json::from_str(&out).unwrap_or(Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn inspect_tells_a_keys_fate_and_exits_1_without_a_trace() {
    let env = setup("inspect_key");
    let path = ran_two(&env).await;
    let (code, ok) = inspect(&env, &path, "k-ok");
    assert_eq!(
        (code, ok["attempt"].as_u64(), ok["fencing_token"].is_u64()),
        (0, Some(0), true),
        "{ok}"
    );
    let events: Vec<&str> = ok["journal"]
        .as_array()
        .expect("journal")
        .iter()
        .filter_map(|e| e["event"].as_str())
        .collect();
    assert!(
        events.contains(&"claim") && events.contains(&"success"),
        "{events:?}"
    );
    let (_, bad) = inspect(&env, &path, "k-bad");
    assert!(
        bad["dead_letter"].is_object() && bad["state"] == "dead",
        "{bad}"
    );
    let (code, unknown) = inspect(&env, &path, "never-seen");
    assert_eq!(
        (code, unknown),
        (1, json!({"key": "never-seen", "state": "unknown"}))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_tells_a_keys_fate_and_404s_without_a_trace() {
    let env = setup("inspect_api");
    let path = ran_two(&env).await;
    let (_beat, port) = env.beat_with_api(&path, "t");
    let get = |key: &str| api_request(port, &format!("GET /api/v1/keys/{key}"), Some("t"), "");
    let (status, _, body) = get("k-ok").expect("an answer");
    assert_eq!((status, &body["state"]), (200, &json!("done")));
    let (status, _, body) = get("never-seen").expect("an answer");
    assert_eq!(
        (status, body),
        (404, json!({"key": "never-seen", "state": "unknown"}))
    );
}
