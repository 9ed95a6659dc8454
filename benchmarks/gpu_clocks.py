"""The GPU's SM clock and power draw beside a benchmark: `nvidia-smi` sampled every 100 ms in the background, and
each timed row's span summarised (mean and lowest SM clock, highest power, the share of samples under the software
power cap).

Why. Session 18 (BENCHMARKS.md) found the decode MoE layers at 16-64 tokens drawing the H200's 700 W cap: the SM
clock fell from 1980 MHz to 1300-1750 MHz within a second of back-to-back layers, so their time depends on the
energy a weight costs (instructions, cache traffic), not only on the bytes. A figure from such a run is read with
the clock it ran at.

    with ClockLog() as clocks:          # no nvidia-smi: an empty log, every summary None
        spans.append((row, time.time())); ...; spans[-1] += (time.time(),)
        samples = clocks.samples(wait=0.5)  # read once at the end: nvidia-smi's lines arrive late
        for row, start, end in spans: row["clocks"] = summarize(samples, start, end)

nvidia-smi's power.draw is its own running average (about a second), so a short row's highest power lags; the
clock and the cap flag are instantaneous.
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
import tempfile
import time

FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
SW_POWER_CAP = 0x4  # clocks_throttle_reasons bit: held by the software power cap
HW_SLOWDOWN = 0x8 | 0x40 | 0x80  # hardware slowdown, thermal slowdown, power brake


def parse_samples(lines) -> list[dict]:
    """nvidia-smi --query-gpu=FIELDS --format=csv[,noheader][,nounits] lines -> samples (t: seconds since the epoch, in
    the machine's local time as nvidia-smi prints it; sm_mhz, mem_mhz, power_w, temp_c, reasons). Lines that do not
    parse (a header, a cut last line, [N/A] fields) are skipped."""
    samples = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6:
            continue
        values = [p.split()[0] if p else p for p in parts[1:]]  # "1980 MHz" (csv with units) or "1980"
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            sm, mem, power, temp = int(values[0]), int(values[1]), float(values[2]), int(values[3])
            reasons = int(values[4], 16)
        except ValueError:
            continue
        samples.append(dict(t=t, sm_mhz=sm, mem_mhz=mem, power_w=power, temp_c=temp, reasons=reasons))
    return samples


def summarize(samples: list[dict], start: float, end: float) -> dict | None:
    """The samples within [start, end] (seconds since the epoch): their count, mean and lowest SM clock, highest
    power, and the shares held by the software power cap and by a hardware slowdown; None without samples."""
    inside = [s for s in samples if start <= s["t"] <= end]
    if not inside:
        return None
    n = len(inside)
    return dict(samples=n, sm_mhz_mean=sum(s["sm_mhz"] for s in inside) / n,
                sm_mhz_min=min(s["sm_mhz"] for s in inside), power_w_max=max(s["power_w"] for s in inside),
                power_capped=sum(bool(s["reasons"] & SW_POWER_CAP) for s in inside) / n,
                hw_slowdown=sum(bool(s["reasons"] & HW_SLOWDOWN) for s in inside) / n)


class ClockLog:
    """nvidia-smi in the background while the `with` block runs (nothing where nvidia-smi is missing)."""

    def __init__(self, interval_ms: int = 100):
        self.interval_ms = interval_ms
        self.proc = None
        self.file = None

    def __enter__(self) -> ClockLog:
        tool = shutil.which("nvidia-smi")
        if tool:
            self.file = tempfile.NamedTemporaryFile("w+", suffix=".csv")
            self.proc = subprocess.Popen([tool, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
                                          "-lms", str(self.interval_ms)], stdout=self.file,
                                         stderr=subprocess.DEVNULL)
        return self

    def samples(self, wait: float = 0.0) -> list[dict]:
        """The samples so far; wait: seconds to let nvidia-smi's last lines arrive first (only while it runs)."""
        if self.file is None:
            return []
        if wait:
            time.sleep(wait)
        self.file.flush()
        with open(self.file.name) as f:
            return parse_samples(f)

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.file is not None:
            self.file.close()
        return False
