"""What plan checks of a kit study's science before any compute: the generator contract, the prior's box."""
import numpy as np
import pytest
import torch

import nre_study
import runtime
import study
from settings import SettingsError

pytestmark = pytest.mark.unit


def settings(names=("uniform",)):
    """Kit settings of one member per prior name (the bundled uniform family, or the study's own prior)."""
    return {"seed": 5, "output": {"root": "outputs/none"}, "cohort": {"priors": list(names), "replicas": 1},
            "priors": {"uniform": {"family": "uniform"}}, "data": {"train": 100, "validation": 20, "test": 20}}


class Seeded(nre_study.Study):
    """Draws from its generator, as the contract asks."""

    parameters = {"mu": (-3.0, 3.0)}

    def simulate(self, theta, generator):
        return theta + torch.randn(theta.shape[0], 2, generator=generator, dtype=torch.float64)


class TorchGlobal(Seeded):
    """Ignores its generator: torch's global stream."""

    def simulate(self, theta, generator):
        return theta + torch.randn(theta.shape[0], 2, dtype=torch.float64)


class NumpyGlobal(Seeded):
    """Ignores its generator: numpy's global stream."""

    def simulate(self, theta, generator):
        return theta + torch.as_tensor(np.random.normal(size=(len(theta), 2)))


class NumpyWrapped(Seeded):
    """numpy's global stream, seeded from the generator as docs/extending.md shows."""

    def simulate(self, theta, generator):
        seed = int(torch.randint(2**62, (), generator=generator))
        saved = np.random.get_state()
        np.random.seed(seed % 2**32)
        try:
            return theta + torch.as_tensor(np.random.normal(size=(len(theta), 2)))
        finally:
            np.random.set_state(saved)


class LogNormal:
    """A prior with mass beyond the box's upper edge (3): log-normal with median 1."""

    def sample(self, n, generator):
        return torch.exp(torch.randn(n, 1, generator=generator, dtype=torch.float64))

    def log_prob(self, theta):
        return torch.distributions.LogNormal(0.0, 1.0).log_prob(theta.clamp_min(1e-300)).sum(-1)


class Boxed(Seeded):
    parameters = {"mu": (0.0, 3.0)}
    custom_priors = {"lognormal": LogNormal()}


@pytest.mark.parametrize("study", [TorchGlobal, NumpyGlobal])
def test_a_simulator_ignoring_its_generator_is_refused_naming_the_fix(study):
    with pytest.raises(SettingsError, match=r"simulate: two calls with generators of the same seed gave different "
                                            r"observations; draw every random number from the `generator`"):
        study(settings()).validate()


def test_a_seeded_simulator_and_the_documented_wrapper_pass_and_leave_the_global_streams_alone():
    torch.manual_seed(3)
    np.random.seed(3)
    before = torch.rand(1), np.random.random_sample()
    torch.manual_seed(3)
    np.random.seed(3)
    for study in (Seeded, NumpyWrapped):
        study(settings()).validate()
    assert (torch.rand(1), np.random.random_sample()) == before


def test_plan_warns_of_prior_mass_outside_the_box_with_the_share():
    study = Boxed(settings(["lognormal", "uniform"]))
    study.validate()
    lines = study.plan_warnings()
    assert len(lines) == 1 and lines[0].startswith("prior 'lognormal': ")
    share = float(lines[0].split(": ")[1].split("%")[0]) / 100
    assert share == pytest.approx(1 - torch.distributions.Normal(0, 1).cdf(torch.tensor(np.log(3.0))).item(), abs=0.01)


class SometimesInvalid(Seeded):
    """Returns NaN for mu above 2.4: 10% of a uniform prior's draws on [-3, 3]."""

    def simulate(self, theta, generator):
        x = super().simulate(theta, generator)
        x[theta[:, 0] > 2.4] = float("nan")
        return x


def test_invalid_simulations_fail_the_sampling_with_the_share_and_a_theta_or_are_dropped():
    member = {"name": "uniform-r0", "prior": "uniform", "replica": 0}
    with pytest.raises(ValueError, match=r"^data\.train: \d+ of 100 simulations \(\d+\.\d+%\) returned NaN or "
                                         r"infinite values, e\.g\. at θ = \[2\.[4-9]\d*\]; .*data\.invalid = \"drop\""):
        SometimesInvalid(settings()).sample_data(member)
    dropping = settings()
    dropping["data"]["invalid"] = "drop"
    study = SometimesInvalid(dropping)
    study.validate()
    with pytest.warns(UserWarning, match=r"data\.\w+: .* dropped") as warned:
        arrays = study.sample_data(member)
    dropped = arrays["dropped_simulations"]
    assert dropped.shape == (3,) and dropped[0] > 0
    # One line per split that dropped simulations, each naming its split and count.
    assert sorted(str(warning.message).split(" simulations")[0] for warning in warned) == sorted(
        f"data.{split}: {count} of {rows}" for split, count, rows in zip(("train", "validation", "test"), dropped,
                                                                        (100, 20, 20)) if count)
    assert len(arrays["train_x"]) == 100 - dropped[0] and np.isfinite(arrays["train_x"]).all()
    assert (arrays["train_theta"] <= 2.4).all()
    with pytest.raises(SettingsError, match=r"^data\.invalid: 'skip' is not valid"):
        SometimesInvalid({**dropping, "data": {**dropping["data"], "invalid": "skip"}}).validate()


def test_a_split_is_simulated_in_chunks_reported_to_nnpd_the_first_from_the_splits_stream():
    member = {"name": "uniform-r0", "prior": "uniform", "replica": 0}
    chunk = nre_study.SIMULATION_CHUNK
    sized = settings()
    sized["data"]["train"] = chunk + 10
    kit = Seeded(sized)
    kit.validate()
    reported = []
    with study.progress_to(lambda what, done, total: reported.append((what, done, total))):
        arrays = kit.sample_data(member)
    assert reported == [("data.train", 0, chunk + 10), ("data.train", chunk, chunk + 10),
                        ("data.train", chunk + 10, chunk + 10), ("data.validation", 0, 20), ("data.validation", 20, 20),
                        ("data.test", 0, 20), ("data.test", 20, 20)]
    seed = runtime.derived_seed(5, "data", "uniform-r0")
    first_x, first_theta = nre_study.sample_joint(kit.problem(), kit.prior(member), chunk,
                                                  runtime.seeded_generator(seed, "split", "train"))
    assert np.array_equal(arrays["train_x"][:chunk], first_x.numpy())
    assert np.array_equal(arrays["train_theta"][:chunk], first_theta.numpy())
    assert arrays["train_x"].shape == (chunk + 10, 2) and not np.array_equal(arrays["train_x"][chunk:], first_x[:10].numpy())
    study.report_progress("data.train", 1, 2)           # outside a launch: nothing to report to, no error
