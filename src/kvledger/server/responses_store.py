"""The bounded store ``previous_response_id`` reads: the last responses created with ``store``, each
with its conversation and its owner (a key finds only its own).

A response's conversation (its input, after the previous response's, and its output as assistant
messages) is kept with it, so the next turn's prompt is that conversation plus the new input: the
same tokens the previous prompt began with, which the prefix cache still holds. ``instructions``
are not carried over (OpenAI's rule): each turn's own go first, as a system message.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..errors import NotFoundError, ValidationError


@dataclass
class Stored:
    """A stored response: its object as answered, and its conversation (without instructions)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    owner: str = ""  # the owner tag of the key that created it (auth.Principal.owner): only it finds it


class ResponseStore:
    """The last ``capacity`` responses created with ``store`` (an LRU: reading one keeps it)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, stored: Stored) -> None:
        if self.capacity <= 0:
            return
        self._items[rid] = stored
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str, owner: str, param: str = "previous_response_id") -> Stored:
        """The stored response ``rid`` if ``owner`` created it; to another key it does not exist (the
        same 404 as an unknown id: a tenant never reads, continues or deletes another's)."""
        if not rid.startswith("resp_"):  # not an id this API makes: a malformed value (OpenAI: 400)
            raise ValidationError(f"{param} {rid!r} is not a response id (they begin with 'resp_')", param=param)
        stored = self._items.get(rid)
        if stored is None or stored.owner != owner:
            raise NotFoundError(
                f"no stored response {rid!r} (never stored, store: false, or evicted)", param=param,
                code="response_not_found",
            )  # fmt: skip
        self._items.move_to_end(rid)
        return stored

    def delete(self, rid: str, owner: str) -> None:
        self.get(rid, owner, param="response_id")
        del self._items[rid]
