//! The status page acts (docs/design.md#status-page), in a real browser: headless Chromium,
//! driven over the DevTools protocol, types the API token into the page and presses a job's
//! buttons; the job is paused (the status document says so), a trigger runs once (its
//! effect line), a dead letter is replayed and then purged. Without the token, or from another origin, the same POST is refused; without
//! a token configured the page has no buttons. A failure's long, unbroken error does not push
//! the page wider than the window.

use drumline_e2e::cfg::{every, Cfg};
use drumline_e2e::probe::{api_request_with, argv, tails};
use drumline_e2e::{http_get, setup, unused_port, wait_until, Proc, TestEnv};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tungstenite::stream::MaybeTlsStream;

const WAIT: Duration = Duration::from_secs(60);
const TOKEN: &str = "page-token";

/// Headless Chromium with its DevTools endpoint on a port of its own, showing `url`; killed
/// (and its profile removed) on drop.
struct Browser {
    child: Child,
    profile: std::path::PathBuf,
    socket: tungstenite::WebSocket<MaybeTlsStream<TcpStream>>,
    next_id: u64,
}

impl Browser {
    fn open(env: &TestEnv, url: &str) -> Browser {
        let profile = env.path("chromium-profile");
        let mut child = Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
            ])
            .args(["--remote-debugging-port=0", "--window-size=1280,700"])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(url)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("chromium: install it with `scripts/services chromium`");
        let stderr = BufReader::new(child.stderr.take().expect("stderr"));
        let port = stderr
            .lines()
            .map_while(Result::ok)
            .find_map(|l| {
                Some(
                    l.split("ws://127.0.0.1:")
                        .nth(1)?
                        .split('/')
                        .next()?
                        .to_owned(),
                )
            })
            .and_then(|p| p.parse::<u16>().ok())
            .expect("chromium names its DevTools port");
        let page = page_socket(port, url);
        let (socket, _) = tungstenite::connect(page).expect("the DevTools WebSocket");
        let mut browser = Browser {
            child,
            profile,
            socket,
            next_id: 0,
        };
        let loaded = wait_until(WAIT, || browser.try_eval(LOADED) == Ok(Value::Bool(true)));
        assert!(loaded, "{url} never loaded");
        browser
    }

    /// Evaluates `script` in the page (awaiting a promise), returning its value.
    fn eval(&mut self, script: &str) -> Value {
        self.try_eval(script)
            .unwrap_or_else(|e| panic!("{script}: {e}"))
    }

    /// [`Browser::eval`], or the exception it threw (the page may be between two loads).
    fn try_eval(&mut self, script: &str) -> Result<Value, Value> {
        self.next_id += 1;
        let id = self.next_id;
        let params = json!({"expression": script, "awaitPromise": true, "returnByValue": true});
        let call = json!({"id": id, "method": "Runtime.evaluate", "params": params});
        self.socket.send(call.to_string().into()).expect("send");
        loop {
            let message = self.socket.read().expect("a DevTools message");
            let Ok(text) = message.into_text() else {
                continue;
            };
            let answer: Value = serde_json::from_str(&text).expect("JSON");
            if answer["id"] == id {
                if !answer["result"]["exceptionDetails"].is_null() || answer["error"].is_object() {
                    return Err(answer);
                }
                return Ok(answer["result"]["result"]["value"].clone());
            }
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// Whether the status page has loaded.
const LOADED: &str = "document.readyState === 'complete' && !!document.getElementById('jobs')";

/// The DevTools WebSocket URL of the tab showing `url`.
fn page_socket(port: u16, url: &str) -> String {
    let mut found = None;
    let listed = wait_until(WAIT, || {
        let Some(body) = tab_list(port) else {
            return false;
        };
        let tabs: Vec<Value> = serde_json::from_str(&body).unwrap_or_default();
        found = tabs
            .iter()
            .find(|t| t["type"] == "page" && t["url"].as_str() == Some(url))
            .and_then(|t| t["webSocketDebuggerUrl"].as_str().map(str::to_owned));
        found.is_some()
    });
    assert!(listed, "chromium never showed {url}");
    found.expect("a tab")
}

/// Chromium's `/json/list`: its answer has a `Content-Length` and the connection stays open,
/// so the body is read to that length.
fn tab_list(port: u16) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    // The tabs' WebSocket URLs name the host this request names.
    let request = format!("GET /json/list HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut got = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        let text = String::from_utf8_lossy(&got);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())?
            })?;
            if body.len() >= length {
                return Some(body[..length].to_owned());
            }
        }
        let n = stream.read(&mut chunk).ok().filter(|n| *n > 0)?;
        got.extend_from_slice(&chunk[..n]);
    }
}

/// Opens the page at `url` afresh (well inside its 5 s refresh), types `token` into its token
/// field, presses `action`'s button of `job`, and returns what the page then says of it.
fn press(env: &TestEnv, url: &str, token: &str, action: &str, job: &str) -> String {
    let mut browser = Browser::open(env, url);
    let script = format!(
        "(async () => {{ \
         const said = document.getElementById('action-result'); said.textContent = ''; \
         window.confirm = () => true; \
         document.getElementById('api-token').value = {token:?}; \
         document.querySelector('button[data-action=\"{action}\"][data-job=\"{job}\"]').click(); \
         for (let i = 0; i < 200 && !said.textContent; i++) \
           await new Promise(r => setTimeout(r, 50)); \
         return said.textContent; }})()"
    );
    browser
        .eval(&script)
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// `POST path` to `port` with the token and `headers`: the status code.
fn post(port: u16, path: &str, headers: &[(&str, &str)]) -> u16 {
    let request = format!("POST {path}");
    api_request_with(port, &request, Some(TOKEN), headers, "").map_or(0, |(code, _, _)| code)
}

/// `tick`, hourly, appends its key; `broken`, hourly, fails at once with a 3,000-character
/// error of one word (`max_retries = 0`).
fn config(env: &TestEnv) -> String {
    let long = "head -c 3000 /dev/zero | tr '\\0' x >&2; exit 3";
    let cfg = Cfg::new()
        .job("tick", every("1h").task("append"))
        .job("broken", every("1h").task("broken"))
        .task("append", env.appender("effects", 0.0))
        .task(
            "broken",
            argv(&["/bin/sh", "-c", long]).with("max_retries", "0"),
        );
    env.config_file(&cfg)
}

/// The status document's entry for `job`, when the page answers.
fn job_status(port: u16, job: &str) -> Option<Value> {
    let (200, body) = http_get(port, "/api/status")? else {
        return None;
    };
    let doc: Value = serde_json::from_str(&body).ok()?;
    let jobs = doc["jobs"].as_array()?;
    jobs.iter().find(|j| j["job"] == job).cloned()
}

#[test]
fn chromium_pauses_triggers_and_replays_with_the_token_and_nothing_without() {
    let env = setup("page_actions");
    let config = config(&env);
    let worker = env.worker_on("worker", &config);
    let port = unused_port();
    let addr = format!("127.0.0.1:{port}");
    let args = ["--config", config.as_str(), "--metrics-addr", &addr];
    let beat = env.beat_with_env("beat", &args, &[("DRUMLINE_API_TOKEN", TOKEN)]);
    let procs: [&Proc; 2] = [&beat, &worker];
    let serving =
        || http_get(port, "/").is_some_and(|(c, b)| c == 200 && b.contains("data-action"));
    assert!(wait_until(WAIT, serving), "{}", tails(&procs));
    let url = format!("http://127.0.0.1:{port}/");

    let refused = press(&env, &url, "wrong", "pause", "tick");
    assert!(refused.starts_with("refused (401)"), "{refused}");
    assert_eq!(job_status(port, "tick").expect("tick")["paused"], false);
    assert_eq!(press(&env, &url, TOKEN, "pause", "tick"), "paused tick");
    assert_eq!(job_status(port, "tick").expect("tick")["paused"], true);
    let said = press(&env, &url, TOKEN, "trigger", "tick");
    assert!(said.starts_with("triggered tick key="), "{said}");
    let ran = wait_until(WAIT, || env.lines("effects").len() == 1);
    assert!(ran, "{}", tails(&procs));

    // Another origin, or none, is refused even with the token.
    let evil = [("Origin", "http://evil.example")];
    assert_eq!(post(port, "/actions/resume/tick", &evil), 403);
    assert_eq!(post(port, "/actions/resume/tick", &[]), 403);
    assert_eq!(job_status(port, "tick").expect("tick")["paused"], true);

    // A failure's long error stays inside the window.
    let said = press(&env, &url, TOKEN, "trigger", "broken");
    assert!(said.starts_with("triggered broken"), "{said}");
    let failed = || job_status(port, "broken").is_some_and(|j| j["last_failure"].is_string());
    assert!(wait_until(WAIT, failed), "{}", tails(&procs));
    let mut browser = Browser::open(&env, &url);
    let wide = "[document.documentElement.scrollWidth, window.innerWidth, \
        document.getElementById('jobs').scrollWidth, \
        document.querySelectorAll('table.runs').length]";
    let sizes = browser.eval(wide);
    let (page, window) = (sizes[0].as_u64().unwrap(), sizes[1].as_u64().unwrap());
    assert!(
        sizes[3].as_u64() >= Some(1),
        "no recent runs shown: {sizes}"
    );
    assert!(
        page <= window,
        "{page} px wide in a {window} px window: {sizes}"
    );
    drop(browser);

    // Its dead letter: replayed (it fails again and is dead again), then purged.
    let dead = || dead_letters(&env, &config);
    assert!(wait_until(WAIT, || dead() == 1), "{}", tails(&procs));
    let said = press(&env, &url, TOKEN, "dead-letters", "replay");
    assert_eq!(said, "replayed 1 dead letters (0 not replayable)");
    let runs =
        || job_status(port, "broken").map_or(0, |j| j["recent"].as_array().map_or(0, Vec::len));
    assert!(wait_until(WAIT, || runs() >= 2), "{}", tails(&procs));
    assert!(wait_until(WAIT, || dead() == 1), "{}", tails(&procs));
    let said = press(&env, &url, TOKEN, "dead-letters", "purge");
    assert_eq!(said, "purged 1 dead letters");
    assert_eq!(dead(), 0);
}

/// How many dead letters `drumline dlq list --json` lists (`usize::MAX` when it fails).
fn dead_letters(env: &TestEnv, config: &str) -> usize {
    let (status, out, _) = env.run("drumline", &["--config", config, "dlq", "list", "--json"]);
    let listed: Vec<Value> = serde_json::from_str(&out).unwrap_or_default();
    if status.success() {
        listed.len()
    } else {
        usize::MAX
    }
}
