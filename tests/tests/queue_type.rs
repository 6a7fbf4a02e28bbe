//! `[broker] queue_type` and `urls` on the shared broker (docs/design.md "Scale-out"): a quorum
//! namespace runs scheduled, ad-hoc and retried work end to end on one node; a namespace whose
//! queues exist as another type is refused at start (exit 2, the fix named, nothing declared);
//! a node list whose first node does not answer is served by the next, and
//! `DRUMLINE_AMQP_URL` beats the list. (Failover under a dying node: `cluster.rs`.)

use drumline_e2e::{
    adhoc, queue_info_on, queue_type_on, queues_on, setup, toml_string, unused_port, wait_until,
    TestEnv,
};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn config(env: &TestEnv, name: &str, queue_type: &str) -> String {
    let cfg = env.config(
        name,
        &format!(
            r#"
[broker]
queue_type = "{queue_type}"

[[jobs]]
name = "tick"
task = "append"
every = "1s"
misfire = "catch_up"
overlap = "queue"

[tasks.append]
command = {cmd}

[tasks.flaky]
command = ["/bin/sh", "-c", {flaky}]
retry_base = "1s"
"#,
            cmd = env.append_key_command("ticks", 0.0),
            flaky = drumline_e2e::toml_string(&format!(
                "[ \"$DRUMLINE_ATTEMPT\" -ge 1 ] || exit 1; echo \"$DRUMLINE_KEY\" >> {}",
                env.path("flaky").display()
            )),
        ),
    );
    cfg.to_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_quorum_namespace_runs_jobs_ad_hoc_tasks_and_retries_on_one_node() {
    let env = setup("e2e_quorum_one_node");
    let cfg = config(&env, "drumline.toml", "quorum");
    let mut worker = env.worker("worker", &["--config", &cfg]);
    env.wait_for_topology(&worker).await;
    let mut beat = env.beat("beat", &["--config", &cfg]);
    let names = env.names();
    assert_eq!(
        queue_type_on(None, &names.work_queue("default")).as_deref(),
        Some("quorum")
    );
    assert_eq!(
        queue_type_on(None, &names.dead()).as_deref(),
        Some("quorum")
    );

    env.publish(&adhoc("once-only", "flaky")).await;
    assert!(
        wait_until(WAIT, || env.lines("ticks").len() >= 3
            && !env.lines("flaky").is_empty()),
        "ticks {:?}, flaky {:?}\n{}\n{}",
        env.lines("ticks"),
        env.lines("flaky"),
        beat.log_tail(20),
        worker.log_tail(20)
    );
    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(20)).success());
    // The retry went through a classic delay queue back into the quorum queue, once.
    assert_eq!(env.lines("flaky"), ["once-only"]);
    let delay_queues = queues_on(None, &format!("{}.delay.", env.ns), "type");
    assert!(!delay_queues.is_empty(), "no delay queue was used");
    assert!(
        delay_queues.iter().all(|(_, t)| t == "classic"),
        "{delay_queues:?}"
    );
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
    let mut worker = env.worker("classic-worker", &["--config", &classic]);
    env.wait_for_topology(&worker).await;
    assert!(worker.terminate(Duration::from_secs(20)).success());
    let names = env.names();
    let queue = names.work_queue("default");
    // A message waits in the classic queue: the refusal must leave it there.
    env.publish(&adhoc("waiting", "append")).await;
    // Polled: under load the broker's count can trail the confirm.
    assert!(
        drumline_e2e::wait_until_async(WAIT, || async { env.queue_len(&queue).await == Some(1) })
            .await,
        "the message waits in the classic queue: {:?}",
        env.queue_len(&queue).await
    );

    let quorum = config(&env, "quorum.toml", "quorum");
    for bin in ["drumline-worker", "drumline-beat"] {
        let mut proc = if bin == "drumline-worker" {
            env.worker("quorum-worker", &["--config", &quorum])
        } else {
            env.beat("quorum-beat", &["--config", &quorum])
        };
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
    assert_eq!(queue_type_on(None, &queue).as_deref(), Some("classic"));
    assert_eq!(
        queue_type_on(None, &names.dead()).as_deref(),
        Some("classic")
    );
    assert_eq!(env.queue_len(&queue).await, Some(1));
    assert!(env.lines("ticks").is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_first_node_that_answers_serves_and_the_env_url_beats_the_list() {
    let env = setup("e2e_broker_urls");
    let dead = |port: u16| toml_string(&format!("amqp://guest:guest@127.0.0.1:{port}/%2f"));
    let cfg = |name: &str, urls: &str| {
        let path = env.config(
            name,
            &format!(
                r#"
[broker]
urls = [{urls}]

[[jobs]]
name = "tick"
task = "append"
every = "1s"

[tasks.append]
command = {cmd}
"#,
                cmd = env.append_key_command("ticks", 0.0),
            ),
        );
        path.to_str().unwrap().to_owned()
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
    let mut worker = env.worker("worker", &["--config", &worker_cfg]);
    env.wait_for_topology(&worker).await;
    let mut beat = env.beat_with_env(
        "beat",
        &["--config", &beat_cfg],
        &[("DRUMLINE_AMQP_URL", drumline_e2e::AMQP_URL)],
    );
    assert!(
        wait_until(WAIT, || env.lines("ticks").len() >= 3),
        "{}\n{}",
        beat.log_tail(20),
        worker.log_tail(20)
    );
    assert!(beat.terminate(Duration::from_secs(10)).success());
    assert!(worker.terminate(Duration::from_secs(20)).success());
    drumline_e2e::assert_contiguous_exactly_once(&env.lines("ticks"), 3);
}
