"""A random workload against one configuration, and the checks it ends with (issue 30's fuzz).

``Workload(target, ref, rng, exact).run(steps)`` drives ``target`` (one engine, or a PD pair driven as
SGLang's router drives one) step by step with what a server sees: shared prefixes, short and long
prompts, greedy, seeded and unseeded sampling, stop strings and stop tokens, grammars, n>1, streams
cut mid-generation, aborts of queued and of prefilling requests, aborts after the end, health checks
(the request /health_generate sends), session turns with offsets, aborted and too-long turns,
sessions closed while busy, embeddings and label scores (no decode; on a PD pair, sent to one side
without a room), all in a pool small enough to retract.

The engines are strict: the books are checked after every step (rank 0's pages and slots, and the L2
tier's), a violation raises there. At random idle points and at the end every engine is audited
(``assert_idle_clean``). Where ``exact`` (fp32, unquantized) every greedy or seeded request's output
equals the reference engine's for the same prompt and parameters (a session turn: the whole
conversation as one prompt), and a cut one's is a prefix of it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field

from kvledger import ValidationError
from kvledger.common.disagg import DisaggParams
from kvledger.common.health import HEALTH_CHECK_IDS, HEALTH_CHECK_SAMPLING, health_check_disagg
from kvledger.common.pooling import PoolingParams
from kvledger.errors import NotFoundError, OverloadedError
from tests.helpers import assert_idle_clean

REGEXES = [r"[ab]{4}", r"(yes|no)", r"[0-9]{2}-[0-9]", r"x(y|z){1,3}"]
FATES = ["none"] * 14 + ["cut", "queued", "waiting", "prefill", "after_end"]
TOO_BIG = "cannot hold this request"  # the 503 of a request that cannot fit beside sessions' turns


@dataclass
class Job:
    rid: str
    prompt: list[int]  # what the engine computes: a session turn's whole conversation
    params: dict
    kind: str  # greedy | seeded | sampled | stop | stop_token | grammar | health
    fate: str = "none"
    cut_at: int = 0
    session: str | None = None
    aborted: bool = False  # we aborted it (it may still have finished first)
    result: dict | None = None
    prefill: dict | None = None  # a PD pair's prefill side's result
    answer: dict | None = None  # ... and its decode side's (the result once both are in)
    pooling: PoolingParams | None = None  # an embedding or score request (kind "embed" / "score")

    def deterministic(self, pd: bool) -> bool:
        """Its output is a function of its prompt and parameters (a PD health check's token is not:
        decode never receives the fake room's KV)."""
        return self.kind not in ("sampled", "embed", "score") and not (pd and self.kind == "health")


class Single:
    """One engine."""

    pd = False

    def __init__(self, eng):
        self.eng = eng
        self.session_eng = eng  # where sessions are opened
        self.engines = [eng]

    def submit(self, job: Job, session: dict | None = None, new: list[int] | None = None) -> None:
        self.eng.add_request(
            new if new is not None else job.prompt, job.params, rid=job.rid, session_params=session,
            pooling=job.pooling,
        )  # fmt: skip

    def abort(self, job: Job, rng) -> None:
        self.eng.abort(job.rid)

    def step(self) -> None:
        self.eng.step()

    def collect(self, job: Job) -> None:
        job.result = self.eng.result(job.rid)

    def live(self, rid: str):
        return self.eng.core.scheduler.reqs.get(rid)


class PDPair:
    """A prefill and a decode engine; each request goes to both with one bootstrap room (a health
    check with the fake one), as SGLang's router sends it. The decode side's result is the answer.
    Sessions are opened on decode; a turn's body (its input and session_params) goes to both."""

    pd = True

    def __init__(self, pre, dec, port: int):
        self.pre, self.dec, self.port = pre, dec, port
        self.session_eng = dec
        self.engines = [pre, dec]
        self.rooms = itertools.count(1)
        self.last_room = 0

    def room(self, job: Job) -> DisaggParams:
        if job.kind == "health":
            return health_check_disagg(True)
        self.last_room = next(self.rooms)
        return DisaggParams("127.0.0.1", self.port, self.last_room)

    def submit(self, job: Job, session: dict | None = None, new: list[int] | None = None) -> None:
        if job.pooling is not None:  # no decode: computed on the side it reaches, no room
            assert session is None
            self.dec.add_request(job.prompt, job.params, rid=job.rid, pooling=job.pooling)
            job.prefill = {"pooling": "not sent to prefill"}
            return
        room = self.room(job)
        body = new if new is not None else job.prompt
        self.dec.add_request(body, job.params, rid=job.rid, session_params=session, disagg=room)
        try:
            self.pre.add_request(body, job.params, rid=job.rid, session_params=session, disagg=room)
        except OverloadedError:
            self.dec.abort(job.rid)  # the router gives up on both
            job.fate, job.aborted = "refused", True
            job.prefill = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}

    def abort(self, job: Job, rng) -> None:
        """The client went away: mostly both sides hear of it, sometimes only one."""
        sides = rng.choices([(self.pre, self.dec), (self.dec,), (self.pre,)], [6, 3, 1])[0]
        for eng in sides:
            if eng.core.scheduler.reqs.get(job.rid) is not None:
                eng.abort(job.rid)

    def step(self) -> None:
        self.pre.step()
        self.dec.step()
        time.sleep(0.0005)  # the transport's threads

    def collect(self, job: Job) -> None:
        """Done when both sides have answered (prefill: its one token, or its abort)."""
        if job.prefill is None:
            job.prefill = self.pre.result(job.rid)
        if job.answer is None:
            job.answer = self.dec.result(job.rid)
        if job.prefill is not None and job.answer is not None:
            job.result = job.answer

    def live(self, rid: str):
        return self.dec.core.scheduler.reqs.get(rid) or self.pre.core.scheduler.reqs.get(rid)


@dataclass
class Conversation:
    sid: str
    tokens: list[int] = field(default_factory=list)  # what the session holds after its completed turns
    busy: str | None = None  # the rid of its running turn


class Workload:
    def __init__(self, target, ref, rng, exact: bool, tokenizer):
        self.t, self.ref, self.rng, self.exact, self.tok = target, ref, rng, exact, tokenizer
        # Embeddings and scores draw from a stream of their own (seeded from ``rng``'s state without
        # consuming it), so the rest of the workload is what it would be without them.
        self.pool_rng = random.Random(hash(rng.getstate()[1][:8]))
        self.ctx = min(e.core.limits.context_length for e in target.engines)
        self.prefixes = [self._tokens(n) for n in (8, 24, 60, 120) if n < self.ctx // 2]
        self.jobs: dict[str, Job] = {}
        self.live: dict[str, Job] = {}
        self.convs: dict[str, Conversation] = {}
        # PD: prefill's halves of turns decode refused (too long): rid -> when sent; each must end
        # soon (decode tells prefill), not after its bootstrap timeout.
        self.orphans: dict[str, float] = {}
        self.stats: Counter = Counter()
        self.ids = itertools.count()
        # Priorities (used where priority scheduling is on) come from their own generator, seeded from
        # the run's without drawing from it, so a seed's workload is the one it was before them.
        self.prio_rng = random.Random(rng.getstate()[1][0])
        # LoRA adapters every engine serves (tests/combos.py's, which leave outputs unchanged); their
        # draws too from a generator of their own.
        served = [set(e.core.loras.adapters) if e.core.loras is not None else set() for e in target.engines]
        self.adapters = sorted(set.intersection(*served))
        self.lora_rng = random.Random(rng.getstate()[1][1])

    # -- the run -------------------------------------------------------------------------------------
    def run(self, steps: int, idle_every: float = 0.01) -> Counter:
        for i in range(steps):
            self._arrivals(health=i == steps // 2)  # one health check in the middle at least
            self._pooling_arrival()
            self.t.step()
            self.stats["steps"] += 1
            self._after_step()
            if self.rng.random() < idle_every:
                self.idle_point()
        self.idle_point()
        for c in list(self.convs.values()):
            self._close(c)
        for eng in self.t.engines:
            assert eng.memory()["kv_session"] == 0
            assert_idle_clean(eng)
        self.check()
        for eng in self.t.engines:
            self.stats["retractions"] += eng.core.scheduler.total_retractions
            self.stats["preemptions"] += eng.core.scheduler.policy.total_preemptions
            self.stats["drafts_accepted"] += eng.core.scheduler.spec_totals.accepted
            window = eng.core.kv_manager.window
            if window is not None:  # a sliding-window model: pages given back out of window
                self.stats["window_released_pages"] += window.released_pages
        return self.stats

    def idle_point(self, timeout: float = 120.0) -> None:
        """Let everything running finish (no arrivals), then audit every engine."""
        deadline = time.monotonic() + timeout
        while self.live or self.orphans or not all(e.core.scheduler.idle for e in self.t.engines):
            assert time.monotonic() < deadline, f"not idle after {timeout}s: {sorted(self.live)[:5]}"
            self.t.step()
            self._after_step()
        for eng in self.t.engines:
            assert_idle_clean(eng)
            if self.rng.random() < 0.3:  # the prefix cache (and its host tier) dropped: nothing else
                assert eng.flush_cache()
                assert_idle_clean(eng)
                self.stats["flushes"] += 1
        self.stats["idle_audits"] += 1

    # -- arrivals ------------------------------------------------------------------------------------
    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 256) for _ in range(n)]

    def _arrivals(self, health: bool = False) -> None:
        r = self.rng.random()
        if r < 0.02 or health:
            self._submit(
                Job(f"health-{next(self.ids)}", list(HEALTH_CHECK_IDS), dict(HEALTH_CHECK_SAMPLING), "health")
            )
        elif r < 0.30:
            self._session_op()
        elif r < 0.65 and len(self.live) < 16:
            prompt = self._prompt()
            job = self._job(prompt, self.rng.randint(1, min(32, self.ctx - len(prompt))))
            if self.adapters and self.lora_rng.random() < 0.5:
                job.params["lora_path"] = self.lora_rng.choice(self.adapters)
                self.stats["lora"] += 1
            for i in range(self.rng.choice([1] * 9 + [2, 3])):  # n > 1: one prompt, its params, n times
                self._submit(Job(f"{job.rid}.{i}", job.prompt, job.params, job.kind))
                self.stats["n>1"] += i == 1

    def _prompt(self, limit: int | None = None) -> list[int]:
        limit = min(limit or self.ctx - 2, self.ctx - 2)
        n = self.rng.choice([1, 3, 9, 20, 40, limit // 2, limit - self.rng.randrange(8)])
        prompt = self._tokens(max(1, min(n, limit)))
        if self.prefixes and self.rng.random() < 0.5:
            prompt = (self.rng.choice(self.prefixes) + prompt)[:limit]
        return prompt

    def _job(self, prompt: list[int], max_new: int) -> Job:
        """A request of a random kind: greedy, sampled (seeded or not), stop string, stop token, grammar."""
        kind = self.rng.choices(
            ["greedy", "seeded", "sampled", "stop", "stop_token", "grammar"], [8, 3, 1, 2, 1, 2]
        )[0]
        p: dict = {"max_new_tokens": max_new, "temperature": 0}
        if self.rng.random() < 0.5:
            p["ignore_eos"] = True
        if kind == "seeded":
            p.update(temperature=0.8, top_p=0.95, seed=self.rng.randrange(10**6))
        elif kind == "sampled":
            p.update(temperature=1.0)
        elif kind in ("stop", "stop_token"):
            want = self.ref.output(prompt, p)  # something it will say, so the stop is met
            if len(want) < 2:
                kind = "greedy"
            elif kind == "stop_token":
                p["stop_token_ids"] = [self.rng.choice(want[1:])]
            else:
                text = self.tok.decode(want[1:], skip_special_tokens=True)
                i = self.rng.randrange(max(len(text) - 1, 1))
                p["stop"] = [text[i : i + self.rng.randint(1, 3)] or "a"]
        elif kind == "grammar":
            p["regex"] = self.rng.choice(REGEXES)
        if self.prio_rng.random() < 0.8:
            p["priority"] = self.prio_rng.randrange(4)
        return Job(f"r{next(self.ids)}", prompt, p, kind)

    def _pooling_arrival(self) -> None:
        """Now and then an embedding (last or mean pooling) or label-token logprobs (/v1/score): no
        token drawn; a short or long prompt, often after a shared prefix."""
        g = self.pool_rng
        if g.random() >= 0.06 or len(self.live) >= 16:
            return
        limit = self.ctx - 2
        prompt = [g.randrange(3, 256) for _ in range(g.choice([1, 3, 20, 40, limit // 2, limit - g.randrange(8)]))]
        if self.prefixes and g.random() < 0.5:
            prompt = (g.choice(self.prefixes) + prompt)[:limit]
        if g.random() < 0.7:
            pooling = PoolingParams(embed=g.choice(["last", "mean"]))
        else:
            pooling = PoolingParams(label_token_ids=[g.randrange(3, 256) for _ in range(3)])
        kind = "embed" if pooling.embed else "score"
        self._submit(Job(f"p{next(self.ids)}", prompt, {"max_new_tokens": 0}, kind, pooling=pooling))

    def _submit(self, job: Job, session: dict | None = None, new: list[int] | None = None) -> bool:
        rng = self.pool_rng if job.pooling is not None else self.rng
        job.fate = rng.choice(FATES) if job.kind != "health" else rng.choice(["none"] * 5 + ["cut"])
        job.cut_at = rng.randint(1, max(1, job.params["max_new_tokens"] - 1))
        try:
            self.t.submit(job, session, new)
        except OverloadedError:
            self.stats["refused_overloaded"] += 1  # the bounded queue is full: a clear 429
            return False
        self.jobs[job.rid] = job
        self.live[job.rid] = job
        self.stats[f"kind_{job.kind}"] += 1
        if job.fate == "queued":  # before the loop ever sees it
            self._abort(job)
        return True

    # -- sessions ------------------------------------------------------------------------------------
    def _session_op(self) -> None:
        idle = [c for c in self.convs.values() if c.busy is None]
        r = self.rng.random()
        if r < 0.2 and len(self.convs) < 3:
            try:
                sid = self.t.session_eng.open_session()
            except OverloadedError:  # closing sessions still count until their turn ends
                return
            self.convs[sid] = Conversation(sid)
        elif r < 0.93:
            if idle:
                self._turn(self.rng.choice(idle))
        elif self.convs:
            self._close(self.rng.choice(list(self.convs.values())))

    def _turn(self, c: Conversation) -> None:
        offset = None
        if c.tokens and self.rng.random() < 0.2:
            offset = self.rng.randint(0, len(c.tokens))
            self.stats["turn_offsets"] += 1
        base = c.tokens[:offset] if offset is not None else c.tokens
        session = {"id": c.sid} if offset is None else {"id": c.sid, "offset": offset}
        if self.rng.random() < 0.08:  # a turn that makes the conversation longer than the context
            new = self._tokens(max(1, self.ctx - len(base) + self.rng.randrange(3)))
            eng = self.t.session_eng
            before = eng.sessions()
            job = Job(f"long{next(self.ids)}", base + new, {"max_new_tokens": 1}, "greedy")
            try:
                self.t.submit(job, session, new)
            except ValidationError as e:
                assert e.code == "context_length_exceeded", e
            else:
                raise AssertionError("a turn longer than the context was accepted")
            assert eng.sessions() == before, "a refused turn changed its session"
            self.stats["turns_too_long"] += 1
            if self.t.pd:  # the router sent prefill the same body: decode's refusal must end it
                room = DisaggParams("127.0.0.1", self.t.port, self.t.last_room)
                # (an input over the context on its own is refused by prefill too: nothing to end)
                with contextlib.suppress(OverloadedError, ValidationError):
                    self.t.pre.add_request(new, job.params, rid=job.rid, session_params=session, disagg=room)
                    self.orphans[job.rid] = time.monotonic()
            return
        if len(base) >= self.ctx - 2:
            self._close(c)
            return
        new = self._prompt(self.ctx - 1 - len(base))[: self.ctx - 1 - len(base)]
        prompt = base + new
        job = self._job(prompt, self.rng.randint(1, 24))
        job.params["max_new_tokens"] = min(job.params["max_new_tokens"], self.ctx - len(prompt))
        job.session = c.sid
        if self._submit(job, session, new):
            c.busy = job.rid
            self.stats["turns"] += 1

    def _close(self, c: Conversation) -> None:
        self.t.session_eng.close_session(c.sid)  # while busy: released when its turn ends
        self.stats["closed_busy"] += c.busy is not None
        del self.convs[c.sid]

    # -- during the run ------------------------------------------------------------------------------
    def _abort(self, job: Job) -> None:
        job.aborted = True
        with contextlib.suppress(NotFoundError):  # finished meanwhile
            self.t.abort(job, self.pool_rng if job.pooling is not None else self.rng)

    @staticmethod
    def _abort_due(job: Job, req) -> bool:
        """Its moment to be aborted has come: the stream's reader went away after ``cut_at`` tokens,
        it waits in the queue, or it is between prefill chunks."""
        if job.fate == "cut":
            return len(req.output_ids) >= job.cut_at
        if job.fate == "waiting":
            return req.state.value == "waiting"
        if job.fate == "prefill":
            return 0 < req.kv_len < req.seq_len - 1 and not req.output_ids
        return False

    def _after_step(self) -> None:
        for rid, at in list(self.orphans.items()):
            res = self.t.pre.result(rid)
            if res is None:
                assert time.monotonic() - at < 30, f"prefill's half of refused turn {rid} still waits"
                continue
            del self.orphans[rid]
            assert res["meta_info"]["finish_reason"]["type"] == "abort", res
            self.stats["prefill_halves_released"] += 1
        for rid, job in list(self.live.items()):
            req = self.t.live(rid)
            if req is not None and not job.aborted and self._abort_due(job, req):
                self._abort(job)
            self.t.collect(job)
            if job.result is None:
                continue
            del self.live[rid]
            if job.fate == "after_end":
                try:
                    self.t.eng.abort(rid) if not self.t.pd else self.t.dec.abort(rid)
                except NotFoundError:
                    self.stats["aborts_after_end"] += 1
                else:
                    raise AssertionError(f"abort of finished {rid} was accepted")
            if job.session is not None:
                self._turn_ended(job)

    def _turn_ended(self, job: Job) -> None:
        c = self.convs.get(job.session)
        if c is None:
            return  # closed while busy: released with the turn
        c.busy = None
        if job.result["meta_info"]["finish_reason"]["type"] != "abort":
            c.tokens = job.prompt + job.result["output_ids"]
        else:
            self.stats["turns_aborted"] += 1

    # -- the end -------------------------------------------------------------------------------------
    def check(self) -> None:
        """Every request's ending and, where ``exact``, its output against the reference."""
        wrong: list[str] = []
        ref = self.ref.outputs(
            [(j.prompt, j.params) for j in self.jobs.values() if self.exact and j.deterministic(self.t.pd)]
        )
        for job in self.jobs.values():
            res = job.result
            assert res is not None, job.rid
            fr = res["meta_info"]["finish_reason"]
            if job.pooling is not None:
                self._check_pooled(job, res, wrong)
                continue
            out = res["output_ids"]
            self.stats[f"finish_{fr['type']}"] += 1
            if fr["type"] == "abort" and not job.aborted:
                # Only a request that cannot fit beside running session turns may end unasked.
                if TOO_BIG not in (fr.get("message") or ""):
                    wrong.append(f"{job.rid} aborted unasked: {fr}")
                self.stats["too_big"] += 1
            assert len(out) <= job.params["max_new_tokens"], (job.rid, len(out), job.params)
            if job.kind == "health" and fr["type"] != "abort":
                assert len(out) == 1 and fr["type"] in ("length", "stop"), res
            if job.kind == "grammar" and fr["type"] == "stop":
                assert re.fullmatch(job.params["regex"], res["text"]), (job.params, res["text"])
            if not (self.exact and job.deterministic(self.t.pd)):
                continue
            want = ref[_key(job.prompt, job.params)]
            if fr["type"] == "abort":
                ok = out == want[: len(out)]
            else:
                ok = out == want
            if not ok:
                wrong.append(
                    f"{job.rid} ({job.kind}, {fr['type']}, {len(job.prompt)} prompt tokens): {out} != {want}"
                )
            pre = job.prefill
            if (
                pre is not None
                and pre["meta_info"]["finish_reason"]["type"] != "abort"
                and pre["output_ids"] != want[:1]
            ):
                wrong.append(f"{job.rid}: prefill's first token {pre['output_ids']} != {want[:1]}")
        assert not wrong, f"{len(wrong)} of {len(self.jobs)} wrong:\n" + "\n".join(wrong[:10])


    def _check_pooled(self, job: Job, res: dict, wrong: list[str]) -> None:
        """An embedding or score: there unless aborted; in fp32 equal to the reference engine's."""
        fr = res["meta_info"]["finish_reason"]
        self.stats[f"finish_{fr['type']}"] += 1
        got = res.get("embedding") if job.kind == "embed" else res.get("label_logprobs")
        if fr["type"] == "abort":
            # As for generation: only one that cannot fit beside running session turns (which PD
            # rows have too, since session turns go through PD) may end unasked.
            if not job.aborted and TOO_BIG not in (fr.get("message") or ""):
                wrong.append(f"{job.rid} aborted unasked: {fr}")
            assert got is None, job.rid
            return
        assert got is not None and res["meta_info"]["completion_tokens"] == 0, (job.rid, res)
        if job.kind == "embed":
            assert abs(sum(x * x for x in got) - 1) < 1e-3, job.rid  # L2-normalised
        if not self.exact:
            return
        want = self.ref.pooled(job.prompt, job.pooling)
        if len(got) != len(want) or any(abs(a - b) > 1e-4 for a, b in zip(got, want)):
            wrong.append(f"{job.rid} ({job.kind} {job.pooling}, {len(job.prompt)} tokens) differs")


def _key(prompt: list[int], params: dict) -> tuple:
    # A priority changes when a request runs, never what it generates: one reference output for all;
    # so does the fuzz's LoRA adapters (B = 0), whose rows must answer what the base model answers.
    same = ("priority", "lora_path")
    return tuple(prompt), json.dumps({k: v for k, v in params.items() if k not in same}, sort_keys=True)


class Reference:
    """The plain engine's outputs (fp32, no prefix cache, a pool that never retracts), memoised."""

    def __init__(self, eng):
        self.eng = eng
        self.memo: dict[tuple, list[int]] = {}

    def pooled(self, prompt: list[int], pooling: PoolingParams) -> list[float]:
        """The plain engine's embedding, or its label-token logprobs, for ``prompt``."""
        key = (tuple(prompt), pooling.embed, tuple(pooling.label_token_ids or ()))
        if key not in self.memo:
            rid = self.eng.add_request(prompt, None, pooling=pooling)
            self.eng.run_until_idle()
            res = self.eng.result(rid)
            self.memo[key] = res["embedding"] if pooling.embed else res["label_logprobs"]
        return self.memo[key]

    def output(self, prompt: list[int], params: dict) -> list[int]:
        return self.outputs([(prompt, params)])[_key(prompt, params)]

    def outputs(self, jobs: list[tuple[list[int], dict]]) -> dict[tuple, list[int]]:
        todo = {_key(p, sp): (p, sp) for p, sp in jobs if _key(p, sp) not in self.memo}
        items = list(todo.items())
        for i in range(0, len(items), 32):
            batch = items[i : i + 32]
            outs = self.eng.generate(  # (the plain engine serves no adapter: ``_key``)
                input_ids=[p for _, (p, _) in batch],
                sampling_params=[{k: v for k, v in sp.items() if k != "lora_path"} for _, (_, sp) in batch],
            )
            for (k, _), o in zip(batch, outs):
                self.memo[k] = o["output_ids"]
        return {_key(p, sp): self.memo[_key(p, sp)] for p, sp in jobs}
