#!/usr/bin/env python3
"""Schedules applied at run time, at scale (scripts/bench step 8; docs/performance.md).

  bench_schedules.py DRUMLINE DRUMLINE_BEAT [--schedules N] [--edits E]

1. `drumline schedules apply FILE` of N schedule objects (one JSON array): wall time and rate;
   applying the same file again (every object `unchanged`) too.
2. a beat started with them stored: time until it logs "beat leading", its resident memory then.
3. E edits, one at a time, each `schedules apply` of one changed object: the time from the
   command's end to the leader's "schedules changed" log line (p50, p99, max).
Works in a namespace of its own and deletes its Redis keys at the end. Numbers to report,
never asserted.
"""
import argparse, datetime, json, os, statistics, subprocess, sys, tempfile, time

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("drumline")
    ap.add_argument("beat")
    ap.add_argument("--schedules", type=int, default=100000)
    ap.add_argument("--edits", type=int, default=20)
    a = ap.parse_args()
    ns = f"bench_sched_{os.getpid()}"
    work = tempfile.mkdtemp(prefix="drumline-bench-sched-")
    cfg = os.path.join(work, "drumline.toml")
    with open(cfg, "w") as f:
        f.write(f'namespace = "{ns}"\n[tasks.report]\ncommand = ["true"]\n')
    try:
        apply_many(a, cfg, work)
        beat = start_beat(a, cfg, work)
        try:
            edits(a, cfg, work, beat)
        finally:
            beat.terminate()
            beat.wait(timeout=30)
    finally:
        cleanup(ns)

def objects(n, every="1h"):
    return [{"name": f"s{i}", "task": "report", "every": every,
             "args": {"customer": i}, "labels": {"tenant": f"t{i % 100}"}} for i in range(n)]

def apply_many(a, cfg, work):
    path = os.path.join(work, "many.json")
    with open(path, "w") as f:
        json.dump(objects(a.schedules), f)
    for what in ("created", "unchanged"):
        start = time.monotonic()
        out = subprocess.run([a.drumline, "--config", cfg, "schedules", "apply", path],
                             check=True, capture_output=True, text=True).stdout
        took = time.monotonic() - start
        n = out.count(what + " ")
        print(f"apply {a.schedules} by CLI ({what}): {took:.2f} s, {n / took:,.0f} schedules/s")

def start_beat(a, cfg, work):
    log = open(os.path.join(work, "beat.log"), "w")
    start = time.monotonic()
    beat = subprocess.Popen([a.beat, "--config", cfg], stdout=log, stderr=subprocess.STDOUT)
    path = log.name
    while "beat leading" not in open(path).read():
        if time.monotonic() - start > 300 or beat.poll() is not None:
            sys.exit(f"the beat did not lead: {open(path).read()[-2000:]}")
        time.sleep(0.05)
    took = time.monotonic() - start
    rss = next(l for l in open(f"/proc/{beat.pid}/status") if l.startswith("VmRSS")).split()[1]
    print(f"beat start with {a.schedules} schedules: leading after {took:.2f} s, "
          f"resident {int(rss) / 1024:.0f} MiB")
    beat.log_path = path
    return beat

def edits(a, cfg, work, beat):
    lags = []
    for i in range(a.edits):
        path = os.path.join(work, f"edit{i}.json")
        with open(path, "w") as f:
            json.dump({"name": "s0", "task": "report", "every": f"{i % 50 + 2}m"}, f)
        seen = open(beat.log_path).read().count("schedules changed")
        subprocess.run([a.drumline, "--config", cfg, "schedules", "apply", path],
                       check=True, capture_output=True)
        done = datetime.datetime.now(datetime.timezone.utc)
        deadline = time.monotonic() + 30
        while open(beat.log_path).read().count("schedules changed") <= seen:
            if time.monotonic() > deadline:
                sys.exit("the leader never saw an edit")
            time.sleep(0.005)
        line = [l for l in open(beat.log_path) if "schedules changed" in l][-1]
        at = datetime.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00"))
        lags.append(max(0.0, (at - done).total_seconds() * 1000))
    lags.sort()
    p99 = lags[min(len(lags) - 1, int(len(lags) * 0.99))]
    print(f"edit → leader with {a.schedules} present ({a.edits} edits): "
          f"p50 {statistics.median(lags):.0f} ms, p99 {p99:.0f} ms, max {lags[-1]:.0f} ms")

def cleanup(ns):
    keys = subprocess.run(["redis-cli", "--scan", "--pattern", f"{ns}:*"],
                          capture_output=True, text=True).stdout.split()
    for i in range(0, len(keys), 1000):
        subprocess.run(["redis-cli", "del", *keys[i:i + 1000]], capture_output=True)

if __name__ == "__main__":
    main()
