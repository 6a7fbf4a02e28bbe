//! `drumline inspect KEY` and `GET /api/v1/keys/{key}` (docs/api.md): what became of one key,
//! ad hoc or scheduled, from the real worker's records; exit 1 (404) when there is no trace.

use drumline_e2e::cfg::{Cfg, Keys};
use drumline_e2e::{adhoc, setup, unused_port, wait_until, TestEnv};
use serde_json::Value;
use std::time::Duration;

fn inspect(env: &TestEnv, path: &str, key: &str) -> (i32, Value) {
    let (status, out, _) = env.run("drumline", &["--config", path, "inspect", key, "--json"]);
    (
        status.code().unwrap_or(-1),
        serde_json::from_str(&out).unwrap_or(Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_keys_fate_is_told_by_command_and_api() {
    let env = setup("inspect_key");
    let append = Keys::default().with("command", &env.append_key_command("effects", 0.0));
    let fail = Keys::default()
        .with("command", "[\"/bin/sh\", \"-c\", \"exit 3\"]")
        .with("permanent_exit_codes", "[3]");
    let path = env.write_config(
        "drumline.toml",
        &Cfg::new().task("ok", append).task("bad", fail),
    );
    let path = path.to_str().expect("utf-8");
    let worker = env.worker("worker", &["--config", path]);
    env.wait_for_topology(&worker).await;
    env.publish(&adhoc("k-ok", "ok")).await;
    env.publish(&adhoc("k-bad", "bad")).await;
    let ended = wait_until(Duration::from_secs(30), || {
        inspect(&env, path, "k-ok").1["state"] == "done"
            && inspect(&env, path, "k-bad").1["state"] == "dead"
    });
    assert!(
        ended,
        "{:?}\n{}",
        inspect(&env, path, "k-bad"),
        worker.log_tail(20)
    );
    let (code, ok) = inspect(&env, path, "k-ok");
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
    let (_, bad) = inspect(&env, path, "k-bad");
    assert!(
        bad["dead_letter"].is_object() && bad["state"] == "dead",
        "{bad}"
    );
    let (code, unknown) = inspect(&env, path, "never-seen");
    assert_eq!(
        (code, unknown),
        (
            1,
            serde_json::json!({"key": "never-seen", "state": "unknown"})
        )
    );

    let port = unused_port();
    let addr = format!("127.0.0.1:{port}");
    let beat = env.beat_with_env(
        "beat",
        &["--config", path, "--api-addr", &addr],
        &[("DRUMLINE_API_TOKEN", "t")],
    );
    assert!(
        wait_until(Duration::from_secs(30), || std::net::TcpStream::connect(
            &addr
        )
        .is_ok()),
        "{}",
        beat.log_tail(20)
    );
    let get = |key: &str| {
        let answer = drumline_e2e::http_with(
            port,
            "GET",
            &format!("/api/v1/keys/{key}"),
            &[("Authorization", "Bearer t")],
        );
        answer.map(|(status, body)| {
            (
                status,
                serde_json::from_str::<Value>(&body).unwrap_or(Value::Null),
            )
        })
    };
    let (status, body) = get("k-ok").expect("an answer");
    assert_eq!((status, &body["state"]), (200, &Value::from("done")));
    assert_eq!(get("never-seen").map(|(s, _)| s), Some(404));
}
