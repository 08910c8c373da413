"""``python -m autoplan.cli``: how torchrun starts each rank of `autoplan run` and `profile`."""

import os
import sys

from autoplan.cli.main import main

code = main()
if "RANK" in os.environ:
    # A rank has done its work and left its process group. Interpreter exit can still abort
    # in torch 2.13's C++ teardown (SIGABRT, "terminate called without an active exception";
    # seen after a checked run had printed OK), which fails the whole job: end without those
    # destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
