"""The preprocess stage: raw data in, a dataset of shards out.

Takes a `PreprocessConfig` (which raw data, how to split and shard it) and a dask cluster;
hands on a `DatasetRef`: the shard folder, its content hash, counts, shapes, classes and
normalisation stats. The flow's host only lists and checks; every pixel is read on a worker.
Skipped when the raw data's fingerprint and the config are unchanged (task.py's cache key).

Modules:
    config        PreprocessConfig.
    ref           DatasetRef, the stage's output, and dataset_spec (what a model is told).
    mlflow_dataset what a run records of the dataset: facts, and the MLflow dataset input.
    task          the Prefect @task: cache key on content, the dask client, then run.
    run           the stage: list and check, split, statistics, shards on the workers, publish.
    preflight     header-only checks of the raw data before any server, cluster or job starts.
    raw           RawData / RawSource: what a source hands the stage, before splitting.
    sources       built-in sources (mnist, folder, npz, synthetic) and the raw fingerprint.
    plugin_source the source plug-in seam: a user's Source lists parts, workers read them.
    array_source  `arrays`: .npz inputs and targets of any shape, a built-in through that seam.
    parquet_source `parquet`: Parquet files, a part per row group, only the named columns read.
    hf_source     `hf_dataset`: a folder `datasets`' save_to_disk wrote, in row ranges.
    columns       Arrow columns as (inputs, targets); their schema checked on the flow's host.
    tokenize      a tokenizer from a folder (its files' sha256 in the key); packing into windows.
    worker_sources folder and npz sources listed on the client, read on the workers.
    image_files   the folder source's files: class folders, one image read, sizes compared.
    image_array   the base of lazy (N, C, H, W) image sources.
    gpu_decode    JPEG decode and resize on a dask-cuda worker's GPU, PIL for the rest.
    npz           the npz source's files and one file read, checked.
    npz_staging   npz files probed, then each read once into shard order (plug-in parts too).
    synthetic     the seeded synthetic generator, evaluated lazily on the workers.
    guarded       worker tasks whose bad-input error comes back as one line.
    validate      checks every raw source passes (shapes, targets, NaN/inf, classes).
    writer        the workers' work: block statistics, normalised shards streamed with sha256.
    dataset       reading a written dataset: manifest checks, splits for training and evaluation.
    size          the disk a dataset takes (pre-flight and a full disk's message).
"""
