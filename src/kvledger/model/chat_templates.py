"""Chat templates: the built-in ones (``--chat-template NAME``), a Jinja file (``--chat-template FILE``),
and which template a model is served with.

Resolution, first found wins: the ``--chat-template`` setting; the template the model carries (a GGUF's
``tokenizer.chat_template``, or a Hugging Face directory's tokenizer config, both of which transformers
puts on the tokenizer it loads); a Hugging Face tokenizer config beside a GGUF file (the repository's
``tokenizer_config.json`` or ``chat_template.jinja`` downloaded next to the file). With none, chat is
refused with an error that names the flag.

Every template is rendered by transformers' ``apply_chat_template``: the same sandboxed Jinja
(``ImmutableSandboxedEnvironment``) whatever its source. The setting is read and tried once, at start
(``read_chat_template``): a missing or empty file, a syntax error, or a template that cannot render a
one-message conversation stops the start-up with an error naming the setting, never a request.

A template's end-of-turn markers (``END_OF_TURN_MARKERS`` that it writes and that the tokenizer holds as
one token) become stop tokens of the engine, as llama.cpp's end-of-generation tokens: a model that
closes its turn with ``<end_of_turn>`` stops there even where the file's EOS is another token.

The built-in templates are written from each family's documented prompt format (its model card and
tokenizer config): chatml (``<|im_start|>role ... <|im_end|>``), llama-3 (header ids, ``<|eot_id|>``),
gemma (``<start_of_turn>user/model``, the system message folded into the first user turn: Gemma has
no system role), mistral (``[INST] ... [/INST]``, the system message folded into the first user turn),
phi-3 (``<|system|>``/``<|user|>``/``<|assistant|>`` closed by ``<|end|>``) and qwen (chatml with
Qwen2's default system message when the conversation brings none).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ..errors import ValidationError

# Each built-in: (template, its end-of-turn markers). Whitespace matters: transformers compiles with
# trim_blocks and lstrip_blocks, so a newline after a block tag is dropped and the text keeps only what
# the expressions write.
_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_QWEN = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}" + _CHATML
)
_LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Gemma has two roles, user and model; a system message opens the first user turn.
_GEMMA = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
# Mistral's [INST] format: no system role (folded into the first user message), an answer closed by EOS;
# the open [/INST] is the generation prompt, so add_generation_prompt adds nothing.
_MISTRAL = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (first_prefix if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('mistral: roles are system (first), user and assistant') }}"
    "{% endif %}"
    "{% endfor %}"
)
_PHI3 = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class BuiltinTemplate:
    template: str
    stop_markers: tuple[str, ...]  # the end-of-turn tokens a model of this family writes


BUILTIN_TEMPLATES: dict[str, BuiltinTemplate] = {
    "chatml": BuiltinTemplate(_CHATML, ("<|im_end|>",)),
    "llama-3": BuiltinTemplate(_LLAMA3, ("<|eot_id|>", "<|eom_id|>")),
    "gemma": BuiltinTemplate(_GEMMA, ("<end_of_turn>",)),
    "mistral": BuiltinTemplate(_MISTRAL, ()),  # its turns end with the tokenizer's EOS, a stop already
    "phi-3": BuiltinTemplate(_PHI3, ("<|end|>",)),
    "qwen": BuiltinTemplate(_QWEN, ("<|im_end|>",)),
}

# End-of-turn markers of the families this field serves (llama.cpp counts these among its
# end-of-generation tokens): one that a template writes and the tokenizer holds as a single token
# stops generation. ``</s>`` and ``<eos>`` are EOS already where a template writes them.
END_OF_TURN_MARKERS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "<|end_of_text|>",
    "<|return|>", "<|END_OF_TURN_TOKEN|>", "<EOT>",
)  # fmt: skip

# What a template is tried on at start: one user message, with a generation prompt.
_TRIAL = [{"role": "user", "content": "Hello"}]


def _names() -> str:
    return ", ".join(BUILTIN_TEMPLATES)


def read_chat_template(value: str) -> str:
    """The template text that ``--chat-template`` names: a built-in's, or a Jinja file's, checked (it
    compiles in the sandbox and renders a one-message conversation). A ValidationError (param
    ``chat_template``) that lists the built-in names otherwise."""
    builtin = BUILTIN_TEMPLATES.get(value.strip().lower())
    if builtin is not None:
        return builtin.template
    path = os.path.expanduser(value)
    if not os.path.isfile(path):
        raise ValidationError(
            f"--chat-template {value!r} is neither a file nor a built-in template (built-in: {_names()})",
            param="chat_template",
        )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValidationError(f"--chat-template {value!r}: cannot read it ({e})", param="chat_template") from None
    if not text.strip():
        raise ValidationError(
            f"--chat-template {value!r} is empty (give a Jinja template, or a built-in: {_names()})",
            param="chat_template",
        )
    check_template(text, f"--chat-template {value!r}")
    return text


def check_template(text: str, what: str) -> None:
    """Compile ``text`` in transformers' sandbox and render a one-user-message conversation with a
    generation prompt; a ValidationError saying why, otherwise. A template that fails there cannot
    serve any chat: it is refused at start rather than on every request."""
    from transformers.utils.chat_template_utils import render_jinja_template  # (lazily: its import is slow)

    try:
        render_jinja_template(
            [_TRIAL], chat_template=text, add_generation_prompt=True, bos_token="<s>", eos_token="</s>"
        )
    except Exception as e:  # a syntax error, raise_exception, an undefined attribute: the template's fault
        raise ValidationError(
            f"{what}: the template fails on a one-message conversation: {type(e).__name__}: {e}",
            param="chat_template",
        ) from None


@dataclass(frozen=True)
class ChatTemplate:
    """The template a model is served with, and where it came from (what the start-up log says)."""

    text: str | None  # None: no template (chat refused)
    source: str  # "--chat-template NAME", "the model", "PATH", or "none"


def resolve_chat_template(setting: str | None, tokenizer: Any, model_path: str) -> ChatTemplate:
    """The template to serve: the setting, else the model's own (the tokenizer's: a GGUF's metadata or
    a directory's tokenizer config), else a tokenizer config beside a GGUF file."""
    if setting:
        return ChatTemplate(read_chat_template(setting), f"--chat-template {setting}")
    own = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(own, str) and own.strip():
        return ChatTemplate(own, "the model")
    if os.path.isfile(model_path):
        beside = _template_beside(os.path.dirname(os.path.abspath(model_path)))
        if beside is not None:
            text, where = beside
            check_template(text, where)
            return ChatTemplate(text, where)
    return ChatTemplate(None, "none")


def _template_beside(directory: str) -> tuple[str, str] | None:
    """A Hugging Face chat template in ``directory`` (``chat_template.jinja``, or ``chat_template`` in
    ``tokenizer_config.json`` or ``chat_template.json``), with the file it came from."""
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            text = f.read()
        if text.strip():
            return text, jinja
    for name in ("tokenizer_config.json", "chat_template.json"):
        p = os.path.join(directory, name)
        if not os.path.isfile(p):
            continue
        try:
            with open(p, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if isinstance(template, str) and template.strip():
            return template, p
    return None


def install_chat_template(tokenizer: Any, setting: str | None, model_path: str) -> ChatTemplate:
    """Resolve the template and put it on ``tokenizer`` (what ``apply_chat_template`` renders);
    returns it. Without a tokenizer, a setting is still read (a bad one fails the start)."""
    if tokenizer is None:
        if setting:
            read_chat_template(setting)
        return ChatTemplate(None, "none")
    resolved = resolve_chat_template(setting, tokenizer, model_path)
    if resolved.text is not None:
        tokenizer.chat_template = resolved.text
    return resolved


def template_stop_ids(text: str | None, tokenizer: Any, setting: str | None = None) -> set[int]:
    """The ids of the end-of-turn markers the template writes (a built-in's declared ones, else
    ``END_OF_TURN_MARKERS`` found in its text) that the tokenizer holds as one token."""
    if not text or tokenizer is None:
        return set()
    builtin = BUILTIN_TEMPLATES.get((setting or "").strip().lower())
    markers = builtin.stop_markers if builtin is not None else tuple(m for m in END_OF_TURN_MARKERS if m in text)
    ids: set[int] = set()
    vocab = tokenizer.get_vocab()
    for m in markers:
        tid = vocab.get(m)
        if tid is not None and tid != getattr(tokenizer, "unk_token_id", None):
            ids.add(int(tid))
    return ids


def no_template_message() -> str:
    """The error of a chat request to a model served without a template."""
    return (
        "this model has no chat template; start the server with --chat-template FILE|NAME "
        f"(a Jinja file, or a built-in: {_names()}), or use /v1/completions"
    )
