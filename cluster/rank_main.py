"""A rank's process: `python -u -m trainflow.cluster.rank_main <submitit folder>`, what
cluster.rank_guard starts for each rank.

It is submitit's own `python -m submitit.core._submit <folder>` (the same job environment,
signals, result pickle) with one step first: rank 0's requeue (SIGUSR2 before a limit) goes
through cluster.requeue, which keeps `scontrol requeue` alive through the SIGTERM Slurm sends
the job's processes for it. And before that, SIGUSR1 makes the rank dump the stacks of all its
threads (cluster.heartbeat), which the guard of a hung rank asks for.
"""

import sys


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m trainflow.cluster.rank_main <submitit folder>")
    from trainflow import gc_policy

    gc_policy.at_start()  # before the job's imports (torch and the training code)
    from submitit.core.submission import submitit_main

    from trainflow.cluster import heartbeat, requeue

    heartbeat.install_stack_dump()  # first: a rank hung anywhere later can show its stacks
    requeue.install()
    submitit_main()  # reads the folder from sys.argv, as `-m submitit.core._submit` does


if __name__ == "__main__":
    main()
