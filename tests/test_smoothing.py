"""Index-key smoothing: folding power-of-two channel scales leaves the model's outputs bit-identical
and makes fp4 index keys select more of the exact keys' top-k when keys have outlier channels."""

import pytest
import torch

from kimiserve.cache import formats
from kimiserve.config import load_preset
from kimiserve.entrypoints.cli import main
from kimiserve.model.loader import load_model
from kimiserve.model.model import build_model
from kimiserve.model.smoothing import (
    fold_index_key_smoothing,
    index_key_channel_rms,
    smooth_index_keys,
    smoothing_scales,
)
from kimiserve.ops.indexer.reference import indexer_scores

OUTLIERS = [3, 11]


def outlier_model(dtype, preset="tiny", seed=0):
    """A preset whose index-key LayerNorm gives two channels ~20x the others (as trained models have)."""
    model = build_model(load_preset(preset), dtype, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "indexer"):
                layer.self_attn.indexer.k_norm.weight[OUTLIERS] *= 20
    return model


def prompts(n, length, seed=1, vocab=1024):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", [None, "bf16"])
def test_fold_leaves_logits_bit_identical(dtype, kv):
    model = outlier_model(dtype)
    ids = prompts(1, 150, seed=2)[0]
    before = model(ids, kv)
    scales = smooth_index_keys(model, prompts(2, 120))
    assert any((s != 1).any() for s in scales)  # the fold really changed weights
    assert torch.equal(model(ids, kv), before)


def test_scales_find_the_outlier_channels():
    model = outlier_model(torch.float32)
    rms = index_key_channel_rms(model, prompts(2, 100))
    for s in (smoothing_scales(r) for r in rms):
        big = torch.nonzero(s > 1).flatten().tolist()
        assert big == OUTLIERS and (s[OUTLIERS] >= 8).all() and (s[s <= 1] >= 0.5).all()
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two


def _fp4_recall(model, x, k):
    """Mean over queries of |top-k with fp4-cached keys (rotated, the default) & exact top-k| / k,
    on the first indexer, fed hidden states x."""
    ix = next(layer.self_attn.indexer for layer in model.model.layers if hasattr(layer.self_attn, "indexer"))
    keys = ix.keys(x)
    q, w = ix.queries(x, torch.randn(*x.shape[:2], ix.wq_b.weight.shape[1], generator=torch.Generator().manual_seed(4)))
    exact = indexer_scores(q, keys, w)[0].topk(k, dim=-1).indices
    read = formats.roundtrip_index_key(keys, "fp4", rotate=True)
    quant = indexer_scores(q, read, w)[0].topk(k, dim=-1).indices
    hits = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(exact, quant)]
    return sum(hits) / (k * len(hits))


def test_smoothing_raises_fp4_key_recall():
    model = outlier_model(torch.float32)
    d = model.config.hidden_size
    x = torch.randn(1, 2000, d, generator=torch.Generator().manual_seed(3))
    before = _fp4_recall(model, x, 64)
    smooth_index_keys(model, prompts(2, 200))
    after = _fp4_recall(model, x, 64)
    assert after > before + 0.05, (before, after)


def test_bad_input():
    model = build_model(load_preset("tiny"), torch.float32)
    n = sum(hasattr(layer.self_attn, "indexer") for layer in model.model.layers)
    with pytest.raises(ValueError, match="powers of two"):
        fold_index_key_smoothing(model, [torch.full((16,), 3.0)] * n)
    with pytest.raises(ValueError, match="one scale vector per indexer"):
        fold_index_key_smoothing(model, [torch.ones(16)])
    with pytest.raises(ValueError, match="positive"):
        fold_index_key_smoothing(model, [torch.zeros(16)] * n)
    with pytest.raises(ValueError, match="prompt"):
        index_key_channel_rms(model, [])


def test_cli_writes_an_equivalent_checkpoint(tmp_path, capsys):
    out = tmp_path / "smoothed"
    assert main(["smooth-index-keys", "--model", "tiny", "--out", str(out), "--num-prompts", "2",
                 "--prompt-len", "64", "--dtype", "fp32"]) == 0
    assert "key channels rescaled" in capsys.readouterr().out
    ids = prompts(1, 100, seed=5)[0]
    original = load_model("tiny", torch.float32)
    smoothed = load_model(str(out), torch.float32)
    assert torch.equal(smoothed(ids, "bf16"), original(ids, "bf16"))
    assert main(["smooth-index-keys", "--model", "tiny", "--out", str(out), "--num-prompts", "0"]) == 2
