"""The scripted tiny model (tests/scripted_model.py) says its scripts through the real engine."""

from __future__ import annotations

import json
import time

import pytest

from kimiserve import LLM, SamplingParams
from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from scripted_model import chat_prompt_ids, make_scripted_checkpoint, response_ids, tiny_tokenizer

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER_TOOL]


def _call(name: str, index: int, args: str) -> str:
    return f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


# (messages, tools, scripted reply)
SCRIPTS = [
    ([{"role": "user", "content": "What's the weather in Paris?"}], TOOLS,
     "<think>Check the weather.</think><|tool_calls_section_begin|>"
     + _call("get_weather", 0, '{"city":"Paris"}') + "<|tool_calls_section_end|>"),
    ([{"role": "user", "content": "Compare the weather in Paris and Tokyo."}], TOOLS,
     "<think>Two cities, two calls.</think><|tool_calls_section_begin|>"
     + _call("get_weather", 0, '{"city":"Paris"}') + _call("get_weather", 1, '{"city":"Tokyo"}')
     + "<|tool_calls_section_end|>"),
    ([{"role": "user", "content": "What is 2 + 2?"}], None,
     "<think>Add the numbers.</think>2 + 2 = 4."),
]
GREEDY = SamplingParams(temperature=0, max_tokens=200)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    start = time.perf_counter()
    path = make_scripted_checkpoint(tmp_path_factory.mktemp("scripted"),
                                    [(chat_prompt_ids(m, t), text) for m, t, text in SCRIPTS])
    return path, time.perf_counter() - start


def _check(out, text: str) -> None:
    completion = out.outputs[0]
    assert completion.text == text
    assert completion.token_ids == response_ids(text)  # the reply, then <|im_end|>
    assert completion.token_ids[-1] == tiny_tokenizer().eos_token_id
    assert completion.finish_reason == "stop"


def test_checkpoint_folder_and_margins(scripted):
    path, seconds = scripted
    assert seconds < 30, f"building the scripted checkpoint took {seconds:.1f}s"
    for name in ("config.json", "model.safetensors.index.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (path / name).is_file()
    report = json.loads((path / "scripted.json").read_text())
    assert report["min_margin"] > 5
    assert len(report["scripts"]) == len(SCRIPTS)
    assert report["positions"] == sum(len(response_ids(text)) for _, _, text in SCRIPTS)


def test_contradictory_scripts_are_refused(tmp_path):
    prompt = chat_prompt_ids(*SCRIPTS[2][:2])
    with pytest.raises(ValueError, match="no model can do both"):
        make_scripted_checkpoint(tmp_path, [(prompt, "<think></think>4"), (prompt, "<think></think>5")])


def test_markers_survive_detokenization():
    tok = tiny_tokenizer()
    ids = response_ids(SCRIPTS[0][2])
    assert tok.token_to_id("<|tool_call_begin|>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == SCRIPTS[0][2]  # only <|im_end|> is skipped


def test_chat_prompt_ids_match_the_engine(scripted):
    llm = LLM(str(scripted[0]), dtype="float32", max_model_len=512)
    for messages, tools, _ in SCRIPTS:
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=1), tools=tools, use_tqdm=False)[0]
        assert out.prompt_token_ids == chat_prompt_ids(messages, tools)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chat_says_each_script(scripted, prefix_caching):
    llm = LLM(str(scripted[0]), dtype="float32", max_model_len=512, enable_prefix_caching=prefix_caching)
    for messages, tools, text in SCRIPTS:
        _check(llm.chat(messages, GREEDY, tools=tools, use_tqdm=False)[0], text)


def test_one_batch_with_prefix_caching(scripted):
    llm = LLM(str(scripted[0]), dtype="float32", max_model_len=512, enable_prefix_caching=True)
    tool_scripts = [s for s in SCRIPTS if s[1] is not None]
    for run in range(2):  # the second run restores the prompts from the prefix cache
        outs = llm.chat([m for m, _, _ in tool_scripts], GREEDY, tools=TOOLS, use_tqdm=False)
        for out, (_, _, text) in zip(outs, tool_scripts):
            _check(out, text)
        outs = llm.generate([chat_prompt_ids(m, t) for m, t, _ in SCRIPTS], GREEDY, use_tqdm=False)
        for out, (_, _, text) in zip(outs, SCRIPTS):
            _check(out, text)
            assert run == 0 or out.num_cached_tokens > 0


def _complete(engine: LLMEngine, request_id: str, prompt: str, params: SamplingParams):
    """A /v1/completions-style request straight on the engine: text prompt in, final output out."""
    engine.add_request(request_id, prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


def test_completions_are_deterministic(scripted):
    engine = LLMEngine(EngineArgs(model=str(scripted[0]), dtype="float32", max_model_len=512))
    messages, tools, text = SCRIPTS[1]
    prompt = tiny_tokenizer().apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    first, second = (_complete(engine, f"cmpl-{i}", prompt, GREEDY) for i in range(2))
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == response_ids(text)
    assert first.outputs[0].text == second.outputs[0].text == text
    plain = SamplingParams(temperature=0, max_tokens=24)
    a, b = (_complete(engine, f"plain-{i}", "Hello, Kimi", plain) for i in range(2))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) >= 1
    engine.check_idle()
