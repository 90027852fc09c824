"""Sampling on the logits' device: the host sampler's math (``sampler.py``) in batched torch ops,
with one device-to-host copy per step (the sampled ids and the logprobs asked for).

Per-row parameters, penalty histories and grammar bitmasks go up as tensors; nothing in here reads a
device value back before that one copy, so on a GPU the step does not wait on it midway. On CPU
tensors it draws exactly the host sampler's tokens for greedy and seeded rows (tests/unit/
test_sampler_device.py); on a GPU the same ops round their floats as the GPU does."""

from __future__ import annotations

import numpy as np
import torch

from ..common.sampling import SamplingRow
from ..constrained.bitmask import apply_token_bitmask
from .sampler import GREEDY_EPS, SampleResult
from .seeded import inverse_cdf, seeded_uniform


class DeviceSampler:
    def __init__(self, seed: int = 0, deterministic: bool = False):
        """``deterministic``: unseeded sampled rows draw as seeded ones with ``seed`` (``Sampler``)."""
        self.seed, self.deterministic = seed, deterministic
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator | None:
        """The unseeded rows' generator on ``device`` (one per device, seeded by the engine's seed)."""
        if device.type == "meta":
            return None  # shapes only (the CPU-only check that nothing here is a host tensor)
        g = self._generators.get(device)
        if g is None:
            g = self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return g

    @staticmethod
    def _penalize(logits: torch.Tensor, rows: list[SamplingRow], pen: torch.Tensor) -> torch.Tensor:
        """Repetition (prompt and output), then frequency and presence (output) penalties, batched:
        the histories go up as one index tensor per kind; rows without a penalty are untouched."""
        B, V = logits.shape
        dev = logits.device
        rep_r: list[int] = []
        rep_c: list[int] = []
        out_r: list[int] = []
        out_c: list[int] = []
        for i, r in enumerate(rows):
            p = r.params
            if not p.has_penalties:
                continue
            prompt, output = r.prompt_ids or [], r.output_ids or []
            if p.repetition_penalty != 1.0:
                seen = set(prompt) | set(output)
                rep_r.extend([i] * len(seen))
                rep_c.extend(seen)
            if (p.frequency_penalty or p.presence_penalty) and output:
                out_r.extend([i] * len(output))
                out_c.extend(output)
        if rep_r:
            idx = torch.tensor([rep_r, rep_c], dtype=torch.long).to(dev, non_blocking=True)
            seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
            seen[idx[0], idx[1]] = True
            rp = pen[:, 0:1]
            logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
        if out_r:
            idx = torch.tensor([out_r, out_c], dtype=torch.long).to(dev, non_blocking=True)
            counts = torch.zeros(B, V, dtype=torch.float32, device=dev)
            counts.index_put_((idx[0], idx[1]), torch.ones(len(out_r), device=dev), accumulate=True)
            delta = counts * pen[:, 1:2] + (counts > 0).float() * pen[:, 2:3]
            active = torch.zeros(B, 1, dtype=torch.bool)
            active[sorted(set(out_r))] = True
            logits = torch.where(active.to(dev, non_blocking=True), logits - delta, logits)
        return logits

    def sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], mask: tuple[np.ndarray, list[int]] | None = None
    ) -> SampleResult:
        """As ``Sampler.sample``, with ``logits`` (float32 ``[B, V]``) on any device."""
        packed, K = self.draw(logits, rows, mask)
        host = packed.cpu().tolist()  # the step's one copy back
        tok_list = [int(h[0]) for h in host]
        lps: list[float | None] = [None] * len(rows)
        tops: list[list[tuple[int, float]] | None] = [None] * len(rows)
        for i, r in enumerate(rows):
            p = r.params
            if p.wants_logprobs:
                lps[i] = host[i][1]
            if p.top_logprobs > 0:
                h = host[i]
                tops[i] = [(int(h[2 + K + j]), h[2 + j]) for j in range(p.top_logprobs)]
        return SampleResult(tok_list, lps, tops)

    def draw(
        self, logits: torch.Tensor, rows: list[SamplingRow], mask: tuple[np.ndarray, list[int]] | None = None
    ) -> tuple[torch.Tensor, int]:
        """Everything before the copy, on the logits' device: float64 ``[B, 1 (+ 1 + 2K)]``, per row
        the token, then (when any row wants logprobs) its logprob, the top ``K`` logprobs and their
        ids (``K``: the most any row asked for)."""
        V = logits.shape[1]
        dev = logits.device
        ps = [r.params for r in rows]
        want_lp = any(p.wants_logprobs for p in ps)
        raw = logits
        # One upload of the rows' float parameters: temperature, top_p, min_p, the three penalties.
        f = torch.tensor(
            [
                [p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                for p in ps
            ],
            dtype=torch.float32,
        ).to(dev, non_blocking=True)
        if any(p.has_penalties for p in ps) or mask is not None:
            logits = self._penalize(logits.clone(), rows, f[:, 3:6])
            if mask is not None:
                apply_token_bitmask(logits, *mask)
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(ps) if p.temperature >= GREEDY_EPS]
        if sampled:
            srows = [ps[i] for i in sampled]
            sidx = torch.tensor(sampled, dtype=torch.long).to(dev, non_blocking=True)
            lg = logits[sidx] / f[sidx, 0:1]
            ks_list = [p.top_k if 0 < p.top_k < V else V for p in srows]
            if min(ks_list) < V:
                ks = torch.tensor(ks_list, dtype=torch.long).to(dev, non_blocking=True)
                kth = lg.topk(max(ks_list), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
                lg = lg.masked_fill(lg < kth, float("-inf"))
            probs = torch.softmax(lg, dim=-1)
            filt = [p.top_p < 1.0 or p.min_p > 0 for p in srows]
            if any(filt):
                top_p, min_p = f[sidx, 1:2], f[sidx, 2:3]
                sp, si = probs.sort(dim=-1, descending=True)
                drop = (sp.cumsum(-1) - sp) > top_p
                drop |= sp < min_p * sp[:, :1]
                drop &= torch.tensor(filt).to(dev, non_blocking=True).unsqueeze(1)
                probs = torch.zeros_like(probs).scatter_(1, si, sp.masked_fill(drop, 0.0))
            chosen = torch.empty(len(sampled), dtype=torch.long, device=dev)
            unseeded = [j for j, p in enumerate(srows) if p.seed is None and not self.deterministic]
            seeded = [j for j, p in enumerate(srows) if p.seed is not None or self.deterministic]
            if unseeded:
                uj = torch.tensor(unseeded, dtype=torch.long).to(dev, non_blocking=True)
                noise = torch.empty(len(unseeded), V, device=dev).exponential_(generator=self._generator(dev))
                chosen[uj] = (probs[uj] / noise.clamp_min_(1e-20)).argmax(dim=-1)
            if seeded:
                sj = torch.tensor(seeded, dtype=torch.long).to(dev, non_blocking=True)
                seeds = [self.seed if srows[j].seed is None else srows[j].seed for j in seeded]
                ids = torch.tensor(
                    [[s, rows[sampled[j]].position] for s, j in zip(seeds, seeded)], dtype=torch.long
                ).to(dev, non_blocking=True)
                chosen[sj] = inverse_cdf(probs[sj], seeded_uniform(ids[:, 0], ids[:, 1]))
            tokens = tokens.index_copy(0, sidx, chosen)
        # Packed for one copy back: ids, each row's logprob and top logprobs (float64 holds them exactly).
        parts = [tokens.double().unsqueeze(1)]
        K = max((p.top_logprobs for p in ps), default=0)
        if want_lp:
            # Reported from the model's raw distribution, as the host sampler does.
            raw_lp = torch.log_softmax(raw, dim=-1)
            parts.append(raw_lp.gather(1, tokens.unsqueeze(1)).double())
            if K:
                tv, ti = raw_lp.topk(K, dim=-1)
                parts += [tv.double(), ti.double()]
        return torch.cat(parts, dim=1), K
