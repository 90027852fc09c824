"""HiSparse (issue 31) on the default SmolLM2 (bf16 + int4): decode speed, memory held, quality.

    python bench/hisparse.py [--quick] [--contexts 4096,8192] [--streams 1,8] [--needles 20]
                             [--lp-prompts 50] [--extra-top-k 8] [--attention-backend auto]
                             [--skip speed,quality,all_pages] [--threads 1]
    python bench/hisparse.py --report bench/out/hisparse.json [more.json ...]   # the tables again

Everything is made by the script from a fixed seed: the text is sentences drawn from word lists
(``make_text``), tokenized and cut to exact token counts.

1. Speed: for each context C (prompt + output = C tokens) and stream count S, the same S prompts go
   to a dense engine and a sparse engine (separate engines in this process, the order alternating per
   row). Decode is timed from the step in which the last request got its first token to the end (every
   step in that window is decodes only); TTFT (submission -> first token of each) is reported apart.
2. Memory held per request, from ``engine.memory()`` in the middle of that decode window: the dense
   engine's ``kv_private``; the sparse engine's ``kv_hisparse_hot`` (KV pool) and ``hisparse.host_held``
   (host pool), in tokens and MiB (``kv_bytes_per_token``).
3./4. Quality, on ONE engine with HiSparse on whose dense reference is the same engine with
   ``hisparse_min_context`` raised above the prompt (the request then decodes densely, exactly as in an
   engine without HiSparse: no sparse rows in its steps): the prompt's KV is computed once, by the dense
   request, and the sparse requests take it from the prefix cache (their first token comes from a
   prefill of the last partial page: dense attention, as in any sparse request). The sparse settings
   of the extra top-k row are set on the same engine's worker (``SparseWorker.top_k``) between runs.
   3. Needle in a haystack: "The secret code of <name> is <5 digits>." at a depth in filler text, then a
      chat-template question; correct = the 5 digits appear in the greedy answer (up to EOS).
   4. Logprob delta: dense greedy for ``--lp-tokens`` tokens (ignore_eos) with logprobs; then the sparse
      engine is forced through dense's exact tokens (an EBNF grammar of the literal text, so every step
      is a real sparse decode over KV that sparse decode wrote) and reports the raw logprob of each
      forced token. Position 0 comes from the prefill (dense in both) and is left out of the mean. A
      position counts while the forced token ids equal dense's (a different tokenization of the same
      text ends the comparison; counted). The free-running sparse greedy agreement length is reported
      too.

Writes bench/out/hisparse.json and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
log = logging.getLogger("bench.hisparse")

# -- text ---------------------------------------------------------------------------------------------------
_SUBJ = ("The farmer", "A young engineer", "The old captain", "Our neighbour", "The museum guide", "A quiet student",
         "The baker", "The mayor of the town", "A travelling musician", "The river pilot", "My aunt", "The librarian",
         "A tired nurse", "The chess club", "The village doctor", "A curious child")  # fmt: skip
_VERB = ("carried", "painted", "repaired", "described", "forgot", "counted", "sold", "borrowed", "measured",
         "photographed", "buried", "wrapped", "cleaned", "discovered", "ordered", "planted")  # fmt: skip
_OBJ = ("a wooden chair", "three copper kettles", "the broken lantern", "a map of the northern hills",
        "an umbrella with blue stripes", "the last loaf of bread", "a box of old letters", "two white goats",
        "the church bell", "a basket of pears", "the heavy anchor", "a jar of honey", "the faded curtains",
        "a small brass key", "the winter coats", "a stack of newspapers")  # fmt: skip
_WHEN = ("before breakfast", "on a rainy Tuesday", "after the market closed", "during the long winter",
         "while the others slept", "at the end of the summer", "just before the storm", "every other morning",
         "in the middle of the festival", "late in the evening")  # fmt: skip
_WHY = ("because nobody else would", "to settle an old argument", "for the spring fair", "as a favour to a friend",
        "without telling anyone", "for no reason at all", "to make some room in the barn",
        "because the rain had stopped")  # fmt: skip
_NAMES = ("Alice Moreau", "Bram Kowalski", "Chiara Lund", "Dmitri Okafor", "Elena Park", "Farid Haddad",
          "Greta Sousa", "Hiro Tanaka", "Ines Varga", "Jonas Berg", "Kofi Mensah", "Lena Novak", "Mateo Rossi",
          "Nadia Petrov", "Oscar Lindqvist", "Priya Raman", "Quentin Dubois", "Rosa Jimenez", "Sven Aalto",
          "Tara Singh")  # fmt: skip


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_SUBJ)} {rng.choice(_VERB)} {rng.choice(_OBJ)} {rng.choice(_WHEN)}"
    return s + (f" {rng.choice(_WHY)}." if rng.random() < 0.5 else ".")


def make_text(rng: random.Random, tok, n_tokens: int) -> list[int]:
    """Paragraphs of drawn sentences, tokenized, exactly ``n_tokens`` ids (cut mid-sentence)."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        para = " ".join(sentence(rng) for _ in range(rng.randint(4, 8)))
        ids += tok.encode(para + "\n\n", add_special_tokens=False)
    return ids[:n_tokens]


def filler_sentences(rng: random.Random, tok, n_tokens: int) -> list[list[int]]:
    """Whole sentences (each its own ids) until they make at least ``n_tokens``."""
    out, total = [], 0
    while total < n_tokens:
        ids = tok.encode(" " + sentence(rng), add_special_tokens=False)
        out.append(ids)
        total += len(ids)
    return out


def needle_prompt(rng: random.Random, tok, sents: list[list[int]], length: int, depth: float) -> tuple[list[int], str]:
    """A chat prompt of exactly ``length`` ids: the filler ``sents`` (``filler_sentences``) with the
    needle sentence at ``depth`` (a fraction of the filler, at a sentence boundary), then the question.
    Returns (ids, the 5-digit code)."""
    name, code = rng.choice(_NAMES), str(rng.randint(10000, 99999))
    marker = "@@FILLER@@"
    text = tok.apply_chat_template(
        [{"role": "user", "content": f"{marker}\n\nWhat is the secret code of {name}? Answer with the number only."}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    head, tail = text.split(marker)
    head_ids, tail_ids = tok.encode(head, add_special_tokens=False), tok.encode(tail, add_special_tokens=False)
    needle = tok.encode(f" The secret code of {name} is {code}.", add_special_tokens=False)
    room = length - len(head_ids) - len(tail_ids) - len(needle)
    flat: list[int] = []
    cut = None
    target = int(room * depth)
    for s in sents:
        if cut is None and len(flat) + len(s) > target:
            cut = len(flat)
        flat += s
    cut = min(cut if cut is not None else len(flat), room)
    body = flat[:cut] + needle + flat[cut:room]  # the filler's tail is cut mid-sentence to fit exactly
    ids = head_ids + body + tail_ids
    assert len(ids) == length, (len(ids), length)
    return ids, code


# -- engines ------------------------------------------------------------------------------------------------
def engine(loaded, args, sparse: bool, **extra):
    from kvledger import Engine

    kw = dict(dtype="bfloat16", page_size=16, max_total_tokens=args.kv_tokens, context_length=8192,
              attention_backend=args.attention_backend, max_running_requests=max(16, max(args.streams)))  # fmt: skip
    if sparse:
        kw.update(enable_hisparse=True, hisparse_top_k_pages=args.top_k, hisparse_hot_pages=args.hot_pages,
                  hisparse_host_ratio=args.host_ratio)  # fmt: skip
        if args.dense_layers is not None:
            kw.update(hisparse_dense_layers=args.dense_layers)
    kw.update(extra)
    return Engine(loaded_model=loaded, **kw)


def check_idle(eng, what: str) -> None:
    eng.run_until_idle()
    rep = eng.audit()
    if not getattr(rep, "ok", True):
        raise SystemExit(f"{what}: the ledger audit failed when idle: {rep}")


def decode_run(eng, prompts: list[list[int]], out_len: int, mem_at: int) -> dict:
    """Submit ``prompts`` together, step to the end. Returns TTFTs, the decode window (from the step in
    which the last request got its first token), and ``memory()`` once ``mem_at`` decode steps in."""
    sp = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    rids = [eng.add_request(p, sp) for p in prompts]
    first: dict[str, float] = {}
    done: dict[str, list[int]] = {}
    got = dict.fromkeys(rids, 0)
    t_dec = None
    steps = tokens = 0
    mem = None
    while len(done) < len(rids):
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.rid not in got:
                continue
            if o.new_ids and o.rid not in first:
                first[o.rid] = now - t0
            got[o.rid] += len(o.new_ids)
            if t_dec is not None:
                tokens += len(o.new_ids)
        if t_dec is not None and any(o.new_ids for o in outs):
            steps += 1
            if steps == mem_at:
                mem = eng.memory()
        if t_dec is None and len(first) == len(rids):
            t_dec = now
        for r in rids:
            if r not in done:
                res = eng.result(r)
                if res is not None:
                    done[r] = res["output_ids"]
    t_end = time.perf_counter()
    window = t_end - t_dec
    return {
        "ttft_s": [first[r] for r in rids],
        "decode_s": window,
        "decode_steps": steps,
        "decode_tokens": tokens,
        "ms_per_step": 1000 * window / max(steps, 1),
        "tok_s": tokens / window if window > 0 else 0.0,
        "memory": mem,
        "outputs": [done[r] for r in rids],
    }


def held(mem: dict, sparse: bool, bytes_per_token: int) -> dict:
    """What a row's requests hold mid-decode, in tokens and MiB: in the KV pool their private pages, the
    cached prefix pages they lock, and (sparse) their hot pages; in the host pool (sparse) their pages."""
    mib = bytes_per_token / 2**20
    pool = mem["kv_private"] + mem["kv_cached_protected"] + mem.get("kv_hisparse_hot", 0)
    host = mem["hisparse"]["host_held"] if sparse else 0
    return {"pool_tokens": pool, "pool_mib": pool * mib, "host_tokens": host, "host_mib": host * mib,
            "private": mem["kv_private"], "protected": mem["kv_cached_protected"],
            "hot": mem.get("kv_hisparse_hot", 0), "evictable": mem["kv_cached_evictable"]}  # fmt: skip


def bench_speed(loaded, args, tok, results: dict) -> None:
    """Per context: a base prompt (all but the last page) is prefilled once per engine (its time is the
    prefill figure; dense and sparse prefill are the same code) and stays in the prefix cache; each
    stream's prompt is the base + its own last page, so a row's requests prefill one page each. The
    streams of a row share the base's KV on the dense engine (each sparse request copies it to its own
    host pages at its first decode), which favours dense slightly: it reads that KV once per stream."""
    rows = []
    dense = engine(loaded, args, sparse=False)
    sparse = engine(loaded, args, sparse=True)
    bpt = dense.core.info.kv_bytes_per_token
    results["kv_bytes_per_token"] = bpt
    # Warm both (first-call allocations, kernel dispatch) on a short prompt.
    for e in (dense, sparse):
        e.generate(input_ids=make_text(random.Random(1), tok, 64), sampling_params={"max_new_tokens": 4,
                   "temperature": 0, "ignore_eos": True})  # fmt: skip
    i = 0
    for c, ctx in enumerate(args.contexts):
        prompt_len = ctx - args.out_len
        rng = random.Random(args.seed * 1000 + ctx)
        base = make_text(rng, tok, prompt_len - 16)
        prompts = [base + make_text(rng, tok, 16) for _ in range(max(args.streams))]
        engines = [("dense", dense), ("sparse", sparse)]
        prefill = {}
        for name, eng in engines if c % 2 == 0 else engines[::-1]:
            log.info("prefill: %s, %d tokens", name, len(base))
            t = time.perf_counter()
            eng.generate(input_ids=base, sampling_params={"max_new_tokens": 1, "temperature": 0})
            prefill[name] = time.perf_counter() - t
            log.info("  %.1f s", prefill[name])
        for streams in tqdm(args.streams, desc=f"speed {ctx}"):
            order = engines if i % 2 == 0 else engines[::-1]
            i += 1
            row = {"context": ctx, "prompt": prompt_len, "streams": streams, "first": order[0][0],
                   "prefill_s": prefill}  # fmt: skip
            outs = {}
            for name, eng in order:
                log.info("speed: %s, %d x %d tokens", name, streams, prompt_len)
                begun = eng.memory()["hisparse"]["requests_begun"] if name == "sparse" else 0
                r = decode_run(eng, prompts[:streams], args.out_len, mem_at=args.out_len // 2)
                check_idle(eng, f"speed {name}")
                if name == "sparse" and eng.memory()["hisparse"]["requests_begun"] - begun != streams:
                    raise SystemExit("the sparse engine did not decode these requests sparsely")
                outs[name] = r.pop("outputs")
                row[name] = r
                row[name]["held"] = held(r.pop("memory"), name == "sparse", bpt)
                log.info("  %s: %.1f ms/step, %.1f tok/s", name, r["ms_per_step"], r["tok_s"])
            row["speedup"] = row["dense"]["ms_per_step"] / row["sparse"]["ms_per_step"]
            row["same_output"] = f"{sum(a == b for a, b in zip(outs['dense'], outs['sparse']))}/{streams}"
            rows.append(row)
        for eng in (dense, sparse):
            eng.flush_cache()
    results["speed"] = rows
    dense.shutdown()
    sparse.shutdown()


# -- quality ------------------------------------------------------------------------------------------------
def literal_ebnf(text: str) -> str:
    esc = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'root ::= "{esc}"'


class Quality:
    """One HiSparse engine; ``dense`` requests run with min_context above every prompt."""

    def __init__(self, eng, tok):
        self.eng, self.tok = eng, tok
        self.cfg = eng.core.kv_manager.sparse.cfg
        self.worker = eng.core.runner.sparse
        self.min_context = self.cfg.hisparse_min_context
        self.eos = set(tok.all_special_ids)

    def warm(self, ids: list[int]) -> None:
        """Prefill ``ids`` into the prefix cache, so that the dense reference and the sparse runs after it
        all prefill the same last page over the same cached KV (the same first-token logits)."""
        self.run(ids, sparse=False, max_new_tokens=1)

    def run(self, ids: list[int], sparse: bool, **sp) -> dict:
        self.cfg.hisparse_min_context = self.min_context if sparse else 10**9
        before = self.eng.memory()["hisparse"]["requests_begun"]
        try:
            out = self.eng.generate(input_ids=ids, sampling_params={"temperature": 0, **sp})
        finally:
            self.cfg.hisparse_min_context = self.min_context
        began = self.eng.memory()["hisparse"]["requests_begun"] - before
        if began != (1 if sparse and sp.get("max_new_tokens", 1) > 1 else 0):
            raise SystemExit(f"expected {'a sparse' if sparse else 'a dense'} decode, {began} sparse begins")
        return out

    def answer(self, out_ids: list[int]) -> str:
        cut = next((i for i, t in enumerate(out_ids) if t in self.eos), len(out_ids))
        return self.tok.decode(out_ids[:cut])


def needle_set(args, tok) -> list[dict]:
    """Per length one filler text (so the prefix before each needle comes from the prefix cache: only
    the needle and what follows it are prefilled), the needles at depths spread evenly over it."""
    items = []
    for length in args.needle_lengths:
        rng = random.Random(args.seed * 7919 + length)
        sents = filler_sentences(rng, tok, length)
        for j in range(args.needles):
            depth = (j + 0.5) / args.needles
            ids, code = needle_prompt(rng, tok, sents, length - 32, depth)  # room for the answer (24)
            items.append({"length": length, "depth": round(depth, 3), "ids": ids, "code": code})
    return items


def bench_quality(loaded, args, tok, results: dict, save) -> None:
    """The logprob delta first, then the needles (saved after each one: a long run cut short keeps them)."""
    eng = engine(loaded, args, sparse=True)
    q = Quality(eng, tok)
    top_ks = [args.top_k] + [k for k in args.extra_top_k if k != args.top_k]
    # Logprob delta of dense's chosen tokens.
    lp = {f"sparse_k{k}": {"deltas": [], "forced_len": [], "free_agree": [], "tokenization_break": 0} for k in top_ks}
    floor = {"deltas": [], "free_agree": []}
    rng = random.Random(args.seed * 31337)
    base = make_text(rng, tok, args.lp_len - args.lp_tail)  # shared (cached); each prompt its own tail
    for _ in tqdm(range(args.lp_prompts), desc="logprob delta"):  # (0: the needles alone)
        ids = base + make_text(rng, tok, args.lp_tail)
        sp = {"max_new_tokens": args.lp_tokens, "ignore_eos": True, "logprobs": True}
        w = q.run(ids, sparse=False, **sp)  # full prefill: fills the prefix cache (see Quality.warm)
        d = q.run(ids, sparse=False, **sp)
        d_ids, d_lp = d["output_ids"], d["meta_info"]["output_token_logprobs"]
        # The noise floor: the same dense decode after a full prefill vs after a cached prefix (bf16 sums
        # in another order), over the positions before their first disagreement.
        w_lp = w["meta_info"]["output_token_logprobs"]
        agree = next((i for i, (a, b) in enumerate(zip(w["output_ids"], d_ids)) if a != b), len(d_ids))
        floor["free_agree"].append(agree)
        floor["deltas"] += [abs(_lp(w_lp[i]) - _lp(d_lp[i])) for i in range(1, min(agree + 1, len(d_ids)))]
        text = tok.decode(d_ids)
        for k in top_ks:
            q.worker.top_k = k
            acc = lp[f"sparse_k{k}"]
            free = q.run(ids, sparse=True, **sp)["output_ids"]
            acc["free_agree"].append(next((i for i, (a, b) in enumerate(zip(free, d_ids)) if a != b), len(d_ids)))
            f = q.run(ids, sparse=True, max_new_tokens=len(d_ids), logprobs=True, ebnf=literal_ebnf(text))
            f_ids, f_lp = f["output_ids"], f["meta_info"]["output_token_logprobs"]
            n = 0
            for i in range(1, len(d_ids)):
                if i >= len(f_ids) or f_ids[i] != d_ids[i]:
                    acc["tokenization_break"] += 1
                    break
                acc["deltas"].append(abs(_lp(f_lp[i]) - _lp(d_lp[i])))
                n += 1
            acc["forced_len"].append(n)
        q.worker.top_k = args.top_k
    results["logprob"] = {} if not args.lp_prompts else {
        key: {
            "prompts": args.lp_prompts,
            "positions": len(v["deltas"]),
            "mean_abs_delta": statistics.fmean(v["deltas"]) if v["deltas"] else None,
            "median_abs_delta": statistics.median(v["deltas"]) if v["deltas"] else None,
            "max_abs_delta": max(v["deltas"]) if v["deltas"] else None,
            "forced_positions_mean": statistics.fmean(v["forced_len"]),
            "tokenization_breaks": v["tokenization_break"],
            "free_agree_mean": statistics.fmean(v["free_agree"]),
            "free_agree_all": sum(a == args.lp_tokens for a in v["free_agree"]),
        }
        for key, v in lp.items()
    }
    results["logprob_floor"] = {} if not args.lp_prompts else {
        "positions": len(floor["deltas"]),
        "mean_abs_delta": statistics.fmean(floor["deltas"]) if floor["deltas"] else None,
        "max_abs_delta": max(floor["deltas"]) if floor["deltas"] else None,
        "free_agree_mean": statistics.fmean(floor["free_agree"]),
        "free_agree_all": sum(a == args.lp_tokens for a in floor["free_agree"]),
    }
    check_idle(eng, "logprob")
    save()
    # Needle in a haystack.
    items = needle_set(args, tok)
    nh = ["dense"] + [f"sparse_k{k}" for k in top_ks]
    for it in tqdm(items, desc="needles"):
        sp = {"max_new_tokens": 24}
        q.warm(it["ids"])
        d = q.run(it["ids"], sparse=False, **sp)
        rec = {"length": it["length"], "depth": it["depth"], "code": it["code"], "dense": q.answer(d["output_ids"])}
        for k in top_ks:
            q.worker.top_k = k
            s = q.run(it["ids"], sparse=True, **sp)
            rec[f"sparse_k{k}"] = q.answer(s["output_ids"])
        q.worker.top_k = args.top_k
        rec["ok"] = {key: it["code"] in rec[key] for key in nh}
        results.setdefault("needle_items", []).append(rec)
        done = results["needle_items"]
        results["needle"] = {key: {str(L): [sum(r["ok"][key] for r in done if r["length"] == L),
                                           sum(r["length"] == L for r in done)] for L in args.needle_lengths}
                             for key in nh}  # fmt: skip
        save()
    check_idle(eng, "needles")
    results["worker_hits"], results["worker_misses"] = q.worker.hits, q.worker.misses
    eng.shutdown()


def bench_all_pages(loaded, args, tok, results: dict) -> None:
    """A sanity check of the measure itself: with every page selected (top-k + sink + recent covers the
    sequence) sparse decode does dense attention's sums, so the forced logprobs must equal dense's
    (bf16 both; the same kernels over the same pages in the same order)."""
    n_prompt, n_out = 1024, 16
    pages = -(-(n_prompt + n_out) // 16)
    eng = engine(loaded, args, sparse=True, hisparse_top_k_pages=pages, hisparse_hot_pages=pages + 4,
                 hisparse_min_context=512)  # fmt: skip
    q = Quality(eng, tok)
    rng = random.Random(args.seed * 4242)
    deltas, same = [], 0
    for _ in range(args.all_pages_prompts):
        ids = make_text(rng, tok, n_prompt)
        sp = {"max_new_tokens": n_out, "ignore_eos": True, "logprobs": True}
        q.warm(ids)
        d = q.run(ids, sparse=False, **sp)
        s_ = q.run(ids, sparse=True, **sp)
        same += s_["output_ids"] == d["output_ids"]
        for a, b in zip(d["meta_info"]["output_token_logprobs"], s_["meta_info"]["output_token_logprobs"]):
            if a[1] != b[1]:
                break
            deltas.append(abs(_lp(a) - _lp(b)))
    check_idle(eng, "all pages")
    eng.shutdown()
    results["all_pages"] = {"prompts": args.all_pages_prompts, "same_output": same, "positions": len(deltas),
                            "max_abs_delta": max(deltas) if deltas else None, "deltas": deltas}  # fmt: skip
    log.info("all pages selected: %s", results["all_pages"])


def _lp(entry) -> float:
    """A logprob entry of meta_info (SGLang's ``(logprob, token_id, text)``, or a bare float)."""
    return float(entry[0] if isinstance(entry, (list, tuple)) else entry)


# -- report -------------------------------------------------------------------------------------------------
def report(results: dict, args) -> str:
    lines = ["| context (prompt + out) | streams | dense ms/step | sparse ms/step | dense tok/s | sparse tok/s | "
             "sparse speedup | KV pool held dense / sparse (tokens, MiB) | host held sparse (tokens, MiB) | "
             "same greedy output |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results.get("speed", []):
        d, s = r["dense"], r["sparse"]
        dh, sh = d["held"], s["held"]
        lines.append(
            f"| {r['context']} ({r['prompt']} + {args.out_len}) | {r['streams']} | {d['ms_per_step']:.1f} | "
            f"{s['ms_per_step']:.1f} | {d['tok_s']:.1f} | {s['tok_s']:.1f} | {r['speedup']:.2f}x | "
            f"{dh['pool_tokens']:.0f} ({dh['pool_mib']:.1f}) / {sh['pool_tokens']:.0f} ({sh['pool_mib']:.1f}) | "
            f"{sh['host_tokens']:.0f} ({sh['host_mib']:.1f}) | {r['same_output']} |"
        )
    pre = {r["context"]: r["prefill_s"] for r in results.get("speed", [])}
    if pre:
        lines += ["", "prefill of the base prompt (s, dense / sparse engine): " + ", ".join(
            f"{c}: {p['dense']:.1f} / {p['sparse']:.1f}" for c, p in pre.items())]  # fmt: skip
    if "needle" in results:
        lines += ["", "| needle in a haystack (correct / prompts) | " + " | ".join(
            f"{L} tokens" for L in args.needle_lengths) + " |", "|---|" + "---|" * len(args.needle_lengths)]  # fmt: skip
        for key, v in results["needle"].items():
            lines.append(f"| {key} | " + " | ".join(f"{v[str(L)][0]}/{v[str(L)][1]}" for L in args.needle_lengths) + " |")
    if results.get("logprob"):
        lines += ["", "| chosen-token logprob vs dense | positions | mean abs delta | median | max | forced positions "
                  "per prompt | tokenization breaks | free greedy agreement (mean tokens, all agree) |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for key, v in results["logprob"].items():
            if v["mean_abs_delta"] is None:
                lines.append(f"| {key} | 0 | - | - | - | - | {v['tokenization_breaks']} | - |")
                continue
            lines.append(
                f"| {key} | {v['positions']} | {v['mean_abs_delta']:.4f} | {v['median_abs_delta']:.4f} | "
                f"{v['max_abs_delta']:.3f} | {v['forced_positions_mean']:.1f} | {v['tokenization_breaks']} | "
                f"{v['free_agree_mean']:.1f}, {v['free_agree_all']}/{v['prompts']} |"
            )
    if results.get("logprob_floor") and results["logprob_floor"]["mean_abs_delta"] is not None:
        f = results["logprob_floor"]
        lines.append(f"| dense: full prefill vs cached prefix (noise floor; positions before the first disagreement) "
                     f"| {f['positions']} | {f['mean_abs_delta']:.4f} | - | {f['max_abs_delta']:.3f} | - | - | "
                     f"{f['free_agree_mean']:.1f}, {f['free_agree_all']}/{args.lp_prompts} |")  # fmt: skip
    if "all_pages" in results:
        a = results["all_pages"]
        lines += ["", f"top-k = all pages (sanity check, {a['prompts']} prompts of 1024 tokens): "
                  f"{a['same_output']}/{a['prompts']} same greedy output, max |logprob delta| {a['max_abs_delta']} "
                  f"over {a['positions']} positions"]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--quick", action="store_true", help="a smoke run: small contexts, few prompts")
    ap.add_argument("--contexts", type=ints, default=[4096, 8192], help="prompt + output tokens (speed)")
    ap.add_argument("--streams", type=ints, default=[1, 8])
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--needles", type=int, default=20, help="needle prompts per length")
    ap.add_argument("--needle-lengths", type=ints, default=[4096, 8192])
    ap.add_argument("--lp-prompts", type=int, default=50)
    ap.add_argument("--all-pages-prompts", type=int, default=3, help="the top-k = all pages sanity check")
    ap.add_argument("--lp-len", type=int, default=4096)
    ap.add_argument("--lp-tail", type=int, default=512, help="tokens of each prompt after the shared base")
    ap.add_argument("--lp-tokens", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--hot-pages", type=int, default=32)
    ap.add_argument("--dense-layers", type=int, default=None,
                    help="--hisparse-dense-layers of the sparse engine (default: the setting's)")
    ap.add_argument("--extra-top-k", type=ints, default=[8], help="more top-k rows for the quality sets")
    ap.add_argument("--host-ratio", type=float, default=1.0)
    ap.add_argument("--kv-tokens", type=int, default=80_000)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: speed,quality")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared, oversubscribed box)")
    ap.add_argument("--out", default="bench/out/hisparse.json")
    ap.add_argument("--report", nargs="+", default=None, metavar="JSON",
                    help="print the tables from these result files (merged in order) and exit")
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.streams, args.out_len = [2560], [1, 2], 16
        args.needles, args.needle_lengths, args.lp_prompts, args.lp_len, args.lp_tokens = 2, [2560], 2, 2560, 8
        args.lp_tail, args.all_pages_prompts = 256, 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.report:
        merged: dict = {}
        for f in args.report:
            merged.update(json.loads(Path(f).read_text()))
        print(report(merged, args))
        return
    import torch

    from kvledger.model import load_model

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    loaded = load_model(None)
    tok = loaded.tokenizer
    results: dict = {"args": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads(),
                     "load_s": time.perf_counter() - t0}  # fmt: skip
    skip = set(args.skip.split(","))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # what is done so far survives a run cut short
        results["wall_s"] = time.perf_counter() - t0
        Path(args.out).write_text(json.dumps(results, indent=2))

    for name, section in (("all_pages", bench_all_pages), ("speed", bench_speed), ("quality", bench_quality)):
        if name not in skip:
            section(loaded, args, tok, results, save) if name == "quality" else section(loaded, args, tok, results)
            save()
    print(report(results, args))
    print(f"\nwall {results['wall_s']:.0f} s; threads {results['threads']}; json: {args.out}")


if __name__ == "__main__":
    main()
