//! `args` is a JSON object everywhere (docs/envelope.md): a raw message with other `args` is a
//! `malformed` dead letter naming `args`, never run; the command line refuses them too.

use drumline_e2e::cfg::{every, Cfg, Keys};
use drumline_e2e::{adhoc, setup, wait_until};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread")]
async fn args_that_are_not_an_object_are_refused_and_dead_lettered_naming_args() {
    let env = setup("args_object");
    let append = Keys::default().with("command", &env.append_key_command("effects", 0.0));
    let cfg = Cfg::new()
        .task("t", append)
        .job("j", every("1h").with("task", "\"t\""));
    let path = env.write_config("drumline.toml", &cfg);
    let path = path.to_str().expect("utf-8");
    let worker = env.worker("worker", &["--config", path]);
    env.wait_for_topology(&worker).await;
    let mut message = adhoc("k-array", "t");
    message.args = serde_json::json!([1, 2]);
    env.publish(&message).await;
    let listed = || {
        let (_, out, _) = env.run("drumline", &["--config", path, "dlq", "list", "--json"]);
        serde_json::from_str::<serde_json::Value>(&out).unwrap_or_default()
    };
    let dead = wait_until(Duration::from_secs(30), || {
        listed().as_array().is_some_and(|l| !l.is_empty())
    });
    assert!(dead, "no dead letter\n{}", worker.log_tail(20));
    let letter = &listed()[0];
    assert_eq!(
        (letter["key"].as_str(), letter["reason"].as_str()),
        (Some("k-array"), Some("malformed"))
    );
    assert!(
        letter["error"].as_str().is_some_and(|e| e.contains("args")),
        "{letter}"
    );
    for command in [["publish", "t"], ["trigger", "j"]] {
        let mut args = vec!["--config", path];
        args.extend(command);
        args.extend(["--args", "[1,2]"]);
        let (status, _, err) = env.run("drumline", &args);
        assert_eq!(status.code(), Some(2), "{args:?}: {err}");
    }
    assert!(env.lines("effects").is_empty());
}
