"""How reasoning models mark their reasoning (``--reasoning-parser``, SGLang's names), shared by the
front (which splits the text: ``server/reasoning.py``) and the engine (which starts a request's grammar
after the end marker: ``constrained/reasoning.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import REASONING_PARSERS


@dataclass(frozen=True)
class ReasoningFormat:
    """One family's markers and when its output begins with reasoning."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    # The chat-template argument that turns thinking off when false (Qwen3's enable_thinking); None:
    # the model always reasons (DeepSeek-R1, whose template pre-fills ``<think>``).
    toggle: str | None = None
    # A marker that ends the reasoning without ``end`` and stays in the answer (Qwen3 may open a tool
    # call straight from its reasoning).
    tool_start: str | None = None

    def thinking(self, template_kwargs: dict[str, Any] | None) -> bool:
        """Whether a chat request's output begins with reasoning (SGLang's ``require_reasoning``):
        always without a toggle; with one, unless the request sets it to false."""
        if self.toggle is None:
            return True
        return (template_kwargs or {}).get(self.toggle) is not False


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat("deepseek-r1"),
    "qwen3": ReasoningFormat("qwen3", toggle="enable_thinking", tool_start="<tool_call>"),
}
if tuple(REASONING_FORMATS) != REASONING_PARSERS:
    raise TypeError("a --reasoning-parser value without its format")
