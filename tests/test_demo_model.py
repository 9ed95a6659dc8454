"""The trained demo model (kimiserve/presets/kimi-demo, scripts/train_demo.py) as the default model, end to end.

The `kimi-demo` preset loads the packaged checkpoint; `LLM()` with no model answers with it; a real
`kimiserve serve` process on it, through the official openai client: a chat with the corpus's
weather tool gets a parsed tool call whose arguments validate against the tool's JSON schema, the
tool result goes back and the answer holds its values (plain and streamed); an arithmetic question
returns its worked steps as `reasoning_content` and the result as `content`. Greedy decoding on
prompts in the corpus's templates (kimiserve/demo/corpus.py), the only phrasings the model knows.
"""

from __future__ import annotations

import json

import pytest
import torch

from kimiserve.config import DEFAULT_MODEL, PRESETS_DIR, ModelConfig, load_preset, model_folder, resolve_model
from kimiserve.demo import corpus
from kimiserve.engine.args import EngineArgs, tokenizer_source
from kimiserve.model.loader import load_model
from kimiserve.model.model import build_model

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from server_utils import running_server  # noqa: E402

FOLDER = PRESETS_DIR / "kimi-demo"
TOOLS = [corpus.TOOLS["get_time"], corpus.TOOLS["get_weather"]]
WEATHER_SCHEMA = corpus.TOOLS["get_weather"]["function"]["parameters"]
RESULT = {"city": "Tokyo", "temperature_c": 23, "condition": "rainy"}


def test_kimi_demo_preset_is_the_packaged_trained_checkpoint():
    assert EngineArgs().model == DEFAULT_MODEL == "kimi-demo"
    assert model_folder("kimi-demo") == FOLDER and model_folder("tiny") is None
    assert resolve_model("kimi-demo") == ModelConfig.from_pretrained(FOLDER) == load_preset("kimi-demo")
    assert tokenizer_source(EngineArgs()) == str(FOLDER)
    files = {p.name: p.stat().st_size for p in FOLDER.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer_config.json", "chat_template.jinja",
            "training_info.json", "train_log.json"} <= set(files)
    assert sum(files.values()) <= 20 * 2**20  # the bound on the shipped folder
    for name in ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (FOLDER / name).read_bytes() == (PRESETS_DIR / "tiny" / name).read_bytes()  # trained on tiny's tokenizer
    trained = load_model("kimi-demo", torch.float32)
    from_folder = load_model(str(FOLDER), torch.float32)
    random = build_model(load_preset("kimi-demo"), torch.float32, seed=0)
    ids = torch.tensor([[768, 5, 300, 42, 7]])
    with torch.no_grad():
        assert torch.equal(trained(ids), from_folder(ids))
        assert not torch.allclose(trained(ids), random(ids))
    assert trained.config.routed_experts_mxfp4  # the release layout: routed experts stored as MXFP4


def test_llm_without_a_model_answers_with_the_demo_model():
    from kimiserve import LLM, SamplingParams

    llm = LLM(max_model_len=256, num_pages=16)
    assert llm.engine.args.model == "kimi-demo"
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert out.text.endswith("The capital of France is Paris.") and out.finish_reason == "stop"


@pytest.fixture(scope="module")
def server():
    with running_server("--model", "kimi-demo", "--max-model-len", "1024", "--num-pages", "64", "--max-num-seqs", "4",
                        "--reasoning-parser", "kimi", "--tool-call-parser", "kimi_k2", "--enable-auto-tool-choice") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", timeout=300)


ASK = [{"role": "user", "content": "What is the weather in Tokyo?"}]


def _check_call(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_SCHEMA)
    assert args == {"city": "Tokyo"}
    return args


def _answer_messages(reasoning: str | None, call_id: str, arguments: str) -> list[dict]:
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    if reasoning:
        turn["reasoning_content"] = reasoning
    return ASK + [turn, {"role": "tool", "tool_call_id": call_id, "content": json.dumps(RESULT)}]


@pytest.mark.fixed_threads  # the server runs with one torch thread
def test_tool_call_then_answer_from_the_result(client):
    r = client.chat.completions.create(model="kimi-demo", messages=ASK, tools=TOOLS, temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    _check_call(call)
    reasoning = getattr(choice.message, "reasoning_content", None)
    assert reasoning and "get_weather" in reasoning and not choice.message.content
    r = client.chat.completions.create(model="kimi-demo", messages=_answer_messages(reasoning, call.id, call.function.arguments),
                                       tools=TOOLS, temperature=0, max_tokens=60)
    answer = r.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "23" in answer.message.content and "rainy" in answer.message.content, answer.message.content


@pytest.mark.fixed_threads  # the server runs with one torch thread
def test_tool_call_then_answer_streamed(client):
    calls: dict[int, dict] = {}
    reasoning, finish = "", None
    for chunk in client.chat.completions.create(model="kimi-demo", messages=ASK, tools=TOOLS, temperature=0,
                                                max_tokens=80, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            if tc.function:
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    args = json.loads(calls[0]["arguments"])
    jsonschema.validate(args, WEATHER_SCHEMA)
    assert args == {"city": "Tokyo"} and "get_weather" in reasoning
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="kimi-demo", messages=_answer_messages(reasoning, calls[0]["id"], calls[0]["arguments"]), tools=TOOLS,
        temperature=0, max_tokens=60, stream=True) if c.choices)
    assert "23" in text and "rainy" in text, text


@pytest.mark.fixed_threads  # the server runs with one torch thread
def test_reasoning_and_content_come_apart(client):
    r = client.chat.completions.create(model="kimi-demo", messages=[{"role": "user", "content": "What is 47 + 38?"}],
                                       temperature=0, max_tokens=200)
    msg = r.choices[0].message
    reasoning = getattr(msg, "reasoning_content", None)
    assert reasoning and "So 47 + 38 = 85." in reasoning and "<think>" not in reasoning, reasoning
    assert msg.content == "47 + 38 = 85." and r.choices[0].finish_reason == "stop", msg


def test_draft_preset_is_small_and_speculates_for_kimi_demo():
    """kimi-demo-draft (scripts/train_demo.py --model demo-draft) shares kimi-demo's tokenizer; as the
    draft of kimi-demo it leaves the greedy reply as it is and, trained on the same corpus, has most of
    its drafts accepted on a templated answer (a random-weight draft has almost none)."""
    from kimiserve import LLM, SamplingParams

    folder = PRESETS_DIR / "kimi-demo-draft"
    assert model_folder("kimi-demo-draft") == folder
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 6 * 2**20
    for name in ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (folder / name).read_bytes() == (FOLDER / name).read_bytes()
    draft, target = load_preset("kimi-demo-draft"), load_preset("kimi-demo")
    assert draft.vocab_size == target.vocab_size and draft.num_hidden_layers < target.num_hidden_layers
    assert draft.full_attn_layers and draft.index_topk and draft.kda_layers
    messages = [{"role": "user", "content": "What is the weather in Tokyo?"}]
    params = SamplingParams(temperature=0, max_tokens=48, skip_special_tokens=False)
    kwargs = dict(max_model_len=1024, num_pages=48)
    plain = LLM("kimi-demo", **kwargs)
    prompt = plain.get_tokenizer().apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    spec = LLM("kimi-demo", speculative_config={"method": "draft_model", "model": "kimi-demo-draft",
                                                "num_speculative_tokens": 3}, **kwargs)
    assert spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    stats = spec.engine.stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted >= 0.5 * drafted, stats


def test_kimi_demo_rewrites_a_file_and_ngram_speculation_drafts_the_copy():
    """Since session 12 kimi-demo knows the corpus's file edits: asked for one change it writes the prompt's file
    back with it, and prompt-lookup (n-gram) speculation drafts most of that copy while leaving the greedy reply
    as it is."""
    import random
    import re

    from kimiserve import LLM, SamplingParams

    rng = random.Random(20_011)  # benchmarks/demo_eval.py's held-out edits
    examples = [corpus.edit(rng) for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=256, skip_special_tokens=False)
    kwargs = dict(max_model_len=1024, num_pages=64)
    plain = LLM("kimi-demo", **kwargs)
    prompts = [corpus.prompt_ids(plain.get_tokenizer(), ex) for ex in examples]
    want = [out.outputs[0] for out in plain.generate(prompts, params, use_tqdm=False)]
    blocks = [re.search(r"```\n(.*?)\n```", w.text, re.S) for w in want]
    assert sum(b is not None and b.group(1) == ex.answer for b, ex in zip(blocks, examples)) >= 2, [w.text for w in want]
    spec = LLM("kimi-demo", speculative_config={"method": "ngram", "num_speculative_tokens": 5}, **kwargs)
    got = [out.outputs[0].token_ids for out in spec.generate(prompts, params, use_tqdm=False)]
    assert got == [w.token_ids for w in want]
    stats = spec.engine.stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted >= 0.5 * drafted, stats
