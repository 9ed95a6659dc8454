"""What vLLM users' tooling expects of the server (issue 19 item 6), on a real server process:
X-Request-Id, /ping, HEAD /health, POST /reset_prefix_cache, the `vllm:` metric names, and
`kimiserve bench serve` driven with `vllm bench serve`'s flags."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from server_utils import LIGHT_SERVER, ROOT, metrics, running_server, wait_until

pytestmark = pytest.mark.fixed_threads  # servers run with one torch thread: OMP_NUM_THREADS changes nothing

PROMPT = list(range(100, 160))  # 60 token ids: a few full pages, so a repeat can hit the prefix cache


@pytest.fixture(scope="module")
def server():
    with running_server(*LIGHT_SERVER, "--api-key", "sekrit") as s:
        yield s


AUTH = {"Authorization": "Bearer sekrit"}


def complete(server, prompt=PROMPT, max_tokens=4, **headers) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                           "temperature": 0}, headers={**AUTH, **headers},
                      timeout=60)


def idle(server) -> dict[str, float]:
    return wait_until(lambda: (lambda m: m if m["kimiserve:num_requests_running"] == 0
                               and m["kimiserve:num_requests_waiting"] == 0 else None)(metrics(server.url)), 10)


def test_request_id_header(server):
    r = complete(server, **{"X-Request-Id": "client-id-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-id-42"
    generated = [complete(server).headers["x-request-id"] for _ in range(2)]
    assert all(len(g) == 32 and int(g, 16) >= 0 for g in generated) and generated[0] != generated[1]
    # errors and refusals carry it too: a 400, a 401 from the key check, a 404, a stream
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, headers=AUTH)
    assert bad.status_code == 400 and len(bad.headers["x-request-id"]) == 32
    denied = httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": "abc"})
    assert denied.status_code == 401 and denied.headers["x-request-id"] == "abc"
    assert httpx.get(f"{server.url}/nope").headers["x-request-id"]
    with httpx.stream("POST", f"{server.url}/v1/completions", headers={**AUTH, "X-Request-Id": "s1"},
                      json={"prompt": PROMPT, "max_tokens": 2, "stream": True}) as s:
        assert s.status_code == 200 and s.headers["x-request-id"] == "s1"
        assert s.read().endswith(b"data: [DONE]\n\n")


def test_ping_and_head_health(server):
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{server.url}/ping")
        assert r.status_code == 200, r.text
    head = httpx.head(f"{server.url}/health")
    assert head.status_code == 200 and head.content == b""
    assert httpx.put(f"{server.url}/ping").status_code == 405


def test_reset_prefix_cache(server):
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 401  # it changes state: key needed
    prompt = list(range(300, 380))
    assert complete(server, prompt).status_code == 200
    before = idle(server)
    assert complete(server, prompt).status_code == 200
    hit = idle(server)
    assert hit["kimiserve:prefix_cache_hits_total"] > before["kimiserve:prefix_cache_hits_total"]  # a hit
    assert hit["kimiserve:cache_pages_cached"] > 0
    r = httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH)
    assert r.status_code == 200 and r.json()["freed_pages"] > 0
    after_reset = idle(server)
    assert after_reset["kimiserve:cache_pages_cached"] == 0
    assert complete(server, prompt).status_code == 200
    miss = idle(server)
    assert miss["kimiserve:prefix_cache_hits_total"] == after_reset["kimiserve:prefix_cache_hits_total"]  # a miss
    assert miss["kimiserve:prefix_cache_queries_total"] > after_reset["kimiserve:prefix_cache_queries_total"]


def test_reset_leaves_running_requests_alone(server):
    """A reset while a stream runs: the stream finishes with all its tokens, and no page leaks."""
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 40, "stream": True, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}) as s:
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
        assert httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH).status_code == 200
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["usage"]["completion_tokens"] == 40
    m = idle(server)
    assert m["kimiserve:cache_pages_used_by_requests"] == 0


def test_vllm_metric_names_count_the_requests(server):
    before_k, before_v = idle(server), metrics(server.url, "vllm:")
    n, prompt_len, out_len = 3, len(PROMPT), 5
    for i in range(n):
        r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": [7 + i] + PROMPT, "max_tokens": out_len, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == out_len
    idle(server)
    after = metrics(server.url, "vllm:")

    def delta(name):
        return after[name] - before_v.get(name, 0.0)

    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"vllm:{name}" in after
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    assert delta("vllm:prompt_tokens_total") == n * (prompt_len + 1)
    assert delta("vllm:generation_tokens_total") == n * out_len
    assert delta('vllm:request_success_total{finished_reason="length"}') == n
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds"):
        assert delta(f"vllm:{hist}_count") == n, hist
        assert delta(f"vllm:{hist}_sum") >= 0
    assert delta("vllm:inter_token_latency_seconds_count") == n * (out_len - 1)
    # the phases add up: queue + prefill + decode <= e2e (the e2e clock starts earlier, at the HTTP side)
    phases = sum(delta(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    assert 0 < phases <= delta("vllm:e2e_request_latency_seconds_sum") + 1e-6
    kimi = metrics(server.url)  # the kimiserve: names carry the same values
    for name in ("prompt_tokens_total", "generation_tokens_total", "request_queue_time_seconds_count"):
        assert kimi[f"kimiserve:{name}"] == after[f"vllm:{name}"]
    assert before_k["kimiserve:prompt_tokens_total"] == before_v["vllm:prompt_tokens_total"]


def test_bench_serve_with_vllm_flags(server, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kimiserve.entrypoints.cli", "bench", "serve", "--backend", "vllm", "--host",
         "127.0.0.1", "--port", str(server.port), "--dataset-name", "random", "--random-input-len", "16",
         "--random-output-len", "4", "--num-prompts", "4", "--api-key", "sekrit", "--save-result", "--result-dir",
         str(tmp_path), "--result-filename", "bench.json", "--disable-tqdm"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["completed"] == 4 and data["failed"] == 0 and data["backend"] == "vllm"
    assert data["total_input_tokens"] == 64 and data["total_output_tokens"] == 16
