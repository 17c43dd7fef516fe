"""pytest plugin: compile every Triton kernel the tests launch for a Hopper GPU, on a machine without one.

The interpreter (TRITON_INTERPRET=1, what `make test` runs) executes kernels as Python: it never type-checks
them, so code that the GPU compiler refuses passes CI (returns of different shapes from the two sides of a
constexpr `if`, a non-power-of-two `tl.arange`, a dot with K < 16, ...).  With this plugin the tests' kernel
launches are compiled for sm_90 by Triton's real compiler (to PTX and, with ptxas, SASS) and never run; tests
then fail on their empty outputs, which is expected: the session's exit status says only whether every kernel
compiled.  Used by `make test` (see the Makefile); relies on Triton's JIT internals (runtime.driver,
JITFunction.run), so a Triton that changes them fails loudly here rather than passing silently.
"""

from __future__ import annotations

import collections
import os

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)


class _CompileOnlyDriver:
    """What JITFunction.run asks the active driver for, answered for one GPU that is not there."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


ERRORS: collections.Counter = collections.Counter()
COMPILED: set = set()
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    try:
        kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    except Exception as e:
        ERRORS[f"{self.fn.__name__}: {type(e).__name__}: {str(e)[-1500:]}"] += 1
        raise
    COMPILED.add(self.fn.__name__)
    return kernel


def pytest_configure(config):
    triton.knobs.runtime.interpret = False     # compile with the real compiler ...
    os.environ["TRITON_INTERPRET"] = "1"        # ... while turboattn's and the tests' CPU checks see the variable
    driver.set_active(_CompileOnlyDriver())
    JITFunction.run = _compile_only


def pytest_sessionfinish(session, exitstatus):
    session.exitstatus = 1 if ERRORS or not COMPILED else 0


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    write(f"Triton compile check (sm_90): kernels compiled: {', '.join(sorted(COMPILED)) or 'none'}")
    if not COMPILED:
        write("no kernel was compiled: the check itself is broken")
    for message, count in ERRORS.most_common():
        write(f"COMPILE ERROR ({count}x) {message}")
    write("Test failures above are expected (kernels are compiled, not run); the exit status counts compile errors.")
