"""Guided decoding (structured outputs): specs, the grammar library, the engine's grammar states, and
the Kimi tool-call grammar. Only `params` is imported eagerly (no grammar library needed)."""

from kimiserve.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
