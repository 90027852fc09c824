"""``--chat-template`` on the real server, with the real ``openai`` client: a model that carries no
template is refused chat (the error names the flag), and answers with ``--chat-template chatml``,
whose ``<|im_end|>`` is then one of the engine's stop tokens."""

from __future__ import annotations

import openai
import pytest

from kvledger import Engine
from kvledger.model.chat_templates import BUILTIN_TEMPLATES
from kvledger.model.loader import load_tokenizer
from tests.helpers import assert_idle_clean, build_tiny_chat_model
from tests.integration.conftest import started_server

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Name a color."},
]


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory) -> str:
    """A tiny random model without a chat template; chatml's markers are special tokens of its tokenizer."""
    return build_tiny_chat_model(
        str(tmp_path_factory.mktemp("bare")), template=None, extra_specials=("<|im_start|>", "<|im_end|>")
    )


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_chat_without_a_template_is_refused_naming_the_flag(bare_model, tmp_path):
    for srv in started_server(bare_model, str(tmp_path / "server.log")):
        c = _client(srv)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4)
        err = e.value.body
        assert "--chat-template" in err["message"] and "chatml" in err["message"], err
        assert err["param"] == "messages"
        # Completions need no template: served as before.
        assert c.completions.create(model="default", prompt="Hi", max_tokens=3).usage.completion_tokens >= 1
        srv.wait_idle_clean()


def test_chat_with_a_builtin_template_answers(bare_model, tmp_path):
    tok = load_tokenizer(bare_model)
    want = tok.apply_chat_template(
        MESSAGES, chat_template=BUILTIN_TEMPLATES["chatml"].template, add_generation_prompt=True, return_dict=False
    )
    for srv in started_server(bare_model, str(tmp_path / "server.log"), "--chat-template", "chatml"):
        c = _client(srv)
        r = c.chat.completions.create(model="default", messages=MESSAGES, max_tokens=6, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.prompt_tokens == len(want)  # the prompt is chatml's rendering
        assert r.usage.completion_tokens >= 1
        chunks = list(c.chat.completions.create(model="default", messages=MESSAGES, max_tokens=6, temperature=0, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content
        srv.wait_idle_clean()


def test_the_engine_stops_at_the_templates_end_of_turn(bare_model):
    """The offline Engine takes the same setting: the template is on its tokenizer and ``<|im_end|>``
    (not the model's EOS) ends generation."""
    eng = Engine(model=bare_model, dtype="float32", chat_template="chatml", strict_memory=True, max_total_tokens=2048)
    try:
        im_end = eng.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert eng.tokenizer.chat_template == BUILTIN_TEMPLATES["chatml"].template
        assert im_end in eng.core.scheduler.stop.eos_token_ids
        assert eng.tokenizer.eos_token_id in eng.core.scheduler.stop.eos_token_ids  # beside the model's EOS
        out = eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    finally:
        assert_idle_clean(eng)
        eng.shutdown()


def test_a_file_template_that_raises_on_one_conversation_is_that_requests_400(bare_model, tmp_path):
    """A user's Jinja file that passes the start-up check but raises on some messages (and reads a
    variable nobody gives: empty, as in transformers): that request is a 400, the next one is served."""
    path = tmp_path / "picky.jinja"
    path.write_text(
        "{{ nobody_gives_this }}{% for m in messages %}"
        "{% if m['content'] == 'boom' %}{{ raise_exception('this template refuses boom') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    for srv in started_server(bare_model, str(tmp_path / "server.log"), "--chat-template", str(path)):
        c = _client(srv)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="default", messages=[{"role": "user", "content": "boom"}], max_tokens=2)
        assert "this template refuses boom" in e.value.body["message"]
        r = c.chat.completions.create(model="default", messages=MESSAGES, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens > 0 and r.choices[0].finish_reason in ("stop", "length")
        srv.wait_idle_clean()
