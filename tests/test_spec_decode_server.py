"""`kimiserve serve --speculative-config`: greedy completions equal the server without speculation, and
/metrics counts the drafts under vLLM's names."""

from __future__ import annotations

import re

import httpx
import pytest

from server_utils import LIGHT_SERVER, running_server

pytestmark = pytest.mark.fixed_threads  # servers run with one torch thread: OMP_NUM_THREADS changes nothing

PROMPT = [3, 7, 11, 19, 3, 7, 11, 19, 3, 7, 11, 23, 3, 7]
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "allowed_token_ids": [3, 7, 11, 19, 23]}


def completion(server) -> str:
    r = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def metric(text: str, name: str) -> float:
    m = re.search(rf'^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$', text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_server_speculative_config_and_metrics():
    with running_server(*LIGHT_SERVER) as plain:
        want = completion(plain)
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    with running_server(*LIGHT_SERVER, "--speculative-config", spec) as server:
        assert completion(server) == want
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        drafts = metric(text, "vllm:spec_decode_num_drafts_total")
        drafted = metric(text, "vllm:spec_decode_num_draft_tokens_total")
        accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total")
        first = metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total")  # position 0 comes first
        assert 0 < drafts <= drafted and 0 < accepted <= drafted and 0 < first <= drafts
        assert 'position="2"' in text
    with pytest.raises(RuntimeError, match="(?s)exited with 2.*speculative_config needs .num_speculative_tokens"):
        with running_server(*LIGHT_SERVER, "--speculative-config", '{"method": "ngram"}'):
            pass
