"""Guided decoding in the engine (llguidance): JSON schemas, regexes, choices, grammars and the Kimi
tool-call grammar on the random tiny model, whose free text never matches (so each test can fail);
the mask application against its reference; n > 1, preemption, rollback, logit_bias, the thinking
budget and compile failures."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from engine_utils import make_engine, run
from structured_utils import random_schemas, validates

pytest.importorskip("llguidance", reason="guided decoding needs llguidance (the guided / test extras)")
jsonschema = pytest.importorskip("jsonschema")

from kimiserve.entrypoints.openai.tool_parser import KimiToolParser  # noqa: E402
from kimiserve.ops.sampling.bitmask import apply_token_bitmask  # noqa: E402
from kimiserve.ops.sampling.reference import apply_token_bitmask_reference  # noqa: E402
from kimiserve.sampling_params import SamplingParams  # noqa: E402
from kimiserve.structured_output import StructuredOutputsParams as Spec  # noqa: E402
from kimiserve.structured_output.tool_grammar import kimi_tool_call_params  # noqa: E402

PROMPT = "Reply in JSON:"
TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city"], "additionalProperties": False},
    "search": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 10},
                                                "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
               "required": ["query", "limit"], "additionalProperties": False},
    "noop": {"type": "object", "properties": {}, "additionalProperties": False},
}


@pytest.fixture
def engines():
    made = []

    def factory(**kwargs):
        made.append(make_engine(**{"max_num_seqs": 64, **kwargs}))
        return made[-1]

    yield factory
    for engine in made:
        engine.check_idle()
        engine.shutdown()


@pytest.mark.parametrize("rows,vocab,width", [(1, 1, 1), (3, 37, 2), (5, 100, 3), (4, 1025, 33), (2, 70, 2)])
def test_bitmask_application_matches_reference(rows, vocab, width):
    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g)
    mask = torch.randint(-2**31, 2**31, (rows, width), dtype=torch.int64, generator=g).to(torch.int32)
    mask[0, 0] = -1  # all bits of a word set (the sign bit included)
    expected = apply_token_bitmask_reference(logits, mask)
    assert torch.equal(apply_token_bitmask(logits.clone(), mask), expected)
    assert torch.isinf(expected).any() or vocab == 1


@pytest.mark.fixed_threads  # grammar guarantees and a share of free samples: other threads, other samples, same bounds
def test_200_random_schemas_all_validate_and_free_text_does_not(engines):
    schemas = random_schemas(200, seed=0)
    engine = engines()
    guided = [SamplingParams(temperature=1.0, seed=i, max_tokens=256, structured_outputs=Spec(json=s))
              for i, s in enumerate(schemas)]
    outs = run(engine, [PROMPT] * 200, guided)
    texts = [outs[f"r{i}"].outputs[0].text for i in range(200)]
    assert all(outs[f"r{i}"].outputs[0].finish_reason == "stop" for i in range(200))
    bad = [(t, s) for t, s in zip(texts, schemas) if not validates(t, s)]
    assert not bad, bad[:3]
    free = run(engine, [PROMPT] * 200, [SamplingParams(temperature=1.0, seed=i, max_tokens=24) for i in range(200)])
    share = sum(validates(free[f"r{i}"].outputs[0].text, s) for i, s in enumerate(schemas)) / 200
    assert share <= 0.02


def _calls(engine, out):
    text = engine.tokenizer.decode(out.outputs[0].token_ids)
    return KimiToolParser().extract(text)


@pytest.mark.fixed_threads  # grammar guarantees and a share of free samples: other threads, other samples, same bounds
def test_200_tool_calls_parse_and_validate(engines):
    engine = engines()
    spec = kimi_tool_call_params(TOOLS)
    outs = run(engine, [PROMPT] * 200, [SamplingParams(temperature=1.0, seed=i, max_tokens=480, structured_outputs=spec)
                                        for i in range(200)])
    good = 0
    for i in range(200):
        content, calls = _calls(engine, outs[f"r{i}"])
        ids = [c.id for c in calls]
        ok = bool(calls) and content.strip() in ("", "<|im_end|>") and len(set(ids)) == len(ids)
        for c in calls:
            ok = ok and validates(c.arguments, TOOLS[c.name])
        good += ok and outs[f"r{i}"].outputs[0].finish_reason == "stop"
    assert good == 200
    free = run(engine, [PROMPT] * 200, [SamplingParams(temperature=1.0, seed=i, max_tokens=24) for i in range(200)])
    assert sum(bool(_calls(engine, free[f"r{i}"])[1]) for i in range(200)) <= 4


def test_named_function_and_forced_prefix(engines):
    engine = engines()
    prefix = "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>"
    spec = kimi_tool_call_params(TOOLS, name="search", prefix=prefix)
    prompt = engine.tokenizer.encode("Call it:" + prefix)
    outs = run(engine, [prompt] * 8, [SamplingParams(temperature=1.0, seed=i, max_tokens=128, structured_outputs=spec)
                                      for i in range(8)])
    for out in outs.values():
        text = out.outputs[0].text  # the arguments, then the call's end markers
        args = engine.tokenizer.decode(out.outputs[0].token_ids).split("<|tool_call_end|>")[0]
        assert validates(args, TOOLS["search"]), text


def test_lazy_tool_grammar_applies_once_the_section_opens(engines):
    engine = engines()
    tok = engine.tokenizer
    begin = tok.token_to_id("<|tool_calls_section_begin|>")
    spec = kimi_tool_call_params(TOOLS, lazy=True)
    # the bias makes the section start likely at once; the free text before it stays free
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200, logit_bias={begin: 6.0}, structured_outputs=spec)
              for i in range(16)]
    outs = run(engine, [PROMPT] * 16, params)
    opened = 0
    for out in outs.values():
        ids = out.outputs[0].token_ids
        if begin not in ids:
            continue
        opened += 1
        content, calls = KimiToolParser().extract(tok.decode(ids))
        assert calls and all(validates(c.arguments, TOOLS[c.name]) for c in calls)
        assert ids[-1] == engine.eos_token_id  # the section closes and the turn ends
    assert opened >= 8


@pytest.mark.parametrize("spec,check", [
    (Spec(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    (Spec(choice=["yes", "no", "maybe not"]), lambda t: t in ("yes", "no", "maybe not")),
    (Spec(grammar='root ::= "(" [0-9]{1,3} (("+" | "*") [0-9]{1,3}){0,3} ")"'),
     lambda t: re.fullmatch(r"\([0-9]{1,3}([+*][0-9]{1,3}){0,3}\)", t)),
    (Spec(grammar='start: "x" NUM\nNUM: /[0-9]{2}/'), lambda t: re.fullmatch(r"x[0-9]{2}", t)),
    (Spec(json_object=True), lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_grammar_json_object(engines, spec, check):
    engine = engines()
    outs = run(engine, [PROMPT] * 12, [SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=spec)
                                       for i in range(12)])
    done = [o.outputs[0] for o in outs.values() if o.outputs[0].finish_reason == "stop"]
    assert all(check(c.text) for c in done), [c.text for c in done]
    # any JSON object: the random model's keys and strings are unbounded, so some run to max_tokens
    assert len(done) >= (6 if spec.json_object else 12)


@pytest.mark.parametrize("spec,needle", [
    (dict(regex="[0-9"), "unclosed character class"),
    (dict(grammar="root ::= ("), "grammar"),
    (dict(json={"type": "object", "properties": {"a": {"type": "nosuchtype"}}}), "nosuchtype"),
])
def test_a_spec_that_does_not_compile_fails_alone(engines, spec, needle):
    engine = engines()
    with pytest.raises(ValueError, match=needle):
        engine.structured_outputs.compile(Spec(**spec))
    good = SamplingParams(temperature=0, max_tokens=20, structured_outputs=Spec(choice=["ok"]))
    outs = run(engine, [PROMPT, PROMPT], [SamplingParams(max_tokens=8, structured_outputs=Spec(**spec)), good])
    assert outs["r0"].outputs[0].finish_reason == "error" and needle in outs["r0"].error
    assert outs["r1"].outputs[0].text == "ok"


def test_spec_shape_errors_are_value_errors():
    with pytest.raises(ValueError, match="exactly one"):
        Spec(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        Spec()
    with pytest.raises(ValueError, match="not valid JSON"):
        Spec(json="{")
    with pytest.raises(ValueError, match="choice"):
        Spec(choice=[])


def test_n_samples_and_preemption_keep_each_matcher(engines):
    schemas = random_schemas(6, seed=5)
    params = [SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=200, structured_outputs=Spec(json=s))
              for i, s in enumerate(schemas)]
    prompts = [list(range(40 + i, 140 + i)) for i in range(6)]
    roomy = run(engines(max_model_len=256), prompts, params)
    tight_engine = engines(max_model_len=256, num_pages=40, enable_prefix_caching=False)  # preempts ~12 times
    tight = run(tight_engine, prompts, params)
    assert tight_engine.stats()["preemptions"] > 0
    for i, s in enumerate(schemas):
        texts = [c.text for c in roomy[f"r{i}"].outputs]
        assert all(validates(t, s) for t in texts), texts
        assert [c.text for c in tight[f"r{i}"].outputs] == texts  # seeded: the same after recompute
    assert any(len({c.text for c in out.outputs}) > 1 for out in roomy.values())  # samples differ


def test_grammar_rollback_and_fork_give_the_masks_of_a_fresh_matcher(engines):
    engine = engines()
    manager = engine.structured_outputs
    spec = Spec(json=random_schemas(1, seed=3)[0])
    manager.compile(spec)
    proto = manager.submit(spec).result()
    rng = random.Random(0)
    V = engine.config.vocab_size
    backend = manager._get_backend()

    def mask(g):
        m = torch.zeros(1, backend.mask_width, dtype=torch.int32)
        backend.fill([(g.matcher, 0)], m)
        return m

    g = manager.new_grammar(spec, proto, [1, 2, 3])
    taken = []
    for _ in range(10):
        allowed = [t for t in range(V) if (int(mask(g)[0, t // 32]) >> (t % 32)) & 1 and t != engine.eos_token_id]
        if not allowed:
            break
        taken.append(rng.choice(allowed))
        g.accept(taken[-1])
    child = g.fork()
    assert torch.equal(mask(child), mask(g))
    g.rollback(4)
    fresh = manager.new_grammar(spec, proto, [1, 2, 3])
    fresh.accept_tokens(taken[:-4])
    assert torch.equal(mask(g), mask(fresh))
    with pytest.raises(ValueError):
        g.rollback(100)


def test_reasoning_aware_grammar_waits_for_the_end_of_thinking(engines):
    engine = engines()
    tok = engine.tokenizer
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    spec = Spec(choice=["alpha", "beta"], after_reasoning=True)
    prompt = tok.encode(PROMPT + "<think>")
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=60, thinking_token_budget=5, structured_outputs=spec)
    out = run(engine, [prompt], params)["r0"].outputs[0]
    ids = out.token_ids
    assert ids.index(end) <= 5  # the budget closed thinking
    assert tok.decode(ids[ids.index(end) + 1:], skip_special_tokens=True) in ("alpha", "beta")
    closed = tok.encode(PROMPT + "<think></think>")  # thinking off: the grammar applies at once
    out = run(engine, [closed], SamplingParams(temperature=1.0, seed=2, max_tokens=20, structured_outputs=spec))["r0"]
    assert out.outputs[0].text in ("alpha", "beta") and start not in out.outputs[0].token_ids


def test_thinking_budget_forces_the_end_of_thinking(engines):
    engine = engines()
    tok = engine.tokenizer
    end = tok.token_to_id("</think>")
    prompt = tok.encode(PROMPT + "<think>")
    for budget in (0, 3, 7):
        outs = run(engine, [prompt], SamplingParams(n=2, temperature=1.0, seed=budget, max_tokens=20, ignore_eos=True,
                                                    thinking_token_budget=budget))["r0"]
        for c in outs.outputs:
            assert end in c.token_ids[:budget + 1] and c.token_ids.index(end) <= budget
    free = run(engine, [prompt], SamplingParams(temperature=1.0, seed=0, max_tokens=20, ignore_eos=True))["r0"]
    assert end not in free.outputs[0].token_ids[:8]  # without a budget the random model does not close it


def test_logit_bias(engines):
    engine = engines()
    greedy = run(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))["r0"].outputs[0]
    banned = greedy.token_ids[0]
    out = run(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                               logit_bias={banned: -100}))["r0"].outputs[0]
    assert banned not in out.token_ids
    out = run(engine, [PROMPT], SamplingParams(temperature=1.0, seed=0, max_tokens=6, ignore_eos=True,
                                               logit_bias={77: 100}))["r0"].outputs[0]
    assert out.token_ids == [77] * 6
    # a bias never lifts a hard mask
    out = run(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={77: 100},
                                               allowed_token_ids=[5, 6]))["r0"].outputs[0]
    assert set(out.token_ids) <= {5, 6}
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("bad", PROMPT, SamplingParams(logit_bias={10**6: 1.0}))


@pytest.mark.fixed_threads
def test_multiprocess_executor_samples_under_the_grammar_on_rank_0(tmp_path):
    """Tensor parallel 2 (a spawned gloo rank): the grammar lives with the sampler on rank 0; the
    greedy guided outputs equal the one-process engine's and validate."""
    from dist_utils import free_port

    from kimiserve.config import tiny_parallel_config
    from kimiserve.entrypoints.llm import LLM
    from kimiserve.model.loader import save_checkpoint
    from kimiserve.model.model import build_model
    from kimiserve.tokenizer import load_tokenizer

    save_checkpoint(build_model(tiny_parallel_config(), torch.float32, seed=3), tmp_path)
    load_tokenizer("tiny").save_pretrained(tmp_path)
    schemas = random_schemas(4, seed=8)
    params = [SamplingParams(n=2, temperature=0, max_tokens=120, structured_outputs=Spec(json=s)) for s in schemas]
    engine_args = dict(dtype="float32", max_model_len=256, num_pages=300)
    texts = []
    for parallel in ({}, {"tensor_parallel_size": 2, "master_port": free_port()}):
        llm = LLM(str(tmp_path), **engine_args, **parallel)
        try:
            outs = llm.generate([PROMPT] * 4, params, use_tqdm=False)
            llm.engine.check_idle()
        finally:
            llm.engine.shutdown()
        texts.append([[c.text for c in o.outputs] for o in outs])
    assert texts[0] == texts[1]
    assert all(validates(t, s) for row, s in zip(texts[0], schemas) for t in row), texts[0]


def test_prefix_hits_and_stop_strings_with_a_grammar(engines):
    engine = engines()
    schema = random_schemas(1, seed=9)[0]
    prompt = list(range(100, 230))
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=200, structured_outputs=Spec(json=schema))
    first = run(engine, [prompt], params)["r0"]
    again = run(engine, [prompt], params)["r0"]
    assert again.num_cached_tokens > 0 and first.num_cached_tokens == 0
    assert again.outputs[0].text == first.outputs[0].text and validates(first.outputs[0].text, schema)
    cut = run(engine, [prompt], SamplingParams(temperature=1.0, seed=4, max_tokens=200, stop=[":"],
                                               structured_outputs=Spec(json=schema)))["r0"].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == ":" and first.outputs[0].text.startswith(cut.text)


def test_guided_benchmark_quick(tmp_path):
    """benchmarks/guided.py --quick runs and writes every figure (no timing asserted)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "guided.json"
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "guided.py"), "--quick", "--out", str(out)],
                          cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["decode"]) == {"batch_1", "batch_4"}
    for row in data["decode"].values():
        assert row["free"]["tokens_per_s"] > 0 and row["guided"]["tokens_per_s"] > 0
    assert data["compile"]["cached_ms"] < data["compile"]["cold_ms"]
