"""The combination fuzz (issue 30): every pair of features the compatibility table allows runs together.

The configurations come from the table at run time (``tests/combos.py``: a pairwise covering array
over ``compat.FUZZED`` less ``REFUSED`` and ``EXCLUSIVE``), so a pair lifted from ``REFUSED`` is run
here as soon as its row is gone. The table's other features (``Feature.fuzzed`` False: request kinds,
the launcher's and a caller's choices, model properties without a fuzz model) are proven row by row in
tests/unit/test_settings.py. Each configuration runs a random workload on the tiny chat model
(``tests/fuzz/workload.py``: shared prefixes, long and short prompts, streams cut, aborts of queued
requests, health checks, session turns with offsets and aborted or too-long turns, grammars, n>1, stop
strings, embeddings and label scores, retraction under a small pool) with strict books after every step, the idle audit at random
points and after, and, in fp32, every deterministic output equal to the plain engine's. PD rows run a
prefill and a decode engine; TP rows start worker processes (gone after).

Images (issue 52) run on the tiny LLaVA, one row per start-up feature the table allows beside them
(``combos.image_rows``, read from the table, so a lifted refusal gets its row): image requests with
repeats, aborts and a small pool, strict books, fp32 rows token-exact to the plain engine.

The CUDA feature's pairs are run only where torch sees a CUDA device; elsewhere they are reported as
not run here (the first test's output), not skipped. ``KVLEDGER_FUZZ_STEPS`` scales the steps per row;
bench/fuzz_combinations.py runs the same rows (and random ones) for 10^5 steps.
"""

from __future__ import annotations

import os
import random
import zlib

import pytest

from kvledger import Engine, compat
from tests import combos
from tests.fuzz.workload import PDPair, Reference, Single, Workload
from tests.helpers import build_tiny_chat_model, tiny_image

ROWS = combos.covering_array()
STEPS = int(os.environ.get("KVLEDGER_FUZZ_STEPS", "240"))


@pytest.fixture(scope="module")
def chat_loaded(chat_model):
    from kvledger.model import load_model

    return load_model(chat_model)


@pytest.fixture(scope="module")
def draft_models(chat_model, tmp_path_factory) -> list[str]:
    """Drafts of the chat model's tokenizer: the model itself (drafts nearly all accepted) and another
    one (nearly all rejected: truncation on every step)."""
    return [chat_model, build_tiny_chat_model(str(tmp_path_factory.mktemp("draft")), seed=6)]


@pytest.fixture(scope="module")
def reference(chat_model, chat_loaded):
    """``reference(row)``: the plain engine of the row's model (the chat model, or its windowed
    variant for a sliding-window row), one per model."""
    made: dict[str, Reference] = {}

    def get(row) -> Reference:
        model, loaded = combos.row_model(row, chat_model, chat_loaded)
        if model not in made:
            eng = Engine(loaded_model=loaded, dtype="float32", page_size=16, max_total_tokens=8192,
                         enable_prefix_cache=False, strict_memory=True)  # fmt: skip
            made[model] = Reference(eng)
        return made[model]

    yield get
    for ref in made.values():
        ref.eng.shutdown()


def run_row(row, seed: int, steps: int, chat_model, chat_loaded, drafts, reference, tmp_dir):
    """One configuration's engines, started with settings drawn from ``seed``, under a workload of
    ``steps`` steps; shut down after (a TP row's workers gone). Outputs compare with the plain engine
    of the row's model (``reference(row)``)."""
    rng = random.Random(seed)
    started = combos.start(row, chat_model, chat_loaded, rng.choice(drafts), tmp_dir, rng)
    try:
        if "compile" in row:
            assert all(e.core.model.compiled is not None for e in started.engines)
        if "sliding_window" in row:
            assert all(e.core.kv_manager.window is not None for e in started.engines)
        target = PDPair(*started.engines, started.port) if started.pd else Single(started.engines[0])
        exact = combos.exact_to_row_model(row)
        return Workload(target, reference(row), rng, exact, chat_loaded.tokenizer).run(steps)
    finally:
        started.shutdown()


def test_the_configurations_cover_every_allowed_pair():
    """Each allowed pair is on together in some configuration, none has a refused or exclusive pair,
    and each feature runs with each other one off too; what is left is what this machine cannot run."""
    here = combos.runnable_here()
    covered = set().union(*(combos.pairs(r) for r in ROWS))
    assert combos.allowed_pairs(here) <= covered
    for r in ROWS:
        assert combos.compatible(r), combos.row_id(r)
        for f, needs in combos.REQUIRES.items():
            assert f not in r or needs in r
    assert combos._targets(here) <= set().union(*(combos.covers(r) for r in ROWS))
    left = combos.not_run_here(ROWS)
    assert all("cuda" in p for p in left) and (combos.cuda_here() or len(left) == len(
        [p for p in compat.allowed_pairs() if "cuda" in p]))  # fmt: skip
    print(f"{len(ROWS)} configurations cover {len(covered & combos.allowed_pairs())} of "
          f"{len(combos.allowed_pairs())} allowed pairs; not run here (no CUDA device): {left}")  # fmt: skip


def test_a_pair_lifted_from_the_table_is_run_without_a_change_here(monkeypatch):
    """The configurations are the table's: each pair still refused as "not yet", once lifted, is
    covered (and a refusal added takes its pair out)."""
    here = combos.runnable_here()
    for pair, r in list(compat.REFUSED.items()):
        if r.kind != compat.NOT_YET or not pair <= set(here):
            continue
        monkeypatch.setattr(compat, "REFUSED", {p: v for p, v in compat.REFUSED.items() if p != pair})
        rows = combos.covering_array(here, tries=5)
        assert any(pair <= row for row in rows), sorted(pair)
        monkeypatch.undo()
    added = frozenset({"mixed_chunk", "ngram"})
    monkeypatch.setattr(compat, "REFUSED", {**compat.REFUSED, added: compat.Refusal(compat.NOT_YET, "test")})
    assert not any(added <= row for row in combos.covering_array(here, tries=5))


@pytest.mark.parametrize("row", ROWS, ids=combos.row_id)
def test_combination(row, chat_model, chat_loaded, draft_models, reference, tmp_path):
    seed = zlib.crc32(combos.row_id(row).encode())
    stats = run_row(row, seed, STEPS, chat_model, chat_loaded, draft_models, reference, str(tmp_path))
    print(combos.row_id(row), dict(stats))
    assert stats["idle_audits"] >= 1 and stats["kind_health"] >= 1
    assert stats["kind_embed"] + stats["kind_score"] >= 1
    if "sessions" in row:
        assert stats["turns"] >= 1
    if "sliding_window" in row:
        assert stats["window_released_pages"] >= 1


# -- images (issue 52): each start-up feature the table allows beside them, on the tiny LLaVA --------------
IMAGE_ROWS = combos.image_rows()
IMAGE_G = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def image_jobs(llava, rng: random.Random, n: int) -> list[tuple[list[int], list]]:
    """``n`` requests: one or two images of a pool of three (repeats: prefix and encoder-cache hits)
    behind texts of several lengths (another text before the same image: no prefix hit), and text."""
    tok = llava[1].tokenizer
    pool = [tiny_image(60 + k, rng.choice([(50, 40), (30, 60)])) for k in range(3)]
    jobs = []
    for _ in range(n):
        k = rng.choice([0, 1, 1, 2])
        head = rng.choice(["", "so ", "a longer question first, then "])
        text = "<|user|>" + head + " and ".join(["<image>"] * k) + rng.choice([" what", " say it"]) + "</s><|assistant|>"
        jobs.append((tok(text)["input_ids"], [rng.choice(pool) for _ in range(k)]))
    return jobs


@pytest.fixture(scope="module")
def llava_loaded(llava):
    from kvledger.model import load_model

    return load_model(llava[0])


@pytest.fixture(scope="module")
def image_reference(llava, llava_loaded):
    """The plain fp32 engine's greedy answers, by job (prompt ids and images' pixels)."""
    eng = Engine(loaded_model=llava_loaded, model=llava[0], dtype="float32", page_size=16, max_total_tokens=4096,
                 enable_prefix_cache=False, encoder_cache_bytes=0, strict_memory=True)  # fmt: skip
    cache: dict = {}

    def answer(ids: list[int], images: list) -> list[int]:
        key = (tuple(ids), tuple((im.size, im.tobytes()) for im in images))  # by content (ids get reused)
        if key not in cache:
            cache[key] = eng.generate(input_ids=ids, sampling_params=IMAGE_G, image_data=images or None)["output_ids"]
        return cache[key]

    yield answer
    eng.shutdown()


@pytest.mark.parametrize("row", IMAGE_ROWS, ids=combos.row_id)
def test_images_combined(row, llava, llava_loaded, image_reference, tmp_path):
    """Image requests (repeats, aborts, a small pool that retracts) under ``row``'s feature, in fp32
    where the row allows it: strict books every step, token-exact to the plain engine where the row is
    exact, nothing held after."""
    from tests.engine.test_vision import assert_images_clean

    rng = random.Random(zlib.crc32(("images " + combos.row_id(row)).encode()))
    fp32 = combos.compatible(row | {"fp32"})  # (a quantized row runs in bfloat16)
    started = combos.start(row, llava[0], llava_loaded, llava[0], str(tmp_path), rng, **({"dtype": "float32"} if fp32 else {}))
    try:
        eng = started.engines[0]
        jobs = image_jobs(llava, rng, 10)
        rids = [eng.add_request(ids, IMAGE_G, image_data=ims or None) for ids, ims in jobs]
        aborted = set(rng.sample(range(len(rids)), 2))
        for _ in range(rng.randint(1, 4)):
            eng.step()
        for i in aborted:
            eng.abort(rids[i])
        eng.run_until_idle()
        exact = fp32 and combos.exact(row | {"fp32"})
        for i, ((ids, ims), rid) in enumerate(zip(jobs, rids)):
            out = eng.result(rid)
            if i in aborted:
                continue
            assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
            if exact:
                assert out["output_ids"] == image_reference(ids, ims), (i, combos.row_id(row))
        assert_images_clean(eng)
        if eng.core.scheduler.images.cache is not None:
            assert set(eng.core.runner.images.cache) == set(eng.core.scheduler.images.cache.entries)
    finally:
        started.shutdown()
