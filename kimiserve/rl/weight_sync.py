"""Pushing new weights into a running engine without a restart.

In process (`sync_weights`): the trainer's tensors are copied into the engine's parameters in place
(same storage, so nothing that holds the parameters needs rebuilding) and the prefix cache is emptied:
cached latents, index keys and KDA states were computed by the old weights. The engine must be idle
(between RL steps), so that no request mixes two policies.

To a server: `POST /update_weights {"path": DIR}` (`kimiserve.entrypoints.openai.rl_routes`) loads the
safetensors file(s) the trainer wrote with `save_weights` and does the same on the engine thread.
A file rather than a collective: it works across machines and processes with no process-group setup
between trainer and server, and the tiny and small models reload in well under a second; a NCCL
broadcast would save the disk round trip for the full-size model, at the cost of both sides joining
one group.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch


def named_weights(source) -> dict[str, torch.Tensor]:
    """A model (its named parameters, routed-expert codes in the checkpoint layout) or a mapping of names
    to tensors (in the checkpoint layout)."""
    if isinstance(source, torch.nn.Module):
        from kimiserve.model.expert_layout import named_checkpoint_tensors

        return named_checkpoint_tensors(source)
    if isinstance(source, Mapping):
        return dict(source)
    raise ValueError(f"weights must be a model or a mapping of parameter names to tensors, got {type(source).__name__}")


def sync_weights(engine, source, names: Iterable[str] | None = None) -> int:
    """Copy `source`'s tensors (all, or those in `names`) into the engine's parameters of the same names
    and empty its prefix cache; routed-expert codes (checkpoint layout) are re-laid into the layout the
    engine holds (`model.expert_layout`). `source` is the one-process model (or its tensors): a
    multi-process engine's every rank loads its own part of each tensor (`loader.load_tensors`).
    `engine`: an LLMEngine or an LLM. Returns the number of tensors copied. ValueError (before anything
    is copied) for an unknown name or a shape mismatch; RuntimeError while requests are running."""
    engine = getattr(engine, "engine", engine)
    if engine.has_unfinished_requests():
        raise RuntimeError("update weights between steps of an idle engine: requests are still running")
    weights = named_weights(source)
    if names is not None:
        weights = {n: weights[n] for n in names}
    engine.executor.update_weights(weights)
    engine.allocator.evict_all()
    engine.weight_version = getattr(engine, "weight_version", 0) + 1
    return len(weights)


WEIGHTS_FILE = "model.safetensors"


def save_weights(source, path: str) -> str:
    """Write `source`'s tensors (a model or a mapping) to DIR/model.safetensors for `/update_weights`."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    file = os.path.join(path, WEIGHTS_FILE)
    save_file({n: t.detach().contiguous().cpu() for n, t in named_weights(source).items()}, file)
    return file


def load_weights(path: str) -> dict[str, torch.Tensor]:
    """The tensors `save_weights` wrote (path: the folder or the file). ValueError when missing."""
    from safetensors.torch import load_file

    file = os.path.join(path, WEIGHTS_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"no weights at {path!r}: give a folder holding {WEIGHTS_FILE} or a .safetensors file")
    return load_file(file)
