//! `[broker] queue_type` and `urls` on the shared broker (docs/design.md "Scale-out"): a quorum
//! namespace runs scheduled, ad-hoc and retried work end to end on one node; a namespace whose
//! queues exist as another type is refused at start (exit 2, the fix named, nothing declared);
//! a node list whose first node does not answer is served by the next, and
//! `DRUMLINE_AMQP_URL` beats the list. (Failover under a dying node: `cluster.rs`.)

use drumline_e2e::cfg::{every, shell, Cfg};
use drumline_e2e::probe::{expect, expect_async, stop};
use drumline_e2e::{
    adhoc, queue_info_on, queue_type_on, queues_on, setup, toml_string, unused_port, TestEnv,
};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn config(env: &TestEnv, name: &str, queue_type: &str) -> String {
    let flaky = "[ \"$DRUMLINE_ATTEMPT\" -ge 1 ] || exit 1; echo \"$DRUMLINE_KEY\" >> {}";
    let flaky = shell(&flaky.replace("{}", &env.path("flaky").display().to_string()));
    let tick = every("1s").texts(&[("misfire", "catch_up"), ("overlap", "queue")]);
    let cfg = Cfg::new()
        .set("broker", "queue_type", &toml_string(queue_type))
        .job("tick", tick.task("append"))
        .task("append", env.appender("ticks", 0.0))
        .task("flaky", flaky.text("retry_base", "1s"));
    env.config_named(name, &cfg)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_quorum_namespace_runs_jobs_ad_hoc_tasks_and_retries_on_one_node() {
    let env = setup("e2e_quorum_one_node");
    let cfg = config(&env, "drumline.toml", "quorum");
    let mut worker = env.worker_ready("worker", &cfg).await;
    let mut beat = env.beat_on("beat", &cfg);
    let names = env.names();
    for queue in [names.work_queue("default"), names.dead()] {
        let kind = queue_type_on(None, &queue);
        assert_eq!(kind.as_deref(), Some("quorum"), "{queue}");
    }

    env.publish(&adhoc("once-only", "flaky")).await;
    let ran = || env.lines("ticks").len() >= 3 && !env.lines("flaky").is_empty();
    expect(
        WAIT,
        &[&beat, &worker],
        "three ticks and the flaky retry",
        ran,
    );
    stop(&mut [&mut beat, &mut worker]);
    // The retry went through a classic delay queue back into the quorum queue, once.
    assert_eq!(env.lines("flaky"), ["once-only"]);
    let delay_queues = queues_on(None, &format!("{}.delay.", env.ns), "type");
    assert!(!delay_queues.is_empty(), "no delay queue was used");
    let classic = delay_queues.iter().all(|(_, t)| t == "classic");
    assert!(classic, "{delay_queues:?}");
    // An explicit delivery limit on the work queue only (RabbitMQ 4 would default it to 20).
    let limit = "{\"x-delivery-limit\",1000000}";
    let work_args = queue_info_on(None, &names.work_queue("default"), "arguments").unwrap();
    assert!(work_args.contains(limit), "{work_args}");
    let dead_args = queue_info_on(None, &names.dead(), "arguments").unwrap();
    assert!(!dead_args.contains("x-delivery-limit"), "{dead_args}");
    assert_eq!(env.run_state("once-only").await.as_deref(), Some("done"));
    drumline_e2e::assert_contiguous_exactly_once(&env.lines("ticks"), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_changed_queue_type_is_refused_at_start_with_the_fix() {
    let env = setup("e2e_queue_type_change");
    let classic = config(&env, "classic.toml", "classic");
    let mut worker = env.worker_ready("classic-worker", &classic).await;
    stop(&mut [&mut worker]);
    let names = env.names();
    let queue = names.work_queue("default");
    // A message waits in the classic queue: the refusal must leave it there.
    env.publish(&adhoc("waiting", "append")).await;
    // Polled: under load the broker's count can trail the confirm.
    let waits = || async { env.queue_len(&queue).await == Some(1) };
    expect_async(WAIT, &[], "the message waits in the classic queue", waits).await;

    let quorum = config(&env, "quorum.toml", "quorum");
    // One after the other: each refuses on its own.
    for bin in ["drumline-worker", "drumline-beat"] {
        let start = if bin == "drumline-worker" {
            TestEnv::worker_on
        } else {
            TestEnv::beat_on
        };
        let mut proc = start(&env, bin, &quorum);
        let status = proc.wait(WAIT);
        let log = proc.log();
        assert_eq!(status.code(), Some(2), "{bin} should exit 2:\n{log}");
        for needle in [
            "queue_type",
            "\"quorum\"",
            "exists as a classic queue",
            "drain",
            "new `namespace`",
        ] {
            assert!(log.contains(needle), "{bin}: {needle:?} missing:\n{log}");
        }
    }
    // Nothing declared over it, nothing consumed, nothing ran.
    for queue in [&queue, &names.dead()] {
        assert_eq!(
            queue_type_on(None, queue).as_deref(),
            Some("classic"),
            "{queue}"
        );
    }
    assert_eq!(env.queue_len(&queue).await, Some(1));
    assert!(env.lines("ticks").is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_first_node_that_answers_serves_and_the_env_url_beats_the_list() {
    let env = setup("e2e_broker_urls");
    let dead = |port: u16| toml_string(&format!("amqp://guest:guest@127.0.0.1:{port}/%2f"));
    let cfg = |name: &str, urls: &str| {
        let cfg = Cfg::new().set("broker", "urls", &format!("[{urls}]"));
        let cfg = cfg.job("tick", every("1s").task("append"));
        env.config_named(name, &cfg.task("append", env.appender("ticks", 0.0)))
    };
    // The worker's first node does not answer; the second is the shared broker.
    let worker_cfg = cfg(
        "worker.toml",
        &format!(
            "{}, {}",
            dead(unused_port()),
            toml_string(drumline_e2e::AMQP_URL)
        ),
    );
    // The beat's list holds no live node at all: only the environment's URL can serve it.
    let beat_cfg = cfg("beat.toml", &dead(unused_port()));
    let mut worker = env.worker_ready("worker", &worker_cfg).await;
    let mut beat = env.beat_with_env(
        "beat",
        &["--config", &beat_cfg],
        &[("DRUMLINE_AMQP_URL", drumline_e2e::AMQP_URL)],
    );
    env.expect_lines("ticks", 3, &[&beat, &worker]);
    stop(&mut [&mut beat, &mut worker]);
    drumline_e2e::assert_contiguous_exactly_once(&env.lines("ticks"), 3);
}
