"""Models split across ranks: the device mesh of train.parallel, the plans that split a
model's layers over its tensor-parallel dimension, and the pipeline stages that cut them over
its `pp` dimension.

Modules:
    layout             train.parallel's sizes resolved against the world (no torch).
    mesh               the device mesh, and each rank's place in the data-parallel dimension.
    tensor_parallel    how a model is split (its own plan or its library's), and the checks.
    hf_plan            transformers models: the library's plan, checked against the model, applied.
    pipeline           a model's pipeline stages (its pp_split) and the step that runs them.
    hf_stages          transformers models: pipeline stages cut by the library's pp plan.
"""
