//! Bad configs are refused by both binaries before anything touches the broker: exit code 2 and
//! one message naming the file, the job and the key.

use drumline_e2e::setup;

const TASK: &str = "[tasks.t]\ncommand = [\"/bin/true\"]\n";

fn cases() -> Vec<(&'static str, String, [&'static str; 2])> {
    vec![
        (
            "unknown key",
            format!("[[jobs]]\nname = \"j1\"\ntask = \"t\"\nevery = \"1s\"\nfrequency = 2\n{TASK}"),
            ["job \"j1\"", "`frequency`"],
        ),
        (
            "cron and every",
            format!("[[jobs]]\nname = \"j2\"\ntask = \"t\"\nevery = \"1s\"\ncron = \"* * * * *\"\n{TASK}"),
            ["job \"j2\"", "`cron`"],
        ),
        (
            "neither cron nor every",
            format!("[[jobs]]\nname = \"j3\"\ntask = \"t\"\n{TASK}"),
            ["job \"j3\"", "`cron`"],
        ),
        (
            "bad duration",
            format!("[[jobs]]\nname = \"j4\"\ntask = \"t\"\nevery = \"often\"\n{TASK}"),
            ["job \"j4\"", "`every`"],
        ),
        (
            "missing task",
            format!("[[jobs]]\nname = \"j5\"\ntask = \"ghost\"\nevery = \"1s\"\n{TASK}"),
            ["job \"j5\"", "`task`"],
        ),
        (
            "duplicate job names",
            format!("[[jobs]]\nname = \"j6\"\ntask = \"t\"\nevery = \"1s\"\n[[jobs]]\nname = \"j6\"\ntask = \"t\"\nevery = \"2s\"\n{TASK}"),
            ["job \"j6\"", "`name`"],
        ),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_configs_exit_2_with_one_clear_message_and_declare_nothing() {
    let env = setup("e2e_badcfg");
    for (what, body, needles) in cases() {
        let path = env.config(&format!("{}.toml", what.replace(' ', "_")), &body);
        let file = path.to_str().unwrap();
        for (bin, args) in [
            ("drumline-beat", vec!["--config", file, "check"]),
            ("drumline-beat", vec!["--config", file]),
            ("drumline-worker", vec!["--config", file]),
        ] {
            let (status, _stdout, stderr) = env.run(bin, &args);
            assert_eq!(status.code(), Some(2), "{what}: {bin} {args:?}: {stderr}");
            let message = stderr.trim();
            let lines = message.lines().count();
            assert_eq!(lines, 1, "{what}: one message, got:\n{message}");
            assert!(message.contains(file), "{what}: names the file: {message}");
            for needle in needles {
                assert!(
                    message.contains(needle),
                    "{what}: {message:?} lacks {needle:?}"
                );
            }
        }
    }
    let declared = env.exchange_exists(&env.names().tasks_exchange()).await;
    assert!(!declared, "nothing may be declared for a bad config");
    let queue = env.queue_len(&env.names().work_queue("default")).await;
    assert_eq!(queue, None, "nothing may be declared for a bad config");
}

#[test]
fn a_good_config_checks_ok() {
    let env = setup("e2e_goodcfg");
    let path = env.config("ok.toml", &format!("[[jobs]]\nname = \"j\"\ntask = \"t\"\ncron = \"0 30 2 * * *\"\ntimezone = \"America/New_York\"\n{TASK}"));
    let (status, stdout, stderr) = env.run(
        "drumline-beat",
        &["check", "--config", path.to_str().unwrap()],
    );
    assert!(status.success(), "{stderr}");
    assert!(stdout.contains("ok"), "{stdout}");
}
