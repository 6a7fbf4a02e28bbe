#!/usr/bin/env python3
"""Publish drumline tasks from Python with pika (docs/envelope.md).

A drumline task message is a JSON object published to the exchange `{namespace}.tasks` with
the logical queue as routing key. Only `key` (the idempotency key: at most one run succeeds
per key) and `task` are required; the worker fills in the rest (docs/envelope.schema.json).
Fields a worker does not know are ignored, so a producer may add its own.

    pip install pika
    python3 publish.py [AMQP_URL] [NAMESPACE] [TASK] [KEY_PREFIX]

publishes two messages for TASK on queue `default`: a minimal one, and one carrying a field
drumline does not know (`priority`). Each publish waits for the broker's confirm; a message no
queue is bound for (no worker ever started in that namespace) is an error, not a silent drop.
"""

import json
import sys

import pika


def publish(channel, namespace, message, queue="default"):
    """Publishes `message` (a dict) persistently, raising if it is unroutable or refused."""
    channel.basic_publish(
        exchange=f"{namespace}.tasks",
        routing_key=queue,
        body=json.dumps(message).encode(),
        properties=pika.BasicProperties(
            content_type="application/json",
            delivery_mode=pika.DeliveryMode.Persistent,
            message_id=message["key"],
        ),
        mandatory=True,
    )


def main():
    url = sys.argv[1] if len(sys.argv) > 1 else "amqp://guest:guest@127.0.0.1:5672/%2F"
    namespace = sys.argv[2] if len(sys.argv) > 2 else "drumline"
    task = sys.argv[3] if len(sys.argv) > 3 else "report"
    prefix = sys.argv[4] if len(sys.argv) > 4 else "py"

    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.confirm_delivery()

    # The least a producer writes.
    publish(channel, namespace, {"key": f"{prefix}-minimal", "task": task, "args": {"region": "eu"}})
    # A field drumline does not know is ignored, not a dead letter.
    publish(channel, namespace, {"key": f"{prefix}-extra", "task": task, "args": {}, "priority": 9})

    connection.close()
    print(f"published {prefix}-minimal and {prefix}-extra to {namespace}.tasks")


if __name__ == "__main__":
    main()
