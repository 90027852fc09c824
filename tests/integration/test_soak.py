"""A 60-second soak at tiny scale: mixed traffic, small pool; the books balance (0 leaks)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_soak_60s_no_leaks(chat_model, tmp_path):
    out = tmp_path / "soak.json"
    r = subprocess.run(
        [
            sys.executable,
            "bench/soak.py",
            "--model",
            chat_model,
            "--duration",
            "60",
            "--small",
            "--workers",
            "8",
            "--out",
            str(out),
            "--audit-interval-s",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["leaks"] == 0 and report["idle_clean"] and report["engine_restarts"] == 0
    assert report["requests"] > 100
    # Busy audits: under continuous load the full audit still runs every 2 s (idle audits add more).
    assert report["audits"] >= 0.8 * 60 / 2, report["audits"]
    assert report["server_exit_code"] == 0
    answers = report["answers"]
    assert sum(v for k, v in answers.items() if k.startswith("bad 400")) > 0
    assert not any(" 500" in k for k in answers), answers
