//! The README's set-up line, as a new user runs it: `cargo install --locked --path cli` from a
//! clean clone installs one `drumline`, which runs every role and the demo config's `check`.
//!
//! The clone is of this repository's committed `HEAD`, always at `target/install-check/src`. It
//! builds (debug, to stay fast) in the suite's own target directory: only drumline's crates
//! compile again, the dependencies are the suite's. The install puts its `drumline` into
//! `target/debug` too, built from the same commit; no other test binary runs meanwhile (cargo
//! runs them one after another).

use drumline_e2e::{binary, setup};
use std::path::Path;
use std::process::{Command, Output};

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("it runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?}: {}\n{stderr}", out.status);
    out
}

/// `clone` holds a clean checkout of `repo`'s `HEAD`: cloned, or brought there (fetch, hard
/// reset, every untracked file removed), which leaves unchanged files as they were so cargo
/// rebuilds only what changed.
fn clean_clone(repo: &Path, clone: &Path) {
    if !clone.join(".git").is_dir() {
        run(Command::new("git")
            .args(["clone", "-q"])
            .arg(repo)
            .arg(clone));
        return;
    }
    let git = |args: &[&str]| run(Command::new("git").arg("-C").arg(clone).args(args));
    git(&["fetch", "-q", repo.to_str().expect("utf-8"), "HEAD"]);
    git(&["reset", "-q", "--hard", "FETCH_HEAD"]);
    git(&["clean", "-q", "-f", "-d", "-x"]);
}

#[test]
fn cargo_install_from_a_clean_clone_installs_one_drumline_that_runs() {
    let env = setup("install");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repo");
    let drumline = binary("drumline");
    let target = drumline.parent().and_then(Path::parent).expect("target");
    let clone = target.join("install-check/src");
    clean_clone(repo, &clone);
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
        .arg(target));

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

/// `scripts/release` packs the binaries, deploy/ and examples/ with `SHA256SUMS` of each file
/// inside, and `SHA256SUMS` of the archive beside it; both check, and the packed `drumline`
/// runs.
#[test]
fn the_release_archive_holds_every_binary_and_checks_against_its_sums() {
    let env = setup("release");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repo");
    let dist = env.path("dist");
    let release = repo.join("scripts/release");
    let out = run(Command::new(release).arg("--debug").env("DIST", &dist));
    let archive = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(archive.ends_with(".tar.gz"), "{archive}");
    run(Command::new("sha256sum")
        .args(["-c", "SHA256SUMS"])
        .current_dir(&dist));
    let unpacked = env.path("unpacked");
    std::fs::create_dir_all(&unpacked).expect("mkdir");
    run(Command::new("tar")
        .arg("-xzf")
        .arg(&archive)
        .arg("-C")
        .arg(&unpacked));
    let name = Path::new(&archive)
        .file_name()
        .expect("a name")
        .to_string_lossy();
    let top = unpacked.join(name.trim_end_matches(".tar.gz"));
    run(Command::new("sha256sum")
        .args(["-c", "--quiet", "SHA256SUMS"])
        .current_dir(&top));
    for part in [
        "bin/drumline-beat",
        "bin/drumline-worker",
        "deploy/systemd",
        "examples/demo.toml",
    ] {
        assert!(top.join(part).exists(), "{part} is not in the archive");
    }
    let version = run(Command::new(top.join("bin/drumline")).arg("--version"));
    assert!(String::from_utf8_lossy(&version.stdout).starts_with("drumline "));
}
