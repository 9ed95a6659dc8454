"""kimiserve: an inference engine for the Kimi-K3.1 model family.

    from kimiserve import LLM, SamplingParams

The top-level names load lazily (module `__getattr__`), so `import kimiserve.config` and the other
submodules stay cheap and free of import cycles.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "EngineArgs", "StructuredOutputsParams"]

_EXPORTS = {
    "LLM": "kimiserve.entrypoints.llm",
    "SamplingParams": "kimiserve.sampling_params",
    "EngineArgs": "kimiserve.engine.args",
    "StructuredOutputsParams": "kimiserve.structured_output.params",
}

if TYPE_CHECKING:
    from kimiserve.engine.args import EngineArgs
    from kimiserve.entrypoints.llm import LLM
    from kimiserve.sampling_params import SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kimiserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
