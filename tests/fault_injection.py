"""`python tests/fault_injection.py serve ...`: the kimiserve CLI with faults injected into the model
runner, for the server fault tests. A step whose new tokens include token KIMISERVE_TEST_POISON
raises an ordinary error (a kernel failing on one request's input: the engine must fail that
request alone); one including KIMISERVE_TEST_FATAL raises a sticky CUDA-style error (the engine
cannot go on: the server must exit non-zero)."""

from __future__ import annotations

import os
import sys

from kimiserve.engine import runner
from kimiserve.entrypoints.cli import main

POISON = int(os.environ.get("KIMISERVE_TEST_POISON", "-1"))
FATAL = int(os.environ.get("KIMISERVE_TEST_FATAL", "-1"))
_execute = runner.ModelRunner.execute


def execute(self, sched):
    for chunk in sched.chunks:
        r = chunk.request
        new = r.all_ids[r.num_computed:r.num_computed + chunk.num_tokens]
        if POISON in new:
            raise RuntimeError("injected kernel failure (secret internal detail)")
        if FATAL in new:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
    return _execute(self, sched)


runner.ModelRunner.execute = execute

if __name__ == "__main__":
    sys.exit(main())
