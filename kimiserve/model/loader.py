"""Checkpoints in the release format: sharded safetensors + model.safetensors.index.json.

One table, `checkpoint_layout`, says which checkpoint tensor feeds which parameter (and which
expert slice of it); the writer, the loader and random init (`init_random_weights`, a virtual
checkpoint) all walk it, so they cannot disagree. Each parameter carries its own `weight_loader`,
which reads only the rank's slice of the memory-mapped tensor (a safetensors slice object): a
tensor-parallel rank never materialises a sharded tensor whole.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kimiserve.config import RANDOM_PRESETS, ModelConfig, load_preset, model_folder
from kimiserve.distributed.parallel_state import ParallelContext
from kimiserve.model.expert_layout import weights_written
from kimiserve.model.model import KimiForCausalLM, build_model
from kimiserve.model.moe import RoutedExperts

INDEX_FILE = "model.safetensors.index.json"
# tensors of a release that the text model does not use
IGNORED = re.compile(r"^(vision_tower\.|mm_projector\.|multi_modal_projector\.)|rotary_emb\.")


@dataclass
class Entry:
    """One checkpoint tensor and the parameter (slice) it loads into."""

    name: str
    param_name: str
    expert: int | None = None
    """The slice of a stacked expert parameter: the index among this rank's experts."""
    to_checkpoint: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    remote: bool = False
    """A routed expert another expert-parallel rank holds: known, not loaded here."""


def _a_log_writer(config: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    if config.is_k3:  # K3 releases zero-pad A_log to a multiple of 128 entries
        return lambda t: torch.nn.functional.pad(t, (0, (-t.numel()) % 128))
    return lambda t: t.view(1, 1, -1, 1)  # Kimi-Linear: [1, 1, H, 1]


def checkpoint_layout(model: KimiForCausalLM) -> Iterator[Entry]:
    config = model.config
    prefix = config.weight_prefix
    for pname, param in model.named_parameters():
        if pname.startswith("model.") and ".experts." in pname:
            base, leaf = pname.rsplit(".", 1)  # leaf: w1 | w1_packed | w1_scale
            proj, _, kind = leaf.partition("_")
            suffix = {"": "weight", "packed": "weight_packed", "scale": "weight_scale"}[kind]
            local = {e: i for i, e in enumerate(model.get_submodule(base).expert_ids)}
            for e in range(param.full_shape[0]):
                name = f"{prefix}{base}.{e}.{proj}.{suffix}"
                yield Entry(name, pname, local[e]) if e in local else Entry(name, pname, remote=True)
        elif pname.endswith(".A_log"):
            yield Entry(prefix + pname, pname, to_checkpoint=_a_log_writer(config))
        elif "conv1d" in pname:
            yield Entry(prefix + pname, pname, to_checkpoint=lambda t: t.unsqueeze(1))
        else:
            yield Entry(prefix + pname, pname)


def save_checkpoint(model: KimiForCausalLM, folder: str | os.PathLike, max_shard_bytes: int = 2 << 30) -> list[str]:
    """Write config.json, the safetensors shards and the index. Returns the shard file names."""
    if model.parallel.world_size > 1:
        raise ValueError("save_checkpoint writes a one-process model; this one is a shard of tensor_parallel_size "
                         f"{model.parallel.tp_size} (build the model without `parallel` to write a checkpoint)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for entry in checkpoint_layout(model):
        param = params[entry.param_name]
        if entry.param_name.endswith("_packed"):  # MXFP4 codes: the checkpoint layout whatever the model holds
            base, leaf = entry.param_name.rsplit(".", 1)
            tensor = model.get_submodule(base).checkpoint_codes(leaf.removesuffix("_packed"), entry.expert)
        else:
            tensor = param.data if entry.expert is None else param.data[entry.expert]
        tensor = entry.to_checkpoint(tensor).contiguous().clone()
        nbytes = tensor.numel() * tensor.element_size()
        if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][entry.name] = tensor
        sizes[-1] += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    with open(folder / INDEX_FILE, "w") as f:
        json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(folder / "config.json", "w") as f:
        json.dump(model.config.to_hf_config(), f, indent=2)
    return names


def _checkpoint_files(folder: Path) -> dict[str, str]:
    """Tensor name -> shard file, from the index (or the single model.safetensors)."""
    index = folder / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            return json.load(f)["weight_map"]
    single = folder / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise ValueError(f"{folder} has neither {INDEX_FILE} nor model.safetensors")


def load_weights(model: KimiForCausalLM, folder: str | os.PathLike) -> None:
    """Fill every parameter of `model` from the checkpoint in `folder` (memory-mapped reads).

    Each parameter's `weight_loader` gets the tensor as a safetensors slice and reads only its rank's
    part (`get_slice`, never `get_tensor`). Raises ValueError naming missing tensors, unexpected
    tensors and shape mismatches. Routed-expert codes land in the layout their layer holds
    (`expert_layout.weights_written`).
    """
    folder = Path(folder)
    layout = {e.name: e for e in checkpoint_layout(model)}
    params = dict(model.named_parameters())
    weight_map = _checkpoint_files(folder)
    unexpected = [n for n in weight_map if n not in layout and not IGNORED.search(n.removeprefix(model.config.weight_prefix))]
    if unexpected:
        shown = ", ".join(sorted(unexpected)[:8])
        raise ValueError(f"{len(unexpected)} checkpoint tensors match no parameter of this config: {shown}")
    missing = sorted(n for n, e in layout.items() if not e.remote and n not in weight_map)
    if missing:
        shown = ", ".join(missing[:8])
        raise ValueError(f"checkpoint {folder} lacks {len(missing)} tensors the model needs: {shown}")
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        if name in layout and not layout[name].remote:
            by_file.setdefault(fname, []).append(name)
    for fname, names in sorted(by_file.items()):
        with safe_open(str(folder / fname), framework="pt") as f:
            for name in names:
                entry = layout[name]
                param = params[entry.param_name]
                source = f.get_slice(name)
                if entry.expert is None:
                    param.weight_loader(param, source, name)
                else:
                    param.weight_loader(param, source, name, entry.expert)
    weights_written(model, params)


def check_tensors(model: KimiForCausalLM, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.nn.Parameter]:
    """ValueError unless every name is a parameter of `model` and every tensor has that parameter's full
    (one-process) shape: `load_tensors`' input checks, alone (a multi-process engine runs them on rank 0
    before any rank writes). Returns the model's parameters by name."""
    params = dict(model.named_parameters())
    for name, value in tensors.items():
        if name not in params:
            raise ValueError(f"the engine's model has no parameter {name!r}")
        if tuple(value.shape) != tuple(params[name].full_shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)}, the engine's parameter is "
                             f"{tuple(params[name].full_shape)}")
    return params


def load_tensors(model: KimiForCausalLM, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Tensors named as the one-process model's parameters (routed-expert codes in the checkpoint layout, as
    `expert_layout.named_checkpoint_tensors` gives them) into `model`, which may be one rank's shard: each
    parameter's `weight_loader` copies its rank's part in place; a stacked expert parameter takes the
    slices of the experts this rank holds. Everything is checked (`check_tensors`) before anything is
    written. Returns whether a routed-expert layer changed its code layout (`expert_layout.weights_written`)."""
    params = check_tensors(model, tensors)
    with torch.no_grad():
        for name, value in tensors.items():
            param = params[name]
            experts = model.get_submodule(name.rpartition(".")[0])
            if isinstance(experts, RoutedExperts):
                for local, e in enumerate(experts.expert_ids):
                    param.weight_loader(param, value[e], name, local)
            else:
                param.weight_loader(param, value, name)
    return weights_written(model, tensors)


def load_model(
    model: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: str | torch.device = "cpu",
    parallel: ParallelContext | None = None, config: ModelConfig | None = None,
) -> KimiForCausalLM:
    """A random-weight preset (weights from `seed`), a trained preset or a model folder (weights from its
    checkpoint); with `parallel`, this rank's shard of it. `config`: the configuration to build when it is
    not the preset's or folder's own (`EngineArgs.model_overrides`; a checkpoint must still match it)."""
    if str(model) in RANDOM_PRESETS:
        return build_model(config or load_preset(str(model)), dtype, seed, device, parallel)
    folder = model_folder(model)
    if folder is None:
        raise ValueError(f"model {str(model)!r} is neither a preset nor a model folder")
    config = config or ModelConfig.from_pretrained(folder)
    net = build_model(config, dtype, seed=None, device=device, parallel=parallel)
    load_weights(net, folder)
    return net
