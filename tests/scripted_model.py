"""A test fixture: the tiny preset with a fitted lm_head, so greedy decoding answers chosen chat
prompts with chosen text (Kimi reasoning / tool-call markers included) and then `<|im_end|>`.

Every weight but the lm_head keeps the tiny preset's random values from `seed`. The lm_head only
maps the final normed hidden state to logits, so it is fitted (full-batch cross-entropy with a
little weight decay, a convex problem; L-BFGS) to put each scripted token on top at the position
that predicts it: the last prompt position predicts the first response token, ..., the last
response token's position predicts `<|im_end|>`. The hidden states are taken from the fp32
full-sequence forward exactly and as bf16 and fp8 caches return MLA latents, so the serving path
of either cache dtype stays on script (the random model is sensitive: bf16 latents move some
final states by up to ~90%, so all three are fitted). The checkpoint is fp32: run it with
dtype="float32" (bf16 weights are not on script).

Capacity (seed 0, 64 dims): the 3 scripts of test_scripted_model.py (151 positions) fit with a
top-1 minus top-2 margin >= 6.7; 10 similar tool-call scripts (484 positions) and 20 (968) still
cleared 5 (with decay 1e-7 / 1e-8).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from kimiserve.config import load_preset
from kimiserve.model.batch import CacheRoundTrip
from kimiserve.model.loader import save_checkpoint
from kimiserve.model.model import build_model
from kimiserve.tokenizer import load_tokenizer

Script = tuple[list[int], str]
CACHE_VARIANTS = (None, "bf16", "fp8")  # exact latents, and as each cache dtype returns them
WEIGHT_DECAYS = (1e-6, 1e-7, 1e-8)  # tried in order until every margin clears min_margin


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    return load_tokenizer("tiny")


def chat_prompt_ids(messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The tiny tokenizer's chat prompt (add_generation_prompt=True) as `LLM.chat` feeds the engine:
    the rendered template string, encoded by `LLMEngine.add_request` with special markers allowed."""
    tok = tiny_tokenizer()
    return tok.encode(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False))


def response_ids(text: str) -> list[int]:
    """The scripted reply's token ids: the text with special markers allowed, then `<|im_end|>`."""
    tok = tiny_tokenizer()
    ids = tok.encode(text, allow_special=True)
    if tok.decode(ids) != text:
        raise ValueError(f"response {text!r} does not survive an encode/decode round trip")
    return ids + [tok.eos_token_id]


def _check_consistent(scripts: list[Script]) -> None:
    """Raise if two scripts ask for different next tokens after the same token prefix."""
    wanted: dict[tuple[int, ...], int] = {}
    for n, (prompt, text) in enumerate(scripts):
        if not prompt:
            raise ValueError(f"script {n}: empty prompt")
        seq = list(prompt) + response_ids(text)
        for t in range(len(prompt), len(seq)):
            prev = wanted.setdefault(tuple(seq[:t]), seq[t])
            if prev != seq[t]:
                raise ValueError(f"script {n}: after the same {t} tokens another script wants token {prev}, "
                                 f"this one {seq[t]}: no model can do both")


@torch.no_grad()
def fitted_states(model, scripts: list[Script]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Final normed hidden states [V, N, d] (V cache variants) at the N positions that predict a
    response token, their targets [N] and the script index of each position [N]."""
    states, targets, owner = [[] for _ in CACHE_VARIANTS], [], []
    for n, (prompt, text) in enumerate(scripts):
        resp = response_ids(text)
        ids = torch.tensor([list(prompt) + resp[:-1]])
        model.check_ids(ids)
        for v, kv in enumerate(CACHE_VARIANTS):
            h = model.model(ids, None if kv is None else CacheRoundTrip(kv))[0]
            states[v].append(h[len(prompt) - 1:].float())
        targets.append(torch.tensor(resp))
        owner.append(torch.full((len(resp),), n))
    return torch.stack([torch.cat(s) for s in states]), torch.cat(targets), torch.cat(owner)


def margins(weight: torch.Tensor, states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Target logit minus the best other logit, per position (negative: argmax is wrong)."""
    logits = states @ weight.T
    idx = targets.expand(*logits.shape[:-1]).unsqueeze(-1)
    target = logits.gather(-1, idx).squeeze(-1)
    return target - logits.scatter(-1, idx, float("-inf")).amax(-1)


def fit_lm_head(states: torch.Tensor, targets: torch.Tensor, vocab_size: int, weight_decay: float,
                max_iter: int = 500) -> torch.Tensor:
    """Cross-entropy of all states (every cache variant) against their targets, lm_head only."""
    x = states.reshape(-1, states.shape[-1]).double()
    y = targets.repeat(states.shape[0])
    weight = torch.zeros(vocab_size, x.shape[-1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([weight], lr=1, max_iter=max_iter, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weight.T, y) + weight_decay * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return weight.detach().float()


def make_scripted_checkpoint(out_dir, scripts: list[Script], seed: int = 0, min_margin: float = 5.0) -> Path:
    """Write a tiny fp32 model folder (config, safetensors, tokenizer files, scripted.json) whose
    greedy reply to each `(prompt_ids, response_text)` is response_text then `<|im_end|>`.

    Raises ValueError if the scripts contradict each other or some position's margin stays below
    `min_margin` (too many positions for 64 dims). scripted.json records the scripts and margins.
    """
    scripts = [(list(p), str(t)) for p, t in scripts]
    if not scripts:
        raise ValueError("give at least one script")
    _check_consistent(scripts)
    config = load_preset("tiny")
    model = build_model(config, torch.float32, seed=seed)
    states, targets, owner = fitted_states(model, scripts)
    for decay in WEIGHT_DECAYS:
        weight = fit_lm_head(states, targets, config.vocab_size, decay)
        m = margins(weight, states, targets).amin(0)  # worst cache variant per position
        if m.min() > min_margin:
            break
    else:
        bad = sorted({int(owner[i]) for i in torch.nonzero(m <= min_margin).flatten()})
        raise ValueError(f"{int((m <= min_margin).sum())} of {len(m)} positions (scripts {bad}) keep a margin "
                         f"<= {min_margin} (worst {m.min():.2f}): use fewer or shorter scripts")
    model.lm_head.weight.data.copy_(weight)
    out = Path(out_dir)
    save_checkpoint(model, out)
    tiny_tokenizer().save_pretrained(out)
    report = {"seed": seed, "weight_decay": decay, "positions": len(targets), "min_margin": float(m.min()),
              "scripts": [{"prompt_ids": p, "response": t, "min_margin": float(m[owner == n].min())}
                          for n, (p, t) in enumerate(scripts)]}
    (out / "scripted.json").write_text(json.dumps(report, indent=1))
    return out
