"""The vision side of a vision-language checkpoint, run in the engine process: its vision tower and
projector turn an image's pixel values into one embedding per placeholder token, in the language
model's hidden size and dtype.

The towers are transformers' own modules (CLIP, SigLIP: ``AutoModel.from_config`` on the
checkpoint's ``vision_config``) with the checkpoint's weights, so their arithmetic is the reference's;
what a family adds around them (LLaVA: the feature layer, the CLS token dropped, the projector) is
its ``VisionFamily`` here. A checkpoint is split at load (``split_checkpoint``): the language model's
tensors under the names the text families take, the vision side's kept for this module."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from .inputs import ImageItem, MultiModalInputs
from .mrope import MRope


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
    # The spatial merge of a family whose decoder takes M-RoPE positions (``mrope.py``); 0: none.
    mrope_merge: int = 0

    def encode(self, item: ImageItem) -> torch.Tensor:
        raise NotImplementedError

    def batch_key(self, item: ImageItem):
        """Images with the same (hashable) key are encoded in one call (``encode_batch``); None:
        this image alone (the default, for a family that does not batch)."""
        return None

    def encode_batch(self, items: list[ImageItem]) -> list[torch.Tensor]:
        return [self.encode(it) for it in items]

    @staticmethod
    def text_config(raw: dict) -> dict:
        """The language model's config.json dict."""
        return dict(raw.get("text_config") or {})


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


class Qwen2VLVision(VisionFamily):
    """Qwen2-VL's and Qwen2.5-VL's: transformers' vision transformer (patch embedding, the 2D
    rotary blocks, Qwen2.5's windowed attention, the 2x2 patch merger into the decoder's hidden size)
    over the image's patches and grid, one image at a time. The decoder takes M-RoPE positions."""

    model_types = ("qwen2_vl", "qwen2_5_vl")
    prefixes: ClassVar[dict[str, str]] = {"model.visual.": "tower.", "visual.": "tower."}

    def __init__(self, raw: dict):
        super().__init__()
        cfg = self._config(raw)
        if raw["model_type"] == "qwen2_vl":
            from transformers.models.qwen2_vl.modeling_qwen2_vl import (
                Qwen2VisionTransformerPretrainedModel as Tower,
            )
        else:
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
                Qwen2_5_VisionTransformerPretrainedModel as Tower,
            )
        self.tower = Tower._from_config(cfg.vision_config)
        self.mrope_merge = int(cfg.vision_config.spatial_merge_size)

    @staticmethod
    def _config(raw: dict):
        # (the modules by path: the engine reads the model while its tokenizer loads on another
        # thread, and transformers' lazy top-level names are not safe to resolve from two at once)
        if raw["model_type"] == "qwen2_vl":
            from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLConfig as Config
        else:
            from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig as Config
        return Config.from_dict(raw)

    @staticmethod
    def text_config(raw: dict) -> dict:
        """transformers' reading of it: a nested ``text_config`` (transformers 5) or the flat
        config.json of the published checkpoints, ``rope_scaling`` ``{"type": "mrope"}`` included."""
        cfg = Qwen2VLVision._config(raw).text_config.to_dict()
        cfg.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        return cfg

    def encode(self, item: ImageItem) -> torch.Tensor:
        p = next(self.tower.parameters())
        with warnings.catch_warnings():  # the message's bytes are read-only; the tower only reads them
            warnings.simplefilter("ignore", UserWarning)
            pixels = torch.from_numpy(item.pixel_values).to(p.device, p.dtype)
        grid = torch.from_numpy(np.asarray(item.extra["image_grid_thw"], dtype=np.int64).reshape(1, 3)).to(p.device)
        return self.tower(pixels, grid_thw=grid).pooler_output


FAMILIES: dict[str, type[VisionFamily]] = {
    t: cls for cls in (LlavaVision, Qwen2VLVision) for t in cls.model_types
}


def is_vision_config(raw: dict) -> bool:
    return raw.get("model_type") in FAMILIES


def split_checkpoint(raw: dict, weights: dict[str, torch.Tensor]) -> tuple[dict, dict, VisionCheckpoint]:
    """A vision-language checkpoint as (the language model's config dict, its tensors under the
    text families' names, the vision side). Raises ``ValueError`` for one this module does not serve."""
    family = FAMILIES[raw["model_type"]]
    text = family.text_config(raw)
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
        self.mrope_merge = self.net.mrope_merge

    def with_rope(self, mm: MultiModalInputs) -> MultiModalInputs:
        """``mm`` with its M-RoPE layout where the decoder takes M-RoPE positions (a 400 where an
        image's grid does not match its tokens); as it is for any other family."""
        if not self.mrope_merge:
            return mm
        return dataclasses.replace(mm, rope=MRope.of(mm.images, self.mrope_merge))

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
