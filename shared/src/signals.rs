//! Shutdown signals for both binaries: the first SIGTERM or SIGINT starts an orderly stop; a
//! second one exits at once with code 1 (what was not acknowledged goes back to the broker).

use tokio::signal::unix::{signal, SignalKind};

/// Completes on the first SIGTERM or SIGINT, logging `what` (what the orderly stop does);
/// installs the second-signal exit. Call it inside the runtime.
pub async fn shutdown(what: &'static str) {
    let mut term = signal(SignalKind::terminate()).expect("cannot install the SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("cannot install the SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down: {what} (signal again to exit now)");
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        eprintln!("second signal: exiting now; unacknowledged messages go back to the broker");
        std::process::exit(1);
    });
}
