"""LoRA adapters and weight updates through a real `kimiserve serve` process (default mode and
--batch-invariant) with the openai client: --lora-modules at start, /v1/load_lora_adapter and
/v1/unload_lora_adapter at run time (vLLM's names), adapters chosen by `model` and listed by /v1/models,
/update_weights from a path; the answers equal an in-process engine's of the same mode, bit for bit (one
request at a time: the same computation)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from engine_utils import random_prompts
from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.lora import LoRAAdapter
from kimiserve.rl.weight_sync import save_weights
from kimiserve.sampling_params import SamplingParams
from server_utils import running_server

pytestmark = pytest.mark.fixed_threads

PROMPT = random_prompts([20], seed=4)[0]


def local_engine(adapters=(), batch_invariant=True):
    e = LLMEngine(EngineArgs(model="tiny", max_model_len=256, num_pages=300, batch_invariant=batch_invariant,
                             enable_lora=True))
    for name, adapter in adapters:
        e.load_lora_adapter(name, adapter)
    return e


def local_logprobs(e, lora_name=None):
    e.add_request("x", PROMPT, SamplingParams(temperature=0.0, max_tokens=6, logprobs=0), lora_name=lora_name)
    out = None
    while e.has_unfinished_requests():
        for o in e.step():
            out = o if o.finished else out
    return out.outputs[0].token_ids, [lp.logprob for lp in out.outputs[0].logprobs]


def served(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=0)
    choice = r.choices[0]
    return choice.logprobs.token_logprobs, r.model


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["batch_invariant", "default"])
def test_lora_adapters_and_weight_updates_through_the_server(tmp_path, batch_invariant):
    base_engine = local_engine(batch_invariant=batch_invariant)
    a = LoRAAdapter.init(base_engine.model, "a", rank=4, random_b=True, seed=1)
    b = LoRAAdapter.init(base_engine.model, "b", rank=8, random_b=True, seed=2)
    a.save_pretrained(str(tmp_path / "a"))
    b.save_pretrained(str(tmp_path / "b"))
    want_base = local_logprobs(base_engine)[1]
    want_a = local_logprobs(local_engine([("a", a)], batch_invariant), "a")[1]
    want_b = local_logprobs(local_engine([("b", b)], batch_invariant), "b")[1]
    assert want_a != want_base and want_b != want_base
    mode = ["--batch-invariant"] if batch_invariant else []
    with running_server("--max-model-len", "256", "--num-pages", "300", *mode,
                        "--lora-modules", f"a={tmp_path / 'a'}") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny", "a"]
        assert served(client, "tiny") == (want_base, "tiny")
        assert served(client, "a") == (want_a, "a")
        with pytest.raises(openai.NotFoundError):
            served(client, "b")
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(tmp_path / "b")})
        assert r.status_code == 200, r.text
        assert served(client, "b") == (want_b, "b")
        assert {m.id for m in client.models.list().data} == {"tiny", "a", "b"}
        bad = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        assert httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "b"}).status_code == 400
        assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            served(client, "b")
        assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 400
        # new weights from a path: the server then answers as an engine with those weights
        with torch.no_grad():
            for p in base_engine.model.parameters():
                if p.dtype.is_floating_point:
                    p.mul_(1.01)
        save_weights(base_engine.model, str(tmp_path / "w"))
        r = httpx.post(f"{server.url}/update_weights", json={"path": str(tmp_path / "w")})
        assert r.status_code == 200, r.text
        base_engine.allocator.evict_all()
        assert served(client, "tiny") == (local_logprobs(base_engine)[1], "tiny")
        assert served(client, "tiny")[0] != want_base
        missing = httpx.post(f"{server.url}/update_weights", json={"path": str(tmp_path / "nothing")})
        assert missing.status_code == 400
