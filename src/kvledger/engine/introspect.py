"""What an engine says about itself, read between steps: its identity (``EngineInfo``), the books'
figures and audit, who owns every page, the PD transport's and the graphs' counters, every rank's
compile counts, and the heartbeat's stats. Nothing here changes the engine."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass


@dataclass
class EngineInfo:
    model_name: str
    model_path: str
    dtype: str
    context_length: int
    vocab_size: int
    page_size: int
    max_total_tokens: int
    kv_bytes_per_token: int = 0
    weight_bytes: int = 0
    arch: str = ""  # llama | qwen2 | qwen3 | mistral
    tp_size: int = 1
    tp_worker_pids: list[int] = dataclasses.field(default_factory=list)  # this node's other ranks
    disaggregation_mode: str | None = None  # prefill | decode | None


class EngineView:
    """The read-only questions of one ``EngineCore`` (``core.view``; the core is named, not imported:
    it builds its view)."""

    def __init__(self, core):
        self.core = core

    def memory(self) -> dict:
        """The ledger's figures (``/get_server_info``'s ``memory``) and the session count."""
        m = self.core.kv_manager.ledger.figures()
        m["num_sessions"] = len(self.core.sessions.sessions)
        return m

    def audit(self):
        return self.core.kv_manager.ledger.audit()

    def page_map(self) -> dict:
        """Who owns every page, with the figures, requests, sessions and last audit of the same
        instant (one engine call, so the parts agree): ``/memory/pages`` and the dashboard."""
        core = self.core
        ledger = core.kv_manager.ledger
        tree = core.kv_manager.tree
        report = ledger.last_report
        return {
            "page_size": ledger.pages.page_size,
            "num_pages": ledger.pages.num_pages,
            "runs": ledger.page_runs(),
            "memory": self.memory(),
            "requests": [
                {
                    "rid": r.rid,
                    "state": r.state.value,
                    "prompt_tokens": len(r.input_ids),
                    "output_tokens": len(r.output_ids),
                    "kv_tokens": r.kv_len,
                    "pages": len(r.pages) - r.num_out_pages,  # (held: out-of-window entries are not)
                    "session": r.session.id if r.session is not None else None,
                }
                for r in core.scheduler.reqs.values()
            ],
            "sessions": core.sessions.describe(),
            "radix": {
                "nodes": sum(1 for _ in tree.nodes()),
                "pages": tree.evictable_pages + tree.protected_pages,
            },
            "last_audit": None if report is None else {"ok": report.ok, "result": report.describe(limit=5)},
        }

    def connector_stats(self) -> dict | None:
        """The PD transport's counters (None without one)."""
        core = self.core
        stats = getattr(core.disagg_connector, "stats", None)
        if stats is None:
            return None
        out = {"mode": core.cfg.disagg.disaggregation_mode, **stats.as_dict()}
        out["authenticated"] = core.disagg_connector.opener.authenticates  # a shared key seals the wire
        if (addr := getattr(core.disagg_connector, "address", None)) is not None:
            out["bootstrap"] = addr  # prefill: where its bootstrap port listens (host:port)
        return out

    def graph_stats(self) -> dict | None:
        """The decode graphs' sizes, replays and eager steps by reason (None: no graphs)."""
        g = self.core.runner.graphs
        return None if g is None else g.stats()

    def vision_stats(self) -> dict | None:
        """A vision model's encoder counters: images encoded, vision-tower calls (a batch is one),
        images read from the encoder cache (None: a text-only model)."""
        im = self.core.runner.images
        if im is None:
            return None
        return {"images_encoded": im.encoded, "tower_calls": im.encoder.calls, "cache_hits": im.cache_hits}

    def rank_stats(self) -> list[dict]:
        """Every rank's ``LlamaModel.compile_stats``, rank 0 first (one entry without TP)."""
        return [{"rank": 0, **self.core.model.compile_stats()}, *self.core.executor.worker_stats()]

    def lora_list(self) -> list[dict]:
        loras = self.core.loras
        return [] if loras is None else [a.info() for a in loras.adapters.values()]

    def info_dict(self) -> dict:
        return {**dataclasses.asdict(self.core.info), "loras": self.lora_list()}

    def stats(self) -> dict:
        """The engine process's heartbeat and gauges (``launch/process.py``)."""
        s = self.core.scheduler
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting) + len(s.compiling),
            "retractions": s.total_retractions,
            "preemptions": s.policy.total_preemptions,
            "num_sessions": len(self.core.sessions.sessions),
            "memory": self.memory(),
            "disagg": self.connector_stats(),
            "cuda_graph": self.graph_stats(),
            "vision": self.vision_stats(),
            "time": time.time(),
        }
