"""Turning output ids into text: never half a UTF-8 character, and never text that a stop string
may still cut while streaming.

Stop strings are the engine's: it detects them (``scheduler/stop.py``) and ends the request with
the matched string (a stop_regex: the text it matched) in its finish reason. This module only
renders: the final text is cut where that string starts, at the occurrence the last token completed;
while streaming, text from the first occurrence (or a possible start) of a stop string on is held
back, since the engine may be about to end there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..common import FinishReason


@dataclass
class TextState:
    """Incremental detokenization of one request."""

    tokenizer: Any
    skip_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    trim_stop: bool = True  # False: the final text keeps the stop string or token (``no_stop_trim``)
    text: str = ""  # the text that is safe to show so far

    def update(self, output_ids: list[int], finish: FinishReason | None) -> str:
        """Recompute the visible text for ``output_ids``; returns it (also kept in ``self.text``)."""
        if self.tokenizer is None:
            return ""
        ids = output_ids
        trim = finish is not None and finish.type == "stop" and self.trim_stop
        if trim and isinstance(finish.matched, int) and ids:
            ids = ids[:-1]  # the stop token itself is not text
        full = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        if finish is not None:
            cut = finish.matched_text if finish.matched_text is not None else finish.matched
            if trim and isinstance(cut, str) and cut:
                full = full[: self._stop_start(ids, full, cut)]
            self.text = full
            return full
        self.text = self._safe_prefix(full)
        return self.text

    def _stop_start(self, ids: list[int], full: str, cut: str) -> int:
        """Where the stop that ended the request starts in ``full``: the occurrence of ``cut`` that
        the last token completed (an earlier one did not end it: a regex's context, as ``\\bor\\b``
        after "for", made it no match), else the last one; the whole text if there is none (a stop
        string that is a special token the text skips)."""
        prev = self.tokenizer.decode(ids[:-1], skip_special_tokens=self.skip_special_tokens).rstrip("\ufffd")
        i = full.find(cut, max(0, len(prev) - len(cut) + 1))
        i = full.rfind(cut) if i == -1 else i
        return len(full) if i == -1 else i

    def _safe_prefix(self, full: str) -> str:
        cut = min([i for i in (full.find(s) for s in self.stop) if i != -1], default=len(full))
        full = full[:cut]
        # Hold back a trailing replacement char (an incomplete multi-byte character) and any tail
        # that is the start of a stop string: the next tokens may complete either.
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
        return full
