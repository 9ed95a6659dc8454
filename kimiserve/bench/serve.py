"""`kimiserve bench serve`: a streaming load generator for OpenAI-compatible servers.

Sends `--num-prompts` random prompts to `/v1/completions` (token-id prompts) or
`/v1/chat/completions` (random words), at most `--concurrency` in flight, arriving as a Poisson
process of `--request-rate` per second (inf: all at once), and reports TTFT, TPOT, ITL and
end-to-end latency like `vllm bench serve`. Times in the JSON arrays are seconds; the summary
statistics (`*_ms`) are milliseconds.

`vllm bench serve`'s common flags work too: `--backend` (vllm/openai: completions, openai-chat:
chat), `--host`/`--port` (instead of `--base-url`), `--dataset-name random` with
`--random-input-len`/`--random-output-len`/`--random-range-ratio`, `--ignore-eos`, and
`--save-result` (with `--result-dir`/`--result-filename`; vLLM's default file name).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field, fields
from datetime import datetime
from urllib.parse import urlsplit

import httpx
import numpy as np

from kimiserve.utils.progress import ProgressBar

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
BACKENDS = {"vllm": "/v1/completions", "openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
"""`vllm bench serve --backend` names and the endpoint each loads."""
DATASETS = ("random",)
METRICS = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))
PERCENTILES = (50, 90, 99)
WORDS = ("the of and to in is it you that he was for on are with as his they be at one have this from "
         "or had by word but what some we can out other were all there when up use your how said an each "
         "she which do their time if will way about many then them write would like so these her long make "
         "thing see him two has look more day could go come did number sound no most people my over know "
         "water than call first who may down side been now find any new work part take get place made live "
         "where after back little only round man year came show every good me give our under name very").split()


@dataclass
class BenchConfig:
    """Settings of one benchmark run; the CLI flags of the same names."""

    base_url: str | None = None
    """Server root; None: http://HOST:PORT from `host` and `port`."""
    model: str | None = None
    endpoint: str | None = None
    """None: the backend's endpoint."""
    backend: str = "openai"
    host: str = "127.0.0.1"
    port: int = 8000
    dataset_name: str = "random"
    random_range_ratio: float = 0.0
    """Prompt and output lengths are drawn uniformly from [len * (1 - r), len * (1 + r)] (vLLM's flag)."""
    num_prompts: int = 100
    concurrency: int = 16
    request_rate: float = math.inf
    burstiness: float = 1.0
    input_len: int = 128
    output_len: int = 64
    vocab_size: int = 1000
    seed: int = 0
    api_key: str | None = None
    result_file: str | None = None
    save_result: bool = False
    result_dir: str | None = None
    result_filename: str | None = None
    ignore_eos: bool = True
    disable_tqdm: bool = False
    timeout: float = 600.0

    @classmethod
    def from_args(cls, args: argparse.Namespace | "BenchConfig") -> "BenchConfig":
        if isinstance(args, cls):
            return args
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting; normalise the URL."""
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dataset_name not in DATASETS:
            raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)} (the only dataset here), got "
                             f"{self.dataset_name!r}")
        if self.endpoint is None:
            self.endpoint = BACKENDS[self.backend]
        if self.base_url is None:
            if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 < self.port < 65536:
                raise ValueError(f"--port must be in [1, 65535], got {self.port!r}")
            host = f"[{self.host}]" if ":" in self.host else self.host
            self.base_url = f"http://{host}:{self.port}"
        if not isinstance(self.random_range_ratio, (int, float)) or not 0 <= self.random_range_ratio < 1:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.random_range_ratio!r}")
        url = (self.base_url or "").strip().rstrip("/")
        try:
            parts = urlsplit(url)
            valid = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
            httpx.URL(url)
        except (ValueError, httpx.InvalidURL):
            valid = False
        if not valid:
            raise ValueError(f"--base-url must look like http://HOST:PORT, got {self.base_url!r}")
        self.base_url = url[:-3] if url.endswith("/v1") else url
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        for name in ("num_prompts", "concurrency", "input_len", "output_len", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        for name in ("request_rate", "burstiness", "timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value!r}")
        if self.api_key is None:
            self.api_key = os.environ.get("KIMISERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")


@dataclass
class RequestResult:
    """What one request measured; times in seconds from when it was sent."""

    success: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    prompt_len: int = 0
    output_len: int = 0


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `kimiserve bench serve` flags to `parser`."""
    a = parser.add_argument
    a("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)")
    a("--host", default="127.0.0.1", help="server host, when --base-url is not given")
    a("--port", type=int, default=8000, help="server port, when --base-url is not given")
    a("--model", default=None, help="model id to request (default: the first id of GET /v1/models)")
    a("--backend", default="openai", choices=tuple(BACKENDS),
      help="vllm bench serve's backend: vllm and openai load /v1/completions, openai-chat /v1/chat/completions")
    a("--endpoint", default=None, choices=ENDPOINTS, help="API to load (default: the backend's)")
    a("--dataset-name", default="random", choices=DATASETS, help="prompts: random token ids (or words for chat)")
    a("--num-prompts", type=int, default=100, help="number of requests to send")
    a("--concurrency", "--max-concurrency", dest="concurrency", type=int, default=16,
      help="most requests in flight at once")
    a("--request-rate", type=float, default=math.inf,
      help="mean arrivals per second (Poisson); inf sends all at once, limited by --concurrency")
    a("--burstiness", type=float, default=1.0,
      help="gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier, > 1 more even")
    a("--input-len", "--random-input-len", dest="input_len", type=int, default=128,
      help="prompt tokens per request (chat: about as many words)")
    a("--output-len", "--random-output-len", dest="output_len", type=int, default=64,
      help="max_tokens per request (sent with ignore_eos=true)")
    a("--random-range-ratio", type=float, default=0.0,
      help="draw each request's input and output lengths uniformly from [len * (1 - r), len * (1 + r)]")
    a("--ignore-eos", action="store_true", default=True,
      help="accepted as vllm bench serve's flag: requests always send ignore_eos=true (random prompts)")
    a("--vocab-size", type=int, default=1000, help="random prompt token ids are drawn from [0, vocab-size)")
    a("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    a("--api-key", default=None, help="Bearer token (default: $KIMISERVE_API_KEY, then $OPENAI_API_KEY)")
    a("--result-file", default=None, metavar="PATH", help="write the results as JSON to PATH")
    a("--save-result", action="store_true", help="write the results as JSON to --result-dir/--result-filename "
      "(default name: BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json, as vLLM names it)")
    a("--result-dir", default=None, help="folder of --save-result's file (default: the current one)")
    a("--result-filename", default=None, help="file name of --save-result's file")
    a("--disable-tqdm", action="store_true", help="no progress line on stderr")
    a("--timeout", type=float, default=600.0, help="seconds one request may take in all")


def _lengths(rng: random.Random, length: int, ratio: float, n: int) -> list[int]:
    if ratio == 0:
        return [length] * n
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_prompts(config: BenchConfig) -> list[list[int] | str]:
    """Seeded random prompts: token-id lists for completions, word strings for chat."""
    rng = random.Random(config.seed)
    lengths = _lengths(rng, config.input_len, config.random_range_ratio, config.num_prompts)
    if config.endpoint == "/v1/chat/completions":
        return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in lengths]
    return [[rng.randrange(config.vocab_size) for _ in range(n)] for n in lengths]


def output_lens(config: BenchConfig) -> list[int]:
    """max_tokens of each request (seeded; all `output_len` unless --random-range-ratio is set)."""
    return _lengths(random.Random(f"{config.seed}-outputs"), config.output_len, config.random_range_ratio,
                    config.num_prompts)


def arrival_gaps(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds to wait before each of `n` requests: gamma gaps with mean 1/rate (0 when rate is inf)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}-arrivals")
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


def _payload(config: BenchConfig, prompt: list[int] | str, max_tokens: int) -> dict:
    body = {"model": config.model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if config.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _error_text(obj) -> str:
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or json.dumps(err))
    return str(err)


def _chunk_tokens(choice: dict, chunk: dict, seen_usage: int) -> int | None:
    """Tokens carried by one streamed choice, or None when it carries none (role or finish-only chunk)."""
    delta = choice.get("delta")
    if delta is not None:
        text = any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls"))
        empty_token = "role" not in delta
    else:
        text = choice.get("text")
        empty_token = True
    if not text and not (empty_token and choice.get("finish_reason") is None):
        return None
    usage = chunk.get("usage") or {}
    if isinstance(usage.get("completion_tokens"), int) and usage["completion_tokens"] > seen_usage:
        return usage["completion_tokens"] - seen_usage
    logprobs = choice.get("logprobs") or {}
    items = logprobs.get("content") or logprobs.get("tokens")
    return len(items) if isinstance(items, list) and items else 1


async def send_request(client: httpx.AsyncClient, config: BenchConfig, prompt: list[int] | str,
                       max_tokens: int | None = None) -> RequestResult:
    """Stream one request and time its chunks; never raises for request failures."""
    res = RequestResult(prompt_len=len(prompt) if isinstance(prompt, list) else len(prompt.split()))
    counted, usage_out = 0, None
    start = last = time.perf_counter()
    try:
        body = _payload(config, prompt, config.output_len if max_tokens is None else max_tokens)
        async with client.stream("POST", config.endpoint, json=body) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                try:
                    detail = _error_text(json.loads(body))
                except ValueError:
                    detail = body.strip()[:500]
                res.error = f"HTTP {resp.status_code}: {detail}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                try:
                    chunk = json.loads(data)
                except ValueError:
                    res.error = f"invalid JSON in stream: {data[:200]!r}"
                    return res
                if not isinstance(chunk, dict) or chunk.get("error") or chunk.get("object") == "error":
                    res.error = f"error event in stream: {_error_text(chunk)}"
                    return res
                choices = chunk.get("choices") or []
                k = _chunk_tokens(choices[0], chunk, counted) if choices else None
                if k is not None:
                    if counted == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    counted, last = counted + k, now
                usage = chunk.get("usage") or {}
                if isinstance(usage.get("prompt_tokens"), int):
                    res.prompt_len = usage["prompt_tokens"]
                if isinstance(usage.get("completion_tokens"), int):
                    usage_out = usage["completion_tokens"]
    except httpx.TimeoutException as e:
        res.error = f"timed out after {config.timeout:g} s ({type(e).__name__})"
        return res
    except (httpx.HTTPError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return res
    res.e2el = time.perf_counter() - start
    if counted == 0:
        res.error = "the stream ended without any token"
        return res
    res.output_len = usage_out if usage_out is not None else counted
    res.success = True
    return res


async def _resolve_model(client: httpx.AsyncClient, config: BenchConfig) -> None:
    try:
        resp = await client.get("/v1/models", timeout=30.0)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server at {config.base_url}: {type(e).__name__}: {e}") from None
    if config.model is not None:
        return
    if resp.status_code != 200:
        raise ValueError(f"GET {config.base_url}/v1/models answered HTTP {resp.status_code}; pass --model")
    try:
        config.model = resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"GET {config.base_url}/v1/models listed no model id; pass --model") from None


def _stats(values: list[float]) -> dict[str, float]:
    ms = np.asarray(values, dtype=np.float64) * 1000.0
    if ms.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    out = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    out.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out


def summarize(config: BenchConfig, results: list[RequestResult], duration: float) -> dict:
    """The result dict (the JSON file): totals, throughputs, *_ms statistics and per-request arrays."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    out = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": config.backend, "base_url": config.base_url,
        "endpoint": config.endpoint, "model_id": config.model, "num_prompts": config.num_prompts,
        "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
        "burstiness": config.burstiness, "max_concurrency": config.concurrency, "input_len": config.input_len,
        "output_len": config.output_len, "random_range_ratio": config.random_range_ratio, "seed": config.seed,
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) * per_s, "input_throughput": total_in * per_s,
        "output_throughput": total_out * per_s, "total_token_throughput": (total_in + total_out) * per_s,
    }
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.e2el - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }
    for key, values in samples.items():
        for stat, value in _stats(values).items():
            out[f"{stat}_{key}_ms"] = value
    out.update({"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_len for r in results],
                "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
                "e2els": [r.e2el for r in results], "errors": [r.error for r in results]})
    return out


async def run_benchmark(config: BenchConfig | argparse.Namespace) -> dict:
    """Run the benchmark and return the result dict (see `summarize`); ValueError for bad settings."""
    config = BenchConfig.from_args(config)
    config.validate()
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    async with httpx.AsyncClient(base_url=config.base_url, headers=headers, limits=limits, trust_env=False,
                                 timeout=httpx.Timeout(config.timeout)) as client:
        await _resolve_model(client, config)
        prompts = make_prompts(config)
        gaps = arrival_gaps(config.num_prompts, config.request_rate, config.burstiness, config.seed)
        sem = asyncio.Semaphore(config.concurrency)
        bar = ProgressBar(config.num_prompts, desc="bench serve", enabled=not config.disable_tqdm)

        async def one(prompt, max_tokens):
            async with sem:
                try:
                    res = await asyncio.wait_for(send_request(client, config, prompt, max_tokens), config.timeout)
                except asyncio.TimeoutError:
                    res = RequestResult(error=f"timed out after {config.timeout:g} s")
                except Exception as e:
                    res = RequestResult(error=f"{type(e).__name__}: {e}")
            bar.update(done=1, tokens=res.output_len)
            return res

        start = time.perf_counter()
        tasks = []
        with bar:
            for prompt, max_tokens, gap in zip(prompts, output_lens(config), gaps):
                if gap > 0:
                    await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(one(prompt, max_tokens)))
            results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(config, list(results), duration)


def format_results(result: dict) -> str:
    """The human summary table, in the layout of `vllm bench serve`."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label, value, fmt="{:.2f}"):
        lines.append("{:<40} {:<10}".format(label, value if isinstance(value, (int, str)) else fmt.format(value)))

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Maximum request concurrency:", result["max_concurrency"])
    row("Request rate configured (RPS):", str(result["request_rate"]))
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    row("Input token throughput (tok/s):", result["input_throughput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    for key, short, title in METRICS:
        lines.append("{:-^50}".format(title))
        row(f"Mean {short} (ms):", result[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", result[f"median_{key}_ms"])
        row(f"Std {short} (ms):", result[f"std_{key}_ms"])
        for p in PERCENTILES:
            row(f"P{p} {short} (ms):", result[f"p{p}_{key}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def saved_result_path(config: BenchConfig, result: dict) -> str:
    """Where --save-result writes: --result-dir / (--result-filename or vLLM's default name)."""
    name = config.result_filename
    if name is None:
        concurrency = f"-concurrency{config.concurrency}" if config.concurrency is not None else ""
        model = (config.model or "model").split("/")[-1]
        name = f"{config.backend}-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"
    return os.path.join(config.result_dir, name) if config.result_dir else name


def main(args: argparse.Namespace) -> int:
    """Run from parsed flags: print the table, write --result-file; 0 if any request succeeded, 1 if none,
    2 for bad settings."""
    try:
        config = BenchConfig.from_args(args)
        config.validate()
        print(f"bench serve: {config.num_prompts} requests to {config.base_url}{config.endpoint}, "
              f"concurrency {config.concurrency}, rate {config.request_rate:g}/s", file=sys.stderr)
        result = asyncio.run(run_benchmark(config))
    except ValueError as e:
        print(f"kimiserve bench serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kimiserve bench serve: interrupted", file=sys.stderr)
        return 130
    print(format_results(result))
    errors = [e for e in result["errors"] if e]
    for message in sorted(set(errors))[:5]:
        print(f"  {errors.count(message)} x {message}", file=sys.stderr)
    for path in filter(None, (config.result_file, saved_result_path(config, result) if config.save_result else None)):
        try:
            if os.path.dirname(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(result, f, indent=2)
        except OSError as e:
            print(f"kimiserve bench serve: error: cannot write {path}: {e}", file=sys.stderr)
            return 2
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="kimiserve bench serve", description=__doc__.splitlines()[0])
    add_cli_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
