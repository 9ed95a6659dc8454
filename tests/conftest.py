import gc
import os
import re

import pytest
import torch

from kimiserve.config import ModelConfig, load_preset


# One torch thread unless OMP_NUM_THREADS says otherwise: CI runs the suite a second time with
# OMP_NUM_THREADS=2, since another thread count changes reduction orders much as another CPU does.
# The tiny model's ops are too small to gain from a second thread, and with two threads on a
# two-core machine any other busy process makes them 20-50x slower, so 1 stays the default. The
# count is exported, so that CLI subprocesses and in-process `serve` calls use the same one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"].split(",")[0]))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    """After each test on a CUDA machine: collect the engines a test left in reference cycles and hand their
    cached blocks back, so the next test finds the card empty rather than holding a `small` preset engine
    (weights + cache pool) until the collector happens to run. (Session 24 blamed the teacher-forced tests'
    out-of-memory on an 80 GB H100 on this; session 25 found they run out on their own there.)"""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def tiny_linear_config() -> ModelConfig:
    """A tiny Kimi-Linear-shaped model: softplus gate, low-rank output gate, no q-LoRA, plain MoE, SiLU,
    no indexer, no attention residuals, bf16 experts."""
    return load_preset("tiny").replace(
        architecture="KimiLinearForCausalLM", gate_lower_bound=None, kda_full_rank_output_gate=False,
        q_lora_rank=None, mla_use_output_gate=False, index_n_heads=None, index_head_dim=None, index_topk=None,
        hidden_act="silu", routed_expert_hidden_size=None, latent_moe_use_norm=False, num_shared_experts=1,
        routed_scaling_factor=2.446, attn_res_block_size=None, routed_experts_mxfp4=False, extra={},
    )


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Session fixtures that cost seconds to build (spawned gloo ranks, a server). Under pytest-xdist's
# `--dist loadfile` (the README's test command: `-n 2 --dist loadfile`) each test module is one unit
# of work for one worker (its module-scoped engines and servers are built once), and here every
# module that uses one of these also goes to the same worker, so that each is built once, not once
# a worker.
SHARED_SESSION_FIXTURES = ("ranks", "agent_server")


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    groups: dict[str, str] = {}

    def unit_of(nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        if module not in groups:
            # the controller does not collect: the fixtures a module's tests and fixtures take, from its text
            text = (config.rootpath / module).read_text() if (config.rootpath / module).is_file() else ""
            params = {name for args in re.findall(r"\bdef \w+\(([^)]*)\)", text) for name in re.findall(r"\w+", args)}
            groups[module] = next((name for name in SHARED_SESSION_FIXTURES if name in params), module)
        return groups[module]

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def ranks():
    """Gloo ranks for the multi-process tests, spawned once per world size (tests/dist_utils.py)."""
    from dist_utils import RankPools

    pools = RankPools()
    yield pools
    pools.close()


API_KEY = "agent-key"


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory):
    """One server for the agent-API tests (test_server_messages.py, test_server_responses.py): the
    scripted tiny model of tests/agent_scripts.py, reasoning and tool parsers on, auto tool choice,
    `--api-key agent-key` (so x-api-key and Bearer auth are both exercised)."""
    from agent_scripts import SCRIPTS, sdk_scripts
    from scripted_model import make_scripted_checkpoint
    from server_utils import running_server

    path = make_scripted_checkpoint(tmp_path_factory.mktemp("agent-scripted"), SCRIPTS + sdk_scripts())
    with running_server("--model", str(path), "--dtype", "float32", "--max-model-len", "512", "--num-pages", "400",
                        "--reasoning-parser", "kimi", "--tool-call-parser", "kimi_k2", "--enable-auto-tool-choice",
                        "--api-key", API_KEY, "--served-model-name", "kimi-agent") as server:
        yield server
