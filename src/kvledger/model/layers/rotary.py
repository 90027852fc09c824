"""Rotary position embeddings (GPT-NeoX's rotate-half form), with the scaling types checkpoints use
(default, linear, llama3, YaRN) and partial rotation (the first ``rot_dim`` dimensions of each head)."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ...errors import ModelLoadError


def rope_inv_freq(
    dim: int, theta: float, scaling: dict | None, max_positions: int | None = None
) -> torch.Tensor:
    """Inverse frequencies over ``dim`` rotated dimensions; scaling: default, linear, llama3, yarn
    (``max_positions``: the model's context, YaRN's factor where its config names none)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = scaling
    kind = (sc or {}).get("rope_type", (sc or {}).get("type", "default"))
    if kind in ("default", None):
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(is_mid, mid, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(dim, theta, sc, _yarn_factor(sc, max_positions))
    raise ModelLoadError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, yarn")


def _yarn_factor(sc: dict, max_positions: int | None) -> float:
    """YaRN's context factor: the config's, else the context over the pretraining one."""
    if sc.get("factor"):
        return float(sc["factor"])
    if not max_positions or not sc.get("original_max_position_embeddings"):
        raise ModelLoadError("yarn rope scaling needs factor or original_max_position_embeddings")
    return max_positions / float(sc["original_max_position_embeddings"])


def _yarn_inv_freq(dim: int, theta: float, sc: dict, factor: float) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dimensions that turn many times over the pretraining context keep
    their frequency, those that turn less than once are divided by ``factor``, and a linear ramp
    between the two correction dimensions (``beta_fast`` and ``beta_slow`` turns) blends them."""
    orig = float(sc["original_max_position_embeddings"])

    def dim_of(turns: float) -> float:  # the dimension that turns ``turns`` times over ``orig`` positions
        return dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(float(sc.get("beta_fast") or 32)), dim_of(float(sc.get("beta_slow") or 1))
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    keep = 1 - ramp  # the share of each dimension's original frequency
    return (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep


def rope_attention_factor(scaling: dict | None, max_positions: int | None = None) -> float:
    """What the cos/sin tables are multiplied by: YaRN's attention temperature (its config's
    ``attention_factor``, else ``0.1 ln(factor) + 1``, or the ratio of two such for ``mscale`` /
    ``mscale_all_dim``); 1 for every other scaling."""
    sc = scaling or {}
    if sc.get("rope_type", sc.get("type")) != "yarn":
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    factor = _yarn_factor(sc, max_positions)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
    return float(mscale(m) / mscale(m_all)) if m and m_all else mscale()


_mrope = threading.local()


@contextmanager
def mrope_positions(positions: torch.Tensor | None) -> Iterator[None]:
    """Inside this block a family with M-RoPE sections (``Rotary.lookup_sections``) reads each
    token's (temporal, height, width) positions ``[3, T]`` from here (a forward where a row meets an
    image, ``multimodal/mrope.py``); per thread, as the forward runs on one. None: ``positions``."""
    prev = getattr(_mrope, "value", None)
    _mrope.value = positions
    try:
        yield
    finally:
        _mrope.value = prev


def current_mrope() -> torch.Tensor | None:
    return getattr(_mrope, "value", None)


class Rotary(nn.Module):
    """cos/sin tables ``[max_positions, rot_dim / 2]`` in the model dtype (YaRN's attention factor
    folded in: it scales q and k alike, so each score by its square, as transformers does)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None = None,
        partial: float = 1.0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rot_dim = int(head_dim * partial)
        inv = rope_inv_freq(self.rot_dim, theta, scaling, max_positions)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        mult = rope_attention_factor(scaling, max_positions)
        if mult != 1.0:  # YaRN: in float32, before the tables take the model dtype (transformers' order)
            cos, sin = cos * mult, sin * mult
        self.register_buffer("cos", cos.to(device, dtype), persistent=False)
        self.register_buffer("sin", sin.to(device, dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``positions``, shaped to broadcast over heads: once per forward, all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def lookup_sections(self, positions: torch.Tensor, sections: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE's rows (Qwen2-VL): frequency section ``i`` of ``sections`` (over the ``rot_dim / 2``
        frequencies) turns at position row ``i % 3`` of ``positions`` ``[3, T]`` (temporal, height,
        width), as transformers' ``recomposition_frequencies`` does."""
        cos, sin = self.cos[positions], self.sin[positions]  # [3, T, rot_dim / 2]
        cut = [0]
        for n in sections:
            cut.append(cut[-1] + n)
        pick = [slice(cut[i], cut[i + 1]) for i in range(len(sections))]
        cos = torch.cat([cos[i % 3, :, sl] for i, sl in enumerate(pick)], dim=-1)
        sin = torch.cat([sin[i % 3, :, sl] for i, sl in enumerate(pick)], dim=-1)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def apply(self, x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x`` ``[T, heads, head_dim]`` rotated at the positions of ``cs`` (``lookup``)."""
        cos, sin = cs
        if self.rot_dim != self.head_dim:
            rot, rest = x[..., : self.rot_dim], x[..., self.rot_dim :]
            return torch.cat((_rotate(rot, cos, sin), rest), dim=-1)
        return _rotate(x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
