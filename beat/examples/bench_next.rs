//! Cost of `Schedule::next_after` (ns per call), for `scripts/bench`. Run with
//! `cargo run --release -p drumline-beat --example bench_next [-- ITERATIONS]`.
//!
//! Each case walks the schedule forward from a fixed instant, one call per instant, so the
//! number is the steady-state cost the beat pays per published instance (the DST zone walk
//! crosses both 2026 New York transitions).

use chrono::{DateTime, Utc};
use drumline_shared::schedule::{parse_timezone, CronExpr, DstFold, DstGap, Schedule};
use std::hint::black_box;
use std::time::Instant;

fn cron(expr: &str, tz: &str, fold: DstFold) -> Schedule {
    Schedule::Cron {
        cron: expr.parse::<CronExpr>().expect("valid cron").into(),
        tz: parse_timezone(tz).expect("valid zone"),
        gap: DstGap::Shift,
        fold,
    }
}

/// Mean ns per `next_after` over `calls` consecutive instants after `from`.
fn measure(schedule: &Schedule, from: DateTime<Utc>, calls: u64) -> f64 {
    // Warm up caches and the branch predictor.
    let mut cursor = from;
    for _ in 0..calls.min(1000) {
        cursor = schedule.next_after(cursor).expect("a next instant");
    }
    let mut cursor = from;
    let started = Instant::now();
    for _ in 0..calls {
        cursor = black_box(
            schedule
                .next_after(black_box(cursor))
                .expect("a next instant"),
        );
    }
    started.elapsed().as_nanos() as f64 / calls as f64
}

fn main() {
    let calls: u64 = std::env::args()
        .nth(1)
        .map(|n| n.parse().expect("ITERATIONS must be a number"))
        .unwrap_or(200_000);
    let from: DateTime<Utc> = "2026-01-01T00:00:00Z".parse().expect("instant");
    let cases = [
        (
            "cron \"*/5 * * * *\" UTC",
            cron("*/5 * * * *", "UTC", DstFold::First),
        ),
        (
            "cron \"*/5 * * * *\" America/New_York",
            cron("*/5 * * * *", "America/New_York", DstFold::First),
        ),
        (
            "cron \"30 2 * * *\" UTC (daily)",
            cron("30 2 * * *", "UTC", DstFold::First),
        ),
        (
            "cron \"30 2 * * *\" America/New_York (daily)",
            cron("30 2 * * *", "America/New_York", DstFold::First),
        ),
        (
            "cron \"30 1 * * *\" America/New_York fold=both",
            cron("30 1 * * *", "America/New_York", DstFold::Both),
        ),
        (
            "cron \"0 9 * * MON-FRI\" Europe/London",
            cron("0 9 * * MON-FRI", "Europe/London", DstFold::First),
        ),
        (
            "every 30s",
            Schedule::Every {
                every: chrono::Duration::seconds(30),
                anchor: DateTime::UNIX_EPOCH,
            },
        ),
    ];
    println!("{:<48} {:>12}", "schedule", "ns/next_after");
    for (name, schedule) in &cases {
        // Daily schedules walk 2,700+ years at 1M calls; keep their walk to a few decades.
        let n = if name.contains("daily") || name.contains("MON-FRI") || name.contains("fold") {
            calls.min(20_000)
        } else {
            calls
        };
        println!("{name:<48} {:>12.0}", measure(schedule, from, n));
    }
}
