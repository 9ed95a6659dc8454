"""LoRA in the default forward on CUDA (skipped without a GPU): real decode-graph capture with each row's
adapter slot as a graph input, adapters a, b and the base in one batch, against the full forward of a
model with the adapter merged into its weights; the same requests in eager mode."""

import pytest
import torch

from engine_utils import (GREEDY, MERGE_TEST, assert_rows_match, compare_with_full_forward, fp32_row_tolerance,
                          make_engine, merged_twin, random_prompts, run)
from kimiserve.lora import LoRAAdapter
from kimiserve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_lora_on_cuda_matches_the_merged_full_forward(enforce_eager):
    engine = make_engine(device="cuda", max_num_seqs=8, num_pages=300, enforce_eager=enforce_eager, **MERGE_TEST)
    prompts = random_prompts([12, 30, 7, 21, 40], seed=11)
    params = SamplingParams(max_tokens=8, **GREEDY)
    run(engine, prompts[:1], params, ids=["warm"])  # graphs captured before any adapter (then again after)
    a = LoRAAdapter.init(engine.model, "a", rank=4, random_b=True, seed=1)
    b = LoRAAdapter.init(engine.model, "b", rank=8, random_b=True, seed=2, targets=("q_b_proj", "o_proj", "w2"))
    engine.load_lora_adapter("a", a)
    engine.load_lora_adapter("b", b)
    names = [None, "a", "b", "a", "b"]
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{i}", prompt, params, lora_name=name)
    outs = run(engine, [], params)
    graphs = engine.runner.graphs
    if enforce_eager:
        assert graphs is None
    else:
        assert graphs.disabled is None and graphs.replays >= 7, (graphs.disabled, graphs.replays)
    twins = {"a": merged_twin(engine, a), "b": merged_twin(engine, b), None: None}
    errors, agree = [], []
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        e, ok, _ = compare_with_full_forward(engine, prompt, outs[f"r{i}"].outputs[0].token_ids, model=twins[name])
        errors, agree = errors + e, agree + ok
    print(f"enforce_eager={enforce_eager}: median row error {float(torch.tensor(errors).median()):.2e} over {len(errors)} rows")
    assert_rows_match(errors, agree, fp32_row_tolerance(engine))
