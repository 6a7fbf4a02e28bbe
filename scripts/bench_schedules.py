#!/usr/bin/env python3
"""Schedules applied at run time, at scale (scripts/bench step 8; docs/performance.md).

  bench_schedules.py DRUMLINE DRUMLINE_BEAT [--schedules N] [--edits E] [--puts P]
                     [--json-file PATH]

1. `drumline schedules apply FILE` of N schedule objects (one JSON array): wall time and rate;
   applying the same file again (every object `unchanged`) too.
2. a beat started with them stored: time until it logs "beat leading", its resident memory then.
3. P more schedules by the HTTP API of that beat, `PUT /api/v1/schedules/{name}` from 8
   connections in parallel: the rate.
4. E edits, one at a time, each `schedules apply` of one changed object: the time from the
   command's end to the leader's "schedules edited in place" log line (p50, p99, max).
5. takeover: a standby started beside it (once it has read every schedule), the leader killed
   with SIGKILL: the time from the kill to the standby's "beat leading", its own load time
   (`load_ms`: reading every job's progress, after the lease lapsed) and its resident memory.
With --json-file, the figures are also written there as JSON (for the targets table at the end
of scripts/bench). Works in a namespace of its own and deletes its Redis keys at the end.
Numbers to report, never asserted.
"""
import argparse, datetime, http.client, json, os, re, signal, socket, statistics, subprocess
import sys, tempfile, threading, time

TOKEN = "bench-token"
# What --json-file writes: each step adds its figures.
FIGURES = {}

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("drumline")
    ap.add_argument("beat")
    ap.add_argument("--schedules", type=int, default=100000)
    ap.add_argument("--edits", type=int, default=20)
    ap.add_argument("--puts", type=int, default=20000)
    ap.add_argument("--json-file")
    a = ap.parse_args()
    FIGURES["schedules"] = a.schedules
    ns = f"bench_sched_{os.getpid()}"
    work = tempfile.mkdtemp(prefix="drumline-bench-sched-")
    cfg = os.path.join(work, "drumline.toml")
    with open(cfg, "w") as f:
        f.write(f'namespace = "{ns}"\n[beat]\nleader_lease = "3s"\n'
                f'[tasks.report]\ncommand = ["true"]\n')
    os.environ["DRUMLINE_API_TOKEN"] = TOKEN
    beats = []
    try:
        apply_many(a, cfg, work)
        port = free_port()
        beats.append(start_beat(a, cfg, work, "leader", ["--api-addr", f"127.0.0.1:{port}"]))
        wait_for(beats[0], "beat leading", "leading after", key="start")
        puts(a, port)
        edits(a, cfg, work, beats[0])
        takeover(a, cfg, work, beats)
    finally:
        for beat in beats:
            beat.terminate()
            beat.wait(timeout=30)
        cleanup(ns)
    if a.json_file:
        with open(a.json_file, "w") as f:
            json.dump(FIGURES, f, indent=2)

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
        FIGURES[f"apply_cli_{what}_per_s"] = n / took

def start_beat(a, cfg, work, label, extra=()):
    log = open(os.path.join(work, f"{label}.log"), "w")
    beat = subprocess.Popen([a.beat, "--config", cfg, *extra], stdout=log,
                            stderr=subprocess.STDOUT)
    beat.log_path, beat.started, beat.schedules = log.name, time.monotonic(), a.schedules
    return beat

def wait_for(beat, line, what, since=None, key=None):
    """Waits until `beat` logs `line`; prints the time since `since` (default: its start) and
    its resident memory then, kept in FIGURES[key] too when given. Returns the line."""
    since = beat.started if since is None else since
    while True:
        found = [l for l in open(beat.log_path) if line in l]
        if found:
            break
        if time.monotonic() - since > 300 or beat.poll() is not None:
            sys.exit(f"no '{line}': {open(beat.log_path).read()[-2000:]}")
        time.sleep(0.02)
    took = time.monotonic() - since
    rss = next(l for l in open(f"/proc/{beat.pid}/status") if l.startswith("VmRSS")).split()[1]
    print(f"beat with {beat.schedules} schedules: {what} {took:.2f} s, "
          f"resident {int(rss) / 1024:.0f} MiB")
    if key:
        FIGURES[key] = {"s": took, "rss_mib": int(rss) / 1024}
    return found[-1]

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def puts(a, port, connections=8):
    def put_range(i0, step):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        for i in range(i0, a.puts, step):
            body = json.dumps({"task": "report", "every": "1h", "args": {"customer": i}})
            conn.request("PUT", f"/api/v1/schedules/api{i}", body, headers)
            answer = conn.getresponse()
            answer.read()
            if answer.status != 201:
                sys.exit(f"PUT api{i}: {answer.status}")
        conn.close()
    start = time.monotonic()
    threads = [threading.Thread(target=put_range, args=(i, connections))
               for i in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - start
    print(f"apply {a.puts} by API ({connections} connections, {a.schedules} present): "
          f"{took:.2f} s, {a.puts / took:,.0f} schedules/s")
    FIGURES["apply_api_per_s"] = a.puts / took

def takeover(a, cfg, work, beats):
    standby = start_beat(a, cfg, work, "standby")
    beats.append(standby)
    wait_for(standby, "schedules applied at run time", "standby ready after")
    killed = time.monotonic()
    beats[0].send_signal(signal.SIGKILL)
    line = wait_for(standby, "beat leading", "takeover (lease 3 s) after", since=killed,
                    key="takeover")
    load = re.search(r"load_ms=(\d+)", line)
    print(f"takeover: the standby's own load {load.group(1) if load else '?'} ms")
    FIGURES["takeover_load_ms"] = int(load.group(1)) if load else None

def edits(a, cfg, work, beat):
    lags = []
    for i in range(a.edits):
        path = os.path.join(work, f"edit{i}.json")
        with open(path, "w") as f:
            json.dump({"name": "s0", "task": "report", "every": f"{i % 50 + 2}m"}, f)
        seen = open(beat.log_path).read().count("schedules edited in place")
        subprocess.run([a.drumline, "--config", cfg, "schedules", "apply", path],
                       check=True, capture_output=True)
        done = datetime.datetime.now(datetime.timezone.utc)
        deadline = time.monotonic() + 30
        while open(beat.log_path).read().count("schedules edited in place") <= seen:
            if time.monotonic() > deadline:
                sys.exit("the leader never saw an edit")
            time.sleep(0.005)
        line = [l for l in open(beat.log_path) if "schedules edited in place" in l][-1]
        at = datetime.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00"))
        lags.append(max(0.0, (at - done).total_seconds() * 1000))
    lags.sort()
    p99 = lags[min(len(lags) - 1, int(len(lags) * 0.99))]
    FIGURES["edit_p99_ms"] = p99
    print(f"edit → leader with {a.schedules} present ({a.edits} edits): "
          f"p50 {statistics.median(lags):.0f} ms, p99 {p99:.0f} ms, max {lags[-1]:.0f} ms")

def cleanup(ns):
    keys = subprocess.run(["redis-cli", "--scan", "--pattern", f"{ns}:*"],
                          capture_output=True, text=True).stdout.split()
    for i in range(0, len(keys), 1000):
        subprocess.run(["redis-cli", "del", *keys[i:i + 1000]], capture_output=True)

if __name__ == "__main__":
    main()
