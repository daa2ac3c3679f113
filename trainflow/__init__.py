"""trainflow: workflow-orchestrated HPC training (Prefect flows, dask preprocessing, submitit/Slurm
training, MLflow tracking).

Installed, trainflow's code lives under this name only: `trainflow.flows`, `trainflow.tasks` and
`trainflow.cluster` (pyproject.toml maps them onto the repo's top-level folders), so a user
project's own `tasks.py` or `cluster/` never shadows it. The links beside this file let tools
that read the tree (mypy, ruff, editors) see the same names.

What every layer uses lives here, beside the links, so no layer climbs into another for it:
`trainflow.errors` (the errors a user can act on, and --debug) and `trainflow.config_base`
(StrictModel, the base of every component's config), `trainflow.gc_policy` (how the command
and a rank set Python's garbage collector) and `trainflow.console` (a console line written
whole from any thread). They import nothing from the layers.
"""

__version__ = "0.1.0"
