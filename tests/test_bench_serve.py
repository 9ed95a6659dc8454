"""`kimiserve bench serve` against a fake OpenAI-compatible SSE server run in-process."""

import argparse
import asyncio
import contextlib
import json
import math
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kimiserve.bench.serve import BenchConfig, add_cli_arguments, arrival_gaps, main, make_prompts, run_benchmark

pytestmark = pytest.mark.fixed_threads  # no torch: the client against a fake server: OMP_NUM_THREADS changes nothing

FIRST_DELAY, GAP = 0.05, 0.02


def make_app(state: dict) -> FastAPI:
    """Streams `max_tokens` tokens: FIRST_DELAY before the first, GAP between chunks. `state` sets the mode
    ("ok", "fail": every 3rd request HTTP 500 and every 3rd an error event) and records requests."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        state["bodies"].append(body)
        state["auth"].append(request.headers.get("authorization"))
        index = state["count"]
        state["count"] += 1
        if state["mode"] == "fail" and index % 3 == 0:
            return JSONResponse({"error": {"message": "boom 500", "code": 500}}, status_code=500)
        n, per_chunk = body["max_tokens"], state.get("per_chunk", 1)
        prompt_tokens = len(body["prompt"]) if not chat else 7

        def chunk(text, finish=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": text} if role else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return f"data: {json.dumps({'id': 'x', 'model': body['model'], 'choices': [choice]})}\n\n"

        async def stream():
            state["inflight"] += 1
            state["max_inflight"] = max(state["max_inflight"], state["inflight"])
            try:
                if chat:
                    yield chunk("", role=True)
                await asyncio.sleep(FIRST_DELAY)
                sent = 0
                while sent < n:
                    k = min(per_chunk, n - sent)
                    sent += k
                    if state["mode"] == "fail" and index % 3 == 1 and sent > 2:
                        yield f"data: {json.dumps({'error': {'message': 'engine died', 'code': 500}})}\n\n"
                        return
                    yield chunk(" tok" * k, finish="length" if sent == n and not chat else None)
                    if sent < n:
                        await asyncio.sleep(GAP)
                if chat:
                    yield chunk("", finish="length")
                if state.get("usage", True):
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                             "total_tokens": prompt_tokens + n}
                    yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["inflight"] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    return app


@contextlib.contextmanager
def fake_server():
    """The fake app on a uvicorn thread: yields (base URL, state)."""
    state = {}
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(make_app(state), log_level="error", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.started
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", state
    finally:
        srv.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def server():
    with fake_server() as s:
        yield s


def reset(state, mode="ok", **fake):
    state.clear()
    state.update(mode=mode, bodies=[], auth=[], count=0, inflight=0, max_inflight=0, **fake)


def run(server, mode="ok", fake=None, **kw):
    """Run one benchmark against the fake server in `mode`, with `fake` settings (per_chunk, usage)."""
    url, state = server
    reset(state, mode, **(fake or {}))
    cfg = BenchConfig(base_url=url, disable_tqdm=True, **kw)
    return asyncio.run(run_benchmark(cfg)), state


def test_completions_counts_and_latencies(server):
    n_out = 6
    res, state = run(server, num_prompts=8, concurrency=4, input_len=12, output_len=n_out, vocab_size=50, seed=3)
    assert res["completed"] == 8 and res["failed"] == 0 and res["errors"] == [""] * 8
    assert res["output_lens"] == [n_out] * 8 and res["total_output_tokens"] == 8 * n_out
    assert res["input_lens"] == [12] * 8 and res["total_input_tokens"] == 96
    assert res["model_id"] == "fake-model"
    body = state["bodies"][0]
    assert body["model"] == "fake-model" and body["max_tokens"] == n_out and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0
    assert all(len(b["prompt"]) == 12 and all(0 <= t < 50 for t in b["prompt"]) for b in state["bodies"])
    assert state["max_inflight"] <= 4
    served = FIRST_DELAY + (n_out - 1) * GAP
    for ttft, itl, e2el in zip(res["ttfts"], res["itls"], res["e2els"]):
        assert FIRST_DELAY * 0.9 <= ttft < FIRST_DELAY + 3
        assert len(itl) == n_out - 1 and all(0 <= g < GAP + 3 for g in itl)
        assert served * 0.9 <= e2el < served + 3 and e2el >= ttft + sum(itl) - 1e-6
    assert GAP * 0.3 <= res["mean_itl_ms"] / 1000 < GAP + 1
    assert GAP * 0.3 <= res["median_tpot_ms"] / 1000 < GAP + 1
    assert res["p99_ttft_ms"] >= res["p50_ttft_ms"] >= FIRST_DELAY * 900
    assert res["mean_e2el_ms"] >= served * 900 and res["std_e2el_ms"] >= 0
    assert res["duration"] >= served * 0.9 * 2
    assert res["request_throughput"] == pytest.approx(8 / res["duration"])
    assert res["output_throughput"] == pytest.approx(48 / res["duration"])
    assert res["total_token_throughput"] == pytest.approx(144 / res["duration"])


def test_concurrency_is_respected(server):
    res, state = run(server, num_prompts=9, concurrency=3, input_len=4, output_len=4)
    assert res["completed"] == 9 and state["max_inflight"] == 3 and res["max_concurrency"] == 3
    # three waves of three requests, each about FIRST_DELAY + 3 * GAP long
    assert res["duration"] >= 3 * (FIRST_DELAY + 3 * GAP) * 0.9


def test_failures_are_counted_with_messages(server):
    res, _ = run(server, mode="fail", num_prompts=9, concurrency=1, input_len=4, output_len=5)
    assert res["completed"] == 3 and res["failed"] == 6
    errors = sorted(e for e in res["errors"] if e)
    assert errors == ["HTTP 500: boom 500"] * 3 + ["error event in stream: engine died"] * 3
    assert [n for n, e in zip(res["output_lens"], res["errors"]) if not e] == [5] * 3
    assert res["total_output_tokens"] == 15 and len(res["ttfts"]) == 9


def test_chat_multi_token_chunks_and_no_usage(server):
    res, state = run(server, endpoint="/v1/chat/completions", num_prompts=3, input_len=20, output_len=7,
                     fake={"per_chunk": 2, "usage": False}, api_key="secret")
    assert res["completed"] == 3
    body = state["bodies"][0]
    assert body["messages"][0]["role"] == "user" and len(body["messages"][0]["content"].split()) == 20
    assert state["auth"] == ["Bearer secret"] * 3
    # 4 chunks (2+2+2+1 tokens) -> 3 gaps; without usage each chunk counts once
    assert all(len(itl) == 3 for itl in res["itls"]) and res["output_lens"] == [4] * 3
    assert all(t >= FIRST_DELAY * 0.9 for t in res["ttfts"])   # the role-only chunk is not the first token
    assert res["input_lens"] == [20] * 3


def test_chat_usage_counts_multi_token_chunks(server):
    res, _ = run(server, endpoint="/v1/chat/completions", num_prompts=2, input_len=5, output_len=7,
                 fake={"per_chunk": 3})
    assert res["output_lens"] == [7, 7] and res["input_lens"] == [7, 7]
    assert all(len(itl) == 2 for itl in res["itls"])


def test_request_rate_and_prompts_are_seeded():
    gaps = arrival_gaps(4000, rate=50.0, seed=1)
    assert gaps == arrival_gaps(4000, rate=50.0, seed=1) and gaps != arrival_gaps(4000, rate=50.0, seed=2)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.1)
    assert arrival_gaps(3, math.inf) == [0.0] * 3
    cfg = BenchConfig(base_url="http://x", num_prompts=5, input_len=9, vocab_size=10, seed=4)
    assert make_prompts(cfg) == make_prompts(cfg) and all(len(p) == 9 for p in make_prompts(cfg))


def test_request_rate_spreads_arrivals(server):
    res, _ = run(server, num_prompts=6, concurrency=6, request_rate=20.0, input_len=4, output_len=2)
    assert res["completed"] == 6 and res["request_rate"] == 20.0
    assert res["duration"] >= sum(arrival_gaps(6, 20.0)) * 0.9


def parse(argv):
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    return parser.parse_args(argv)


def test_main_writes_json_and_table(server, tmp_path, capsys):
    out = tmp_path / "res.json"
    args = parse(["--base-url", server[0] + "/", "--num-prompts", "4", "--input-len", "8", "--output-len", "3",
                  "--result-file", str(out), "--disable-tqdm"])
    reset(server[1])
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Mean TTFT (ms):" in printed and "P99 E2EL (ms):" in printed
    data = json.loads(out.read_text())
    for key in ("completed", "failed", "duration", "request_throughput", "input_throughput", "output_throughput",
                "total_token_throughput", "total_input_tokens", "total_output_tokens", "ttfts", "itls", "e2els",
                "output_lens", "input_lens", "errors", "model_id", "max_concurrency", "request_rate"):
        assert key in data
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in data
    assert data["completed"] == 4 and data["output_lens"] == [3] * 4 and data["request_rate"] == "inf"


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "-1"], "--num-prompts must be an integer >= 1"),
    (["--concurrency", "0"], "--concurrency must be an integer >= 1"),
    (["--request-rate", "-2"], "--request-rate must be > 0"),
    (["--output-len", "0"], "--output-len must be an integer >= 1"),
])
def test_main_rejects_bad_arguments(argv, message, capsys):
    assert main(parse(["--base-url", "http://127.0.0.1:9"] + argv)) == 2
    assert message in capsys.readouterr().err


def test_bad_url_and_unreachable_server(capsys):
    assert main(parse(["--base-url", "localhost:8000"])) == 2
    assert "--base-url must look like http://HOST:PORT" in capsys.readouterr().err
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(ValueError, match="cannot reach the server"):
        asyncio.run(run_benchmark(BenchConfig(base_url=f"http://127.0.0.1:{port}", model="m", timeout=5)))
    assert main(parse(["--base-url", f"http://127.0.0.1:{port}", "--disable-tqdm"])) == 2
    assert "cannot reach the server" in capsys.readouterr().err


def test_timeout_fails_requests():
    # a server of its own: the timed-out requests may reach it after the test (late on a loaded
    # machine), where they would count as the next test's requests
    with fake_server() as own:
        res, _ = run(own, num_prompts=2, input_len=4, output_len=3, timeout=0.01)
    assert res["completed"] == 0 and res["failed"] == 2
    assert all(e.startswith("timed out after 0.01 s") for e in res["errors"])


def test_vllm_bench_serve_flags(server, tmp_path, capsys):
    """`vllm bench serve`'s common flags: --backend picks the endpoint, --host/--port the server, the random
    dataset's lengths, --save-result with vLLM's file name under --result-dir."""
    url, state = server
    port = url.rsplit(":", 1)[1]
    args = parse(["--backend", "openai-chat", "--host", "127.0.0.1", "--port", port, "--dataset-name", "random",
                  "--random-input-len", "9", "--random-output-len", "4", "--num-prompts", "3", "--ignore-eos",
                  "--max-concurrency", "2", "--save-result", "--result-dir", str(tmp_path / "out"),
                  "--disable-tqdm"])
    reset(state)
    assert main(args) == 0
    (saved,) = (tmp_path / "out").iterdir()
    assert saved.name.startswith("openai-chat-infqps-concurrency2-fake-model-") and saved.suffix == ".json"
    data = json.loads(saved.read_text())
    assert data["backend"] == "openai-chat" and data["endpoint"] == "/v1/chat/completions"
    assert data["completed"] == 3 and data["input_len"] == 9 and data["output_lens"] == [4] * 3
    assert data["base_url"] == url
    assert [len(b["messages"][0]["content"].split()) for b in state["bodies"]] == [9] * 3
    assert all(b["max_tokens"] == 4 for b in state["bodies"])
    args = parse(["--backend", "vllm", "--base-url", url, "--random-input-len", "10", "--random-output-len", "6",
                  "--random-range-ratio", "0.5", "--num-prompts", "12", "--seed", "1", "--save-result",
                  "--result-dir", str(tmp_path), "--result-filename", "r.json", "--disable-tqdm"])
    reset(state)
    assert main(args) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["backend"] == "vllm" and data["endpoint"] == "/v1/completions" and data["completed"] == 12
    lens = [len(b["prompt"]) for b in state["bodies"]]
    outs = sorted(b["max_tokens"] for b in state["bodies"])
    assert all(5 <= n <= 15 for n in lens) and len(set(lens)) > 1 and sorted(data["input_lens"]) == sorted(lens)
    assert all(3 <= n <= 9 for n in outs) and len(set(outs)) > 1 and sorted(data["output_lens"]) == outs
    with pytest.raises(SystemExit):
        parse(["--dataset-name", "sharegpt"])
