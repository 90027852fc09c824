"""The bf16 flash kernels' order of sums, checked on any AVX-512 CPU (issue 56 item 5).

``tests/unit/csrc/flash_emulated.cpp`` compiles ``flash_bf16.cpp`` with its three AVX512-BF16
intrinsics replaced by lane-wise software versions and checks that the decode form (``flash_chunk``
over the pool's rows in place, chunks folded) gives the bits of ``flash_rows`` over packed keys. On a
CPU with AVX512-BF16, tests/unit/test_batch_invariance.py checks the real instructions; this test keeps
the layout and shuffle logic of those kernels under test on the CPUs without them (a wrong lane index
in the decode kernel's V interleave makes 112 of its 112 cases differ).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "src" / "kvledger" / "kernels" / "csrc"
HARNESS = Path(__file__).parent / "csrc" / "flash_emulated.cpp"


def _avx512() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return all(f in flags.split() for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the emulated kernels")
@pytest.mark.skipif(not _avx512(), reason="the CPU has no AVX-512 (F, BW, VL, DQ)")
def test_the_decode_form_of_the_bf16_flash_kernel_gives_flash_rows_bits(tmp_path):
    exe = tmp_path / "flash_emulated"
    flags = ["-O2", "-std=c++17", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    build = subprocess.run(["g++", *flags, "-mavx2", "-mfma", f"-I{CSRC}", "-o", str(exe), str(HARNESS)],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "0 of 112 cases differ" in run.stdout
