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

use drumline_e2e::{http_get, setup, toml_string, unused_port, wait_until, TestEnv};
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

#[tokio::test(flavor = "multi_thread")]
async fn chromium_renders_every_job_the_leader_paused_and_stale() {
    let env = setup("e2e_page");
    let append = env.append_key_command("effects", 0.0);
    let body = format!(
        r#"
[worker]
concurrency = 4
lease = "5s"

[[jobs]]
name = "heartbeat"
task = "append"
every = "2s"

[[jobs]]
name = "nightly-report"
task = "append"
every = "1s"

[[jobs]]
name = "sync-invoices"
task = "broken"
every = "1s"

[[jobs]]
name = "rollup"
task = "slow"
every = "3s"
overlap = "allow"

[[jobs]]
name = "cleanup"
task = "append"
cron = "0 3 * * *"
timezone = "Europe/Berlin"

[tasks.append]
command = {append}

[tasks.broken]
command = ["/bin/false"]
max_retries = 0

[tasks.slow]
command = ["/bin/sleep", "10"]
"#
    );
    let cfg_path = env.config("drumline.toml", &body);
    let cfg = cfg_path.to_str().unwrap();
    // Paused before the beat starts: none of its instants is ever published.
    let (status, stdout, stderr) = env.run(
        "drumline-beat",
        &["--config", cfg, "pause", "nightly-report"],
    );
    assert!(status.success(), "{stderr}");
    assert!(stdout.contains("paused 1 job"), "{stdout}");

    let mut worker = env.worker("worker", &["--config", cfg]);
    let port = unused_port();
    let addr = format!("127.0.0.1:{port}");
    let mut beat = env.beat("beat", &["--config", cfg, "--metrics-addr", &addr]);

    // `heartbeat` succeeds, `rollup` runs (10 s per instance), `sync-invoices` never succeeds
    // and turns stale two periods after its first run.
    let ready = wait_until(WAIT, || {
        api_status(port).is_some_and(|s| {
            let jobs = &s["jobs"];
            s["leader"]["pid"] == beat.pid()
                && jobs[0]["last_success"].is_string()
                && jobs[3]["running"].as_u64() >= Some(1)
                && jobs[2]["stale"] == true
                && jobs[2]["last_failure"].is_string()
                // Read from the broker at most every 5 s: it may lag the dead letter.
                && s["dead_letters"].as_u64() >= Some(1)
                // The worker announced itself; the broker counts it on the queue.
                && s["workers"][0]["pid"] == worker.pid()
                && s["queues"][0]["consumers"] == 1
        })
    });
    assert!(
        ready,
        "{:?}\n{}\n{}",
        http_get(port, "/api/status"),
        beat.log_tail(20),
        worker.log_tail(20)
    );

    // /api/status is the status document: the same jobs, fields and flags as `status --json`.
    let api = api_status(port).unwrap();
    let (status, stdout, stderr) = env.run("drumline-beat", &["--config", cfg, "status", "--json"]);
    assert!(status.success(), "{stderr}");
    let cli: Value = serde_json::from_str(&stdout).unwrap();
    let shape = |doc: &Value| -> Vec<(String, Vec<String>, bool)> {
        doc["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| {
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
    let flags: Vec<(bool, bool)> = api["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| {
            (
                j["paused"].as_bool().unwrap(),
                j["stale"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        flags,
        [
            (false, false),
            (true, false),
            (false, true),
            (false, false),
            (false, false)
        ],
        "{api}"
    );
    let (code, head, _) = http(port, "HEAD", "/api/status").unwrap();
    assert_eq!(code, 200);
    assert_eq!(header(&head, "content-type"), "application/json", "{head}");
    let (code, head, _) = http(port, "HEAD", "/").unwrap();
    assert_eq!(code, 200);
    assert_eq!(
        header(&head, "content-type"),
        "text/html; charset=utf-8",
        "{head}"
    );

    // The page as a browser renders it.
    let dom = chromium(&env, &format!("http://{addr}/"), &["--dump-dom"]);
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
        assert_eq!(cell(row(&dom, name), "name"), name);
    }
    let leader = dom
        .split("<p id=\"leader\">")
        .nth(1)
        .unwrap_or_else(|| panic!("no leader in {dom}"));
    assert!(
        leader.contains(&format!("pid <span class=\"pid\">{}</span>", beat.pid())),
        "{leader}"
    );
    assert!(
        leader.contains(&format!(
            "<span class=\"host\">{}</span>",
            api["leader"]["host"].as_str().unwrap()
        )),
        "{leader}"
    );
    let nightly = row(&dom, "nightly-report");
    assert_eq!(cell(nightly, "paused"), "PAUSED", "{nightly}");
    assert_eq!(cell(nightly, "stale"), "", "{nightly}");
    assert_eq!(cell(nightly, "last-success"), "–", "{nightly}");
    let sync = row(&dom, "sync-invoices");
    assert_eq!(cell(sync, "stale"), "STALE", "{sync}");
    assert_eq!(cell(sync, "paused"), "", "{sync}");
    assert!(datetime(sync, "last-failure").is_some(), "{sync}");
    let heartbeat = row(&dom, "heartbeat");
    assert_eq!(
        (cell(heartbeat, "paused"), cell(heartbeat, "stale")),
        (String::new(), String::new())
    );
    assert_eq!(cell(heartbeat, "schedule"), "every 2s");
    assert!(datetime(heartbeat, "last-success").is_some(), "{heartbeat}");
    assert!(datetime(heartbeat, "next-due").is_some(), "{heartbeat}");
    let rollup = row(&dom, "rollup");
    assert!(
        cell(rollup, "running").parse::<u64>().unwrap() >= 1,
        "{rollup}"
    );
    assert_eq!(cell(row(&dom, "cleanup"), "zone"), "Europe/Berlin");
    let dead = dom
        .split("<p id=\"dead-letters\"")
        .nth(1)
        .unwrap_or_else(|| panic!("no dead letters in {dom}"));
    assert!(dead.contains("Dead letters: "), "{dead}");
    assert!(dom.contains("<span id=\"worker-count\">1</span>"), "{dom}");
    let worker_row = dom
        .split("<tr data-worker=\"")
        .nth(1)
        .unwrap_or_else(|| panic!("no worker row in {dom}"));
    assert!(
        worker_row.contains(&format!("<td>{}</td>", worker.pid())),
        "{worker_row}"
    );
    let queue_row = dom
        .split("<tr data-queue=\"default\"")
        .nth(1)
        .unwrap_or_else(|| panic!("no queue row in {dom}"));
    assert!(
        queue_row.contains("<td class=\"consumers\">1</td>"),
        "{queue_row}"
    );

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
    assert!(
        !env.lines("effects")
            .iter()
            .any(|k| k.starts_with("nightly-report@")),
        "{:?}",
        env.lines("effects")
    );

    // A screenshot taken the same way is a PNG.
    let shot = env.path("status-page.png");
    chromium(
        &env,
        &format!("http://{addr}/"),
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1200,600",
        ],
    );
    let png = std::fs::read(&shot).expect("screenshot written");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    if let Ok(target) = std::env::var("DRUMLINE_PAGE_SCREENSHOT") {
        std::fs::copy(&shot, Path::new(&target)).expect("copy the screenshot");
    }
    let _ = std::fs::remove_file(&shot);

    // SIGHUP: the page follows the reloaded jobs, as the beat does (`cleanup` removed,
    // `added-later` added).
    let reloaded = body.replace("name = \"cleanup\"", "name = \"added-later\"");
    env.config("drumline.toml", &reloaded);
    beat.signal(libc::SIGHUP);
    let followed = wait_until(WAIT, || {
        api_status(port).is_some_and(|s| {
            let names: Vec<&str> = s["jobs"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|j| j["job"].as_str())
                .collect();
            names.contains(&"added-later") && !names.contains(&"cleanup")
        })
    });
    assert!(followed, "{:?}", http_get(port, "/api/status"));
    let dom = chromium(&env, &format!("http://{addr}/"), &["--dump-dom"]);
    assert_eq!(cell(row(&dom, "added-later"), "zone"), "Europe/Berlin");
    assert!(!dom.contains("data-job=\"cleanup\""), "{dom}");

    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(30)).success());
}

/// Redis accepts the connection and never answers (a listener nobody reads): the page and
/// `/api/status` answer 503 with the reason within the page's wait, and the HTML one still
/// refreshes itself.
#[tokio::test(flavor = "multi_thread")]
async fn a_stuck_redis_makes_a_503_with_the_reason_not_a_hung_page() {
    let env = setup("e2e_page_stuck");
    let stuck = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let redis_port = stuck.local_addr().unwrap().port();
    let cfg = env.config(
        "drumline.toml",
        &format!(
            "[redis]\nurl = {}\n[[jobs]]\nname = \"heartbeat\"\ntask = \"append\"\nevery = \"1s\"\n\
             [tasks.append]\ncommand = {}\n",
            toml_string(&format!("redis://127.0.0.1:{redis_port}/0")),
            env.append_key_command("effects", 0.0)
        ),
    );
    let port = unused_port();
    let addr = format!("127.0.0.1:{port}");
    let mut beat = env.beat(
        "beat",
        &["--config", cfg.to_str().unwrap(), "--metrics-addr", &addr],
    );
    assert!(
        wait_until(WAIT, || http_get(port, "/healthz").is_some()),
        "{}",
        beat.log_tail(20)
    );
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
    assert!(beat.terminate(Duration::from_secs(10)).success());
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

/// A beat with one idle job (daily at 03:00) serving its page on a free port, `extra` put at
/// the head of its config: the beat and the port.
fn beat_with_page(env: &TestEnv, extra: &str) -> (drumline_e2e::Proc, u16) {
    let cfg = env.config(
        "drumline.toml",
        &format!(
            "{extra}[[jobs]]\nname = \"daily\"\ntask = \"append\"\ncron = \"0 3 * * *\"\n\
             [tasks.append]\ncommand = {}\n",
            env.append_key_command("effects", 0.0)
        ),
    );
    let port = unused_port();
    let addr = format!("127.0.0.1:{port}");
    let beat = env.beat(
        "beat",
        &["--config", cfg.to_str().unwrap(), "--metrics-addr", &addr],
    );
    (beat, port)
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
    let (mut beat, port) = beat_with_page(&env, "");
    let pid = beat.pid();
    // The beat's own (publishing) connection, before the page made any.
    assert!(
        wait_until(WAIT, || broker_connections(pid) >= 1
            && http_get(port, "/healthz").is_some()),
        "{}",
        beat.log_tail(20)
    );
    let own = broker_connections(pid);

    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let done = done.clone();
        std::thread::spawn(move || {
            let (mut most, mut evidence) = (0, String::new());
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let now = broker_connections(pid);
                if now > most {
                    (most, evidence) = (now, connection_evidence(pid, 5672));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            (most, evidence)
        })
    };
    let paths: Vec<&str> = (0..300)
        .map(|i| if i % 2 == 0 { "/" } else { "/api/status" })
        .collect();
    let answers = burst(port, &paths);
    // And a few one after another, each after the cached count may have expired.
    let mut later = Vec::new();
    for _ in 0..3 {
        later.push(http(port, "GET", "/api/status").expect("an answer"));
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let (most, evidence) = sampler.join().unwrap();
    assert!(
        most <= own + 1,
        "{most} broker connections at once ({evidence}); the beat's own: {own}\n{}",
        beat.log_tail(20)
    );

    let ok = answers.iter().filter(|a| a.1 == 200).count();
    let busy = answers
        .iter()
        .filter(|a| a.1 == 503 && header(&a.2, "retry-after") == "1")
        .count();
    eprintln!(
        "{most} broker connections at most (the beat's own: {own}); {ok} rendered, {busy} busy"
    );
    assert_eq!(ok + busy, 300, "every request answered 200 or busy");
    assert!(ok >= 1, "none rendered");
    for (code, _, body) in later {
        assert_eq!(code, 200, "{body}");
        let status: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(status["dead_letters"], 0, "{body}");
    }
    assert!(beat.terminate(Duration::from_secs(10)).success());
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
    let broker = format!("[broker]\nurl = {}\n", toml_string(&broker));
    let (mut beat, port) = beat_with_page(&env, &broker);
    let pid = beat.pid();
    // The counts are known once the page has connected and read them.
    assert!(
        wait_until(WAIT, || connections_to(pid, proxy.port) >= 1
            && api_status(port).is_some_and(|s| s["dead_letters"] == 0)),
        "the counts never became known\n{}",
        beat.log_tail(20)
    );
    proxy.set(drumline_e2e::proxy::Fault::Delay(Duration::from_millis(
        350,
    )));
    let own = connections_to(pid, proxy.port);
    // The cached counts expire; reads over the slow link, each slower than a request waits.
    let start = Instant::now();
    let (mut most, mut evidence) = (own, String::new());
    let mut sample = || {
        let now = connections_to(pid, proxy.port);
        if now > most {
            (most, evidence) = (now, connection_evidence(pid, proxy.port));
        }
    };
    let fresh = wait_until(Duration::from_secs(40), || {
        sample();
        let status = api_status(port);
        sample();
        // Past the 5 s the count read before the delay was kept for: a read over the slow link.
        start.elapsed() > Duration::from_secs(6) && status.is_some_and(|s| s["dead_letters"] == 0)
    });
    assert!(
        fresh,
        "no count read over the slow link\n{}",
        beat.log_tail(20)
    );
    assert!(
        most <= own + 1,
        "{most} broker connections at once ({evidence}); the beat's own: {own}\n{}",
        beat.log_tail(20)
    );
    proxy.set(drumline_e2e::proxy::Fault::Pass);
    assert!(beat.terminate(Duration::from_secs(10)).success());
}

/// At most four requests are rendered at once (docs/design.md): with Redis stuck, four requests
/// wait for it (and get the 503 that says so after the page's wait); the other eight of twelve
/// concurrent requests are answered 503 with `Retry-After: 1` at once, before any of the four.
// See: issues/16
#[tokio::test(flavor = "multi_thread")]
async fn a_fifth_concurrent_request_is_answered_503_with_retry_after_at_once() {
    let env = setup("e2e_page_busy");
    let stuck = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let redis_port = stuck.local_addr().unwrap().port();
    let cfg = env.config(
        "drumline.toml",
        &format!(
            "[redis]\nurl = {}\n[[jobs]]\nname = \"heartbeat\"\ntask = \"append\"\nevery = \"1s\"\n\
             [tasks.append]\ncommand = {}\n",
            toml_string(&format!("redis://127.0.0.1:{redis_port}/0")),
            env.append_key_command("effects", 0.0)
        ),
    );
    let port = unused_port();
    let addr = format!("127.0.0.1:{port}");
    let mut beat = env.beat(
        "beat",
        &["--config", cfg.to_str().unwrap(), "--metrics-addr", &addr],
    );
    assert!(
        wait_until(WAIT, || http_get(port, "/healthz").is_some()),
        "{}",
        beat.log_tail(20)
    );
    let paths: Vec<&str> = (0..12)
        .map(|i| if i % 2 == 0 { "/" } else { "/api/status" })
        .collect();
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
    assert!(beat.terminate(Duration::from_secs(10)).success());
}

/// The page lists at most `limit` jobs (default 500), from `offset`, and shows the total
/// (docs/design.md); `/api/status` carries `total` beside the listed `jobs`.
// See: issues/16
#[tokio::test(flavor = "multi_thread")]
async fn the_page_lists_at_most_limit_jobs_and_shows_the_total() {
    let env = setup("e2e_page_rows");
    let jobs: String = (0..503)
        .map(|i| format!("[[jobs]]\nname = \"j{i:03}\"\ntask = \"t\"\ncron = \"0 3 * * *\"\n"))
        .collect();
    let cfg = env.config(
        "drumline.toml",
        &format!("{jobs}[tasks.t]\ncommand = [\"/bin/true\"]\n"),
    );
    let port = unused_port();
    let addr = format!("127.0.0.1:{port}");
    let mut beat = env.beat(
        "beat",
        &["--config", cfg.to_str().unwrap(), "--metrics-addr", &addr],
    );
    assert!(
        wait_until(WAIT, || api_status(port).is_some()),
        "{}",
        beat.log_tail(20)
    );
    let names = |doc: &Value| -> Vec<String> {
        doc["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["job"].as_str().unwrap().to_owned())
            .collect()
    };
    let first = api_status(port).unwrap();
    assert_eq!(first["total"], 503);
    let listed = names(&first);
    assert_eq!(listed.len(), 500);
    assert_eq!((listed[0].as_str(), listed[499].as_str()), ("j000", "j499"));

    let (code, body) = http_get(port, "/api/status?limit=2&offset=501").unwrap();
    assert_eq!(code, 200, "{body}");
    let tail: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(names(&tail), ["j501", "j502"]);
    assert_eq!(tail["total"], 503);
    let (_, body) = http_get(port, "/api/status?offset=600").unwrap();
    let past: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((names(&past).len(), &past["total"]), (0, &Value::from(503)));
    let (code, _) = http_get(port, "/api/status?limit=many").unwrap();
    assert_eq!(code, 400);

    let (code, page) = http_get(port, "/").unwrap();
    assert_eq!(code, 200);
    assert_eq!(page.matches("<tr class=\"job").count(), 500);
    assert!(page.contains("Jobs 1–500 of 503"), "{page}");
    let (_, page) = http_get(port, "/?offset=500").unwrap();
    assert_eq!(page.matches("<tr class=\"job").count(), 3);
    assert!(page.contains("Jobs 501–503 of 503"), "{page}");
    assert!(page.contains("data-job=\"j502\""));
    assert!(beat.terminate(Duration::from_secs(10)).success());
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

/// A job that fails shows its recent runs — outcome, attempt, start, duration, error — in
/// `status --json` (`recent`, newest first, at most 5), in `status JOB`'s table, in
/// `/api/status` and on the page, in a detail row under the job (docs/design.md#recent-runs).
// See: issues/20
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_job_shows_its_recent_runs_with_duration_and_error() {
    let env = setup("e2e_page_runs");
    let cfg_path = env.config(
        "drumline.toml",
        r#"
[[jobs]]
name = "spool-sweep"
task = "sweep"
every = "1s"
# Each instance's retry overlaps the next instance: let both run, so every run shows the failure.
overlap = "allow"

[[jobs]]
name = "quiet"
task = "sweep"
cron = "0 3 * * *"

[tasks.sweep]
command = ["/bin/sh", "-c", "sleep 0.3; echo 'disk full on /var/spool' >&2; exit 3"]
max_retries = 1
retry_base = "1s"
"#,
    );
    let cfg = cfg_path.to_str().unwrap();
    let mut worker = env.worker("worker", &["--config", cfg]);
    let port = unused_port();
    let addr = format!("127.0.0.1:{port}");
    let mut beat = env.beat("beat", &["--config", cfg, "--metrics-addr", &addr]);

    // A first attempt that failed (retried) and a second that went to the dead letters.
    let status_json = || {
        let (status, stdout, stderr) = env.run("drumline", &["--config", cfg, "status", "--json"]);
        assert!(status.success(), "{stderr}");
        serde_json::from_str::<Value>(&stdout).unwrap()
    };
    let shown = wait_until(WAIT, || {
        let doc = status_json();
        let runs = recent(&doc, "spool-sweep");
        runs.len() == 5
            && runs.iter().any(|r| shows_the_failure(r, "failed", 0))
            && runs.iter().any(|r| shows_the_failure(r, "dead", 1))
    });
    assert!(
        shown,
        "{}\n{}\n{}",
        status_json(),
        beat.log_tail(20),
        worker.log_tail(20)
    );
    let doc = status_json();
    let runs = recent(&doc, "spool-sweep");
    let finished: Vec<&str> = runs
        .iter()
        .map(|r| r["finished_at"].as_str().unwrap())
        .collect();
    let mut newest_first = finished.clone();
    newest_first.sort_by(|a, b| b.cmp(a));
    assert_eq!(finished, newest_first, "newest first: {doc}");
    assert!(runs
        .iter()
        .all(|r| r["key"].as_str().unwrap().starts_with("spool-sweep@")));
    assert_eq!(recent(&doc, "quiet"), &[] as &[Value]);

    // The table: none by default, the recent runs for one job.
    let (_, table, _) = env.run("drumline", &["--config", cfg, "status"]);
    assert!(!table.contains("recent runs of"), "{table}");
    let (status, table, stderr) = env.run("drumline", &["--config", cfg, "status", "spool-sweep"]);
    assert!(status.success(), "{stderr}");
    let listed = table
        .split("recent runs of spool-sweep:\n")
        .nth(1)
        .unwrap_or_else(|| panic!("no recent runs in\n{table}"));
    let lines: Vec<&str> = listed.lines().take_while(|l| !l.is_empty()).collect();
    assert!(lines[0].starts_with("KEY") && lines[0].contains("DURATION"));
    assert_eq!(lines.len(), 6, "{table}");
    assert!(
        lines[1..]
            .iter()
            .all(|l| l.starts_with("spool-sweep@") && l.contains("disk full on /var/spool")),
        "{table}"
    );

    // /api/status carries the same runs; the page shows them under the job.
    assert!(
        wait_until(WAIT, || api_status(port).is_some_and(|api| {
            recent(&api, "spool-sweep")
                .iter()
                .any(|r| shows_the_failure(r, "dead", 1))
        })),
        "{:?}",
        http_get(port, "/api/status")
    );
    let dom = chromium(&env, &format!("http://{addr}/"), &["--dump-dom"]);
    let start = dom
        .find("data-runs-of=\"spool-sweep\"")
        .unwrap_or_else(|| panic!("no recent runs row in\n{dom}"));
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

    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(30)).success());
}
