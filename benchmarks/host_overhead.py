"""The engine's host cost per decode step, phase by phase (issue 15 item 2), on a model whose compute
is negligible (`tiny`), so that the step is what the host does around it.

Two measurements per batch size, each after `batch` requests were prefilled and one decode step
ran (capturing the CUDA graph of that shape):

- **step**: `engine.step()` timed by the host clock, nothing patched but one timer (on CUDA the step ends when
  the sampled tokens reach the host, so this is the real step the engine runs; with overlapped
  (async) scheduling it is the time between two steps' outputs). With async scheduling it is split
  into the host's busy time and its wait in `LaunchedStep.results` for the device's tokens (wait ~0:
  the step is host-bound; the timer around that one call costs ~1 us).
- **phases**: the same steps with the engine's functions wrapped by host timers (exclusive times: a
  phase's own time without the wrapped phases it calls): schedule, prepare (StepInput), batch build
  (SequenceChunk / ForwardBatch / the graph's static inputs), forward (the model, or the graph
  replay; on CUDA followed by a synchronize, so the device's time lands here and not in the phase
  that happens to wait for it), sample, postprocess, output, and "other" (step's own code).
  host = step - forward. With async scheduling the phases are not additive (the host runs while the
  device works), so the phase run forces the synchronous step (`async_scheduling=False`).

    python3 benchmarks/host_overhead.py [--batches 1,64] [--steps 50] [--device cuda|cpu] [--out PATH]
                                       [--async-scheduling auto|on|off] [--profile N] [--stub-forward]
                                       [--speculative JSON] [--emulate-graphs]

Speculative rounds (`--speculative '{"method": "ngram", "num_speculative_tokens": 3}'`, or a draft model):
each step is then a verify round (the phases add propose, commit (the KDA replay's launch) and the graph
fills). With `--stub-forward` every logit is zero, so every sequence repeats token 0 and every draft is
accepted: the host's work of full rounds. `--emulate-graphs` (CPU, with --stub-forward) runs the CUDA-graph
paths (decode, verify and draft-loop graphs: their fills, the device drafts, the page ids) with each
"graph" replaying its function eagerly (`tests/graph_emulation.py`) and the KDA replay's body skipped
(device work): the host side of a round as it runs on CUDA, without a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimiserve.engine.args import EngineArgs  # noqa: E402
from kimiserve.engine.engine import LLMEngine  # noqa: E402
from kimiserve.sampling_params import SamplingParams  # noqa: E402
from kimiserve.utils.run_info import git_commit  # noqa: E402


class PhaseTimer:
    """Exclusive host time per phase name, over wrapped callables (nested wraps subtract)."""

    def __init__(self, sync=None):
        self.totals: dict[str, float] = {}
        self.stack: list[list[float]] = []  # per open phase: [start, child time]
        self.sync = sync
        self.undo: list = []

    def wrap(self, owner, attr: str, name: str, sync_after: bool = False) -> None:
        if not hasattr(owner, attr):
            return
        original = getattr(owner, attr)
        timer = self
        is_static = isinstance(owner, type) and isinstance(owner.__dict__.get(attr), (classmethod, staticmethod))
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
        own = not isinstance(owner, type) and attr in getattr(owner, "__dict__", {})  # e.g. a stubbed forward

        def timed(*a, **k):
            timer.stack.append([time.perf_counter(), 0.0])
            try:
                out = original(*a, **k)
                if sync_after and timer.sync is not None:
                    timer.sync()
                return out
            finally:
                start, child = timer.stack.pop()
                total = time.perf_counter() - start
                timer.totals[name] = timer.totals.get(name, 0.0) + total - child
                if timer.stack:
                    timer.stack[-1][1] += total

        if is_static:
            setattr(owner, attr, staticmethod(timed))
        else:
            setattr(owner, attr, timed)
        self.undo.append((owner, attr, raw, original, own))

    def restore(self) -> None:
        for owner, attr, raw, original, own in reversed(self.undo):
            if isinstance(owner, type):
                setattr(owner, attr, raw)
            elif own:  # the instance's own attribute (a stub): put it back
                setattr(owner, attr, original)
            else:  # the wrapper shadowed the class's method on the instance
                delattr(owner, attr)
        self.undo.clear()


def instrument(engine: LLMEngine, timer: PhaseTimer) -> None:
    from kimiserve.engine import runner as runner_mod
    from kimiserve.model.batch import ForwardBatch

    runner = engine.runner
    timer.wrap(engine, "step", "other")
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(runner, "prepare", "prepare")
    timer.wrap(engine, "_postprocess", "postprocess")
    timer.wrap(engine, "_output", "output")
    timer.wrap(runner, "sample", "sample")
    timer.wrap(runner_mod.StepChunk, "to_sequence_chunk", "batch build")
    timer.wrap(ForwardBatch, "build", "batch build")
    timer.wrap(runner, "_decode_batch", "batch build")
    timer.wrap(runner.model, "forward_batch", "forward", sync_after=True)
    timer.wrap(engine, "_propose", "propose")
    timer.wrap(engine, "_commit_verified", "commit")
    for graphs in (runner.verify_graphs, getattr(engine.proposer, "loop_graphs", None)):
        if graphs is not None:
            timer.wrap(graphs, "_fill", "batch build")
    draft_runner = getattr(engine.proposer, "runner", None)
    if draft_runner is not None:
        timer.wrap(draft_runner.model, "forward_batch", "forward", sync_after=True)
    if runner.graphs is not None:
        graphs = runner.graphs
        for attr in ("_fill", "fill"):
            timer.wrap(graphs, attr, "batch build")
        # the replay itself: wrap the graph objects' replay through the dict of captured graphs
        for key, entry in list(graphs.graphs.items()):
            timer.wrap(entry[0], "replay", "forward", sync_after=True)


STUB_CYCLE = 8
"""The stub model's greedy continuation cycles through this many tokens."""


def runner_module():
    from kimiserve.engine import runner

    return runner


def stub_forward(engine: LLMEngine) -> None:
    """The model's forward replaced by logits that are zero but at a fixed successor of each row's input
    token, one of a cycle of STUB_CYCLE tokens (CPU only: what is left of a step is the host's work).
    Greedy outputs repeat with that period, so n-gram drafts hit after one period, and a draft model
    (stubbed alike) always drafts the target's tokens. The verify graphs' KDA replay is skipped (the stub
    leaves it no inputs; on CUDA it is device work)."""
    vocab = engine.config.vocab_size
    cycle = torch.arange(STUB_CYCLE) * 7 % vocab
    successor = torch.full((vocab,), int(cycle[0]), dtype=torch.int64)
    successor[cycle] = cycle.roll(-1)

    def forward(ids, batch, rows):
        logits = torch.zeros(len(rows), vocab)
        logits[torch.arange(len(rows)), successor[ids[rows]]] = 1.0
        return logits

    runners = [engine.runner, getattr(engine.proposer, "runner", None)]
    for runner in filter(None, runners):
        runner.model.forward_batch = forward
        for graphs in (runner.graphs, runner.verify_graphs):
            if graphs is not None and hasattr(graphs, "forward"):
                graphs.forward = forward  # the decode graphs hold the forward they capture
        if runner.verify_graphs is not None:
            runner.verify_graphs._replay_kept = lambda size, inputs: None


def emulate_graphs() -> None:
    """Engines built after this run their CUDA-graph paths on the CPU (`tests/graph_emulation.py`)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import pytest
    from graph_emulation import emulate_cuda_graphs

    emulate_cuda_graphs(pytest.MonkeyPatch())


def per_step(speculative) -> int:
    """Most tokens a step appends per sequence: K + 1 with speculation, else 1."""
    return 1 + (speculative["num_speculative_tokens"] if speculative else 0)


def make_engine(device: str, batch: int, steps: int, async_scheduling: bool | None, speculative=None,
                model: str = "tiny") -> LLMEngine:
    kwargs = {}
    if speculative is not None:
        kwargs["speculative_config"] = speculative
    if "async_scheduling" in EngineArgs.__dataclass_fields__:  # (absent in trees before it)
        kwargs["async_scheduling"] = async_scheduling
    args = EngineArgs(model=model, dtype="bfloat16" if device == "cuda" else "float32", device=device,
                      max_model_len=1024, max_num_seqs=max(batch, 1), enable_prefix_caching=False, seed=0,
                      num_pages=max(64, batch * (12 + steps * per_step(speculative) // 8)), **kwargs)  # no preemption
    return LLMEngine(args)


def start_batch(engine: LLMEngine, batch: int, tokens: int, tag: str, warm: int = 3) -> None:
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, 768, (16,), generator=gen).tolist()
        engine.add_request(f"{tag}{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    while any(not g.samples[0].output_ids for g in engine.groups.values()):  # prefill
        engine.step()
    for _ in range(warm):  # decode steps of this shape (a graph is captured on the first)
        engine.step()


def finish(engine: LLMEngine) -> None:
    for rid in list(engine.groups):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def time_steps(engine: LLMEngine, steps: int, sync, waits: list[float] | None = None) -> list[float]:
    """Host ms of each `engine.step()`; with `waits`, also the ms of each step spent in `LaunchedStep.results`
    (async scheduling: waiting for the device's tokens, then reading them), appended to it."""
    times = []
    spent = [0.0]
    undo = None
    if waits is not None:
        from kimiserve.engine import runner as runner_mod

        original = runner_mod.LaunchedStep.results

        def results(self):
            start = time.perf_counter()
            try:
                return original(self)
            finally:
                spent[0] += time.perf_counter() - start

        runner_mod.LaunchedStep.results = results
        undo = lambda: setattr(runner_mod.LaunchedStep, "results", original)  # noqa: E731
    try:
        for _ in range(steps):
            spent[0] = 0.0
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1e3)
            if waits is not None:
                waits.append(spent[0] * 1e3)
    finally:
        if undo is not None:
            undo()
    if sync is not None:
        sync()
    return times


def measure(device: str, batch: int, steps: int, async_scheduling: bool | None, profile: int,
            stub: bool = False, speculative=None, model: str = "tiny") -> dict:
    sync = torch.cuda.synchronize if device == "cuda" else None
    engine = make_engine(device, batch, steps, async_scheduling, speculative, model)
    if stub:
        stub_forward(engine)
    warm = 3 + (STUB_CYCLE if stub and speculative else 0)  # past the stub's first period: every step a round
    start_batch(engine, batch, (2 * steps + 20) * per_step(speculative), "s", warm)
    if sync:
        sync()
    generated = sum(len(s.output_ids) for g in engine.groups.values() for s in g.samples)
    waits: list[float] = []
    step = time_steps(engine, steps, sync, waits if hasattr(runner_module(), "LaunchedStep") else None)
    generated = sum(len(s.output_ids) for g in engine.groups.values() for s in g.samples) - generated
    async_used = getattr(engine, "async_scheduling", False)
    overlapped = engine.stats().get("overlapped_steps", 0)
    finish(engine)
    # the phases: the synchronous step (phases of an overlapped step are not additive)
    engine = make_engine(device, batch, steps, False, speculative, model)
    if stub:
        stub_forward(engine)
    start_batch(engine, batch, (2 * steps + 20) * per_step(speculative), "p", warm)
    timer = PhaseTimer(sync)
    instrument(engine, timer)
    phase_steps = time_steps(engine, steps, sync)
    timer.restore()
    phases = {k: v * 1e3 / steps for k, v in sorted(timer.totals.items())}
    prof_text = None
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        time_steps(engine, profile, sync)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        prof_text = s.getvalue()
    finish(engine)
    engine.check_idle()
    forward = phases.get("forward", 0.0)
    phase_step = statistics.mean(phase_steps)
    row = {"batch": batch, "step_ms_median": statistics.median(step), "step_ms_mean": statistics.mean(step),
           "step_ms_min": min(step),
           # async scheduling: the step's host time less its wait for the device (host-bound when the wait is ~0)
           "step_wait_ms_median": statistics.median(waits) if waits else None,
           "step_busy_ms_median": statistics.median(t - w for t, w in zip(step, waits)) if waits else None,
           "phase_run_step_ms_mean": phase_step,
           "phase_run_host_ms": phase_step - forward, "phases_ms": phases,
           "async_scheduling": async_used, "overlapped_steps": overlapped,
           "tokens_per_step_per_sequence": generated / steps / batch,
           "graph_replays": engine.runner.graphs.replays if engine.runner.graphs is not None else 0}
    if prof_text:
        row["profile"] = prof_text
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="EngineArgs.async_scheduling of the step timing (auto: the engine's default)")
    p.add_argument("--profile", type=int, default=0, help="cProfile this many extra steps (print the top 25)")
    p.add_argument("--stub-forward", action="store_true",
                   help="CPU only: the model's forward returns zero logits (the step is then the host's work alone)")
    p.add_argument("--speculative", default=None, help="a speculative config (JSON): every step is then a verify round")
    p.add_argument("--emulate-graphs", action="store_true",
                   help="CPU, with --stub-forward: the CUDA-graph paths with eagerly replayed 'graphs' (tests/graph_emulation.py)")
    p.add_argument("--model", default="tiny",
                   help="the model (default tiny: negligible compute); e.g. kimi-demo with --speculative "
                        "'{\"method\": \"draft_model\", \"model\": \"kimi-demo-draft\", ...}' for the phases of real draft rounds")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    async_flag = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    if args.stub_forward and args.device != "cpu":
        p.error("--stub-forward runs on the CPU only (a captured graph would record the stub)")
    if args.emulate_graphs and not args.stub_forward:
        p.error("--emulate-graphs needs --stub-forward (on the CPU)")
    if args.emulate_graphs:
        emulate_graphs()
    speculative = json.loads(args.speculative) if args.speculative else None
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        row = measure(args.device, b, args.steps, async_flag, args.profile, args.stub_forward, speculative, args.model)
        rows.append(row)
        ph = "  ".join(f"{k} {v:.3f}" for k, v in row["phases_ms"].items())
        busy = "" if row["step_wait_ms_median"] is None else (
            f", busy {row['step_busy_ms_median']:.3f} + waiting for the device {row['step_wait_ms_median']:.3f}")
        print(f"batch {b:3d}: step {row['step_ms_median']:.3f} ms median ({row['step_ms_min']:.3f} min, "
              f"{row['tokens_per_step_per_sequence']:.2f} tokens per sequence, "
              f"async={row['async_scheduling']}{busy}); synchronous phase run: step {row['phase_run_step_ms_mean']:.3f}, "
              f"host {row['phase_run_host_ms']:.3f} ms = {ph}", flush=True)
        if row.get("profile"):
            print(row["profile"])
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"device": device, "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc)
              .isoformat(timespec="seconds"), "commit": git_commit(), "model": args.model, "steps": args.steps,
              "stub_forward": args.stub_forward, "emulated_graphs": args.emulate_graphs, "speculative": speculative,
              "load_average_1min": os.getloadavg()[0], "rows": [{k: v for k, v in r.items() if k != "profile"} for r in rows]}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
