//! A webhook receiver for the HTTP executor's tests: a real HTTP/1.1 server (axum) on a free
//! port of 127.0.0.1 that records every request (when it arrived, path, headers, body) and
//! answers as the test's script says, per path and per how many times that key came before.

use axum::body::{to_bytes, Body};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::Response;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One request as received.
#[derive(Debug, Clone)]
pub struct Received {
    /// When the server had read its head (before any hang).
    pub at: Instant,
    /// The request path.
    pub path: String,
    /// The method.
    pub method: String,
    /// Headers by lower-case name (the last value of a repeated one).
    pub headers: BTreeMap<String, String>,
    /// The body.
    pub body: Vec<u8>,
}

impl Received {
    /// Header `name` (lower case), or `""`.
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", String::as_str)
    }

    /// The request's `Idempotency-Key`.
    pub fn key(&self) -> &str {
        self.header("idempotency-key")
    }
}

/// How the server answers one request.
#[derive(Debug, Clone)]
pub enum Reply {
    /// This status, these headers, this body.
    With(u16, Vec<(String, String)>, String),
    /// Waits this long, then answers this status (the client has usually gone by then).
    Hang(Duration, u16),
}

impl Reply {
    /// Just a status, no body.
    pub fn status(code: u16) -> Self {
        Reply::With(code, vec![], String::new())
    }
}

type Script = dyn Fn(&str, usize) -> Reply + Send + Sync;

struct Shared {
    received: Mutex<Vec<Received>>,
    script: Box<Script>,
}

/// The running receiver; stopped when dropped.
pub struct Hook {
    /// Its port on 127.0.0.1.
    pub port: u16,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

impl Hook {
    /// Starts a receiver (on the current tokio runtime) that answers a request for `path`
    /// with `script(path, n)`, `n` being how many requests for that path and key came before.
    pub async fn start(script: impl Fn(&str, usize) -> Reply + Send + Sync + 'static) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the webhook receiver");
        let port = listener.local_addr().expect("local addr").port();
        let shared = Arc::new(Shared {
            received: Mutex::new(Vec::new()),
            script: Box::new(script),
        });
        let app = axum::Router::new()
            .fallback(answer)
            .with_state(shared.clone());
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Hook {
            port,
            shared,
            server,
        }
    }

    /// `http://127.0.0.1:PORT{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Every request received so far, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.shared.received.lock().expect("lock").clone()
    }

    /// The requests received for `path`, in arrival order.
    pub fn on(&self, path: &str) -> Vec<Received> {
        let mut all = self.received();
        all.retain(|r| r.path == path);
        all
    }
}

impl Drop for Hook {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn answer(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let at = Instant::now();
    let (head, body) = request.into_parts();
    let body = to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default()
        .to_vec();
    let headers = head
        .headers
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    let received = Received {
        at,
        path: head.uri.path().to_owned(),
        method: head.method.as_str().to_owned(),
        headers,
        body,
    };
    let reply = {
        let mut all = shared.received.lock().expect("lock");
        let before = all
            .iter()
            .filter(|r| r.path == received.path && r.key() == received.key())
            .count();
        let reply = (shared.script)(&received.path, before);
        all.push(received);
        reply
    };
    let (code, headers, text) = match reply {
        Reply::With(code, headers, text) => (code, headers, text),
        Reply::Hang(wait, code) => {
            tokio::time::sleep(wait).await;
            (code, vec![], String::new())
        }
    };
    let mut response = Response::builder().status(StatusCode::from_u16(code).expect("status"));
    for (name, value) in headers {
        response = response.header(name, value);
    }
    response.body(Body::from(text)).expect("response")
}
