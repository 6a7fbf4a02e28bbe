//! The HTTP API every beat serves, leader or standby, at `--api-addr` or `[api] addr`
//! (docs/api.md): schedules created, read, listed and deleted at run time
//! (docs/design.md#schedules-as-data), ad-hoc tasks published as `drumline publish` does, and
//! what became of one key. Every request carries `Authorization: Bearer T`, T the
//! value of the variable `[api] token_env` names; answers are JSON, errors
//! `{"error", "field"}`. [`ApiDoc`] is the OpenAPI document, kept in `docs/api.openapi.json`.

use crate::adhoc;
use crate::schedules::{check, has_labels, shown, shown_config_job, shown_of};
use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use chrono::Utc;
use drumline_shared::client::{ClientError, Producer};
use drumline_shared::config::{Config, RefusalKind};
use drumline_shared::envelope::Envelope;
use drumline_shared::store::{Applied, ObjectKind, Store};
use drumline_shared::trace::{TraceParent, H_TRACEPARENT};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use utoipa::{OpenApi, ToSchema};

/// Schedules a list page holds unless `limit` says otherwise, and at most.
const PAGE: (usize, usize) = (100, 1000);

/// What the handlers share.
pub struct Api {
    config: Arc<Config>,
    store: Store,
    /// `Bearer T`, as the header must read.
    expected: String,
    /// The broker connection `POST /api/v1/tasks` publishes through, opened by the first.
    producer: tokio::sync::OnceCell<Producer>,
}

impl Api {
    /// The API on `config` and `store`, answering requests that carry `token`.
    pub fn new(config: Arc<Config>, store: Store, token: &str) -> Self {
        Api {
            config,
            store,
            expected: format!("Bearer {token}"),
            producer: tokio::sync::OnceCell::new(),
        }
    }

    /// Publishes `env` with confirms, as `drumline publish` does ([`adhoc::publish_with`]), in
    /// the trace of `parent` (the request's `traceparent`) when it has one.
    async fn publish(
        &self,
        env: &Envelope,
        parent: Option<TraceParent>,
    ) -> Result<(), ClientError> {
        let producer = (self.producer)
            .get_or_try_init(|| adhoc::producer(&self.config))
            .await?;
        adhoc::publish_with(producer, env, parent).await
    }
}

/// The API's routes, every one behind the token.
pub fn routes(api: Arc<Api>) -> Router {
    Router::new()
        .route("/api/v1/schedules", get(list_schedules))
        .route(
            "/api/v1/schedules/{name}",
            get(get_schedule).put(put_schedule).delete(delete_schedule),
        )
        .route("/api/v1/keys/{key}", get(get_key))
        .route("/api/v1/tasks", post(post_task))
        .route(
            "/api/v1/calendars/{name}",
            get(get_calendar).put(put_calendar).delete(delete_calendar),
        )
        .layer(middleware::from_fn_with_state(api.clone(), authorize))
        .with_state(api)
}

/// 401 unless the request carries the token (compared in constant time).
async fn authorize(State(api): State<Arc<Api>>, request: Request, next: Next) -> Response {
    let given = request.headers().get(header::AUTHORIZATION);
    let given = given.map(|v| v.as_bytes()).unwrap_or_default();
    if !same(given, api.expected.as_bytes()) {
        return error(StatusCode::UNAUTHORIZED, "a bearer token is required", None);
    }
    next.run(request).await
}

/// Equal bytes, in time that depends on the lengths only.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |d, (x, y)| d | (x ^ y)) == 0
}

/// A JSON answer.
fn reply(status: StatusCode, body: &Value) -> Response {
    let json = [(header::CONTENT_TYPE, "application/json")];
    (status, json, body.to_string()).into_response()
}

/// An error answer, `{"error", "field"}`.
fn error(status: StatusCode, message: &str, field: Option<&str>) -> Response {
    let mut body = json!({ "error": message });
    if let Some(field) = field {
        body["field"] = field.into();
    }
    reply(status, &body)
}

fn store_error(e: impl std::fmt::Display) -> Response {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        &format!("redis: {e}"),
        None,
    )
}

/// Create or replace a schedule.
#[utoipa::path(put, path = "/api/v1/schedules/{name}", tag = "schedules",
    params(("name" = String, Path, description = "The schedule's name")),
    request_body(content = ScheduleInput, description = "The schedule; `name` may be omitted"),
    responses(
        (status = 201, description = "Created", body = Schedule),
        (status = 200, description = "Replaced or unchanged", body = Schedule),
        (status = 400, description = "Not a valid schedule", body = ApiError),
        (status = 401, description = "No or a wrong bearer token", body = ApiError),
        (status = 409, description = "A job of the config file has the name", body = ApiError)),
    security(("bearer" = [])))]
async fn put_schedule(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    put_object(&api, (ObjectKind::Schedule, &name), &body).await
}

/// Creates or replaces object `name` of `kind` from `body`; answers with it as stored.
async fn put_object(api: &Api, (kind, name): (ObjectKind, &str), body: &[u8]) -> Response {
    let object: Value = match serde_json::from_slice(body) {
        Ok(object) => object,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("not JSON: {e}"), None),
    };
    let mut object = object;
    if let Some(keys) = object.as_object_mut() {
        keys.entry("name").or_insert_with(|| name.into());
    }
    let checked = match check(&api.config, kind, object) {
        Ok((given, _)) if given != name => {
            let message = format!("{given:?} differs from the name addressed, {name:?}");
            return error(StatusCode::BAD_REQUEST, &message, Some("name"));
        }
        Ok(checked) => checked,
        Err(r) if r.kind == RefusalKind::ConfigName => {
            return error(StatusCode::CONFLICT, &r.message, r.field.as_deref())
        }
        Err(r) => return error(StatusCode::BAD_REQUEST, &r.message, r.field.as_deref()),
    };
    let now = Utc::now().timestamp_millis();
    let applied = match api.store.put_objects(kind, &[checked], now).await {
        Ok(applied) => applied,
        Err(e) => return store_error(e),
    };
    let status = match applied.first() {
        Some(Applied::Created) => StatusCode::CREATED,
        _ => StatusCode::OK,
    };
    match read_shown(api, kind, name).await {
        Ok(Some(shown)) => reply(status, &shown),
        Ok(None) => error(StatusCode::CONFLICT, "deleted meanwhile", None),
        Err(response) => response,
    }
}

/// The stored object `name` of `kind` as shown, `None` when there is none.
async fn read_shown(api: &Api, kind: ObjectKind, name: &str) -> Result<Option<Value>, Response> {
    let stored = api.store.object(kind, name).await;
    let stored = stored.map_err(store_error)?;
    Ok(stored.and_then(|s| shown_of(&api.config, kind, &s, Utc::now())))
}

/// One schedule.
#[utoipa::path(get, path = "/api/v1/schedules/{name}", tag = "schedules",
    params(("name" = String, Path, description = "The schedule's name")),
    responses(
        (status = 200, description = "The schedule", body = Schedule),
        (status = 401, description = "No or a wrong bearer token", body = ApiError),
        (status = 404, description = "No such schedule", body = ApiError)),
    security(("bearer" = [])))]
async fn get_schedule(State(api): State<Arc<Api>>, Path(name): Path<String>) -> Response {
    get_object(&api, ObjectKind::Schedule, &name).await
}

/// Answers with object `name` of `kind`, 404 when there is none.
async fn get_object(api: &Api, kind: ObjectKind, name: &str) -> Response {
    match read_shown(api, kind, name).await {
        Ok(Some(shown)) => reply(StatusCode::OK, &shown),
        Ok(None) => not_found(kind, name),
        Err(response) => response,
    }
}

fn not_found(kind: ObjectKind, name: &str) -> Response {
    let what = &kind.as_str()[..kind.as_str().len() - 1];
    error(StatusCode::NOT_FOUND, &format!("no {what} {name:?}"), None)
}

/// Delete a schedule: it publishes nothing more (runs in flight finish).
#[utoipa::path(delete, path = "/api/v1/schedules/{name}", tag = "schedules",
    params(("name" = String, Path, description = "The schedule's name")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 401, description = "No or a wrong bearer token", body = ApiError),
        (status = 404, description = "No such schedule", body = ApiError)),
    security(("bearer" = [])))]
async fn delete_schedule(State(api): State<Arc<Api>>, Path(name): Path<String>) -> Response {
    delete_object(&api, ObjectKind::Schedule, &name).await
}

/// Deletes object `name` of `kind`: 204, or 404 when there was none.
async fn delete_object(api: &Api, kind: ObjectKind, name: &str) -> Response {
    match api.store.delete_objects(kind, &[name]).await {
        Ok(gone) if gone.first() == Some(&true) => StatusCode::NO_CONTENT.into_response(),
        Ok(_) => not_found(kind, name),
        Err(e) => store_error(e),
    }
}

/// What became of one key, scheduled or ad hoc (what `drumline inspect KEY --json` prints).
#[utoipa::path(get, path = "/api/v1/keys/{key}", tag = "keys",
    params(("key" = String, Path, description = "The idempotency key")),
    responses(
        (status = 200, description = "What drumline knows of it", body = KeyReport),
        (status = 401, description = "No or a wrong bearer token", body = ApiError),
        (status = 404, description = "No trace of it", body = KeyReport)),
    security(("bearer" = [])))]
async fn get_key(State(api): State<Arc<Api>>, Path(key): Path<String>) -> Response {
    match crate::inspect::read(&api.store, &key).await {
        Ok(known) => {
            let report = crate::inspect::report(&key, &known);
            match report["state"] == "unknown" {
                true => reply(StatusCode::NOT_FOUND, &report),
                false => reply(StatusCode::OK, &report),
            }
        }
        Err(e) => store_error(e),
    }
}

/// Publish an ad-hoc task, as `drumline publish` does: answered once the broker confirmed it.
#[utoipa::path(post, path = "/api/v1/tasks", tag = "tasks",
    request_body(content = TaskInput, description = "The task"),
    responses(
        (status = 202, description = "Published (the broker confirmed it)", body = TaskPublished),
        (status = 400, description = "Not a valid task; `field` names the key", body = ApiError),
        (status = 401, description = "No or a wrong bearer token", body = ApiError),
        (status = 503, description = "The broker did not take it", body = ApiError)),
    security(("bearer" = [])))]
async fn post_task(State(api): State<Arc<Api>>, headers: HeaderMap, body: Bytes) -> Response {
    let body: Value = match serde_json::from_slice(&body) {
        Ok(body) => body,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("not JSON: {e}"), None),
    };
    let request = adhoc::from_json(&body);
    let env = request.and_then(|r| adhoc::envelope(&api.config, &r, Utc::now()));
    let env = match env {
        Ok(env) => env,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e.to_string(), e.field()),
    };
    // The request's trace continues (docs/envelope.md#trace-context).
    let parent = headers
        .get(H_TRACEPARENT)
        .and_then(|v| v.to_str().ok()?.parse().ok());
    match api.publish(&env, parent).await {
        Ok(()) => reply(StatusCode::ACCEPTED, &json!({ "key": env.key })),
        Err(e) if e.is_request() => error(StatusCode::BAD_REQUEST, &e.to_string(), e.field()),
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("broker: {e}"),
            None,
        ),
    }
}

/// Create or replace a calendar (`{"dates": [...]}`); the config file's cannot be.
#[utoipa::path(put, path = "/api/v1/calendars/{name}", tag = "calendars",
    params(("name" = String, Path, description = "The calendar's name")),
    request_body(content = CalendarInput, description = "The calendar; `name` may be omitted"),
    responses(
        (status = 201, description = "Created", body = CalendarShown),
        (status = 200, description = "Replaced or unchanged", body = CalendarShown),
        (status = 400, description = "Not a valid calendar", body = ApiError),
        (status = 401, description = "No or a wrong bearer token", body = ApiError),
        (status = 409, description = "A calendar of the config file has the name", body = ApiError)),
    security(("bearer" = [])))]
async fn put_calendar(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    put_object(&api, (ObjectKind::Calendar, &name), &body).await
}

/// One calendar.
#[utoipa::path(get, path = "/api/v1/calendars/{name}", tag = "calendars",
    params(("name" = String, Path, description = "The calendar's name")),
    responses(
        (status = 200, description = "The calendar", body = CalendarShown),
        (status = 401, description = "No or a wrong bearer token", body = ApiError),
        (status = 404, description = "No such calendar", body = ApiError)),
    security(("bearer" = [])))]
async fn get_calendar(State(api): State<Arc<Api>>, Path(name): Path<String>) -> Response {
    get_object(&api, ObjectKind::Calendar, &name).await
}

/// Delete a calendar: the jobs that exclude it skip its dates no more.
#[utoipa::path(delete, path = "/api/v1/calendars/{name}", tag = "calendars",
    params(("name" = String, Path, description = "The calendar's name")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 401, description = "No or a wrong bearer token", body = ApiError),
        (status = 404, description = "No such calendar", body = ApiError)),
    security(("bearer" = [])))]
async fn delete_calendar(State(api): State<Arc<Api>>, Path(name): Path<String>) -> Response {
    delete_object(&api, ObjectKind::Calendar, &name).await
}

/// A page of schedules: the config's jobs first (`source` `config`, on the first page when no
/// label is asked for), then the stored ones.
#[utoipa::path(get, path = "/api/v1/schedules", tag = "schedules",
    params(
        ("label" = Option<String>, Query, description = "K=V: only schedules with this label"),
        ("limit" = Option<usize>, Query, description = "About this many stored schedules (default 100, at most 1000)"),
        ("cursor" = Option<String>, Query, description = "The `next_cursor` of the page before")),
    responses(
        (status = 200, description = "A page", body = SchedulePage),
        (status = 400, description = "A bad parameter", body = ApiError),
        (status = 401, description = "No or a wrong bearer token", body = ApiError)),
    security(("bearer" = [])))]
async fn list_schedules(
    State(api): State<Arc<Api>>,
    Query(query): Query<Vec<(String, String)>>,
) -> Response {
    let asked = match ListQuery::parse(&query) {
        Ok(asked) => asked,
        Err((field, message)) => return error(StatusCode::BAD_REQUEST, &message, Some(field)),
    };
    let page = api
        .store
        .objects_page(ObjectKind::Schedule, asked.cursor, asked.limit);
    let (next, page) = match page.await {
        Ok(page) => page,
        Err(e) => return store_error(e),
    };
    let mut rows: Vec<Value> = match asked.cursor == 0 && asked.labels.is_empty() {
        true => api.config.jobs.iter().map(shown_config_job).collect(),
        false => Vec::new(),
    };
    let now = Utc::now();
    let stored = page.iter().filter_map(|s| shown(&api.config, s, now));
    rows.extend(stored.filter(|o| has_labels(o, &asked.labels)));
    let next = (next != 0).then(|| next.to_string());
    reply(
        StatusCode::OK,
        &json!({"schedules": rows, "next_cursor": next}),
    )
}

/// A list request's parameters.
#[derive(Debug, PartialEq)]
struct ListQuery {
    labels: Vec<(String, String)>,
    limit: usize,
    cursor: u64,
}

impl ListQuery {
    fn parse(query: &[(String, String)]) -> Result<Self, (&'static str, String)> {
        let mut asked = ListQuery {
            labels: Vec::new(),
            limit: PAGE.0,
            cursor: 0,
        };
        for (key, value) in query {
            let bad = |what: &str| format!("{value:?} is not {what}");
            match key.as_str() {
                "label" => asked
                    .labels
                    .push(crate::schedules::parse_label(value).map_err(|m| ("label", m))?),
                "limit" => match value.parse() {
                    Ok(n) if (1..=PAGE.1).contains(&n) => asked.limit = n,
                    _ => return Err(("limit", bad("a number from 1 to 1000"))),
                },
                "cursor" => {
                    asked.cursor = value.parse().map_err(|_| ("cursor", bad("a cursor")))?
                }
                _ => return Err(("query", format!("unknown parameter {key:?}"))),
            }
        }
        Ok(asked)
    }
}

/// A refused request.
#[derive(ToSchema)]
pub struct ApiError {
    /// What is wrong.
    pub error: String,
    /// The offending key, when one is.
    pub field: Option<String>,
}

/// A schedule as applied: the keys of a `[[jobs]]` table (docs/configuration.md) plus `labels`.
/// Exactly one of `every` and `cron`.
#[derive(ToSchema)]
pub struct ScheduleInput {
    /// The name; optional in a PUT (the path names it), equal to the path's when given.
    pub name: Option<String>,
    /// The `[tasks.NAME]` it runs.
    pub task: String,
    /// Due every this long (`"30s"`, `"1h"`), anchored to the epoch.
    pub every: Option<String>,
    /// A cron expression (5 or 6 fields).
    pub cron: Option<String>,
    /// The zone `cron` is read in (default UTC).
    pub timezone: Option<String>,
    /// Handed to the task.
    pub args: Option<BTreeMap<String, serde_json::Value>>,
    /// Logical queue (default `default`).
    pub queue: Option<String>,
    /// Not run after this long past its instant.
    pub expires: Option<String>,
    /// `skip` (default), `queue` or `allow`.
    pub overlap: Option<String>,
    /// `run_once` (default), `skip` or `catch_up`.
    pub misfire: Option<String>,
    /// Missed instants older than this are never published (default 1h).
    pub misfire_grace: Option<String>,
    /// Most missed instants `catch_up` publishes (default 100).
    pub max_catch_up: Option<i64>,
    /// Each instant is published a fixed offset in `[0, jitter)` late.
    pub jitter: Option<String>,
    /// `every`'s anchor (RFC 3339).
    pub anchor: Option<String>,
    /// Free-form labels, for `label=K=V` filters.
    pub labels: Option<BTreeMap<String, String>>,
}

/// A stored schedule as shown: what was applied plus where it came from, when, and what is
/// next. Config jobs in a list carry `schedule` (the rule) and `source` `config` instead.
#[derive(ToSchema)]
pub struct Schedule {
    /// The name.
    pub name: String,
    /// `api` (applied at run time) or `config` (the file).
    pub source: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// The task.
    pub task: String,
    /// When created (RFC 3339; stored schedules only).
    pub created_at: Option<String>,
    /// When last changed (RFC 3339; stored schedules only).
    pub updated_at: Option<String>,
    /// The next three instants (RFC 3339, UTC; stored schedules only).
    pub next: Option<Vec<String>>,
}

/// What became of one key.
#[derive(ToSchema)]
pub struct KeyReport {
    /// The key.
    pub key: String,
    /// `queued`, `running`, `retrying`, `done`, `dead`, `expired`, `skipped`, or `unknown`
    /// (then nothing else is given).
    pub state: String,
    /// The attempt (0 first).
    pub attempt: Option<u64>,
    /// The fencing token of its last claim.
    pub fencing_token: Option<u64>,
    /// The worker of its last claim.
    pub worker: Option<String>,
    /// When its run record last changed (RFC 3339).
    pub updated_at: Option<String>,
    /// Its last run's error, when it failed.
    pub error: Option<String>,
    /// `{"reason"}` when dead-lettered.
    pub dead_letter: Option<BTreeMap<String, Option<String>>>,
    /// Its journal entries, oldest first: `{at, event, attempt, worker, reason}`.
    pub journal: Option<Vec<BTreeMap<String, serde_json::Value>>>,
}

/// An ad-hoc task to publish: what `drumline publish` takes. Give at most one of `delay` and
/// `not_before`, and of `expires` and `expires_at`.
#[derive(ToSchema)]
pub struct TaskInput {
    /// The `[tasks.NAME]` it runs.
    pub task: String,
    /// Handed to the task (default `{}`).
    pub args: Option<BTreeMap<String, serde_json::Value>>,
    /// The idempotency key (default: a fresh UUID): at most one run succeeds per key.
    pub key: Option<String>,
    /// Logical queue (default `default`).
    pub queue: Option<String>,
    /// Due this long after now (`"30s"`): sets `not_before`.
    pub delay: Option<String>,
    /// Not started before this instant (RFC 3339); one past runs at once.
    pub not_before: Option<String>,
    /// Not run later than this long after it is due (`"10m"`).
    pub expires: Option<String>,
    /// Not run after this instant (RFC 3339), which must be after `not_before`.
    pub expires_at: Option<String>,
}

/// A published task.
#[derive(ToSchema)]
pub struct TaskPublished {
    /// Its idempotency key: `GET /api/v1/keys/{key}` tells what became of it.
    pub key: String,
}

/// A calendar as applied.
#[derive(ToSchema)]
pub struct CalendarInput {
    /// The name; optional in a PUT (the path names it), equal to the path's when given.
    pub name: Option<String>,
    /// `YYYY-MM-DD` (that day) or `*-MM-DD` (that day every year).
    pub dates: Vec<String>,
}

/// A stored calendar as shown.
#[derive(ToSchema)]
pub struct CalendarShown {
    /// The name.
    pub name: String,
    /// Its dates, `YYYY-MM-DD` first, then `*-MM-DD`.
    pub dates: Vec<String>,
    /// `api`.
    pub source: String,
    /// When created (RFC 3339).
    pub created_at: String,
    /// When last changed (RFC 3339).
    pub updated_at: String,
}

/// A page of `GET /api/v1/schedules`.
#[derive(ToSchema)]
pub struct SchedulePage {
    /// The schedules.
    pub schedules: Vec<Schedule>,
    /// The cursor of the next page; null on the last.
    pub next_cursor: Option<String>,
}

/// The OpenAPI document of the API (`docs/api.openapi.json`).
#[derive(OpenApi)]
#[openapi(
    info(title = "drumline API", description = "Schedules and calendars at run time, ad-hoc tasks and what became of them (docs/api.md)."),
    paths(put_schedule, get_schedule, delete_schedule, list_schedules, put_calendar, get_calendar,
        delete_calendar, get_key, post_task),
    components(schemas(ApiError, ScheduleInput, Schedule, SchedulePage, CalendarInput,
        CalendarShown, KeyReport, TaskInput, TaskPublished)),
    modifiers(&Bearer))]
pub struct ApiDoc;

/// Adds the bearer token scheme.
struct Bearer;

impl utoipa::Modify for Bearer {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
        let scheme = SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer));
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme("bearer", scheme);
    }
}

/// Serves the API at `addr` (or `[api] addr`) in the background, when either is given; refused
/// (exit 2) when the variable `[api] token_env` names is unset or empty. `store` connects to
/// Redis, only when the API is served.
pub async fn serve(
    config: &Arc<Config>,
    addr: Option<std::net::SocketAddr>,
    store: impl std::future::Future<Output = Result<Store, drumline_shared::exit::Failure>>,
) -> Result<(), drumline_shared::exit::Failure> {
    use drumline_shared::exit::Failure;
    let Some(addr) = addr.or(config.api.addr) else {
        return Ok(());
    };
    let var = &config.api.token_env;
    let token = std::env::var(var)
        .ok()
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            Failure::usage(format!(
                "the API at {addr} needs its bearer token in ${var} (unset)"
            ))
        })?;
    let store = store.await?;
    let app = routes(Arc::new(Api::new(config.clone(), store, &token)));
    drumline_shared::metrics::serve_router(addr, app, "the API at /api/v1")
        .await
        .map_err(|e| Failure::usage(format!("--api-addr {addr}: {e}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The document in docs/ is this code's: `DRUMLINE_WRITE_OPENAPI=1 cargo test -p
    /// drumline-ops --lib api` writes it anew.
    #[test]
    fn the_openapi_document_in_docs_is_the_codes() {
        let doc = ApiDoc::openapi().to_pretty_json().expect("json") + "\n";
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/api.openapi.json");
        if std::env::var_os("DRUMLINE_WRITE_OPENAPI").is_some() {
            std::fs::write(path, &doc).expect("write");
        }
        let kept = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            kept == doc,
            "docs/api.openapi.json is stale: run with DRUMLINE_WRITE_OPENAPI=1"
        );
        assert!(doc.contains("\"openapi\": \"3.1.0\""));
    }

    #[test]
    fn list_parameters_are_checked() {
        let q = |pairs: &[(&str, &str)]| {
            let pairs: Vec<(String, String)> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            ListQuery::parse(&pairs)
        };
        let asked = q(&[("label", "t=a"), ("limit", "5"), ("cursor", "7")]).expect("ok");
        assert_eq!(
            asked,
            ListQuery {
                labels: vec![("t".into(), "a".into())],
                limit: 5,
                cursor: 7
            }
        );
        assert_eq!(q(&[("limit", "0")]).unwrap_err().0, "limit");
        assert_eq!(q(&[("limit", "1001")]).unwrap_err().0, "limit");
        assert_eq!(q(&[("cursor", "x")]).unwrap_err().0, "cursor");
        assert_eq!(q(&[("label", "x")]).unwrap_err().0, "label");
        assert_eq!(q(&[("sort", "x")]).unwrap_err().0, "query");
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same(b"Bearer abc", b"Bearer abc"));
        assert!(!same(b"Bearer ab", b"Bearer abc") && !same(b"Bearer abd", b"Bearer abc"));
    }
}
