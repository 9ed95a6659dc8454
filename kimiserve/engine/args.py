"""Engine arguments: one typed dataclass; the field docstrings are the CLI help."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass

import torch

from kimiserve.cache.formats import check_kv_cache_dtype
from kimiserve.config import model_folder
from kimiserve.utils.docs import field_docs

CPU_DEFAULT_CACHE_GIB = 1.0


@dataclass
class EngineArgs:
    model: str = "kimi-demo"
    """A preset or a checkpoint folder: kimi-demo (the default: a small trained model that chats, reasons
    and calls tools), or tiny, small, kimi-k3.1-pro (random weights from `seed`, for tests and sizing)."""
    model_overrides: dict | str | None = None
    """ModelConfig fields to change after the model's configuration is read, as a JSON object (vLLM's
    hf_overrides in kimiserve's field names, 0-based layer indices), e.g. {"num_hidden_layers": 4,
    "full_attn_layers": [3]}: a layer subset of a random-weight preset; a checkpoint must still match."""
    tokenizer: str | None = None
    """Tokenizer folder (default: the model folder; kimi-demo and tiny have their own). small and
    kimi-k3.1-pro have none: give token ids as prompts."""
    device: str = "auto"
    """cpu or cuda[:N]; auto picks cuda when present."""
    dtype: str = "auto"
    """Model dtype: float32 or bfloat16; auto is bfloat16 on GPU and float32 on CPU."""
    seed: int = 0
    """Seed of preset weights and of sampling for requests without their own seed."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output) in tokens; default: the model's context length."""
    max_num_seqs: int = 256
    """Most sequences running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step; longer prompts are prefilled in chunks."""
    kv_cache_dtype: str = "auto"
    """Cache dtype of MLA latents and index keys: bf16, fp8 (e4m3) or fp4 (NVFP4 latents, MXFP4 index keys:
    1.8x the tokens of fp8), or LATENT+KEY to mix them (e.g. fp8+fp4); auto is fp8 on GPU, bf16 on CPU."""
    index_key_rotation: bool | None = None
    """Store index keys rotated by a Hadamard matrix (spreads outlier channels before quantisation; the
    scan rotates its queries to match); default: on for fp4 index keys, off otherwise."""
    block_size: int | None = None
    """Tokens per attention page (a multiple of 64); default: the smallest that holds a KDA state page."""
    num_pages: int | None = None
    """Pages in the cache pool; overrides the memory budget below."""
    kv_cache_memory_gib: float | None = None
    """Cache pool size in GiB; default: from gpu_memory_utilization on GPU, 1 GiB on CPU."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may use (weights + cache) when no cache size is given."""
    enable_prefix_caching: bool = True
    """Reuse cached prefixes (pages + KDA state snapshots at prompt and request ends)."""
    batch_invariant: bool = False
    """Make each sequence's logits and logprobs bit-identical whatever else is in the batch, however it is
    chunked, cached or preempted (fixed reduction orders: `kimiserve.rl.forward`), and equal to the
    trainer forward's (`kimiserve.rl.trainer`); slower (benchmarks/batch_invariant.py); one process only."""
    enable_lora: bool = False
    """Serve LoRA adapters (chosen per request by model name; several and the base model in one batch,
    through grouped LoRA matmuls; `kimiserve.lora.serving` in the default forward, the batch-invariant forward's
    own with batch_invariant). One rank, no speculative decoding."""
    lora_modules: str | None = None
    """LoRA adapters to load at start, NAME=PATH pairs separated by commas (or spaces, quoted; PATH: a PEFT folder
    with adapter_config.json and adapter_model.safetensors); implies enable_lora."""
    max_loras: int = 8
    """Most LoRA adapters loaded at once (the default forward keeps max_loras + 1 slots of max_lora_rank in
    every projection an adapter covers)."""
    max_lora_rank: int = 64
    """Largest LoRA rank accepted."""
    enforce_eager: bool = False
    """Run decode steps eagerly instead of replaying CUDA graphs (CUDA only; a graph is captured the first
    time a padded batch size and context bucket occur)."""
    async_scheduling: bool | None = None
    """Schedule and launch each decode step while the device still runs the previous one, its tokens
    fed from the device (vLLM's async scheduling; the same tokens, the host's work hidden behind the
    device's). Steps of plain decodes only (no grammar, drafts, logprobs, penalties, bans or thinking
    budget); others run as before. Default: on with CUDA on one rank, off on the CPU."""
    tensor_parallel_size: int = 1
    """Ranks (GPUs, or CPU processes) that split the heads, dense MLPs and vocabulary, one process each."""
    enable_expert_parallel: bool = False
    """Split the routed experts over the tensor-parallel ranks instead of sharding every expert."""
    decode_context_parallel_size: int = 1
    """Ranks of the tensor-parallel group that split every sequence's attention pages (must divide
    tensor_parallel_size): each holds 1/DCP of the tokens, an exact top-k merge keeps the results equal."""
    prefill_context_parallel_size: int = 1
    """Copies of the tensor-parallel group that split long prompts into contiguous chunks (token-sharded
    prefill); the world size is tensor_parallel_size x this."""
    run_one_rank: bool = False
    """Benchmarks only: build rank 0 of the tensor/expert-parallel layout and run it alone on this process's
    device, each collective replaced by a local op of its output's shape (all-reduce: the rank's own
    partial sum; all-gather: its block repeated): one rank's compute and memory traffic without the
    communication. The outputs are not the model's."""
    nnodes: int = 1
    """Hosts the ranks are spread over (each runs `kimiserve serve ... --node-rank R`)."""
    node_rank: int = 0
    """This host's index among the nnodes (0 runs the engine and the API server)."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where the ranks meet (torch.distributed's TCP rendezvous)."""
    master_port: int = 29555
    """Port of that rendezvous on node 0."""
    distributed_timeout: float = 300.0
    """Seconds a collective may wait for the other ranks before the engine declares them hung and stops."""
    speculative_config: dict | str | None = None
    """Speculative decoding, as a JSON object (vLLM's shape): {"method": "ngram", "num_speculative_tokens": K,
    "prompt_lookup_max": N, "prompt_lookup_min": M} or {"method": "draft_model", "model": PATH,
    "num_speculative_tokens": K}; off when unset."""

    def validate(self) -> None:
        def positive(name):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_pages", "block_size"):
            positive(name)
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.kv_cache_dtype != "auto":
            check_kv_cache_dtype(self.kv_cache_dtype)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        for name in ("nnodes",):
            positive(name)
        world = self.parallel_config()
        world.validate()
        if self.batch_invariant and world.world_size > 1:
            raise ValueError("batch_invariant runs in one process: leave tensor_parallel_size and "
                             "prefill_context_parallel_size at 1")
        if (self.enable_lora or self.lora_modules) and world.world_size * self.decode_context_parallel_size > 1:
            raise ValueError("LoRA adapters run on one rank for now: leave tensor_parallel_size, "
                             "prefill_context_parallel_size and decode_context_parallel_size at 1 with "
                             "enable_lora / lora_modules")
        if (self.enable_lora or self.lora_modules) and self.speculative_config is not None:
            raise ValueError("speculative_config with LoRA adapters is not supported yet: drop one of them")
        for name in ("max_loras", "max_lora_rank"):
            positive(name)
        self.lora_module_paths()
        if self.batch_invariant and self.speculative_config is not None:
            raise ValueError("batch_invariant does not run speculative decoding yet: drop speculative_config")
        if world.world_size % self.nnodes:
            raise ValueError(f"the world size ({world.world_size} = tensor_parallel_size x "
                             f"prefill_context_parallel_size) must be a multiple of nnodes ({self.nnodes})")
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank!r}")
        if not isinstance(self.master_port, int) or not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port!r}")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0, got {self.distributed_timeout}")
        self.speculative()
        if self.parsed_model_overrides():
            self.model_config()  # unknown fields, values that make no model
        if self.run_one_rank and (self.tensor_parallel_size == 1 or world.world_size != self.tensor_parallel_size
                                  or self.decode_context_parallel_size != 1 or self.nnodes != 1):
            raise ValueError("run_one_rank runs rank 0 of a tensor(/expert)-parallel layout alone: give "
                             "tensor_parallel_size > 1 and leave decode_context_parallel_size, "
                             "prefill_context_parallel_size and nnodes at 1")
        if self.async_scheduling and world.world_size > 1 and not self.run_one_rank:
            raise ValueError("async_scheduling runs on one rank for now: leave it unset (or off) with "
                             "tensor_parallel_size or prefill_context_parallel_size > 1")
        if world.world_size > 1 and not self.run_one_rank and self.resolved_device().type == "cuda":
            per_node, have = world.world_size // self.nnodes, torch.cuda.device_count()
            if per_node > have:
                raise ValueError(f"{per_node} ranks per node need {per_node} GPUs, this host has {have}: lower "
                                 f"tensor_parallel_size / prefill_context_parallel_size or add nodes (nnodes)")

    def speculative(self):
        """The parsed `spec_decode.config.SpeculativeConfig`, or None when speculation is off (ValueError
        for a bad config or one combined with what speculation does not support yet)."""
        if self.speculative_config is None:
            return None
        from kimiserve.engine.spec_decode.config import SpeculativeConfig

        config = SpeculativeConfig.from_user(self.speculative_config)
        for name in ("tensor_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size", "nnodes"):
            if getattr(self, name) != 1:
                raise ValueError(f"speculative decoding runs on one rank for now: {name}={getattr(self, name)} "
                                 f"with speculative_config is not supported (set {name}=1 or drop speculative_config)")
        if self.batch_invariant:  # its forward (kimiserve.rl.forward) has no verify chunks or KDA replay yet
            raise ValueError("speculative_config with batch_invariant is not supported yet: drop one of them")
        return config

    def lora_module_paths(self) -> dict[str, str]:
        """lora_modules parsed: {name: path} (ValueError for an entry that is not NAME=PATH)."""
        out: dict[str, str] = {}
        for item in (self.lora_modules or "").replace(",", " ").split():
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules entries are NAME=PATH, got {item!r}")
            if name in out:
                raise ValueError(f"lora_modules names {name!r} twice")
            out[name] = path
        return out

    def parsed_model_overrides(self) -> dict:
        """model_overrides as a dict (ValueError for JSON that is not an object)."""
        if self.model_overrides is None:
            return {}
        value = self.model_overrides
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"model_overrides is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"model_overrides must be a JSON object of ModelConfig fields, got {value!r}")
        return value

    def model_config(self):
        """The model's `ModelConfig`: the preset's or folder's, with model_overrides applied."""
        from kimiserve.config import apply_overrides, resolve_model

        return apply_overrides(resolve_model(self.model), self.parsed_model_overrides())

    def parallel_config(self):
        """The ranks' layout (`kimiserve.distributed.parallel_state.ParallelConfig`)."""
        from kimiserve.distributed.parallel_state import ParallelConfig

        return ParallelConfig(self.tensor_parallel_size, self.enable_expert_parallel,
                              self.decode_context_parallel_size, self.prefill_context_parallel_size)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but CUDA is not available: use --device cpu")
        return device

    def resolved_async_scheduling(self, device: torch.device) -> bool:
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device.type == "cuda" and (self.parallel_config().world_size == 1 or self.run_one_rank)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def resolved_kv_cache_dtype(self, device: torch.device) -> str:
        if self.kv_cache_dtype == "auto":
            return "fp8" if device.type == "cuda" else "bf16"
        return self.kv_cache_dtype

    def cache_budget_bytes(self, device: torch.device) -> int:
        if self.kv_cache_memory_gib is not None:
            return int(self.kv_cache_memory_gib * 2**30)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return int(free - (1 - self.gpu_memory_utilization) * total)
        return int(CPU_DEFAULT_CACHE_GIB * 2**30)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """One --flag per field, help from the field docstrings."""
        docs = field_docs(EngineArgs)
        for f in dataclasses.fields(EngineArgs):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool, "bool | None"):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=docs[f.name])
                continue
            kind = {"int": int, "int | None": int, "float": float, "float | None": float}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, default=f.default, help=docs[f.name])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def pages_for_budget(budget_bytes: int, page_bytes: int) -> int:
    return max(0, math.floor(budget_bytes / page_bytes))


def tokenizer_source(args: EngineArgs) -> str | None:
    """Where the tokenizer comes from, or None when there is none (random presets other than tiny)."""
    if args.tokenizer is not None:
        return args.tokenizer
    if args.model == "tiny":
        return args.model
    folder = model_folder(args.model)
    return str(folder) if folder is not None else None
