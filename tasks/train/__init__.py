"""The train stage: a dataset in, checkpoints and a trained model out.

Takes a `TrainJobSpec` (the `TrainConfig`, the `DatasetRef`, the MLflow run id, the output
folder) and an executor from cluster/; hands on a `CheckpointRef`: the best checkpoint's file,
its hash, step and metrics. The job is a plain submitit payload: it knows nothing of Slurm or
Prefect, logs only from rank 0 and resumes from its latest checkpoint by itself.

Modules:
    config             TrainConfig: model, optimisation, precision, checkpointing, strategy.
    ref                CheckpointRef, the stage's output.
    task               the Prefect @tasks: submit (one job or an array), forward logs, wait.
    epoch_progress     the Prefect progress artifact of the epochs checkpointed.
    job                TrainingJob, the callable submitit runs once per rank: builds, resumes.
    recipe             the training loop: segments, validation, checkpoints, logs, stops.
    job_spec           TrainJobSpec, what a training job is given.
    cadence            the run's length and step cadences: where the loop stops, what is due.
    step_metrics       per-step metrics of a window of steps; the progress line's step, ETA.
    monitor            train.monitor: the best validation, early stopping, checkpoints kept.
    sweep              a sweep's job array and the choice of its best element.
    distributed        process group set-up and tear-down (gloo | nccl), DDP.
    rendezvous         ranks meet on a store rank 0 starts on a free port.
    sharding           train.strategy=fsdp: FSDP2 fully_shard per sharding unit.
    sharded_init       fsdp: rank 0 builds the model, the others receive their shards.
    parallel           train.parallel: the device mesh, tensor-parallel plans.
    precision          bf16 / fp16 with GradScaler / fp32, chosen per device.
    native_bf16        whether a device computes bf16 natively.
    models             the built-in networks and their factories.
    transformer        the built-in decoder transformer and its tensor-parallel plan.
    hf_models          the built-in factory hf: transformers architectures, local fine-tuning.
    outputs            a model's output (tensor, ModelOutput/dict, tuple) read as logits.
    model_plugins      the model factory seam: build_model, check_model on the meta device.
    model_report       what the meta-device check learnt about a model (handed to the flow).
    data               batches as index slices of a split, in memory or streamed.
    streaming          a split streamed from its shards, each rank reading its own batches.
    prefetch           host batches copied to the GPU one step ahead.
    normalise          raw shard values to float32 at batch time.
    loop               the train and evaluation epochs: optimiser, schedule, metric sums.
    optimizers         AdamW / SGD and optimizer plug-ins; no decay on biases, norms, embeddings.
    schedule           the learning rate as a pure function of the step (warm-up, shapes).
    clipping           the global gradient norm over ranks and FSDP shards, clipped.
    init_from          train.init_from: another run's weights, resolved, checked and loaded.
    throughput         samples/s, step time, FLOPs and MFU per rank and per job.
    progress           what a checkpoint holds of the run's progress and identity.
    batching           the global batch as micro-batches per rank (accumulation), checked.
    resume             resume from a checkpoint; the global batch kept on fewer ranks.
    first_result       the test split through the best weights as the job ends.
    checkpointing      checkpoints: atomic, off the training path, verified, resharded.
    limits             time limits and their requeue, early signals, stragglers.
    log_lines          the lines a job prints: where it trains, per-epoch progress.
"""

from trainflow.tasks.train.limits.early_signal import hold_early_preemption

# Unpickling a training job imports this package first: from here on, a requeue signal that
# arrives while the rest (torch) is still importing is held instead of killing the rank.
hold_early_preemption()
