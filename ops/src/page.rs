//! The status page on the beat's `--metrics-addr` (docs/design.md "Status page"): `/`, the
//! `status` report as HTML that refreshes itself, and `/api/status`, the `status --json`
//! document: `GET` (and `HEAD`) only, nothing written. With the API token set the page also
//! offers actions (`actions.rs`: their buttons, script and `POST` routes); without it, it is
//! read-only and has no JavaScript. Each job's row carries its strip of recent instants
//! (`strip.rs`), each cell a link to `/keys/{key}`, what `inspect KEY` shows, as HTML.
//! Every request builds the report afresh with the code `status` uses
//! ([`status::read_window`]), within [`PAGE_WAIT`]: a stuck Redis makes a 503 with the reason,
//! never a hung page. On SIGHUP the page re-reads the config file as the scheduler does and
//! shows the reloaded `[[jobs]]` (a file that does not load leaves it on the jobs it had; the
//! scheduler logs why).
//!
//! Bounded work for every request (docs/design.md#bounded-work): one Redis connection and one
//! broker connection ([`DeadLetters`], its count cached for 5 s) shared by all requests; at
//! most [`MAX_RENDERS`] reports built at once, a request beyond them answered 503 with
//! `Retry-After: 1` at once; at most `limit` jobs listed ([`Window`]); one journal read of at
//! most [`strip::JOURNAL_ENTRIES`] entries per page or key page, never a scan.

use crate::actions::{self, Actions};
use crate::dead_letters::DeadLetters;
use crate::status::{self, JobStatus, Status};
use crate::strip::{self, Cell};
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use chrono::{DateTime, Utc};
use drumline_shared::config::Config;
use drumline_shared::envelope::parse_instant;
use drumline_shared::signals::Hangups;
use drumline_shared::store::{Store, StoreError};
use std::fmt::Write;
use std::future::Future;
use std::ops::Range;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::{OnceCell, Semaphore};

/// How long a request waits for the report before answering 503. Longer than `status`' own
/// wait for the broker (which only leaves the dead letters unknown), so only Redis trips it.
pub const PAGE_WAIT: Duration = Duration::from_secs(4);

/// The page's `<meta http-equiv="refresh">`, in seconds.
pub const REFRESH_SECONDS: u32 = 5;

/// Most requests of `/` and `/api/status` (together) being answered at once; another one is
/// answered 503 with `Retry-After: 1` at once.
pub const MAX_RENDERS: usize = 4;

/// Jobs listed when the request does not say `limit`.
pub const DEFAULT_LIMIT: usize = 500;

/// Most jobs one request lists, whatever its `limit`.
pub const MAX_LIMIT: usize = 1000;

/// What the handlers share: the config (its jobs replaced on SIGHUP), one Redis connection,
/// made at the first request (and tried again at the next one if that failed), the cached
/// dead-letter count with its broker connection, and the render slots.
#[derive(Clone)]
struct Page {
    /// Whether the page offers the actions ([`actions`]).
    acts: bool,
    config: Arc<RwLock<Arc<Config>>>,
    store: Arc<OnceCell<Store>>,
    dead_letters: Arc<DeadLetters>,
    renders: Arc<Semaphore>,
}

impl Page {
    /// The config now (never held across an await).
    fn config(&self) -> Arc<Config> {
        self.config.read().expect("page config lock").clone()
    }
}

/// The routes `/` and `/api/status` for `config`, to hand to
/// [`drumline_shared::metrics::serve_with`]; starts following SIGHUP (call it inside the
/// runtime). `dead_letters` is the one broker connection the page reads counts through, shared
/// with the queue gauges.
pub fn routes(config: Arc<Config>, dead_letters: Arc<DeadLetters>) -> Router {
    let acting = Actions::of(&config);
    let page = Page {
        acts: acting.is_some(),
        dead_letters,
        config: Arc::new(RwLock::new(config)),
        store: Arc::new(OnceCell::new()),
        renders: Arc::new(Semaphore::new(MAX_RENDERS)),
    };
    tokio::spawn(follow_reloads(page.config.clone()));
    let router = match acting {
        Some(acting) => actions::routes(acting, page.config.clone(), page.store.clone()),
        None => Router::new(),
    };
    router
        .route("/", get(html_page))
        .route("/api/status", get(api_status))
        .route("/keys/{key}", get(key_page))
        .with_state(page)
}

/// On each SIGHUP, the jobs of the re-read config file. Only `[[jobs]]`: the rest (namespace,
/// Redis, broker) takes a restart of the beat, so the page keeps what it started with, as the
/// scheduler's connections do.
async fn follow_reloads(config: Arc<RwLock<Arc<Config>>>) {
    let mut hangups = Hangups::new();
    loop {
        hangups.recv().await;
        let current = config.read().expect("page config lock").clone();
        match current.reload() {
            Ok((new, _)) => {
                let mut next = (*current).clone();
                next.jobs = new.jobs;
                *config.write().expect("page config lock") = Arc::new(next);
            }
            // The scheduler logs the refusal; the page keeps the jobs it had, as the beat does.
            Err(e) => tracing::debug!(error = %e, "status page: reload refused"),
        }
    }
}

/// Which jobs a request lists: `?offset=N&limit=M` (both optional; other parameters are
/// ignored). `limit` defaults to [`DEFAULT_LIMIT`] and is cut to [`MAX_LIMIT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Position (from 0, config order) of the first job listed.
    pub offset: usize,
    /// Most jobs listed.
    pub limit: usize,
}

impl Default for Window {
    fn default() -> Self {
        Self {
            offset: 0,
            limit: DEFAULT_LIMIT,
        }
    }
}

impl Window {
    /// The window a query string asks for, or why it is refused (a value that is not a
    /// non-negative integer).
    pub fn from_query(query: Option<&str>) -> Result<Self, String> {
        let mut window = Self::default();
        for pair in query.unwrap_or("").split('&') {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let slot = match key {
                "offset" => &mut window.offset,
                "limit" => &mut window.limit,
                _ => continue,
            };
            *slot = value
                .parse()
                .map_err(|_| format!("{key}: {value:?} is not a non-negative integer"))?;
        }
        window.limit = window.limit.min(MAX_LIMIT);
        Ok(window)
    }

    /// The positions listed.
    fn range(self) -> Range<usize> {
        self.offset..self.offset.saturating_add(self.limit)
    }
}

/// The answer to a request that finds all [`MAX_RENDERS`] render slots taken.
fn busy(page: &Page, json: bool) -> Response {
    let reason = format!("busy: {MAX_RENDERS} requests are being answered; retry in 1 s");
    let (content_type, body) = if json {
        (
            "application/json",
            serde_json::json!({ "error": reason }).to_string(),
        )
    } else {
        (
            "text/html; charset=utf-8",
            render_error(&reason, &page.config().namespace, Utc::now()),
        )
    };
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [
            (header::CONTENT_TYPE, content_type),
            (header::RETRY_AFTER, "1"),
        ],
        body,
    )
        .into_response()
}

/// A 400 for a query that does not parse.
fn bad_query(reason: String) -> Response {
    (
        StatusCode::BAD_REQUEST,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        reason,
    )
        .into_response()
}

/// An HTML answer.
fn html(code: StatusCode, body: String) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        body,
    )
        .into_response()
}

/// What `read` found, or why not (Redis failed or did not answer within [`PAGE_WAIT`]).
async fn within_wait<T>(read: impl Future<Output = Result<T, StoreError>>) -> Result<T, String> {
    match tokio::time::timeout(PAGE_WAIT, read).await {
        Ok(Ok(found)) => Ok(found),
        Ok(Err(e)) => Err(format!("redis: {e}")),
        Err(_) => Err(format!("redis: no answer within {} s", PAGE_WAIT.as_secs())),
    }
}

/// The report on `window` now, or why not.
async fn report(page: &Page, window: Window, now: DateTime<Utc>) -> Result<Status, String> {
    let config = &page.config();
    within_wait(async {
        let store = actions::connected(&page.store, config).await?;
        let dead_letters = page.dead_letters.count();
        status::read_window(store, config, window.range(), dead_letters, now).await
    })
    .await
}

/// The report on `window` and its jobs' strips: the report first (its progress read before
/// the journal, as `audit` reads them), then one capped journal read for all of them.
async fn report_with_strips(
    page: &Page,
    window: Window,
    now: DateTime<Utc>,
) -> Result<(Status, Vec<Vec<Cell>>), String> {
    let config = page.config();
    let status = report(page, window, now).await?;
    let entries = within_wait(async {
        let store = actions::connected(&page.store, &config).await?;
        store.journal_newest(strip::JOURNAL_ENTRIES).await
    })
    .await?;
    let recent = strip::Recent::new(entries, strip::JOURNAL_ENTRIES, &config.journal, now);
    let listed = config
        .jobs
        .iter()
        .skip(window.offset)
        .take(status.jobs.len());
    let strips = listed
        .zip(&status.jobs)
        .map(|(job, shown)| {
            if job.name != shown.job {
                return Vec::new(); // a reload between the two reads: drawn at the next render
            }
            // Its progress as `status` shows it: none when no longer an instant of the rule
            // (a reload changed it), so nothing is called missed on the old rule's progress.
            let progress = shown.last_published.as_deref().and_then(parse_instant);
            recent.strip(job, progress, now)
        })
        .collect();
    Ok((status, strips))
}

async fn html_page(State(page): State<Page>, RawQuery(query): RawQuery) -> Response {
    let window = match Window::from_query(query.as_deref()) {
        Ok(window) => window,
        Err(reason) => return bad_query(reason),
    };
    let Ok(_slot) = page.renders.clone().try_acquire_owned() else {
        return busy(&page, false);
    };
    let now = Utc::now();
    let (code, body) = match report_with_strips(&page, window, now).await {
        Ok((status, strips)) => (
            StatusCode::OK,
            render(
                &status,
                &strips,
                window,
                &page.config().namespace,
                now,
                page.acts,
            ),
        ),
        Err(reason) => {
            tracing::warn!(reason = %reason, "status page: no report");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                render_error(&reason, &page.config().namespace, now),
            )
        }
    };
    html(code, body)
}

/// `/keys/{key}`: what `inspect KEY` shows, as HTML (404 when drumline has no trace of it),
/// bounded as the page is: a render slot, [`PAGE_WAIT`], and the journal entries only among
/// its newest [`strip::JOURNAL_ENTRIES`].
async fn key_page(State(page): State<Page>, Path(key): Path<String>) -> Response {
    let Ok(_slot) = page.renders.clone().try_acquire_owned() else {
        return busy(&page, false);
    };
    let (config, now) = (page.config(), Utc::now());
    let read = within_wait(async {
        let store = actions::connected(&page.store, &config).await?;
        crate::inspect::read_newest(store, &key, strip::JOURNAL_ENTRIES).await
    })
    .await;
    let (code, body) = match read {
        Ok(known) => {
            let report = crate::inspect::report(&key, &known);
            let code = match report["state"] == "unknown" {
                true => StatusCode::NOT_FOUND,
                false => StatusCode::OK,
            };
            (code, render_key(&key, &report, &config.namespace, now))
        }
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            render_error(&reason, &config.namespace, now),
        ),
    };
    html(code, body)
}

/// A report's value as shown: text as is, null as a dash, anything else as JSON; escaped.
fn shown_value(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(text) => escape(text),
        serde_json::Value::Null => "–".to_owned(),
        other => escape(&other.to_string()),
    }
}

/// The page of one key: the fields of its `inspect` report, then its journal entries.
pub fn render_key(
    key: &str,
    report: &serde_json::Value,
    namespace: &str,
    now: DateTime<Utc>,
) -> String {
    let mut out = String::with_capacity(2048);
    open(&mut out, namespace, now);
    let _ = writeln!(
        out,
        "<p><a href=\"/\">All jobs</a></p>\n<h2>Key <code id=\"key\">{}</code></h2>\n\
         <table id=\"fields\"><tbody>",
        escape(key)
    );
    let fields = [
        "state",
        "attempt",
        "fencing_token",
        "worker",
        "updated_at",
        "error",
    ];
    for name in fields {
        let _ = writeln!(
            out,
            "<tr><th>{name}</th><td class=\"{name}\">{}</td></tr>",
            shown_value(&report[name])
        );
    }
    let dead = shown_value(&report["dead_letter"]["reason"]);
    let _ = writeln!(
        out,
        "<tr><th>dead letter</th><td class=\"dead_letter\">{dead}</td></tr></tbody></table>\n\
         <h2>Journal</h2>\n<p class=\"ago\">Its entries among the journal's newest {}; \
         <code>drumline inspect KEY</code> reads them all.</p>\n<table id=\"journal\">\
         <thead><tr><th>At</th><th>Event</th><th>Attempt</th><th>Worker</th><th>Reason</th>\
         </tr></thead><tbody>",
        strip::JOURNAL_ENTRIES
    );
    let entries = report["journal"].as_array().map_or(&[][..], Vec::as_slice);
    for e in entries {
        let cells: Vec<String> = ["at", "event", "attempt", "worker", "reason"]
            .iter()
            .map(|f| format!("<td class=\"{f}\">{}</td>", shown_value(&e[*f])))
            .collect();
        let _ = writeln!(out, "<tr class=\"entry\">{}</tr>", cells.concat());
    }
    out.push_str("</tbody></table>\n");
    close(&mut out, false);
    out
}

async fn api_status(State(page): State<Page>, RawQuery(query): RawQuery) -> Response {
    let window = match Window::from_query(query.as_deref()) {
        Ok(window) => window,
        Err(reason) => return bad_query(reason),
    };
    let Ok(_slot) = page.renders.clone().try_acquire_owned() else {
        return busy(&page, true);
    };
    let (code, body) = match report(&page, window, Utc::now()).await {
        Ok(status) => (
            StatusCode::OK,
            serde_json::to_string_pretty(&status).expect("serialisable"),
        ),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({ "error": reason }).to_string(),
        ),
    };
    (code, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// `text` with the five characters that mean something in HTML escaped, for element content
/// and quoted attribute values alike.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;font-size:14px;margin:1.2em;color:#222}\
h1{font-size:1.3em;margin:0 0 .3em}\
p{margin:.15em 0}\
table{border-collapse:collapse;margin-top:.8em}\
th,td{border-bottom:1px solid #ddd;padding:.3em .45em;text-align:left;white-space:nowrap}\
th{background:#f3f3f3}\
td.num{text-align:right}\
.ago{color:#777;font-size:.85em}\
.none{color:#999}\
.warn{color:#a00;font-weight:bold}\
span.flag{font-weight:bold}\
span.flag.paused{color:#a60}\
span.flag.stale{color:#a00}\
tr.stale td{background:#fdecea}\
tr.paused td{background:#fff6e0}\
tr.runs>td{border-bottom:1px solid #ddd;padding:0 .45em .3em 1.5em}\
summary{color:#555;cursor:pointer}\
table.runs{margin:.2em 0 .3em}\
table.runs td{white-space:normal;overflow-wrap:anywhere}\
.outcome.failed,.outcome.dead,.outcome.expired{color:#a00;font-weight:bold}\
footer{margin-top:1em;color:#777;font-size:.85em}";

/// The page's head and heading, down to the opening of the body's content.
fn open(out: &mut String, namespace: &str, now: DateTime<Utc>) {
    let ns = escape(namespace);
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta http-equiv=\"refresh\" content=\"{REFRESH_SECONDS}\">\n\
         <title>drumline status · {ns}</title>\n<style>{STYLE}{strip}</style>\n</head>\n<body>\n\
         <h1>drumline status · namespace <code>{ns}</code></h1>\n\
         <p id=\"generated\">As of <time datetime=\"{t}\">{t}</time>; times in UTC.</p>\n",
        t = escape(&drumline_shared::envelope::format_instant(now)),
        strip = strip::STYLE,
    );
}

/// The footer and the end of the document (`Read-only` unless the page `acts`).
fn close(out: &mut String, acts: bool) {
    let lead = if acts {
        "Refreshes"
    } else {
        "Read-only; refreshes"
    };
    let _ = write!(
        out,
        "<footer>{lead} every {REFRESH_SECONDS} s. \
         The same report as JSON: <a href=\"/api/status\">/api/status</a>; \
         metrics: <a href=\"/metrics\">/metrics</a>.</footer>\n</body>\n</html>\n"
    );
}

/// How far `then` is from `now`, short: "12 s ago", "3 min ago", "2 h ago", "4 d ago", and
/// "in 5 s" for the future (rounded up, so a due instant is never "0 s ago" before it comes).
fn ago(then: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let ms = (now - then).num_milliseconds();
    let secs = if ms < 0 {
        (-ms + 999) / 1000
    } else {
        ms / 1000
    }
    .unsigned_abs();
    let (n, unit) = match secs {
        s if s < 120 => (s, "s"),
        s if s < 2 * 3600 => (s / 60, "min"),
        s if s < 2 * 86_400 => (s / 3600, "h"),
        s => (s / 86_400, "d"),
    };
    if ms < 0 {
        format!("in {n} {unit}")
    } else {
        format!("{n} {unit} ago")
    }
}

/// An instant as shown: the time of day when it falls on `now`'s UTC date, else date and time
/// (to the second; the full RFC 3339 text is in the `<time>` element's `datetime`).
fn short(then: DateTime<Utc>, now: DateTime<Utc>) -> String {
    if then.date_naive() == now.date_naive() {
        then.format("%H:%M:%S").to_string()
    } else {
        then.format("%Y-%m-%d %H:%M:%S").to_string()
    }
}

/// A `<time>` element for `text` (RFC 3339, as in the JSON) and how far from now it is.
fn instant(text: &str, now: DateTime<Utc>) -> String {
    let full = escape(text);
    match parse_instant(text) {
        Some(t) => format!(
            "<time datetime=\"{full}\" title=\"{full}\">{}</time> <span class=\"ago\">({})</span>",
            short(t, now),
            ago(t, now)
        ),
        None => format!("<time>{full}</time>"),
    }
}

/// A cell holding an instant, or a dash.
fn instant_cell(class: &str, value: &Option<String>, now: DateTime<Utc>) -> String {
    match value {
        None => format!("<td class=\"{class}\"><span class=\"none\">–</span></td>"),
        Some(text) => format!("<td class=\"{class}\">{}</td>", instant(text, now)),
    }
}

/// The next-due cell; a jittered job's also says when the leader publishes it.
fn next_cell(job: &JobStatus, now: DateTime<Utc>) -> String {
    let cell = instant_cell("next-due", &job.next_due, now);
    let (Some(due), Some(runs)) = (&job.next_due, &job.next_runs_at) else {
        return cell;
    };
    match (parse_instant(due), parse_instant(runs)) {
        (Some(d), Some(r)) if r > d => {
            let offset = crate::status::offset_text(r - d);
            let runs = format!(
                " <span class=\"runs-at\" title=\"{}\">runs +{offset}</span></td>",
                escape(runs)
            );
            cell.replacen("</td>", &runs, 1)
        }
        _ => cell,
    }
}

/// One job's row, with its strip of recent instants.
fn row(job: &JobStatus, cells: &[Cell], now: DateTime<Utc>, acts: bool) -> String {
    let mut classes = Vec::new();
    if job.paused {
        classes.push("paused");
    }
    if job.stale {
        classes.push("stale");
    }
    let marker = |on: bool, class: &str, text: &str| {
        if on {
            format!("<td class=\"{class}\"><span class=\"flag {class}\">{text}</span></td>")
        } else {
            format!("<td class=\"{class}\"></td>")
        }
    };
    let name = escape(&job.job);
    format!(
        "<tr class=\"job {classes}\" data-job=\"{name}\">\
         <td class=\"name\">{name}</td>\
         <td class=\"schedule\">{schedule}</td>\
         <td class=\"zone\">{zone}</td>\
         <td class=\"recent\">{strip}</td>\
         {next}{published}{success}{failure}\
         <td class=\"running num\">{running}</td>\
         {paused}{stale}{buttons}</tr>\n",
        classes = classes.join(" "),
        schedule = escape(&job.schedule),
        zone = escape(&job.timezone),
        strip = strip::render(cells, escape),
        next = next_cell(job, now),
        published = instant_cell("last-published", &job.last_published, now),
        success = instant_cell("last-success", &job.last_success, now),
        failure = instant_cell("last-failure", &job.last_failure, now),
        running = job.running,
        paused = marker(job.paused, "paused", "PAUSED"),
        stale = marker(job.stale, "stale", "STALE"),
        buttons = if acts {
            buttons(&job.job, job.paused)
        } else {
            String::new()
        },
    )
}

/// A job row's buttons: resume when paused, else pause; trigger.
fn buttons(job: &str, paused: bool) -> String {
    let flip = if paused { "resume" } else { "pause" };
    let job = escape(job);
    format!(
        "<td class=\"actions\"><button data-action=\"{flip}\" data-job=\"{job}\">{flip}</button> \
         <button data-action=\"trigger\" data-job=\"{job}\">trigger</button></td>"
    )
}

/// The row under a job's with its recent runs (docs/design.md#recent-runs) in a `<details>`,
/// open when the last run failed; nothing for a job with none.
fn runs_row(job: &JobStatus, now: DateTime<Utc>) -> String {
    let Some(last) = job.recent.first() else {
        return String::new();
    };
    let failed = matches!(last.outcome.as_str(), "failed" | "dead" | "expired");
    let mut out = format!(
        "<tr class=\"runs\" data-runs-of=\"{name}\"><td colspan=\"11\"><details{open}>\
         <summary>Recent runs ({n}); last: <span class=\"outcome {outcome}\">{outcome}</span>\
         </summary>\n<table class=\"runs\"><thead><tr><th>Key</th><th>Outcome</th>\
         <th>Attempt</th><th>Started</th><th>Duration</th><th>Error</th></tr></thead><tbody>\n",
        name = escape(&job.job),
        open = if failed { " open" } else { "" },
        n = job.recent.len(),
        outcome = escape(&last.outcome),
    );
    for run in &job.recent {
        let _ = writeln!(
            out,
            "<tr class=\"run\" data-key=\"{key}\"><td class=\"key\">{key}</td>\
             <td class=\"outcome {outcome}\">{outcome}</td><td class=\"attempt num\">{attempt}</td>\
             {started}<td class=\"duration num\">{duration}</td>\
             <td class=\"error\">{error}</td></tr>",
            key = escape(&run.key),
            outcome = escape(&run.outcome),
            attempt = run.attempt,
            started = instant_cell("started", &run.started_at, now),
            duration = run
                .duration_ms
                .map_or_else(|| "–".to_owned(), crate::recent::human_duration),
            error = run.error.as_deref().map(escape).unwrap_or_default(),
        );
    }
    out.push_str("</tbody></table></details></td></tr>\n");
    out
}

/// Which jobs of how many are listed, with links to the windows before and after.
fn shown(out: &mut String, status: &Status, window: Window) {
    let listed = status.jobs.len();
    let total = status.total;
    let _ = if listed > 0 {
        write!(
            out,
            "<p id=\"shown\">Jobs {}–{} of {total}",
            window.offset + 1,
            window.offset + listed
        )
    } else {
        write!(
            out,
            "<p id=\"shown\">No jobs listed from {}; {total} in all",
            window.offset + 1
        )
    };
    let limit = window.limit.max(1);
    if window.offset > 0 && total > 0 {
        let before = window.offset.min(total).saturating_sub(limit);
        let _ = write!(
            out,
            " · <a rel=\"prev\" href=\"/?offset={before}&amp;limit={limit}\">previous</a>"
        );
    }
    if window.offset + listed < total && listed > 0 {
        let after = window.offset + listed;
        let _ = write!(
            out,
            " · <a rel=\"next\" href=\"/?offset={after}&amp;limit={limit}\">next</a>"
        );
    }
    out.push_str("</p>\n");
}

/// The status page for `status` of `namespace`, listing `window` of its jobs, as of `now`:
/// pure, so the tests can read it. `strips` are the jobs' strips, in `status.jobs` order (a job
/// without one shows none).
/// With `acts`, each job has its buttons and the page the token field ([`actions`]).
pub fn render(
    status: &Status,
    strips: &[Vec<Cell>],
    window: Window,
    namespace: &str,
    now: DateTime<Utc>,
    acts: bool,
) -> String {
    let mut out = String::with_capacity(2048 + 512 * status.jobs.len());
    open(&mut out, namespace, now);
    if acts {
        out.push_str(actions::CONTROLS);
    }
    match &status.leader {
        Some(l) => {
            let _ = writeln!(
                out,
                "<p id=\"leader\">Leader: <span class=\"host\">{host}</span> \
                 pid <span class=\"pid\">{pid}</span>, \
                 epoch <span class=\"epoch\">{epoch}</span>, since {since}</p>",
                host = escape(&l.host),
                pid = l.pid,
                epoch = l.epoch,
                since = instant(&l.since, now),
            );
        }
        None => out.push_str(
            "<p id=\"leader\" class=\"warn\">No leader: no beat holds the leader lease; \
             nothing is being published.</p>\n",
        ),
    }
    dead_letters_line(&mut out, status.dead_letters, acts);
    shown(&mut out, status, window);
    out.push_str(&strip::legend());
    jobs_table(&mut out, status, strips, now, acts);
    workers_and_queues(&mut out, status);
    close(&mut out, acts);
    out
}

/// The dead-letter count (with the buttons to replay or purge them with `acts`).
fn dead_letters_line(out: &mut String, count: Option<u64>, acts: bool) {
    let buttons = if acts {
        actions::DEAD_LETTER_BUTTONS
    } else {
        ""
    };
    let _ = match count {
        Some(0) => writeln!(out, "<p id=\"dead-letters\">Dead letters: 0{buttons}</p>"),
        Some(n) => writeln!(
            out,
            "<p id=\"dead-letters\" class=\"warn\">Dead letters: {n}{buttons}</p>"
        ),
        None => writeln!(
            out,
            "<p id=\"dead-letters\" class=\"warn\">Dead letters: unknown (the broker did \
             not answer)</p>"
        ),
    };
}

/// The table of the listed jobs, each with its recent runs under it (and its buttons with
/// `acts`).
fn jobs_table(
    out: &mut String,
    status: &Status,
    strips: &[Vec<Cell>],
    now: DateTime<Utc>,
    acts: bool,
) {
    out.push_str(
        "<table id=\"jobs\">\n<thead><tr><th>Job</th><th>Schedule</th><th>Zone</th>\
         <th>Recent</th>\
         <th>Next due</th><th>Last published</th><th>Last success</th><th>Last failure</th>\
         <th>Running</th><th>Paused</th><th>Stale</th>",
    );
    out.push_str(if acts { "<th>Actions</th>" } else { "" });
    out.push_str("</tr></thead>\n<tbody>\n");
    if status.total == 0 {
        out.push_str("<tr><td colspan=\"11\" class=\"none\">No jobs in the config.</td></tr>\n");
    }
    for (i, job) in status.jobs.iter().enumerate() {
        let cells = strips.get(i).map_or(&[][..], Vec::as_slice);
        out.push_str(&row(job, cells, now, acts));
        out.push_str(&runs_row(job, now));
    }
    out.push_str("</tbody>\n</table>\n");
}

/// The workers announced (`{ns}:worker:{id}`) and every queue's depth and consumers.
fn workers_and_queues(out: &mut String, status: &Status) {
    let _ = writeln!(
        out,
        "<h2>Workers: <span id=\"worker-count\">{}</span></h2>\n<table id=\"workers\">\n\
         <thead><tr><th>Worker</th><th>Host</th><th>Pid</th><th>Version</th><th>Queues</th>\
         <th>Running</th><th>Started</th></tr></thead>\n<tbody>",
        status.workers.len()
    );
    if status.workers.is_empty() {
        out.push_str("<tr><td colspan=\"7\" class=\"none\">No worker announced.</td></tr>\n");
    }
    for w in &status.workers {
        let _ = writeln!(
            out,
            "<tr data-worker=\"{id}\"><td>{id}</td><td>{host}</td><td>{pid}</td>\
             <td>{version}</td><td>{queues}</td><td class=\"running\">{running}/{concurrency}</td>\
             <td>{started}</td></tr>",
            id = escape(&w.id),
            host = escape(&w.host),
            pid = w.pid,
            version = escape(&w.version),
            queues = escape(&w.queues.join(", ")),
            running = w.running,
            concurrency = w.concurrency,
            started = escape(&w.started),
        );
    }
    out.push_str(
        "</tbody>\n</table>\n<h2>Queues</h2>\n<table id=\"queues\">\n<thead><tr><th>Queue</th>\
         <th>Depth</th><th>Consumers</th></tr></thead>\n<tbody>\n",
    );
    let number = |n: Option<u32>| n.map_or_else(|| "unknown".to_owned(), |n| n.to_string());
    for q in &status.queues {
        let warn = if q.consumers == Some(0) {
            " class=\"warn\""
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "<tr data-queue=\"{name}\"{warn}><td>{name}</td><td class=\"depth\">{depth}</td>\
             <td class=\"consumers\">{consumers}</td></tr>",
            name = escape(&q.queue),
            depth = number(q.depth),
            consumers = number(q.consumers),
        );
    }
    out.push_str("</tbody>\n</table>\n");
}

/// The page shown (with a 503) when there is no report: the reason, and the same refresh, so
/// it recovers by itself once Redis answers.
pub fn render_error(reason: &str, namespace: &str, now: DateTime<Utc>) -> String {
    let mut out = String::new();
    open(&mut out, namespace, now);
    let _ = writeln!(
        out,
        "<p id=\"error\" class=\"warn\">No status: {}</p>",
        escape(reason)
    );
    close(&mut out, false);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use drumline_shared::store::Leader;

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap()
    }

    fn job(name: &str) -> JobStatus {
        JobStatus {
            job: name.into(),
            schedule: "every 1m".into(),
            timezone: "UTC".into(),
            next_due: Some("2026-11-30T12:01:00Z".into()),
            next_runs_at: Some("2026-11-30T12:01:00Z".into()),
            last_published: Some("2026-11-30T12:00:00Z".into()),
            last_success: Some("2026-11-30T11:59:58.500Z".into()),
            last_failure: None,
            last_error: None,
            running: 2,
            paused: false,
            stale: false,
            recent: vec![],
            after: None,
            last_skipped: None,
        }
    }

    fn status() -> Status {
        let mut paused = job("reports");
        paused.paused = true;
        let mut stale = job("sync");
        stale.stale = true;
        stale.schedule = "0 3 * * *".into();
        stale.timezone = "Europe/Berlin".into();
        Status {
            leader: Some(Leader {
                host: "beat-1".into(),
                pid: 4242,
                epoch: 7,
                since: "2026-11-30T11:00:00Z".into(),
            }),
            dead_letters: Some(3),
            total: 3,
            jobs: vec![job("heartbeat"), paused, stale],
            workers: vec![drumline_shared::store::WorkerInfo {
                id: "w-1:77:abc".into(),
                host: "w-1".into(),
                pid: 77,
                version: "0.1.0".into(),
                queues: vec!["default".into()],
                concurrency: 4,
                running: 1,
                started: "2026-11-30T10:00:00Z".into(),
            }],
            queues: vec![crate::status::QueueStatus {
                queue: "default".into(),
                depth: Some(12),
                consumers: Some(1),
            }],
        }
    }

    #[test]
    fn the_page_shows_workers_and_queues() {
        let page = render(&status(), &[], Window::default(), "ns", now(), false);
        assert!(
            page.contains("<span id=\"worker-count\">1</span>"),
            "{page}"
        );
        assert!(page.contains("data-worker=\"w-1:77:abc\""), "{page}");
        assert!(page.contains("<td class=\"running\">1/4</td>"), "{page}");
        assert!(page.contains("<td class=\"depth\">12</td>"), "{page}");
        assert!(page.contains("<td class=\"consumers\">1</td>"), "{page}");
    }

    fn row_of<'p>(page: &'p str, name: &str) -> &'p str {
        let start = page
            .find(&format!("data-job=\"{name}\""))
            .unwrap_or_else(|| panic!("no row for {name}: {page}"));
        let end = page[start..].find("</tr>").unwrap();
        &page[start..start + end]
    }

    #[test]
    fn a_row_per_job_with_its_markers() {
        let page = render(&status(), &[], Window::default(), "prod", now(), false);
        assert!(page.starts_with("<!DOCTYPE html>"));
        assert!(page.contains("<meta http-equiv=\"refresh\" content=\"5\">"));
        assert!(!page.contains("<script"), "no JavaScript needed");
        assert_eq!(page.matches("<tr class=\"job").count(), 3);
        let heartbeat = row_of(&page, "heartbeat");
        assert!(!heartbeat.contains("PAUSED") && !heartbeat.contains("STALE"));
        assert!(heartbeat.contains("<td class=\"running num\">2</td>"));
        assert!(heartbeat.contains(
            "<time datetime=\"2026-11-30T11:59:58.500Z\" title=\"2026-11-30T11:59:58.500Z\">\
             11:59:58</time> <span class=\"ago\">(1 s ago)"
        ));
        assert!(heartbeat.contains("in 60 s"), "next due: {heartbeat}");
        assert!(!heartbeat.contains("runs-at"), "not jittered: {heartbeat}");
        let mut jittered = status();
        jittered.jobs[0].next_runs_at = Some("2026-11-30T12:01:37Z".into());
        let page = render(&jittered, &[], Window::default(), "prod", now(), false);
        let heartbeat = row_of(&page, "heartbeat");
        assert!(
            heartbeat.contains(
                "<span class=\"runs-at\" title=\"2026-11-30T12:01:37Z\">runs +37s</span></td>"
            ),
            "{heartbeat}"
        );
        let reports = row_of(&page, "reports");
        assert!(reports.contains(">PAUSED<") && !reports.contains("STALE"));
        let sync = row_of(&page, "sync");
        assert!(sync.contains(">STALE<") && !sync.contains("PAUSED"));
        assert!(sync.contains("<td class=\"zone\">Europe/Berlin</td>"));
        // In config order.
        let at = |n: &str| page.find(&format!("data-job=\"{n}\"")).unwrap();
        assert!(at("heartbeat") < at("reports") && at("reports") < at("sync"));
    }

    #[test]
    fn recent_runs_in_a_row_under_their_job_open_when_the_last_failed() {
        let run = |outcome: &str, error: Option<&str>| crate::recent::RecentRun {
            key: "heartbeat@2026-11-30T11:59:00Z".into(),
            scheduled_for: "2026-11-30T11:59:00Z".into(),
            outcome: outcome.into(),
            attempt: 1,
            worker: "w-1:77:abc".into(),
            started_at: Some("2026-11-30T11:59:00.100Z".into()),
            finished_at: "2026-11-30T11:59:01.600Z".into(),
            duration_ms: Some(1500),
            error: error.map(str::to_owned),
        };
        let mut s = status();
        s.jobs[0].recent = vec![
            run("dead", Some("exit code 1: <disk> full")),
            run("done", None),
        ];
        s.jobs[1].recent = vec![run("done", None)];
        let page = render(&s, &[], Window::default(), "ns", now(), false);
        let start = page.find("data-runs-of=\"heartbeat\"").unwrap();
        let runs = &page[start..start + page[start..].find("</details>").unwrap()];
        assert!(runs.contains("<details open>"), "{runs}");
        assert_eq!(runs.matches("<tr class=\"run\"").count(), 2);
        assert!(
            runs.contains("<td class=\"duration num\">1.5 s</td>"),
            "{runs}"
        );
        assert!(runs.contains("<td class=\"error\">exit code 1: &lt;disk&gt; full</td>"));
        assert!(runs.contains("<td class=\"outcome dead\">dead</td>"));
        // Under its job's row, before the next job's.
        assert!(page.find("data-job=\"heartbeat\"").unwrap() < start);
        assert!(start < page.find("data-job=\"reports\"").unwrap());
        let reports = page.find("data-runs-of=\"reports\"").unwrap();
        assert!(
            page[reports..].starts_with("data-runs-of=\"reports\"><td colspan=\"11\"><details>")
        );
        assert!(!page.contains("data-runs-of=\"sync\""), "no runs, no row");
    }

    #[test]
    fn leader_and_dead_letters() {
        let page = render(&status(), &[], Window::default(), "prod", now(), false);
        assert!(
            page.contains("<span class=\"host\">beat-1</span>"),
            "{page}"
        );
        assert!(page.contains("pid <span class=\"pid\">4242</span>"));
        assert!(page.contains("epoch <span class=\"epoch\">7</span>"));
        assert!(page.contains("(60 min ago)"));
        assert!(page.contains("<p id=\"dead-letters\" class=\"warn\">Dead letters: 3</p>"));

        let mut none = status();
        none.leader = None;
        none.dead_letters = None;
        let page = render(&none, &[], Window::default(), "prod", now(), false);
        assert!(page.contains("No leader"));
        assert!(page.contains("Dead letters: unknown"));
    }

    #[test]
    fn everything_shown_is_escaped() {
        let mut hostile = status();
        hostile.leader.as_mut().unwrap().host = "<script>alert(1)</script>".into();
        hostile.jobs[0].job = "a\"b<c>&'".into();
        hostile.jobs[0].schedule = "<b>".into();
        hostile.jobs[0].last_failure = Some("\"><img src=x>".into());
        let page = render(&hostile, &[], Window::default(), "ns<&>", now(), false);
        assert!(!page.contains("<script>") && !page.contains("<img") && !page.contains("<b>"));
        assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
        assert!(page.contains("data-job=\"a&quot;b&lt;c&gt;&amp;&#39;\""));
        assert!(page.contains("ns&lt;&amp;&gt;"));
        let error = render_error("redis: <refused> & \"gone\"", "ns", now());
        assert!(error.contains("redis: &lt;refused&gt; &amp; &quot;gone&quot;"));
        assert!(error.contains("http-equiv=\"refresh\""));
    }

    #[test]
    fn no_jobs() {
        let mut empty = status();
        empty.jobs.clear();
        empty.total = 0;
        let page = render(&empty, &[], Window::default(), "prod", now(), false);
        assert!(page.contains("No jobs in the config."));
    }

    #[test]
    fn the_window_comes_from_the_query() {
        let window = |q: Option<&str>| Window::from_query(q);
        assert_eq!(window(None), Ok(Window::default()));
        assert_eq!(window(None).unwrap().limit, 500);
        assert_eq!(
            window(Some("limit=2&offset=501&refresh=1")),
            Ok(Window {
                offset: 501,
                limit: 2
            })
        );
        assert_eq!(window(Some("limit=1000000")).unwrap().limit, MAX_LIMIT);
        assert_eq!(window(Some("")), Ok(Window::default()));
        let bad = window(Some("limit=many")).unwrap_err();
        assert!(bad.contains("limit") && bad.contains("many"), "{bad}");
        assert!(window(Some("offset=-1")).is_err());
        assert_eq!(
            Window {
                offset: usize::MAX,
                limit: 7
            }
            .range(),
            usize::MAX..usize::MAX
        );
    }

    #[test]
    fn which_jobs_of_how_many_with_links_to_the_others() {
        let mut many = status();
        many.total = 10;
        let window = Window {
            offset: 3,
            limit: 3,
        };
        let page = render(&many, &[], window, "prod", now(), false);
        assert!(page.contains("Jobs 4–6 of 10"), "{page}");
        assert!(
            page.contains("href=\"/?offset=0&amp;limit=3\">previous"),
            "{page}"
        );
        assert!(
            page.contains("href=\"/?offset=6&amp;limit=3\">next"),
            "{page}"
        );
        let first = render(
            &many,
            &[],
            Window {
                offset: 0,
                limit: 3,
            },
            "prod",
            now(),
            false,
        );
        assert!(first.contains("Jobs 1–3 of 10") && !first.contains("previous"));
        let last = render(
            &many,
            &[],
            Window {
                offset: 7,
                limit: 3,
            },
            "prod",
            now(),
            false,
        );
        assert!(
            last.contains("Jobs 8–10 of 10") && !last.contains(">next<"),
            "{last}"
        );
        many.jobs.clear();
        let past = render(
            &many,
            &[],
            Window {
                offset: 20,
                limit: 3,
            },
            "prod",
            now(),
            false,
        );
        assert!(past.contains("No jobs listed from 21; 10 in all"), "{past}");
        assert!(!past.contains("No jobs in the config."));
    }

    #[test]
    fn ages() {
        let t = now();
        assert_eq!(ago(t - chrono::TimeDelta::seconds(5), t), "5 s ago");
        assert_eq!(ago(t - chrono::TimeDelta::minutes(5), t), "5 min ago");
        assert_eq!(ago(t - chrono::TimeDelta::hours(5), t), "5 h ago");
        assert_eq!(ago(t - chrono::TimeDelta::days(5), t), "5 d ago");
        assert_eq!(ago(t + chrono::TimeDelta::seconds(30), t), "in 30 s");
        assert_eq!(ago(t + chrono::TimeDelta::milliseconds(200), t), "in 1 s");
        assert_eq!(ago(t - chrono::TimeDelta::milliseconds(200), t), "0 s ago");
        assert_eq!(short(t - chrono::TimeDelta::seconds(5), t), "11:59:55");
        assert_eq!(
            short(t + chrono::TimeDelta::hours(15), t),
            "2026-12-01 03:00:00"
        );
    }

    #[test]
    fn a_paused_job_offers_resume_and_names_are_escaped() {
        let paused = buttons("a<b", true);
        assert!(
            paused.contains("data-action=\"resume\" data-job=\"a&lt;b\""),
            "{paused}"
        );
        assert!(buttons("j", false).contains("data-action=\"pause\""));
    }

    /// Each job's strip sits in its row, its cells link to their keys' pages, the legend is
    /// on the page once, and a key's page shows its report escaped.
    #[test]
    fn strips_in_their_rows_with_a_legend_and_key_pages() {
        use crate::audit::Class;
        use crate::strip::Mark;
        let cell = |key: &str, mark| Cell {
            instant: now() - chrono::TimeDelta::minutes(1),
            key: key.into(),
            mark,
        };
        let strips = vec![
            vec![
                cell("heartbeat@2026-11-30T11:59:00Z", Mark::Unknown),
                cell("heartbeat@2026-11-30T12:00:00Z", Mark::Known(Class::Ran)),
            ],
            vec![cell("reports@<x>", Mark::Known(Class::Missed))],
        ];
        let page = render(&status(), &strips, Window::default(), "ns", now(), false);
        assert_eq!(page.matches("<p id=\"legend\">").count(), 1, "{page}");
        let heartbeat = row_of(&page, "heartbeat");
        assert!(
            heartbeat.contains(
                "<td class=\"recent\"><span class=\"strip\"><a class=\"cell unknown\" \
             href=\"/keys/heartbeat@2026-11-30T11:59:00Z\" title=\"2026-11-30T11:59:00Z unknown\">\
             </a><a class=\"cell ran\" href=\"/keys/heartbeat@2026-11-30T12:00:00Z\""
            ),
            "{heartbeat}"
        );
        let reports = row_of(&page, "reports");
        assert!(
            reports.contains("class=\"cell missed\" href=\"/keys/reports@%3Cx%3E\""),
            "{reports}"
        );
        assert!(row_of(&page, "sync")
            .contains("<td class=\"recent\"><span class=\"strip\"></span></td>"));
        assert!(!page.contains("<script"), "no JavaScript needed");

        let report = serde_json::json!({"key": "k<", "state": "dead", "attempt": 2,
            "worker": "w<1>", "dead_letter": {"reason": "permanent"},
            "journal": [{"at": "2026-11-30T12:00:00.100Z", "event": "dead", "attempt": 2,
                         "worker": null, "reason": "<exit 1>"}]});
        let key = render_key("k<", &report, "ns", now());
        assert!(key.contains("<code id=\"key\">k&lt;</code>"), "{key}");
        assert!(key.contains("<td class=\"state\">dead</td>"), "{key}");
        assert!(
            key.contains("<td class=\"worker\">w&lt;1&gt;</td>"),
            "{key}"
        );
        assert!(
            key.contains("<td class=\"dead_letter\">permanent</td>"),
            "{key}"
        );
        assert!(
            key.contains("<td class=\"reason\">&lt;exit 1&gt;</td>"),
            "{key}"
        );
        assert_eq!(key.matches("<tr class=\"entry\">").count(), 1);
    }

    /// A page with buttons does not call itself read-only; one without does.
    #[test]
    fn only_a_page_without_actions_says_read_only() {
        let acting = render(&status(), &[], Window::default(), "ns", now(), true);
        assert!(!acting.contains("Read-only"), "{acting}");
        assert!(
            render(&status(), &[], Window::default(), "ns", now(), false).contains("Read-only")
        );
    }
}
