"""``--chat-template``: each built-in renders its family's format, the resolution order (the setting,
the model's own, a tokenizer config beside a GGUF), the start-up errors of bad files and names, and the
template's end-of-turn tokens as the engine's stop tokens."""

from __future__ import annotations

import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from kvledger import cli
from kvledger.config import CHAT_TEMPLATES
from kvledger.errors import ValidationError
from kvledger.model.chat_templates import (
    BUILTIN_TEMPLATES,
    install_chat_template,
    read_chat_template,
    resolve_chat_template,
    template_stop_ids,
)
from kvledger.model.loader import load_tokenizer
from tests.helpers import TINY_CHAT_TEMPLATE, build_tiny_chat_model

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Name a color."},
]

# Each family's documented format, written out by hand (what the built-in must render).
EXPECTED = {
    "chatml": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "qwen": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "llama-3": (
        "<BOS><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nName a color.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "gemma": (
        "<BOS><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nName a color.<end_of_turn>\n<start_of_turn>model\n"
    ),
    "mistral": "<BOS>[INST] You are terse.\n\nHi [/INST]Hello!<EOS>[INST] Name a color. [/INST]",
    "phi-3": (
        "<|system|>\nYou are terse.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
        "<|user|>\nName a color.<|end|>\n<|assistant|>\n"
    ),
}


def _render(template: str, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Through transformers' sandbox, as apply_chat_template renders (bos/eos as visible markers)."""
    out, _ = render_jinja_template(
        [messages], chat_template=template, add_generation_prompt=add_generation_prompt,
        bos_token="<BOS>", eos_token="<EOS>",
    )  # fmt: skip
    return out[0]


def test_builtin_names_are_the_settings_names():
    assert tuple(BUILTIN_TEMPLATES) == CHAT_TEMPLATES


@pytest.mark.parametrize("name", CHAT_TEMPLATES)
def test_builtin_renders_two_turns_with_a_system_message(name):
    assert _render(read_chat_template(name), CONVERSATION) == EXPECTED[name]


@pytest.mark.parametrize("name", CHAT_TEMPLATES)
def test_builtin_without_generation_prompt_ends_after_the_last_turn(name):
    text = _render(read_chat_template(name), CONVERSATION, add_generation_prompt=False)
    want = EXPECTED[name]
    # The generation prompt is what the expected text has past the last user turn's end.
    assert want.startswith(text) and text.rstrip().endswith(
        {"mistral": "[/INST]", "gemma": "<end_of_turn>", "llama-3": "<|eot_id|>", "phi-3": "<|end|>"}.get(name, "<|im_end|>")
    )


def test_qwen_gives_its_default_system_message_and_gemma_needs_none():
    user = [{"role": "user", "content": "Hi"}]
    assert _render(read_chat_template("qwen"), user).startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi"
    )
    assert _render(read_chat_template("chatml"), user) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert _render(read_chat_template("gemma"), user) == "<BOS><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_names_are_case_and_space_tolerant():
    assert read_chat_template(" Gemma ") == BUILTIN_TEMPLATES["gemma"].template


# -- bad settings: start-up errors that name the setting and list the built-ins ------------------------
@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("", "is empty"),
        ("  \n\t\n", "is empty"),
        ("{% for m in messages %}{{ m.content }}", "TemplateSyntaxError"),
        ("{{ raise_exception('no chat here') }}", "no chat here"),
        ("{{ messages[0].content.nope.deeper }}", "UndefinedError"),
    ],
)
def test_a_bad_file_is_a_start_up_error(tmp_path, content, why):
    p = tmp_path / "t.jinja"
    p.write_text(content)
    with pytest.raises(ValidationError) as e:
        read_chat_template(str(p))
    assert why in e.value.message and e.value.param == "chat_template", e.value.message


def test_undefined_variables_render_empty_as_in_transformers(tmp_path):
    """Jinja's default: an undefined name is empty (only an attribute of one raises): accepted."""
    p = tmp_path / "t.jinja"
    p.write_text("{{ not_given }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    text = read_chat_template(str(p))
    assert _render(text, [{"role": "user", "content": "x"}]) == "[user]x"


def test_a_file_that_is_not_text_is_a_start_up_error(tmp_path):
    p = tmp_path / "t.jinja"
    p.write_bytes(b"\xff\xfe\x00\x81 not utf-8")
    with pytest.raises(ValidationError, match="cannot read it"):
        read_chat_template(str(p))


@pytest.mark.parametrize("value", ["chat-ml", "/no/such/template.jinja", "llama3"])
def test_an_unknown_name_or_missing_file_lists_the_builtins(value):
    with pytest.raises(ValidationError) as e:
        read_chat_template(value)
    assert all(n in e.value.message for n in CHAT_TEMPLATES) and value in e.value.message


def test_the_cli_refuses_a_bad_template_before_starting(capsys, tmp_path):
    assert cli.main(["serve", "--chat-template", "nope", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "--chat-template 'nope'" in err and "chatml" in err
    empty = tmp_path / "empty.jinja"
    empty.write_text("")
    assert cli.main(["generate", "hi", "--chat-template", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err


# -- resolution: the setting, the model's own, a tokenizer config beside a GGUF -------------------------
@pytest.fixture(scope="module")
def bare_model(tmp_path_factory) -> str:
    """A tiny model whose tokenizer carries no template but has chatml's markers as special tokens."""
    return build_tiny_chat_model(
        str(tmp_path_factory.mktemp("bare")), template=None, extra_specials=("<|im_start|>", "<|im_end|>")
    )


def test_the_setting_wins_over_the_models_template(tmp_path):
    path = build_tiny_chat_model(str(tmp_path / "m"))
    tok = load_tokenizer(path)
    assert resolve_chat_template(None, tok, path).text == TINY_CHAT_TEMPLATE
    got = install_chat_template(tok, "chatml", path)
    assert got.source == "--chat-template chatml" and tok.chat_template == BUILTIN_TEMPLATES["chatml"].template


def test_no_template_anywhere_resolves_to_none(bare_model):
    tok = load_tokenizer(bare_model)
    assert not tok.chat_template
    assert resolve_chat_template(None, tok, bare_model).text is None
    assert install_chat_template(tok, None, bare_model).source == "none" and not tok.chat_template


def test_a_tokenizer_config_beside_a_gguf_file_is_the_last_resort(tmp_path, bare_model):
    tok = load_tokenizer(bare_model)
    gguf = tmp_path / "model.gguf"  # only its directory is read here
    gguf.write_bytes(b"GGUF")
    assert resolve_chat_template(None, tok, str(gguf)).text is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0].content }}"}))
    got = resolve_chat_template(None, tok, str(gguf))
    assert got.text == "{{ messages[0].content }}" and got.source.endswith("tokenizer_config.json")
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert resolve_chat_template(None, tok, str(gguf)).text == "J{{ messages[0].content }}"  # (HF's order)
    assert resolve_chat_template("phi-3", tok, str(gguf)).text == BUILTIN_TEMPLATES["phi-3"].template
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('broken beside') }}")
    with pytest.raises(ValidationError, match="broken beside"):
        resolve_chat_template(None, tok, str(gguf))


def test_end_of_turn_markers_the_tokenizer_holds_become_stop_ids(bare_model):
    tok = load_tokenizer(bare_model)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert template_stop_ids(BUILTIN_TEMPLATES["chatml"].template, tok, "chatml") == {im_end}
    assert template_stop_ids(BUILTIN_TEMPLATES["qwen"].template, tok, "qwen") == {im_end}
    # A file's template: the known markers it writes; one the tokenizer lacks (gemma's) is no stop.
    assert template_stop_ids("{{ '<|im_end|>' }}{{ '<end_of_turn>' }}", tok) == {im_end}
    assert template_stop_ids(BUILTIN_TEMPLATES["gemma"].template, tok, "gemma") == set()
    assert template_stop_ids(None, tok) == set()


def test_a_template_that_raises_on_some_conversations_passes_the_start_up_check():
    """The built-in mistral refuses a role it has no place for: at request time (the chat front turns
    it into a 400), not at start, where one user message renders."""
    from jinja2.exceptions import TemplateError

    text = read_chat_template("mistral")
    with pytest.raises(TemplateError, match="roles are system"):
        _render(text, [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])
