"""LoRA adapters: served per request (several and the base in one batch) and trained by the trainer forward."""

from kimiserve.lora.adapter import DEFAULT_TARGETS, LoRAAdapter
from kimiserve.lora.batch import LoRABatch, lora_reference

__all__ = ["DEFAULT_TARGETS", "LoRAAdapter", "LoRABatch", "lora_reference"]
