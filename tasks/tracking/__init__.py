"""MLflow tracking for every stage: the run tree, the ranks' journal, what each run records.

Used by the flow (it creates one parent run and one child run per stage and passes their ids
on) and by the stages. Ranks never talk to MLflow: rank 0 writes a journal file that the flow
relays to the run, so a tracking outage never stops training.

Modules:
    config          TrackingConfig and the tracking URI it resolves to.
    runs            experiments, run creation, batched params and metrics, the git commit.
    pipeline_runs   the parent and child runs, ended FINISHED, FAILED or KILLED.
    orphaned_runs   a dead flow's runs marked KILLED (run by the job's watchdog).
    store_lock      a new local store created by one process at a time.
    mlflow_server   MLflow's server command in one process.
    reachability    bounded waits on the tracking server; its /health probe.
    logger          the MetricLogger the loop calls: journal on rank 0, nothing elsewhere.
    journal         what ranks record for the run, as JSON lines.
    logged_through  the last step an attempt's logger wrote, so a retry logs no step twice.
    relay           the flow sends a job's journal to its run, while it runs and at its end.
    sender          a bounded buffer sent by a background thread, with its own retries.
    system_metrics  CPU, memory and GPU metrics per node, into the journal.
    lineage         the data, code, config and package set a run came from, as tags.
    packages        the installed package set as one hash.
    job_accounting  what a stage's run records about the Slurm job that ran it.
    lost_ranks      what a stage's run records about ranks its job lost.
"""
