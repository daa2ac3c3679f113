"""Profiles every Python process started with this folder on PYTHONPATH and
TRAINFLOW_BENCH_PROFILE naming a folder (bench/p8_profile.py): the command, its training
ranks, and any other Python child. Each process writes `<pid>.prof` (cProfile, its main
thread from interpreter start-up to its atexit handlers) and `<pid>.json` (argv, its rank where
it is a training rank, the time this hook started and the time it wrote).
A process that leaves through os._exit (a training rank does) writes them first; one killed
by a signal writes nothing.

Bench-only: never on the product's path.
"""

import os
from typing import NoReturn

_FOLDER = os.environ.get("TRAINFLOW_BENCH_PROFILE", "")

if _FOLDER:
    import atexit
    import cProfile
    import json
    import sys
    import time

    _started = time.time()
    _profile = cProfile.Profile()

    def _write() -> None:
        _profile.disable()
        stem = os.path.join(_FOLDER, str(os.getpid()))
        _profile.dump_stats(stem + ".prof")
        rank = os.environ.get("RANK")  # a training rank's, set by the job's distributed set-up
        facts = {"argv": sys.argv, "rank": rank, "started": _started, "atexit": time.time()}
        with open(stem + ".json", "w") as f:
            json.dump(facts, f)

    def _exit_after_writing(status: int) -> NoReturn:
        _write()
        _os_exit(status)

    _os_exit = os._exit
    os._exit = _exit_after_writing  # bench only: a rank ends with os._exit, past atexit
    atexit.register(_write)  # registered first, so it runs last: other handlers are inside
    _profile.enable()
