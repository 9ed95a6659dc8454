"""A Worker is one rank's share of the engine: its model shard, its page pool and its model runner.

The engine (rank 0) owns the scheduler and the allocator; every rank owns a pool with the same
page count and page ids (so one allocator's decisions address every rank's pool) and runs the
step's forward on its shard. At world size 1 the engine's only worker lives in its process.
"""

from __future__ import annotations

import math

import torch

from kimiserve.cache.layout import CacheLayout
from kimiserve.cache.pool import PagePool
from kimiserve.config import ModelConfig
from kimiserve.distributed.parallel_state import ParallelContext
from kimiserve.engine.args import EngineArgs, pages_for_budget
from kimiserve.engine.runner import ModelRunner
from kimiserve.engine.sampler import Sampler
from kimiserve.model.loader import load_model


def uses_cuda_graphs(device: torch.device, args: EngineArgs) -> bool:
    return device.type == "cuda" and not args.enforce_eager


class Worker:
    """Build with the engine's args and this rank's ParallelContext; then `init_cache(num_pages)`
    once every rank agreed on the page count."""

    def __init__(self, args: EngineArgs, parallel: ParallelContext, eos_token_id: int | None,
                 config: ModelConfig | None = None):
        self.args, self.parallel = args, parallel
        self.device = parallel.device
        self.dtype = args.resolved_dtype(self.device)
        self.config = config or args.model_config()
        kv_dtype = args.resolved_kv_cache_dtype(self.device)
        self.model = load_model(args.model, self.dtype, args.seed, self.device, parallel, self.config)
        self.layout = CacheLayout.from_config(self.model.cache_config, kv_dtype, self.dtype, args.block_size,
                                              args.index_key_rotation)
        self.eos_token_id = eos_token_id
        self.pool: PagePool | None = None
        self.runner: ModelRunner | None = None

    @property
    def block_size(self) -> int:
        """Tokens per page of a block table: the pool's pages, or under DCP virtual pages of dcp of them
        (page j of a sequence's table holds its share of tokens [j x dcp x bs, (j + 1) x dcp x bs) on each rank)."""
        return self.layout.block_size * self.parallel.dcp_size

    def budget_pages(self) -> int:
        """Pages this rank's cache budget holds (args.num_pages when given)."""
        return self.args.num_pages or pages_for_budget(self.args.cache_budget_bytes(self.device), self.layout.page_bytes)

    def init_cache(self, num_pages: int, max_model_len: int) -> None:
        """The pool (plus the CUDA graphs' padding pages past the allocator's) and the runner."""
        num_state = len(self.config.kda_layers)
        use_graphs = uses_cuda_graphs(self.device, self.args) and self.parallel.dcp_size == 1  # DCP: eager for now
        reserved = 1 + num_state if use_graphs else 0
        self.pool = PagePool(self.layout, num_pages + reserved, self.device)
        self.runner = ModelRunner(self.model, self.pool, Sampler(self.args.seed, self.args.batch_invariant),
                                  self.eos_token_id, batch_invariant=self.args.batch_invariant)
        if use_graphs:
            from kimiserve.engine.cuda_graphs import DecodeGraphs

            pad_states = torch.arange(num_pages + 1, num_pages + reserved, dtype=torch.int64)
            invariant = self.runner.invariant
            self.runner.graphs = DecodeGraphs(self.model, self.pool, self.runner.ops, self.args.max_num_seqs,
                                              max_model_len, num_pages, pad_states,
                                              forward=invariant.forward_batch if invariant is not None else None)
            spec = self.args.speculative()
            if spec is not None:
                from kimiserve.engine.spec_decode.verify_graphs import VerifyGraphs

                self.runner.verify_graphs = VerifyGraphs(self.model, self.pool, self.runner.ops, self.args.max_num_seqs,
                                                         max_model_len, num_pages, pad_states,
                                                         spec.num_speculative_tokens + 1)
        spec = self.args.speculative()
        if spec is not None:
            self.runner.plan_verify_slots(spec.num_speculative_tokens + 1, self.args.max_num_seqs)

    def update_weights(self, tensors) -> None:
        """Load one-process-named tensors into this rank's shard (`loader.load_tensors`); the captured graphs
        are dropped when a routed-expert layer changed its code layout (they captured the old decode)."""
        from kimiserve.model.loader import load_tensors

        if load_tensors(self.model, tensors) and self.runner is not None:
            self.runner.forget_graphs()


def pages_needed(max_model_len: int, block_size: int, num_state: int) -> int:
    """Pages one sequence of max_model_len tokens, its state pages and one copy-on-write page need."""
    return math.ceil(max_model_len / block_size) + 2 * num_state + 1
