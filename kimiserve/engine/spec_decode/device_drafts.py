"""Drafts left on the device between the proposer and the target's verify step.

The draft model's drafting loop ends with its drafts on the device. Rather than wait for them on the
host (a synchronisation that leaves the device idle while the host then schedules, prepares and fills
the verify step), the proposer hands back a `DraftRow` per request: the verify step's host-side ids
hold placeholders at the draft positions, and the runner writes the drafts into the step's device
inputs from the device tensor (`write_drafts`). Their copy to the host is queued behind the loop; the
engine reads the values (`DraftRow.values`) after the verify step's sampled tokens came back, when
that copy is long done, and accepts as usual.

Only rows that need nothing of the drafts' values on the host take this path: plain sampling rows
(`SampleRequest.is_plain`: a plain row reads the number of tokens before it, not which), no grammar,
no thinking budget (`runner._draft_states` advances those with the draft tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimiserve.utils.host_copy import queue_host_copy

PLACEHOLDER = -1
"""The host-side id at a draft position whose token is on the device (never fed to a model)."""


@dataclass(eq=False)
class DeviceDrafts:
    """One round's drafts: `tokens` int64 [n, K] on the device, their copy to the host in flight."""

    tokens: torch.Tensor
    host: torch.Tensor
    copied: "torch.cuda.Event | None" = None
    _values: list[list[int]] | None = None

    @classmethod
    def of(cls, tokens: torch.Tensor) -> "DeviceDrafts":
        """Queue the copy of `tokens` to the host (pinned, no wait)."""
        return cls(tokens, *queue_host_copy(tokens))

    def values(self, row: int) -> list[int]:
        """Row `row`'s drafts on the host (waits for the copy the first time: done by then in practice)."""
        if self._values is None:
            if self.copied is not None:
                self.copied.synchronize()
            self._values = self.host.tolist()
        return self._values[row]


@dataclass(eq=False)
class DraftRow:
    """A request's `count` drafts: row `row` of a round's `DeviceDrafts`."""

    source: DeviceDrafts
    row: int
    count: int

    def values(self) -> list[int]:
        return self.source.values(self.row)[: self.count]


def write_drafts(input_ids: torch.Tensor, drafts: tuple[torch.Tensor, list[tuple[int, int, int]]],
                 first_rows) -> None:
    """Write device drafts into a step's device input ids: `drafts` = (the round's tokens flattened,
    [(chunk index j, index of its first draft in them, count)]); chunk j's pending token sits at row
    first_rows(j) of `input_ids` and its drafts follow it."""
    from kimiserve.engine.runner import to_device

    flat, entries = drafts
    dst = [first_rows(j) + 1 + t for j, _, count in entries for t in range(count)]
    src = [start + t for _, start, count in entries for t in range(count)]
    if dst:
        input_ids[to_device(dst, input_ids.device)] = flat[to_device(src, flat.device)]
