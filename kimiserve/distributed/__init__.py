"""Scale-out on torch.distributed (DESIGN.md section 4): one scheduler, many workers.

Layout of the ranks (`ParallelConfig`, `parallel_state.py`). World size W = tp x pcp; rank r has
tp_rank = r % tp and pcp_rank = r // tp.

- Tensor parallel (TP, size tp): KDA heads, MLA heads (q_b / q, kv_b, g, o), the dense MLP, the
  shared experts and the latent-MoE down/up projections are split column/row-wise over the TP group
  with one all-reduce per sublayer output; the embedding and lm_head are vocab-parallel (rows padded
  to a multiple of tp); the router, the norms, the MLA latent down-projections (q_a, kv_a), the KDA
  low-rank down-projections (f_a, g_a), the attention-residual projections and the whole indexer
  (replicated: the score of a token sums over all index heads, so sharding heads would all-reduce a
  score row per query per layer) are replicated. Every parameter's `weight_loader` reads only its
  rank's slice of the memory-mapped checkpoint tensor.
- Expert parallel (EP, `enable_expert_parallel`): the routed experts are split over the TP group
  instead of being TP-sharded, by an expert-placement table; tokens are already on every rank of the
  group (TP attention), so a rank runs its experts on the pairs routed to them and the partial
  outputs are summed (all-reduce / reduce-scatter).
- Decode context parallel (DCP, size dcp, dividing tp): the TP group is cut into tp / dcp DCP groups
  of dcp consecutive ranks; the ranks of a DCP group hold different tokens of every sequence
  (token p on DCP rank (p // I) % dcp, I the page-aligned interleave) and write only their own; per
  MLA layer each rank scans its own index keys, keeps a local top-k, the ranks exchange (score,
  token id) candidates only and take the global top-k with the single-device comparator and tie
  rule, each attends over the selected tokens it owns and the partial outputs merge by log-sum-exp.
  KDA state is sharded by heads (TP) and not split by tokens.
- Prefill context parallel (PCP, size pcp): the PCP ranks hold the same weights (each its TP shard)
  and split a long prompt into contiguous chunks; MLA layers see every earlier token (gathered
  latents and index keys), KDA layers fold the earlier chunks' states in order.

The engine (scheduler, sampler, detokenizer) lives in rank 0's process and drives every rank
through an `Executor` (`executor.py`): world size 1 is the same code with one in-process worker.
No module keeps process-global state: a `ParallelContext` is passed to whatever needs the groups.
"""
