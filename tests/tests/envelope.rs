//! The wire contract (docs/envelope.md): every envelope the beat, the worker (retry copies,
//! dead letters) and the producer client write validates against `docs/envelope.schema.json`;
//! a Python producer (`examples/python/publish.py`, pika) that writes only `key`, `task` and
//! `args`, or adds a field drumline does not know, gets each message run exactly once.

use drumline_e2e::cfg::{every, shell, Cfg};
use drumline_e2e::scenario::{take_dead_letters, Scenario};
use drumline_e2e::snoop::{Snoop, Snooped};
use drumline_e2e::{TestEnv, AMQP_URL};
use drumline_shared::client::{Message, Producer};
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The schema, compiled with format checks (uuid, date-time) on.
fn validator() -> jsonschema::Validator {
    let text = std::fs::read_to_string(repo().join("docs/envelope.schema.json")).unwrap();
    let schema: serde_json::Value = serde_json::from_str(&text).unwrap();
    jsonschema::options()
        .should_validate_formats(true)
        .build(&schema)
        .expect("docs/envelope.schema.json is a valid schema")
}

/// Panics with every schema error of `body`, naming `what` wrote it.
fn assert_valid(validator: &jsonschema::Validator, what: &str, body: &[u8]) {
    let value: serde_json::Value = serde_json::from_slice(body).unwrap();
    let errors: Vec<String> = validator
        .iter_errors(&value)
        .map(|e| format!("{}: {e}", e.instance_path))
        .collect();
    assert!(
        errors.is_empty(),
        "{what} wrote {value}, against the schema: {errors:?}"
    );
}

/// The bodies of every dead letter of the namespace (taken off `{ns}.dead`).
async fn dead_bodies(env: &TestEnv) -> Vec<Vec<u8>> {
    let letters = take_dead_letters(env).await;
    letters.into_iter().map(|m| m.delivery.data).collect()
}

#[test]
fn the_schema_accepts_the_documented_messages_and_refuses_what_workers_refuse() {
    let validator = validator();
    let ok = |v: serde_json::Value| validator.is_valid(&v);
    assert!(ok(json!({"key": "k", "task": "t"})));
    assert!(ok(
        json!({"key": "k", "task": "t", "args": {}, "priority": 9})
    ));
    assert!(!ok(json!({"task": "t"})), "key is required");
    assert!(!ok(json!({"key": "k"})), "task is required");
    assert!(!ok(json!({"key": "two words", "task": "t"})));
    assert!(!ok(json!({"key": "k", "task": "t", "v": 2})));
    assert!(!ok(
        json!({"key": "k", "task": "t", "scheduled_for": "soon"})
    ));
    assert!(!ok(json!({"key": "k", "task": "t", "id": "not-a-uuid"})));
    // The examples of docs/envelope.md.
    let page = std::fs::read_to_string(repo().join("docs/envelope.md")).unwrap();
    let examples: Vec<&str> = page
        .split("```json\n")
        .skip(1)
        .filter_map(|rest| rest.split_once("```").map(|(json, _)| json))
        .collect();
    let shown = "docs/envelope.md shows a minimal and a full message";
    assert!(examples.len() >= 2, "{shown}");
    for example in examples {
        assert_valid(&validator, "docs/envelope.md", example.as_bytes());
    }
}

/// `flaky` (job, every second) fails its first attempt (a retry copy), `doomed` fails for good
/// (a dead letter).
fn flaky_and_doomed() -> Cfg {
    let flaky = shell("[ \"$DRUMLINE_ATTEMPT\" -gt 0 ]").with("retry_base", "\"200ms\"");
    let doomed = shell("exit 3").with("permanent_exit_codes", "[3]");
    let job = every("1s").with("args", "{ region = \"eu\" }");
    Cfg::new()
        .task("flaky", flaky)
        .task("doomed", doomed)
        .job("flaky", job)
}

/// What the producer client sends: `doomed-1` with args and an expiry, `later-1` delayed.
fn produced() -> [Message; 2] {
    let doomed = Message::new("doomed").key("doomed-1").args(json!({"n": 1}));
    let later = Message::new("flaky").key("later-1");
    [
        doomed.expires(Duration::from_secs(600)),
        later.delay(Duration::from_millis(300)),
    ]
}

/// Every kind of envelope is among `seen`: a beat's, its retry copy, and both produced.
fn every_kind(seen: &[Snooped]) -> bool {
    let any = |pred: &dyn Fn(&Snooped) -> bool| seen.iter().any(pred);
    any(&|m| m.envelope.job.is_some() && m.envelope.attempt == 0)
        && any(&|m| m.envelope.job.is_some() && m.envelope.attempt == 1)
        && any(&|m| m.envelope.key == "doomed-1")
        && any(&|m| m.envelope.key == "later-1" && m.envelope.attempt == 0)
}

/// Who wrote the snooped message `m`.
fn writer(m: &Snooped) -> &'static str {
    match (&m.envelope.job, m.envelope.attempt) {
        (Some(_), 0) => "the beat",
        (_, n) if n > 0 => "the worker (a retry copy)",
        _ => "the producer client",
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_envelope_drumline_writes_validates_against_the_schema() {
    let mut sc = Scenario::start("e2e_envelope_schema", 0, 1, |_| flaky_and_doomed()).await;
    let snoop = Snoop::start(&mut sc, "default");
    sc.start_beat();
    let producer = Producer::connect(AMQP_URL, &sc.ns).await.unwrap();
    for message in produced() {
        producer.publish(&message).await.unwrap();
    }
    let what = "not every kind of envelope was seen";
    sc.wait(WAIT, what, || every_kind(&snoop.messages()));
    sc.wait_state("doomed-1", "dead").await;
    sc.beats.clear();
    let validator = validator();
    for m in snoop.messages() {
        assert_valid(&validator, writer(&m), &m.body);
    }
    let letters = dead_bodies(&sc).await;
    assert!(!letters.is_empty());
    for body in letters {
        assert_valid(&validator, "the worker (a dead letter)", &body);
    }
    producer.close().await;
}

/// The Python of the virtualenv `scripts/services`' `ensure_pika` makes (`target/pyenv`).
fn python_with_pika() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test binary>
    let target = exe.parent().and_then(|d| d.parent()?.parent()).unwrap();
    let python = target.join("pyenv/bin/python3");
    assert!(
        python.exists(),
        "{} is missing: run `source scripts/services && ensure_pika` (scripts/test does)",
        python.display()
    );
    python
}

/// Runs `examples/python/publish.py` against namespace `ns`: its messages for `task`, keys
/// prefixed `prefix`.
fn publish_from_python(ns: &str, task: &str, prefix: &str) {
    let out = std::process::Command::new(python_with_pika())
        .arg(repo().join("examples/python/publish.py"))
        .args([AMQP_URL, ns, task, prefix])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_python_producer_with_a_minimal_envelope_and_an_unknown_field_runs_each_once() {
    let sc = Scenario::start("e2e_envelope_python", 0, 1, |env| {
        let runs = env.path("runs").display().to_string();
        let report = shell(&format!("echo \"$DRUMLINE_KEY $(cat)\" >> {runs}"));
        Cfg::new().task("report", report)
    })
    .await;
    publish_from_python(&sc.ns, "report", "py");
    for key in ["py-minimal", "py-extra"] {
        sc.wait_state(key, "done").await;
    }
    sc.wait_drained("default").await;
    let mut runs = sc.lines("runs");
    runs.sort();
    assert_eq!(
        runs,
        ["py-extra {}", "py-minimal {\"region\":\"eu\"}"],
        "each ran exactly once, with its args"
    );
    let dead = dead_bodies(&sc).await;
    assert!(dead.is_empty(), "{} were dead-lettered", dead.len());
}
