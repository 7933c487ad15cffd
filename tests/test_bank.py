"""A simulation bank: a kit study trains on (x, θ) arrays a researcher already has (data.bank)."""

import io
import os
import zipfile

import numpy as np
import pytest
import torch

import nre_study
import runtime
from settings import SettingsError

CPU = runtime.Runtime(device=torch.device("cpu"))
SIZES = {"train": 300, "validation": 100, "test": 50}


class Line(nre_study.Study):
    """x = slope · (−1, 0, 1) + offset + noise."""

    parameters = {"slope": (-1.0, 1.0), "offset": (-1.0, 1.0)}

    def simulate(self, theta, generator):
        noise = torch.randn(theta.shape[0], 3, generator=generator, dtype=torch.float64)
        return theta[:, :1] * torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64) + theta[:, 1:] + 0.3 * noise


class BankOnly(nre_study.Study):
    """The same parameters with no simulator: only a bank can train it."""

    parameters = Line.parameters


def settings(**data):
    """Kit settings of one uniform-prior member, training briefly."""
    return {
        "seed": 5,
        "cohort": {"priors": ["uniform"], "replicas": 1},
        "priors": {"uniform": {"family": "uniform"}},
        "data": {**SIZES, **data},
        "training": {"epochs": 2, "batch_size": 64},
    }


def simulated_bank(path):
    """The arrays the kit simulates for the member, saved in the splits' order as a bank."""
    study = Line(settings())
    arrays = study.sample_data(study.members()[0])
    x = np.concatenate([arrays[f"{split}_x"] for split in nre_study.SPLITS]).astype(np.float64)
    theta = np.concatenate([arrays[f"{split}_theta"] for split in nre_study.SPLITS]).astype(np.float64)
    np.savez(path, x=x, theta=theta)
    return study, arrays


def train(study):
    """The member's weights, trained on its data as a launch would."""
    member = study.members()[0]
    weights, _ = study.train(member, study.build_model(member), study.sample_data(member), CPU)
    return weights


@pytest.mark.unit
def test_a_bank_trains_the_same_model_as_the_same_simulations(tmp_path):
    simulated, arrays = simulated_bank(tmp_path / "bank.npz")
    banked = Line(settings(bank=str(tmp_path / "bank.npz")))
    banked.validate()
    again = banked.sample_data(banked.members()[0])
    assert sorted(again) == sorted(arrays) and all(np.array_equal(again[k], arrays[k]) for k in arrays)
    one, two = train(simulated), train(banked)
    assert all(torch.equal(one[k], two[k]) for k in one)


@pytest.mark.unit
def test_a_bank_is_keyed_by_its_content_not_its_path(tmp_path):
    simulated_bank(tmp_path / "bank.npz")
    (tmp_path / "moved").mkdir()
    (tmp_path / "bank.npz").rename(tmp_path / "moved" / "renamed.npz")
    member = {"name": "uniform-r0", "prior": "uniform", "replica": 0}
    moved = Line(settings(bank=str(tmp_path / "moved" / "renamed.npz"))).data_recipe(member)
    simulated_bank(tmp_path / "bank.npz")
    assert Line(settings(bank=str(tmp_path / "bank.npz"))).data_recipe(member) == moved
    with np.load(tmp_path / "bank.npz") as bank:
        np.savez(tmp_path / "other.npz", x=bank["x"] + 1, theta=bank["theta"])
    assert Line(settings(bank=str(tmp_path / "other.npz"))).data_recipe(member) != moved


@pytest.mark.unit
def test_a_study_without_a_simulator_trains_on_its_bank(tmp_path):
    _, arrays = simulated_bank(tmp_path / "bank.npz")
    with pytest.raises(SettingsError, match=r"must define simulate\(theta, generator\), or train on .* \(data\.bank\)"):
        BankOnly(settings()).validate()
    study = BankOnly(settings(bank=str(tmp_path / "bank.npz")))
    study.validate()
    assert study.problem().dimension == 3 and study.problem().simulate is None
    data = study.sample_data(study.members()[0])
    assert all(np.array_equal(data[k], arrays[k]) for k in arrays)


def npz_with_header(path, shape):
    """An .npz whose member x.npy declares `shape` float64 but holds no data (a header of 10^12 rows)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", header.getvalue())
        archive.writestr("theta.npy", npy_bytes(np.zeros((600, 2))))


def npy_bytes(array):
    """The bytes numpy.save writes for `array`."""
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def truncated_npz(path):
    """A good bank's .npz cut in the middle."""
    np.savez(path, x=np.zeros((600, 3)), theta=np.zeros((600, 2)))
    path.write_bytes(path.read_bytes()[:9000])


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda p: np.savez(p, x=np.zeros((600, 3)), theta=np.zeros((600, 3))),
            r"theta \(600, 3\) must be .* \(n, 2\)",
        ),
        (
            lambda p: np.savez(p, x=np.zeros((100, 3)), theta=np.zeros((100, 2))),
            "holds 100 simulations; .* ask for 450",
        ),
        (
            lambda p: np.savez(p, x=np.zeros((600, 3)), theta=np.full((600, 2), np.nan)),
            r"must be real numbers \(θ finite\)",
        ),
        (lambda p: np.savez(p, y=np.zeros(3)), "cannot read"),
        (lambda p: np.savez(p, x=np.zeros((600, 4)), theta=np.zeros((600, 2))), "x has 4 numbers per row where Line"),
        (lambda p: p.write_bytes(b"not a bank"), "cannot read"),
        (lambda p: p.write_bytes(npy_bytes(np.zeros((600, 3)))), r"one array of a \.npy file, not an \.npz archive"),
        (truncated_npz, r"cannot read .*bank\.npz as a bank \(.*\); save one with numpy\.savez"),
        (lambda p: npz_with_header(p, (10**12, 3)), r"declares 3,000,000,000,000 numbers, over the 100,000,000"),
        (
            lambda p: np.savez(p, x=np.array([[1.0, 2.0]], dtype=object), theta=np.zeros((1, 2))),
            "holds object, not real numbers",
        ),
        (lambda p: np.savez(p, x=np.zeros((600, 0)), theta=np.zeros((600, 2))), r"\(n, d\) and \(n, 2\), d ≥ 1"),
        (
            lambda p: np.savez(p, x=np.full((600, 3), 1e300), theta=np.zeros((600, 2))),
            r"its x holds finite values beyond float32's range .* rescale them",
        ),
        (lambda p: np.savez(p, x=np.zeros((600, 3)), theta=np.full((600, 2), 1e39)), "its theta holds finite values"),
        (lambda p: np.savez(p, x=np.zeros((600, 3)) + 1j, theta=np.zeros((600, 2))), "holds complex128, not real"),
        (lambda p: p.mkdir(), r"is not a regular file \(a folder, FIFO or device\)"),
        (lambda p: os.mkfifo(p), r"is not a regular file"),  # opening it would block for ever
        (
            lambda p: np.savez(p, x=np.zeros((600, 3)), theta=np.full((600, 2), 2.5)),
            r"100\.0% of its θ rows lie outside the parameter box \(e\.g\. θ = \[2\.5, 2\.5\]\).*; widen `parameters`",
        ),
    ],
)
@pytest.mark.unit
def test_a_bad_bank_is_refused_naming_the_setting(tmp_path, make, message):
    path = tmp_path / "bank.npz"
    make(path)
    with pytest.raises(SettingsError, match=rf"^data\.bank: .*{message}"):
        Line(settings(bank=str(path))).validate()
    with pytest.raises(SettingsError, match=r"^data\.bank: a bank holds joint simulations"):
        Line(settings(bank=str(path), pairing="fixed")).validate()


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"x": 1, "theta": 2}, r'expected "bank\.npz" .* got \{'),
        ("/dev/zero", r"/dev/zero is not a regular file"),  # was read as "pickled data"
        ({"x": "/dev/zero", "theta": "/dev/zero"}, r"\.x: /dev/zero is not a regular file"),
    ],
)
@pytest.mark.unit
def test_a_bank_setting_that_names_no_bank_file_is_refused_in_one_line(spec, message):
    with pytest.raises(SettingsError, match=rf"^data\.bank.*{message}"):
        Line(settings(bank=spec)).validate()


@pytest.mark.unit
def test_bank_theta_a_little_outside_the_box_is_a_plan_warning_naming_the_share(tmp_path):
    theta = np.random.default_rng(0).uniform(-1, 1, (600, 2))
    theta[:30, 0] = 1.5  # 5% outside
    np.savez(tmp_path / "bank.npz", x=np.zeros((600, 3)), theta=theta)
    study = Line({**settings(bank=str(tmp_path / "bank.npz")), "output": {"root": str(tmp_path / "out")}})
    study.validate()
    assert study.plan_warnings() == [
        r"data.bank: 5.0% of its θ rows lie outside the parameter box (e.g. θ = "
        f"{[1.5, round(float(theta[0, 1]), 4)]}), where no posterior is computed; widen "
        '`parameters` until it holds them (docs/training.md, "What `data` counts: '
        'simulations, each a joint pair used twice")'
    ]


BANK_STUDY = """
import nre_study


class BankOnly(nre_study.Study):
    parameters = {"slope": (-1.0, 1.0), "offset": (-1.0, 1.0)}
"""


@pytest.mark.launch
def test_the_command_line_trains_a_bank_study_refuses_its_analysis_and_infers(tmp_path):
    import json

    from helpers import main_in_process, write_settings

    simulated_bank(tmp_path / "bank.npz")
    module = f"bank_{tmp_path.name}"
    training = (
        f'settings["experiment"] = "{module}:BankOnly"\ndel settings["problem"]\n'
        f'settings["cohort"]["priors"] = ["uniform"]\n'
        f'settings["data"] = {{**{SIZES!r}, "bank": {str(tmp_path / "bank.npz")!r}}}\n'
    )
    folder = write_settings(
        tmp_path / "settings", tmp_path / "out", training, 'settings = {"analysis": "nre_analysis:NREAnalysis"}\n'
    )
    (folder / f"{module}.py").write_text(BANK_STUDY)
    refused = main_in_process("run", "--settings-dir", str(folder))
    assert refused.returncode == 2 and "BankOnly defines no simulate(theta, generator)" in refused.stderr
    assert not (tmp_path / "out").exists()
    trained = main_in_process("train", "--settings-dir", str(folder))
    assert trained.returncode == 0, trained.stderr
    run = next((tmp_path / "out").glob("runs/*/uniform-r0-*"))
    np.save(tmp_path / "x.npy", np.array([0.5, 0.2, -0.1]))
    inferred = main_in_process("infer", str(run), "--observations", str(tmp_path / "x.npy"), "--samples", "200")
    assert inferred.returncode == 0, inferred.stderr
    summary = json.loads((tmp_path / "x-uniform-r0.posterior.json").read_text())
    assert summary["parameters"] == ["slope", "offset"] and len(summary["mean"]) == 2


@pytest.mark.launch
def test_a_bank_overwritten_at_its_path_is_another_training_and_the_old_one_comes_back_trained(tmp_path):
    from helpers import kit_study, main_in_process

    bank = tmp_path / "bank.npz"
    simulated_bank(bank)
    with np.load(bank) as arrays:
        x, theta = arrays["x"], arrays["theta"]
    folder, _, root = kit_study(tmp_path, training=f'settings["data"]["bank"] = {str(bank)!r}\n')

    def train_now():
        """Train the settings on the bank as it is now: (the run folders, the trained models, the log)."""
        trained = main_in_process("train", "--settings-dir", str(folder))
        assert trained.returncode == 0, trained.stderr
        runs = sorted(str(run.relative_to(root)) for run in root.glob("runs/*/uniform-r0-*"))
        return runs, {model.name for model in root.glob("cache/model/*")}, trained.stdout

    runs_a, models_a, _ = train_now()
    np.savez(bank, x=x + 0.5, theta=theta)  # bank B, written over bank A at the same path
    runs_b, models_b, log_b = train_now()
    assert "] train   runs/" in log_b and runs_b != runs_a  # B is trained, in a run folder of its own
    assert len(models_b) == 2 and models_a < models_b  # A's model is kept: one of the last three trainings
    np.savez(bank, x=x, theta=theta)  # bank A back
    runs_again, models_again, log_again = train_now()
    assert runs_again == runs_a and models_again == models_b
    assert "] train   runs/" not in log_again and "] model   " + runs_a[0] + ": reused" in log_again, log_again
