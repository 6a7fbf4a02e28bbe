//! The beat's HTTP API (docs/api.md), end to end with the real `drumline-beat` and Redis: the
//! bearer token, each answer's status and body checked against `docs/api.openapi.json`, an
//! ad-hoc task posted and followed to its end, and a beat given `--api-addr` without its token
//! refusing to start.

use chrono::Utc;
use drumline_e2e::cfg::{cron, shell, Cfg};
use drumline_e2e::probe::api_request;
use drumline_e2e::scenario::appends;
use drumline_e2e::{setup, unused_port, wait_until, Proc, TestEnv};
use drumline_shared::envelope::{format_instant, parse_instant};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

const TOKEN: &str = "s3cret-token";

/// The config (task `report`, file job `nightly`) and a beat serving the API on a fresh port.
fn beat_with_api(env: &TestEnv) -> (Proc, u16) {
    let cfg = Cfg::new()
        .task("report", shell("true"))
        .job("nightly", cron("0 3 * * *").with("task", "\"report\""));
    env.beat_with_api(&env.config_file(&cfg), TOKEN)
}

/// `"METHOD PATH"` with the right token: asserts the answer's `status` and, unless
/// `component` is empty (an empty body), its JSON body against that schema of the OpenAPI
/// document.
fn call(port: u16, request: &str, body: &str, status: u16, component: &str) -> Value {
    let (got, content_type, answer) =
        api_request(port, request, Some(TOKEN), body).expect("an answer");
    assert_eq!(got, status, "{request}: {answer}");
    if !component.is_empty() {
        assert_eq!(content_type, "application/json", "{request}");
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
            api_request(port, "GET /api/v1/schedules", token, "").expect("answer");
        assert_eq!(status, 401, "{token:?}");
        assert_valid("ApiError", &body);
    }
    let acme = r#"{"task": "report", "every": "1h", "labels": {"tenant": "acme"}}"#;
    let p = port;
    let created = call(p, "PUT /api/v1/schedules/acme", acme, 201, "Schedule");
    let name_source = (created["name"].as_str(), created["source"].as_str());
    assert_eq!(name_source, (Some("acme"), Some("api")));
    call(p, "PUT /api/v1/schedules/acme", acme, 200, "Schedule");
    let often = r#"{"task": "report", "every": "often"}"#;
    let bad = call(p, "PUT /api/v1/schedules/b", often, 400, "ApiError");
    assert_eq!(bad["field"], "every");
    let taken = call(p, "PUT /api/v1/schedules/nightly", acme, 409, "ApiError");
    assert_eq!(taken["field"], "name");
    call(p, "GET /api/v1/schedules/acme", "", 200, "Schedule");
    call(p, "GET /api/v1/schedules/nobody", "", 404, "ApiError");
    let labelled = "GET /api/v1/schedules?label=tenant=acme&limit=10";
    let page = call(p, labelled, "", 200, "SchedulePage");
    let listed = page["schedules"].as_array().map(Vec::len);
    assert_eq!(listed, Some(1), "{page}");
    call(p, "GET /api/v1/schedules?limit=0", "", 400, "ApiError");
    call(p, "DELETE /api/v1/schedules/acme", "", 204, "");
    call(p, "DELETE /api/v1/schedules/acme", "", 404, "ApiError");
}

#[test]
fn calendars_are_put_read_and_deleted_through_the_api() {
    let env = setup("api_calendars");
    let (_beat, p) = beat_with_api(&env);
    let (put, get) = (
        "PUT /api/v1/calendars/holidays",
        "GET /api/v1/calendars/holidays",
    );
    let body = r#"{"dates": ["*-12-25", "2026-01-01"]}"#;
    let created = call(p, put, body, 201, "CalendarShown");
    assert_eq!(created["dates"], json!(["2026-01-01", "*-12-25"]));
    call(p, put, body, 200, "CalendarShown");
    let soon = r#"{"dates": ["soon"]}"#;
    let bad = call(p, "PUT /api/v1/calendars/x", soon, 400, "ApiError");
    assert_eq!(bad["field"], "dates");
    call(p, get, "", 200, "CalendarShown");
    call(p, "DELETE /api/v1/calendars/holidays", "", 204, "");
    call(p, get, "", 404, "ApiError");
}

#[test]
fn a_beat_with_an_api_address_and_no_token_refuses_to_start() {
    let env = setup("api_no_token");
    let config = env.config_file(&Cfg::new().task("report", shell("true")));
    let addr = format!("127.0.0.1:{}", unused_port());
    let (code, _, err) = env.beat_cmd(&config, &["--api-addr", &addr]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("DRUMLINE_API_TOKEN"), "{err}");
}

/// `POST /api/v1/tasks` with `not_before` (docs/api.md#tasks): published as `drumline publish`
/// publishes, run by a worker once, not before it; `GET /api/v1/keys/{key}` then says `done`.
/// A bad task, `args` or instant is a 400 naming it; no token, a 401.
// See: issues/36
#[tokio::test(flavor = "multi_thread")]
async fn a_task_posted_with_not_before_runs_after_it_and_its_key_says_done() {
    let env = setup("api_tasks");
    let config = env.config_file(&Cfg::new().task("report", appends(&env, "effects")));
    let _worker = env.worker_ready("worker", &config).await;
    let (_beat, p) = env.beat_with_api(&config, TOKEN);
    let not_before = Utc::now() + chrono::Duration::seconds(2);
    let at = format_instant(not_before);
    let body = json!({"task": "report", "key": "k-api", "args": {"n": 1}, "not_before": at});
    let posted = call(
        p,
        "POST /api/v1/tasks",
        &body.to_string(),
        202,
        "TaskPublished",
    );
    assert_eq!(posted["key"], "k-api");
    let state = || {
        let answer = api_request(p, "GET /api/v1/keys/k-api", Some(TOKEN), "");
        answer.map(|(_, _, body)| body["state"].clone())
    };
    let done = wait_until(Duration::from_secs(60), || state() == Some(json!("done")));
    assert!(done, "{:?}", state());
    let report = call(p, "GET /api/v1/keys/k-api", "", 200, "KeyReport");
    let claims = report["journal"].as_array().expect("journal").iter();
    let mut claimed = claims.filter(|e| e["event"] == "claim");
    let first = claimed
        .next()
        .and_then(|e| e["at"].as_str().and_then(parse_instant));
    assert!(first.is_some_and(|t| t >= not_before), "{report}");
    assert_eq!(env.lines("effects"), vec!["k-api"]);
    let never = r#"{"task": "report", "not_before": "2030-01-01T00:00:00Z",
        "expires_at": "2029-01-01T00:00:00Z"}"#;
    for (body, field) in [
        (r#"{"task": "nope"}"#, "task"),
        (r#"{"task": "report", "args": [1, 2]}"#, "args"),
        (r#"{"task": "report", "not_before": "soon"}"#, "not_before"),
        (never, "expires_at"),
    ] {
        let bad = call(p, "POST /api/v1/tasks", body, 400, "ApiError");
        assert_eq!(bad["field"], field, "{body}");
    }
    let unauthorized = api_request(p, "POST /api/v1/tasks", None, r#"{"task": "report"}"#);
    assert_eq!(unauthorized.map(|(status, ..)| status), Some(401));
}
