"""``python -m bench.cprofiled OUT -m MODULE ARGS...``: run MODULE as ``python -m`` would, under a cProfile
that SIGUSR1 switches on and SIGUSR2 switches off and writes to OUT (whole: written beside it, then
renamed). So a profile holds the measured load only, not the start-up, the warm-up or the shutdown.
"""

from __future__ import annotations

import cProfile
import os
import runpy
import signal
import sys
from types import FrameType


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit(__doc__)
    out, module = sys.argv[1], sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    profiler = cProfile.Profile()

    def start(_signum: int, _frame: FrameType | None) -> None:
        profiler.enable()

    def stop(_signum: int, _frame: FrameType | None) -> None:
        profiler.disable()
        profiler.dump_stats(out + ".partial")
        os.replace(out + ".partial", out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
