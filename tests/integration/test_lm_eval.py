"""lm-eval against the real server: a small multiple-choice task from a local JSONL file (no hub),
run with lm-eval's ``local-completions`` backend on kvledger and with its own ``hf`` backend on the
same weights (fp32); every loglikelihood must agree within 1e-3."""

from __future__ import annotations

import json

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval[api] is a test dependency (.ci/run installs it)")

DOCS = [
    {"q": "The sky is", "choices": [" blue", " green", " loud"], "label": 0},
    {"q": "Two plus two is", "choices": [" four", " five"], "label": 0},
    {"q": "Cats say", "choices": [" woof", " meow", " moo"], "label": 1},
    {"q": "Water is", "choices": [" wet", " dry"], "label": 0},
    {"q": "The opposite of hot is", "choices": [" cold", " warm", " tall"], "label": 0},
    {"q": "A week has seven", "choices": [" days", " hours"], "label": 0},
]
TOL = 1e-3


def task_dir(tmp_path) -> str:
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "kvl_tiny_mc.yaml").write_text(
        "task: kvl_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n"
    )
    return str(tmp_path)


def loglikelihoods(model: str, model_args: str, tasks_path: str) -> list[list[float]]:
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["kvl_tiny_mc"],
        task_manager=TaskManager(include_path=tasks_path),
        log_samples=True,
        batch_size=1,
    )
    samples = sorted(out["samples"]["kvl_tiny_mc"], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


def test_loglikelihoods_match_lm_evals_hf_backend(srv, chat_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = task_dir(tmp_path)
    served = loglikelihoods(
        "local-completions",
        f"model=default,base_url={srv.url}/v1/completions,tokenizer={chat_model},"
        "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=2,max_retries=1",
        tasks,
    )
    reference = loglikelihoods("hf", f"pretrained={chat_model},dtype=float32,device=cpu", tasks)
    assert len(served) == len(DOCS) and [len(x) for x in served] == [len(d["choices"]) for d in DOCS]
    assert all(x < 0 for row in served for x in row)  # real loglikelihoods, not placeholders
    for a, b in zip(served, reference):
        assert max(abs(x - y) for x, y in zip(a, b)) < TOL, (a, b)
