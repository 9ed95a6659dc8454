"""benchmarks/gpu_clocks.py: nvidia-smi's samples parsed and summarised over a span, and the background log run
against a stand-in nvidia-smi (a script on PATH), so no GPU is needed."""

import datetime
import os
import stat
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_clocks  # noqa: E402

LINES = [  # as the H200 printed them in session 18 (--format=csv,noheader,nounits), around a power-capped row
    "2026/12/04 21:27:06.833, 1980, 3201, 143.88, 39, 0x0000000000000000",
    "2026/12/04 21:27:06.933, 1755, 3201, 209.72, 49, 0x0000000000000004",
    "2026/12/04 21:27:07.735, 1305, 3201, 666.47, 53, 0x0000000000000004",
    "2026/12/04 21:27:07.835, 1590, 3201, 702.50, 52, 0x0000000000000004",
    "2026/12/04 21:27:08.637, 1980, 3201, 398.71, 42, 0x0000000000000000",
]


def epoch(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y/%m/%d %H:%M:%S.%f").timestamp()


def test_samples_parse_and_a_span_is_summarised():
    with_units = "2026/12/04 21:27:08.737, 1980 MHz, 3201 MHz, 347.67 W, 42, 0x0000000000000000"  # --format=csv
    samples = gpu_clocks.parse_samples(["timestamp, clocks.sm [MHz]", *LINES, with_units, "2026/12/04 21:27:08.7",
                                        "x, [N/A], 1, 2, 3, 4", ""])
    assert [s["sm_mhz"] for s in samples] == [1980, 1755, 1305, 1590, 1980, 1980]  # header, cut, N/A lines skipped
    assert samples[-1]["power_w"] == 347.67
    got = gpu_clocks.summarize(samples, epoch("2026/12/04 21:27:06.900"), epoch("2026/12/04 21:27:08.000"))
    assert got["samples"] == 3
    assert got["sm_mhz_mean"] == pytest.approx((1755 + 1305 + 1590) / 3)
    assert got["sm_mhz_min"] == 1305 and got["power_w_max"] == 702.5
    assert got["power_capped"] == 1.0 and got["hw_slowdown"] == 0.0
    assert gpu_clocks.summarize(samples, epoch("2026/12/04 21:28:00.000"), epoch("2026/12/04 21:29:00.000")) is None


def test_log_reads_a_running_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    now = datetime.datetime.now()
    body = "".join(f"echo '{(now + datetime.timedelta(seconds=0.1 * i)).strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, "
                   f"{1980 - i}, 3201, 300.0, 40, 0x0000000000000000'\n" for i in range(3))
    fake.write_text(f"#!/bin/sh\n{body}exec sleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with gpu_clocks.ClockLog() as clocks:
        for _ in range(50):
            if len(clocks.samples()) == 3:
                break
            time.sleep(0.1)
        samples = clocks.samples()
        proc = clocks.proc
    assert [s["sm_mhz"] for s in samples] == [1980, 1979, 1978]
    assert gpu_clocks.summarize(samples, now.timestamp() - 1, now.timestamp() + 1)["samples"] == 3
    assert proc.poll() is not None  # stopped on leaving the block


def test_log_without_nvidia_smi_is_empty(monkeypatch):
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    with gpu_clocks.ClockLog() as clocks:
        assert clocks.samples() == [] and gpu_clocks.summarize(clocks.samples(), 0, time.time()) is None
