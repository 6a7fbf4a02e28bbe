#!/usr/bin/env python3
"""The speed targets (issue 37) beside this run's figures: the last step of scripts/bench.

  bench_targets.py DIR

DIR holds the JSON the earlier steps wrote with --json-file (a step that was skipped leaves its
rows out). Each row: what was measured, its reference from the same run, the target, and
whether it was met. docs/performance.md says where the time goes for each miss. Prints only;
asserts nothing.
"""
import json, os, sys


def load(directory, name):
    try:
        with open(os.path.join(directory, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def worker_rows(tp):
    for row in tp.get("throughput", []):
        if row["mode"] != "drain":
            continue
        c = row["concurrency"]
        yield (f"worker drain c={c} / bare consumer", row["ratio"]["of_medians"],
               f"bare {row['bare_msgs_per_s']['median']:,.0f} msg/s, "
               f"worker {row['worker_msgs_per_s']['median']:,.0f}", ">=", 0.9)
    for row in (tp.get("shell") or {}).get("by_concurrency", []):
        loaded = row.get("executor_with_background_per_s")
        if loaded:
            unloaded = row["executor_per_s"]["median"]
            yield (f"shell K={row['concurrency']}, {row['background_tasks']} running / unloaded",
                   loaded["median"] / unloaded, f"unloaded {unloaded:,.0f}/s", ">=", 0.9)


def lag_rows(lag):
    bare = lag["bare_publish_to_delivery"]["p99_ms"]["median"]
    worker = lag["worker_publish_to_handler"]["p99_ms"]["median"]
    yield (f"lag p99 at {lag['rate_per_s']:.0f}/s, worker / bare", worker / bare,
           f"bare {bare:.2f} ms, worker {worker:.2f} ms", "<=", 1.1)


def million_rows(m):
    jobs = f"{m['jobs']:,} file jobs"
    start = m["first_start"]
    yield (f"{jobs}: resident at start, MiB", start["rss_kib"] / 1024,
           f"settled {start['settled_rss_kib'] / 1024:.0f} MiB", "<=", 200)
    status = m.get("status")
    if status:
        yield (f"{jobs}: status --json first row, ms", status["first_row_ms"], "", "<=", 1000)
        yield (f"{jobs}: status --json end, ms", status["end_ms"], "", "<=", 5000)


def schedule_rows(s):
    n = f"{s['schedules']:,} schedules"
    yield (f"{n}: apply by CLI, per s", s["apply_cli_created_per_s"],
           f"by API {s.get('apply_api_per_s', 0):,.0f}/s", ">=", 20000)
    yield (f"{n}: leader start, s", s["start"]["s"], "", "<=", 3)
    yield (f"{n}: leader resident, MiB", s["start"]["rss_mib"], "", "<=", 300)
    # The standby cannot lead before the dead leader's lease (3 s in the bench) lapses: the row
    # is what it took beyond that.
    took, load = s["takeover"]["s"], s.get("takeover_load_ms")
    yield (f"{n}: takeover beyond the 3 s lease, s", took - 3,
           f"{took:.2f} s from the kill; own load {load} ms", "<=", 3)
    yield (f"{n}: standby resident after takeover, MiB", s["takeover"]["rss_mib"], "", "<=", 300)


def peer_rows(directory):
    for c in (32, 256):
        b = load(directory, f"bullmq_drain_{c}.json")
        if b and b.get("drumline_over_bullmq"):
            yield (f"drumline / BullMQ drain c={c}", b["drumline_over_bullmq"],
                   f"BullMQ {b['jobs_per_s']['median']:,.0f} jobs/s", None, None)
    b = load(directory, "bullmq_scheduler.json")
    if b and b.get("bullmq_started_over_drumline"):
        yield (f"BullMQ all started / drumline queued, {b['jobs']:,} due", b["bullmq_started_over_drumline"],
               f"drumline {b['drumline_all_queued_ms']['median']:,.0f} ms", None, None)


def show(value):
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def main():
    directory = sys.argv[1]
    sources = [("throughput.json", worker_rows), ("lag.json", lag_rows),
               ("million.json", million_rows), ("schedules.json", schedule_rows)]
    rows = []
    for name, rows_of in sources:
        figures = load(directory, name)
        if figures:
            rows.extend(rows_of(figures))
    rows.extend(peer_rows(directory))
    print(f"{'row':<52} {'this run':>9}  {'target':>9}  {'':6}  reference, same run")
    for what, value, reference, op, target in rows:
        if op is None:
            goal, verdict = "", ""
        else:
            met = value >= target if op == ">=" else value <= target
            goal, verdict = f"{op} {show(target)}", "met" if met else "MISSED"
        print(f"{what:<52} {show(value):>9}  {goal:>9}  {verdict:6}  {reference}")


if __name__ == "__main__":
    main()
