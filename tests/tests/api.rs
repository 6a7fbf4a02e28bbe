//! The beat's HTTP API (docs/api.md), end to end with the real `drumline-beat` and Redis: the
//! bearer token, each answer's status and body checked against `docs/api.openapi.json`, and a
//! beat given `--api-addr` without its token refusing to start.

use drumline_e2e::cfg::{cron, shell, Cfg};
use drumline_e2e::{setup, unused_port, wait_until, Proc, TestEnv};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

const TOKEN: &str = "s3cret-token";

/// The config (task `report`, file job `nightly`) and a beat serving the API on a fresh port.
fn beat_with_api(env: &TestEnv) -> (Proc, u16) {
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
    let beat = env.beat_with_env("beat", &args, &[("DRUMLINE_API_TOKEN", TOKEN)]);
    let up = wait_until(Duration::from_secs(30), || {
        request(port, "GET", "/api/v1/schedules", None, "").is_some()
    });
    assert!(up, "the API never answered\n{}", beat.log_tail(20));
    (beat, port)
}

/// One request with `token` (none: no header) and `body`: (status, content type, JSON body).
fn request(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Option<(u16, String, Value)> {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    stream.write_all(format!("{head}{body}").as_bytes()).ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let status = answer.split(' ').nth(1)?.parse().ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    let content_type = head.lines().find_map(|l| {
        l.to_ascii_lowercase()
            .strip_prefix("content-type: ")
            .map(str::to_owned)
    });
    Some((
        status,
        content_type.unwrap_or_default(),
        serde_json::from_str(body).unwrap_or(Value::Null),
    ))
}

/// `request` with the right token, checked against schema `component` of the OpenAPI document
/// (none: an empty body).
fn call(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
    status: u16,
    component: Option<&str>,
) -> Value {
    let (got, content_type, answer) =
        request(port, method, path, Some(TOKEN), body).expect("an answer");
    assert_eq!(got, status, "{method} {path}: {answer}");
    if let Some(component) = component {
        assert_eq!(content_type, "application/json", "{method} {path}");
        assert_valid(component, &answer);
    }
    answer
}

fn assert_valid(component: &str, answer: &Value) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/api.openapi.json");
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("doc")).expect("json");
    let schema = json!({"$ref": format!("#/components/schemas/{component}"), "components": doc["components"]});
    let validator = jsonschema::validator_for(&schema).expect("a valid schema");
    let errors: Vec<String> = validator
        .iter_errors(answer)
        .map(|e| format!("{}: {e}", e.instance_path))
        .collect();
    assert!(
        errors.is_empty(),
        "{answer} against {component}: {errors:?}"
    );
}

#[test]
fn the_api_needs_the_token_and_answers_as_documented() {
    let env = setup("api_crud");
    let (_beat, port) = beat_with_api(&env);
    for token in [None, Some("wrong")] {
        let (status, _, body) =
            request(port, "GET", "/api/v1/schedules", token, "").expect("answer");
        assert_eq!(status, 401, "{token:?}");
        assert_valid("ApiError", &body);
    }
    let acme = r#"{"task": "report", "every": "1h", "labels": {"tenant": "acme"}}"#;
    let created = call(
        port,
        "PUT",
        "/api/v1/schedules/acme",
        acme,
        201,
        Some("Schedule"),
    );
    assert_eq!(
        (created["name"].as_str(), created["source"].as_str()),
        (Some("acme"), Some("api"))
    );
    call(
        port,
        "PUT",
        "/api/v1/schedules/acme",
        acme,
        200,
        Some("Schedule"),
    );
    let bad = call(
        port,
        "PUT",
        "/api/v1/schedules/b",
        r#"{"task": "report", "every": "often"}"#,
        400,
        Some("ApiError"),
    );
    assert_eq!(bad["field"], "every");
    let taken = call(
        port,
        "PUT",
        "/api/v1/schedules/nightly",
        acme,
        409,
        Some("ApiError"),
    );
    assert_eq!(taken["field"], "name");
    call(
        port,
        "GET",
        "/api/v1/schedules/acme",
        "",
        200,
        Some("Schedule"),
    );
    call(
        port,
        "GET",
        "/api/v1/schedules/nobody",
        "",
        404,
        Some("ApiError"),
    );
    let page = call(
        port,
        "GET",
        "/api/v1/schedules?label=tenant=acme&limit=10",
        "",
        200,
        Some("SchedulePage"),
    );
    assert_eq!(
        page["schedules"].as_array().map(Vec::len),
        Some(1),
        "{page}"
    );
    call(
        port,
        "GET",
        "/api/v1/schedules?limit=0",
        "",
        400,
        Some("ApiError"),
    );
    call(port, "DELETE", "/api/v1/schedules/acme", "", 204, None);
    call(
        port,
        "DELETE",
        "/api/v1/schedules/acme",
        "",
        404,
        Some("ApiError"),
    );
}

#[test]
fn calendars_are_put_read_and_deleted_through_the_api() {
    let env = setup("api_calendars");
    let (_beat, port) = beat_with_api(&env);
    let body = r#"{"dates": ["*-12-25", "2026-01-01"]}"#;
    let created = call(
        port,
        "PUT",
        "/api/v1/calendars/holidays",
        body,
        201,
        Some("CalendarShown"),
    );
    assert_eq!(created["dates"], json!(["2026-01-01", "*-12-25"]));
    call(
        port,
        "PUT",
        "/api/v1/calendars/holidays",
        body,
        200,
        Some("CalendarShown"),
    );
    let bad = call(
        port,
        "PUT",
        "/api/v1/calendars/x",
        r#"{"dates": ["soon"]}"#,
        400,
        Some("ApiError"),
    );
    assert_eq!(bad["field"], "dates");
    call(
        port,
        "GET",
        "/api/v1/calendars/holidays",
        "",
        200,
        Some("CalendarShown"),
    );
    call(port, "DELETE", "/api/v1/calendars/holidays", "", 204, None);
    call(
        port,
        "GET",
        "/api/v1/calendars/holidays",
        "",
        404,
        Some("ApiError"),
    );
}

#[test]
fn a_beat_with_an_api_address_and_no_token_refuses_to_start() {
    let env = setup("api_no_token");
    let path = env.write_config("drumline.toml", &Cfg::new().task("report", shell("true")));
    let addr = format!("127.0.0.1:{}", unused_port());
    let (status, _, err) = env.run(
        "drumline-beat",
        &[
            "--config",
            path.to_str().expect("utf-8"),
            "--api-addr",
            &addr,
        ],
    );
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("DRUMLINE_API_TOKEN"), "{err}");
}
