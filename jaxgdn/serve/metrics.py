"""/metrics: the engine's snapshot in Prometheus' text format (prometheus_client)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

GAUGES = {
    "running": ("jaxgdn_requests_running", "requests in the running batch"),
    "waiting": ("jaxgdn_requests_waiting", "requests waiting for a slot or pages"),
    "kv_pages_used": ("jaxgdn_kv_pages_used", "KV cache pages held by requests"),
    "kv_pages_cached": ("jaxgdn_kv_pages_cached", "KV cache pages held by the prefix cache alone (freed on demand)"),
    "kv_pages_total": ("jaxgdn_kv_pages_total", "KV cache pages in all"),
    "slots_used": ("jaxgdn_gdn_slots_used", "request slots (GDN state) in use"),
    "slots_total": ("jaxgdn_gdn_slots_total", "request slots (GDN state) in all"),
    "snapshots_used": ("jaxgdn_gdn_snapshots_used", "GDN state snapshots the prefix cache holds"),
    "snapshots_total": ("jaxgdn_gdn_snapshots_total", "GDN state snapshots in all"),
    "generation_tokens_per_s": ("jaxgdn_generation_tokens_per_second", "output tokens per second, last 10 s"),
    "compiles_after_startup": ("jaxgdn_compiles_after_startup", "step and state copy programs compiled after start-up"),
    "xla_compiles_after_startup": ("jaxgdn_xla_compiles_after_startup",
                                   "JAX compile events (tracing, lowering, compiling) in the engine's process after "
                                   "start-up"),
}
COUNTERS = {
    "prompt_tokens": ("jaxgdn_prompt_tokens", "prompt tokens of the requests admitted"),
    "generation_tokens": ("jaxgdn_generation_tokens", "output tokens produced"),
    "num_steps": ("jaxgdn_model_steps", "model steps run"),
    "spec_drafted": ("jaxgdn_spec_decode_draft_tokens", "MTP draft tokens verified"),
    "spec_accepted": ("jaxgdn_spec_decode_accepted_tokens", "MTP draft tokens accepted"),
    "prefix_cache_queries": ("jaxgdn_prefix_cache_queries", "prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("jaxgdn_prefix_cache_hits", "prompt tokens found in the prefix cache (not computed)"),
    "prefix_cache_evicted_pages": ("jaxgdn_prefix_cache_evicted_pages", "cached KV pages evicted to make room"),
}


class _Snapshot:
    def __init__(self, snapshot: dict, role: str):
        self.snapshot, self.role = snapshot, role

    def collect(self):
        s = self.snapshot
        for key, (name, doc) in GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["role"])
            g.add_metric([self.role], float(s.get(key, 0)))
            yield g
        for key, (name, doc) in COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["role"])
            c.add_metric([self.role], float(s.get(key, 0)))
            yield c
        done = CounterMetricFamily("jaxgdn_requests_finished", "requests finished, by reason", labels=["role", "reason"])
        for key, value in s.items():
            if key.startswith("finished_"):
                done.add_metric([self.role, key.removeprefix("finished_")], float(value))
        yield done


def prometheus_text(snapshot: dict, role: str) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(snapshot, role))
    return generate_latest(registry).decode()
