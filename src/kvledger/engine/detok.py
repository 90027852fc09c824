"""Turning output ids into text: stop tokens and stop strings cut, special tokens skipped, and never
half a UTF-8 character or part of a stop string that may still be cut while streaming."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..scheduler.request import FinishReason


@dataclass
class TextState:
    """Incremental detokenization of one request."""

    tokenizer: Any
    skip_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    text: str = ""  # the text that is safe to show so far

    def update(self, output_ids: list[int], finish: FinishReason | None) -> str:
        """Recompute the visible text for ``output_ids``; returns it (also kept in ``self.text``)."""
        if self.tokenizer is None:
            return ""
        ids = output_ids
        if finish is not None and finish.type == "stop" and isinstance(finish.matched, int) and ids:
            ids = ids[:-1]  # the stop token itself is not text
        full = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        cut = len(full)
        for s in self.stop:
            i = full.find(s)
            if i != -1:
                cut = min(cut, i)
        if cut < len(full):
            self.text = full[:cut]
            return self.text
        if finish is None:
            # Hold back a trailing replacement char (an incomplete multi-byte character) and any tail
            # that is the start of a stop string, since the next tokens may complete either.
            while full.endswith("\ufffd"):
                full = full[:-1]
            hold = 0
            for s in self.stop:
                for k in range(min(len(s) - 1, len(full)), 0, -1):
                    if full.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            full = full[: len(full) - hold]
            # Never take back text already shown.
            if len(full) < len(self.text) or not full.startswith(self.text):
                return self.text
        self.text = full
        return self.text
