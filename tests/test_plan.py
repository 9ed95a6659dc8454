import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import tiny_linear_config
from kimiserve.cache.allocator import PageAllocator
from kimiserve.cache.layout import CacheLayout
from kimiserve.cache.pool import PagePool
from kimiserve.config import load_preset
from kimiserve.entrypoints.cli import main
from kimiserve.model.inspect import count_params
from kimiserve.model.model import KimiForCausalLM
from kimiserve.plan import compute_plan, format_plan, weight_groups

pytestmark = pytest.mark.fixed_threads  # shapes on the meta device, plans from sizes: OMP_NUM_THREADS changes nothing

TINY = load_preset("tiny")
GB = 1e9


@pytest.fixture(scope="module")
def pro():
    config = load_preset("kimi-k3.1-pro")
    return config, weight_groups(config)


def plan(config, gpus, parallel, kv, context, gpu_mem_gb, reserve_gb=0.0, util=0.9, groups=None):
    return compute_plan(config, gpu_mem_gb, gpus, parallel, kv, context, util, reserve_gb, groups=groups)


def meta_param_bytes(config) -> int:
    with torch.device("meta"):
        model = KimiForCausalLM(config, torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_tiny_page_by_hand():
    # tiny: 4 KDA heads x 16, conv 4; 2 MLA layers, latent 32 + 8 = 40, index keys 16. dcp2 -> 2 heads per rank
    p = plan(TINY, 2, "dcp", "fp8", 1000, 0.01)
    state = 2 * 16 * 16 * 4 + 3 * (2 * 16) * 3 * 2  # fp32 recurrent [2, 16, 16] + bf16 conv [3, 32, 3]
    per_layer = 64 * 40 + 64 * 16 + 64 * 4  # fp8 latent, fp8 key, fp32 key scale; 64-token block
    assert p["kda"]["state_bytes_per_layer"] == state == 2624
    assert p["cache"]["block_size"] == 64 and p["cache"]["page_bytes"] == 2 * per_layer == 7680
    assert p["cache"]["bytes_per_token_per_gpu"] == 2 * (40 + 16 + 4)
    assert p["cache"]["tokens_per_gpu"] == 500
    assert p["fit"]["pages_per_seq"] == math.ceil(500 / 64) + 5


def test_weights_per_gpu():
    whole = meta_param_bytes(TINY)
    per = {n: plan(TINY, n, "tp", "fp8", 64, 1.0)["weights"]["per_gpu"] for n in (1, 2, 4)}
    assert per[1]["total"] == whole  # one GPU holds every byte the model builds
    # everything but the replicated part divides evenly over 2 and 4 tiny GPUs
    assert per[1]["total"] - per[2]["total"] == 2 * (per[2]["total"] - per[4]["total"]) > 0
    assert per[1]["replicated"] == per[2]["replicated"] == per[4]["replicated"]
    # MXFP4 experts: 4 bits per value + one ue8m0 byte per 32 values
    c = TINY
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    values = moe_layers * c.num_experts * 3 * c.moe_hidden_size * c.moe_intermediate_size
    assert per[1]["routed_experts"] == values // 2 + values // 32
    assert per[4]["routed_experts"] == (values // 2 + values // 32) // 4
    assert per[2]["vocab"] == 2 * (c.vocab_size // 2) * c.hidden_size * 2  # embedding + lm_head rows, bf16
    router = moe_layers * (c.num_experts * c.hidden_size + c.num_experts) * 4  # fp32, on every GPU
    assert per[4]["replicated"] >= router
    groups = weight_groups(c)
    assert groups["routed_experts"]["params"] + sum(g["params"] for part in ("sharded", "replicated")
                                                    for g in groups[part].values()) \
        + groups["vocab"]["params"] == count_params(c)["total_params"]


@pytest.mark.parametrize("config_name, gpus, expert_parallel", [
    ("tiny", 2, True), ("tiny", 4, True), ("parallel", 2, False), ("parallel", 3, False), ("parallel", 4, True),
])
def test_weights_per_gpu_are_what_a_rank_builds(config_name, gpus, expert_parallel):
    """The planner's per-GPU weight bytes equal the parameters of the engine's rank shard (built on the
    meta device): heads, MLPs, vocab rows (padded to a multiple of N), experts split; the indexer, router,
    norms and latent down-projections replicated."""
    from kimiserve.config import tiny_parallel_config
    from kimiserve.distributed.parallel_state import ParallelConfig, ParallelContext

    config = TINY if config_name == "tiny" else tiny_parallel_config()
    per = plan(config, gpus, "tp", "fp8", 64, 1.0)["weights"]["per_gpu"]
    for rank in range(gpus):
        ctx = ParallelContext(ParallelConfig(gpus, enable_expert_parallel=expert_parallel), rank)
        with torch.device("meta"):
            model = KimiForCausalLM(config, torch.bfloat16, ctx)
        assert sum(p.numel() * p.element_size() for p in model.parameters()) == per["total"]
        indexer = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".indexer." in n)
        assert indexer == meta_param_bytes_of(config, ".indexer.") > 0  # replicated: every rank holds all of it
    groups = weight_groups(config)
    assert not [label for label in groups["sharded"] if "indexer" in label]
    assert [label for label in groups["replicated"] if label.startswith("indexer")]


def meta_param_bytes_of(config, part: str) -> int:
    with torch.device("meta"):
        model = KimiForCausalLM(config, torch.bfloat16)
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if part in n)


def test_experts_not_dividing_take_ceil():
    config = TINY.replace(num_experts=6, num_experts_per_token=2)
    one = plan(config, 1, "tp", "fp8", 64, 1.0)["weights"]["per_gpu"]
    four = plan(config, 4, "tp", "fp8", 64, 1.0)["weights"]["per_gpu"]
    assert four["experts_per_gpu"] == 2 and four["routed_experts"] == one["routed_experts"] // 6 * 2


@pytest.mark.parametrize("parallel", ["tp", "dcp"])
@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4", "fp8+fp4"])
def test_pages_match_the_real_pool_and_allocator(parallel, kv):
    N, L, mem = 2, 777, 0.0025
    p = plan(TINY, N, parallel, kv, L, mem)
    fit, cache = p["fit"], p["cache"]
    layout = CacheLayout.from_config(TINY.replace(kda_num_heads=TINY.kda_num_heads // N), kv, torch.bfloat16)
    assert (layout.block_size, layout.page_bytes) == (cache["block_size"], cache["page_bytes"])
    available = int(mem * GB * 0.9) - p["weights"]["per_gpu"]["total"]
    assert fit["available_bytes"] == available > 0
    pool = PagePool(layout, fit["pages_per_gpu"])
    assert pool.recurrent.shape[1] == TINY.kda_num_heads // N  # a rank's state page holds its heads only
    assert pool.nbytes <= available < pool.nbytes + layout.page_bytes  # the most pages that fit
    # as many sequences as the planner says get their pages from the real allocator, and no more
    tokens = L if parallel == "tp" else math.ceil(L / N)
    need = math.ceil(tokens / layout.block_size) + len(TINY.kda_layers)
    alloc = PageAllocator(fit["pages_per_gpu"], layout.block_size, len(TINY.kda_layers), enable_prefix_caching=False)
    count = 0
    while alloc.allocate(need) is not None:
        count += 1
    assert count == fit["full_contexts"] > 0
    # the longest single sequence fits, one token more does not
    longest = fit["max_single_context"]
    per_rank = lambda n: n if parallel == "tp" else math.ceil(n / N)  # noqa: E731
    pages_for = lambda n: math.ceil(per_rank(n) / layout.block_size) + len(TINY.kda_layers)  # noqa: E731
    assert pages_for(longest) <= fit["pages_per_gpu"] < pages_for(longest + 1)


def test_dcp_fits_about_n_times_more_when_cache_bound():
    N, L = 4, 65536
    tp, dcp = plan(TINY, N, "tp", "fp8", L, 1.0), plan(TINY, N, "dcp", "fp8", L, 1.0)
    assert tp["weights"]["per_gpu"] == dcp["weights"]["per_gpu"]  # same shards in both modes
    assert tp["cache"]["tokens_per_gpu"] == L and dcp["cache"]["tokens_per_gpu"] == L // N
    ratio = dcp["fit"]["full_contexts"] / tp["fit"]["full_contexts"]
    assert tp["fit"]["full_contexts"] > 10 and 0.9 * N <= ratio <= N
    assert dcp["fit"]["max_single_context"] == N * tp["fit"]["max_single_context"]


def test_full_model_fp4_beats_fp8_beats_bf16(pro):
    config, groups = pro
    fits = {kv: plan(config, 8, "dcp", kv, 1048576, 288, 4.0, groups=groups)["fit"]["full_contexts"]
            for kv in ("bf16", "fp8", "fp8+fp4", "fp4")}
    assert fits["fp4"] > fits["fp8+fp4"] > fits["fp8"] > fits["bf16"] > 0
    assert fits["fp4"] >= 1.6 * fits["fp8"]  # 9,408 against 16,992 B per token, less the KDA state pages
    tp = plan(config, 8, "tp", "fp8", 1048576, 288, 4.0, groups=groups)
    assert 190e9 < tp["weights"]["per_gpu"]["total"] < 205e9  # 2.78T params, experts MXFP4, sharded 8 ways
    assert tp["fit"]["full_contexts"] * 7 <= fits["fp8"]  # dcp8 fits ~8x the 1M contexts of tp8


def test_nothing_fits_is_said_plainly(pro, capsys):
    config, groups = pro
    p = plan(config, 8, "dcp", "fp4", 1048576, 141, 4.0, groups=groups)
    assert not p["fit"]["weights_fit"] and p["fit"]["full_contexts"] == 0 and p["fit"]["available_bytes"] == 0
    assert p["fit"]["shortfall_bytes"] > 70e9 and p["hints"]["min_gpus"] == 16
    text = format_plan(p)
    assert "NOTHING FITS" in text and "answer: 0 full contexts" in text
    assert "= -" not in text and " -7" not in text  # no negative available memory


def test_cli_text_shows_the_numbers(capsys):
    p = plan(TINY, 2, "dcp", "fp4", 3000, 0.005, 0.001)
    code = main(["plan", "--model", "tiny", "--gpu-mem", "0.005", "--gpus", "2", "--parallel", "dcp",
                 "--kv-cache-dtype", "fp4", "--context", "3000", "--reserve-gb", "0.001"])
    out = capsys.readouterr().out
    assert code == 0
    fit, cache, w = p["fit"], p["cache"], p["weights"]["per_gpu"]
    for number in (w["total"], cache["page_bytes"], cache["bytes_per_token_per_gpu"], fit["pages_per_gpu"],
                   fit["pages_per_seq"], fit["max_single_context"], fit["available_bytes"]):
        assert f"{number:,}" in out
    assert f"floor({fit['pages_per_gpu']:,} / {fit['pages_per_seq']:,}) = {fit['full_contexts']:,}" in out
    assert "ceil(3,000 / 2) = 1,500 tokens per GPU" in out
    assert "replicated on every GPU" in out and "MoE router" in out and "norms" in out


def test_cli_json(capsys):
    code = main(["plan", "--model", "tiny", "--gpu-mem", "0.01", "--gpus", "4", "--parallel", "tp",
                 "--kv-cache-dtype", "fp8+fp4", "--context", "500", "--gpu-memory-utilization", "0.5", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    expect = plan(TINY, 4, "tp", "fp8+fp4", 500, 0.01, 4.0, util=0.5)
    assert out["fit"] == expect["fit"] and out["cache"] == expect["cache"]
    assert out["fit"]["full_contexts"] == 0 and out["fit"]["weights_fit"] is False  # the 4 GB default reserve
    assert out["gpu_memory_utilization"] == 0.5


def test_kimi_linear_shape_plans():
    p = plan(tiny_linear_config(), 2, "dcp", "fp4", 1000, 0.01)
    assert p["weights"]["groups"]["routed_experts"]["format"] == "bf16"
    assert p["cache"]["index_key_bytes_per_token_per_layer"] == 0 and p["fit"]["full_contexts"] > 0
    assert "index key" not in format_plan(p)


BASE = ["plan", "--model", "tiny", "--gpu-mem", "1", "--gpus", "2", "--parallel", "tp", "--kv-cache-dtype", "fp8",
        "--context", "100"]


def _with(flag, value):
    args = list(BASE)
    args[args.index(flag) + 1] = value
    return args


@pytest.mark.parametrize("argv, message", [
    (_with("--gpus", "0"), "--gpus must be >= 1"),
    (_with("--gpus", "3"), "does not divide the 4 KDA heads"),
    (_with("--context", "0"), "--context must be >= 1"),
    (_with("--gpu-mem", "0"), "--gpu-mem must be a positive"),
    (_with("--gpu-mem", "-3"), "--gpu-mem must be a positive"),
    (_with("--gpu-mem", "nan"), "--gpu-mem must be a positive"),
    (_with("--model", "nope"), "neither a preset"),
    (BASE + ["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
    (BASE + ["--reserve-gb", "-1"], "--reserve-gb must be >= 0"),
    (_with("--parallel", "pp"), "invalid choice: 'pp'"),
    (_with("--kv-cache-dtype", "fp6"), "invalid choice: 'fp6'"),
    (_with("--gpus", "two"), "invalid int value"),
])
def test_bad_input_exits_2(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_console_script_exit_code():
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # as tests/conftest.py set in-process
    res = subprocess.run([sys.executable, "-m", "kimiserve.entrypoints.cli", *_with("--gpus", "3")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "kimiserve plan: error:" in res.stderr and "Traceback" not in res.stderr
