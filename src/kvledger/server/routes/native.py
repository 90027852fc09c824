"""SGLang's native ``POST /generate``: text or input_ids (one or a batch), stream or not."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ...common import parse_prompts, validate_request
from ...common.disagg import parse_disagg
from ...compat import refusal_error
from ...errors import ValidationError
from ...multimodal.inputs import to_wire
from ..admission import check_fanout, check_prompt_tokens, prompt_count
from ..handlers import parse_body
from ..image_parts import decode_images, native_images, native_url, remote_native_urls
from ..openai_format import sse
from ..protocol import GenerateRequest
from ..state import state

router = APIRouter()


@router.post("/generate")
async def generate(request: Request):
    srv = state(request)
    srv.live_client()
    body = await parse_body(request, GenerateRequest)
    given = body.text if body.text is not None else body.input_ids
    check_fanout(srv.admission, prompt_count(given), 1, "text" if body.text is not None else "input_ids")
    ids_list, single = parse_prompts(body.text, body.input_ids, srv.tokenizer)
    check_prompt_tokens(srv.admission, ids_list, "text" if body.text is not None else "input_ids")
    if body.session_params is not None and not single:
        raise refusal_error("sessions", "several_prompts", param="session_params")
    sp = dict(body.sampling_params or {})
    salt = body.salt()
    if salt is not None:
        if sp.get("cache_salt") is not None:
            raise ValidationError("give cache_salt once, at the top level", param="cache_salt")
        sp["cache_salt"] = salt
    if body.priority is not None:
        if sp.get("priority") is not None:
            raise ValidationError("give priority once, at the top level", param="priority")
        sp["priority"] = body.priority
    if body.require_reasoning:  # SGLang's: a grammar starts after the reasoning (needs --reasoning-parser)
        sp["require_reasoning"] = True
    if body.return_logprob:
        sp["logprobs"] = True
        if body.top_logprobs_num:
            sp["top_logprobs"] = body.top_logprobs_num
        if body.logprob_start_len != -1:
            sp["logprob_start_len"] = body.logprob_start_len
    loras = _loras(body.lora_path, len(ids_list), sp)
    images: list = [None] * len(ids_list)
    oa = srv.openai
    for k, pairs in enumerate(native_images(body.image_data, len(ids_list), single)):
        if pairs:  # each placeholder repeated for its image, before the length is checked
            fetched = {}
            if oa.images is not None and oa.media.allow_remote_media:  # fetched first, the loop serving on
                urls = [(native_url(x, where), where) for x, where in pairs[: oa.max_images]]
                fetched = await oa.remote.fetch_all(remote_native_urls(urls, oa.max_images))
            prepared = {}
            if oa.reader is not None:  # read, decoded and processed in the reader's threads, the loop serving on
                prepared = await oa.reader.read_all(pairs[: oa.max_images], fetched, native=True)
            got = decode_images(pairs, oa.images, oa.media, oa.max_images, fetched, prepared)
            ids_list[k], mm = oa.images.expand(list(ids_list[k]), got.images, got.params)
            images[k] = to_wire(mm)
    jobs = [validate_request(ids, {**sp, **lo}, srv.limits) for ids, lo in zip(ids_list, loras)]
    rooms = parse_disagg(body.model_extra, len(jobs))  # PD: the router's bootstrap room(s)
    text_fn = srv.openai.token_text if body.return_text_in_logprobs else None
    if not single:
        if body.stream:
            raise ValidationError("stream takes a single prompt", param="stream")
        base = body.rid or uuid.uuid4().hex
        states = await srv.gen.collect_all(
            [
                srv.gen.collect(ids, p, f"{base}-{i}", disagg=room, images=images[i])
                for i, ((ids, p), room) in enumerate(zip(jobs, rooms))
            ],
            request.is_disconnected,
            fail_fast=False,  # SGLang's batch: each prompt answers for itself, a failed one with its abort
        )
        return [s.native(body.return_logprob, text_fn) for s in states]
    (ids, params), rid = jobs[0], body.rid or uuid.uuid4().hex
    if not body.stream:
        st = await srv.gen.collect(
            ids, params, rid, request.is_disconnected, body.session_params, disagg=rooms[0], images=images[0]
        )
        err = st.error()
        if err is not None:  # an unstreamed answer that failed is an error, partial output or not
            raise err
        return st.native(body.return_logprob, text_fn)
    agen = srv.gen.stream(ids, params, rid, body.session_params, disagg=rooms[0], images=images[0])
    first = await agen.__anext__()  # errors before any output become a proper status code
    err = first.error()
    if err is not None and not first.output_ids:
        raise err

    async def events():
        try:
            yield sse(first.native(body.return_logprob, text_fn))
            async for st in agen:
                err = st.error()
                yield sse(
                    err.to_dict()
                    if err is not None and not st.output_ids
                    else st.native(body.return_logprob, text_fn)
                )
            yield "data: [DONE]\n\n"
        finally:
            await agen.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


def _loras(lora_path, n: int, sp: dict) -> list[dict]:
    """SGLang's top-level ``lora_path``: one adapter for every prompt, or one per prompt (None: the
    base model); the engine checks each is loaded. Given in ``sampling_params`` too, once only."""
    if lora_path is None:
        return [{}] * n
    if sp.get("lora_path") is not None:
        raise ValidationError("give lora_path once, at the top level", param="lora_path")
    names = lora_path if isinstance(lora_path, list) else [lora_path] * n
    if len(names) != n:
        raise ValidationError(f"lora_path has {len(names)} entries for {n} prompts", param="lora_path")
    return [{"lora_path": name} for name in names]
