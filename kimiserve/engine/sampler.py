"""Sampler: logits of the batch's last positions -> one token id per row (plus logprobs).

Order per row: hard masks (the grammar's token bitmask, a forced token, allowed_token_ids, bad
words, min_tokens masking of eos / stop_token_ids) -> logit_bias -> penalties -> greedy rows take
the argmax (smallest id among ties) -> other rows: temperature, top-k, top-p, min-p, softmax, one
draw. Logprobs are the log_softmax of the raw model logits (vLLM's default "raw_logprobs"),
whatever the masks and penalties.

Reproducibility: a row with a seed draws from a fresh generator seeded with
`mix_seed(seed, len(output_ids))`, so its tokens do not depend on the batch it runs in and are
the same after a preemption and recompute. Rows without a seed share the Sampler's generator.

Robustness: the sampler serves every request of the batch, so no value that SamplingParams
accepts may make it raise or return a token outside [0, V). top_k is clamped to V (k >= V keeps
every token); a temperature below `SAMPLING_EPS` is greedy; extreme penalties and temperatures
saturate (see `kimiserve/ops/sampling/reference.py`): after the masks and penalties, NaN logits
count as -inf and +inf as the largest finite value, and sampled rows subtract their max before
dividing by the temperature, so a row with one finite logit always has a finite distribution.
A row left with no finite logit (its raw logits, masks or penalties exclude everything) falls
back, deterministically, to the best raw logit among the tokens its hard masks allow (penalties
are then ignored); if they allow no token with a finite raw logit, to the first token they
allow; if they allow none (allowed_token_ids all banned), the masks are relaxed in that order:
allowed_token_ids alone, then every token. The grammar's mask and a forced token count as part of
allowed_token_ids there.

Guided decoding: rows with a grammar (`SampleRequest.grammar`) get their bitmask filled on the host
(`structured_output.manager.fill_bitmask`, into a pinned buffer on CUDA) while the device still runs
the step's forward, copied without blocking and applied on the device (`ops/sampling/bitmask.py`);
the only host transfer of a step stays the sampled ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kimiserve.engine.bad_words import banned_tokens
from kimiserve.ops.sampling import reference as ops
from kimiserve.ops.sampling.bitmask import unpack_bitmask
from kimiserve.sampling_params import SamplingParams
from kimiserve.utils.host_copy import queue_device_copy

_MASK64 = (1 << 64) - 1


@dataclass
class SampleRequest:
    """What the sampler needs to know about one row (one sample of one request)."""

    params: SamplingParams
    """The request's sampling parameters."""
    prompt_ids: list[int]
    """Prompt token ids (for the repetition penalty)."""
    output_ids: list[int]
    """Tokens generated so far by this sample."""
    seed: int | None
    """Seed specific to this sample (e.g. the request seed mixed with the sample index), or None."""
    eos_token_id: int | None
    """The model's eos id, masked while fewer than min_tokens tokens exist (unless ignore_eos)."""
    grammar: Any = None
    """The sample's `RequestGrammar` (guided decoding), or None."""
    forced_token_id: int | None = None
    """A token this row must produce (the thinking budget's `</think>`), or None."""
    pending_tokens: int = 0
    """Tokens this sample drew before this row that `output_ids` does not hold yet (a step scheduled
    while the previous one ran: async scheduling); only plain rows (`is_plain`) may have any."""

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids) + self.pending_tokens

    @property
    def is_plain(self) -> bool:
        """Sampled from the raw logits alone (temperature, top-k, top-p, min-p, seed): no grammar,
        forced token, allowed_token_ids, bad words, min_tokens ban, logit_bias, penalties or logprobs.
        Such rows need nothing from the host (`Sampler.sample_plain`)."""
        p = self.params
        return (self.grammar is None and self.forced_token_id is None and not p.allowed_token_ids
                and not p._bad_words_token_ids and not p.logit_bias and p.logprobs is None
                and p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1
                and (self.num_output_tokens >= p.min_tokens
                     or (not p.stop_token_ids and (self.eos_token_id is None or p.ignore_eos))))


@dataclass
class TokenLogprobs:
    """Logprob of one chosen token and its best alternatives."""

    token_id: int
    """The chosen (sampled or prompt) token."""
    logprob: float
    """Its log-probability under the raw model logits."""
    rank: int
    """1-based rank among the vocabulary (ties: the smaller id ranks better)."""
    top: list[tuple[int, float]]
    """(token id, logprob) of the n best tokens, best first."""


def mix_seed(seed: int, step: int) -> int:
    """A fixed 63-bit generator seed for (seed, step): splitmix64 of seed combined with step."""
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def _to_token_logprobs(token_lp, rank, top_ids, top_lp) -> list[TokenLogprobs]:
    """Tensors from `ops.logprobs_with_top` -> TokenLogprobs per row (one host transfer each)."""
    return [TokenLogprobs(0, lp, rk, list(zip(ids, lps)))
            for lp, rk, ids, lps in zip(token_lp.tolist(), rank.tolist(), top_ids.tolist(), top_lp.tolist())]


def logprobs_of(logits: torch.Tensor, token_ids: list[int], n: int, log_softmax=torch.log_softmax) -> list[TokenLogprobs]:
    """TokenLogprobs of token_ids[i] under the log_softmax of logits row i, with n alternatives."""
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    out = _to_token_logprobs(*ops.logprobs_with_top(log_softmax(logits.float(), -1), ids, n))
    for entry, token in zip(out, token_ids):
        entry.token_id = token
    return out


def prompt_logprobs_chunk(logits: torch.Tensor, next_ids: list[int], n: int,
                          log_softmax=torch.log_softmax) -> list[TokenLogprobs]:
    """Prompt logprobs for one chunk: logits [C, V] at positions [start, end) and next_ids, the
    prompt tokens at positions start+1 .. end. For the prompt's last chunk next_ids has one entry
    fewer than the logits rows (the last row predicts the first output token) and that row is
    ignored. Returns len(next_ids) entries."""
    if len(next_ids) > logits.shape[0]:
        raise ValueError(f"{len(next_ids)} next ids but only {logits.shape[0]} logits rows")
    return logprobs_of(logits[:len(next_ids)], next_ids, n, log_softmax) if next_ids else []


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], n: int) -> list[TokenLogprobs | None]:
    """Logprobs of each prompt token; logits row i predicts prompt token i + 1.

    logits: [T, V] with T >= len(prompt_ids) - 1. Entry 0 is None (the first prompt token has no
    logprob), so the result has len(prompt_ids) entries.
    """
    return [None, *prompt_logprobs_chunk(logits, list(prompt_ids[1:]), n)] if prompt_ids else []


def _device_list(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a device tensor without blocking the host (through pinned memory on CUDA)."""
    return queue_device_copy(torch.tensor(values, dtype=dtype if dtype is not None else torch.int64
                                          if isinstance(values[0], int) else torch.float32), device)


def _scatter_ones(target: torch.Tensor, ids_per_row: list[list[int]], accumulate: bool) -> torch.Tensor:
    """Add (accumulate) or set 1 at target[r, t] for every t in ids_per_row[r]; returns target."""
    rows = [r for r, ids in enumerate(ids_per_row) for _ in ids]
    if rows:
        dev = target.device
        index = (torch.tensor(rows, dtype=torch.int64, device=dev),
                 torch.tensor([t for ids in ids_per_row for t in ids], dtype=torch.int64, device=dev))
        target.index_put_(index, torch.ones(len(rows), dtype=target.dtype, device=dev), accumulate=accumulate)
    return target


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """int64 [R] argmax per row of raw logits in two device ops, the tokens `Sampler._draw` gives greedy rows:
    NaN counts as -inf, the first +inf wins (saturate's +inf -> the float32 maximum is above every finite
    value of a narrower dtype, and is saturate itself in float32), and a row without a finite logit takes
    token 0 (argmax's first maximum)."""
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        logits = logits.float()  # float64: the values the float32 path compares
    posinf = None if logits.dtype == torch.float32 else float("inf")
    return torch.argmax(torch.nan_to_num(logits, nan=ops.NEG_INF, posinf=posinf, neginf=ops.NEG_INF), dim=-1)


class Sampler:
    """Turns the batch's logits into tokens; owns the generator of the unseeded rows."""

    def __init__(self, seed: int | None = None, batch_invariant: bool = False):
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self.batch_invariant = batch_invariant
        """Logprobs and sampling probabilities through the batch-invariant softmaxes (`ops.batch_invariant`)."""
        if batch_invariant:
            from kimiserve.ops.batch_invariant import reference as bi

            self.log_softmax, self.softmax = bi.log_softmax, bi.softmax
        else:
            self.log_softmax, self.softmax = torch.log_softmax, torch.softmax
        self._host_bitmask: torch.Tensor | None = None
        """Reused host buffer of the grammar bitmasks (pinned when the logits are on CUDA)."""

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed & _MASK64)
            self._generators[device] = gen
        return self._generators[device]

    def _generator(self, req: SampleRequest, device: torch.device) -> torch.Generator:
        if req.seed is None:
            return self._shared_generator(device)
        return torch.Generator(device=device).manual_seed(mix_seed(req.seed, req.num_output_tokens))

    @staticmethod
    def _penalise(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        params = [r.params for r in requests]
        if all(p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1 for p in params):
            return logits
        R, V = logits.shape
        prompt_mask = _scatter_ones(torch.zeros(R, V, dtype=torch.bool, device=logits.device),
                                    [r.prompt_ids for r in requests], accumulate=False)
        counts = _scatter_ones(torch.zeros(R, V, dtype=torch.int32, device=logits.device),
                               [r.output_ids for r in requests], accumulate=True)

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=logits.dtype, device=logits.device)

        return ops.saturate(ops.apply_penalties(logits, prompt_mask, counts, column("presence_penalty"),
                                                column("frequency_penalty"), column("repetition_penalty")))

    @staticmethod
    def _banned(req: SampleRequest, V: int) -> list[int]:
        """Token ids this row may not produce now: the tokens completing a bad word, and eos
        (unless ignore_eos) and stop_token_ids while len(output_ids) < min_tokens."""
        p = req.params
        out = banned_tokens(p._bad_words_token_ids, req.output_ids, V) if p._bad_words_token_ids else []
        if req.num_output_tokens < p.min_tokens:
            out += [t for t in p.stop_token_ids if t < V]
            if req.eos_token_id is not None and not p.ignore_eos and 0 <= req.eos_token_id < V:
                out.append(req.eos_token_id)
        return out

    @staticmethod
    def _allowed_ids(params: SamplingParams, V: int) -> torch.Tensor:
        """params.allowed_token_ids below V as a CPU int64 tensor, cached on params (built once per
        request, not per step; rebuilt if the list is replaced)."""
        cached = getattr(params, "_allowed_ids_cache", None)
        if cached is None or cached[0] is not params.allowed_token_ids:
            ids = params.allowed_token_ids
            cached = (ids, torch.tensor(ids, dtype=torch.int64), max(ids))
            params._allowed_ids_cache = cached
        _, ids, largest = cached
        return ids if largest < V else ids[ids < V]

    def _row_allowed_ids(self, req: SampleRequest, V: int) -> torch.Tensor:
        """The ids a row may take by itself: its forced token, else its allowed_token_ids."""
        if req.forced_token_id is not None:
            return torch.tensor([req.forced_token_id], dtype=torch.int64)
        return self._allowed_ids(req.params, V)

    def _grammar_masks(self, x: torch.Tensor, requests: list[SampleRequest]) -> dict[int, torch.Tensor]:
        """-inf, in place, where the rows' grammars disallow a token; returns row -> its bool keep
        mask (on the device) for the fallback."""
        grammars = [r.grammar if r.forced_token_id is None else None for r in requests]
        if not any(g is not None and g.needs_mask for g in grammars):
            return {}
        from kimiserve.structured_output.manager import fill_bitmask

        R, V = x.shape
        W = (V + 31) // 32
        buf = self._host_bitmask
        if buf is None or buf.shape[0] < R or buf.shape[1] != W:
            buf = torch.empty(max(R, 64), W, dtype=torch.int32, pin_memory=x.device.type == "cuda")
            self._host_bitmask = buf
        host = buf[:R]
        rows = fill_bitmask(grammars, host)
        dev_mask = host.to(x.device, non_blocking=True)
        idx = torch.tensor(rows, dtype=torch.int64, device=x.device)
        keep = unpack_bitmask(dev_mask[idx], V)
        x[idx] = x[idx].masked_fill_(~keep, ops.NEG_INF)
        return {r: keep[j] for j, r in enumerate(rows)}

    @staticmethod
    def _logit_bias(x: torch.Tensor, requests: list[SampleRequest]) -> None:
        """Add each row's logit_bias in place (a -inf stays -inf: a bias never lifts a hard mask)."""
        rows, ids, bias = [], [], []
        for i, r in enumerate(requests):
            for t, b in (r.params.logit_bias or {}).items():
                if t < x.shape[1]:
                    rows.append(i)
                    ids.append(t)
                    bias.append(b)
        if rows:
            dev = x.device
            x.index_put_((torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)),
                         torch.tensor(bias, dtype=x.dtype, device=dev), accumulate=True)

    def _hard_masks(self, x: torch.Tensor, requests: list[SampleRequest]) -> None:
        """-inf, in place, on what allowed_token_ids, bad words and min_tokens exclude: one
        [rows, V] mask for the rows with allowed_token_ids and one index_put for the bans."""
        R, V = x.shape
        dev = x.device
        rows = [i for i, r in enumerate(requests) if r.params.allowed_token_ids or r.forced_token_id is not None]
        if rows:
            ids = [self._row_allowed_ids(requests[i], V) for i in rows]
            which = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(t) for t in ids]))
            keep = torch.zeros(len(rows), V, dtype=torch.bool, device=dev)
            keep[which.to(dev), torch.cat(ids).to(dev)] = True
            idx = torch.tensor(rows, dtype=torch.int64, device=dev)
            x[idx] = x[idx].masked_fill_(~keep, ops.NEG_INF)
        ban_rows, ban_ids = [], []
        for i, r in enumerate(requests):
            banned = self._banned(r, V)
            ban_rows += [i] * len(banned)
            ban_ids += banned
        if ban_rows:
            x[torch.tensor(ban_rows, device=dev), torch.tensor(ban_ids, device=dev)] = ops.NEG_INF

    def _fallback(self, raw: torch.Tensor, req: SampleRequest, grammar_keep: torch.Tensor | None = None) -> int:
        """The token of a row left with no finite logit (see the module doc)."""
        V = raw.shape[0]
        row = ops.saturate(raw)
        allowed = torch.ones(V, dtype=torch.bool, device=raw.device) if grammar_keep is None else grammar_keep.clone()
        if req.params.allowed_token_ids or req.forced_token_id is not None:
            only = torch.zeros_like(allowed)
            only[self._row_allowed_ids(req, V).to(raw.device)] = True
            allowed &= only
        strict = allowed.clone()
        banned = self._banned(req, V)
        if banned:
            strict[torch.tensor(banned, device=raw.device)] = False
        for ok in (strict, allowed):
            if bool(ok.any()):
                scores = row.masked_fill(~ok, ops.NEG_INF)
                return int(torch.argmax(scores)) if bool(scores.max() > ops.NEG_INF) else int(torch.argmax(ok.to(torch.int8)))
        return int(torch.argmax(row))

    def _draw(self, x: torch.Tensor, requests: list[SampleRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [R], valid [R]) on the device from the masked, penalised logits x: the argmax for
        greedy rows, one draw for the others; valid is False for a row without a finite logit."""
        dev, V = x.device, x.shape[1]
        best = x.max(dim=-1, keepdim=True).values
        valid = best.squeeze(-1) > ops.NEG_INF
        token_ids = torch.argmax(x, dim=-1)
        rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if rows:
            sub = [requests[i].params for i in rows]
            every = len(rows) == len(requests)
            idx = None if every else _device_list(rows, dev)
            pick = (lambda t: t) if every else (lambda t: t[idx])
            # minus the row max: <= 0 everywhere, 0 at the best token, so no temperature overflows it
            # up; rows without a finite logit (nan here) are replaced by their fallback
            y = torch.where(pick(valid)[:, None], pick(x) - pick(best), 0.0)
            y = ops.apply_temperature(y, _device_list([p.temperature for p in sub], dev, x.dtype))
            top_k = [p.top_k if p.top_k < V else 0 for p in sub]  # k >= V keeps all: 0 (and no int64 overflow)
            if any(k > 0 for k in top_k) or any(p.top_p < 1 or p.min_p > 0 for p in sub):
                y = ops.apply_top_k_top_p_min_p(y, _device_list(top_k, dev),
                                                _device_list([p.top_p for p in sub], dev, x.dtype),
                                                _device_list([p.min_p for p in sub], dev, x.dtype))
            gens = [self._generator(requests[i], dev) for i in rows]
            drawn = ops.sample(self.softmax(y, dim=-1), gens)
            if every:
                token_ids = drawn
            else:
                token_ids[idx] = drawn
        return token_ids, valid

    def sample_plain(self, logits: torch.Tensor, requests: list[SampleRequest],
                     checked: bool = False) -> torch.Tensor | None:
        """int64 [R] token ids on the logits' device, no host transfer, when every row `is_plain`
        (checked: the caller knows they are); else None (use `__call__`). The same tokens `__call__`
        gives (a row without a finite logit takes the first token, as its fallback does for a row with
        nothing masked)."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [R, V] with R = {len(requests)} requests, got {tuple(logits.shape)}")
        if not checked and not all(r.is_plain for r in requests):
            return None
        if all(r.params.greedy for r in requests):
            return greedy_tokens(logits)  # a row without a finite logit takes the first token, as below
        x = ops.saturate(logits.float())
        token_ids, valid = self._draw(x, requests)
        return torch.where(valid, token_ids, 0)

    def __call__(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[tuple[int, TokenLogprobs | None]]:
        """Sample one token per row. logits: fp32 [R, V], row r for requests[r]."""
        plain = self.sample_plain(logits, requests)
        if plain is not None:
            return [(t, None) for t in plain.tolist()]  # one host transfer
        raw = logits.float()
        dev = raw.device
        x = ops.saturate(raw)  # a fresh tensor: the masks write into it
        grammar_keep = self._grammar_masks(x, requests)
        self._hard_masks(x, requests)
        self._logit_bias(x, requests)
        x = self._penalise(x, requests)
        token_ids, valid = self._draw(x, requests)
        ids = torch.where(valid, token_ids, -1).tolist()  # one host transfer; -1: no finite logit
        for i, t in enumerate(ids):
            if t < 0:
                ids[i] = self._fallback(raw[i], requests[i], grammar_keep.get(i))
        results: list[tuple[int, TokenLogprobs | None]] = [(t, None) for t in ids]
        want = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if want:
            n = max(requests[i].params.logprobs for i in want)
            picked = torch.tensor(want, dtype=torch.int64, device=dev)
            for i, entry in zip(want, logprobs_of(raw[picked], [ids[i] for i in want], n, self.log_softmax)):
                entry.top = entry.top[:requests[i].params.logprobs]
                results[i] = (ids[i], entry)
        return results
