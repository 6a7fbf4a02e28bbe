//! `drumline-beat next` (docs/design.md–8): upcoming instants in UTC and local time with DST
//! annotations, as JSON for machines and as an aligned table for people. The New York dates are
//! 2026's transitions: 2026-03-08 02:00 → 03:00 (gap), 2026-11-01 02:00 → 01:00 (fold).

use drumline_e2e::cfg::{cron, Cfg};
use drumline_e2e::probe::argv;
use drumline_e2e::{setup, TestEnv};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// Four daily jobs: New York at 02:30 (shifted in the gap, or skipped) and at 01:30 (both
/// runs in the fold), London at 09:00.
fn config() -> Cfg {
    let new_york = |at: &str| cron(at).text("timezone", "America/New_York").task("t");
    Cfg::new()
        .job("shift", new_york("30 2 * * *"))
        .job("skip", new_york("30 2 * * *").text("dst_gap", "skip"))
        .job("fold-both", new_york("30 1 * * *").text("dst_fold", "both"))
        .job(
            "london",
            cron("0 9 * * *")
                .text("timezone", "Europe/London")
                .task("t"),
        )
        .task("t", argv(&["/bin/true"]))
}

fn with_config(test: &str) -> (TestEnv, PathBuf) {
    let env = setup(test);
    let config = env.write_config("drumline.toml", &config());
    (env, config)
}

/// Runs `drumline-beat --config F next ARGS…`: (exit code, stdout, stderr).
fn next(env: &TestEnv, config: &Path, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["--config", config.to_str().expect("utf-8 path"), "next"];
    all.extend_from_slice(args);
    let (status, out, err) = env.run("drumline-beat", &all);
    (status.code().expect("exit code"), out, err)
}

fn next_json(env: &TestEnv, config: &Path, args: &[&str]) -> Vec<Value> {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let (code, out, err) = next(env, config, &all);
    assert_eq!(code, 0, "stderr: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// One line of a job without jitter: `runs_at` is `utc`.
fn line(job: &str, utc: &str, local: &str, offset: &str, note: Option<&str>) -> Value {
    json!({"job": job, "utc": utc, "runs_at": utc, "local": local, "offset": offset, "note": note})
}

/// Lines of `job`, each (utc, local, note), the offset the one `local` ends with.
fn rows(job: &str, rows: &[(&str, &str, Option<&str>)]) -> Vec<Value> {
    let row = |(utc, local, note): &(&str, &str, Option<&str>)| {
        line(job, utc, local, &local[local.len() - 6..], *note)
    };
    rows.iter().map(row).collect()
}

/// `next --json JOB --from FROM --count COUNT` on [`config`], in a namespace of its own.
fn upcoming(test: &str, job: &str, from: &str, count: &str) -> Vec<Value> {
    let (env, config) = with_config(test);
    next_json(&env, &config, &[job, "--from", from, "--count", count])
}

#[test]
fn gap_under_shift_runs_at_the_transition() {
    let lines = upcoming("next_shift", "shift", "2026-03-07T12:00:00Z", "2");
    let shifted = Some("gap: shifted from 02:30");
    let want = [
        ("2026-03-08T07:00:00Z", "2026-03-08T03:00:00-04:00", shifted),
        ("2026-03-09T06:30:00Z", "2026-03-09T02:30:00-04:00", None),
    ];
    assert_eq!(lines, rows("shift", &want));
}

#[test]
fn gap_under_skip_is_shown_but_not_run() {
    let lines = upcoming("next_skip", "skip", "2026-03-07T12:00:00Z", "2");
    assert_eq!(lines.len(), 2, "{lines:?}");
    let note = lines[0]["note"]
        .as_str()
        .expect("a note on the skipped day");
    assert!(note.starts_with("gap: skipped"), "{note}");
    assert_eq!(lines[0]["job"], "skip");
    // The next real run is the following day, back at 02:30 local.
    let next_day = ("2026-03-09T06:30:00Z", "2026-03-09T02:30:00-04:00", None);
    assert_eq!(lines[1..], rows("skip", &[next_day]));
}

#[test]
fn fold_under_both_runs_twice() {
    let lines = upcoming("next_fold", "fold-both", "2026-10-31T12:00:00Z", "3");
    let want = [
        (
            "2026-11-01T05:30:00Z",
            "2026-11-01T01:30:00-04:00",
            Some("fold: first of two"),
        ),
        (
            "2026-11-01T06:30:00Z",
            "2026-11-01T01:30:00-05:00",
            Some("fold: second of two"),
        ),
        ("2026-11-02T06:30:00Z", "2026-11-02T01:30:00-05:00", None),
    ];
    assert_eq!(lines, rows("fold-both", &want));
}

#[test]
fn a_zone_at_utc_plus_zero_still_shows_its_offset() {
    let lines = upcoming("next_london", "london", "2026-01-01T00:00:00Z", "1");
    let nine = ("2026-01-01T09:00:00Z", "2026-01-01T09:00:00+00:00", None);
    assert_eq!(lines, rows("london", &[nine]));
}

#[test]
fn the_table_is_aligned() {
    let (env, config) = with_config("next_table");
    let window = ["--from", "2026-03-07T12:00:00Z", "--count", "3"];
    let (code, out, err) = next(&env, &config, &window);
    assert_eq!(code, 0, "stderr: {err}");
    let rows: Vec<&str> = out.lines().collect();
    assert_eq!(rows.len(), 1 + 4 * 3, "{out}");
    let header = rows[0];
    let column = |name: &str| {
        header
            .find(name)
            .unwrap_or_else(|| panic!("no {name}: {header}"))
    };
    let (utc, local, note) = (column("UTC"), column("LOCAL"), column("NOTE"));
    assert!(header.starts_with("JOB"), "{header}");
    assert!(utc < local && local < note, "{header}");
    for row in &rows[1..] {
        // Every value starts exactly under its header, after a blank.
        for col in [utc, local] {
            assert!(row[col..].starts_with("2026-"), "misaligned:\n{out}");
            assert_eq!(&row[col - 1..col], " ", "misaligned:\n{out}");
        }
        let noted =
            row.len() <= note || ["gap:", "fold:"].iter().any(|n| row[note..].starts_with(n));
        assert!(noted, "misaligned:\n{out}");
        assert_eq!(row, &row.trim_end(), "trailing blanks:\n{out}");
    }
    // The shifted and skipped gap days carry their annotation on the table too.
    assert!(out.contains("gap: shifted from 02:30"), "{out}");
    assert!(out.contains("gap: skipped"), "{out}");
    assert!(out.contains("2026-03-08T03:00:00-04:00"), "{out}");
}

#[test]
fn an_unknown_job_is_a_usage_error() {
    let (env, config) = with_config("next_unknown");
    let (code, out, err) = next(&env, &config, &["nightly"]);
    assert_eq!(code, 2, "stdout: {out}");
    assert!(err.contains("\"nightly\""), "{err}");
    assert!(err.contains("shift"), "should list the known jobs: {err}");
}

#[test]
fn a_bad_from_is_a_usage_error() {
    let (env, config) = with_config("next_bad_from");
    for bad in ["yesterday", "2026-03-08 07:00", "2026-13-01T00:00:00Z"] {
        let (code, out, err) = next(&env, &config, &["--from", bad]);
        assert_eq!(code, 2, "--from {bad}: stdout {out}");
        assert!(err.contains("--from"), "{err}");
        assert!(err.contains("RFC 3339"), "{err}");
    }
}
