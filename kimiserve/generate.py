"""Plain text generation by full-sequence recompute: the stand-in main job until the engine lands."""

from __future__ import annotations

import torch

from kimiserve.config import PRESET_NAMES


def generate(
    model: str,
    prompts: list[str],
    max_tokens: int = 16,
    temperature: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    chat: bool = False,
) -> list[str]:
    """Generate up to max_tokens per prompt from a preset (random weights) or a model folder."""
    from kimiserve.model.loader import load_model
    from kimiserve.tokenizer import load_tokenizer

    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if model in PRESET_NAMES and model != "tiny":
        raise ValueError(f"preset {model!r} ships no tokenizer; generate with 'tiny' or a model folder")
    tokenizer = load_tokenizer(model)
    net = load_model(model, dtype, seed)
    if tokenizer.vocab_size > net.config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {net.config.vocab_size}")
    gen = torch.Generator().manual_seed(seed)
    outputs = []
    for i, prompt in enumerate(prompts):
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
        else:
            ids = tokenizer.encode(prompt)
        if not ids:
            raise ValueError(f"prompt {i} is empty: give at least one character")
        if len(ids) + max_tokens > net.config.max_position_embeddings:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_tokens={max_tokens} it exceeds the context "
                f"of {net.config.max_position_embeddings}"
            )
        new: list[int] = []
        for _ in range(max_tokens):
            logits = net(torch.tensor(ids + new))[-1]
            if temperature == 0:
                token = int(logits.argmax())
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=gen))
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
        outputs.append(tokenizer.decode(new, skip_special_tokens=True))
    return outputs
