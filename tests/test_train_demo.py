"""The demo model's training path: loss falls, the release-format export loads with equal logits."""

import json
import random
import re

import pytest
import torch

from kimiserve.demo import corpus
from kimiserve.demo.train import (TOKENIZER_DIR, BatchStream, TrainArgs, batch_loss, export, load_float_weights,
                                  tiny_train_config, train)
from kimiserve.model.loader import load_model
from kimiserve.model.model import build_model
from kimiserve.model.training import TrainContext, enable_training, train_logits
from kimiserve.tokenizer import load_tokenizer


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    model = build_model(tiny_train_config(routed_experts_mxfp4=False), torch.float32, seed=seed)
    return model, enable_training(model)


def test_loss_falls_and_export_round_trips(tmp_path):
    model, params = _tiny_model()
    ids, mask = (torch.from_numpy(a) for a in next(iter(BatchStream(0, 2048, 384, 100, pool=32))))
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses, kls = [], []
    for step in range(10):
        opt.zero_grad()
        ctx = TrainContext(sparse=step >= 5, kda_chunk_size=32)
        ce, kl, _, _ = batch_loss(model, ids, mask, ctx)
        (ce + kl).backward()
        opt.step()
        losses.append(ce.item())
        kls.append(kl.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(k >= 0 for k in kls) and kls[0] > 0, kls
    # the indexer is trained (its weights moved) by the KL alone: the LM loss does not reach it
    idx = model.model.layers[1].self_attn.indexer
    assert idx.wk.weight.grad is not None and idx.wk.weight.grad.abs().sum() > 0

    # export: round non-expert weights to bf16 first, so the float model and the release agree exactly
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." not in name and p.dtype == torch.float32:
                p.copy_(p.to(torch.bfloat16))
    folder = export(model, tmp_path / "demo")
    for f in ("config.json", "chat_template.jinja", "tokenizer.json", "tiktoken.model", "tokenizer_config.json"):
        assert (folder / f).is_file()
    cfg = json.loads((folder / "config.json").read_text())["text_config"]
    assert "mxfp4" in cfg["quantization_config"]["format"] and cfg["index_topk"] == 16
    loaded = load_model(folder, torch.float32)
    assert loaded.model.layers[1].block_sparse_moe.experts.w1_packed.dtype == torch.uint8
    x = ids[:2, :200]
    for m in model.modules():
        if hasattr(m, "fake_quant"):
            m.fake_quant = True
    with torch.no_grad():
        ref = train_logits(model, x, TrainContext(sparse=True))
    got = loaded(x)
    assert torch.allclose(got, ref, atol=2e-4, rtol=1e-4), (got - ref).abs().max()


def test_train_loop_writes_a_loadable_model(tmp_path):
    args = TrainArgs(out=str(tmp_path / "m"), device="cpu", max_minutes=5, max_steps=3, tokens_per_step=1024,
                     max_seq_len=320, max_filler_tokens=50, warmup_steps=2, log_every=1, eval_examples=3,
                     num_workers=0)
    lines = []
    _, records = train(tiny_train_config(), args, log=lines.append)
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["step_s"] > 0 for r in steps)
    assert any(r["event"] == "final_eval" for r in records)
    assert json.loads(lines[-1])["event"] == "done"
    info = json.loads((tmp_path / "m" / "training_info.json").read_text())
    assert info["steps"] == 3 and info["final"]
    net = load_model(tmp_path / "m", torch.bfloat16)
    assert net(torch.tensor([768, 5, 6])).shape == (3, 1024)


def test_init_from_starts_a_run_from_an_exported_model(tmp_path):
    """A fine-tune starts from the exported weights: every tensor as stored, the MXFP4 experts dequantised, so
    the float model's logits equal the release model's."""
    model, _ = _tiny_model(seed=3)
    folder = export(model, tmp_path / "base")
    release = load_model(folder, torch.float32)
    started = build_model(tiny_train_config(routed_experts_mxfp4=False), torch.float32, seed=7)
    load_float_weights(started, folder)
    x = torch.tensor([[768, 5, 6, 9, 40, 41, 7, 5, 6, 9]])
    with torch.no_grad():
        got = train_logits(started, x, TrainContext(sparse=True))
    assert torch.allclose(got[0], release(x[0]), atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="not this --model's shape"):
        load_float_weights(build_model(tiny_train_config(hidden_size=32, routed_experts_mxfp4=False), torch.float32,
                                       seed=0), folder)


def test_corpus_renders_through_the_chat_template():
    tok = load_tokenizer(TOKENIZER_DIR)
    rng = random.Random(1)
    seen = set()
    for _ in range(300):
        ex = corpus.sample(rng, 200)
        seen.add(ex.kind)
        ids, mask = corpus.render(tok, ex)
        text = tok.decode(ids)
        # segment-wise tokenisation equals tokenising the whole text (segments end at special tokens)
        assert tok.encode(text, allow_special=True) == ids
        target = tok.decode([i for i, m in zip(ids, mask) if m])
        assert target.endswith(corpus.generation_text(ex.messages[-1]))
        assert text.startswith(tok.apply_chat_template(ex.prompt_messages, tools=ex.tools, add_generation_prompt=True))
        if ex.messages[-1].get("tool_calls"):  # a tool-call turn renders in the history as generated
            full = tok.apply_chat_template(ex.messages, tools=ex.tools, add_generation_prompt=False)
            assert full == text
    assert seen == {"chat", "multi_turn", "arithmetic", "word_problem", "tool_call", "tool_answer", "no_tool",
                    "decline", "passkey", "edit"}


@pytest.mark.parametrize("seed", range(30))
def test_file_edit_reply_is_the_prompt_file_with_one_change(seed):
    """An edit example's reply is the prompt's file again, every line kept but the one change asked for: the
    repeated span that n-gram speculation drafts from the prompt."""
    ex = corpus.edit(random.Random(seed))
    ask, reply = ex.messages[0]["content"], ex.messages[-1]["content"]
    file = re.search(r"```\n(.*?)\n```", ask, re.S).group(1).split("\n")
    edited = re.fullmatch(r"```\n(.*)\n```", reply, re.S).group(1).split("\n")
    assert ex.answer == "\n".join(edited) and len(file) >= 6
    keys = lambda lines: [line.split(" = ")[0] for line in lines]  # noqa: E731
    if match := re.search(r"(?:Set|Change|make) (\w+) (?:to )?(\S+)\.", ask):
        key, value = match.groups()
        i = keys(file).index(key)
        assert edited == file[:i] + [f"{key} = {value}"] + file[i + 1:] and file[i] != edited[i]
    elif match := re.search(r"(?:Remove the|Delete the) (\w+) ", ask):
        i = keys(file).index(match.group(1))
        assert edited == file[:i] + file[i + 1:]
    else:
        line = re.search(r"(?:Add|the line) (\w+ = \S+?)(?: at the end)?\. Reply", ask).group(1)
        assert edited == file + [line] and line.split(" = ")[0] not in keys(file)


FACT = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")
PLACE = re.compile(r"(\d+) = ((?:\d+ (?:hundreds|tens|ones)(?: \+ )?)+)\.")
WRITE = re.compile(r"write (?:the carry )?(\d+)")
VALUE = {"ones": 1, "tens": 10, "hundreds": 100}


@pytest.mark.parametrize("a,b", [(47, 38), (999, 1), (5, 0), (120, 85), (100, 1), (900, 899), (0, 0), (305, 7)])
def test_worked_arithmetic_states_only_true_facts(a, b):
    hi, lo = max(a, b), min(a, b)
    for text, result in ((corpus.addition_steps(a, b), a + b), (corpus.subtraction_steps(hi, lo), hi - lo),
                         (corpus.multiplication_steps(a % 100, 7), a % 100 * 7)):
        assert text.endswith(f"= {result}."), text
        facts = FACT.findall(text)
        assert facts, text
        for x, op, y, z in facts:  # every column fact, borrow and carry step is true
            assert {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op] == int(z), (text, x, op, y, z)
        for n, parts in PLACE.findall(text):  # the place-value decompositions add up to the operand
            assert sum(int(d) * VALUE[p] for d, p in (t.split() for t in parts.split(" + "))) == int(n), text
        writes = WRITE.findall(text)  # the written digits, ones first, spell the result
        assert writes or len(facts) == 1, text  # (a one-digit product is a single fact)
        if writes:
            assert int("".join(reversed(writes))) == result, (text, writes)


def test_draft_model_shares_the_vocabulary_in_a_quarter_of_the_layers():
    """The draft (v4) keeps the target's vocabulary and attention kinds in a quarter of its layers, with dense
    MLPs only: on a GPU a small model's step costs what its kernel launches cost, so layers and routers count,
    not widths; it still has a fraction of the target's active parameters."""
    def active(config):
        model = build_model(config.replace(routed_experts_mxfp4=False), torch.float32, seed=0)
        routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and "shared" not in n)
        total = sum(p.numel() for p in model.parameters())
        return total - routed * (1 - config.num_experts_per_token / config.num_experts)

    demo, draft = TrainArgs(model="demo").model_config(), TrainArgs(model="demo-draft").model_config()
    for field in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "architecture"):
        assert getattr(draft, field) == getattr(demo, field)
    assert draft.index_topk == demo.index_topk and draft.full_attn_layers and draft.kda_layers
    assert 4 * draft.num_hidden_layers <= demo.num_hidden_layers
    assert draft.first_k_dense_replace >= draft.num_hidden_layers  # no routed experts
    assert 2 <= active(demo) / active(draft) <= 8
    with pytest.raises(ValueError, match="demo-draft"):
        TrainArgs(model="huge").model_config()


def test_mixture_overrides_name_kinds_and_shares():
    mixture = corpus.parse_mixture("edit=0.5, passkey=0")
    assert mixture["edit"] == 0.5 and mixture["passkey"] == 0 and mixture["arithmetic"] == corpus.MIXTURE["arithmetic"]
    rng = random.Random(0)
    kinds = [corpus.sample(rng, 50, mixture).kind for _ in range(400)]
    assert "passkey" not in kinds and 140 < kinds.count("edit") < 260
    for text, match in (("edits=0.4", "unknown kind"), ("edit=lots", "not kind=share"), ("edit=-1", ">= 0"),
                        (",".join(f"{k}=0" for k in corpus.KINDS), "every share is 0")):
        with pytest.raises(ValueError, match=match):
            corpus.parse_mixture(text)
