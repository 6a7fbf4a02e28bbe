//! `drumline-worker dlq list | replay | purge` against the real broker, Redis and worker.

use drumline_e2e::{setup, toml_string, wait_until, wait_until_async};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_are_listed_replayed_and_purged() {
    let mut env = setup("e2e_dlq");
    let broken = env.path("broken");
    std::fs::write(&broken, "").unwrap();
    // Fails permanently while the flag file exists.
    let script = format!(
        "[ -e {flag} ] && exit 3; echo \"$DRUMLINE_KEY\" >> {effects}",
        flag = broken.display(),
        effects = env.path("effects").display()
    );
    let cfg = env.config(
        "drumline.toml",
        &format!(
            "[worker]\nlease = \"3s\"\n[tasks.fragile]\ncommand = [\"/bin/sh\", \"-c\", {}]\npermanent_exit_codes = [3]\n",
            toml_string(&script)
        ),
    );
    let cfg = cfg.to_str().unwrap();
    let dead = env.names().dead();
    let mut worker = env.worker("worker", &["--config", cfg]);
    for key in ["k1", "k2"] {
        let (status, _, stderr) = env.run(
            "drumline-beat",
            &["--config", cfg, "publish", "fragile", "--key", key],
        );
        assert!(status.success(), "{stderr}");
    }
    // An instance that expires while queued where nobody consumes: the broker dead-letters it.
    env.forget_queue_later(env.names().work_queue("idle"));
    let (status, _, stderr) = env.run(
        "drumline-beat",
        &[
            "--config",
            cfg,
            "publish",
            "fragile",
            "--key",
            "k3",
            "--queue",
            "idle",
            "--expires",
            "100ms",
        ],
    );
    assert!(status.success(), "{stderr}");
    assert!(
        wait_until_async(WAIT, || async { env.queue_len(&dead).await == Some(3) }).await,
        "{:?}\n{}",
        env.queue_len(&dead).await,
        worker.log_tail(20)
    );

    let list = || {
        let (status, stdout, stderr) = env.run(
            "drumline-worker",
            &["--config", cfg, "dlq", "list", "--json"],
        );
        assert!(status.success(), "{stderr}");
        let mut rows: Vec<serde_json::Value> = serde_json::from_str(&stdout).unwrap();
        rows.sort_by_key(|r| r["key"].as_str().unwrap_or_default().to_owned());
        rows
    };
    let rows = list();
    assert_eq!(rows.len(), 3, "{rows:?}");
    assert_eq!(
        (
            rows[0]["key"].as_str(),
            rows[0]["reason"].as_str(),
            rows[0]["attempts"].as_u64()
        ),
        (Some("k1"), Some("permanent"), Some(1))
    );
    assert_eq!(rows[0]["error"], "exit code 3");
    assert_eq!(rows[0]["task"], "fragile");
    assert!(rows[0]["dead_at"].is_string());
    assert_eq!(
        (
            rows[2]["key"].as_str(),
            rows[2]["reason"].as_str(),
            rows[2]["attempts"].as_u64()
        ),
        (Some("k3"), Some("expired"), Some(0))
    );
    assert!(rows[2]["dead_at"].is_string(), "from x-death");
    // Listing leaves them in place.
    assert_eq!(env.queue_len(&dead).await, Some(3));

    // Fix the cause, replay one: it runs, the others stay.
    std::fs::remove_file(&broken).unwrap();
    let (status, stdout, stderr) =
        env.run("drumline-worker", &["--config", cfg, "dlq", "replay", "k1"]);
    assert!(status.success(), "{stderr}");
    assert_eq!(stdout.trim(), "replayed k1");
    assert!(
        wait_until(WAIT, || env.lines("effects") == vec!["k1"]),
        "{}",
        worker.log_tail(20)
    );
    let keys: Vec<_> = list()
        .iter()
        .map(|r| r["key"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(keys, vec!["k2", "k3"]);

    let (status, _, stderr) = env.run(
        "drumline-worker",
        &["--config", cfg, "dlq", "replay", "no-such-key"],
    );
    assert_eq!(status.code(), Some(1));
    assert!(
        stderr.contains("not found in the dead letters: no-such-key"),
        "{stderr}"
    );

    let (status, stdout, _) = env.run(
        "drumline-worker",
        &["--config", cfg, "dlq", "purge", "--yes"],
    );
    assert!(status.success());
    assert_eq!(stdout.trim(), "purged 2 dead letters");
    assert_eq!(env.queue_len(&dead).await, Some(0));
    assert!(worker.terminate(Duration::from_secs(20)).success());
    assert_eq!(env.lines("effects"), vec!["k1"], "k2 was purged, never run");
}
