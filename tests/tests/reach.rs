//! A new user's first steps with the `drumline` command: what its output does when read by a
//! pipe that closes early.

use drumline_e2e::binary;
use std::process::{Command, Stdio};

/// `drumline completions bash | head -1`: the reader goes away after the first line; the
/// command stops quietly (exit 0, no panic) instead of exit 101.
#[test]
fn completions_into_a_closed_pipe_exit_quietly() {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let out = Command::new(binary("drumline"))
        .args(["completions", "bash"])
        .stdout(Stdio::from(writer))
        .stderr(Stdio::piped())
        .output()
        .expect("drumline runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
