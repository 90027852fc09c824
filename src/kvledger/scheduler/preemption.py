"""Preemption by priority (``--enable-priority-scheduling``): a waiting request that does not fit (no
slot, or not enough pages for its next chunk) retracts running requests whose priority is lower by more
than the threshold (``queue_order.may_preempt``), least important then newest first, when together
they would make the room (SGLang's rule); retraction keeps their output, so each ends as it would have.
"""

from __future__ import annotations

import logging

from .queue_order import may_preempt
from .request import Req

log = logging.getLogger(__name__)


def preempt_for(policy, req: Req, budget: int, reserve_pages: int, slot: bool = False) -> bool:
    """Make room for waiting ``req`` (a slot, or the pages of its next chunk) by retracting running
    requests it may preempt, least important then newest first; only when together they would
    make that room (else none is touched). True: something was retracted (admission is retried).
    ``policy``: the BatchPolicy, which retracts and counts."""
    if not policy.priorities:
        return False
    s = policy.s
    threshold = s.cfg.scheduler.priority_scheduling_preemption_threshold
    victims = sorted(
        (r for r in s.running if r.to_finish is None and may_preempt(req, r, threshold)),
        key=policy.seniority,
        reverse=True,
    )
    if not victims or not s.connector.may_admit(req):
        return False  # (a request its connector holds back would only take the room and wait)
    if slot:
        chosen = victims[:1]  # one slot is all a request needs
    else:
        # The pages its first chunk needs past what is cached, and what the victims' own pages
        # give back (their borrowed prefix may stay locked by others: not counted).
        kvm, ps = s.kv_manager, s.kv_manager.page_size
        matched = policy.order.tree.peek(kvm.cache_key(req)[: req.reuse_limit])[0] if req.session is None else 0
        need = -(-(matched + min(budget, req.seq_len - matched)) // ps) - matched // ps
        short = need + reserve_pages - kvm.available_pages()
        chosen = []
        for v in victims:
            if short <= 0:
                break
            chosen.append(v)
            short -= len(v.pages) - v.num_tree_pages - v.num_out_pages
        if short > 0:
            return False  # SGLang's rule too: preempt only when it makes the room
    for v in chosen:
        log.info(
            "request %s (priority %s) preempts %s (priority %s)", req.rid, req.params.priority, v.rid,
            v.params.priority,
        )
        policy.retract(v)
        policy.total_preemptions += 1
    return True
