import json
import subprocess
import sys

import pytest
import torch

from kimiserve.config import ModelConfig, load_preset
from kimiserve.entrypoints.cli import main
from kimiserve.generate import generate
from kimiserve.model.loader import load_model
from kimiserve.tokenizer import load_tokenizer


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


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
    assert generate(str(out_dir), ["hello"], max_tokens=5) == generate("tiny", ["hello"], max_tokens=5, seed=5)


def test_generate_is_reproducible_and_validates():
    greedy = generate("tiny", ["The quick brown fox"], max_tokens=6)
    assert greedy == generate("tiny", ["The quick brown fox"], max_tokens=6) and greedy[0]
    a = generate("tiny", ["x"], max_tokens=6, temperature=1.0, seed=11)
    assert a == generate("tiny", ["x"], max_tokens=6, temperature=1.0, seed=11)
    with pytest.raises(ValueError, match="max_tokens"):
        generate("tiny", ["x"], max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        generate("tiny", ["x"], temperature=-1)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate("tiny", [""])
    with pytest.raises(ValueError, match="no tokenizer"):
        generate("small", ["x"])


def test_console_script_generates():
    exe = [sys.executable, "-m", "kimiserve.entrypoints.cli"]
    res = subprocess.run([*exe, "generate", "--model", "tiny", "--max-tokens", "4", "Hello, Kimi"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("'Hello, Kimi' -> ")


def test_readme_quotes_the_current_inspect_output(capsys):
    readme = (__import__("pathlib").Path(__file__).parent.parent / "README.md").read_text()
    code, out, _ = run_cli(capsys, "inspect", "--model", "kimi-k3.1-pro")
    assert code == 0 and out.strip() in readme
