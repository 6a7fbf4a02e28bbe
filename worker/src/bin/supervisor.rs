//! `drumline-supervisor`: leads one shell task's process group for the worker
//! ([`drumline_worker::supervisor`] says what it does and why it is a program of its own).

fn main() {
    std::process::exit(drumline_worker::supervisor::run(std::env::args_os()));
}
