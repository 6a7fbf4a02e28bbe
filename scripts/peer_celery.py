"""Celery beside drumline (docs/performance.md#a-peer-celery): the same RabbitMQ and Redis, the
same dedupe a Celery user would add for "at most once" (SET NX of the task's key in Redis before
it runs), late acks (a delivery is acked after its task, like drumline's manual ack).

Pre-fills a queue of its own with N task messages, starts `celery worker` on it and times the
drain from the worker's start (as the drumline bench times its worker) until Redis counts N
tasks finished. `--task noop` runs nothing after the dedupe; `--task shell` runs `/bin/true`
through `subprocess`. Prints the median and spread of the runs (`--json`: one JSON line);
asserts nothing about speed.

    python peer_celery.py --messages 10000 --pool threads --concurrency 32 --task noop --runs 3

Run by `scripts/bench` from a virtualenv it makes (target/peerenv) with `celery` and `redis`.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import uuid

import redis
from celery import Celery

BROKER = os.environ.get("PEER_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
REDIS = os.environ.get("PEER_REDIS", "redis://127.0.0.1:6379/0")
NS = os.environ.get("PEER_NS", "bench_celery")

app = Celery(NS, broker=BROKER)
app.conf.update(
    task_default_queue=f"{NS}.celery",
    task_acks_late=True,
    task_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # The worker's prefetch: the multiplier times the concurrency, as drumline's prefetch is
    # its concurrency.
    worker_prefetch_multiplier=1,
    # No remote-control queue or exchange of its own (nothing to clean up after).
    worker_enable_remote_control=False,
)
store = redis.Redis.from_url(REDIS)


def first_time(key):
    """The dedupe: true for the first delivery of `key` (kept for a day)."""
    return bool(store.set(f"{NS}:dedupe:{key}", 1, nx=True, ex=86400))


@app.task(name="noop")
def noop(key):
    if first_time(key):
        pass
    store.incr(f"{NS}:finished")


@app.task(name="shell")
def shell(key):
    if first_time(key):
        subprocess.run(["/bin/true"], check=True)
    store.incr(f"{NS}:finished")


def clean():
    for key in store.scan_iter(f"{NS}:*", count=10000):
        store.unlink(key)
    with app.connection_for_write() as conn:
        # As Celery declares its default queue: durable, not auto-deleted.
        conn.default_channel.queue_declare(f"{NS}.celery", durable=True, auto_delete=False)
        conn.default_channel.queue_purge(f"{NS}.celery")


def fill(task, n):
    with app.producer_or_acquire() as producer:
        for _ in range(n):
            task.apply_async(args=[str(uuid.uuid4())], producer=producer)


def one_run(args):
    clean()
    task = noop if args.task == "noop" else shell
    fill(task, args.messages)
    env = dict(os.environ, PEER_NS=NS)
    cmd = [
        sys.executable, "-m", "celery", "-A", "peer_celery", "worker",
        f"--pool={args.pool}", f"--concurrency={args.concurrency}",
        "-Q", f"{NS}.celery", "--without-gossip", "--without-mingle", "--without-heartbeat",
        "--loglevel=warning",
    ]
    started = time.monotonic()
    worker = subprocess.Popen(
        cmd, cwd=os.path.dirname(os.path.abspath(__file__)), env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = started + args.timeout
    finished, first = 0, None
    while time.monotonic() < deadline:
        finished = int(store.get(f"{NS}:finished") or 0)
        if finished and first is None:
            first = (time.monotonic(), finished)
        if finished >= args.messages:
            break
        if worker.poll() is not None:
            break
        time.sleep(0.01)
    now = time.monotonic()
    elapsed = now - started
    worker.terminate()
    try:
        _, err = worker.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        worker.kill()
        _, err = worker.communicate()
    if finished < args.messages:
        sys.exit(f"celery finished {finished} of {args.messages}: {err.decode()[-2000:]}")
    steady = (args.messages - first[1]) / max(now - first[0], 1e-6)
    return args.messages / elapsed, steady


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--messages", type=int, default=10000)
    p.add_argument("--pool", default="threads")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--task", choices=["noop", "shell"], default="noop")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    try:
        runs = [one_run(args) for _ in range(args.runs)]
    finally:
        clean()
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(f"{NS}.celery")
            conn.default_channel.exchange_delete(f"{NS}.celery")
    if not args.json:
        med = lambda xs: xs[len(xs) // 2]
        whole, steady = sorted(r[0] for r in runs), sorted(r[1] for r in runs)
        print(
            f"celery {__import__('celery').__version__} {args.pool:<8} c={args.concurrency:<3} "
            f"{args.task:<5} {args.messages} msgs: {med(whole):.0f} msg/s "
            f"({whole[0]:.0f}–{whole[-1]:.0f}) from the worker's start, "
            f"{med(steady):.0f} ({steady[0]:.0f}–{steady[-1]:.0f}) from its first task"
        )
        return
    print(json.dumps({
        "peer": "celery", "version": __import__("celery").__version__,
        "pool": args.pool, "concurrency": args.concurrency, "task": args.task,
        "messages": args.messages,
        # From the worker's start, as the drumline bench counts; and from its first finished
        # task on (Celery's own start-up left out).
        "msgs_per_s": sorted(r[0] for r in runs),
        "steady_msgs_per_s": sorted(r[1] for r in runs),
    }))


if __name__ == "__main__":
    main()
