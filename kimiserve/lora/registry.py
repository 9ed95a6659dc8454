"""The engine's loaded LoRA adapters: names, ids (the prefix-cache salt), slots of a step's batch.

In the batch-invariant forward a step's adapters go in a `LoRABatch`; in the default forward each loaded
adapter keeps a slot of the `ServingLoRA` buffers (1..max_loras) while it is loaded, and a step's rows
get a `LoRARows`."""

from __future__ import annotations

import itertools

import torch

from kimiserve.lora.adapter import LoRAAdapter
from kimiserve.lora.batch import LoRABatch, small_tensor
from kimiserve.lora.serving import LoRARows, ServingLoRA


class LoRARegistry:
    def __init__(self, model, max_loras: int, max_rank: int, batch_invariant: bool = True):
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.by_name: dict[str, LoRAAdapter] = {}
        self.ids: dict[str, int] = {}
        self._next_id = itertools.count(1)
        self.serving = None if batch_invariant else ServingLoRA(model, max_loras, max_rank)
        """The default forward's slot buffers (None in the batch-invariant mode)."""
        self.slots: dict[str, int] = {}
        """Default forward: each loaded adapter's slot (1..max_loras)."""

    def names(self) -> list[str]:
        return list(self.by_name)

    def id_of(self, name: str) -> int:
        if name not in self.ids:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: {', '.join(self.by_name) or 'none'})")
        return self.ids[name]

    def load(self, name: str, source: str | LoRAAdapter) -> LoRAAdapter:
        """Load from a PEFT folder or take an adapter object (copied: the caller keeps training its own)."""
        if name in self.by_name:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded: unload it first")
        if len(self.by_name) >= self.max_loras:
            raise ValueError(f"{self.max_loras} LoRA adapters are loaded already (max_loras): unload one first")
        if isinstance(source, LoRAAdapter):
            adapter = source.detached_copy(name)
        else:
            adapter = LoRAAdapter.from_pretrained(source, self.model, name)
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {adapter.rank} > max_lora_rank {self.max_rank}")
        device = self.model.lm_head_weight.device
        adapter.weights = {k: (a.to(device), b.to(device)) for k, (a, b) in adapter.weights.items()}
        adapter.expert_weights = {k: (a.to(device), b.to(device)) for k, (a, b) in adapter.expert_weights.items()}
        if self.serving is not None:
            slot = min(set(range(1, self.max_loras + 1)) - set(self.slots.values()))
            self.serving.write(slot, adapter)
            self.slots[name] = slot
        self.by_name[name], self.ids[name] = adapter, next(self._next_id)
        return adapter

    def unload(self, name: str) -> None:
        self.id_of(name)
        del self.by_name[name], self.ids[name]
        if self.serving is not None:
            self.serving.clear(self.slots.pop(name))

    def update(self, adapter: LoRAAdapter) -> int:
        """New values for the loaded adapter of adapter.name; it gets a new id (old cache entries never hit)."""
        self.id_of(adapter.name)
        self.by_name[adapter.name].copy_from(adapter)
        if self.serving is not None:
            self.serving.write(self.slots[adapter.name], self.by_name[adapter.name])
        self.ids[adapter.name] = next(self._next_id)
        return self.ids[adapter.name]

    def slot_list(self, lora_ids: list[int]) -> list[int]:
        """Default forward: the slot of each of these adapter ids (0: the base model)."""
        if not any(lora_ids):
            return [0] * len(lora_ids)
        by_id = {i: self.slots[n] for n, i in self.ids.items()}
        missing = sorted({i for i in lora_ids if i and i not in by_id})
        if missing:
            raise ValueError(f"LoRA adapter ids {missing} are no longer loaded")
        return [by_id[i] if i else 0 for i in lora_ids]

    def rows(self, chunk_ids: list[int], chunk_lengths: list[int], device) -> LoRARows | None:
        """Default forward: the LoRARows of an eager step's packed rows (chunks' adapter ids and lengths);
        None when no chunk runs an adapter."""
        if not any(chunk_ids):
            return None
        slots = self.slot_list(chunk_ids)
        return LoRARows.of([s for s, n in zip(slots, chunk_lengths) for _ in range(n)], self.serving.ranks, device)

    def batch(self, row_ids: list[int], device) -> LoRABatch | None:
        """The LoRABatch of a step whose packed rows carry these adapter ids (0: base); None if all base."""
        if not any(row_ids):
            return None
        by_id = {i: self.by_name[n] for n, i in self.ids.items()}
        used = sorted(set(row_ids) - {0})
        missing = [i for i in used if i not in by_id]
        if missing:
            raise ValueError(f"LoRA adapter ids {missing} are no longer loaded")
        slot = {i: s for s, i in enumerate(used)}
        rows = small_tensor([slot[i] if i else -1 for i in row_ids], torch.int64, device)
        return LoRABatch([by_id[i] for i in used], rows)
