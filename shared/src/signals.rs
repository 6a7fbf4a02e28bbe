//! Shutdown signals for both binaries: the first SIGTERM or SIGINT starts an orderly stop; a
//! second one exits at once with code 1 (what was not acknowledged goes back to the broker).

use tokio::signal::unix::{signal, Signal, SignalKind};

/// Completes on the first SIGTERM or SIGINT, logging `what` (what the orderly stop does);
/// installs the second-signal exit. Call it inside the runtime.
pub async fn shutdown(what: &'static str) {
    Shutdown::listen().wait(what).await
}

/// SIGTERM and SIGINT, listened for from [`listen`](Shutdown::listen) on: a binary makes it
/// before it tells systemd it is ready, so a stop from then on is always an orderly one (until
/// it exists, the signal's default action ends the process at once).
pub struct Shutdown {
    term: Signal,
    int: Signal,
}

impl Shutdown {
    /// Installs the handlers now (call it inside the runtime).
    pub fn listen() -> Self {
        Shutdown {
            term: signal(SignalKind::terminate()).expect("cannot install the SIGTERM handler"),
            int: signal(SignalKind::interrupt()).expect("cannot install the SIGINT handler"),
        }
    }

    /// Completes at the first signal (`what` says what stopping does); a second one exits at
    /// once.
    pub async fn wait(self, what: &'static str) {
        let Shutdown { mut term, mut int } = self;
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
}

/// SIGHUP, the reload request of both binaries (docs/design.md "Reload").
pub struct Hangups(Option<tokio::signal::unix::Signal>);

impl Hangups {
    /// Starts listening for SIGHUP (call it inside the runtime). Without a handler (it could
    /// not be installed, which is logged) [`recv`](Self::recv) never completes.
    pub fn new() -> Self {
        match signal(SignalKind::hangup()) {
            Ok(s) => Hangups(Some(s)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot install the SIGHUP handler; reload needs a restart");
                Hangups(None)
            }
        }
    }

    /// Completes at the next SIGHUP.
    pub async fn recv(&mut self) {
        match &mut self.0 {
            Some(s) => {
                s.recv().await;
            }
            None => std::future::pending().await,
        }
    }
}

impl Default for Hangups {
    fn default() -> Self {
        Self::new()
    }
}
