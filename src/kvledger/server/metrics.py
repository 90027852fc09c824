"""Prometheus metrics (names prefixed ``kvledger_``), one registry per app (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._declare_requests(r)
        self._declare_memory(r)
        self._declare_sessions_and_drafts(r)
        self._declare_pd(r)
        self._declare_tiers_and_engine(r)

    # The families, declared by room (the engine's stats each update feeds; ``update_engine``).
    def _declare_requests(self, r: CollectorRegistry) -> None:
        self.num_running = Gauge("kvledger_num_running_requests", "Requests admitted and running", registry=r)
        self.num_waiting = Gauge(
            "kvledger_num_waiting_requests", "Requests waiting for admission", registry=r
        )
        self.kv_usage = Gauge("kvledger_kv_usage", "Fraction of KV tokens not free", registry=r)
        self.kv_tokens = Gauge("kvledger_kv_tokens", "KV tokens by ledger state", ["state"], registry=r)
        self.req_slots_free = Gauge("kvledger_req_slots_free", "Free request slots", registry=r)
        self.cache_hit = Counter(
            "kvledger_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.prompt_tokens = Counter(
            "kvledger_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter("kvledger_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter(
            "kvledger_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.aborted = Counter(
            "kvledger_aborted_requests", "Aborted requests by reason", ["reason"], registry=r
        )
        self.retractions = Gauge("kvledger_retractions", "Retractions since the engine started", registry=r)
        self.preemptions = Gauge(
            "kvledger_preemptions", "Retractions for a higher-priority request since the engine started", registry=r
        )
        self.ttft = Histogram(
            "kvledger_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "kvledger_inter_token_latency_seconds", "Time between tokens", buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "kvledger_e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=r
        )

    def _declare_memory(self, r: CollectorRegistry) -> None:
        self.audit_runs = Gauge(
            "kvledger_memory_audit_runs", "Full memory audits run by the engine (idle and busy)", registry=r
        )
        self.audit_last_seconds = Gauge(
            "kvledger_memory_audit_last_seconds", "Duration of the last full ledger audit", registry=r
        )
        self.audit_seconds = Gauge(
            "kvledger_memory_audit_seconds",
            "Time spent in full ledger audits since the engine started",
            registry=r,
        )
        self.audit_violations = Gauge(
            "kvledger_memory_audit_violations", "Ledger violations found", registry=r
        )
        self.quarantine = Gauge(
            "kvledger_memory_quarantine",
            "Production-mode quarantine since the engine started: pages and request slots found with no "
            "owner and held aside, and those freed once proven unowned",
            ["what"],
            registry=r,
        )
        self.contained_errors = Gauge(
            "kvledger_memory_contained_errors",
            "Component failures (release hooks, tree hooks, release steps) a release completed through",
            registry=r,
        )

    def _declare_sessions_and_drafts(self, r: CollectorRegistry) -> None:
        self.sessions = Gauge("kvledger_num_streaming_sessions", "Open streaming sessions", registry=r)
        self.session_tokens = Gauge(
            "kvledger_streaming_session_held_tokens", "KV tokens held by sessions", registry=r
        )
        self.spec_accept_length = Histogram(
            "kvledger_spec_accept_length",
            "Tokens one speculative verify step gave a request (accepted drafts + 1)",
            buckets=tuple(range(1, 17)),
            registry=r,
        )
        self.spec_accept_length_mean = Gauge(
            "kvledger_spec_accept_length_mean", "Mean tokens per speculative verify step", registry=r
        )
        self._verify = [0, 0]  # steps, tokens

    def _declare_pd(self, r: CollectorRegistry) -> None:
        self.pd_transfers = Gauge(
            "kvledger_pd_transfers",
            "PD disaggregation: KV transfers of this server by outcome (since the engine started)",
            ["result"],
            registry=r,
        )
        self.pd_frames_refused = Gauge(
            "kvledger_pd_frames_refused",
            "PD: messages refused (unauthenticated or replayed, malformed, a foreign room, over a cap)",
            registry=r,
        )
        self.pd_kv_bytes = Gauge("kvledger_pd_kv_bytes", "PD: KV bytes sent or received", registry=r)
        self.pd_kv_tokens = Gauge("kvledger_pd_kv_tokens", "PD: tokens of KV sent or received", registry=r)
        self.pd_transfer_seconds = Gauge(
            "kvledger_pd_transfer_seconds", "PD: seconds spent in completed transfers", registry=r
        )
        self.pd_staged_bytes = Gauge(
            "kvledger_pd_staged_bytes",
            "PD under tensor parallel: whole-head KV bytes held on rank 0 between the group and the wire",
            registry=r,
        )

    def _declare_tiers_and_engine(self, r: CollectorRegistry) -> None:
        self.hicache_tokens = Gauge(
            "kvledger_hicache_tokens", "Hierarchical cache: L2 tokens by state", ["state"], registry=r
        )
        self.hicache_events = Gauge(
            "kvledger_hicache_events",
            "Hierarchical cache: running totals (tokens, pages, ops)",
            ["event"],
            registry=r,
        )
        self.hicache_l3 = Gauge(
            "kvledger_hicache_l3", "Hierarchical cache: L3 files and bytes", ["what"], registry=r
        )
        self.hicache_l3_rejected = Gauge(
            "kvledger_hicache_l3_rejected", "L3 files refused on read (a miss)", ["reason"], registry=r
        )
        self.cuda_graph_steps = Gauge(
            "kvledger_cuda_graph_steps",
            "Steps of the engine's decode graphs since it started: replayed, or eager by reason (prefill, "
            "speculative, lora, hisparse, kv_connector, sliding_window, batch_size)",
            ["path", "reason"],
            registry=r,
        )
        self.engine_restarts = Counter("kvledger_engine_restarts", "Engine process restarts", registry=r)
        self.watchdog_stalls = Counter(
            "kvledger_watchdog_stalls", "Engine stalls caught by the watchdog", registry=r
        )

    def update_engine(self, stats: dict) -> None:
        self.num_running.set(stats.get("num_running", 0))
        self.num_waiting.set(stats.get("num_waiting", 0))
        self.retractions.set(stats.get("retractions", 0))
        self.preemptions.set(stats.get("preemptions", 0))
        self.sessions.set(stats.get("num_sessions", 0))
        pd = stats.get("disagg")
        if pd:
            for result in ("ok", "failed", "timed_out"):
                self.pd_transfers.labels(result).set(pd[f"transfers_{result}"])
            self.pd_frames_refused.set(pd["frames_refused"])
            self.pd_kv_bytes.set(pd["bytes"])
            self.pd_kv_tokens.set(pd["tokens"])
            self.pd_transfer_seconds.set(pd["seconds"])
            self.pd_staged_bytes.set(pd["staged_bytes"])
        g = stats.get("cuda_graph")
        if g:
            self.cuda_graph_steps.labels("replay", "").set(g["replays"])
            for reason, n in g["eager_steps"].items():
                self.cuda_graph_steps.labels("eager", reason).set(n)
        m = stats.get("memory")
        if not m:
            return
        total = max(m["kv_total"], 1)
        self.kv_usage.set(1 - m["kv_free"] / total)
        for state in ("free", "cached_evictable", "cached_protected", "private", "session"):
            self.kv_tokens.labels(state).set(m[f"kv_{state}"])
        if "kv_reserved" in m:  # CUDA graphs' padding page
            self.kv_tokens.labels("reserved").set(m["kv_reserved"])
        self.kv_tokens.labels("quarantined").set(m["kv_quarantined"])
        self.req_slots_free.set(m["req_slots_free"])
        self.session_tokens.set(m["kv_session"])
        self.audit_runs.set(m["leak_check"]["checks"])
        self.audit_last_seconds.set(m["audit"]["last_ms"] / 1000)
        self.audit_seconds.set(m["audit"]["seconds_total"])
        lc = m["leak_check"]
        self.audit_violations.set(lc["violations"])
        self.contained_errors.set(lc["contained_errors"])
        for what in ("quarantined_pages", "reclaimed_pages", "quarantined_slots", "reclaimed_slots"):
            self.quarantine.labels(what).set(lc[f"{what}_total"])
        h = m.get("hicache")
        if h:
            self._update_hicache(h)

    def _update_hicache(self, h: dict) -> None:
        for state in ("total", "free", "cached", "loading", "storing", "prefetching", "session"):
            self.hicache_tokens.labels(state).set(h[f"l2_{state}"])
        for event in (
            "backed_up_pages", "l1_demoted_pages", "l2_evicted_pages", "l2_hit_tokens", "l3_hit_tokens",
            "prefetches", "prefetches_cancelled", "stores", "session_demotions", "session_promotions",
        ):  # fmt: skip
            self.hicache_events.labels(event).set(h[event])
        if h.get("storage_backend"):
            for what in ("l3_files", "l3_bytes", "pages_written", "pages_read", "write_errors"):
                self.hicache_l3.labels(what).set(h[what])
            for reason, n in h["rejected"].items():
                self.hicache_l3_rejected.labels(reason).set(n)

    def observe_verify(self, tokens: int) -> None:
        self.spec_accept_length.observe(tokens)
        self._verify[0] += 1
        self._verify[1] += tokens
        self.spec_accept_length_mean.set(self._verify[1] / self._verify[0])

    def engine_died(self) -> None:
        self.sessions.set(0)
        self.session_tokens.set(0)
        self.num_running.set(0)
        self.num_waiting.set(0)
        self.engine_restarts.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
