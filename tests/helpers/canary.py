"""A canary in a process of its own: it asks a server's gRPC health service and its HTTP
``/healthz`` over and over, and reports the slowest answer of each since the last report.

    python -m tests.helpers.canary GRPC_PORT HTTP_PORT

Each line read from stdin ends a window: the canary prints one JSON line, ``{"grpc":
seconds, "http": seconds, "grpc_failures": n, "http_failures": n, "asks": n}``, where a
failure (no answer within 5 s, or an error) counts as 5 s. End of stdin ends it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 5.0
#: a subchannel per channel: the process-wide pool would carry a dead server's backoff
LOCAL = [("grpc.use_local_subchannel_pool", 1)]


class Window:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.worst = {"grpc": 0.0, "http": 0.0}
        self.failures = {"grpc": 0, "http": 0}
        self.asks = 0

    def note(self, kind: str, took: float, ok: bool) -> None:
        with self.lock:
            self.worst[kind] = max(self.worst[kind], took if ok else TIMEOUT_S)
            self.failures[kind] += 0 if ok else 1
            self.asks += 1

    def report(self) -> str:
        with self.lock:
            out = {
                "grpc": self.worst["grpc"],
                "http": self.worst["http"],
                "grpc_failures": self.failures["grpc"],
                "http_failures": self.failures["http"],
                "asks": self.asks,
            }
            self.worst = {"grpc": 0.0, "http": 0.0}
            self.failures = {"grpc": 0, "http": 0}
            self.asks = 0
        return json.dumps(out)


def ask_grpc(port: int, window: Window, done: threading.Event) -> None:
    # a fresh channel now and then, so that a server that stopped listening shows
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=LOCAL)
    stub = health_pb2_grpc.HealthStub(channel)
    asked = 0
    while not done.is_set():
        t0 = time.monotonic()
        try:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
            ok = True
        except grpc.RpcError:
            ok = False
        window.note("grpc", time.monotonic() - t0, ok)
        asked += 1
        if asked % 20 == 0 or not ok:
            channel.close()
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=LOCAL)
            stub = health_pb2_grpc.HealthStub(channel)
        done.wait(0.02)
    channel.close()


def ask_http(port: int, window: Window, done: threading.Event) -> None:
    url = f"http://127.0.0.1:{port}/healthz"
    while not done.is_set():
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT_S) as answer:
                answer.read()
                ok = answer.status == 200
        except OSError:
            ok = False
        window.note("http", time.monotonic() - t0, ok)
        done.wait(0.02)


def main() -> None:
    grpc_port, http_port = int(sys.argv[1]), int(sys.argv[2])
    window, done = Window(), threading.Event()
    threads = [
        threading.Thread(target=ask_grpc, args=(grpc_port, window, done), daemon=True),
        threading.Thread(target=ask_http, args=(http_port, window, done), daemon=True),
    ]
    for t in threads:
        t.start()
    print("ready", flush=True)
    for _ in sys.stdin:
        print(window.report(), flush=True)
    done.set()


if __name__ == "__main__":
    main()
