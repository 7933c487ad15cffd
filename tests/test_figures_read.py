"""Figures a reader understands (docs/results.md, "Figures"): every prior drawn or named, bias and width
binned over continuous truths, every parameter of a diagnostic case, corner plots naming their run and prior
and telling joint from marginal HPD bounds. Drawn from real tiny runs: the decay example (a study's own
prior, Sobol truths) and the bundled study in two parameters (grid truths)."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

import jobs
import nnpd
import nre_figures
import posterior as post
import priors
from helpers import figure_legend_texts, main_in_process, patched_settings, recorded_figures, write_settings
from store import restore

pytest.importorskip("matplotlib")
import matplotlib.collections  # noqa: E402
import matplotlib.figure  # noqa: E402
import matplotlib.patches  # noqa: E402

SOBOL_TRUTHS = 256  # continuous truths of the decay run: many more than nre_figures.TRUTH_BINS


def record_launch(settings_dir):
    """Run a launch in this process; every Figure it made and the contexts of each cohort figure."""
    cohorts = []
    drawn = jobs.draw_figures

    def recording(figure_hooks, selected, target, folder, plotting):
        if isinstance(target, list):  # the cohort's contexts (a run's figures get one context)
            cohorts.append(target)
        return drawn(figure_hooks, selected, target, folder, plotting)

    with recorded_figures() as figures, pytest.MonkeyPatch.context() as patch:
        patch.setattr(jobs, "draw_figures", recording)
        nnpd.execute("run", None, str(settings_dir))
    return figures, cohorts


def titled(figures, start):
    """The one figure whose title starts so."""
    found = [figure for figure in figures if figure.get_suptitle().startswith(start)]
    assert len(found) == 1, [figure.get_suptitle() for figure in figures]
    return found[0]


def legend_texts(*axes):
    return [text.get_text() for axis in axes if axis.get_legend() for text in axis.get_legend().get_texts()]


@pytest.fixture(scope="module")
def decay(tmp_path_factory):
    """The decay example, tiny, with Sobol truths: its "uniform-rate" prior is the study's own object."""
    tmp = tmp_path_factory.mktemp("decay-figures")
    settings = patched_settings(
        tmp,
        {
            '"analysis": "nre_analysis:NREAnalysis",': '"analysis": "nre_analysis:NREAnalysis", "plots": '
            '["diagnostic_cases"], "cohort_plots": ["priors", "bias_width"], "metrics": ["bias", "coverage"],',
            '"sobol_truths": 1000': f'"sobol_truths": {SOBOL_TRUTHS}',
            '"root": f"outputs/decay-{profile}"': f'"root": {str(tmp / "out")!r}',
            '"train": 8192, "validation": 1024, "test": 512': '"train": 1024, "validation": 128, "test": 128',
            '"epochs": 8': '"epochs": 1',
        },
    )
    figures, cohorts = record_launch(settings)
    return tmp / "out", figures, cohorts


@pytest.fixture(scope="module")
def two_parameters(tmp_path_factory):
    """The bundled study in two parameters (4 × 4 grid truths), under a uniform and a grid prior."""
    tmp = tmp_path_factory.mktemp("two-parameter-figures")
    settings = write_settings(
        tmp / "s",
        tmp / "out",
        training='settings["cohort"]["priors"] = ["uniform", "grid"]\nsettings["problem"]["dimension"] = 2\n',
        analysis='settings["plots"] = ["diagnostic_cases"]\nsettings["cohort_plots"] = ["priors", "bias_width"]\n',
    )
    figures, cohorts = record_launch(settings)
    return tmp / "out", figures, cohorts


# ---------------------------------------------------------------- priors


@pytest.mark.launch
def test_the_priors_figure_draws_a_studys_own_prior_from_its_log_prob(decay):
    _, figures, _ = decay
    (axis,) = titled(figures, "Priors of the members").axes
    lines = {line.get_label(): line for line in axis.get_lines()}
    assert set(lines) == {"log-uniform", "uniform-rate (own prior, from its log_prob)"}
    assert legend_texts(axis) == ["log-uniform", "uniform-rate (own prior, from its log_prob)"]
    own = lines["uniform-rate (own prior, from its log_prob)"]
    # Uniform in the rate λ on [0.2, 5] is the density e^θ / 4.8 in θ = log λ (examples/decay/decay_study.py).
    np.testing.assert_allclose(own.get_ydata(), np.exp(own.get_xdata()) / 4.8, rtol=1e-9)
    assert own.get_xdata()[0] == pytest.approx(math.log(0.2)) and own.get_xdata()[-1] == pytest.approx(math.log(5))


class Correlated:
    """A study's own prior in two parameters: correlated normals about 5 with sd 2, some mass outside [0, 10]."""

    def sample(self, n, generator):
        z = torch.randn(n, 2, generator=generator, dtype=torch.float64)
        return torch.stack([5 + 2 * z[:, 0], 5 + 2 * (0.8 * z[:, 0] + 0.6 * z[:, 1])], dim=1)

    def log_prob(self, theta):
        return torch.zeros(theta.shape[:-1], dtype=torch.float64)  # unnormalised: only the draws are drawn


class Broken:
    """A study's own prior whose methods fail when called."""

    def sample(self, n, generator):
        raise RuntimeError("no prior table")

    def log_prob(self, theta):
        raise RuntimeError("no prior table")


@pytest.mark.launch
def test_a_many_parameter_own_prior_is_a_histogram_and_one_that_fails_is_named_not_drawable(two_parameters):
    _, _, cohorts = two_parameters
    contexts = cohorts[0]
    names = contexts[0].problem.names
    own = [
        dataclasses.replace(
            contexts[0],
            member={"name": "correlated-r0", "prior": "correlated", "replica": 0},
            _prior=priors.CustomPrior(Correlated(), names),
        ),
        dataclasses.replace(
            contexts[1],
            member={"name": "broken-r0", "prior": "broken", "replica": 0},
            _prior=priors.CustomPrior(Broken(), names),
        ),
    ]
    figure = matplotlib.figure.Figure()
    nre_figures.draw_priors(contexts + own, figure)
    assert len(figure.axes) == 2
    inside = 2 * torch.distributions.Normal(0.0, 1.0).cdf(torch.tensor(2.5)).item() - 1  # |θ − 5| ≤ 5 = 2.5 sd
    for axis in figure.axes:
        steps = [patch for patch in axis.patches if isinstance(patch, matplotlib.patches.StepPatch)]
        assert [patch.get_label() for patch in steps] == ["correlated (own prior, histogram of 20,000 draws)"]
        values, edges = steps[0].get_data()[:2]
        assert (edges[0], edges[-1]) == (0.0, 10.0)
        assert float(np.sum(values * np.diff(edges))) == pytest.approx(inside, abs=0.01)  # outside mass left out
        assert legend_texts(axis) == [
            "uniform",
            "grid (lattice: mass / step)",
            "correlated (own prior, histogram of 20,000 draws)",
            "broken: not drawable (RuntimeError: no prior table)",
        ]


# ---------------------------------------------------------------- bias and width


@pytest.mark.launch
def test_bias_width_bins_many_continuous_truths(decay):
    root, figures, _ = decay
    figure = titled(figures, "Bias and width")
    bias, width = figure.axes
    truths = restore(next(root.glob("runs/*/log-uniform-r0-*"))).array("truths", "truths")[:, 0]
    assert len(np.unique(truths)) > nre_figures.TRUTH_BINS
    for axis in (bias, width):
        members = [line for line in axis.get_lines() if line.get_label().endswith("-r0")]
        assert len(members) == 2
        for line in members:
            x = line.get_xdata()
            assert nre_figures.TRUTH_BINS // 2 <= len(x) <= nre_figures.TRUTH_BINS
            assert np.all(np.diff(x) > 0) and truths.min() <= x[0] and x[-1] <= truths.max()
        bands = [c for c in axis.collections if isinstance(c, matplotlib.collections.PolyCollection)]
        assert len(bands) >= 2  # a band per member (and the legend's grey entry)
        assert axis.get_xlabel() == "true theta"
        assert (
            f"bin means: {len(members[0].get_xdata())} quantile bins of {SOBOL_TRUTHS} truths" in figure.get_suptitle()
        )
    assert "±2 s.e. of a bin's mean" in figure_legend_texts(figure)
    for run in root.glob("runs/*/*/metrics.json"):
        member = json.loads((run.parent / "run.json").read_text())["member"]["name"]
        (line,) = [line for line in bias.get_lines() if line.get_label() == member]
        signed = json.loads(run.read_text())["bias"]["per_axis"]["theta"]["signed"]
        assert line.get_ydata().min() <= signed <= line.get_ydata().max()  # bin means surround the mean bias


@pytest.mark.launch
def test_bias_width_keeps_one_point_per_grid_truth(two_parameters):
    root, figures, _ = two_parameters
    figure = titled(figures, "Bias and width")
    truths = restore(next(root.glob("runs/*/uniform-r0-*"))).array("truths", "truths")
    for j, axis in enumerate(figure.axes):
        j %= 2
        for line in (line for line in axis.get_lines() if line.get_label().endswith("-r0")):
            np.testing.assert_allclose(line.get_xdata(), np.unique(truths[:, j]))
        assert axis.get_xlabel() == f"true mean:{j}" and "; mean per true value)" in figure.get_suptitle()
        assert not any(isinstance(c, matplotlib.collections.PolyCollection) for c in axis.collections)


# ---------------------------------------------------------------- diagnostic cases


@pytest.mark.launch
def test_diagnostic_cases_draw_every_parameter_a_row_each(two_parameters):
    root, figures, _ = two_parameters
    figure = titled(figures, "Retained cases of uniform-r0")
    truths = restore(next(root.glob("runs/*/uniform-r0-*"))).array("truths", "truths")
    assert len(figure.axes) == 2 * 4  # two parameters, four retained cases
    for index, axis in enumerate(figure.axes):
        j, case = divmod(index, 4)
        assert axis.get_xlabel() == f"mean:{j}"
        assert axis.get_title() == f"case {case}: true mean:{j} = {truths[case, j]:.3g}"
        labels = {line.get_label() for line in axis.get_lines()}
        assert {"learned ratio (flat prior)", "learned posterior", "exact likelihood (flat prior)", "truth"} <= labels
        (truth_line,) = [line for line in axis.get_lines() if line.get_label() == "truth"]
        assert truth_line.get_xdata()[0] == pytest.approx(truths[case, j])
    assert [figure.axes[4 * j].get_ylabel() for j in range(2)] == ["density of mean:0", "density of mean:1"]
    assert figure.get_suptitle().endswith("density along each parameter (rows: marginal densities)")


# ---------------------------------------------------------------- corner plots


@pytest.mark.unit
def test_marginal_interval_is_the_shortest_holding_the_level():
    normal = np.random.default_rng(0).normal(size=200_000)
    low, high = post.marginal_interval(normal, 0.68)
    assert (low, high) == pytest.approx((-0.994, 0.994), abs=0.02)
    skewed = np.random.default_rng(1).exponential(size=200_000)
    low, high = post.marginal_interval(skewed, 0.68)
    assert low == skewed.min() and high == pytest.approx(-math.log(0.32), abs=0.02)
    assert np.mean((skewed >= low) & (skewed <= high)) == pytest.approx(0.68, abs=1e-4)


@pytest.mark.launch
def test_the_corner_plot_names_its_run_and_prior_and_tells_joint_from_marginal_bounds(two_parameters, tmp_path):
    root, _, _ = two_parameters
    run = next(root.glob("runs/*/uniform-r0-*"))
    restored = restore(run)
    np.save(tmp_path / "x.npy", restored.array("observations", "observations")[1])
    with recorded_figures() as figures:
        result = main_in_process(
            "infer", str(run), "--observations", str(tmp_path / "x.npy"), "--samples", "2000", "--plot"
        )
    assert result.returncode == 0, result.stderr
    (figure,) = figures
    assert figure.get_suptitle().startswith(
        f"Posterior of run {run.parent.name}/{run.name}\nprior uniform; 2000 samples"
    )
    texts = legend_texts(*figure.axes)
    assert texts == [
        "samples",
        "marginal 0.68 HPD interval (from the samples)",
        "joint 0.68 HPD region, projected",
        "marginal 0.95 HPD interval (from the samples)",
        "joint 0.95 HPD region, projected",
    ]
    samples = np.load(tmp_path / "x-uniform-r0.samples.npy")
    summary = json.loads((tmp_path / "x-uniform-r0.posterior.json").read_text())
    for i in range(2):
        diagonal = figure.axes[3 * i]  # row-major 2 × 2: the diagonal panels
        spans = [p for p in diagonal.patches if p.get_label().startswith("marginal")]
        for span, level in zip(spans, ("0.68", "0.95")):
            low, high = span.get_x(), span.get_x() + span.get_width()
            share = np.mean((samples[:, i] >= low) & (samples[:, i] <= high))
            assert float(level) <= share <= float(level) + 0.002  # the shortest interval holding the level
        joint = sorted(line.get_xdata()[0] for line in diagonal.get_lines() if line.get_color() == "tab:orange")
        bounds = [summary["hpd"][level][side][i] for level in ("0.68", "0.95") for side in ("lower", "upper")]
        assert joint == sorted(bounds)
