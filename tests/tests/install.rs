//! The README's set-up line, as a new user runs it: `cargo install --locked --path cli` from a
//! clean clone installs one `drumline`, which runs every role and the demo config's `check`.
//!
//! The clone is of this repository's committed `HEAD`. It builds (debug, to stay fast) into
//! `target/install-check`, kept between runs, with the clone always at the same path there, so a
//! second run rebuilds only what changed.

use drumline_e2e::{binary, setup};
use std::path::Path;
use std::process::{Command, Output};

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("it runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?}: {}\n{stderr}", out.status);
    out
}

#[test]
fn cargo_install_from_a_clean_clone_installs_one_drumline_that_runs() {
    let env = setup("install");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repo");
    let drumline = binary("drumline");
    let target = drumline.parent().and_then(Path::parent).expect("target");
    let target = target.join("install-check");
    let clone = target.join("src");
    let _ = std::fs::remove_dir_all(&clone);
    run(Command::new("git")
        .args(["clone", "-q"])
        .arg(repo)
        .arg(&clone));
    let root = env.path("root");
    let install = [
        "install",
        "--locked",
        "--offline",
        "--debug",
        "--quiet",
        "--path",
    ];
    run(Command::new("cargo")
        .args(install)
        .arg(clone.join("cli"))
        .arg("--root")
        .arg(&root)
        .arg("--target-dir")
        .arg(&target));

    let installed: Vec<String> = std::fs::read_dir(root.join("bin"))
        .expect("bin/")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(installed, ["drumline"]);
    let drumline = root.join("bin/drumline");
    let demo = clone.join("examples/demo.toml");
    let check = run(Command::new(&drumline)
        .arg("--config")
        .arg(&demo)
        .arg("check"));
    let said = String::from_utf8_lossy(&check.stdout);
    assert!(said.contains(": ok ("), "{said}");
    for role in ["beat", "worker"] {
        let help = run(Command::new(&drumline).args([role, "--help"]));
        assert!(
            !help.stdout.is_empty(),
            "drumline {role} --help says nothing"
        );
    }
}
