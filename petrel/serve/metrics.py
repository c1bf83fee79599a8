"""Prometheus metrics, one CollectorRegistry per app. The names are part of petrel's interface: never rename.

Per request the engine serves, whatever its front (the HTTP endpoints, the gRPC worker's trtllm and vLLM services,
the LLM API called in the server's process), counted where its caller sees it end (petrel/request_events.py):
petrel_request_success_total{finished_reason} (per sequence: stop | length, the engine's reason in OpenAI's words,
a timeout reading as length; a tool call ends with stop), petrel_request_aborted_total (given up before its end:
the client went away, a gRPC call cancelled or aborted), petrel_request_rejected_total (refused because the server
was full: HTTP 429, gRPC RESOURCE_EXHAUSTED), petrel_prompt_tokens_total, petrel_generation_tokens_total,
petrel_time_to_first_token_seconds, petrel_time_per_output_token_seconds, petrel_e2e_request_latency_seconds. A
request that fails with an error counts in none of them. Engine state (read through the engine loop at each scrape):
petrel_num_requests_running, petrel_num_requests_waiting, petrel_kv_cache_usage_perc,
petrel_prefix_cache_hit_rate, petrel_prefix_cache_queries_tokens, petrel_prefix_cache_hits_tokens,
petrel_num_preemptions, and with speculative decoding petrel_spec_decode_num_draft_tokens,
petrel_spec_decode_num_accepted_tokens, petrel_spec_decode_acceptance_rate (accepted / drafted since start).
With KV tiers (--kv-host-tier-bytes, --kv-disk-tier-path), per tier since start: petrel_kv_tier_hits{tier},
petrel_kv_tier_misses{tier}, petrel_kv_tier_bytes_read{tier}, petrel_kv_tier_bytes_written{tier},
petrel_kv_tier_dropped{tier}, petrel_kv_tier_errors{tier}; and petrel_kv_tier_blocks{event=loaded|stored|rejected},
petrel_kv_tier_seconds{phase=fetch|store} (time spent bringing blocks back, and storing evicted ones).
Vision-language models' encoder (counters, brought up to the engine's totals at each scrape):
petrel_encoder_images_encoded_total, petrel_encoder_cache_hits_total, petrel_encoder_seconds_total.
Disaggregated serving (--kv-transfer-role), the prefill side: petrel_kv_transfer_handoffs_total and
petrel_kv_transfer_handoff_bytes_total (prompts' KV sent to decode instances), petrel_kv_transfer_handoff_seconds
(histogram: a fetch's request to its last byte sent), petrel_kv_transfer_handoff_failures_total (fetches refused:
wrong secret, unknown or expired handle, or not sent whole), petrel_kv_transfer_pins_held (prompts' KV pinned now,
waiting for their fetch), petrel_kv_transfer_pins_expired_total (pins released unfetched after
--kv-transfer-timeout); the decode side: petrel_kv_transfer_fetches_total, petrel_kv_transfer_fetch_bytes_total,
petrel_kv_transfer_fetch_seconds (histogram), petrel_kv_transfer_fetch_failures_total (fetches refused or failed:
their requests failed).
Mixtures of experts: petrel_moe_expert_tokens{layer, expert} (tokens routed to that expert of that layer since
start: a hot expert shows as one series growing faster than its layer's others).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The app's metrics. It listens to the engine's request events (`llm.engine.events.listen(metrics)`, done by
    build_app), so every request the engine serves is counted, whichever front it came through."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(name, doc, ["model_name", *extra], registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, ["model_name"], registry=r).labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(**labels)

        self._labels = labels
        self.request_success = counter(
            "petrel_request_success", "Finished sequences by finish reason", ["finished_reason"]
        )
        self.aborted = counter("petrel_request_aborted", "Requests aborted because the client went away").labels(
            **labels
        )
        self.rejected = counter(
            "petrel_request_rejected", "Requests refused with 429 because the server was full"
        ).labels(**labels)
        self.prompt_tokens = counter("petrel_prompt_tokens", "Prompt tokens of finished requests").labels(**labels)
        self.generation_tokens = counter("petrel_generation_tokens", "Generated tokens").labels(**labels)
        self.ttft = histogram("petrel_time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.tpot = histogram(
            "petrel_time_per_output_token_seconds", "Time per output token after the first", _TPOT_BUCKETS
        )
        self.e2e = histogram("petrel_e2e_request_latency_seconds", "Arrival to last token", _LATENCY_BUCKETS)
        self.running = gauge("petrel_num_requests_running", "Sequences in the running batch")
        self.waiting = gauge("petrel_num_requests_waiting", "Sequences waiting to be scheduled")
        self.kv_usage = gauge("petrel_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1)")
        self.hit_rate = gauge("petrel_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / queried")
        self.prefix_queries = gauge("petrel_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = gauge("petrel_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache")
        self.preemptions = gauge("petrel_num_preemptions", "Sequences preempted since start")
        self.spec_drafted = gauge("petrel_spec_decode_num_draft_tokens", "Draft tokens verified since start")
        self.spec_accepted = gauge("petrel_spec_decode_num_accepted_tokens", "Draft tokens accepted since start")
        self.spec_rate = gauge("petrel_spec_decode_acceptance_rate", "Accepted / verified draft tokens since start")

        def tier_gauge(name, doc, label="tier"):
            return Gauge(name, doc, ["model_name", label], registry=r)

        self.tier_gauges = {  # KVTierIO.stats() counter -> gauge labelled by tier
            "hits": tier_gauge("petrel_kv_tier_hits", "Block lookups a KV tier answered, since start"),
            "misses": tier_gauge("petrel_kv_tier_misses", "Block lookups a KV tier did not hold, since start"),
            "bytes_out": tier_gauge("petrel_kv_tier_bytes_read", "Bytes of KV blocks read from a tier, since start"),
            "bytes_in": tier_gauge("petrel_kv_tier_bytes_written", "Bytes of KV blocks stored in a tier, since start"),
            "dropped": tier_gauge("petrel_kv_tier_dropped", "KV blocks a tier did not keep (too large, failed write)"),
            "errors": tier_gauge("petrel_kv_tier_errors", "I/O errors of a KV tier, since start"),
        }
        self.tier_blocks = tier_gauge(
            "petrel_kv_tier_blocks", "KV blocks loaded from / stored to / refused by the tiers, since start", "event"
        )
        self.tier_seconds = tier_gauge(
            "petrel_kv_tier_seconds", "Seconds spent fetching blocks from / storing blocks to the tiers", "phase"
        )
        self.expert_tokens = Gauge(
            "petrel_moe_expert_tokens",
            "Tokens routed to an expert of a mixture-of-experts layer, since start",
            ["model_name", "layer", "expert"],
            registry=r,
        )
        self.engine_up = gauge("petrel_engine_up", "1 when the engine loop answered this scrape, else 0")
        self.encoder = (  # the engine's (images encoded, cache hits, seconds) since start, as counters
            counter("petrel_encoder_images_encoded", "Images run through the vision encoder").labels(**labels),
            counter("petrel_encoder_cache_hits", "Images whose encoder output came from the encoder cache").labels(
                **labels
            ),
            counter("petrel_encoder_seconds", "Time spent in the vision encoder").labels(**labels),
        )
        self._encoder_seen = (0, 0, 0.0)

        def kv_counter(name, doc):
            return counter(f"petrel_kv_transfer_{name}", doc).labels(**labels)

        self.kv_handoffs = kv_counter("handoffs", "Prompts' KV sent to decode instances")
        self.kv_handoff_bytes = kv_counter("handoff_bytes", "Bytes of prompts' KV sent to decode instances")
        self.kv_handoff_seconds = histogram(
            "petrel_kv_transfer_handoff_seconds", "A KV fetch's request to its last byte sent", _TRANSFER_BUCKETS
        )
        self.kv_handoff_failures = kv_counter("handoff_failures", "KV fetches refused or not sent whole")
        self.kv_fetches = kv_counter("fetches", "Prompts' KV fetched from prefill instances")
        self.kv_fetch_bytes = kv_counter("fetch_bytes", "Bytes of prompts' KV fetched from prefill instances")
        self.kv_fetch_seconds = histogram(
            "petrel_kv_transfer_fetch_seconds", "Time to fetch a prompt's KV from a prefill instance", _TRANSFER_BUCKETS
        )
        self.kv_fetch_failures = kv_counter("fetch_failures", "KV fetches refused or failed (their requests failed)")
        self.kv_pins_held = gauge("petrel_kv_transfer_pins_held", "Prompts' KV pinned for a decode instance's fetch")
        self.kv_pins_expired = kv_counter("pins_expired", "Pinned prompts' KV released unfetched after the timeout")
        self._pins_expired_seen = 0

    # ------------------------------------------------------------------ the engine's request events
    def request_finished(self, request) -> None:
        """One request at its end (a petrel.request_events.FinishedRequest)."""
        if request.error is not None:
            return
        if "cancelled" in request.finish_reasons:  # aborted in the engine without RequestFuture.abort
            self.aborted.inc()
            return
        for reason in request.finish_reasons:
            self.request_success.labels(finished_reason=api_finish_reason(reason), **self._labels).inc()
        self.prompt_tokens.inc(request.prompt_tokens)
        self.generation_tokens.inc(request.generated_tokens)
        m = request.perf
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.e2e is not None:
            self.e2e.observe(m.e2e)

    def request_aborted(self) -> None:
        self.aborted.inc()

    def request_rejected(self) -> None:
        self.rejected.inc()

    def kv_handed_off(self, num_bytes: int, seconds: float) -> None:
        self.kv_handoffs.inc()
        self.kv_handoff_bytes.inc(num_bytes)
        self.kv_handoff_seconds.observe(seconds)

    def kv_handoff_failed(self) -> None:
        self.kv_handoff_failures.inc()

    def kv_fetched(self, num_bytes: int, seconds: float) -> None:
        self.kv_fetches.inc()
        self.kv_fetch_bytes.inc(num_bytes)
        self.kv_fetch_seconds.observe(seconds)

    def kv_fetch_failed(self) -> None:
        self.kv_fetch_failures.inc()

    async def render(self, engine, timeout: float = 2.0) -> bytes:
        try:
            state = await asyncio.to_thread(engine.call, _engine_state, timeout)
        except Exception:  # noqa: BLE001 - a stuck engine still gets its request metrics scraped
            state = None
        if state is None:
            self.engine_up.set(0)
        else:
            self.engine_up.set(1)
            self.running.set(state["running"])
            self.waiting.set(state["waiting"])
            self.kv_usage.set(state["kv_usage"])
            self.hit_rate.set(state["hit_rate"])
            self.prefix_queries.set(state["queried"])
            self.prefix_hits.set(state["hits"])
            self.preemptions.set(state["preemptions"])
            self.spec_drafted.set(state["drafted"])
            self.spec_accepted.set(state["accepted"])
            self.spec_rate.set(state["accepted"] / state["drafted"] if state["drafted"] else 0.0)
            if state["kv_tiers"] is not None:
                self._set_tiers(state["kv_tiers"])
            if state["expert_tokens"] is not None:
                self._set_expert_tokens(state["expert_tokens"])
            for metric, seen, total in zip(self.encoder, self._encoder_seen, state["encoder"]):
                if total > seen:
                    metric.inc(total - seen)
            self._encoder_seen = tuple(max(a, b) for a, b in zip(self._encoder_seen, state["encoder"]))
            self.kv_pins_held.set(state["pins_held"])
            if state["pins_expired"] > self._pins_expired_seen:
                self.kv_pins_expired.inc(state["pins_expired"] - self._pins_expired_seen)
                self._pins_expired_seen = state["pins_expired"]
        return generate_latest(self.registry)

    def _set_expert_tokens(self, tokens: dict) -> None:
        model = self._labels["model_name"]
        for layer, counts in tokens.items():
            for expert, count in enumerate(counts):
                self.expert_tokens.labels(model_name=model, layer=str(layer), expert=str(expert)).set(count)

    def _set_tiers(self, tiers: dict) -> None:
        model = self._labels["model_name"]
        for tier, counters in tiers.items():
            if tier == "all":
                continue
            for key, gauge in self.tier_gauges.items():
                gauge.labels(model_name=model, tier=tier).set(counters[key])
        chain = tiers["all"]
        for event in ("loaded", "stored", "rejected"):
            self.tier_blocks.labels(model_name=model, event=event).set(chain[f"{event}_blocks"])
        for phase in ("fetch", "store"):
            self.tier_seconds.labels(model_name=model, phase=phase).set(chain[f"{phase}_seconds"])


def api_finish_reason(reason: str | None) -> str | None:
    """petrel's stop | length | timeout | cancelled -> OpenAI's; a cut-short sequence reads as 'length'."""
    if reason is None or reason in ("stop", "length"):
        return reason
    return "length"


def _engine_state(core) -> dict:
    bm, sched = core.block_manager, core.scheduler
    pinned = getattr(core, "pinned", None)
    queried, hits = sched.prefix_queried_tokens, sched.prefix_hit_tokens
    return {
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "kv_usage": bm.num_used_blocks / bm.num_blocks if bm.num_blocks else 0.0,
        "hit_rate": hits / queried if queried else 0.0,
        "queried": queried,
        "hits": hits,
        "preemptions": sched.num_preemptions,
        "drafted": core.num_draft_tokens,
        "accepted": core.num_accepted_tokens,
        "kv_tiers": core.tier_io.stats() if getattr(core, "tier_io", None) is not None else None,
        "encoder": core.encoder_counters(),
        "pins_held": len(pinned) if pinned is not None else 0,
        "pins_expired": pinned.num_expired if pinned is not None else 0,
        "expert_tokens": _copied(getattr(core, "expert_tokens", None)),  # a mixture of experts' (None: dense)
    }


def _copied(table: dict | None) -> dict | None:
    """A copy of the core's {layer: [per expert]} made in the engine loop, read later by the scrape's thread."""
    return {layer: list(counts) for layer, counts in table.items()} if table else None
