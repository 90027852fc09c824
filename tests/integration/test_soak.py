"""A 20-second soak at tiny scale: mixed traffic, small pool; the books balance (0 leaks).

Why 20 s suffices (it was 60): the traffic mix is one loop of the same request kinds, which 20 s runs
~750 times on the tiny model (>100 asserted, as before), and the busy audit runs every 0.5 s, so the
run makes more full audits under load (>= 32) than the 60 s run made at 2 s (>= 24). A leak is caught
by the first audit after it, not by the run's length; long soaks are ``bench/soak.py --duration 600``."""

from __future__ import annotations

import json
import subprocess
import sys

DURATION_S = 20
AUDIT_INTERVAL_S = 0.5


def test_soak_no_leaks(chat_model, tmp_path):
    out = tmp_path / "soak.json"
    r = subprocess.run(
        [
            sys.executable,
            "bench/soak.py",
            "--model",
            chat_model,
            "--duration",
            str(DURATION_S),
            "--small",
            "--workers",
            "8",
            "--out",
            str(out),
            "--audit-interval-s",
            str(AUDIT_INTERVAL_S),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["leaks"] == 0 and report["idle_clean"] and report["engine_restarts"] == 0
    assert report["requests"] > 100
    # Busy audits: under continuous load the full audit still runs every interval (idle audits add more).
    assert report["audits"] >= 0.8 * DURATION_S / AUDIT_INTERVAL_S, report["audits"]
    assert report["server_exit_code"] == 0
    answers = report["answers"]
    assert sum(v for k, v in answers.items() if k.startswith("bad 400")) > 0
    assert not any(" 500" in k for k in answers), answers
