//! systemd `Type=notify` (feature `bin-support`; deploy/systemd/): `READY=1` once a binary is
//! up, and `WATCHDOG=1` at half the unit's `WatchdogSec` while its runtime keeps running, so
//! systemd restarts a process that hangs. Without `NOTIFY_SOCKET` (not under systemd) nothing
//! is sent.

use sd_notify::NotifyState;
use std::time::Duration;

/// Tells systemd the process is ready and, when the unit has a watchdog, pings it from a task
/// of its own for as long as the tokio runtime runs. The handle is the pinging task, if any.
pub fn ready() -> Option<tokio::task::JoinHandle<()>> {
    if let Err(e) = sd_notify::notify(false, &[NotifyState::Ready]) {
        tracing::warn!(error = %e, "cannot tell systemd we are ready");
    }
    let timeout = watchdog_timeout(
        std::env::var("WATCHDOG_USEC").ok().as_deref(),
        std::env::var("WATCHDOG_PID").ok().as_deref(),
        std::process::id(),
    )?;
    let every = ping_interval(timeout);
    Some(tokio::spawn(async move {
        loop {
            let _ = sd_notify::notify(false, &[NotifyState::Watchdog]);
            tokio::time::sleep(every).await;
        }
    }))
}

/// The watchdog's timeout from `WATCHDOG_USEC`, as `sd_watchdog_enabled(3)` reads it: none when
/// unset, zero or not a number, or when `WATCHDOG_PID` is set to another process than `me`.
pub fn watchdog_timeout(usec: Option<&str>, pid: Option<&str>, me: u32) -> Option<Duration> {
    let usec: u64 = usec?.trim().parse().ok().filter(|u| *u > 0)?;
    if pid.is_some_and(|p| p.trim().parse::<u32>().ok() != Some(me)) {
        return None;
    }
    Some(Duration::from_micros(usec))
}

/// How often to ping a watchdog of `timeout`: half of it, as systemd recommends.
pub fn ping_interval(timeout: Duration) -> Duration {
    (timeout / 2).max(Duration::from_millis(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_is_pinged_at_half_its_timeout() {
        assert_eq!(
            ping_interval(Duration::from_secs(30)),
            Duration::from_secs(15)
        );
        assert_eq!(ping_interval(Duration::ZERO), Duration::from_millis(1));
        let two_s = Some(Duration::from_secs(2));
        assert_eq!(watchdog_timeout(Some("2000000"), None, 7), two_s);
        assert_eq!(watchdog_timeout(Some("2000000"), Some("7"), 7), two_s);
        assert_eq!(watchdog_timeout(Some("2000000"), Some("8"), 7), None);
        assert_eq!(watchdog_timeout(Some("0"), None, 7), None);
        assert_eq!(watchdog_timeout(Some("x"), None, 7), None);
        assert_eq!(watchdog_timeout(None, Some("7"), 7), None);
    }
}
