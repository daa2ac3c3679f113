"""The benchmark code runs (tiny sizes, CPU): it must not rot between benchmark runs."""

from pathlib import Path

import pytest
import torch

from bench.common import median_seconds, slug, table
from bench.p6_gpu import matmul_peak, model_rate


@pytest.mark.services
def test_gpu_benchmark_code_runs_on_cpu_at_tiny_size() -> None:
    cpu = torch.device("cpu")
    assert matmul_peak(cpu, 64, torch.float32, repeats=2) > 0
    rate, flops = model_rate(cpu, width=4, size=16, batch=4, steps=1)
    assert rate > 0 and flops > 0


def test_helpers() -> None:
    assert median_seconds(lambda: None, repeats=3) >= 0
    assert slug("AMD EPYC 9B14 96-Core") == "amd-epyc-9b14-96-core"
    assert "goal" in table("t", [("m", "1", "<= 2")])


def test_lightning_trains_in_the_precision_trainflow_picks() -> None:
    from bench.p7_lightning import PRECISION, lightning_precision
    from trainflow.tasks.train.precision import resolve_precision

    cpu = torch.device("cpu")
    assert lightning_precision(cpu) == PRECISION[resolve_precision("auto", cpu).name]
    assert set(PRECISION.values()) == {"bf16-mixed", "16-mixed", "32-true"}


def test_a_command_is_timed_to_its_event_and_exit_with_its_childrens_cpu() -> None:
    import os
    import sys

    from bench.timed import TEST_ACCURACY, timed_command

    busy = (
        "import subprocess, sys; print('begun', flush=True); "
        "subprocess.run([sys.executable, '-c', 'sum(range(3*10**7))']); "
        "print('[rank0] test accuracy 0.9640 (first result)', flush=True); print('done')"
    )
    out = timed_command([sys.executable, "-c", busy], os.environ, TEST_ACCURACY)
    assert out.returncode == 0 and [x.strip() for x in out.lines][::2] == ["begun", "done"]
    assert out.event == "0.9640"  # the first group: the accuracy itself
    assert out.event_s is not None and 0 < out.event_s <= out.exit_s
    assert out.cpu_s > 0.2  # the grandchild's summing is counted (reaped by its parent)


def test_a_command_past_its_time_is_killed_with_what_it_started() -> None:
    import os
    import sys

    from bench.timed import timed_command

    sleeper = "import subprocess, sys; subprocess.run(['sleep', '60'])"
    out = timed_command([sys.executable, "-c", sleeper], os.environ, timeout_s=1)
    assert out.returncode < 0 and out.event is None and out.exit_s < 30


def test_a_measured_command_never_inherits_a_server_or_a_command_service(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from bench.timed import LEFT_OUT, command_env, fresh_prefect_home

    for name in LEFT_OUT:
        monkeypatch.setenv(name, "from the caller")
    database = tmp_path / "template.db"
    database.write_bytes(b"db")
    home = fresh_prefect_home(tmp_path / "run", database)
    env = command_env(home, PREFECT_API_URL="http://127.0.0.1:1/api")
    assert not set(LEFT_OUT) - {"PREFECT_API_URL"} & set(env)
    assert env["PREFECT_API_URL"] == "http://127.0.0.1:1/api"  # only where asked
    assert env["PREFECT_HOME"] == str(home) and (home / "prefect.db").read_bytes() == b"db"


def test_the_lightning_script_splits_and_schedules_as_trainflow_does() -> None:
    import numpy as np

    from bench.p7_lightning import cosine, samples_digest, split_members
    from trainflow.tasks.preprocess.config import PreprocessConfig
    from trainflow.tasks.preprocess.run import split_indices
    from trainflow.tasks.train.schedule import Schedule

    labels = np.random.default_rng(3).integers(0, 10, 997)
    cfg = PreprocessConfig(source="mnist", seed=7, val_fraction=0.15, test_fraction=0.1)
    theirs = split_indices(labels, cfg)
    ours = split_members(labels, seed=7, val=0.15, test=0.1)
    for name in ("train", "val", "test"):
        assert np.array_equal(np.sort(theirs[name]), ours[name])
    assert all(abs(cosine(s, 256) * 5e-3 - Schedule().lr(s, 256, 5e-3)) < 1e-12 for s in range(300))
    x = np.arange(12, dtype=np.uint8).reshape(4, 3)
    y = np.array([0, 1, 0, 1])
    assert samples_digest(x, y) == samples_digest(x[::-1], y[::-1])
    assert samples_digest(x, y) != samples_digest(x, y[::-1])


def test_p7t_reports_medians_ratios_and_a_differing_test_set() -> None:
    from bench.p7t import GOALS, SIDES, rows, summarise

    def one(t: float | None, digest: str = "d") -> dict[str, object]:
        return {
            "to_test_accuracy_s": t,
            "exit_s": 2 * (t or 9),
            "cpu_s": 1.0,
            "test_digest": digest,
        }

    runs = {side: [one(10.0), one(12.0), one(11.0)] for side in SIDES}
    runs["trainflow running server"] = [one(5.0), one(6.0), one(7.0)]
    runs["trainflow temporary server"] = [one(9.0), one(None), one(9.0, "other")]
    result = summarise(runs)
    assert result["medians"]["lightning"]["to_test_accuracy_s"] == 11.0
    ratios = result["ratios_to_lightning"]
    assert ratios["trainflow running server"]["to_test_accuracy_s"] == round(6 / 11, 2)
    assert ratios["trainflow temporary server"]["to_test_accuracy_s"] is None  # one missed
    assert result["same_test_set"] is False
    assert len(rows(result)) == len(SIDES) + 4 * len(GOALS) + 1  # ratios and evaluate per mode


def test_a_saved_result_names_its_command_load_and_cpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import json

    import bench.common as common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    path = common.save("p0", {"x": 1}, command="python -m bench p0", load_at_start=(1.0, 2, 3))
    entry = json.loads(path.read_text())["p0"]
    assert entry["x"] == 1 and entry["command"] == "python -m bench p0"
    assert entry["load_average_at_start"] == [1.0, 2, 3] and len(entry["load_average_at_end"]) == 3
    assert isinstance(entry["cpu"]["native_bf16"], bool) and entry["cpu"]["cores"] >= 1


def test_a_generic_cpu_name_gets_its_family_and_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Results of two "AMD EPYC" generations (Zen 1 and Zen 3 both without bf16) go to two
    files; a name that carries a model number keeps its file."""
    import bench.common as common
    from trainflow.tasks.train import native_bf16

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(common, "x86_family_model", lambda: "family 25 model 1")
    generic = native_bf16.CpuInfo("AMD EPYC", frozenset())
    monkeypatch.setattr(native_bf16, "this_cpu", lambda: generic)
    assert common.machine_name() == "AMD EPYC family 25 model 1 (no native bf16)"
    named = native_bf16.CpuInfo("AMD EPYC 9254 24-Core Processor", frozenset({"avx512_bf16"}))
    monkeypatch.setattr(native_bf16, "this_cpu", lambda: named)
    assert common.machine_name() == "AMD EPYC 9254 24-Core Processor (native bf16)"
    monkeypatch.undo()  # the real reading, on this machine
    assert common.x86_family_model() == "" or common.x86_family_model().startswith("family ")


def _side(best: float, epochs: int, cpu: float, params: list[int]) -> dict[str, object]:
    trials = [{"params": {"train.width": p}, "curve": [0.5, 0.9]} for p in params]
    return {
        "best": {"value": best, "params": {}, "number": 0},
        "epochs": epochs,
        "trials": trials,
        "states": {"COMPLETE": 1},
        "array_cpu_s": cpu,
        "command_cpu_s": cpu + 50,
        "trial_s": cpu / 2,
        "exit_s": cpu,
    }


def test_p11_compares_the_best_in_points_and_the_epochs_as_a_share() -> None:
    from bench.p11_search import rows, summarise

    met = summarise({"unpruned": _side(0.98, 96, 400.0, [4, 8]),
                     "pruned": _side(0.976, 36, 150.0, [4, 8])})  # fmt: skip
    assert met["best_difference_points"] == -0.4 and met["epoch_share"] == 0.375
    assert met["array_cpu_ratio"] == 0.375 and met["command_cpu_ratio"] == 0.444
    assert met["goal_met"] is True and met["same_points_same_order"] is True
    assert ("goal met", "yes", "yes") in rows(met)
    worse = summarise({"unpruned": _side(0.98, 96, 400.0, [4, 8]),
                       "pruned": _side(0.974, 36, 150.0, [8, 4])})  # fmt: skip
    assert worse["best_difference_points"] == -0.6 and worse["goal_met"] is False
    assert worse["same_points_same_order"] is False
    longer = summarise({"unpruned": _side(0.98, 96, 400.0, [4]),
                        "pruned": _side(0.99, 39, 150.0, [4])})  # fmt: skip
    assert longer["epoch_share"] == 0.406 and longer["goal_met"] is False


@pytest.mark.services
def test_a_p11_side_counts_the_epochs_the_command_trained(tmp_path: Path) -> None:
    """One real side at the tiny preset (2 points, 2 epochs): the epochs read from the study
    are those rank 0 logged, complete trials trained every epoch, and the array's CPU seconds
    are part of the command's."""
    from bench.p11_search import side
    from bench.timed import migrated_prefect_db

    database = migrated_prefect_db(tmp_path / "prefect-template.db")
    space = ("train.lr=choice(0.005,1e-07)",)
    out = side(tmp_path / "side", "asha", database, preset="tiny", overrides=(), space=space)
    assert {t["params"]["train.lr"] for t in out["trials"]} == {0.005, 1e-07}
    assert out["epochs"] == out["epoch_lines"] > 0
    assert all(t["epochs"] == 2 for t in out["trials"] if t["state"] == "COMPLETE")
    assert out["best"]["params"] == {"train.lr": 0.005}
    assert 0 < out["array_cpu_s"] <= out["command_cpu_s"]


def test_p11_replays_curves_through_the_default_pruner_by_its_rungs() -> None:
    """Successive halving by hand (keep the best quarter at epochs 1 and 4; fewer than four
    values: keep only the best): a leads and completes, b is last at epoch 1, c leads at
    epoch 1 but not at epoch 4."""
    from bench.p11_replay import product_pruner, replay_order

    a = [0.9, 0.95, 0.96, 0.97, 0.98, 0.99]
    b = [0.1, 0.5, 0.6, 0.7, 0.8, 0.995]
    c = [0.95, 0.2, 0.2, 0.3, 0.3, 0.3]
    assert replay_order([a, b, c], product_pruner("asha")) == (6 + 1 + 4, 0.99)
    assert replay_order([a, b, c], product_pruner("none")) == (18, 0.995)


def test_p11_sees_a_pruned_trial_that_reported_other_values() -> None:
    from bench.p11_search import summarise

    full, pruned = _side(0.98, 96, 400.0, [4, 8]), _side(0.976, 36, 150.0, [4, 8])
    assert summarise({"unpruned": full, "pruned": pruned})["same_values_until_pruned"] is True
    pruned["trials"] = [{"params": {"train.width": 4}, "curve": [0.5]},
                        {"params": {"train.width": 8}, "curve": [0.4]}]  # fmt: skip
    assert summarise({"unpruned": full, "pruned": pruned})["same_values_until_pruned"] is False


def test_the_profile_hook_profiles_a_process_and_its_child_that_exits_at_once(tmp_path) -> None:
    import os
    import subprocess
    import sys

    from bench.p8_profile import HOOK, profiles, summarise

    child = "import os, json; json.dumps([1]); os._exit(0)"  # os._exit skips atexit
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    env = {**os.environ, "PYTHONPATH": str(HOOK), "TRAINFLOW_BENCH_PROFILE": str(tmp_path)}
    subprocess.run([sys.executable, "-c", parent], env=env, check=True, timeout=60)
    found = profiles(tmp_path)
    assert len(found) == 2  # the parent at its atexit, the child through os._exit
    assert found[0][0]["started"] <= found[1][0]["started"] <= found[1][0]["atexit"]
    out = summarise(found[0][0], found[0][1], found[0][0]["started"], found[0][0]["atexit"])
    assert out["process"] == "-c" and out["profiled_s"] >= 0


def test_p7t_records_a_side_that_printed_its_result_and_then_aborted_at_exit(tmp_path) -> None:
    from bench.p7t import record, summary
    from bench.timed import Timed

    facts = 'p7-lightning {"test_digest": "d", "ended": 1.0}\n'
    aborted = Timed(-6, 21.0, 19.5, "0.9780", 12.0, ["test accuracy 0.9780\n", facts])
    r = record("lightning", aborted, tmp_path)
    assert (r["to_test_accuracy_s"], r["returncode"], r["test_digest"]) == (19.5, -6, "d")
    assert "exit status -6" in summary(r)
    with pytest.raises(RuntimeError, match="failed"):  # no result line: nothing to record
        record("lightning", Timed(-6, 3.0, None, None, 1.0, ["Aborted\n"]), tmp_path)


def test_p14_counts_each_saved_storage_once_less_the_parameters_and_freed_ones() -> None:
    from bench.p14_mesh_memory import held_bytes, local_bytes

    weight = torch.nn.Parameter(torch.zeros(8, 4))
    kept = torch.zeros(16, 16)  # 1,024 bytes, saved through two views
    freed = torch.zeros(100)
    freed.untyped_storage().resize_(0)  # as FSDP frees a gathered weight
    saved = [kept, kept[:4].t(), weight, weight.t(), freed, torch.zeros(3, dtype=torch.bfloat16)]
    assert held_bytes(saved, [weight]) == 16 * 16 * 4 + 3 * 2
    assert local_bytes([weight, torch.zeros(5, dtype=torch.float64)]) == 8 * 4 * 4 + 5 * 8


def test_p14_counts_a_dtensors_local_shard() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from bench.p14_mesh_memory import held_bytes, local_bytes, storages
    from bench.ranks import free_port

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        whole = torch.ones(6, 10)
        d = distribute_tensor(whole, mesh, [Shard(0)])
        assert [s.data_ptr() for s in storages(d)] == [d.to_local().untyped_storage().data_ptr()]
        assert local_bytes([d]) == 6 * 10 * 4 == held_bytes([d, d.to_local()], [])
    finally:
        torch.distributed.destroy_process_group()


def test_p14_reads_what_malloc_has_handed_out() -> None:
    from bench.p14_mesh_memory import malloc_in_use

    before = malloc_in_use()
    if before < 0:
        pytest.skip("the C library has no mallinfo2 (not glibc 2.33+)")
    big = torch.ones(16 * 2**20, dtype=torch.uint8)  # 16 MiB, written (not lazily mapped)
    grown = malloc_in_use() - before
    del big
    # within 1 MiB of the 16: other threads (gloo's, the sampler's) allocate and free a little
    # meanwhile (a fresh-clone run saw 1152 bytes fewer than 16 MiB)
    assert abs(grown - 16 * 2**20) < 2**20
    assert malloc_in_use() - before < 2**20
