#!/usr/bin/env python3
"""A producer without AMQP (docs/api.md#tasks): a task delayed over drumline's HTTP API, then
its outcome, in the caller's trace. Standard library only.

    DRUMLINE_API_TOKEN=… python3 over_http.py [API_URL] [TASK] [DELAY_SECONDS]

posts TASK (default `send-invoice`) with `not_before` DELAY_SECONDS (default 60) from now to
API_URL (default http://127.0.0.1:8080), waits until `GET /api/v1/keys/{key}` says how it
ended, and prints the key, that state and the journal's last event. With TRACEPARENT set (a W3C
trace context), the run is in that trace: the task's own TRACEPARENT continues it.
"""

import datetime
import json
import os
import sys
import time
import urllib.error
import urllib.request

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080"
TASK = sys.argv[2] if len(sys.argv) > 2 else "send-invoice"
DELAY = float(sys.argv[3]) if len(sys.argv) > 3 else 60


def api(method, path, body=None):
    headers = {"Authorization": "Bearer " + os.environ["DRUMLINE_API_TOKEN"]}
    if "TRACEPARENT" in os.environ:
        headers["traceparent"] = os.environ["TRACEPARENT"]
    request = urllib.request.Request(
        URL + path, method=method, headers=headers,
        data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request) as answer:
            return answer.status, json.loads(answer.read() or "null")
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read() or "null")


due = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=DELAY)
status, published = api("POST", "/api/v1/tasks", {
    "task": TASK, "args": {"invoice": 44},
    "not_before": due.isoformat(timespec="milliseconds")})
assert status == 202, published
key = published["key"]
while True:
    status, report = api("GET", "/api/v1/keys/" + key)
    # 404 until a worker takes it; then queued, running, retrying, and one of the ends.
    if status == 200 and report["state"] in ("done", "dead", "expired", "skipped"):
        break
    time.sleep(0.2)
print(key, report["state"], report["journal"][-1]["event"])
