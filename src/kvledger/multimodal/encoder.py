"""The vision side of a vision-language checkpoint, run in the engine process: its vision tower and
projector turn an image's pixel values into one embedding per placeholder token, in the language
model's hidden size and dtype.

The towers are transformers' own modules (CLIP, SigLIP: ``AutoModel.from_config`` on the
checkpoint's ``vision_config``) with the checkpoint's weights, so their arithmetic is the reference's;
what a family adds around them (LLaVA: the feature layer, the CLS token dropped, the projector) is
its ``VisionFamily`` here. A checkpoint is split at load (``split_checkpoint``): the language model's
tensors under the names the text families take, the vision side's kept for this module."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .inputs import ImageItem


@dataclass
class VisionCheckpoint:
    """A vision-language checkpoint's vision side as read: its config.json and its tensors (names
    without the family's prefix), and the placeholder token's id."""

    raw: dict
    weights: dict[str, torch.Tensor]
    image_token_id: int


class VisionFamily(nn.Module):
    """One family's encoder: ``encode(item)`` -> ``[item.length, hidden]``."""

    model_types: ClassVar[tuple[str, ...]] = ()
    # checkpoint prefix -> this module's attribute, for the vision side's tensors
    prefixes: ClassVar[dict[str, str]] = {}

    def encode(self, item: ImageItem) -> torch.Tensor:
        raise NotImplementedError

    def batch_key(self, item: ImageItem):
        """Images with the same (hashable) key are encoded in one call (``encode_batch``); None:
        this image alone (the default, for a family that does not batch)."""
        return None

    def encode_batch(self, items: list[ImageItem]) -> list[torch.Tensor]:
        return [self.encode(it) for it in items]


class LlavaVision(VisionFamily):
    """LLaVA 1.5's: the tower's hidden states of ``vision_feature_layer`` (the CLS token dropped
    under the ``default`` strategy), then the two-layer projector."""

    model_types = ("llava",)
    prefixes: ClassVar[dict[str, str]] = {
        "model.vision_tower.": "tower.",
        "vision_tower.": "tower.",  # transformers 4's names
        "model.multi_modal_projector.": "projector.",
        "multi_modal_projector.": "projector.",
    }

    def __init__(self, raw: dict):
        super().__init__()
        from transformers import AutoModel, LlavaConfig
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        cfg = LlavaConfig.from_dict(raw)
        self.layer = cfg.vision_feature_layer
        self.strategy = cfg.vision_feature_select_strategy
        if not isinstance(self.layer, int) or self.strategy not in ("default", "full"):
            raise ValueError(f"LLaVA feature layer {self.layer!r} / strategy {self.strategy!r} not served")
        self.tower = AutoModel.from_config(cfg.vision_config)
        self.projector = LlavaMultiModalProjector(cfg)

    def encode(self, item: ImageItem) -> torch.Tensor:
        return self.encode_batch([item])[0]

    def batch_key(self, item: ImageItem):
        return item.pixel_values.shape[1:]  # same-size pixel tensors stack

    def encode_batch(self, items: list[ImageItem]) -> list[torch.Tensor]:
        """Same-size images through the tower and projector in one call, each its rows back."""
        p = self.projector.linear_1.weight
        with warnings.catch_warnings():  # the message's bytes are read-only; the tower only reads them
            warnings.simplefilter("ignore", UserWarning)
            pixels = torch.cat([torch.from_numpy(it.pixel_values) for it in items]).to(p.device, p.dtype)
        states = self.tower(pixels, output_hidden_states=True, return_dict=True).hidden_states[self.layer]
        if self.strategy == "default":
            states = states[:, 1:]
        out = self.projector(states)
        sizes = [it.pixel_values.shape[0] for it in items]  # crops per image (1 for LLaVA 1.5)
        return [e.reshape(-1, out.shape[-1]) for e in out.split(sizes)]


FAMILIES: dict[str, type[VisionFamily]] = {t: cls for cls in (LlavaVision,) for t in cls.model_types}


def is_vision_config(raw: dict) -> bool:
    return raw.get("model_type") in FAMILIES


def split_checkpoint(raw: dict, weights: dict[str, torch.Tensor]) -> tuple[dict, dict, VisionCheckpoint]:
    """A vision-language checkpoint as (the language model's config dict, its tensors under the
    text families' names, the vision side). Raises ``ValueError`` for one this module does not serve."""
    family = FAMILIES[raw["model_type"]]
    text = dict(raw.get("text_config") or {})
    if "model_type" not in text:
        raise ValueError("text_config without a model_type")
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    token = raw.get("image_token_id", raw.get("image_token_index"))
    if token is None:
        raise ValueError("no image_token_id in config.json")
    lm: dict[str, torch.Tensor] = {}
    vision: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        for pre, to in family.prefixes.items():
            if name.startswith(pre):
                vision[to + name[len(pre):]] = t
                break
        else:
            for pre, to in (("model.language_model.", "model."), ("language_model.model.", "model."),
                            ("language_model.lm_head.", "lm_head.")):  # fmt: skip
                if name.startswith(pre):
                    name = to + name[len(pre):]
                    break
            lm[name] = t
    return text, lm, VisionCheckpoint(raw, vision, int(token))


class VisionEncoder:
    """The engine's encoder: the family's module with the checkpoint's weights, in the model's dtype
    and device; ``encode`` gives an image's embeddings ``[length, hidden]``."""

    def __init__(self, ckpt: VisionCheckpoint, dtype: torch.dtype, device: torch.device, hidden_size: int):
        self.net = FAMILIES[ckpt.raw["model_type"]](ckpt.raw)
        missing, unexpected = self.net.load_state_dict(ckpt.weights, strict=False)
        missing = [m for m in missing if not m.endswith("position_ids")]
        if missing or unexpected:
            raise ValueError(f"vision weights do not match: missing {missing[:4]}, unexpected {unexpected[:4]}")
        self.net = self.net.to(device=device, dtype=dtype).eval()
        self.hidden_size = hidden_size
        self.image_token_id = ckpt.image_token_id
        self.calls = 0  # vision-tower calls (a batch is one)

    @torch.inference_mode()
    def encode(self, item: ImageItem) -> torch.Tensor:
        return self.encode_many([item])[0]

    @torch.inference_mode()
    def encode_many(self, items: list[ImageItem]) -> list[torch.Tensor]:
        """Several images' embeddings, those the family batches together (``batch_key``) in one
        vision-tower call each (``calls`` counts them)."""
        groups: dict = {}
        for i, it in enumerate(items):
            k = self.net.batch_key(it)
            groups.setdefault(("alone", i) if k is None else ("batch", k), []).append(i)
        out: list = [None] * len(items)
        for idx in groups.values():
            self.calls += 1
            for i, emb in zip(idx, self.net.encode_batch([items[i] for i in idx])):
                if emb.shape != (items[i].length, self.hidden_size):
                    raise ValueError(f"image encoded to {tuple(emb.shape)}, its prompt run has {items[i].length} tokens")
                out[i] = emb
        return out
