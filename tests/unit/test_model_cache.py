"""kvledger's model cache (issue 29: converting a GGUF's tokenizer and parsing its metadata cost
seconds at every start, in both server processes). A GGUF's tokenizer is converted once and loaded
from the cache after: the same tokenizer (ids, chat template, special tokens). Its index serves the
same weights, config and flags as a parse of the file. A changed file is a new entry; a broken entry
is derived again, never trusted."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import gguf
import pytest
import torch

from kvledger.model import loader
from kvledger.model.loader import default_model_path, load_tokenizer
from kvledger.model.model_cache import cache_root, tokenizer_cache_dir
from kvledger.model.quantized import dense
from tests.helpers import build_tiny_model
from tests.unit.test_loader import write_gguf

TEXTS = ["Hello world", "  two spaces\n\ttab", "<|im_start|>user\nHi<|im_end|>", "émoji 🤖 中文 ÿ", ""]


def _same(a, b) -> None:
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert a.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == b.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    ids = list(range(0, 49152, 97))
    assert a.decode(ids) == b.decode(ids)
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids", "add_bos_token"):
        assert getattr(a, attr, None) == getattr(b, attr, None), attr
    assert a.get_vocab() == b.get_vocab()


@pytest.mark.smollm2
def test_the_cached_tokenizer_is_the_converted_one_and_a_changed_file_is_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLEDGER_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "model.gguf")
    shutil.copy(default_model_path(), path)
    conversions, auto_loads = [], []
    real = loader._hf_tokenizer

    def counting(p, **kw):
        (conversions if "gguf_file" in kw else auto_loads).append(p)
        return real(p, **kw)

    monkeypatch.setattr(loader, "_hf_tokenizer", counting)
    converted = load_tokenizer(path)
    assert len(conversions) == 1 and len(list(tokenizer_cache_dir().iterdir())) == 1
    cached = load_tokenizer(path)
    assert len(conversions) == 1  # served from the cache
    _same(converted, cached)
    # A plain fast tokenizer's entry loads through its own class, not AutoTokenizer's mapping (whose
    # import a warm start would wait on): the same class as the converted one.
    assert auto_loads == [] and type(cached) is type(converted)
    # The engine's load (the model's tokenizer) reads the same entry.
    assert load_model_tokenizer(path) is not None and len(conversions) == 1

    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: a new key
    load_tokenizer(path)
    assert len(conversions) == 2 and len(list(tokenizer_cache_dir().iterdir())) == 2

    for entry in tokenizer_cache_dir().iterdir():  # a broken entry is a miss, converted again
        (entry / "tokenizer.json").write_text("{ not json")
    again = load_tokenizer(path)
    assert len(conversions) == 3
    _same(converted, again)
    load_tokenizer(path)  # ... and replaced by a good one
    assert len(conversions) == 3


@pytest.mark.smollm2
def test_an_unwritable_cache_still_loads(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache directory should be: nothing can be written
    monkeypatch.setenv("KVLEDGER_CACHE_DIR", str(blocker))
    tok = load_tokenizer(default_model_path())
    assert tok.encode("Hello") and blocker.is_file()


def load_model_tokenizer(path: str):
    return loader.load_model(path).tokenizer


def _same_load(a, b) -> None:
    assert a.config == b.config and a.stored_quantization == b.stored_quantization
    assert set(a.weights) == set(b.weights)
    for name, w in a.weights.items():
        assert type(w) is type(b.weights[name]) and torch.equal(dense(w), dense(b.weights[name])), name


@pytest.mark.parametrize("qtype", ["Q4_1", "F32", "Q6_K"])
def test_the_gguf_index_serves_what_a_parse_of_the_file_gives(tmp_path, monkeypatch, qtype):
    monkeypatch.setenv("KVLEDGER_CACHE_DIR", str(tmp_path / "cache"))
    src = build_tiny_model(str(tmp_path / "hf"), "llama", hidden_size=256, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
    path = str(tmp_path / f"m-{qtype}.gguf")
    write_gguf(src, path, qtype)
    parsed = loader.load_model(path, load_tokenizer=False)  # parses, writes the index
    entries = list((cache_root() / "gguf-index").iterdir())
    assert len(entries) == 1

    def no_parse(*a, **kw):
        raise AssertionError("parsed the file although its index is cached")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    _same_load(parsed, loader.load_model(path, load_tokenizer=False))
    monkeypatch.undo()

    monkeypatch.setenv("KVLEDGER_CACHE_DIR", str(tmp_path / "cache"))
    entries[0].write_text('{"format": 1, "tensors": [{"name": "x"}]}')  # an index that does not fit
    _same_load(parsed, loader.load_model(path, load_tokenizer=False))  # parsed again, and re-indexed
    entries[0].write_text("{ garbage")
    _same_load(parsed, loader.load_model(path, load_tokenizer=False))
    assert "tensors" in entries[0].read_text()


def test_a_gguf_truncated_after_indexing_is_a_one_line_error_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLEDGER_CACHE_DIR", str(tmp_path / "cache"))
    src = build_tiny_model(str(tmp_path / "hf"), "llama")
    path = str(tmp_path / "m.gguf")
    write_gguf(src, path, "Q8_0")
    loader.load_model(path, load_tokenizer=False)
    data = Path(path).read_bytes()
    st = os.stat(path)
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime, another size: another key
    with pytest.raises(loader.ModelLoadError, match="truncated or corrupt"):
        loader.load_model(path, load_tokenizer=False)
