//! Trace context end to end (docs/envelope.md#trace-context): a producer's `traceparent`
//! reaches the run in the same trace — `drumline publish` continues its `TRACEPARENT`, the beat
//! starts a trace per instance, a retry keeps it, a bad one is ignored; shell tasks get
//! `TRACEPARENT`, HTTP tasks a `traceparent` header, each the run's own span; with `[telemetry]`
//! an OTLP collector receives the spans of one trace.
// See: issues/36

use drumline_e2e::cfg::{every, shell, Cfg};
use drumline_e2e::hook::{Hook, Reply};
use drumline_e2e::otlp::Collector;
use drumline_e2e::probe::api_request_with;
use drumline_e2e::scenario::{run_checked, Scenario, WAIT};
use drumline_e2e::{adhoc, binary, toml_string};
use drumline_shared::broker::long_string;
use drumline_shared::trace::TraceParent;
use lapin::types::FieldTable;
use lapin::BasicProperties;

const GIVEN: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// A worker whose task `trace` appends `KEY ATTEMPT TRACEPARENT` to `effects`, fails its
/// first attempt when the key starts with `retry` (retried 100 ms later) and fails for good
/// one starting with `dead` until the file `fixed` exists; `more` adds to the config.
async fn tracing_worker(test: &str, more: impl FnOnce(Cfg) -> Cfg) -> Scenario {
    let mut sc = Scenario::new(test, |env| {
        let (effects, fixed) = (env.path("effects"), env.path("fixed"));
        let script = format!(
            "echo \"$DRUMLINE_KEY $DRUMLINE_ATTEMPT $TRACEPARENT\" >> {}; \
             case \"$DRUMLINE_KEY\" in retry*) [ \"$DRUMLINE_ATTEMPT\" -ge 1 ];; \
             dead*) [ -e {} ] || exit 3;; esac",
            effects.display(),
            fixed.display()
        );
        let task = shell(&script)
            .with("permanent_exit_codes", "[3]")
            .with("max_retries", "2")
            .with("retry_base", "\"100ms\"");
        more(Cfg::new().task("trace", task))
    });
    sc.start_workers(1).await;
    sc
}

/// Each line of `effects`: (key, attempt, the run's `TRACEPARENT`, parsed).
fn runs(sc: &Scenario) -> Vec<(String, u32, TraceParent)> {
    let line = |l: &String| {
        let mut words = l.split(' ');
        let key = words.next()?.to_owned();
        let attempt = words.next()?.parse().ok()?;
        let trace = words.next()?.parse().unwrap_or_else(|e| panic!("{l}: {e}"));
        Some((key, attempt, trace))
    };
    sc.lines("effects").iter().filter_map(line).collect()
}

/// The run of `key`'s attempt `attempt`, once it ran.
fn run_of(sc: &Scenario, key: &str, attempt: u32) -> TraceParent {
    let found = || {
        let runs = runs(sc).into_iter();
        runs.filter(|(k, a, _)| k == key && *a == attempt)
            .map(|(_, _, trace)| trace)
            .next()
    };
    sc.wait(WAIT, format!("{key} attempt {attempt} ran"), || {
        found().is_some()
    });
    found().expect("ran")
}

/// Adds job `trace`, every second.
fn every_second(cfg: Cfg) -> Cfg {
    cfg.job("trace", every("1s"))
}

/// `drumline publish trace --key KEY` with `TRACEPARENT` = `parent` (none: unset).
fn publish_cli(sc: &Scenario, key: &str, parent: Option<&str>) {
    let mut publish = std::process::Command::new(binary("drumline"));
    publish.args(["--config", sc.cfg(), "publish", "trace", "--key", key]);
    match parent {
        Some(parent) => publish.env("TRACEPARENT", parent),
        None => publish.env_remove("TRACEPARENT"),
    };
    run_checked(&mut publish, "drumline publish");
}

#[tokio::test(flavor = "multi_thread")]
async fn publish_continues_the_producers_traceparent_into_the_shell_task() {
    let sc = tracing_worker("traces_publish", |c| c).await;
    publish_cli(&sc, "p1", Some(GIVEN));
    let given: TraceParent = GIVEN.parse().unwrap();
    let run = run_of(&sc, "p1", 0);
    assert_eq!(run.trace_id, given.trace_id, "the producer's trace");
    assert_ne!(run.span_id, given.span_id, "the run's own span");
    assert_eq!(run.flags, 1);

    // Without one, each publish starts a trace of its own.
    publish_cli(&sc, "p2", None);
    assert_ne!(run_of(&sc, "p2", 0).trace_id, given.trace_id);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_posted_to_the_api_continues_the_requests_traceparent() {
    let sc = tracing_worker("traces_api", |c| c).await;
    let (_beat, port) = sc.beat_with_api(sc.cfg(), "s3cret-token");
    let body = r#"{"task": "trace", "key": "a1"}"#;
    let headers = [("traceparent", GIVEN)];
    let posted = api_request_with(
        port,
        "POST /api/v1/tasks",
        Some("s3cret-token"),
        &headers,
        body,
    );
    assert_eq!(posted.map(|(status, ..)| status), Some(202));
    let given: TraceParent = GIVEN.parse().unwrap();
    let run = run_of(&sc, "a1", 0);
    assert_eq!(run.trace_id, given.trace_id, "the request's trace");
    assert_ne!(run.span_id, given.span_id);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retry_and_a_replay_keep_the_trace_and_a_bad_traceparent_is_ignored() {
    let sc = tracing_worker("traces_retry", |c| c).await;
    let traced = TraceParent::root();
    let env = drumline_shared::envelope::Envelope {
        trace: Some(traced),
        ..adhoc("retry-1", "trace")
    };
    sc.publish(&env).await;
    let (first, second) = (run_of(&sc, "retry-1", 0), run_of(&sc, "retry-1", 1));
    assert_eq!(first.trace_id, traced.trace_id);
    assert_eq!(second.trace_id, traced.trace_id, "the retry's trace");
    assert_ne!(first.span_id, second.span_id, "each run a span");

    // A dead letter replayed: still the same trace.
    let dead = drumline_shared::envelope::Envelope {
        trace: Some(traced),
        ..adhoc("dead-1", "trace")
    };
    sc.publish(&dead).await;
    sc.wait_dead_letters(1).await;
    std::fs::write(sc.path("fixed"), "").expect("fix");
    sc.run_ok("drumline-worker", &["dlq", "replay", "dead-1"]);
    sc.wait_state("dead-1", "done").await;
    let both: Vec<_> = runs(&sc).into_iter().filter(|r| r.0 == "dead-1").collect();
    assert_eq!(both.len(), 2, "{both:?}");
    assert!(
        both.iter().all(|r| r.2.trace_id == traced.trace_id),
        "{both:?}"
    );

    // Bad: uppercase hex. Ignored: the message runs, in a trace of its own.
    let bad = GIVEN.to_uppercase();
    let mut headers = FieldTable::default();
    headers.insert("traceparent".into(), long_string(&bad));
    let props = BasicProperties::default().with_headers(headers);
    let body = adhoc("bad-1", "trace").encode();
    sc.publish_raw("default", &body, props).await;
    let run = run_of(&sc, "bad-1", 0);
    assert_ne!(run.trace_id, GIVEN.parse::<TraceParent>().unwrap().trace_id);
    sc.wait_state("bad-1", "done").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn each_scheduled_instance_is_a_trace_of_its_own() {
    let mut sc = tracing_worker("traces_beat", every_second).await;
    sc.start_beat();
    sc.wait(WAIT, "two instances ran", || runs(&sc).len() >= 2);
    let runs = runs(&sc);
    assert!(runs[0].0.starts_with("trace@"), "{runs:?}");
    assert_ne!(runs[0].2.trace_id, runs[1].2.trace_id, "{runs:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_http_task_gets_a_traceparent_header_in_the_producers_trace() {
    let hook = Hook::start(|_, _| Reply::status(200)).await;
    let url = drumline_e2e::toml_string(&hook.url("/traced"));
    let task = drumline_e2e::cfg::Keys::default().with("http", &format!("{{ url = {url} }}"));
    let mut sc = Scenario::new("traces_http", |_| Cfg::new().task("hook", task));
    sc.start_workers(1).await;
    let traced = TraceParent::root();
    let env = drumline_shared::envelope::Envelope {
        trace: Some(traced),
        ..adhoc("h1", "hook")
    };
    sc.publish(&env).await;
    sc.wait_state("h1", "done").await;
    let received = hook.on("/traced");
    assert_eq!(received.len(), 1, "{received:#?}");
    let header: TraceParent = received[0].header("traceparent").parse().unwrap();
    assert_eq!(header.trace_id, traced.trace_id);
    assert_ne!(header.span_id, traced.span_id);
}

/// With `[telemetry] otlp_endpoint`, the spans reach a collector: `drumline publish`'s
/// `publish` under the producer's span, the worker's `claim`, `run` (the span the task was
/// given) and `finish` under it, all in the producer's trace; a scheduled instance's `publish`
/// (the beat's) and `run` share a trace too. Stopped, each process sends what it still held.
#[tokio::test(flavor = "multi_thread")]
async fn an_otlp_collector_sees_publish_and_run_spans_of_one_trace() {
    let collector = Collector::start();
    let endpoint = toml_string(&collector.endpoint());
    let mut sc = tracing_worker("traces_otlp", |c| {
        every_second(c).set("telemetry", "otlp_endpoint", &endpoint)
    })
    .await;
    sc.start_beat();
    publish_cli(&sc, "o1", Some(GIVEN));
    let run = run_of(&sc, "o1", 0);
    let scheduled = || runs(&sc).into_iter().find(|r| r.0.starts_with("trace@"));
    sc.wait(WAIT, "a scheduled instance ran", || scheduled().is_some());
    let scheduled = scheduled().expect("ran").2;
    sc.wait_state("o1", "done").await;
    sc.stop();

    let given: TraceParent = GIVEN.parse().unwrap();
    let named = |trace: &TraceParent, name: &str| {
        let spans = collector.spans().into_iter();
        spans
            .filter(|s| s.trace_id == trace.trace_hex() && s.name == name)
            .collect::<Vec<_>>()
    };
    let all_there = || {
        ["publish", "claim", "run", "finish"]
            .iter()
            .all(|n| !named(&given, n).is_empty())
    };
    sc.wait(WAIT, "the spans of o1's trace", all_there);
    let publish = &named(&given, "publish")[0];
    assert_eq!(
        publish.parent_span_id,
        given.span_hex(),
        "under the producer's span"
    );
    assert_eq!(publish.key.as_deref(), Some("o1"));
    let runs = named(&given, "run");
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(
        runs[0].span_id,
        run.span_hex(),
        "the span the task was given"
    );
    for name in ["claim", "run", "finish"] {
        let span = &named(&given, name)[0];
        assert_eq!(
            span.parent_span_id, publish.span_id,
            "{name} under the publish"
        );
    }
    let beat_trace =
        || !named(&scheduled, "publish").is_empty() && !named(&scheduled, "run").is_empty();
    sc.wait(WAIT, "the scheduled instance's publish and run", beat_trace);
    assert_eq!(named(&scheduled, "run")[0].span_id, scheduled.span_hex());
}

/// `examples/python/over_http.py`, the standard-library producer of docs/api.md: it delays a
/// task over the API with its `TRACEPARENT` as `traceparent`, reads the outcome over HTTP, and
/// the run was in its trace, not before `not_before`.
// See: issues/36
#[tokio::test(flavor = "multi_thread")]
async fn a_python_producer_delays_a_task_reads_its_outcome_and_shares_the_trace() {
    let sc = tracing_worker("traces_python", |c| c).await;
    let (_beat, port) = sc.beat_with_api(sc.cfg(), "s3cret-token");
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/python/over_http.py");
    let url = format!("http://127.0.0.1:{port}");
    let posted = std::time::Instant::now();
    let mut python = std::process::Command::new("python3");
    python
        .arg(&script)
        .args([url.as_str(), "trace", "1"])
        .env("DRUMLINE_API_TOKEN", "s3cret-token")
        .env("TRACEPARENT", GIVEN);
    let out = run_checked(&mut python, "over_http.py");
    let printed = String::from_utf8_lossy(&out.stdout);
    let words: Vec<&str> = printed.split_whitespace().collect();
    assert_eq!(words.get(1..), Some(&["done", "success"][..]), "{printed}");
    assert!(
        posted.elapsed() >= std::time::Duration::from_secs(1),
        "not before not_before"
    );
    let run = run_of(&sc, words[0], 0);
    assert_eq!(run.trace_id, GIVEN.parse::<TraceParent>().unwrap().trace_id);
}
