"""Config of the training stage: model, optimisation, precision, checkpointing, speed."""

from typing import Any, Literal, Self

from pydantic import Field, ValidationInfo, field_validator, model_validator

from trainflow.config_base import StrictModel
from trainflow.tasks.train.batching import check_batch_keys
from trainflow.tasks.train.parallel.layout import ParallelConfig

ADAM_KEYS = ("adam_beta1", "adam_beta2", "adam_eps")
SGD_KEYS = ("momentum", "nesterov")
DEFAULT_EPOCHS = 8
"""train.epochs when neither it nor train.max_steps is set."""


class TrainConfig(StrictModel):
    """What to train and how."""

    model: str = Field("reference_cnn", min_length=1)
    """The model factory: a built-in (reference_cnn: the founding material's CNN; resnet: a
    small residual net, both for images; mlp: a multi-layer perceptron over any float input;
    token_conv: a small causal convolutional net over token ids; hf or transformers: any
    Hugging Face transformers architecture, from model_args.model_type or a local
    model_args.pretrained folder, trainflow.tasks.train.hf_models), an import path
    'package.module:factory', or a name an installed package registers under the entry-point
    group 'trainflow.models' (trainflow.tasks.train.model_plugins)."""
    model_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the factory, a JSON object: --set train.model_args='{"depth":4}'."""
    width: int | None = Field(None, ge=4, le=1024)
    """Shorthand of model_args.width, passed to factories that take a `width` argument (the
    resnet's base channel width, 32 when unset; reference_cnn takes none)."""
    init_from: str | None = None
    """Start from another run's weights (only its weights: optimizer, schedule and data order
    start afresh): a checkpoint or best.pt file, a run folder, a pipeline run's parent run id
    under the workdir, or models:/<name>/<version> (trainflow.tasks.train.init_from). Checked
    against this model before anything is queued."""
    objective: str = "classification"
    """classification, regression or sequence (trainflow.tasks.objectives), an import path
    'package.module:Objective' or an entry-point name (group trainflow.objectives)."""
    objective_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the objective, e.g. {"loss": "l1"} for regression."""
    epochs: int | None = Field(None, ge=1, le=10_000)
    """Passes over the training split. Unset: 8, unless train.max_steps is set (then the
    steps alone end the run). With both set, the run ends at whichever comes first."""
    max_steps: int | None = Field(None, ge=1, le=1_000_000_000)
    """Optimizer steps of the whole run (an end inside an epoch validates and checkpoints
    there): the learning-rate schedule, the time-limit planning and the progress line count
    these. A resume may raise it (`trainflow resume <run> --set train.max_steps=N`)."""
    batch_size: int = Field(64, ge=1, le=65_536)
    """Samples per rank per forward and backward pass (a micro-batch): per optimizer step too
    unless train.global_batch_size or train.grad_accumulation make a step take several."""
    global_batch_size: int | None = Field(None, ge=1, le=16_777_216)
    """Samples per optimizer step, all ranks together: each rank then accumulates the
    gradients of global_batch_size / (batch_size x ranks) micro-batches before it steps, so
    the step (and the learning rate tuned for it) does not depend on how many ranks train.
    Must be a multiple of batch_size x ranks (refused before anything is queued). Unset:
    batch_size x ranks, or with train.grad_accumulation that many times more. A run resumed
    on fewer ranks keeps its global batch either way (tasks.train.batching)."""
    grad_accumulation: int | None = Field(None, ge=1, le=65_536)
    """Micro-batches each rank accumulates per optimizer step (global batch: batch_size x
    ranks x this); set this or train.global_batch_size, not both. Unset: 1."""
    optimizer: str = Field("adamw", min_length=1)
    """adamw (torch.optim.AdamW: train.adam_beta1, adam_beta2, adam_eps) or sgd
    (torch.optim.SGD: train.momentum, nesterov), fused where torch has the kernels; or a
    plug-in: an import path 'package.module:factory' or a name an installed package registers
    under the entry-point group 'trainflow.optimizers', called as
    ``factory(param_groups, lr=train.lr, **train.optimizer_args)`` and returning a
    torch.optim.Optimizer (trainflow.tasks.train.optimizers)."""
    optimizer_args: dict[str, Any] = Field(default_factory=dict)
    """A plug-in optimizer's keyword arguments, a JSON object: --set
    train.optimizer_args='{"betas":[0.9,0.99]}'. Not for adamw and sgd (their keys are their
    own)."""
    adam_beta1: float | None = Field(None, ge=0.0, lt=1.0)
    """adamw only: decay rate of the gradient's running mean. Unset: 0.9 (torch's)."""
    adam_beta2: float | None = Field(None, ge=0.0, lt=1.0)
    """adamw only: decay rate of the squared gradient's running mean. Unset: 0.999 (torch's);
    0.95 is common for large language models."""
    adam_eps: float | None = Field(None, gt=0.0, le=1.0)
    """adamw only: added to the denominator of each update. Unset: 1e-8 (torch's)."""
    momentum: float | None = Field(None, ge=0.0, lt=1.0)
    """sgd only: momentum. Unset: 0.9."""
    nesterov: bool = False
    """sgd only: Nesterov momentum (needs a momentum above 0)."""
    lr: float = Field(5e-3, gt=0.0, le=10.0)
    """Peak learning rate (train.schedule shapes it over the run). 5e-3 beat 2e-3 on the bundled
    MNIST for both models (test accuracy 0.984 vs ~0.96 in 8 epochs for the CNN)."""
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """The learning rate over the optimizer steps, after the warm-up: cosine (half a cosine from
    train.lr down to train.min_lr_ratio x train.lr at the last step), linear (a straight line
    between the same two), constant (train.lr throughout), or wsd (warm-up, stable, decay:
    train.lr until the last train.decay_fraction of the steps, then a straight line down to
    min_lr_ratio x train.lr). A function of the step alone (tasks.train.schedule)."""
    warmup_steps: int = Field(0, ge=0, le=10_000_000)
    """Optimizer steps of a linear warm-up from 0 to train.lr before the schedule's shape
    (step 0 runs at 0, as in Hugging Face transformers). 0: none."""
    warmup_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """The warm-up as a fraction of the run's optimizer steps (rounded up), for runs counted in
    epochs; set this or train.warmup_steps, not both."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Where cosine, linear and wsd end, as a fraction of train.lr (0.1: decay to lr/10). A
    ratio, not a rate, so it follows train.lr when a search varies it."""
    decay_fraction: float | None = Field(None, gt=0.0, le=1.0)
    """schedule=wsd only: the fraction of the run's optimizer steps (rounded up) of its final
    decay. Unset: 0.1."""
    max_grad_norm: float = Field(0.0, ge=0.0, le=1e6)
    """Clip the gradients before each optimizer step so that their global L2 norm (all
    parameters, all ranks and FSDP shards, after fp16's unscaling) is at most this; each
    epoch's mean norm before clipping is logged as grad_norm. 0 (the default): no clipping and
    no norm computed, so a run that does not set it trains exactly as without the key, and
    the built-in models' tuned learning rates keep their results; Hugging Face's Trainer
    clips at 1.0, a usual choice for transformers (tasks.train.clipping)."""
    weight_decay: float = Field(1e-4, ge=0.0, le=1.0)
    """Weight decay (decoupled under adamw), on every parameter but biases, norm weights and
    embeddings (parameters of fewer than 2 dimensions or of an nn.Embedding: decaying them
    only shrinks what the model needs unshrunk; tasks.train.optimizers)."""
    weight_decay_all: bool = False
    """true: weight decay on every parameter, biases, norm weights and embeddings too (one
    parameter group)."""
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """auto: bf16 autocast where the device computes bf16 natively (CPU flags avx512_bf16 or
    amx_bf16, GPU compute capability >= 8.0), else fp16 + GradScaler on GPU, else fp32; the
    job log and the train run's params (precision.used, precision.reason) say which and why.
    bf16/fp16 force that dtype; fp32 disables autocast."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda when the rank sees a GPU, else cpu."""
    seed: int = 0
    """Seed of weights and data order."""
    monitor: str | None = None
    """The validation metric, as logged (val_loss, val_accuracy, ...), that picks the best
    model (best.pt, which evaluation takes), ranks the checkpoints train.keep_checkpoints
    keeps and that early stopping watches. Unset: the objective's own (val_accuracy for
    classification, val_loss for regression and sequence). Checked against the objective's
    metrics before anything is queued."""
    monitor_mode: Literal["auto", "min", "max"] = "auto"
    """Whether train.monitor is better lower (min) or higher (max); auto: the objective's
    direction for that metric (losses and errors lower, accuracies and r2 higher)."""
    keep_checkpoints: int | None = Field(None, ge=1, le=10_000)
    """Checkpoints kept on disk: the k best by train.monitor, plus the newest (the one a
    requeued or resumed run continues from). Unset: the two newest."""
    early_stop_patience: int = Field(0, ge=0, le=100_000)
    """Stop training after this many validations in a row in which train.monitor did not
    improve by more than train.early_stop_min_delta; the run ends FINISHED, and evaluation
    takes its best model. 0: never stop early."""
    early_stop_min_delta: float = Field(0.0, ge=0.0, le=1e9)
    """The improvement of train.monitor that counts for early stopping (more than this,
    in the metric's units); smaller changes count as none."""
    log_every_epochs: int = Field(1, ge=1)
    """Metrics are flushed to MLflow in one batch every N epochs."""
    log_every_steps: int | None = Field(None, ge=1, le=1_000_000_000)
    """Also log the training metrics of the last N optimizer steps every N steps, with the
    global step as the x axis: train_loss_step (and the objective's other metrics with the
    _step suffix), lr_step, grad_norm_step (with clipping) and samples_per_s_step. Costs one
    all-reduce of a few numbers per N steps. Unset: per epoch only."""
    val_every_steps: int | None = Field(None, ge=1, le=1_000_000_000)
    """Also validate every N optimizer steps (besides every epoch's end): each validation is a
    history entry, may become best.pt, and is logged. Unset: once per epoch."""
    checkpoint_every_steps: int | None = Field(None, ge=1, le=1_000_000_000)
    """Also checkpoint every N optimizer steps (besides every epoch's end), mid-epoch if need
    be; a run resumed from one continues exactly. Unset: once per epoch."""
    test_after_training: bool = True
    """The job runs the test split through the best weights as training ends (all ranks, in
    fp32 as the evaluate stage does): the run's first result, on the console and the train
    run seconds before the evaluate stage's report (tasks.train.first_result)."""
    channels_last: Literal["auto", "on", "off"] = "auto"
    """Memory format of images and conv weights. auto: channels_last (NHWC) on CUDA, and on
    CPUs with oneDNN (reference CNN, batch 64, one EPYC core: 1.6x faster fp32, 2.2x bf16)."""
    compile: bool = False
    """torch.compile the model. Off by default: with 2 DDP ranks on the 2-core CPU it ran
    1.6x slower and spent ~20 s compiling; try it on GPUs with larger models."""
    cuda_graphs: bool = False
    """Replay each step's forward and backward kernels as CUDA graphs (torch.compile with
    mode="reduce-overhead"): for small models whose GPU steps are launch-bound. Every batch
    then has the same shape: the last partial batch of each epoch is dropped, on every device,
    so the data order does not depend on where a run trains (and a run cannot switch this on
    or off when it resumes). On a rank without a GPU (device=auto on a CPU node) it is
    ignored with a warning in the job log; with device=cpu it is a config error."""
    data_placement: Literal["auto", "device", "host", "stream"] = "auto"
    """Where the train and val splits live. auto: in GPU memory when a split takes at most
    half of the free GPU memory (on a CPU rank: in memory when all ranks' copies take at most
    a quarter of the memory available), else stream. device: in GPU memory (error when it
    cannot fit). host: host memory; on a GPU each batch is gathered into a pinned staging
    buffer and copied on a side stream one batch ahead, overlapping the previous step.
    stream: each rank reads only its batches from the memory-mapped shards (through the same
    pinned buffers): memory does not grow with the dataset."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How several ranks share the work. ddp: every rank holds the whole model, its gradients
    and optimizer state (DistributedDataParallel all-reduces the gradients). fsdp: FSDP2
    (`fully_shard`) shards parameters, gradients and optimizer state over the ranks (~1/N of
    each per rank; a block's weights are gathered only while it runs), for models whose
    training state does not fit on one device; checkpoints are then sharded too (one file
    per rank, torch.distributed.checkpoint), and load on any number of ranks. Sharding units
    are the model's blocks (tasks.train.sharding). One rank: the same as ddp."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """strategy=fsdp only: the device mesh ([train.parallel]: dp_replicate, dp_shard, tp;
    tasks.train.parallel.layout). Unset: every rank shards (dp_shard over the world)."""
    reshard_after_forward: bool = True
    """fsdp only: free each block's gathered weights after its forward pass (gathered again
    for the backward): less memory, one more all-gather per block and step. False keeps them
    until the backward (ZeRO-2-like: faster, more memory)."""
    activation_checkpointing: bool = False
    """Recompute each sharding unit's (block's) activations in the backward pass instead of
    keeping them: less activation memory for ~1/3 more compute. Under ddp or fsdp."""
    ddp_bucket_cap_mb: float = Field(25.0, ge=1.0, le=1024.0)
    """Size cap (MiB) of DDP's gradient all-reduce buckets: smaller buckets start reducing
    earlier in the backward pass (more overlap) but launch more collectives. 25 is torch's
    default, kept: our models' gradients (reference CNN 0.05 MiB, resnet width 32 2.7 MiB)
    fit in one or two buckets at any cap from 1 MiB (DDP's first bucket is always 1 MiB), and
    2 gloo ranks on CPU showed no difference between 1, 5, 25 and 100 beyond the noise. Tune
    it for wide resnets on GPUs (width 256: 169 MiB of gradients, 7 buckets at 25)."""
    hang_timeout_s: float = Field(300.0, ge=0.0, le=86_400.0)
    """Seconds a rank may make no progress (no step, no evaluation batch) before it is declared
    hung: its guard dumps its stacks into its log, ends it, and the job restarts from its last
    checkpoint as after a lost rank (cluster.max_restarts). A checkpoint save may take the
    larger of this and 4 times the longest save so far. 0: no hang detection. At least 2 (the
    guard looks once a second)."""
    time_limit_margin_s: float = Field(10.0, ge=0.0, le=3600.0)
    """Under a time limit (Slurm's cluster.timeout_min, or the local executor's), the job
    checkpoints at a step boundary early enough that its save (1.5 times the last one
    measured) ends this many seconds before the limit, then requeues and continues exactly
    where it stopped. Covers the requeue itself and a step slower than measured. Not under
    train.strategy=fsdp (its checkpoints are per epoch: the requeue signal alone acts)."""
    hang_first_step_s: float = Field(1800.0, ge=0.0, le=86_400.0)
    """Seconds a rank may make no progress while it starts (model, data, resume) and the first
    time through each phase (the first step: compilation; the first evaluation; the first
    checkpoint save). The larger of this and hang_timeout_s applies."""

    straggler_fraction: float = Field(0.2, ge=0.0, le=10.0)
    """A rank whose own time a step (data wait + compute, tasks.train.limits.step_times) exceeds the
    median of the other ranks' by more than this fraction, for straggler_windows windows in a
    row, is named as a straggler: a warning line in the job's log and the train run's tag
    trainflow.straggler (rank, node, and the part that is slow). 0: no straggler detection
    (per-rank step times are still logged every epoch)."""
    straggler_windows: int = Field(3, ge=1, le=1000)
    """Consecutive windows a rank must be slow in to be named (persistently slow, not a
    hiccup)."""
    straggler_window_steps: int = Field(50, ge=1, le=100_000)
    """Steps of a window: every rank's step times are gathered into rank 0 (one all-gather of
    four numbers) and compared every this many steps. A straggler is named after
    straggler_windows x straggler_window_steps steps."""

    @field_validator("model_args", "optimizer_args")
    @classmethod
    def _json_object(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        bad = [k for k in value if not k.isidentifier()]
        if bad:
            raise ValueError(
                f"{info.field_name} keys must be Python identifiers (keyword names): {bad}"
            )
        return value

    @model_validator(mode="after")
    def _width_is_a_model_arg(self) -> Self:
        if self.width is not None and self.model_args.get("width", self.width) != self.width:
            raise ValueError(
                f"train.width={self.width} and train.model_args.width="
                f"{self.model_args['width']} disagree: set one of them"
            )
        return self

    @model_validator(mode="after")
    def _fsdp_combinations(self) -> Self:
        if self.strategy == "fsdp" and (self.compile or self.cuda_graphs):
            raise ValueError(
                "train.strategy=fsdp does not support train.compile or train.cuda_graphs yet: "
                "set them to false, or use train.strategy=ddp"
            )
        if self.strategy == "fsdp" and self.channels_last == "on":
            raise ValueError(
                "train.strategy=fsdp cannot shard channels_last conv weights (FSDP2 needs "
                "contiguous parameters): set train.channels_last=auto or off"
            )
        self.parallel.check_with(self.strategy, self.batch_size)
        if self.strategy == "fsdp" and self.precision == "fp16":
            raise ValueError(
                "train.strategy=fsdp does not support precision=fp16 (loss scaling of sharded "
                "gradients): set train.precision=bf16, auto or fp32"
            )
        return self

    @model_validator(mode="after")
    def _global_batch_is_whole_micro_batches(self) -> Self:
        check_batch_keys(self.global_batch_size, self.grad_accumulation, self.batch_size)
        return self

    @model_validator(mode="after")
    def _schedule_keys_agree(self) -> Self:
        if self.warmup_steps and self.warmup_fraction:
            raise ValueError(
                f"train.warmup_steps={self.warmup_steps} and train.warmup_fraction="
                f"{self.warmup_fraction} both set the warm-up: set one of them"
            )
        if self.schedule == "constant" and self.min_lr_ratio:
            raise ValueError(
                "train.min_lr_ratio has no effect with train.schedule=constant: leave it at 0, "
                "or pick train.schedule=cosine, linear or wsd"
            )
        if self.decay_fraction is not None and self.schedule != "wsd":
            raise ValueError(
                f"train.decay_fraction is for train.schedule=wsd, not {self.schedule}: unset "
                "it, or set train.schedule=wsd"
            )
        decay = self.decay_fraction or 0.0
        if self.warmup_fraction + decay > 1.0:
            raise ValueError(
                f"train.warmup_fraction={self.warmup_fraction} and train.decay_fraction="
                f"{decay} add up to more than the whole run: lower one of them"
            )
        return self

    @model_validator(mode="after")
    def _optimizer_keys_are_its_own(self) -> Self:
        own = {"adamw": ADAM_KEYS, "sgd": SGD_KEYS}.get(self.optimizer, ())
        unset = {"nesterov": False}  # the others: None
        wrong = [
            k
            for k in (*ADAM_KEYS, *SGD_KEYS)
            if k not in own and getattr(self, k) is not unset.get(k)
        ]
        if wrong:
            owner = "adamw" if wrong[0] in ADAM_KEYS else "sgd"
            raise ValueError(
                f"train.{wrong[0]} is a setting of train.optimizer={owner}, not "
                f"{self.optimizer}: unset it, or set train.optimizer={owner}"
                + ("" if own else " (a plug-in takes train.optimizer_args)")
            )
        if self.optimizer_args and own:
            raise ValueError(
                f"train.optimizer_args is for a plug-in optimizer, not {self.optimizer}: set "
                f"its settings as train keys ({', '.join('train.' + k for k in own)})"
            )
        if self.nesterov and self.momentum == 0:
            raise ValueError(
                "train.nesterov=true needs momentum: set train.momentum above 0 (or leave it "
                "unset: 0.9), or train.nesterov=false"
            )
        return self

    @property
    def epoch_limit(self) -> int | None:
        """Epochs the run trains at most: train.epochs; unset, 8 unless train.max_steps is
        set (None: the steps alone end the run)."""
        if self.epochs is not None:
            return self.epochs
        return None if self.max_steps is not None else DEFAULT_EPOCHS

    @property
    def same_shape_batches(self) -> bool:
        """Whether every training batch is whole (the last partial batch of an epoch dropped):
        CUDA graphs replay one shape, and a pipeline's stages receive activations into buffers
        of one shape (train.parallel.pp above 1)."""
        return self.cuda_graphs or self.parallel.pp != 1

    @property
    def counts_steps(self) -> bool:
        """Whether a run started with this config logs its metrics against the global step
        (a length or a cadence in steps is set), rather than the epoch (kept on resume:
        tasks.train.progress.Progress.by_step)."""
        keys = (self.max_steps, self.val_every_steps, self.checkpoint_every_steps)
        return any(k is not None for k in (*keys, self.log_every_steps))

    @field_validator("monitor")
    @classmethod
    def _monitor_is_a_validation_metric(cls, value: str | None) -> str | None:
        if value is not None and not (value.startswith("val_") and value[4:].isidentifier()):
            raise ValueError(
                f"train.monitor={value} is not a validation metric: name one as logged, "
                f"val_<metric> (e.g. val_{value.split('_', 1)[-1] or 'loss'})"
            )
        return value

    @model_validator(mode="after")
    def _early_stop_keys_agree(self) -> Self:
        if self.early_stop_min_delta and not self.early_stop_patience:
            raise ValueError(
                f"train.early_stop_min_delta={self.early_stop_min_delta} has no effect without "
                "early stopping: set train.early_stop_patience (validations to wait), or unset it"
            )
        return self

    @model_validator(mode="after")
    def _hang_timeout_is_off_or_seconds(self) -> Self:
        if 0 < self.hang_timeout_s < 2:
            raise ValueError(
                f"train.hang_timeout_s={self.hang_timeout_s} is shorter than the 1 s between the "
                "guard's looks: set it to 2 or more, or to 0 to turn hang detection off"
            )
        return self

    @model_validator(mode="after")
    def _cuda_graphs_need_a_gpu(self) -> Self:
        if self.cuda_graphs and self.device == "cpu":
            raise ValueError(
                "train.cuda_graphs=true needs a GPU but train.device=cpu: set train.device=auto "
                "or cuda, or train.cuda_graphs=false"
            )
        return self
