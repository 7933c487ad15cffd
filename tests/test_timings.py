"""Timings of launches: timings.json per run and per launch, the table, the advice, NNPD_PROBES."""

import functools
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fingerprint
import nnpd
import timings
from helpers import REPO, ahead, made_ahead, run_cli, side_by_side, torchrun, write_settings

STEP = {"train.forward", "train.loss", "train.backward", "train.optimizer", "train.validation"}


def run_timings(root):
    """{run folder name: its timings.json} of every run of an output root."""
    return {path.parent.name: json.loads(path.read_text()) for path in Path(root).glob("runs/*/*/timings.json")}


def run_count(root):
    """How many run folders an output root has."""
    return len(list(Path(root).glob("runs/*/*/run.json")))


# ---------------------------------------------------------------- the arithmetic


@pytest.mark.unit
def test_phases_add_counts_and_times_and_combine_extremes():
    total = timings.add_phases(
        {}, {"a": {"count": 2, "nested": 0, "total_s": 1.0, "min_s": 0.2, "max_s": 0.8, "cpu_s": 0.9}}
    )
    timings.add_phases(
        total,
        {
            "a": {"count": 1, "nested": 1, "total_s": 0.5, "min_s": 0.5, "max_s": 0.5, "cpu_s": 0.4, "device_s": 0.3},
            "b": {"count": 1, "nested": 0, "total_s": 0.1, "min_s": 0.1, "max_s": 0.1, "cpu_s": 0},
        },
    )
    assert total["a"] == {
        "count": 3,
        "nested": 1,
        "total_s": 1.5,
        "min_s": 0.2,
        "max_s": 0.8,
        "cpu_s": 1.3,
        "device_s": 0.3,
    }
    assert total["b"]["count"] == 1


@pytest.mark.unit
def test_busy_share_takes_the_largest_jobs_first():
    assert timings.busy_share([1.0, 1.0, 1.0, 1.0], 2) == 1.0
    # largest first onto the freer worker: loads 3+2+2 = 7 and 3+2 = 5
    assert timings.busy_share([3.0, 3.0, 2.0, 2.0, 2.0], 2) == pytest.approx(12 / 14)
    assert timings.busy_share([5.0], 2) == 0.5


@pytest.mark.unit
def test_advice_weighs_communication_against_idle_workers():
    heavy = timings.advise("ddp", 2, [1.0, 1.0, 1.0, 1.0], 0.7)
    assert "70% of each training step" in heavy and 'runtime.parallel="jobs"' in heavy and "faster" in heavy
    light = timings.advise("ddp", 2, [4.0, 1.0], 0.1)
    assert light.startswith('keep runtime.parallel="ddp"') and "10%" in light
    unknown = timings.advise("ddp", 2, [1.0, 1.0], "no training step was timed")
    assert "unknown (no training step was timed)" in unknown
    assert timings.advise("jobs", 2, [1.0, 1.0], "x").startswith('keep runtime.parallel="jobs"')
    idle = timings.advise("jobs", 4, [1.0, 1.0], "x")
    assert "only about 50% busy" in idle and '"ddp"' in idle
    assert "side by side" in timings.advise("jobs", 1, [1.0, 2.0, 3.0], "x")


@pytest.mark.unit
def test_communication_share_needs_device_time_on_cuda():
    cpu = {"step_s": 2.0, "communicate_s": 0.5, "clock": "host", "device_type": "cpu"}
    assert timings.communication_share(cpu) == 0.25
    assert "NNPD_PROBES_CUDA=1" in timings.communication_share({**cpu, "device_type": "cuda"})
    assert timings.communication_share({**cpu, "device_type": "cuda", "clock": "device"}) == 0.25
    assert isinstance(timings.communication_share(None), str)
    for broken in ({**cpu, "step_s": None}, {**cpu, "step_s": "2"}, {**cpu, "communicate_s": []}):
        assert isinstance(timings.communication_share(broken), str)  # a damaged record is "unknown"


@pytest.mark.unit
def test_run_sections_keep_the_work_of_earlier_launches():
    worked = {"0": {"wall_s": 9.0, "phases": {"train.forward": {"count": 1, "total_s": 8.0}}}}
    old = {"training": {"launch": "old", "workers": worked}, "analysis": {"launch": "old", "workers": worked}}
    part = {"training": {"wall_s": 1.0, "phases": {}}, "analysis": {"wall_s": 2.0, "phases": {}}}
    reused = timings.run_sections(old, {0: (part, set())}, {"launch": "new"})
    assert reused == old  # nothing redone: the old sections stay
    analysed = timings.run_sections(old, {0: (part, {"analysis"})}, {"launch": "new"})
    assert analysed["training"] == old["training"] and analysed["analysis"]["launch"] == "new"
    retrained = timings.run_sections(old, {0: ({"training": part["training"]}, {"training"})}, {"launch": "new"})
    assert set(retrained) == {"training"} and retrained["training"]["launch"] == "new"  # old analysis dropped
    assert timings.run_sections({}, {0: (part, set())}, {"launch": "new"})["analysis"]["workers"]["0"]["wall_s"] == 2.0
    for phases in (
        {},
        {"train.forward": "8"},
        {"train.forward": {"count": 1, "total_s": None}},
        {"train.forward": {"count": 1, "total_s": 8.0, "cpu_s": "x"}},
    ):
        damaged = {
            "training": {"launch": "old", "workers": {"0": {"wall_s": "9" if not phases else 9.0, "phases": phases}}}
        }
        kept = timings.run_sections(damaged, {0: (part, set())}, {"launch": "new"})
        assert kept["training"]["launch"] == "new", phases  # a section of the wrong shape is replaced
    assert timings.job_record(old, "cpu") == {
        "size_s": 18.0,
        "steps": {"step_s": 8.0, "communicate_s": 0.0, "clock": "host", "device_type": "cpu"},
    }


# ---------------------------------------------------------------- real launches


@pytest.mark.launch
def test_every_run_gets_timings_and_analysis_keeps_the_training_section(study_dir, tmp_path, capsys):
    root = tmp_path / "out"
    summary = nnpd.execute("train", "smoke", study_dir)
    trained = run_timings(root)
    assert len(trained) == run_count(root) == 4
    for record in trained.values():
        assert set(record) == {"training"}
        phases = record["training"]["workers"]["0"]["phases"]
        assert STEP <= set(phases) and "data.sample" in phases and phases["train.forward"]["count"] > 0
        assert record["training"]["probes"] in ("native", "python")
    launch = json.loads((root / "timings.json").read_text())
    assert launch["stage"] == "train" and set(launch["workers"]) == {"0"} and len(launch["jobs"]) == 4
    printed = capsys.readouterr().out
    assert "timings: 1 worker(s)" in printed and "train.backward" in printed
    assert f"advice: {summary['advice']}" in printed and "side by side" in summary["advice"]

    nnpd.execute("analyze", "smoke", study_dir)  # clears each run's analysis files, timings.json included
    analysed = run_timings(root)
    for name, record in analysed.items():
        assert record["training"] == trained[name]["training"]  # the training launch's section survives
        phases = record["analysis"]["workers"]["0"]["phases"]
        assert {"metric.bias", "product.learned", "product.truths"} <= set(phases)
    files = {path: path.read_bytes() for path in root.glob("runs/*/*/timings.json")}
    nnpd.execute("run", "smoke", study_dir)  # everything reused: the work's timings stay as they were
    assert {path: path.read_bytes() for path in root.glob("runs/*/*/timings.json")} == files
    assert json.loads((root / "timings.json").read_text())["stage"] == "run"


@pytest.mark.launch
def test_plan_advises_from_the_workload_then_from_the_timings_and_writes_nothing(study_dir, tmp_path):
    estimated = nnpd.plan("smoke", study_dir)["advice"]
    assert estimated.startswith("estimated from the workload (no timings")
    nnpd.execute("train", "smoke", study_dir)
    before = {path: path.stat().st_mtime_ns for path in (tmp_path / "out").rglob("*")}
    measured = nnpd.plan("smoke", study_dir)["advice"]
    assert measured.startswith("measured by the launch of") and "4 jobs" in measured
    assert {path: path.stat().st_mtime_ns for path in (tmp_path / "out").rglob("*")} == before


@pytest.mark.launch
def test_probes_off_launch_works_and_records_no_phases(tmp_path):
    settings = write_settings(tmp_path / "s", tmp_path / "out", training='settings["cohort"]["priors"] = ["uniform"]\n')
    done = run_cli("train", "--settings-dir", str(settings), env={"NNPD_PROBES": "off"})
    assert done.returncode == 0, done.stderr
    assert "probes were off (NNPD_PROBES=off)" in done.stdout and "\nadvice: " in done.stdout
    (record,) = run_timings(tmp_path / "out").values()
    assert record["training"]["probes"] == "off" and record["training"]["workers"]["0"]["phases"] == {}
    assert record["training"]["workers"]["0"]["wall_s"] > 0
    launch = json.loads((tmp_path / "out" / "timings.json").read_text())
    assert launch["probes"] == "off" and launch["workers"]["0"]["phases"] == {}


def train_with_switch(folder, name, value):
    """`train` of tiny settings in `folder` with the environment variable `name` set to `value`."""
    return run_cli("train", "--settings-dir", str(write_settings(folder / "s", folder / "out")), env={name: value})


@pytest.fixture(scope="module")
def bad_switch_launches(request, tmp_path_factory):
    """The launches of the cases below, made side by side before the first one."""
    return ahead(request, tmp_path_factory, "test_a_bad_probes_switch_is_one_line_and_exit_two", train_with_switch)


@pytest.mark.parametrize("name, value", [("NNPD_PROBES", "fast"), ("NNPD_PROBES_CUDA", "yes")])
@pytest.mark.launch
def test_a_bad_probes_switch_is_one_line_and_exit_two(bad_switch_launches, tmp_path, name, value):
    folder, done = made_ahead(bad_switch_launches, train_with_switch, tmp_path, name=name, value=value)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]  # one line, no traceback
    assert done.stderr.startswith(f"nnpd: settings error: {name}={value!r} is not valid")
    assert not (folder / "out").exists()


@pytest.mark.launch
def test_ddp_launch_writes_both_workers_phases_with_communication(tmp_path):
    ddp = 'settings["runtime"]["parallel"] = "ddp"\nsettings["cohort"]["priors"] = ["uniform", "grid"]\n'
    settings = write_settings(tmp_path / "s", tmp_path / "out", training=ddp)
    done = torchrun("run", "--settings-dir", str(settings))
    assert done.returncode == 0, done.stdout + done.stderr
    records = run_timings(tmp_path / "out")
    assert len(records) == run_count(tmp_path / "out") == 2
    for record in records.values():
        workers = record["training"]["workers"]
        assert set(workers) == {"0", "1"}
        for phases in (workers["0"]["phases"], workers["1"]["phases"]):
            assert STEP <= set(phases) and phases["train.communicate"]["count"] == phases["train.backward"]["count"]
        assert set(record["analysis"]["workers"]) == {"0"}  # rank 0 analyses
    launch = json.loads((tmp_path / "out" / "timings.json").read_text())
    assert set(launch["workers"]) == {"0", "1"} and launch["parallel"] == "ddp" and launch["world_size"] == 2
    assert 0 < launch["steps"]["communicate_s"] < launch["steps"]["step_s"]
    assert done.stdout.count("timings: 2 worker(s)") == 1 and "train.communicate" in done.stdout
    advice = [line for line in done.stdout.splitlines() if line.startswith("advice: ")]
    assert len(advice) == 1 and "of each training step" in advice[0]


def ddp_worker_result(tmp_path, probes_mode, workers=3):
    """Weights and histories of the DDP test worker's two trainings, with the probes on or off.

    Three workers: DDP scales each gradient by 1/3, which unlike 1/2 is not exact in floating point.
    """
    output = tmp_path / f"{probes_mode}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "NNPD_PROBES": probes_mode}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={workers}",
        str(REPO / "tests" / "ddp_train_worker.py"),
        str(output),
        "train",
        "41",
        "40",
        "2",
        "cpu",
    ]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[:3000]
    return torch.load(output)["result"]


@pytest.mark.launch
def test_the_timed_allreduce_trains_bitwise_like_ddps_own(tmp_path):
    launched = side_by_side({mode: functools.partial(ddp_worker_result, tmp_path, mode) for mode in ("python", "off")})
    timed, untimed = launched["python"], launched["off"]
    for objective in ("bce", "balanced"):
        assert timed[objective]["history"]["train_loss"] == untimed[objective]["history"]["train_loss"]
        for name, tensor in untimed[objective]["weights"].items():
            assert torch.equal(timed[objective]["weights"][name], tensor), (objective, name)


@pytest.mark.launch
def test_jobs_mode_workers_time_their_own_jobs(tmp_path):
    settings = write_settings(tmp_path / "s", tmp_path / "out")
    done = torchrun("train", "--settings-dir", str(settings))
    assert done.returncode == 0, done.stdout + done.stderr
    records = run_timings(tmp_path / "out")
    assert len(records) == run_count(tmp_path / "out") == 4
    workers = {tuple(record["training"]["workers"]) for record in records.values()}
    assert workers == {("0",), ("1",)}  # each run is timed by the one worker that did it
    launch = json.loads((tmp_path / "out" / "timings.json").read_text())
    assert set(launch["workers"]) == {"0", "1"} and len(launch["jobs"]) == 4
    for rank, worker in launch["workers"].items():
        assert worker["phases"]["train.forward"]["count"] > 0, rank
    assert "train.communicate" not in done.stdout  # no DDP, no all-reduce


# ---------------------------------------------------------------- a lighter launch path


@pytest.mark.parametrize(
    "name",
    [
        "gaussian_study:GaussianExperiment",
        "gaussian_study:GaussianAnalysis",
        "toy_study:SlopeExperiment",
        "jobs:Launch",
        "store:Store",
        "timings:LaunchTimer",
        "trainer:TrainingHooks",
    ],
)
@pytest.mark.unit
def test_source_text_is_inspects_text(name):
    module, _, attribute = name.partition(":")
    cls = getattr(__import__(module), attribute)
    assert fingerprint.source_text(cls) == inspect.getsource(cls)


@pytest.mark.unit
def test_source_text_falls_back_when_the_class_line_is_ambiguous(tmp_path, monkeypatch):
    source = (
        "class Twice:\n    def one(self):\n        return 1\n\n\n"
        "if True:\n    class Twice:\n        def two(self):\n            return 2\n"
    )
    (tmp_path / "twice_module.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    import twice_module

    path = inspect.getsourcefile(twice_module.Twice)
    assert fingerprint.class_block(twice_module.Twice, path, source.splitlines(True)) is None  # methods lie elsewhere
    assert fingerprint.source_text(twice_module.Twice) == inspect.getsource(twice_module.Twice)


@pytest.mark.unit
def test_source_text_keeps_a_decorator_parted_from_its_class_by_a_blank_line(tmp_path, monkeypatch):
    source = (
        "def mark(cls):\n    return cls\n\n\n@mark\n\n# a comment\nclass Spaced:\n"
        "    def one(self):\n        return 1\n"
    )
    (tmp_path / "spaced_module.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    import spaced_module

    text = fingerprint.source_text(spaced_module.Spaced)
    assert text == inspect.getsource(spaced_module.Spaced) and text.startswith("@mark")
