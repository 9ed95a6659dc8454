"""The Responses API's stored responses (`store: true`): in the server's memory, bounded, LRU.

Each entry keeps the response object (for GET /v1/responses/{id}) and the items of its own turn
(its input items, then its output items) with the id of the response it continued, so a
conversation of k turns costs its k turns once, not k times; `history` walks the chain back.
Reading an entry (or continuing it) makes it and its ancestors the most recently used.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kimiserve.entrypoints.openai.errors import OpenAIError


@dataclass
class StoredResponse:
    response: dict[str, Any]
    items: list[dict[str, Any]]
    """This turn's input items then its output items (Responses item dicts)."""
    previous_id: str | None
    size: int
    """Estimated bytes (its JSON)."""


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(f"Response with id {response_id!r} not found (responses are kept in this server's memory "
                       f"while it runs, up to --responses-store-mib, least recently used dropped first; a "
                       f"response created with store: false is not kept)", 404, param, "response_not_found")


class ResponseStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response: dict[str, Any], items: list[dict[str, Any]], previous_id: str | None) -> None:
        size = len(json.dumps(response)) + len(json.dumps(items))
        if size > self.max_bytes:
            return  # larger than the whole store: not kept (a later GET is a 404)
        entry = StoredResponse(response, items, previous_id, size)
        self._entries[response["id"]] = entry
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.size

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise not_found(response_id, param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            raise not_found(response_id)
        self.bytes -= entry.size

    def history(self, response_id: str) -> list[dict[str, Any]]:
        """Every item of the conversation up to and including response `response_id`, oldest first;
        a 404 naming previous_response_id when it (or a response it continued) is not stored."""
        chain: list[StoredResponse] = []
        current: str | None = response_id
        seen: set[str] = set()
        while current is not None and current not in seen:
            seen.add(current)
            entry = self._entries.get(current)
            if entry is None:
                if current == response_id:
                    raise not_found(response_id, "previous_response_id")
                raise OpenAIError(f"Response {response_id!r} continues {current!r}, which is no longer stored "
                                  f"(dropped from this server's memory): send the whole conversation as input "
                                  f"instead", 404, "previous_response_id", "response_not_found")
            chain.append(entry)
            current = entry.previous_id
        for entry in chain:  # the conversation is in use: keep its turns longest
            self._entries.move_to_end(entry.response["id"])
        return [item for entry in reversed(chain) for item in entry.items]
