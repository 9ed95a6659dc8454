"""benchmarks/demo_eval.py's scoring: a reply equal to the corpus target scores perfectly; wrong ones do not."""

import importlib.util
import json
from pathlib import Path

import pytest

from kimiserve.demo import corpus

pytestmark = pytest.mark.fixed_threads  # no torch: scoring of strings: OMP_NUM_THREADS changes nothing

_spec = importlib.util.spec_from_file_location("demo_eval", Path(__file__).parent.parent / "benchmarks" / "demo_eval.py")
demo_eval = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo_eval)


def _reply(ex: corpus.Example) -> str:
    return corpus.generation_text(ex.messages[-1]).removesuffix(corpus.TURN_END)


def test_targets_score_perfectly_and_kinds_are_balanced():
    examples = demo_eval.heldout(seed=3, n=6) + demo_eval.passkeys(3, [64, 128], 2)
    kinds = {}
    for ex in examples:
        kinds[ex.kind] = kinds.get(ex.kind, 0) + 1
        s = demo_eval.score(ex, _reply(ex))
        assert all(s.values()), (ex.kind, s, _reply(ex))
    assert kinds["arithmetic"] == kinds["tool_call"] == 6 and kinds["no_tool"] + kinds.get("decline", 0) == 6
    assert kinds["passkey"] == 4 and kinds["edit"] == 6
    # the edits come from a stream of their own: the other kinds' held-out sets are those of earlier tables
    assert demo_eval.heldout(3, 6, demo_eval.KINDS[:-1]) == demo_eval.heldout(3, 6)[:-6]


def test_wrong_replies_fail():
    ex = next(e for e in demo_eval.heldout(seed=4, n=4) if e.kind == "tool_call")
    call = ex.messages[-1]["tool_calls"][0]
    bad_args = dict(json.loads(call["function"]["arguments"]), extra="x")
    wrong = corpus.assistant("", "", [{**call, "function": {**call["function"], "arguments": json.dumps(bad_args)}}])
    s = demo_eval.score(ex, corpus.generation_text(wrong))
    assert s["called"] and s["parsed"] and not s["schema_valid"] and not s["correct"]
    s = demo_eval.score(ex, "<think></think>I do not know.")
    assert not s["called"]
    arith = next(e for e in demo_eval.heldout(seed=4, n=4) if e.kind == "arithmetic")
    assert not demo_eval.score(arith, f"<think>x</think>= {int(arith.answer) + 1}.")["exact"]
    edit = demo_eval.edits(seed=4, n=1)[0]
    unchanged = demo_eval.CODE_BLOCK.search(edit.messages[0]["content"]).group(1)  # the file as given
    assert not demo_eval.score(edit, f"<think>x</think>```\n{unchanged}\n```")["exact"]
    assert not demo_eval.score(edit, f"<think>x</think>```\n{edit.answer}\nextra = 1\n```")["exact"]


def test_spec_decode_demo_prompts_are_chat_templated_corpus_prompts():
    spec = importlib.util.spec_from_file_location("spec_decode", Path(__file__).parent.parent / "benchmarks" / "spec_decode.py")
    spec_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(spec_decode)
    from kimiserve.demo.train import TOKENIZER_DIR
    from kimiserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER_DIR)
    prompts = spec_decode.prompts_of("demo", 4, seed=0)
    assert prompts == spec_decode.prompts_of("demo", 4, seed=0) != spec_decode.prompts_of("demo", 4, seed=1)
    texts = [tokenizer.decode(p) for p in prompts]
    assert all(t.endswith("<|im_assistant|>assistant<|im_middle|>") for t in texts), texts
    assert "How many" in texts[0] and "<|im_system|>tool_declare" in texts[1], texts
    edits = spec_decode.prompts_of("edit", 2, seed=0)
    assert edits == [corpus.prompt_ids(tokenizer, ex) for ex in demo_eval.edits(0, 2)]
    assert all("Reply with the whole file." in tokenizer.decode(p) for p in edits)
