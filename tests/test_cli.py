import json
import os
import subprocess
import sys

import pytest
import torch

from kimiserve.config import ModelConfig, load_preset
from kimiserve.entrypoints.cli import main
from kimiserve.model.loader import load_model
from kimiserve.tokenizer import load_tokenizer

pytestmark = pytest.mark.fixed_threads  # outputs compared within one process, formats, exit codes: OMP_NUM_THREADS changes nothing

LIGHT = ("--max-model-len", "256", "--num-pages", "48")  # a small cache: generate tests stay light


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def completions(out: str) -> dict[str, str]:
    """`'prompt' -> 'text'` lines -> {prompt: text}."""
    import ast

    pairs = [line.split(" -> ", 1) for line in out.splitlines()]
    return {ast.literal_eval(p): ast.literal_eval(t) for p, t in pairs}


def test_inspect_full_model_json(capsys):
    code, out, _ = run_cli(capsys, "inspect", "--model", "kimi-k3.1-pro", "--json")
    s = json.loads(out)
    assert code == 0
    assert 2.7e12 < s["total_params"] < 2.9e12  # ~2.8T total
    assert 100e9 < s["active_params"] < 108e9  # ~104B active
    assert s["kda_state_bytes_per_seq"] == 69 * (96 * 128 * 128 * 4 + 3 * 96 * 128 * 3 * 2)
    assert s["mla_layers"] == 24 and s["kda_layers"] == 69
    assert {dt: c["bytes_per_token_per_mla_layer"] for dt, c in s["cache"].items()} == {"bf16": 1408, "fp8": 708, "fp4": 392}
    assert s["cache"]["fp8"]["bytes_per_token"] == 708 * 24


def test_inspect_kimi_linear_folder_matches_the_release_parameter_count(capsys, tmp_path):
    (tmp_path / "config.json").write_text((__import__("pathlib").Path(__file__).parent / "fixtures/kimi_linear_48b_a3b_config.json").read_text())
    code, out, _ = run_cli(capsys, "inspect", "--model", str(tmp_path), "--json")
    s = json.loads(out)
    assert code == 0 and s["total_params"] == 49_122_681_728  # the published checkpoint's count
    assert s["cache"]["fp8"]["index_key_bytes_per_token_per_layer"] == 0  # dense MLA, no indexer


def test_inspect_table_and_bad_model(capsys):
    code, out, _ = run_cli(capsys, "inspect", "--model", "tiny")
    assert code == 0 and "7 layers = 5 KDA + 2 MLA" in out and "fp8" in out
    code, _, err = run_cli(capsys, "inspect", "--model", "nope")
    assert code == 2 and "neither a preset" in err


def test_make_checkpoint_then_load_and_generate(capsys, tmp_path):
    out_dir = tmp_path / "tiny-ckpt"
    code, out, _ = run_cli(capsys, "make-checkpoint", "--preset", "tiny", "--out", str(out_dir), "--seed", "5",
                           "--dtype", "fp32", "--max-shard-mb", "0.3")
    assert code == 0
    names = {p.name for p in out_dir.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tiktoken.model", "tokenizer_config.json",
            "chat_template.jinja"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) > 1
    assert ModelConfig.from_pretrained(out_dir) == load_preset("tiny")
    from_folder = load_model(out_dir, torch.float32)
    from_preset = load_model("tiny", torch.float32, seed=5)
    ids = torch.tensor([[1, 2, 3, 500, 7]])
    assert torch.equal(from_folder(ids), from_preset(ids))
    assert load_tokenizer(out_dir).encode("hello world") == load_tokenizer("tiny").encode("hello world")
    code, from_dir, _ = run_cli(capsys, "generate", "--model", str(out_dir), "--max-tokens", "5", *LIGHT, "hello")
    assert code == 0
    code, from_seed, _ = run_cli(capsys, "generate", "--model", "tiny", "--seed", "5", "--max-tokens", "5", *LIGHT,
                                 "hello")
    assert code == 0 and from_dir == from_seed and completions(from_dir)["hello"]


def test_generate_prints_each_completion(capsys):
    code, out, err = run_cli(capsys, "generate", "--model", "tiny", "--max-tokens", "4", "Hello")
    assert code == 0 and out.startswith("'Hello' -> ") and len(out.splitlines()) == 1 and err == ""
    prompts = ["The quick brown fox", "Hello", "x"]
    code, out, err = run_cli(capsys, "generate", "--model", "tiny", "--max-tokens", "4", *LIGHT, *prompts)
    got = completions(out)
    assert code == 0 and list(got) == prompts and all(got.values())
    assert "generate: 3/3 requests" in err and err.endswith("\n")  # the progress bar of a batch
    assert got["Hello"] == completions(run_cli(capsys, "generate", "--model", "tiny", "--max-tokens", "4", *LIGHT, "Hello")[1])["Hello"]


def test_generate_sampling_is_seeded(capsys):
    def sample(seed):
        code, out, _ = run_cli(capsys, "generate", "--model", "tiny", "--max-tokens", "8", "--temperature", "1", "--top-p", "0.9",
                               "--top-k", "50", "--seed", seed, *LIGHT, "x")
        assert code == 0
        return out

    assert sample("11") == sample("11")
    code, out, _ = run_cli(capsys, "generate", "--model", "tiny", "--max-tokens", "4", "--chat", "--dtype", "fp32", *LIGHT, "Hi", "Bye")
    assert code == 0 and list(completions(out)) == ["Hi", "Bye"]


def test_generate_stream_prints_the_same_text(capsys):
    code, out, _ = run_cli(capsys, "generate", "--model", "tiny", "--max-tokens", "6", *LIGHT, "Hello, Kimi")
    text = completions(out)["Hello, Kimi"]
    code, streamed, _ = run_cli(capsys, "generate", "--model", "tiny", "--max-tokens", "6", "--stream", *LIGHT, "Hello, Kimi")
    assert code == 0 and streamed == text + "\n"
    code, _, err = run_cli(capsys, "generate", "--model", "tiny", "--stream", *LIGHT, "a", "b")
    assert code == 2 and "--stream takes one prompt" in err


@pytest.mark.parametrize("flags, field", [
    (["--temperature", "-1"], "temperature"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--top-p", "1.5"], "top_p"),
    (["--dtype", "fp16"], "dtype"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--max-model-len", "4"], "max_model_len"),
    (["--model", "nope"], "neither a preset"),
])
def test_generate_bad_values_exit_2(capsys, flags, field):
    code, out, err = run_cli(capsys, "generate", *flags, "Hello, Kimi: a prompt of more than four tokens")
    assert code == 2 and out == "" and err.startswith("kimiserve generate: error: ") and field in err


def test_generate_help_shows_engine_args(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exc.value.code == 0
    assert "--max-num-batched-tokens MAX_NUM_BATCHED_TOKENS Token budget of one step; longer prompts are " \
           "prefilled in chunks." in text
    assert "--no-enable-prefix-caching" in text and "--stream" in text and "--top-p" in text


def test_console_script_generates():
    exe = [sys.executable, "-m", "kimiserve.entrypoints.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # as tests/conftest.py set in-process
    res = subprocess.run([*exe, "generate", "--model", "tiny", "--max-tokens", "4", "Hello, Kimi"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 0 and res.stdout.startswith("'Hello, Kimi' -> ")


def test_readme_quotes_the_current_inspect_output(capsys):
    readme = (__import__("pathlib").Path(__file__).parent.parent / "README.md").read_text()
    code, out, _ = run_cli(capsys, "inspect", "--model", "kimi-k3.1-pro")
    assert code == 0 and out.strip() in readme
