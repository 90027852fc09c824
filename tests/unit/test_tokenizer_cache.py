"""A GGUF's tokenizer is converted once and loaded from kvledger's cache after: the same tokenizer
(ids, chat template, special tokens), a new entry when the file changes, and a broken entry is
converted again rather than trusted (issue 29: the conversion cost seconds at every start, twice)."""

from __future__ import annotations

import os
import shutil

import pytest

from kvledger.model import loader
from kvledger.model.loader import default_model_path, load_tokenizer, tokenizer_cache_dir

pytestmark = pytest.mark.smollm2

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


def test_the_cached_tokenizer_is_the_converted_one_and_a_changed_file_is_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLEDGER_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "model.gguf")
    shutil.copy(default_model_path(), path)
    conversions = []
    real = loader._hf_tokenizer

    def counting(p, **kw):
        if "gguf_file" in kw:
            conversions.append(p)
        return real(p, **kw)

    monkeypatch.setattr(loader, "_hf_tokenizer", counting)
    converted = load_tokenizer(path)
    assert len(conversions) == 1 and len(list(tokenizer_cache_dir().iterdir())) == 1
    cached = load_tokenizer(path)
    assert len(conversions) == 1  # served from the cache
    _same(converted, cached)
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


def test_an_unwritable_cache_still_loads(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache directory should be: nothing can be written
    monkeypatch.setenv("KVLEDGER_CACHE_DIR", str(blocker))
    tok = load_tokenizer(default_model_path())
    assert tok.encode("Hello") and blocker.is_file()


def load_model_tokenizer(path: str):
    return loader.load_model(path).tokenizer
