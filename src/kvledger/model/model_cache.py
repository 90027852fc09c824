"""kvledger's on-disk cache of what is derived from a GGUF file and slow to derive again.

- The tokenizer: transformers converts a GGUF's vocabulary and merges into a fast tokenizer in
  seconds; the result is saved (``save_pretrained``) and loaded back in a fraction of one.
- The file's index: ``gguf.GGUFReader`` parses every metadata field, the tokenizer's 100,000 strings
  included, to reach the tensors; the index keeps what the model loader reads (the config, each
  tensor's type, offset and shape), so a later start memory-maps the tensors straight away.

Entries live under ``$KVLEDGER_CACHE_DIR`` (else ``$XDG_CACHE_HOME/kvledger``, ``~/.cache/kvledger``)
and are keyed by the file (real path, size, modification time) and the versions of the libraries that
produced them: a changed file or library is a miss, never a stale hit. Entries are written atomically
(a temporary name, then a rename); an entry that does not load is removed and derived again; a cache
that cannot be written costs the next start the work, nothing more.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT = 2  # bump when an entry's layout changes (2: a GGUF's config holds its family's settings)


def cache_root() -> Path:
    base = os.environ.get("KVLEDGER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvledger"
    )
    return Path(base)


def file_key(path: str, *versions: str) -> str:
    """The cache key of ``path`` as it is now, under the given library versions."""
    st = os.stat(path)
    ident = "|".join([str(FORMAT), os.path.realpath(path), str(st.st_size), str(st.st_mtime_ns), *versions])
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


# -- the tokenizer ---------------------------------------------------------------------------------------


def tokenizer_cache_dir() -> Path:
    return cache_root() / "tokenizers"


TOKENIZER_ENTRY = "read-once"  # the entry's config as ``_entry_config`` writes it (a new layout: a new key)


def _tokenizer_entry(path: str) -> Path:
    # The versions from the installed packages' metadata: importing transformers only to read its
    # version would put its import on a warm start's path.
    versions = (_version("transformers", None), _version("tokenizers", None), TOKENIZER_ENTRY)
    return tokenizer_cache_dir() / file_key(path, *versions)


def load_tokenizer_entry(path: str, load) -> Any | None:
    """The tokenizer kept for GGUF ``path`` (``load(dir)`` loads a saved one), or None on a miss."""
    entry = _tokenizer_entry(path)
    if not (entry / "tokenizer_config.json").is_file():
        return None
    try:
        return load(str(entry))
    except Exception as e:  # a truncated or foreign entry: derive it again
        log.warning("dropping the cached tokenizer %s (%s); converting the GGUF's again", entry, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def store_tokenizer(path: str, tokenizer) -> None:
    """Keep ``tokenizer`` (converted from GGUF ``path``) for the next start."""
    entry = _tokenizer_entry(path)
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent)
        tokenizer.save_pretrained(tmp)
        _entry_config(tmp, tokenizer)
        os.rename(tmp, entry)  # atomic; loses to a concurrent writer of the same entry
        tmp = None
    except OSError as e:
        log.debug("tokenizer cache not written (%s)", e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# What a saved tokenizer's class adds to ``TokenizersBackend`` when it only builds the backend from a
# vocabulary and merges (Gemma's, Llama's): nothing a saved ``tokenizer.json`` does not hold.
_BUILD_ONLY = {
    "__init__", "__module__", "__doc__", "__qualname__", "__annotations__", "__firstlineno__",
    "__static_attributes__", "vocab_files_names", "padding_side", "model_input_names", "model",
    "slow_tokenizer_class",
}  # fmt: skip


def _entry_config(directory: str, tokenizer) -> None:
    """Rewrite a saved tokenizer's config so that loading it reads ``tokenizer.json`` once, in Rust.

    transformers' ``from_pretrained`` parses ``tokenizer.json`` in Python (Gemma's: 33 MB, 262,144
    tokens) to find the added tokens when the config does not list them, and a class with its own
    ``__init__`` (GemmaTokenizer) parses it again to rebuild the BPE from the vocabulary and merges; a
    Gemma start waited ~4 s on that. So the config lists ``added_tokens_decoder`` (what the file's
    ``added_tokens`` hold), and a class that adds nothing but that rebuild is saved as
    ``TokenizersBackend`` with its class's padding side and input names: the same pipeline (the
    saved file is the rebuilt backend), encodings, specials and template (tests/unit/test_model_cache.py,
    tests/integration/test_gemma3_real.py). Not carried: the class's ``add_bos_token`` attribute, which
    transformers drops when it loads any ``tokenizer.json`` (the file's post-processor adds the BOS, as
    before); kvledger never reads it. Anything unexpected leaves the config as saved (correct, slower)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cfg_path = os.path.join(directory, "tokenizer_config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        added = {str(i): t.__getstate__() for i, t in tokenizer.added_tokens_decoder.items()}
        cls = type(tokenizer)
        if cls is not TokenizersBackend and cls.__mro__[1] is TokenizersBackend and set(cls.__dict__) <= _BUILD_ONLY:
            cfg["tokenizer_class"] = "TokenizersBackend"
            cfg.setdefault("padding_side", tokenizer.padding_side)
            cfg.setdefault("model_input_names", list(tokenizer.model_input_names))
        cfg["added_tokens_decoder"] = added
    except (AttributeError, TypeError, ValueError, OSError) as e:
        log.debug("tokenizer entry kept as saved (%s)", e)
        return
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=1)


# -- the GGUF index ----------------------------------------------------------------------------------------


def _index_entry(path: str) -> Path:
    import gguf
    import numpy as np

    return cache_root() / "gguf-index" / f"{file_key(path, _version('gguf', gguf), np.__version__)}.json"


def _version(name: str, module) -> str:
    """``name``'s installed version (its metadata; else ``module``'s, or the module imported, ``__version__``)."""
    import importlib
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        if module is None:
            module = importlib.import_module(name)
        return getattr(module, "__version__", "?")


def load_index(path: str) -> dict | None:
    """The index kept for GGUF ``path``, or None on a miss (an unreadable entry is removed)."""
    entry = _index_entry(path)
    try:
        with open(entry) as f:
            index = json.load(f)
        if index.get("format") != FORMAT or not isinstance(index.get("tensors"), list):
            raise ValueError("not an index of this format")
        return index
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:
        log.warning("dropping the cached GGUF index %s (%s)", entry, e)
        with contextlib.suppress(OSError):
            entry.unlink(missing_ok=True)
        return None


def store_index(path: str, index: dict) -> None:
    entry = _index_entry(path)
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=entry.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({**index, "format": FORMAT}, f)
        os.replace(tmp, entry)
        tmp = None
    except OSError as e:
        log.debug("GGUF index not written (%s)", e)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
