"""Checkpoints of the train stage: written atomically and off the training path, found and
verified on resume, resharded on load.

Modules:
    checkpoint         atomic full-state checkpoints, resume look-up, best model.
    sharded_checkpoint DCP checkpoints of fsdp runs, resharded on load.
    checkpoint_tags    what the train run records of the checkpoint evaluation used.
    recorder           rank 0's records and checkpoints written off the training path.
"""
