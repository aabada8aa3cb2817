"""Server metrics in the Prometheus text format (no client library needed for a handful)."""

import threading
from bisect import bisect_left
from typing import Dict, List, Sequence

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Histogram:
    def __init__(self, buckets: Sequence[float]):
        self.buckets = list(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self, name: str) -> List[str]:
        lines, cumulative = [], 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        lines.append(f"{name}_sum {self.total}")
        lines.append(f"{name}_count {self.n}")
        return lines


class Metrics:
    """Thread-safe counters, gauges and histograms of the serving engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Dict[str, int] = {"completed": 0, "aborted": 0, "rejected": 0}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        # prefix caching: tokens queried and hit (PagePool), and a state-cache model's state copies
        self.prefix_cache = {"queried": 0, "hit": 0, "state_saved": 0, "state_restored": 0, "tail_pages": 0}
        self.gauges = {"running": 0, "waiting": 0, "pages_used": 0, "pages_free": 0}
        self.ttft = _Histogram(_LATENCY_BUCKETS)
        self.itl = _Histogram(_LATENCY_BUCKETS)

    def on_request_start(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def on_request_end(self, status: str) -> None:
        with self._lock:
            self.requests[status] = self.requests.get(status, 0) + 1

    def on_rejected(self) -> None:
        self.on_request_end("rejected")

    def on_tokens(self, n: int) -> None:
        with self._lock:
            self.generation_tokens += n

    def set_preemptions(self, total: int) -> None:
        """The engine's own count (its one source), copied after each step."""
        with self._lock:
            self.preemptions = total

    def set_prefix_cache(self, queried: int, hit: int, state_saved: int = 0, state_restored: int = 0,
                         tail_pages: int = 0) -> None:
        """The scheduler's prefix-caching token counts, the state snapshot store's copies and the
        pool's tail pages matched (their one sources), copied after each step."""
        with self._lock:
            self.prefix_cache = {"queried": queried, "hit": hit, "state_saved": state_saved,
                                 "state_restored": state_restored, "tail_pages": tail_pages}

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def set_gauges(self, **values: int) -> None:
        with self._lock:
            self.gauges.update(values)

    def render(self) -> str:
        with self._lock:
            g = dict(self.gauges)
            lines = [
                "# HELP autodeploy_requests_running Sequences being processed by the engine.",
                "# TYPE autodeploy_requests_running gauge",
                f"autodeploy_requests_running {g['running']}",
                "# HELP autodeploy_requests_waiting Sequences queued for the engine.",
                "# TYPE autodeploy_requests_waiting gauge",
                f"autodeploy_requests_waiting {g['waiting']}",
                "# HELP autodeploy_kv_pages_used KV-cache pages held by sequences.",
                "# TYPE autodeploy_kv_pages_used gauge",
                f"autodeploy_kv_pages_used {g['pages_used']}",
                "# HELP autodeploy_kv_pages_free KV-cache pages free.",
                "# TYPE autodeploy_kv_pages_free gauge",
                f"autodeploy_kv_pages_free {g['pages_free']}",
                "# HELP autodeploy_requests_total Finished requests by outcome.",
                "# TYPE autodeploy_requests_total counter",
                *[f'autodeploy_requests_total{{status="{k}"}} {v}' for k, v in sorted(self.requests.items())],
                "# HELP autodeploy_prompt_tokens_total Prompt tokens of accepted requests.",
                "# TYPE autodeploy_prompt_tokens_total counter",
                f"autodeploy_prompt_tokens_total {self.prompt_tokens}",
                "# HELP autodeploy_generation_tokens_total Generated tokens.",
                "# TYPE autodeploy_generation_tokens_total counter",
                f"autodeploy_generation_tokens_total {self.generation_tokens}",
                "# HELP autodeploy_preemptions_total Sequences preempted for KV pages (freed, recomputed later).",
                "# TYPE autodeploy_preemptions_total counter",
                f"autodeploy_preemptions_total {self.preemptions}",
                "# HELP autodeploy_prefix_cache_queried_tokens_total Tokens of the sequences admitted with prefix caching.",
                "# TYPE autodeploy_prefix_cache_queried_tokens_total counter",
                f"autodeploy_prefix_cache_queried_tokens_total {self.prefix_cache['queried']}",
                "# HELP autodeploy_prefix_cache_hit_tokens_total Of those, tokens read from cached pages, not computed.",
                "# TYPE autodeploy_prefix_cache_hit_tokens_total counter",
                f"autodeploy_prefix_cache_hit_tokens_total {self.prefix_cache['hit']}",
                "# HELP autodeploy_prefix_cache_state_copies_total Models with state caches: copies of a state at a "
                "page boundary or at the end of a sequence, saved (kept for later prompts) and restored (a sequence "
                "resumed from one).",
                "# TYPE autodeploy_prefix_cache_state_copies_total counter",
                f'autodeploy_prefix_cache_state_copies_total{{op="saved"}} {self.prefix_cache["state_saved"]}',
                f'autodeploy_prefix_cache_state_copies_total{{op="restored"}} {self.prefix_cache["state_restored"]}',
                "# HELP autodeploy_prefix_cache_tail_pages_total Sequences that started from a copy of an ended "
                "sequence's partly filled last page (its hit tokens are counted above).",
                "# TYPE autodeploy_prefix_cache_tail_pages_total counter",
                f"autodeploy_prefix_cache_tail_pages_total {self.prefix_cache['tail_pages']}",
                "# HELP autodeploy_time_to_first_token_seconds Arrival to first generated token.",
                "# TYPE autodeploy_time_to_first_token_seconds histogram",
                *self.ttft.render("autodeploy_time_to_first_token_seconds"),
                "# HELP autodeploy_inter_token_latency_seconds Time between generated tokens.",
                "# TYPE autodeploy_inter_token_latency_seconds histogram",
                *self.itl.render("autodeploy_inter_token_latency_seconds"),
            ]
        return "\n".join(lines) + "\n"
