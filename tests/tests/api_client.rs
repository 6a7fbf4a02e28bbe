//! The Rust client's `Schedules` (docs/api.md) against a real beat's API and Redis: apply,
//! get, list by label, delete, and the refusals it hands back typed.

use drumline_e2e::cfg::{cron, shell, Cfg};
use drumline_e2e::{setup, unused_port, wait_until};
use drumline_shared::client::{Applied, ScheduleError, Schedules};
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread")]
async fn the_rust_client_applies_reads_lists_and_deletes_schedules() {
    let env = setup("api_client");
    let cfg = Cfg::new()
        .task("report", shell("true"))
        .job("nightly", cron("0 3 * * *").with("task", "\"report\""));
    let path = env.write_config("drumline.toml", &cfg);
    let port = unused_port();
    let addr = format!("127.0.0.1:{port}");
    let args = [
        "--config",
        path.to_str().expect("utf-8"),
        "--api-addr",
        &addr,
    ];
    let beat = env.beat_with_env("beat", &args, &[("DRUMLINE_API_TOKEN", "t0k")]);
    let up = wait_until(Duration::from_secs(30), || {
        std::net::TcpStream::connect(&addr).is_ok()
    });
    assert!(up, "no API\n{}", beat.log_tail(20));
    let schedules = Schedules::new(&format!("http://{addr}"), "t0k").expect("a client");

    let report = json!({"task": "report", "every": "1h", "labels": {"tenant": "acme"}});
    assert_eq!(
        schedules.apply("acme", &report).await.expect("apply"),
        Applied::Created
    );
    assert_eq!(
        schedules.apply("acme", &report).await.expect("apply"),
        Applied::Replaced
    );
    let stored = schedules.get("acme").await.expect("get").expect("stored");
    assert_eq!(
        (
            stored["every"].as_str(),
            stored["next"].as_array().map(Vec::len)
        ),
        (Some("1h"), Some(3))
    );
    let acme = schedules
        .list(Some(("tenant", "acme")))
        .await
        .expect("list");
    assert_eq!(acme.len(), 1);
    let all = schedules.list(None).await.expect("list");
    assert_eq!(all.len(), 2, "the config's job and the schedule: {all:?}");
    match schedules.apply("nightly", &report).await {
        Err(ScheduleError::Refused {
            status: 409, field, ..
        }) => assert_eq!(field.as_deref(), Some("name")),
        other => panic!("a config name was not refused: {other:?}"),
    }
    let wrong = Schedules::new(&format!("http://{addr}"), "nope").expect("a client");
    assert!(matches!(
        wrong.get("acme").await,
        Err(ScheduleError::Unauthorized)
    ));
    assert!(schedules.delete("acme").await.expect("delete"));
    assert!(!schedules.delete("acme").await.expect("delete"));
    assert_eq!(schedules.get("acme").await.expect("get"), None);
}
