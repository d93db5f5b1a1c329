"""The gateway's Prometheus metrics, in a registry of their own (``GET /metrics``)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# the gateway's overhead: fine from 0.25 ms to 50 ms, where its p50 and p99 fall
_OVER = (0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
         0.1, 0.25, 1)
_FAST = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "kvinject_gateway_"
        self.requests = Counter(p + "requests", "HTTP requests by route and status", ["route", "method", "status"],
                                registry=r)
        self.chat_seconds = Histogram(p + "chat_seconds", "chat completion latency (to the last byte)",
                                      ["stream"], buckets=_LAT, registry=r)
        self.overhead_seconds = Histogram(p + "overhead_seconds", "the gateway's own part of a chat's time to its "
                                          "first byte (stream) or last byte: that time less the answering "
                                          "replica's, as the gateway waited for it", ["stream"], buckets=_OVER,
                                          registry=r)
        self.retrieval_seconds = Histogram(p + "retrieval_seconds", "search over a user's memories",
                                           buckets=_FAST, registry=r)
        self.embedding_seconds = Histogram(p + "embedding_seconds", "embedding of texts (per call)",
                                           ["what"], buckets=_FAST + (2.5, 5, 10), registry=r)
        self.replica_requests = Counter(p + "replica_requests", "requests sent to a replica",
                                        ["replica", "kind", "status"], registry=r)
        self.replica_up = Gauge(p + "replica_up", "1 while the replica answers its health checks", ["replica"],
                                registry=r)
        self.captures = Counter(p + "captures", "capture requests sent (add, full, reencode)", ["kind"],
                                registry=r)
        self.capture_failures = Counter(p + "capture_failures", "capture requests that failed", ["kind"],
                                        registry=r)
        self.captured_facts = Counter(p + "captured_facts", "facts captured on replicas", registry=r)
        self.injected_facts = Counter(p + "injected_facts", "facts injected into chats", registry=r)
        self.injected_tokens = Counter(p + "injected_tokens", "tokens injected into chats", registry=r)
        self.chat_retries = Counter(p + "chat_retries", "chats retried after a failed injection or a replica "
                                    "that stopped answering", ["why"], registry=r)
        self.removals = Counter(p + "removals", "remove requests sent to replicas", ["status"], registry=r)
        self.prefetches = Counter(p + "prefetches", "prefetch requests sent to replicas, by why (idle: a "
                                  "user's first chat after idle_prefetch_s; explicit: POST /v1/memory/{user}/prefetch; shared: a user "
                                  "moved to a replica that loads its memory from the shared disk) and status",
                                  ["why", "status"], registry=r)
        self.facts = Gauge(p + "facts", "memories in the database", registry=r)
        self.users = Gauge(p + "users", "users in the database", registry=r)

    def scrape(self) -> bytes:
        return generate_latest(self.registry)
