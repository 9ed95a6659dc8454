"""`rl.weight_sync.sync_weights`: new weights into a running engine without a restart, in one process and
on every rank of a multi-process engine (each rank loads its own part of the one-process tensors); the
engine then answers as an engine built with those weights. Bad input is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from dist_utils import free_port
from kimiserve.config import tiny_parallel_config
from kimiserve.entrypoints.llm import LLM
from kimiserve.model.loader import save_checkpoint
from kimiserve.model.model import build_model
from kimiserve.rl.weight_sync import sync_weights
from kimiserve.sampling_params import SamplingParams
from kimiserve.tokenizer import load_tokenizer

# the ranks run with one torch thread whatever OMP_NUM_THREADS says, and the rest compares one process's runs
pytestmark = pytest.mark.fixed_threads

PROMPTS = [[5, 9, 200, 7], list(range(30, 30 + 77)), [11] * 9]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=256, num_pages=300, max_num_batched_tokens=64)


def new_model():
    return build_model(tiny_parallel_config(), torch.float32, seed=5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Folders of the model the engines start with (seed 3) and of the one synced into them (seed 5)."""
    folders = {}
    for seed in (3, 5):
        folders[seed] = str(tmp_path_factory.mktemp(f"tiny_parallel_seed{seed}"))
        save_checkpoint(build_model(tiny_parallel_config(), torch.float32, seed=seed), folders[seed])
        load_tokenizer("tiny").save_pretrained(folders[seed])
    return folders


@pytest.fixture(scope="module")
def want(checkpoints):
    """The one-process engine built with the new weights: its greedy tokens."""
    llm = LLM(checkpoints[5], **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_one_process_engine_answers_with_the_new_weights(checkpoints, want):
    llm = LLM(checkpoints[3], **ENGINE, enable_prefix_caching=True)
    before = tokens(llm)
    assert before != want
    assert llm.engine.stats()["pages_cached"] > 0
    assert sync_weights(llm, new_model()) == len(list(new_model().parameters()))
    assert llm.engine.stats()["pages_cached"] == 0  # the old weights' latents and states are gone
    assert tokens(llm) == want
    llm.engine.check_idle()


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "ep2"])
def test_every_rank_loads_its_part(checkpoints, want, parallel):
    """A multi-process engine after the sync gives the one-process engine's tokens of the new weights
    (before the fix only rank 0's parameters were written, and a sharded tensor's full shape was refused)."""
    llm = LLM(checkpoints[3], master_port=free_port(), **ENGINE, **parallel)
    try:
        assert tokens(llm) != want
        sync_weights(llm, new_model())
        assert tokens(llm) == want
        llm.engine.check_idle()
    finally:
        llm.engine.shutdown()


def test_bad_updates_are_refused_before_anything_is_written(checkpoints):
    llm = LLM(checkpoints[3], **ENGINE)
    before = {n: p.detach().clone() for n, p in llm.engine.model.named_parameters()}
    new = {n: t for n, t in new_model().state_dict().items()}
    name = next(iter(new))
    with pytest.raises(ValueError, match="has no parameter 'model.nope'"):
        sync_weights(llm, {**new, "model.nope": torch.zeros(3)})
    with pytest.raises(ValueError, match=rf"{name}: shape \(1, 2\), the engine's parameter is"):
        sync_weights(llm, {**new, name: torch.zeros(1, 2)})
    assert all(torch.equal(p, before[n]) for n, p in llm.engine.model.named_parameters())
    llm.engine.add_request("r", [1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="requests are still running"):
        sync_weights(llm, new)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert all(torch.equal(p, before[n]) for n, p in llm.engine.model.named_parameters())
