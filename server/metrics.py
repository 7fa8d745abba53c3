"""Prometheus metrics with vLLM-style names (`llamaserve:` prefix), one CollectorRegistry per app.

Engine numbers are pulled at scrape time from each loaded engine's `stats()`: gauges and counters
are read as they are; histogram observations (which `stats()` hands over once) are fed into
histograms this module keeps per model, so nothing is lost between scrapes.

The engine numbers are also published under vLLM's own names (`vllm:` prefix, `model_name` label,
vLLM's types and buckets), which the Gateway API Inference Extension's endpoint picker (llm-d)
scrapes to route between replicas (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`) and vLLM's Grafana dashboards read.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import structlog

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.types import EngineClient, EngineStats

PREFIX = "llamaserve:"
VLLM_PREFIX = "vllm:"
log = structlog.get_logger("llamaserve.metrics")
_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# vLLM's bucket shapes (vllm/v1/metrics/loggers.py), so dashboards built for it read ours unchanged
_VLLM_TTFT_BUCKETS_S = _TTFT_BUCKETS_S + (160.0, 640.0, 2560.0)
_VLLM_ITL_BUCKETS_S = _TPOT_BUCKETS_S
_VLLM_REQUEST_BUCKETS_S = _E2E_BUCKETS_S + (1920.0, 7680.0)

EnginesFn = Callable[[], Sequence[tuple[str, EngineClient]]]


class _EngineCollector(Collector):
    def __init__(self, engines: EnginesFn) -> None:
        self._engines = engines
        labels = ["model_name"]
        self._histograms = {
            "observations_ttft_s": Histogram(f"{PREFIX}time_to_first_token_seconds", "Time to first token.",
                                             labels, buckets=_TTFT_BUCKETS_S, registry=None),
            "observations_tpot_s": Histogram(f"{PREFIX}time_per_output_token_seconds", "Time per output token.",
                                             labels, buckets=_TPOT_BUCKETS_S, registry=None),
            "observations_e2e_s": Histogram(f"{PREFIX}e2e_request_latency_seconds", "End-to-end request latency.",
                                            labels, buckets=_E2E_BUCKETS_S, registry=None),
            "observations_step_s": Histogram(f"{PREFIX}engine_step_seconds", "Duration of one engine step.",
                                             labels, buckets=_STEP_BUCKETS_S, registry=None),
            "observations_batch_size": Histogram(f"{PREFIX}batch_size", "Sequences per engine step.",
                                                 labels, buckets=_BATCH_BUCKETS, registry=None),
        }
        # (stats attribute, histogram): one attribute may feed several (a vLLM name and its older alias)
        self._vllm_histograms: list[tuple[str, Histogram]] = [
            (attribute, Histogram(f"{VLLM_PREFIX}{name}", doc, labels, buckets=buckets, registry=None))
            for attribute, name, doc, buckets in (
                ("observations_ttft_s", "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                 _VLLM_TTFT_BUCKETS_S),
                ("observations_itl_s", "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                 _VLLM_ITL_BUCKETS_S),
                ("observations_itl_s", "time_per_output_token_seconds",
                 "Histogram of time per output token in seconds (the older name of inter_token_latency).",
                 _VLLM_ITL_BUCKETS_S),
                ("observations_tpot_s", "request_time_per_output_token_seconds",
                 "Histogram of time_per_output_token_seconds per request.", _VLLM_ITL_BUCKETS_S),
                ("observations_e2e_s", "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                 _VLLM_REQUEST_BUCKETS_S),
                ("observations_queue_s", "request_queue_time_seconds",
                 "Histogram of time spent in WAITING phase for request.", _VLLM_REQUEST_BUCKETS_S),
                ("observations_prefill_s", "request_prefill_time_seconds",
                 "Histogram of time spent in PREFILL phase for request.", _VLLM_REQUEST_BUCKETS_S),
                ("observations_decode_s", "request_decode_time_seconds",
                 "Histogram of time spent in DECODE phase for request.", _VLLM_REQUEST_BUCKETS_S),
            )
        ]

    def describe(self) -> Iterable[Metric]:
        return []  # metrics depend on which engines are loaded at scrape time

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily(f"{PREFIX}num_requests_running", "Requests running on the engine.", labels=["model_name"])
        waiting = GaugeMetricFamily(f"{PREFIX}num_requests_waiting", "Requests waiting to be scheduled.", labels=["model_name"])
        kv_usage = GaugeMetricFamily(f"{PREFIX}kv_cache_usage_perc", "KV cache usage (1 means 100 percent).", labels=["model_name"])
        kv_total = GaugeMetricFamily(f"{PREFIX}kv_cache_blocks_total", "KV cache blocks.", labels=["model_name"])
        # by the preempted request's priority: 0 online, higher values less urgent (1: Batch API items)
        preemptions = CounterMetricFamily(f"{PREFIX}num_preemptions", "Preemptions.", labels=["model_name", "priority"])
        counters = {
            name: CounterMetricFamily(f"{PREFIX}{name}", doc, labels=["model_name"])
            for name, doc in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
                ("prompt_tokens", "Prompt tokens processed."),
                ("generation_tokens", "Tokens generated."),
                ("spec_decode_draft_tokens", "Speculative decoding: draft tokens proposed and verified."),
                ("spec_decode_accepted_tokens", "Speculative decoding: draft tokens accepted."),
            )
        }
        acceptance = GaugeMetricFamily(f"{PREFIX}spec_decode_acceptance_rate",
                                       "Speculative decoding: accepted over proposed draft tokens, since start.",
                                       labels=["model_name"])
        success = CounterMetricFamily(f"{PREFIX}request_success", "Finished requests.", labels=["model_name", "finished_reason"])
        vllm = _VllmFamilies()
        for model_id, engine in self._engines():
            try:
                stats: EngineStats = engine.stats()
            except Exception:  # noqa: BLE001 - a dying engine must not break the whole scrape
                log.exception("engine stats failed", model=model_id)
                continue
            labels = [model_id]
            running.add_metric(labels, stats.num_running)
            waiting.add_metric(labels, stats.num_waiting)
            kv_usage.add_metric(labels, stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
            kv_total.add_metric(labels, stats.kv_blocks_total)
            for priority, count in sorted({0: 0, **stats.num_preempted_by_priority}.items()):
                preemptions.add_metric([model_id, str(priority)], count)
            counters["prefix_cache_queries"].add_metric(labels, stats.prefix_cache_queries_total)
            counters["prefix_cache_hits"].add_metric(labels, stats.prefix_cache_hits_total)
            counters["prompt_tokens"].add_metric(labels, stats.prompt_tokens_total)
            counters["generation_tokens"].add_metric(labels, stats.generation_tokens_total)
            counters["spec_decode_draft_tokens"].add_metric(labels, stats.spec_decode_num_draft_tokens_total)
            counters["spec_decode_accepted_tokens"].add_metric(labels, stats.spec_decode_num_accepted_tokens_total)
            drafted = stats.spec_decode_num_draft_tokens_total
            acceptance.add_metric(labels, stats.spec_decode_num_accepted_tokens_total / drafted if drafted else 0.0)
            for reason, count in sorted(stats.requests_finished_total.items()):
                success.add_metric([model_id, reason], count)
            vllm.add(model_id, stats)
            for attribute, histogram in [*self._histograms.items(), *self._vllm_histograms]:
                child = histogram.labels(model_id)
                for value in getattr(stats, attribute):
                    child.observe(value)
        yield from (running, waiting, kv_usage, kv_total, preemptions, *counters.values(), acceptance, success)
        yield from vllm.families()
        for histogram in [*self._histograms.values(), *(h for _, h in self._vllm_histograms)]:
            yield from histogram.collect()


class _VllmFamilies:
    """One scrape's gauges and counters under vLLM's names (the histograms are kept by _EngineCollector)."""

    def __init__(self) -> None:
        labels = ["model_name"]
        self.running = GaugeMetricFamily(f"{VLLM_PREFIX}num_requests_running",
                                         "Number of requests in model execution batches.", labels=labels)
        self.waiting = GaugeMetricFamily(f"{VLLM_PREFIX}num_requests_waiting", "Number of requests waiting to be processed.",
                                         labels=labels)
        self.kv_usage = GaugeMetricFamily(f"{VLLM_PREFIX}kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                          labels=labels)
        self.gpu_kv_usage = GaugeMetricFamily(f"{VLLM_PREFIX}gpu_cache_usage_perc",
                                              "KV-cache usage (the older name of kv_cache_usage_perc).", labels=labels)
        self.preemptions = CounterMetricFamily(f"{VLLM_PREFIX}num_preemptions", "Cumulative number of preemptions.",
                                               labels=labels)
        self.prompt_tokens = CounterMetricFamily(f"{VLLM_PREFIX}prompt_tokens", "Number of prefill tokens processed.",
                                                 labels=labels)
        self.generation_tokens = CounterMetricFamily(f"{VLLM_PREFIX}generation_tokens",
                                                     "Number of generation tokens processed.", labels=labels)
        self.prefix_queries = CounterMetricFamily(f"{VLLM_PREFIX}prefix_cache_queries",
                                                  "Prefix cache queries, in terms of number of queried tokens.", labels=labels)
        self.prefix_hits = CounterMetricFamily(f"{VLLM_PREFIX}prefix_cache_hits",
                                               "Prefix cache hits, in terms of number of cached tokens.", labels=labels)
        self.success = CounterMetricFamily(f"{VLLM_PREFIX}request_success", "Count of successfully processed requests.",
                                           labels=["model_name", "finished_reason"])
        # speculative decoding, as vLLM's SpecDecodingProm names them (per position: a `position` label)
        self.spec_drafts = CounterMetricFamily(f"{VLLM_PREFIX}spec_decode_num_drafts", "Number of spec decoding drafts.",
                                               labels=labels)
        self.spec_draft_tokens = CounterMetricFamily(f"{VLLM_PREFIX}spec_decode_num_draft_tokens", "Number of draft tokens.",
                                                     labels=labels)
        self.spec_accepted = CounterMetricFamily(f"{VLLM_PREFIX}spec_decode_num_accepted_tokens",
                                                 "Number of accepted tokens.", labels=labels)
        self.spec_per_pos = CounterMetricFamily(f"{VLLM_PREFIX}spec_decode_num_accepted_tokens_per_pos",
                                                "Accepted tokens per draft position.", labels=["model_name", "position"])

    def add(self, model_id: str, stats: EngineStats) -> None:
        labels = [model_id]
        usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        self.running.add_metric(labels, stats.num_running)
        self.waiting.add_metric(labels, stats.num_waiting)
        self.kv_usage.add_metric(labels, usage)
        self.gpu_kv_usage.add_metric(labels, usage)
        self.preemptions.add_metric(labels, stats.num_preempted_total)
        self.prompt_tokens.add_metric(labels, stats.prompt_tokens_total)
        self.generation_tokens.add_metric(labels, stats.generation_tokens_total)
        self.prefix_queries.add_metric(labels, stats.prefix_cache_queries_total)
        self.prefix_hits.add_metric(labels, stats.prefix_cache_hits_total)
        for reason, count in sorted(stats.requests_finished_total.items()):
            self.success.add_metric([model_id, reason], count)
        if stats.spec_decode_num_accepted_tokens_per_pos:  # only engines that speculate, as vLLM
            self.spec_drafts.add_metric(labels, stats.spec_decode_num_drafts_total)
            self.spec_draft_tokens.add_metric(labels, stats.spec_decode_num_draft_tokens_total)
            self.spec_accepted.add_metric(labels, stats.spec_decode_num_accepted_tokens_total)
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                self.spec_per_pos.add_metric([model_id, str(position)], count)

    def families(self) -> tuple[Metric, ...]:
        return (self.running, self.waiting, self.kv_usage, self.gpu_kv_usage, self.preemptions, self.prompt_tokens,
                self.generation_tokens, self.prefix_queries, self.prefix_hits, self.success, self.spec_drafts,
                self.spec_draft_tokens, self.spec_accepted, self.spec_per_pos)
class _LoraCollector(Collector):
    """LoRA adapters per engine: requests admitted per adapter, and vLLM's `vllm:lora_requests_info`
    (the running and waiting adapters as comma-separated labels, its value the scrape's unix time,
    as vLLM sets it), which gateways that route by adapter read (the Gateway API Inference Extension)."""

    def __init__(self, engines: EnginesFn) -> None:
        self._engines = engines

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(f"{PREFIX}lora_requests", "Sequences admitted per LoRA adapter.",
                                       labels=["model_name", "lora_name"])
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        now_s = time.time()
        for model_id, engine in self._engines():
            activity = getattr(engine, "adapter_activity", None)  # engines that serve adapters
            if activity is None:
                continue
            try:
                running, waiting = activity()
                totals = engine.adapter_requests_total()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - a dying engine must not break the whole scrape
                log.exception("engine adapter stats failed", model=model_id)
                continue
            for name, count in sorted(totals.items()):
                requests.add_metric([model_id, name], count)
            max_lora = getattr(getattr(engine, "config", None), "max_loras", 0)
            info.add_metric([model_id, ",".join(running), ",".join(waiting), str(max_lora)], now_s)
        yield requests
        yield info


class _LifecycleCollector(Collector):
    """The registry's model lifecycle counters (loads, failures, evictions, memory)."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, doc, value in (
            ("model_loads", "Model loads completed.", stats.loads_total),
            ("model_load_failures", "Model loads that failed.", stats.load_failures_total),
            ("model_load_seconds", "Seconds spent loading models.", stats.load_seconds_total),
            ("model_unloads", "Models unloaded.", stats.unloads_total),
            ("model_evictions", "Idle models evicted to make room.", stats.evictions_total),
            ("model_idle_unloads", "Models unloaded after their keep_alive passed idle.", stats.idle_unloads_total),
        ):
            yield CounterMetricFamily(f"{PREFIX}{name}", doc, value=value)
        for name, doc, value in (
            ("models_loaded", "Models loaded now.", stats.loaded_models),
            ("models_loading", "Models loading now.", stats.loading_models),
            ("model_memory_reserved_bytes", "Bytes reserved by loaded and loading models.", stats.memory_reserved_bytes),
        ):
            yield GaugeMetricFamily(f"{PREFIX}{name}", doc, value=value)
        if stats.memory_budget_bytes is not None:
            yield GaugeMetricFamily(f"{PREFIX}model_memory_budget_bytes", "The memory budget for models.",
                                    value=stats.memory_budget_bytes)


class _SubsystemCollector(Collector):
    """`subsystem_up{subsystem}`: 0 while an optional subsystem is down (server/subsystems.py)."""

    def __init__(self, states: Callable[[], Iterable[tuple[str, bool]]]) -> None:
        self._states = states

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(f"{PREFIX}subsystem_up", "1 unless the optional subsystem is down (see /ready for "
                               "the reason).", labels=["subsystem"])
        for name, is_up in self._states():
            up.add_metric([name], 1.0 if is_up else 0.0)
        yield up


class ServerMetrics:
    """The app's own registry (never prometheus_client's global one), so apps and tests don't share state."""

    def __init__(self, engines: EnginesFn) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engines))
        self.registry.register(_LoraCollector(engines))
        self.http_requests = Counter(
            f"{PREFIX}http_requests", "HTTP requests by route and status.", ["method", "route", "status"],
            registry=self.registry,
        )
        self.http_latency = Histogram(
            f"{PREFIX}http_request_duration_seconds", "HTTP request latency (streams: until the last byte).",
            ["route"], buckets=_E2E_BUCKETS_S, registry=self.registry,
        )

    def add_lifecycle(self, stats: Callable[[], Any]) -> None:
        """Model lifecycle metrics from a `registry.lifecycle_stats`-like callable."""
        self.registry.register(_LifecycleCollector(stats))

    def add_subsystems(self, states: Callable[[], Iterable[tuple[str, bool]]]) -> None:
        """Optional subsystems' health from a callable giving (name, is up) pairs."""
        self.registry.register(_SubsystemCollector(states))

    def render(self) -> bytes:
        return generate_latest(self.registry)
