"""Rounds (rounds.py, docs/rounds.md): the cut prior, the rounds' keys, and a kit study trained in rounds."""

import math
import warnings

import numpy as np
import pytest
import torch

import jobs
import networks
import nre_study
import posterior
import rounds
from helpers import command, kit_study, main_in_process, saved_states, start, torchrun, wait_for, weights
from settings import SettingsError
from store import digest, restore

BOX = [[6.0, -0.5], [9.0, 0.25]]


class Pair(nre_study.Study):
    """Two parameters, a normal-prior one and a uniform-prior one, observed with noise."""

    parameters = {"a": (0.0, 10.0), "b": (-1.0, 1.0)}

    def simulate(self, theta, generator):
        return theta + 0.1 * torch.randn(theta.shape, generator=generator, dtype=torch.float64)


class OwnNormal:
    """A study's own prior object: independent normals N(5, 2.5) and N(0, 0.5), unbounded."""

    def sample(self, n, generator):
        return torch.randn(n, 2, generator=generator, dtype=torch.float64) * torch.tensor([2.5, 0.5]) + torch.tensor(
            [5.0, 0.0]
        )

    def log_prob(self, theta):
        z = (theta - torch.tensor([5.0, 0.0])) / torch.tensor([2.5, 0.5])
        return (-0.5 * z * z - 0.5 * math.log(2 * math.pi) - torch.log(torch.tensor([2.5, 0.5]))).sum(-1)


def pair_study(prior="mixed"):
    """A Pair study whose cohort is the one named prior."""
    study = Pair(
        {
            "seed": 3,
            "cohort": {"priors": [prior], "replicas": 1},
            "priors": {"mixed": {"family": "normal", "by_parameter": {"b": "uniform"}}},
            "data": {"train": 8, "validation": 4, "test": 4},
        }
    )
    study.custom_priors = {"own": OwnNormal()}
    return study


def truncated_normal_cdf(t, mean, sd, low, high):
    """The CDF of N(mean, sd) cut to [low, high]."""
    phi = lambda v: 0.5 * (1 + math.erf((v - mean) / (sd * math.sqrt(2))))  # noqa: E731
    return (np.vectorize(phi)(t) - phi(low)) / (phi(high) - phi(low))


def ks_distance(draws, cdf):
    """The Kolmogorov-Smirnov distance of draws from a CDF."""
    draws = np.sort(draws)
    n = len(draws)
    values = cdf(draws)
    return max(np.max(np.arange(1, n + 1) / n - values), np.max(values - np.arange(n) / n))


@pytest.mark.unit
@pytest.mark.parametrize("prior", ["mixed", "own"])
def test_the_cut_prior_draws_inside_the_box_and_follows_the_prior_there(prior):
    study = pair_study(prior)
    cut = study.prior({"name": f"{prior}-r0", "prior": prior, "replica": 0, "round": 2, "box": BOX})
    draws = cut.sample(20_000, torch.Generator().manual_seed(0)).numpy()
    assert ((draws >= BOX[0]) & (draws <= BOX[1])).all()
    # 1.63 / sqrt(n): the KS distance a correct sampler stays under 99% of the time.
    assert ks_distance(draws[:, 0], lambda t: truncated_normal_cdf(t, 5.0, 2.5, 6.0, 9.0)) < 1.63 / math.sqrt(20_000)
    second = (
        (lambda t: (t + 0.5) / 0.75) if prior == "mixed" else (lambda t: truncated_normal_cdf(t, 0.0, 0.5, -0.5, 0.25))
    )
    assert ks_distance(draws[:, 1], second) < 1.63 / math.sqrt(20_000)
    # Its density is renormalised to the box (exactly for a bundled family, from 2e5 draws for an object).
    a, b = np.meshgrid(
        6 + 3 * (np.arange(600) + 0.5) / 600, -0.5 + 0.75 * (np.arange(300) + 0.5) / 300, indexing="ij"
    )  # the midpoints of a 600 x 300 grid on the box
    mass = cut.log_prob(torch.from_numpy(np.stack([a, b], -1))).exp().mean().item() * 3 * 0.75
    assert mass == pytest.approx(1.0, abs=1e-4 if prior == "mixed" else 0.02)
    assert cut.log_prob(torch.tensor([[5.9, 0.0], [7.0, 0.3]])).isinf().all()


@pytest.mark.unit
def test_a_posterior_proposal_trains_near_the_posterior_and_tests_on_the_prior():
    study = pair_study()
    study.settings["data"] = {"train": 20_000, "validation": 100, "test": 20_000}
    member = study.members()[0]
    fit = {"shares": [1.0], "means": [[7.0, 0.0]], "covs": [[[0.01, 0.0], [0.0, 1e-4]]]}
    later = {**member, "round": 2, "box": BOX, "previous": "a" * 64, "observation": "b" * 64, "proposal": fit}
    arrays = study.sample_data(later)
    train, test = arrays["train_theta"], arrays["test_theta"]
    assert ((train >= BOX[0]) & (train <= BOX[1])).all() and ((test >= BOX[0]) & (test <= BOX[1])).all()
    # The test split, whose truths the analysis reads, is the cut prior's (as in the test above).
    assert ks_distance(test[:, 0], lambda t: truncated_normal_cdf(t, 5.0, 2.5, 6.0, 9.0)) < 1.63 / math.sqrt(20_000)
    assert ks_distance(test[:, 1], lambda t: (t + 0.5) / 0.75) < 1.63 / math.sqrt(20_000)

    def near(theta):  # the share within 4 widened sds of the fit's mean, where its Gaussian draws all fall
        return float((np.abs(theta - [7.0, 0.0]) < 4 * rounds.proposal_spread(2) * np.array([0.1, 0.01])).all(1).mean())

    share = rounds.PROPOSAL_PRIOR_SHARE
    assert near(test) < 0.2
    assert near(train) == pytest.approx((1 - share) + share * near(test), abs=0.015)
    assert rounds.proposal(study.prior(member), member) is None  # round 1 draws from the prior


@pytest.mark.unit
def test_the_proposal_fits_one_component_per_mode_and_draws_near_each():
    generator = torch.Generator().manual_seed(1)
    modes = torch.tensor([[6.5, -0.3], [8.5, 0.1]], dtype=torch.float64)
    sds = torch.tensor([0.05, 0.01], dtype=torch.float64)
    z = torch.randn(20_000, 2, generator=generator, dtype=torch.float64)
    first = torch.arange(20_000) % 4 == 0  # a quarter of the draws in the first mode, the rest in the second
    points = torch.where(first[:, None], modes[0], modes[1]) + z * sds
    fit = rounds.mixture_fit(points, torch.ones(20_000, dtype=torch.float64))
    order = np.argsort([mean[0] for mean in fit["means"]])
    assert len(fit["shares"]) == 2
    np.testing.assert_allclose(np.array(fit["shares"])[order], [0.25, 0.75], atol=0.01)
    np.testing.assert_allclose(np.array(fit["means"])[order], modes.numpy(), atol=0.01)
    one = rounds.mixture_fit(z * sds + modes[1], torch.ones(20_000, dtype=torch.float64))
    assert len(one["shares"]) == 1  # a single Gaussian needs no second component
    study = pair_study()
    later = {**study.members()[0], "round": 2, "box": BOX, "previous": "a" * 64, "observation": "b" * 64}
    cut = study.prior(later)
    draws, prior_draws = (
        rounds.PosteriorProposal(cut, fit, BOX).sample(20_000, generator),
        cut.sample(20_000, generator),
    )

    def near(theta, mode):  # the share within 4 widened sds of a mode, where its component's draws all fall
        return float((((theta - mode) / sds).abs() < 4 * rounds.proposal_spread(2)).all(1).double().mean())

    share = rounds.PROPOSAL_PRIOR_SHARE
    for mode, weight in zip(modes, (0.25, 0.75)):
        assert near(draws, mode) == pytest.approx((1 - share) * weight + share * near(prior_draws, mode), abs=0.015)


@pytest.mark.unit
def test_a_collapsed_fit_still_proposes_inside_the_box():
    study = pair_study()
    later = {**study.members()[0], "round": 2, "box": BOX, "previous": "a" * 64, "observation": "b" * 64}
    fit = {"shares": [1.0], "means": [[7.0, 0.0]], "covs": [[[0.0, 0.0], [0.0, 0.0]]]}  # no Cholesky factor
    draws = rounds.PosteriorProposal(study.prior(later), fit, BOX).sample(1000, torch.Generator().manual_seed(0))
    assert draws.shape == (1000, 2) and ((draws >= torch.tensor(BOX[0])) & (draws <= torch.tensor(BOX[1]))).all()
    assert int((draws == torch.tensor([7.0, 0.0])).all(1).sum()) == 1000 - round(1000 * rounds.PROPOSAL_PRIOR_SHARE)
    # A last simulation chunk of one row asks the prior for none: a study's own prior object is not asked.
    own = pair_study("own")
    cut = own.prior({"name": "own-r0", "prior": "own", "replica": 0, "round": 2, "box": BOX})
    one = rounds.PosteriorProposal(cut, fit, BOX).sample(1, torch.Generator().manual_seed(0))
    assert one.tolist() == [[7.0, 0.0]]


class Counts(nre_study.Study):
    """One parameter on a lattice of step 0.5 over [0, 10]."""

    parameters = {"k": (0.0, 10.0, 0.5)}

    def simulate(self, theta, generator):
        return theta + torch.randn(theta.shape, generator=generator, dtype=torch.float64)


@pytest.mark.unit
def test_a_lattice_prior_is_cut_on_its_own_lattice():
    study = Counts(
        {
            "seed": 3,
            "cohort": {"priors": ["grid"], "replicas": 1},
            "priors": {"grid": {"family": "grid"}},
            "data": {"train": 8, "validation": 4, "test": 4},
        }
    )
    low, high = rounds.snap_to_lattice(study.problem(), torch.tensor([2.3]), torch.tensor([7.1]))
    assert (low.item(), high.item()) == (2.0, 7.5)
    cut = study.prior(
        {"name": "grid-r0", "prior": "grid", "replica": 0, "round": 2, "box": [low.tolist(), high.tolist()]}
    )
    draws = cut.sample(4000, torch.Generator().manual_seed(0))[:, 0]
    assert set((draws * 2).round().tolist()) == set(range(4, 16))  # the 12 lattice points in the box
    assert torch.allclose(
        cut.log_prob(torch.arange(4, 16)[:, None] / 2.0), torch.tensor(-math.log(12.0), dtype=torch.float64)
    )
    # A Gaussian proposal's draws would leave the lattice: its rounds draw from the cut prior alone.
    assert not rounds.follows_a_proposal(study, study.members()[0])
    assert rounds.follows_a_proposal(pair_study(), pair_study().members()[0])


@pytest.mark.unit
def test_a_rounds_key_changes_with_the_observation_the_box_and_the_previous_model():
    study = pair_study()
    member = study.members()[0]
    later = {**member, "round": 2, "box": BOX, "previous": "a" * 64, "observation": "b" * 64, "history": [{"round": 1}]}

    def keys(m):
        return digest(study.data_recipe(m)), digest(study.model_recipe(m))

    first = keys(later)
    assert keys(member) != first
    for change in (
        {"observation": "c" * 64},
        {"previous": "d" * 64},
        {"box": [[6.0, -0.5], [9.5, 0.25]]},
        {"reuse": "e" * 64},
        {"warm": True},
        {"proposal": {"shares": [1.0], "means": [[7.0, 0.0]], "covs": [[[0.01, 0.0], [0.0, 1e-4]]]}},
    ):
        assert all(a != b for a, b in zip(keys({**later, **change}), first)), change
    assert keys({**later, "history": []}) == first  # what is recorded of earlier rounds is no key
    assert rounds.round_recipe(member) == {}  # round 1 shares the amortized model's keys


@pytest.mark.unit
def test_a_warm_round_starts_from_the_previous_rounds_weights_and_a_cold_one_does_not():
    study = pair_study()
    member = study.members()[0]
    later = {**member, "round": 2, "box": BOX, "previous": "a" * 64, "observation": "b" * 64}
    previous = study.build_model(member)
    torch.nn.init.normal_(next(previous.parameters()))  # weights no fresh network has
    study.round_states["a" * 64] = previous.state_dict()
    for warm in (True, False):
        model = study.build_model(later)
        rounds.warm_start(study, {**later, "warm": True} if warm else later, model)
        same = [torch.equal(a, b) for a, b in zip(model.state_dict().values(), previous.state_dict().values())]
        assert all(same) if warm else not all(same)
    with pytest.raises(rounds.RoundsError, match="previous round's weights"):
        rounds.warm_start(study, {**later, "warm": True, "previous": "c" * 64}, study.build_model(later))


@pytest.mark.unit
@pytest.mark.parametrize(
    "settings",
    [
        {"kind": "residual", "width": 16, "blocks": 2, "activation": "gelu"},
        {"kind": "mlp", "hidden": [16, 16], "activation": "relu"},
    ],
)
def test_restandardizing_keeps_the_networks_function_and_takes_the_new_transform(settings):
    generator = torch.Generator().manual_seed(5)
    spread = torch.tensor([1.0, 3.0, 0.1, 10.0], dtype=torch.float64)
    rows = 2 + spread * torch.randn(500, 4, generator=generator, dtype=torch.float64)
    model = networks.build_network(settings, 4)
    networks.fit_standardization(model, rows)
    before = model(rows.float()).detach()
    own = 1 + 0.05 * rows[:100]  # a round's own data: narrower, elsewhere
    assert networks.restandardize(model, own.mean(0), own.std(0))
    assert torch.equal(model.shift, own.mean(0).float()) and torch.equal(model.scale, own.std(0).float())
    assert torch.allclose(model(rows.float()).detach(), before, rtol=1e-4, atol=1e-4 * float(before.abs().max()))
    embedded = networks.build_network(settings, 4, embedding=torch.nn.Linear(2, 3), observation_size=2)
    assert not networks.restandardize(embedded, own.mean(0), own.std(0))  # no first layer of ours: unchanged
    assert torch.equal(embedded.scale, torch.ones(4))


@pytest.mark.unit
def test_a_warm_round_keeps_the_previous_function_on_its_own_standardisation():
    study = pair_study()
    member = study.members()[0]
    later = {**member, "round": 2, "box": BOX, "previous": "a" * 64, "observation": "b" * 64, "warm": True}
    generator = torch.Generator().manual_seed(9)
    wide = 3 * torch.randn(400, study.input_size(), generator=generator, dtype=torch.float64)
    previous = study.build_model(member)
    networks.fit_standardization(previous, wide)
    study.round_states["a" * 64] = previous.state_dict()
    narrow = 0.5 + 0.01 * wide[:50]  # the round's data, in a box far smaller than the prior
    model = study.build_model(later)
    networks.fit_standardization(model, narrow)
    rounds.warm_start(study, later, model)
    assert torch.equal(model.scale, narrow.std(0).float())  # standardised on its own data, not round 1's
    expected = previous(narrow.float()).detach()
    assert torch.allclose(model(narrow.float()).detach(), expected, atol=1e-4 * float(expected.abs().max()))


@pytest.mark.unit
def test_a_rounds_section_is_checked_at_plan(tmp_path):
    study = pair_study()
    for section, names in (
        ({"count": 0, "observation": "x.npy"}, "rounds.count"),
        ({"count": 2, "observation": "x.npy", "truncation": 0.0}, "rounds.truncation"),
        ({"count": 2, "observation": str(tmp_path / "none.npy")}, "rounds.observation"),
        ({"count": 2, "observation": "x.npy", "budget": 3}, "rounds"),
        ({"count": 2, "observation": "x.npy", "warm": "yes"}, "rounds.warm"),
        ({"count": 2, "observation": "x.npy", "proposal": "gaussian"}, "rounds.proposal: one of 'posterior'"),
    ):
        study.settings["rounds"] = section
        with pytest.raises(SettingsError, match=names):
            study.validate()
    # A bank holds draws of the whole prior, not of a round's box: rounds refuse it.
    theta = study.prior(study.members()[0]).sample(64, torch.Generator().manual_seed(0))
    np.savez(tmp_path / "bank.npz", x=study.simulate(theta, torch.Generator().manual_seed(1)).numpy(), theta=theta)
    np.save(tmp_path / "x.npy", np.zeros(2))
    study.settings["rounds"] = {"count": 2, "observation": str(tmp_path / "x.npy")}
    study.settings["data"] = {**study.settings["data"], "bank": str(tmp_path / "bank.npz")}
    with pytest.raises(SettingsError, match="rounds: a bank's simulations come from the whole prior"):
        study.validate()
    del study.settings["data"]["bank"]
    np.save(tmp_path / "wrong.npy", np.zeros(3))
    study.settings["rounds"] = {"count": 2, "observation": str(tmp_path / "wrong.npy")}
    with pytest.raises(SettingsError, match=r"expected \(2,\)"):
        study.validate()
    once = study.workload(study.members()[0])["training_examples"]
    study.settings["rounds"]["count"] = 3  # three trainings: the launch's cost estimate says so
    assert study.workload(study.members()[0])["training_examples"] == 3 * once // 2
    del study.settings["rounds"]["count"]  # the documented default
    assert rounds.rounds_settings(study.settings) == {
        "count": 3,
        "observation": str(tmp_path / "wrong.npy"),
        "truncation": 1e-3,
        "reuse": True,
        "warm": True,
        "proposal": "posterior",
    }


@pytest.mark.unit
def test_a_posterior_pressed_against_a_cut_face_is_named_in_a_warning():
    study = pair_study()
    problem = rounds.BoxProblem(study.problem(), BOX)
    points = torch.tensor([[6.01, 0.0], [7.0, 0.0], [8.0, -0.1], [8.5, 0.1]], dtype=torch.float64)
    masses = torch.tensor([0.01, 0.5, 0.29, 0.2], dtype=torch.float64)
    edges = rounds.edge_mass(problem, study.problem(), points, masses)
    assert edges == pytest.approx([0.01, 0.0])
    lines = rounds.edge_warnings(["a", "b"], {"round": 2, "edge_mass": edges}, 1e-3)
    assert len(lines) == 1 and "'a'" in lines[0] and "rounds.truncation" in lines[0]


# ---------------------------------------------------------------- a study trained in rounds

X_O = np.array([0.3, 0.5, 0.7])  # slope 0.2, offset 0.5 with noise 0.05: posterior sds about 0.03
EPSILON = 1e-3
ROUNDS_TRAINING = """
settings["data"] = {{"train": 2000, "validation": 500, "test": 200}}
settings["model"] = {{"kind": "mlp", "hidden": [32, 32], "activation": "relu"}}
settings["training"].update(epochs=30, learning_rate=3e-3)
settings["rounds"] = {{"count": 3, "observation": {path!r}, "truncation": {epsilon}}}
"""


@pytest.fixture(scope="module")
def trained_in_rounds(tmp_path_factory):
    """A Line study trained in three rounds for X_O, then trained again: (root, first, second outputs)."""
    tmp = tmp_path_factory.mktemp("rounds")
    np.save(tmp / "x_o.npy", X_O)
    folder, _, root = kit_study(
        tmp,
        training=ROUNDS_TRAINING.format(path=str(tmp / "x_o.npy"), epsilon=EPSILON),
        analysis='settings["plots"] = ["rounds"]\n',
        noise=0.05,
    )
    first = main_in_process("train", "--settings-dir", str(folder))
    second = main_in_process("train", "--settings-dir", str(folder))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    return root, first.stdout, second.stdout


@pytest.mark.launch
def test_a_study_trains_its_rounds_and_a_rerun_rebuilds_nothing(trained_in_rounds):
    root, first, second = trained_in_rounds
    for line in ("round 1 of 3: box 100% of the prior's volume", "round 2 of 3", "round 3 of 3"):
        assert line in first and line in second
    assert first.count(": sampling") == 3 and first.count("trained in") == 3
    assert ": sampling" not in second and "train   " not in second and second.count("reused") == 8
    member = restore(next(root.glob("runs/*/*/run.json")).parent).member
    assert member["round"] == 3 and [row["round"] for row in member["history"]] == [1, 2, 3]
    assert member["warm"] is True  # rounds.warm, the default: round 3 started from round 2's weights
    volumes = [row["volume"] for row in member["history"]]
    low, high = (np.array(bound) for bound in member["box"])
    assert volumes[0] == 1 and volumes[1] < 0.2 and volumes[2] <= volumes[1]
    # Rounds 2 and 3 also train on the earlier simulations inside their boxes (rounds.reuse, the default).
    fresh = 2700
    assert [row["simulations"] - row["reused"] for row in member["history"]] == [fresh] * 3
    assert member["history"][0]["reused"] == 0 and all(row["reused"] > 0 for row in member["history"][1:])
    # Half of rounds 2 and 3's train and validation draws followed the previous posterior (rounds.proposal).
    assert [row["proposal"] for row in member["history"]] == ["prior", "posterior", "posterior"]
    assert "near round 1's posterior" in first and "near round 2's posterior" in first
    fit = member["proposal"]
    means, covs = np.array(fit["means"]), np.array(fit["covs"])
    assert np.all(means >= low) and np.all(means <= high) and means.shape[1] == 2 and covs.shape[1:] == (2, 2)
    assert sum(fit["shares"]) == pytest.approx(1.0)


@pytest.mark.launch
def test_the_last_rounds_posterior_lies_in_its_box_and_the_exact_one_keeps_its_mass_there(trained_in_rounds):
    root, _, _ = trained_in_rounds
    restored = restore(next(root.glob("runs/*/*/run.json")).parent)
    low, high = (np.array(bound) for bound in restored.member["box"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rounds' own observation: no warning
        samples = restored.posterior(X_O).sample(2000, seed=1).numpy()
    assert ((samples >= low) & (samples <= high)).all()
    # The exact posterior (uniform prior on [-1, 1]^2, Gaussian noise 0.05) on a fine grid keeps 1 - ε in the box.
    slope, offset = np.meshgrid(np.linspace(-1, 1, 2001), np.linspace(-1, 1, 2001), indexing="ij")
    mean = slope[..., None] * np.array([-1.0, 0.0, 1.0]) + offset[..., None]
    log_likelihood = -0.5 * (((X_O - mean) / 0.05) ** 2).sum(-1)
    weights = np.exp(log_likelihood - log_likelihood.max())
    box = (slope >= low[0]) & (slope <= high[0]) & (offset >= low[1]) & (offset <= high[1])
    assert weights[box].sum() / weights.sum() >= 1 - EPSILON
    # ... and, as the report's truncation check, at most ε within the edge band of each face the box cut.
    theta = torch.from_numpy(np.stack([slope[box], offset[box]], -1))
    masses = torch.from_numpy(weights[box] / weights[box].sum())
    edges = rounds.edge_mass(
        rounds.BoxProblem(restored.experiment.problem(), restored.member["box"]),
        restored.experiment.problem(),
        theta,
        masses,
    )
    assert max(edges) <= EPSILON and edges == pytest.approx(restored.member["history"][-1]["edge_mass"], abs=0.01)


@pytest.mark.launch
def test_another_observation_gets_one_warning_line(trained_in_rounds):
    root, _, _ = trained_in_rounds
    restored = restore(next(root.glob("runs/*/*/run.json")).parent)
    with pytest.warns(posterior.PosteriorWarning, match="trained in rounds for another observation") as caught:
        restored.posterior(X_O + 0.01)
    assert len([w for w in caught if "rounds" in str(w.message)]) == 1


@pytest.mark.launch
def test_infer_prints_one_warning_line_for_another_observation(trained_in_rounds, tmp_path):
    root, _, _ = trained_in_rounds
    run = next(root.glob("runs/*/*/run.json")).parent
    np.save(tmp_path / "other.npy", X_O + 0.01)
    result = main_in_process("infer", str(run), "--observations", str(tmp_path / "other.npy"), "--samples", "100")
    assert result.returncode == 0, result.stderr
    printed = result.stdout + result.stderr
    assert printed.count("warning: this model was trained in rounds for another observation") == 1, printed


@pytest.mark.launch
def test_the_analysis_of_the_last_round_tests_it_inside_the_final_box(trained_in_rounds):
    root, _, _ = trained_in_rounds
    folder = root.parent / "settings"
    result = main_in_process("analyze", "--settings-dir", str(folder))
    assert result.returncode == 0, result.stderr
    restored = restore(next(root.glob("runs/*/*/run.json")).parent)
    low, high = (np.array(bound) for bound in restored.member["box"])
    truths = restored.array("truths", "truths")
    assert ((truths >= low) & (truths <= high)).all()
    assert restored.metrics["coverage"]["0.68"]["cases"] == len(truths)
    rows = [line for line in result.stdout.splitlines() if line.startswith("round ") and "simulations" in line]
    assert [row.split(":")[0] for row in rows] == ["round 1", "round 2", "round 3"], result.stdout
    assert "100% of the prior's volume" in rows[0] and all("mass near cut faces" in row for row in rows)
    assert ["near the previous posterior" in row for row in rows] == [False, True, True]
    if not jobs.matplotlib_missing():
        assert (restored.run_dir / "plots" / "rounds.png").stat().st_size > 0


# ---------------------------------------------------------------- rounds on several workers

TWO_MEMBERS = """
settings["cohort"]["priors"] = ["uniform", "normal"]
settings["runtime"]["parallel"] = {parallel!r}
"""


def final_members(root):
    """{run folder name: the member its run.json records} of an output root."""
    return {run.parent.name: restore(run.parent).member for run in sorted(root.glob("runs/*/*/run.json"))}


@pytest.mark.launch
@pytest.mark.parametrize("parallel", ["jobs", "ddp"])
def test_two_workers_train_the_rounds_one_process_does(tmp_path, parallel):
    np.save(tmp_path / "x_o.npy", X_O)
    training = ROUNDS_TRAINING.format(path=str(tmp_path / "x_o.npy"), epsilon=EPSILON).replace(
        '"count": 3', '"count": 2'
    )
    folder, _, root = kit_study(tmp_path, training=training + TWO_MEMBERS.format(parallel=parallel), noise=0.05)
    launched = torchrun("train", "--settings-dir", str(folder))
    assert launched.returncode == 0, launched.stdout + launched.stderr
    members = final_members(root)
    assert len(members) == 2 and all(member["round"] == 2 for member in members.values())
    if parallel == "jobs":  # each worker trained one member's rounds: the same as one process would
        alone = main_in_process("train", "--settings-dir", str(folder))
        assert alone.returncode == 0 and ": sampling" not in alone.stdout and "train   " not in alone.stdout
        assert final_members(root) == members
        assert "rank 0]" in launched.stdout and "rank 1]" in launched.stdout
    else:  # both ranks trained every round together with rank 0's boxes
        assert launched.stdout.count("round 2 of 2") == 2 and "rank 1" not in launched.stdout


@pytest.mark.launch
def test_a_kill_mid_round_resumes_in_that_round_bitwise(trained_in_rounds, tmp_path):
    reference, _, _ = trained_in_rounds
    np.save(tmp_path / "x_o.npy", X_O)
    training = ROUNDS_TRAINING.format(path=str(tmp_path / "x_o.npy"), epsilon=EPSILON)
    folder, _, root = kit_study(
        tmp_path, training=training + 'settings["runtime"]["resume_seconds"] = 0.2\n', noise=0.05
    )
    process = start(command(folder))
    # Round 1's box is cached and a later round's training state saved: the kill lands inside round 2 or 3.
    wait_for(
        lambda: list(root.glob("cache/round-box/*/artifact.json")) and saved_states(root),
        "a later round's saved state",
        process=process,
    )
    process.kill()
    process.wait()
    again = main_in_process("train", "--settings-dir", str(folder))
    assert again.returncode == 0, again.stderr
    assert "resumed" in again.stdout and again.stdout.count("trained in") <= 2
    ours, theirs = weights(root), weights(reference)
    assert ours.keys() == theirs.keys() and len(ours) == 3
    assert all(torch.equal(ours[key][name], theirs[key][name]) for key in ours for name in ours[key])
