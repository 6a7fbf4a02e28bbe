//! The beat's read-only status page (docs/design.md "Status page"), loaded in a real browser:
//! headless Chromium (Debian `chromium`; `scripts/services chromium` installs it, scripts/test
//! does first) renders `/` and the test asserts on the DOM it dumps — a row per job, the
//! leader, PAUSED on the paused job, STALE on the stale one — and on `/api/status`, the
//! `status --json` document; after SIGHUP it shows the reloaded jobs. A stuck Redis makes a
//! 503 with the reason, not a hung page. Bounded work per request: concurrent requests share
//! one broker connection, at most four are answered at once (the others 503 with
//! `Retry-After`), and at most `limit` jobs are listed, with the total.
//!
//! `DRUMLINE_PAGE_SCREENSHOT=/abs/path.png` also saves the browser's screenshot of the page
//! there (how docs/status-page.png is made).

use drumline_e2e::cfg::{cron, every, shell, Cfg};
use drumline_e2e::probe::{argv, expect, stop, tails};
use drumline_e2e::{http_get, setup, wait_until, Proc, TestEnv};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);

/// Chromium's private profile directory, removed when the test ends (it holds a few MB).
struct Profile(PathBuf);

impl Drop for Profile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs headless Chromium on `url` with `extra` arguments (`--dump-dom`, `--screenshot=…`)
/// and a private profile in the test's directory; returns its stdout. Chromium runs as root
/// here, which needs `--no-sandbox`.
fn chromium(env: &TestEnv, url: &str, extra: &[&str]) -> String {
    let profile = Profile(env.path("chromium-profile"));
    let mut child = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
        ])
        .arg(format!("--user-data-dir={}", profile.0.display()))
        .args(extra)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("chromium: {e}: install it with `scripts/services chromium`"));
    let stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || std::io::read_to_string(stdout).unwrap_or_default());
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish within {WAIT:?} on {url}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "chromium exited with {status} on {url}");
    reader.join().unwrap()
}

/// The rendered `<tr>` of `job` in the dumped DOM.
fn row<'d>(dom: &'d str, job: &str) -> &'d str {
    let start = dom
        .find(&format!("data-job=\"{job}\""))
        .unwrap_or_else(|| panic!("no row for {job} in\n{dom}"));
    let end = dom[start..].find("</tr>").expect("row end");
    &dom[start..start + end]
}

/// The text of the first `<td class="{class}…">` of a row (tags inside stripped).
fn cell(row: &str, class: &str) -> String {
    let start = row
        .find(&format!("<td class=\"{class}"))
        .unwrap_or_else(|| panic!("no {class} cell in {row}"));
    let body = &row[start..];
    let body = &body[body.find('>').unwrap() + 1..body.find("</td>").unwrap()];
    let mut text = String::new();
    let mut in_tag = false;
    for c in body.chars() {
        match c {
            '<' => in_tag = true,
            '>' => in_tag = false,
            c if !in_tag => text.push(c),
            _ => {}
        }
    }
    text.trim().to_owned()
}

/// The `datetime` of the `<time>` in the `<td class="{class}…">` of a row, if it holds one.
fn datetime(row: &str, class: &str) -> Option<chrono::DateTime<chrono::FixedOffset>> {
    let start = row.find(&format!("<td class=\"{class}"))?;
    let cell = &row[start..start + row[start..].find("</td>")?];
    let value = cell.split("datetime=\"").nth(1)?.split('"').next()?;
    chrono::DateTime::parse_from_rfc3339(value).ok()
}

/// [`drumline_e2e::http`] with time for a 503 (it comes after the page's own 4 s wait).
fn http(port: u16, method: &str, path: &str) -> Option<(u16, String, String)> {
    drumline_e2e::http(port, method, path, Duration::from_secs(20))
}

/// The value of header `name` in a response head.
fn header(head: &str, name: &str) -> String {
    head.lines()
        .find_map(|l| {
            let (key, value) = l.split_once(':')?;
            key.eq_ignore_ascii_case(name)
                .then(|| value.trim().to_owned())
        })
        .unwrap_or_default()
}

/// `/api/status` parsed, when it answers 200.
fn api_status(port: u16) -> Option<Value> {
    match http_get(port, "/api/status")? {
        (200, body) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

/// Waits until `/api/status` on `port` satisfies `condition`; else panics with the last
/// document and the log tails of `procs`.
fn expect_status(port: u16, procs: &[&Proc], mut condition: impl FnMut(&Value) -> bool) {
    let held = wait_until(WAIT, || api_status(port).is_some_and(|s| condition(&s)));
    assert!(
        held,
        "{:?}\n{}",
        http_get(port, "/api/status"),
        tails(procs)
    );
}

/// The names of the jobs a status document lists.
fn names(doc: &Value) -> Vec<String> {
    let jobs = doc["jobs"].as_array().unwrap();
    jobs.iter()
        .map(|j| j["job"].as_str().unwrap().to_owned())
        .collect()
}

/// Five jobs on three tasks: a succeeding `heartbeat`, a paused-to-be `nightly-report`, a
/// failing (so stale) `sync-invoices`, a long-running `rollup` and an idle cron job `last`.
fn five_jobs(env: &TestEnv, last: &str) -> Cfg {
    let (often, fast) = (every("2s"), every("1s"));
    let berlin = cron("0 3 * * *").text("timezone", "Europe/Berlin");
    Cfg::new()
        .worker_slots(4, "5s")
        .jobs_of(
            "append",
            vec![("heartbeat", often), ("nightly-report", fast)],
        )
        .job("sync-invoices", every("1s").task("broken"))
        .job("rollup", every("3s").task("slow").text("overlap", "allow"))
        .job(last, berlin.task("append"))
        .task("append", env.appender("effects", 0.0))
        .task("broken", argv(&["/bin/false"]).with("max_retries", "0"))
        .task("slow", argv(&["/bin/sleep", "10"]))
}

/// `/api/status` is the status document: the same jobs, fields and flags as `status --json`;
/// the flags are (paused, stale) per job. Returns it.
fn assert_api_is_status_json(env: &TestEnv, config: &str, port: u16) -> Value {
    let (api, cli) = (api_status(port).unwrap(), env.status_json(config));
    let shape = |doc: &Value| -> Vec<(String, Vec<String>, bool)> {
        let jobs = doc["jobs"].as_array().unwrap().iter();
        jobs.map(|j| {
            let mut keys: Vec<String> = j.as_object().unwrap().keys().cloned().collect();
            keys.sort();
            (
                j["job"].as_str().unwrap().to_owned(),
                keys,
                j["paused"] == true,
            )
        })
        .collect()
    };
    assert_eq!(shape(&api), shape(&cli), "{api}\n{cli}");
    assert_eq!(api["leader"], cli["leader"]);
    assert_eq!(
        (&api["total"], &cli["total"]),
        (&Value::from(5), &Value::from(5))
    );
    assert!(api["dead_letters"].as_u64() >= Some(1), "{api}");
    let jobs = api["jobs"].as_array().unwrap().iter();
    let flags: Vec<(bool, bool)> = jobs
        .map(|j| {
            (
                j["paused"].as_bool().unwrap(),
                j["stale"].as_bool().unwrap(),
            )
        })
        .collect();
    let want = [
        (false, false),
        (true, false),
        (false, true),
        (false, false),
        (false, false),
    ];
    assert_eq!(flags, want, "{api}");
    for (path, kind) in [
        ("/api/status", "application/json"),
        ("/", "text/html; charset=utf-8"),
    ] {
        let (code, head, _) = http(port, "HEAD", path).unwrap();
        assert_eq!(
            (code, header(&head, "content-type")),
            (200, kind.to_owned()),
            "{head}"
        );
    }
    api
}

/// The text after the first `marker` in `dom` (panics naming `what` when it is not there).
fn after<'d>(dom: &'d str, marker: &str, what: &str) -> &'d str {
    let found = dom.split(marker).nth(1);
    found.unwrap_or_else(|| panic!("no {what} in {dom}"))
}

/// The page of [`five_jobs`] as the browser rendered it: a row per job with its flags and
/// times, the leader (`beat`, on `host`), the dead letters, the worker and the queue.
fn assert_page_shows_five_jobs(dom: &str, beat: i32, worker: i32, host: &str) {
    assert!(
        dom.contains("<meta http-equiv=\"refresh\" content=\"5\">"),
        "{dom}"
    );
    assert_eq!(dom.matches("<tr class=\"job").count(), 5, "{dom}");
    assert!(dom.contains("Jobs 1–5 of 5"), "{dom}");
    for name in [
        "heartbeat",
        "nightly-report",
        "sync-invoices",
        "rollup",
        "cleanup",
    ] {
        assert_eq!(cell(row(dom, name), "name"), name);
    }
    let leader = after(dom, "<p id=\"leader\">", "leader");
    assert!(
        leader.contains(&format!("pid <span class=\"pid\">{beat}</span>")),
        "{leader}"
    );
    assert!(
        leader.contains(&format!("<span class=\"host\">{host}</span>")),
        "{leader}"
    );
    let nightly = row(dom, "nightly-report");
    let flags = |r: &str| [cell(r, "paused"), cell(r, "stale")];
    assert_eq!(flags(nightly), ["PAUSED", ""], "{nightly}");
    assert_eq!(cell(nightly, "last-success"), "–", "{nightly}");
    let sync = row(dom, "sync-invoices");
    assert_eq!(flags(sync), ["", "STALE"], "{sync}");
    assert!(datetime(sync, "last-failure").is_some(), "{sync}");
    let heartbeat = row(dom, "heartbeat");
    assert_eq!(flags(heartbeat), ["", ""], "{heartbeat}");
    assert_eq!(cell(heartbeat, "schedule"), "every 2s");
    for time in ["last-success", "next-due"] {
        assert!(datetime(heartbeat, time).is_some(), "{time}: {heartbeat}");
    }
    let rollup = row(dom, "rollup");
    assert!(
        cell(rollup, "running").parse::<u64>().unwrap() >= 1,
        "{rollup}"
    );
    assert_eq!(cell(row(dom, "cleanup"), "zone"), "Europe/Berlin");
    let dead = after(dom, "<p id=\"dead-letters\"", "dead letters");
    assert!(dead.contains("Dead letters: "), "{dead}");
    assert!(dom.contains("<span id=\"worker-count\">1</span>"), "{dom}");
    let worker_row = after(dom, "<tr data-worker=\"", "worker row");
    assert!(
        worker_row.contains(&format!("<td>{worker}</td>")),
        "{worker_row}"
    );
    let queue_row = after(dom, "<tr data-queue=\"default\"", "queue row");
    assert!(
        queue_row.contains("<td class=\"consumers\">1</td>"),
        "{queue_row}"
    );
}

/// A screenshot of the page at `url` taken the same way is a PNG (copied to
/// `DRUMLINE_PAGE_SCREENSHOT` when set).
fn assert_screenshot(env: &TestEnv, url: &str) {
    let shot = env.path("status-page.png");
    let arg = format!("--screenshot={}", shot.display());
    chromium(env, url, &[&arg, "--window-size=1200,600"]);
    let png = std::fs::read(&shot).expect("screenshot written");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    if let Ok(target) = std::env::var("DRUMLINE_PAGE_SCREENSHOT") {
        std::fs::copy(&shot, Path::new(&target)).expect("copy the screenshot");
    }
    let _ = std::fs::remove_file(&shot);
}

#[tokio::test(flavor = "multi_thread")]
async fn chromium_renders_every_job_the_leader_paused_and_stale() {
    let env = setup("e2e_page");
    let config = env.config_file(&five_jobs(&env, "cleanup"));
    // Paused before the beat starts: none of its instants is ever published.
    let (code, out, err) = env.beat_cmd(&config, &["pause", "nightly-report"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("paused 1 job"), "{out}");
    let mut worker = env.worker_on("worker", &config);
    let (mut beat, port) = env.beat_serving("beat", &config);
    let url = format!("http://127.0.0.1:{port}/");

    // `heartbeat` succeeds, `rollup` runs (10 s per instance), `sync-invoices` never succeeds
    // and turns stale two periods after its first run.
    let (beat_pid, worker_pid) = (beat.pid(), worker.pid());
    expect_status(port, &[&beat, &worker], |s| {
        let jobs = &s["jobs"];
        s["leader"]["pid"] == beat_pid
            && jobs[0]["last_success"].is_string()
            && jobs[3]["running"].as_u64() >= Some(1)
            && jobs[2]["stale"] == true
            && jobs[2]["last_failure"].is_string()
            // Read from the broker at most every 5 s: it may lag the dead letter.
            && s["dead_letters"].as_u64() >= Some(1)
            // The worker announced itself; the broker counts it on the queue.
            && s["workers"][0]["pid"] == worker_pid
            && s["queues"][0]["consumers"] == 1
    });
    let api = assert_api_is_status_json(&env, &config, port);

    // The page as a browser renders it.
    let dom = chromium(&env, &url, &["--dump-dom"]);
    let host = api["leader"]["host"].as_str().unwrap();
    assert_page_shows_five_jobs(&dom, beat_pid, worker_pid, host);

    // Read-only: no method but GET (and HEAD) is served, and nothing changed.
    for path in ["/", "/api/status"] {
        for method in ["POST", "PUT", "DELETE"] {
            let (code, _, _) = http(port, method, path).unwrap();
            assert_eq!(code, 405, "{method} {path}");
        }
    }
    let after = api_status(port).unwrap();
    assert_eq!(after["jobs"][1]["paused"], true, "{after}");
    // The paused job never ran.
    let nightly = env.runs_of("effects", "nightly-report");
    assert!(nightly.is_empty(), "{:?}", env.lines("effects"));
    assert_screenshot(&env, &url);

    // SIGHUP: the page follows the reloaded jobs, as the beat does (`cleanup` removed,
    // `added-later` added).
    env.config_file(&five_jobs(&env, "added-later"));
    beat.signal(libc::SIGHUP);
    expect_status(port, &[&beat], |s| {
        let names = names(s);
        names.contains(&"added-later".into()) && !names.contains(&"cleanup".into())
    });
    let dom = chromium(&env, &url, &["--dump-dom"]);
    assert_eq!(cell(row(&dom, "added-later"), "zone"), "Europe/Berlin");
    assert!(!dom.contains("data-job=\"cleanup\""), "{dom}");
    stop(&mut [&mut beat, &mut worker]);
}

/// The (class, href) of each cell of `job`'s strip in a served page.
fn strip_cells(page: &str, job: &str) -> Vec<(String, String)> {
    let row = row(page, job);
    let strip = after(row, "<td class=\"recent\">", "strip");
    let strip = &strip[..strip.find("</td>").expect("strip end")];
    strip
        .split("<a class=\"cell ")
        .skip(1)
        .map(|a| {
            let class = a.split('"').next().unwrap().to_owned();
            let href = after(a, "href=\"", "href").split('"').next().unwrap();
            (class, href.to_owned())
        })
        .collect()
}

/// How many cells of `cells` are of `class`.
fn count(cells: &[(String, String)], class: &str) -> usize {
    cells.iter().filter(|(c, _)| c == class).count()
}

/// Each job's recent instants as a strip coloured by their `audit` class, each cell a link to
/// its key's page (what `inspect` shows): `ok` ran, `broken` (no retries) dead, `daily` (not
/// due while its journal existed) unknown, and nothing missed.
// See: issues/36
#[tokio::test(flavor = "multi_thread")]
async fn each_job_has_a_strip_of_its_instants_linking_to_their_keys() {
    let env = setup("e2e_page_strip");
    let cfg = Cfg::new()
        .job("ok", every("1s").task("append"))
        .job("broken", every("1s").task("broken"))
        .job("daily", cron("0 3 * * *").task("append"))
        .task("append", env.appender("effects", 0.0))
        .task("broken", argv(&["/bin/false"]).with("max_retries", "0"));
    let config = env.config_file(&cfg);
    let mut worker = env.worker_on("worker", &config);
    let (mut beat, port) = env.beat_serving("beat", &config);
    let mut page = String::new();
    expect(WAIT, &[&beat, &worker], "3 ran and 3 dead cells", || {
        page = http_get(port, "/")
            .map(|(_, body)| body)
            .unwrap_or_default();
        page.contains("data-job=\"daily\"")
            && count(&strip_cells(&page, "ok"), "ran") >= 3
            && count(&strip_cells(&page, "broken"), "dead") >= 3
    });
    assert_eq!(page.matches("<p id=\"legend\">").count(), 1, "{page}");
    let (ok, broken, daily) = (
        strip_cells(&page, "ok"),
        strip_cells(&page, "broken"),
        strip_cells(&page, "daily"),
    );
    for cells in [&ok, &broken, &daily] {
        assert_eq!(cells.len(), 12, "{cells:?}");
        assert_eq!(count(cells, "missed"), 0, "{cells:?}");
    }
    assert_eq!(count(&broken, "ran"), 0, "{broken:?}");
    assert_eq!(count(&ok, "dead"), 0, "{ok:?}");
    assert_eq!(count(&daily, "unknown"), 12, "{daily:?}");

    // A cell's link: its key's page, as `inspect` tells it (404 for a key with no trace).
    let link = |cells: &[(String, String)], class: &str| -> String {
        let (_, href) = cells.iter().find(|(c, _)| c == class).unwrap();
        href.clone()
    };
    for (href, state) in [(link(&broken, "dead"), "dead"), (link(&ok, "ran"), "done")] {
        let key = href.strip_prefix("/keys/").unwrap();
        let (code, body) = http_get(port, &href).unwrap();
        assert_eq!(code, 200, "{href}: {body}");
        assert!(
            body.contains(&format!("<code id=\"key\">{key}</code>")),
            "{body}"
        );
        assert!(
            body.contains(&format!("<td class=\"state\">{state}</td>")),
            "{body}"
        );
        assert!(body.contains("<tr class=\"entry\">"), "its journal: {body}");
        let (code, _, _) = http(port, "POST", &href).unwrap();
        assert_eq!(code, 405, "GET only: {href}");
    }
    let (code, body) = http_get(port, &link(&daily, "unknown")).unwrap();
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("<td class=\"state\">unknown</td>"), "{body}");
    stop(&mut [&mut beat, &mut worker]);
}

/// Redis accepts the connection and never answers (a listener nobody reads): the page and
/// `/api/status` answer 503 with the reason within the page's wait, and the HTML one still
/// refreshes itself.
#[tokio::test(flavor = "multi_thread")]
async fn a_stuck_redis_makes_a_503_with_the_reason_not_a_hung_page() {
    let env = setup("e2e_page_stuck");
    let stuck = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (mut beat, port) = beat_with_page(&env, heartbeat_on_stuck_redis(&stuck));
    expect(WAIT, &[&beat], "/healthz", || {
        http_get(port, "/healthz").is_some()
    });
    for path in ["/", "/api/status"] {
        let started = Instant::now();
        let (code, head, body) = http(port, "GET", path).expect("an answer");
        let took = started.elapsed();
        assert_eq!(code, 503, "{path}: {body}");
        assert!(body.contains("redis"), "{path}: {body}");
        assert!(took < Duration::from_secs(8), "{path} took {took:?}");
        if path == "/" {
            assert_eq!(header(&head, "content-type"), "text/html; charset=utf-8");
            assert!(body.contains("http-equiv=\"refresh\""), "{body}");
        } else {
            let error: Value = serde_json::from_str(&body).unwrap();
            assert!(error["error"].is_string(), "{body}");
        }
    }
    drop(stuck);
    stop(&mut [&mut beat]);
}

/// A `heartbeat` job every second, with Redis at `stuck`: a listener nobody reads.
fn heartbeat_on_stuck_redis(stuck: &std::net::TcpListener) -> Cfg {
    let port = stuck.local_addr().unwrap().port();
    let heartbeat = every("1s").task("append");
    Cfg::new()
        .redis_url(&format!("redis://127.0.0.1:{port}/0"))
        .job("heartbeat", heartbeat)
}

/// A job that is never due while a test runs: daily at 03:00.
fn daily() -> Cfg {
    Cfg::new().job("daily", cron("0 3 * * *").task("append"))
}

/// The established TCP connections of process `pid` to the broker's port 5672.
fn broker_connections(pid: i32) -> usize {
    connections_to(pid, 5672)
}

/// The established TCP connections of process `pid` to `port` on any address: its socket
/// inodes (`/proc/PID/fd`) found in the kernel's TCP tables.
fn connections_to(pid: i32, port: u16) -> usize {
    local_ports_to(pid, port).len()
}

/// The local ports of [`connections_to`]'s connections, one per socket: a read of
/// `/proc/net/tcp` is not atomic, and while other sockets come and go (a burst of requests)
/// it may list one socket twice, so lines are counted by their inode.
fn local_ports_to(pid: i32, port: u16) -> Vec<u16> {
    let remote = format!(":{port:04X}");
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|target| {
                    let text = target.to_string_lossy().into_owned();
                    Some(text.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
                })
                .collect()
        })
        .unwrap_or_default();
    let sockets: std::collections::BTreeMap<String, u16> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|text| text.lines().skip(1).map(str::to_owned).collect::<Vec<_>>())
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local address, remote address, state (01 = ESTABLISHED), inode
            let established = fields.len() > 9
                && fields[2].ends_with(&remote)
                && fields[3] == "01"
                && inodes.contains(fields[9]);
            let local = fields.get(1)?.rsplit(':').next()?;
            let local = u16::from_str_radix(local, 16).ok()?;
            established.then(|| (fields[9].to_owned(), local))
        })
        .collect();
    sockets.into_values().collect()
}

/// What the evidence of too many connections needs: their local ports and how many AMQP
/// connections the process runs (lapin runs one `lapin-io-loop` thread per connection).
fn connection_evidence(pid: i32, port: u16) -> String {
    let loops = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|dir| {
            dir.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|name| name.trim() == "lapin-io-loop")
                .count()
        })
        .unwrap_or(0);
    format!(
        "local ports {:?}; lapin io loops {loops}",
        local_ports_to(pid, port)
    )
}

/// A beat serving its page on a free port, with `cfg` and an append task: the beat and the
/// port.
fn beat_with_page(env: &TestEnv, cfg: Cfg) -> (Proc, u16) {
    let config = env.config_file(&cfg.task("append", env.appender("effects", 0.0)));
    env.beat_serving("beat", &config)
}

/// Sends `paths` all at once, one thread each: (path, code, head, body, when it was answered).
fn burst(port: u16, paths: &[&str]) -> Vec<(String, u16, String, String, Instant)> {
    let start = std::sync::Arc::new(std::sync::Barrier::new(paths.len()));
    let threads: Vec<_> = paths
        .iter()
        .map(|path| {
            let (start, path) = (start.clone(), path.to_string());
            std::thread::spawn(move || {
                start.wait();
                let (code, head, body) = http(port, "GET", &path).expect("an answer");
                (path, code, head, body, Instant::now())
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// 300 concurrent requests to `/` and `/api/status` (docs/design.md "Bounded work for every
/// request"): the page opens at most one broker connection of its own at any time (it used to
/// open one per request: 74 at once), every request is answered (200, or 503 with
/// `Retry-After` while four others are being rendered), and the dead-letter count is known.
// See: issues/16
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_requests_share_one_broker_connection() {
    let env = setup("e2e_page_conns");
    let (mut beat, port) = beat_with_page(&env, daily());
    let pid = beat.pid();
    // The beat's own (publishing) connection, before the page made any.
    expect(WAIT, &[&beat], "a broker connection and /healthz", || {
        broker_connections(pid) >= 1 && http_get(port, "/healthz").is_some()
    });
    let own = broker_connections(pid);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut most = Most::default();
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                most.sample(pid, 5672);
                std::thread::sleep(Duration::from_millis(2));
            }
            most
        })
    };
    let paths: Vec<&str> = (0..300).map(|i| ["/", "/api/status"][i % 2]).collect();
    let answers = burst(port, &paths);
    // And a few one after another, each after the cached count may have expired.
    let later: Vec<_> = (0..3)
        .map(|_| http(port, "GET", "/api/status").expect("an answer"))
        .collect();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    sampler
        .join()
        .unwrap()
        .assert_at_most_one_more_than(own, &beat);

    let ok = answers.iter().filter(|a| a.1 == 200).count();
    let busy = answers
        .iter()
        .filter(|a| a.1 == 503 && header(&a.2, "retry-after") == "1");
    let busy = busy.count();
    eprintln!("{ok} rendered, {busy} busy");
    assert_eq!(ok + busy, 300, "every request answered 200 or busy");
    assert!(ok >= 1, "none rendered");
    for (code, _, body) in later {
        assert_eq!(code, 200, "{body}");
        let status: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(status["dead_letters"], 0, "{body}");
    }
    stop(&mut [&mut beat]);
}

/// The most broker connections a process was seen with at once, and the evidence.
#[derive(Default)]
struct Most {
    connections: usize,
    evidence: String,
}

impl Most {
    /// Counts `pid`'s connections to `port` now; keeps the count and evidence if the most.
    fn sample(&mut self, pid: i32, port: u16) {
        let now = connections_to(pid, port);
        if now > self.connections {
            (self.connections, self.evidence) = (now, connection_evidence(pid, port));
        }
    }

    /// The page opened at most one connection beside the beat's `own`.
    fn assert_at_most_one_more_than(&self, own: usize, beat: &Proc) {
        let Most {
            connections: most,
            evidence,
        } = self;
        eprintln!("{most} broker connections at most (the beat's own: {own})");
        assert!(
            *most <= own + 1,
            "{most} broker connections at once ({evidence}); the beat's own: {own}\n{}",
            tails(&[beat])
        );
    }
}

/// A slow link to the broker (every chunk held 350 ms, so a connect and a read together take
/// longer than a request waits for them): the page's read is not cancelled with the request
/// that started it (which left the connect half-open beside the next one, and never got a count
/// at all), so the counts become known and the page still holds one broker connection at most.
// See: issues/16
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_broker_link_still_gives_the_counts_through_one_connection() {
    let env = setup("e2e_page_slow_broker");
    let proxy = drumline_e2e::proxy::Proxy::start("127.0.0.1:5672".parse().unwrap());
    let broker = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port);
    let (mut beat, port) = beat_with_page(&env, daily().broker_url(&broker));
    let pid = beat.pid();
    let counted = || api_status(port).is_some_and(|s| s["dead_letters"] == 0);
    // The counts are known once the page has connected and read them.
    expect(WAIT, &[&beat], "the counts never became known", || {
        connections_to(pid, proxy.port) >= 1 && counted()
    });
    proxy.set(drumline_e2e::proxy::Fault::Delay(Duration::from_millis(
        350,
    )));
    let own = connections_to(pid, proxy.port);
    // The cached counts expire; reads over the slow link, each slower than a request waits.
    let start = Instant::now();
    let mut most = Most {
        connections: own,
        evidence: String::new(),
    };
    expect(
        Duration::from_secs(40),
        &[&beat],
        "no count read over the slow link",
        || {
            most.sample(pid, proxy.port);
            let known = counted();
            most.sample(pid, proxy.port);
            // Past the 5 s the count read before the delay was kept for: a read over the slow link.
            start.elapsed() > Duration::from_secs(6) && known
        },
    );
    most.assert_at_most_one_more_than(own, &beat);
    proxy.set(drumline_e2e::proxy::Fault::Pass);
    stop(&mut [&mut beat]);
}

/// At most four requests are rendered at once (docs/design.md): with Redis stuck, four requests
/// wait for it (and get the 503 that says so after the page's wait); the other eight of twelve
/// concurrent requests are answered 503 with `Retry-After: 1` at once, before any of the four.
// See: issues/16
#[tokio::test(flavor = "multi_thread")]
async fn a_fifth_concurrent_request_is_answered_503_with_retry_after_at_once() {
    let env = setup("e2e_page_busy");
    let stuck = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (mut beat, port) = beat_with_page(&env, heartbeat_on_stuck_redis(&stuck));
    expect(WAIT, &[&beat], "/healthz", || {
        http_get(port, "/healthz").is_some()
    });
    let paths: Vec<&str> = (0..12).map(|i| ["/", "/api/status"][i % 2]).collect();
    let answers = burst(port, &paths);
    let (busy, slow): (Vec<_>, Vec<_>) = answers
        .iter()
        .partition(|a| header(&a.2, "retry-after") == "1");
    assert_eq!(
        (busy.len(), slow.len()),
        (8, 4),
        "busy and rendered answers: {:?}",
        answers
            .iter()
            .map(|a| (&a.0, a.1, &a.3))
            .collect::<Vec<_>>()
    );
    for (path, code, _, body, _) in &answers {
        assert_eq!(*code, 503, "{path}: {body}");
    }
    for (path, _, _, body, _) in &slow {
        assert!(body.contains("redis"), "{path}: {body}");
    }
    let first_slow = slow.iter().map(|a| a.4).min().unwrap();
    for (path, _, head, body, at) in &busy {
        assert!(*at < first_slow, "{path}: busy only after a render ended");
        if path == "/api/status" {
            assert_eq!(header(head, "content-type"), "application/json");
            let error: Value = serde_json::from_str(body).unwrap();
            assert!(error["error"].is_string(), "{body}");
        } else {
            assert_eq!(header(head, "content-type"), "text/html; charset=utf-8");
        }
    }
    drop(stuck);
    stop(&mut [&mut beat]);
}

/// The page lists at most `limit` jobs (default 500), from `offset`, and shows the total
/// (docs/design.md); `/api/status` carries `total` beside the listed `jobs`.
// See: issues/16
#[tokio::test(flavor = "multi_thread")]
async fn the_page_lists_at_most_limit_jobs_and_shows_the_total() {
    let env = setup("e2e_page_rows");
    let jobs = (0..503).map(|i| (format!("j{i:03}"), cron("0 3 * * *").task("t")));
    let cfg = jobs.fold(Cfg::new(), |cfg, (name, keys)| cfg.job(&name, keys));
    let config = env.config_file(&cfg.task("t", argv(&["/bin/true"])));
    let (mut beat, port) = env.beat_serving("beat", &config);
    expect(WAIT, &[&beat], "/api/status", || api_status(port).is_some());
    let first = api_status(port).unwrap();
    assert_eq!(first["total"], 503);
    let listed = names(&first);
    assert_eq!(listed.len(), 500);
    assert_eq!((listed[0].as_str(), listed[499].as_str()), ("j000", "j499"));

    let get = |path: &str| http_get(port, path).unwrap();
    let (code, body) = get("/api/status?limit=2&offset=501");
    assert_eq!(code, 200, "{body}");
    let tail: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(names(&tail), ["j501", "j502"]);
    assert_eq!(tail["total"], 503);
    let past: Value = serde_json::from_str(&get("/api/status?offset=600").1).unwrap();
    assert_eq!((names(&past).len(), &past["total"]), (0, &Value::from(503)));
    assert_eq!(get("/api/status?limit=many").0, 400);

    let (code, page) = get("/");
    assert_eq!(code, 200);
    assert_eq!(page.matches("<tr class=\"job").count(), 500);
    assert!(page.contains("Jobs 1–500 of 503"), "{page}");
    let (_, page) = get("/?offset=500");
    assert_eq!(page.matches("<tr class=\"job").count(), 3);
    assert!(page.contains("Jobs 501–503 of 503"), "{page}");
    assert!(page.contains("data-job=\"j502\""));
    stop(&mut [&mut beat]);
}

/// The recent runs of `job` in a status document (`status --json`, `/api/status`).
fn recent<'d>(doc: &'d Value, job: &str) -> &'d [Value] {
    doc["jobs"]
        .as_array()
        .and_then(|jobs| jobs.iter().find(|j| j["job"] == job))
        .and_then(|j| j["recent"].as_array())
        .map_or(&[], Vec::as_slice)
}

/// A run of the failing task as it must show: its outcome and attempt, a start, a duration of
/// at least the task's 300 ms sleep, and the task's stderr in its error.
fn shows_the_failure(run: &Value, outcome: &str, attempt: u64) -> bool {
    run["outcome"] == outcome
        && run["attempt"] == attempt
        && run["started_at"].is_string()
        && run["duration_ms"].as_u64() >= Some(300)
        && run["error"]
            .as_str()
            .is_some_and(|e| e.contains("disk full on /var/spool"))
}

/// The page shows the recent runs of `spool-sweep` in an open detail row under its job: five
/// runs with error, duration and start, one of them dead; none for `quiet`.
fn assert_runs_row(dom: &str) {
    let start = dom.find("data-runs-of=\"spool-sweep\"");
    let start = start.unwrap_or_else(|| panic!("no recent runs row in\n{dom}"));
    assert!(dom.find("data-job=\"spool-sweep\"").unwrap() < start);
    let runs_row = &dom[start..start + dom[start..].find("</details>").unwrap()];
    assert!(runs_row.contains("<details open"), "{runs_row}");
    let rows: Vec<&str> = runs_row.split("<tr class=\"run\"").skip(1).collect();
    assert_eq!(rows.len(), 5, "{runs_row}");
    for run in &rows {
        assert!(
            cell(run, "error").contains("disk full on /var/spool"),
            "{run}"
        );
        let duration = cell(run, "duration");
        assert!(
            duration.ends_with(" ms") || duration.ends_with(" s"),
            "{run}"
        );
        assert!(datetime(run, "started").is_some(), "{run}");
    }
    assert!(rows.iter().any(|r| cell(r, "outcome") == "dead"));
    assert!(!dom.contains("data-runs-of=\"quiet\""), "{dom}");
}

/// A job that fails shows its recent runs — outcome, attempt, start, duration, error — in
/// `status --json` (`recent`, newest first, at most 5), in `status JOB`'s table, in
/// `/api/status` and on the page, in a detail row under the job (docs/design.md#recent-runs).
// See: issues/20
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_job_shows_its_recent_runs_with_duration_and_error() {
    let env = setup("e2e_page_runs");
    let sweep = "sleep 0.3; echo 'disk full on /var/spool' >&2; exit 3";
    let cfg = Cfg::new()
        // Each instance's retry overlaps the next instance: let both run, so every run shows
        // the failure.
        .job(
            "spool-sweep",
            every("1s").task("sweep").text("overlap", "allow"),
        )
        .job("quiet", cron("0 3 * * *").task("sweep"))
        .task(
            "sweep",
            shell(sweep)
                .with("max_retries", "1")
                .text("retry_base", "1s"),
        );
    let config = env.config_file(&cfg);
    let mut worker = env.worker_on("worker", &config);
    let (mut beat, port) = env.beat_serving("beat", &config);

    // A first attempt that failed (retried) and a second that went to the dead letters.
    let shown = |doc: &Value| {
        let runs = recent(doc, "spool-sweep");
        runs.len() == 5
            && runs.iter().any(|r| shows_the_failure(r, "failed", 0))
            && runs.iter().any(|r| shows_the_failure(r, "dead", 1))
    };
    expect(
        WAIT,
        &[&beat, &worker],
        "failed and dead runs in status --json",
        || shown(&env.status_json(&config)),
    );
    let doc = env.status_json(&config);
    let runs = recent(&doc, "spool-sweep");
    let text = |r: &Value, field: &str| r[field].as_str().unwrap().to_owned();
    let finished: Vec<String> = runs.iter().map(|r| text(r, "finished_at")).collect();
    let mut newest_first = finished.clone();
    newest_first.sort_by(|a, b| b.cmp(a));
    assert_eq!(finished, newest_first, "newest first: {doc}");
    assert!(runs
        .iter()
        .all(|r| text(r, "key").starts_with("spool-sweep@")));
    assert_eq!(recent(&doc, "quiet"), &[] as &[Value]);

    // The table: none by default, the recent runs for one job.
    let (_, table, _) = env.run("drumline", &["--config", &config, "status"]);
    assert!(!table.contains("recent runs of"), "{table}");
    let (status, table, err) = env.run("drumline", &["--config", &config, "status", "spool-sweep"]);
    assert!(status.success(), "{err}");
    let listed = after(&table, "recent runs of spool-sweep:\n", "recent runs");
    let lines: Vec<&str> = listed.lines().take_while(|l| !l.is_empty()).collect();
    assert!(lines[0].starts_with("KEY") && lines[0].contains("DURATION"));
    assert_eq!(lines.len(), 6, "{table}");
    let failed = |l: &&str| l.starts_with("spool-sweep@") && l.contains("disk full on /var/spool");
    assert!(lines[1..].iter().all(failed), "{table}");

    // /api/status carries the same runs; the page shows them under the job.
    expect_status(port, &[&beat], |api| {
        recent(api, "spool-sweep")
            .iter()
            .any(|r| shows_the_failure(r, "dead", 1))
    });
    let dom = chromium(&env, &format!("http://127.0.0.1:{port}/"), &["--dump-dom"]);
    assert_runs_row(&dom);
    stop(&mut [&mut beat, &mut worker]);
}
