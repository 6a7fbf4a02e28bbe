//! `Collector`: a tiny OTLP/HTTP receiver (JSON) on a free port that keeps every span POSTed
//! to `/v1/traces`, for the traces tests (docs/operations.md#traces).

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// One span as received: its name, ids (lowercase hex) and attributes.
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    /// `publish`, `claim`, `run`, `finish`.
    pub name: String,
    /// 32 hex digits.
    pub trace_id: String,
    /// 16 hex digits.
    pub span_id: String,
    /// 16 hex digits, empty for a root span.
    pub parent_span_id: String,
    /// `drumline.key`, if set.
    pub key: Option<String>,
}

/// The receiver; it runs until the test process ends.
pub struct Collector {
    port: u16,
    spans: Arc<Mutex<Vec<Received>>>,
}

impl Collector {
    /// Listens on 127.0.0.1 at a free port.
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let kept = spans.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let kept = kept.clone();
                std::thread::spawn(move || serve(stream, &kept));
            }
        });
        Collector { port, spans }
    }

    /// The `[telemetry] otlp_endpoint` that reaches it.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Received> {
        self.spans.lock().expect("spans").clone()
    }
}

/// Answers each request of one connection: a POST's spans kept, `200 {}`.
fn serve(stream: TcpStream, kept: &Mutex<Vec<Received>>) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut writer = stream;
    loop {
        let mut length = 0;
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            let header = header.trim_end().to_ascii_lowercase();
            if header.is_empty() {
                break;
            }
            if let Some(n) = header.strip_prefix("content-length:") {
                length = n.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        if line.starts_with("POST /v1/traces") {
            let doc: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            kept.lock().expect("spans").extend(spans_of(&doc));
        }
        let answer =
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        if writer.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

/// The spans of an OTLP/JSON `ExportTraceServiceRequest`.
fn spans_of(doc: &Value) -> Vec<Received> {
    let list = |v: &Value, key: &str| v[key].as_array().cloned().unwrap_or_default();
    let text = |v: &Value, key: &str| v[key].as_str().unwrap_or_default().to_owned();
    let mut out = Vec::new();
    for resource in list(doc, "resourceSpans") {
        for scope in list(&resource, "scopeSpans") {
            for span in list(&scope, "spans") {
                let key = list(&span, "attributes")
                    .into_iter()
                    .find(|a| a["key"] == "drumline.key")
                    .and_then(|a| a["value"]["stringValue"].as_str().map(str::to_owned));
                out.push(Received {
                    name: text(&span, "name"),
                    trace_id: text(&span, "traceId"),
                    span_id: text(&span, "spanId"),
                    parent_span_id: text(&span, "parentSpanId"),
                    key,
                });
            }
        }
    }
    out
}
