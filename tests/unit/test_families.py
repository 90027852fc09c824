"""Each model family against transformers on a tiny random config built here (fp32, greedy,
token for token), on both attention backends, with chunked prefill beside decodes, pages smaller
than the sliding windows, and a prefix-cache hit. Adding a family: its file in model/models/, its
line in the registry, and its row here."""

from __future__ import annotations

import random

import pytest
import torch

from kvledger import Engine, kernels
from kvledger.model.models.registry import ARCHITECTURES, family_for
from tests.helpers import TINY_CONFIG, assert_idle_clean, hf_greedy

S, F = "sliding_attention", "full_attention"
BASE = {**TINY_CONFIG, "max_position_embeddings": 512, "pad_token_id": 0}
# family -> (config class, model class, settings over BASE); windows of 8 tokens under prompts of
# up to 40, so the windowed layers see less than the full layers
FAMILIES = {
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),  # every layer slides
    "gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(sliding_window=8, layer_types=[S, F], query_pre_attn_scalar=24, attn_logit_softcapping=1.0,
             final_logit_softcapping=3.0),
    ),
    "gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(num_hidden_layers=3, sliding_window=8, layer_types=[S, F, S], tie_word_embeddings=True),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(head_dim=None, partial_rotary_factor=0.5, sliding_window=12)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1]),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    # sinks, q/k/v/o biases, layer 0 sliding and layer 1 full, YaRN rope (transformers' default), routed
    # experts with biases; a clamp low enough to cut
    "gpt_oss": (
        "GptOssConfig", "GptOssForCausalLM",
        dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, swiglu_limit=0.5),
    ),
}  # fmt: skip
# transformers starts these near or at zero (biases, sinks): drawn again (name suffix: std), so the
# parity sees them
REDRAW = {"gpt_oss": {"bias": 0.2, "sinks": 1.0}}
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
LENGTHS = (1, 5, 23, 40)


def build_family(path: str, family: str, seed: int = 0, **extra) -> str:
    """The tiny random ``family`` model saved to ``path``; ``extra`` settings win (None: the default)."""
    import transformers

    cfg_cls, model_cls, over = FAMILIES[family]
    settings = {**BASE, **over, **extra}
    settings = {k: v for k, v in settings.items() if v is not None}
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**settings)
    model = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():  # random init gives near-uniform logits; scale up so greedy choices are clear
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(2.5)
            for suffix, std in REDRAW.get(family, {}).items():
                if name.endswith(suffix):
                    p.normal_(0.0, std)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory):
    import transformers

    path = build_family(str(tmp_path_factory.mktemp(request.param)), request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in LENGTHS]
    refs = [hf_greedy(hf.eval(), p, GREEDY["max_new_tokens"]) for p in prompts]
    with torch.no_grad():  # the log-probability of the first token of the longest prompt's answer
        logits = hf(torch.tensor([prompts[-1]])).logits[0, -1].float()
    first_logprob = torch.log_softmax(logits, -1)[refs[-1][0]].item()
    return request.param, path, prompts, refs, first_logprob


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_family_greedy_matches_transformers(family_model, backend):
    """All prompts at once (prefill chunks of 16 beside decodes, pages of 4), then the longest again
    from the prefix cache: every output token equal to transformers', the first one's logprob too."""
    family, path, prompts, refs, first_logprob = family_model
    if backend == "cpu" and not kernels.load():
        pytest.skip(f"CPU kernels unavailable: {kernels.status()}")
    eng = Engine(
        path,
        dtype="float32",
        page_size=4,
        max_total_tokens=2048,
        chunked_prefill_size=16,
        enable_mixed_chunk=True,
        strict_memory=True,
        attention_backend=backend,
    )
    assert eng.core.model.family is family_for(eng.core.model.cfg.arch)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for p, o, ref in zip(prompts, outs, refs):
        assert o["output_ids"] == ref, f"{family}: prompt of {len(p)} tokens"
    again = eng.generate(input_ids=prompts[-1], sampling_params={**GREEDY, "logprobs": True})
    assert again["meta_info"]["cached_tokens"] >= 36
    assert again["output_ids"] == refs[-1]
    # greedy choices do not see a monotonic change of the logits (Gemma 2's final soft-capping): logprobs do
    assert abs(again["meta_info"]["output_token_logprobs"][0][0] - first_logprob) < 1e-4
    assert_idle_clean(eng)


def test_registry_lines_name_their_family():
    for model_type in ARCHITECTURES:
        assert model_type in family_for(model_type).model_types
    assert family_for("gpt2") is None


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_family_under_tp2_equals_tp1(family, tmp_path):
    """Tensor parallel on the shared layers: Gemma 3's scaled, tied vocabulary ends and per-head
    norms; Qwen3-MoE's experts split by width with the router replicated. Same tokens as one rank."""
    path = build_family(str(tmp_path), family)
    prompts = [[5 + i] * 3 + list(range(30, 50 + 7 * i)) for i in range(3)]
    outs = []
    for tp in (1, 2):
        eng = Engine(
            path, dtype="float32", page_size=4, max_total_tokens=1024, strict_memory=True, tp_size=tp
        )
        outs.append([o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)])
        assert_idle_clean(eng)
        eng.shutdown()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("family", ["olmo2", "gpt_oss"])
def test_family_refuses_tp(tmp_path, family):
    from kvledger.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=rf"without tensor-parallel shards \({family}\) does not work with tensor parallel"):
        Engine(build_family(str(tmp_path), family), dtype="float32", tp_size=2)


def test_windows_keep_the_one_call_decode(tmp_path):
    """A window matters once a sequence outgrows it: before, every layer attends all keys; after, the
    one-call decode of every layer applies each layer's window in its attention kernel (the Python
    loop would run the reference attention for those layers). Its tokens against transformers':
    tests/unit/test_one_call_decode.py."""
    if not kernels.load():
        pytest.skip(f"CPU kernels unavailable: {kernels.status()}")
    path = build_family(str(tmp_path), "mistral_window")  # windows of 8
    eng = Engine(path, dtype="bfloat16", quantization="int4", attention_backend="cpu", max_total_tokens=1024)
    model = eng.core.model
    eng.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 5})  # up to 7 tokens
    short = model.one_call_forwards
    assert short >= 4
    eng.generate(input_ids=list(range(10, 30)), sampling_params=GREEDY)  # 20 tokens and more
    assert model.one_call_forwards >= short + GREEDY["max_new_tokens"] - 1
    assert_idle_clean(eng)


@pytest.mark.parametrize(
    "family, match",
    [
        # every layer slides: the compatibility table's row (sliding-window release x HiSparse)
        ("mistral_window", r"sliding-window release \(a model whose every layer slides\) does not work with HiSparse"),
        # some layers slide, soft-cap or have sinks: the row special_attention x HiSparse
        ("gemma3", r"sink attention \(gemma3_text\) does not work with HiSparse \(--enable-hisparse\)"),
        ("gpt_oss", r"sliding-window, soft-capped or sink attention \(gpt_oss\) does not work with HiSparse"),
    ],
)
def test_hisparse_refuses_windowed_attention(tmp_path, family, match):
    """HiSparse keeps a sparse slot's history in its host pool; the windowed layers read pages through
    the slot table, so the pair is refused at start (not served wrong)."""
    from kvledger.errors import ValidationError

    with pytest.raises(ValidationError, match=match):
        Engine(build_family(str(tmp_path), family), dtype="float32", page_size=16, enable_hisparse=True)


def test_lora_on_routed_experts_is_refused(tmp_path):
    """LoRA puts its deltas on each layer's four ``Linear`` projections; routed experts have none:
    refused at start with the reason."""
    from kvledger.errors import ValidationError

    with pytest.raises(ValidationError, match=r"routed experts \(mixtral\) does not work with LoRA adapters"):
        Engine(build_family(str(tmp_path), "mixtral"), dtype="float32", enable_lora=True)


def test_gpt_oss_attends_with_its_sinks(tmp_path):
    """The sinks are each layer's backend setting, the layers' own tensors: every layer takes the exact
    path, the full layer too and the sliding one before any sequence outgrows its window."""
    from types import SimpleNamespace

    eng = Engine(build_family(str(tmp_path), "gpt_oss"), dtype="float32", max_total_tokens=512)
    model = eng.core.model
    assert [s is L.attn.sinks for s, L in zip(model.attn.sinks, model.net.layers)] == [True, True]
    assert model.cfg.layer_windows() == [8, None]
    assert model.attn.special_layers(SimpleNamespace(seq_lens=[3])) == [True, True]
    assert_idle_clean(eng)


def test_gpt_oss_mxfp4_checkpoint_is_refused(tmp_path):
    """OpenAI's MXFP4 release is not read: refused at load with the reason, before any weight."""
    import json

    from kvledger.errors import ModelLoadError

    path = build_family(str(tmp_path), "gpt_oss")
    cfg_file = tmp_path / "config.json"
    raw = json.loads(cfg_file.read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    cfg_file.write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="mxfp4 checkpoints of gpt_oss are not read"):
        Engine(path, dtype="float32")


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_tables_equal_transformers(truncate):
    """YaRN's frequencies and its attention factor (folded into the cos/sin tables) as transformers
    computes them, GPT-OSS's truncate=False and the default truncate=True."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvledger.model.layers import Rotary

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": truncate, "original_max_position_embeddings": 4096}  # fmt: skip
    cfg = transformers.GptOssConfig(**{**BASE, "rope_parameters": dict(rope)})
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    assert factor != 1.0
    rot = Rotary(16, 512, 150000.0, dict(rope))
    freqs = torch.arange(512, dtype=torch.float32)[:, None] * inv[None, :]
    assert torch.equal(rot.cos, freqs.cos() * factor)
    assert torch.equal(rot.sin, freqs.sin() * factor)
