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
    return {
        "seed": 5,
        "output": {"root": "outputs/none"},
        "cohort": {"priors": list(names), "replicas": 1},
        "priors": {"uniform": {"family": "uniform"}},
        "data": {"train": 100, "validation": 20, "test": 20},
    }


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
    with pytest.raises(
        SettingsError,
        match=r"simulate: two calls with generators of the same seed gave different "
        r"observations; draw every random number from the `generator`",
    ):
        study(settings()).validate()


def test_a_seeded_simulator_and_the_documented_wrapper_pass_and_leave_the_global_streams_alone():
    torch.manual_seed(3)
    np.random.seed(3)
    before = torch.rand(1), np.random.random_sample()
    torch.manual_seed(3)
    np.random.seed(3)
    for cls in (Seeded, NumpyWrapped):
        cls(settings()).validate()
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
    with pytest.raises(
        ValueError,
        match=r"^data\.train: \d+ of 100 simulations \(\d+\.\d+%\) returned NaN or "
        r"infinite values, e\.g\. at θ = \[2\.[4-9]\d*\]; .*data\.invalid = \"drop\"",
    ):
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
        f"data.{split}: {count} of {rows}"
        for split, count, rows in zip(("train", "validation", "test"), dropped, (100, 20, 20))
        if count
    )
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
    assert reported == [
        ("data.train", 0, chunk + 10),
        ("data.train", chunk, chunk + 10),
        ("data.train", chunk + 10, chunk + 10),
        ("data.validation", 0, 20),
        ("data.validation", 20, 20),
        ("data.test", 0, 20),
        ("data.test", 20, 20),
    ]
    seed = runtime.derived_seed(5, "data", "uniform-r0")
    first_x, first_theta = nre_study.sample_joint(
        kit.problem(), kit.prior(member), chunk, runtime.seeded_generator(seed, "split", "train")
    )
    assert np.array_equal(arrays["train_x"][:chunk], first_x.numpy())
    assert np.array_equal(arrays["train_theta"][:chunk], first_theta.numpy())
    assert arrays["train_x"].shape == (chunk + 10, 2) and not np.array_equal(
        arrays["train_x"][chunk:], first_x[:10].numpy()
    )
    study.report_progress("data.train", 1, 2)  # outside a launch: nothing to report to, no error


# ---------------------------------------------------------------- a study's science answered in one line at plan


class WiderAboveTwo(Seeded):
    """Right for one or two rows, a column too many for more (plan once simulated two)."""

    def simulate(self, theta, generator):
        x = super().simulate(theta, generator)
        return x if len(theta) <= 2 else torch.cat([x, x[:, :1]], dim=1)


class ListAboveTwo(Seeded):
    def simulate(self, theta, generator):
        x = super().simulate(theta, generator)
        return x if len(theta) <= 2 else x.tolist()


class Complex(Seeded):
    def simulate(self, theta, generator):
        return super().simulate(theta, generator) * (1 + 1j)


class ChangesTheta(Seeded):
    """Shifts θ in place (was blamed on the generator: the second call saw the shifted θ)."""

    def simulate(self, theta, generator):
        theta += 1
        return super().simulate(theta, generator)


class AlwaysInvalid(Seeded):
    def simulate(self, theta, generator):
        return super().simulate(theta, generator) * float("nan")


@pytest.mark.parametrize(
    "kind, message",
    [
        (
            WiderAboveTwo,
            r"^WiderAboveTwo\.simulate: returned 3 numbers per row for 16 rows but 2 for 1; return the same "
            r"observation width d for any number of rows",
        ),
        (ListAboveTwo, r"^ListAboveTwo\.simulate: for 16 parameter rows it returned list"),
        (Complex, r"^Complex\.simulate: returned torch\.complex128 values; return real numbers"),
        (ChangesTheta, r"^ChangesTheta\.simulate changed its θ argument in place; work on a copy"),
    ],
)
def test_a_simulator_that_breaks_the_contract_is_named_at_plan(kind, message):
    with pytest.raises(SettingsError, match=message):
        kind(settings()).validate()


def test_a_simulator_whose_width_changes_with_n_past_plans_batch_fails_at_train_in_one_line():
    class WiderAboveSixteen(Seeded):
        def simulate(self, theta, generator):
            x = super().simulate(theta, generator)
            return x if len(theta) <= nre_study.CHECK_ROWS else torch.cat([x, x[:, :1]], dim=1)

    kit = WiderAboveSixteen(settings())
    kit.validate()
    with pytest.raises(SettingsError, match=r"for 100 parameter rows it returned \(100, 3\); .* \(100, 2\)"):
        kit.sample_data(kit.members()[0])


def test_a_split_left_empty_under_drop_does_not_advise_drop():
    dropping = settings()
    dropping["data"]["invalid"] = "drop"
    with pytest.raises(
        ValueError, match=r"leaving 0 \(at least 2 needed\); fix the simulator there, or narrow"
    ) as error:
        AlwaysInvalid(dropping).sample_data(AlwaysInvalid(dropping).members()[0])
    assert "set data.invalid" not in str(error.value)


def test_a_contrastive_batch_smaller_than_classes_plus_one_is_refused_naming_the_setting():
    small = {**settings(), "training": {"batch_size": 8, "classes": 10}}
    with pytest.raises(
        SettingsError,
        match=r"^training\.batch_size: 8 rows per batch, fewer than training\.classes "
        r"\+ 1 = 11",
    ):
        Seeded(small).validate()
    Seeded({**settings(), "training": {"batch_size": 11, "classes": 10}}).validate()


@pytest.mark.parametrize(
    "parameter, message",
    [
        ({"low": 0.0, "high": 1.0, "normal_std": 0}, r"\.normal_std: expected a finite number in \(0, inf\]"),
        ({"low": 0.0, "high": 1.0, "normal_std": -1}, r"\.normal_std: expected a finite number"),
        ({"low": 0.0, "high": 1.0, "normal_mean": float("nan")}, r"\.normal_mean: expected a finite number"),
        ({"low": 0.0, "high": 1.0, "exponential_rate": float("inf")}, r"\.exponential_rate: expected a finite number"),
        ((float("nan"), 1.0), r"\.low: expected a finite number"),
        ((0.0, float("inf")), r"\.high: expected a finite number"),
        ((-1e308, 1e308), r"\.low: expected a finite number in \[-3\.40282e\+38, 3\.40282e\+38\]"),
    ],
)
def test_the_bundled_priors_hyper_parameters_are_checked_at_plan(parameter, message):
    class Declared(Seeded):
        parameters = {"mu": parameter}

    with pytest.raises(SettingsError, match=rf"^Declared\.parameters\['mu'\]{message}"):
        Declared(settings()).validate()


class NanPrior(LogNormal):
    def sample(self, n, generator):
        return super().sample(n, generator) * float("nan")


class LateNanPrior(LogNormal):
    """Finite for plan's draws, NaN from the 17th row on: only training meets it."""

    def sample(self, n, generator):
        theta = super().sample(n, generator)
        theta[nre_study.CHECK_ROWS :] = float("nan")
        return theta


class GlobalStreamPrior(LogNormal):
    def sample(self, n, generator):
        return torch.exp(torch.randn(n, 1, dtype=torch.float64))


class SetDescribed(LogNormal):
    def describe(self):
        return {"support": {"positive"}}


@pytest.mark.parametrize(
    "prior, message",
    [
        (NanPrior(), r"^priors\.own \(NanPrior\): sample\(\) drew NaN or infinite θ"),
        (
            GlobalStreamPrior(),
            r"^priors\.own \(GlobalStreamPrior\): two sample\(\) calls with generators of the same seed "
            r"drew different θ; draw every random number from the `generator`",
        ),
        (SetDescribed(), r"^priors\.own \(SetDescribed\): describe\(\) returned a value JSON cannot hold"),
    ],
)
def test_a_custom_prior_that_breaks_the_contract_is_named_at_plan(prior, message):
    class Own(Boxed):
        custom_priors = {"own": prior}

    with pytest.raises(SettingsError, match=message):
        Own(settings(["own"])).validate()


def test_a_custom_prior_drawing_nan_in_training_is_named_as_the_prior_not_the_simulator():
    class Own(Boxed):
        custom_priors = {"own": LateNanPrior()}

    kit = Own(settings(["own"]))
    kit.validate()
    with pytest.raises(SettingsError, match=r"^data\.train: the prior \(LateNanPrior\) drew NaN or infinite θ"):
        kit.sample_data(kit.members()[0])
