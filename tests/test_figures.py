"""The figures a reader sees: titled, labelled, with legends, drawn from a real tiny run (no swept setting)."""

import json

import numpy as np
import pytest

import nnpd
import results
import study_loading
from helpers import figure_legend_texts, recorded_figures, run_cli, write_settings
from nre_analysis import NREAnalysis

matplotlib = pytest.importorskip("matplotlib")

pytestmark = pytest.mark.launch

PLOTS = (
    'settings["plots"] = ["diagnostic_cases", "expected_coverage"]\n'
    'settings["cohort_plots"] = ["priors", "training", "estimates", "bias_width"]\n'
)


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """A tiny run of two priors with every figure selected, and every matplotlib Figure it drew."""
    tmp = tmp_path_factory.mktemp("figures")
    settings = write_settings(
        tmp / "s", tmp / "out", analysis=PLOTS, training='settings["cohort"]["priors"] = ["uniform", "grid"]\n'
    )
    with recorded_figures() as figures:
        nnpd.execute("run", None, str(settings))
    return tmp, settings, figures


def titled(figures, start):
    """The figures whose title starts so."""
    return [figure for figure in figures if figure.get_suptitle().startswith(start)]


def legend_texts(*axes):
    return [text.get_text() for axis in axes if axis.get_legend() for text in axis.get_legend().get_texts()]


def test_every_figure_is_written_titled_and_its_axes_labelled(drawn):
    tmp, _, figures = drawn
    assert len(list((tmp / "out" / "runs").glob("*/*/plots/*.png"))) == 4
    assert sorted(path.stem for path in (tmp / "out" / "runs").glob("*/plots/*.png")) == [
        "bias_width",
        "estimates",
        "priors",
        "training",
    ]
    assert len(figures) == 8
    for figure in figures:
        assert "configuration baseline" in figure.get_suptitle(), figure.get_suptitle()
        for axis in figure.axes:
            assert axis.get_title() and axis.get_xlabel(), figure.get_suptitle()
        assert figure.axes[0].get_ylabel() and any(figure_legend_texts(figure)), figure.get_suptitle()


def test_diagnostic_cases_draw_sorted_lines_the_ratio_visible_under_the_posterior(drawn):
    _, _, figures = drawn
    (figure,) = titled(figures, "Retained cases of uniform-r0")
    for case, axis in enumerate(figure.axes):
        assert axis.get_title().startswith(f"case {case}: true mean:0 = ")  # the member is in the figure's title
        assert axis.get_xlabel() == "mean:0"
        lines = {line.get_label(): line for line in axis.get_lines()}
        ratio, posterior = lines["learned ratio (flat prior)"], lines["learned posterior"]
        for line in (ratio, posterior, lines["exact likelihood (flat prior)"]):
            assert line.get_linestyle() not in ("None", "") and np.all(np.diff(line.get_xdata()) >= 0)
        assert (ratio.get_linestyle(), ratio.get_linewidth()) != (posterior.get_linestyle(), posterior.get_linewidth())
        assert ratio.get_linewidth() > posterior.get_linewidth()  # the wide ratio stays visible around it
    assert "truth" in figure_legend_texts(figure)


def test_training_figure_has_integer_epoch_ticks_and_each_members_auc_in_the_roc_legend(drawn):
    tmp, _, figures = drawn
    (figure,) = titled(figures, "Training of the members")
    curves, roc = figure.axes
    low, high = curves.get_xlim()
    ticks = [tick for tick in curves.get_xticks() if low <= tick <= high]
    assert ticks and all(float(tick).is_integer() for tick in ticks), ticks
    assert {"training BCE", "validation BCE", "selected epoch", "uniform-r0", "grid-r0"} <= set(legend_texts(curves))
    aucs = {}
    for run in (tmp / "out" / "runs").glob("*/*/metrics.json"):
        aucs[json.loads((run.parent / "run.json").read_text())["member"]["name"]] = json.loads(run.read_text())[
            "classification"
        ]["auc"]
    texts = legend_texts(roc)
    for member, auc in aucs.items():
        assert f"{member} (AUC {auc:.3f})" in texts, texts
    assert "chance (AUC 0.5)" in texts and roc.get_title()


def test_priors_estimates_and_bias_width_name_the_parameters(drawn):
    _, _, figures = drawn
    (priors,) = titled(figures, "Priors of the members")
    assert priors.axes[0].get_title() == "prior of mean:0" and priors.axes[0].get_xlabel() == "mean:0"
    assert legend_texts(priors.axes[0]) == ["uniform", "grid (lattice: mass / step)"]
    (estimates,) = titled(figures, "Learned-ratio estimates")
    assert [axis.get_xlabel() for axis in estimates.axes] == ["true mean:0"] * 2
    assert {"mode of the ratio", "estimate = truth", "0.68 HPD region (projected)"} <= set(
        figure_legend_texts(estimates)
    )
    (bias_width,) = titled(figures, "Bias and width")
    assert [axis.get_title() for axis in bias_width.axes] == ["bias: mean:0", "0.68 width: mean:0"]
    assert {"uniform-r0", "grid-r0", "no bias"} <= set(figure_legend_texts(bias_width))


def test_report_plot_without_a_sweep_draws_each_metric_per_prior(drawn):
    tmp, settings, _ = drawn
    figure = results.comparison_figure(results.read_runs(tmp / "out"), NREAnalysis.FIGURE_METRICS, "title")
    titles = [f"{title} per prior" for title, _ in NREAnalysis.FIGURE_METRICS]
    assert [axis.get_title() for axis in figure.axes] == titles
    for axis, (title, _) in zip(figure.axes, NREAnalysis.FIGURE_METRICS):
        assert axis.get_xlabel() == "prior" and axis.get_ylabel() == title
        assert [label.get_text() for label in axis.get_xticklabels()] == ["grid", "uniform"]
        assert len(axis.containers) >= 2  # a point (with its error bars) per member
    assert {"grid-r0", "uniform-r0", "nominal level 0.68", "bars: 95% Wilson interval"} <= set(
        legend_texts(*figure.axes)
    )
    result = run_cli("report", "--settings-dir", str(settings), "--plot")
    assert result.returncode == 0, result.stderr
    assert "figure written to" in result.stdout
    assert (tmp / "out" / "report" / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_plot_with_nothing_to_draw_says_so_and_writes_nothing(drawn, monkeypatch):
    tmp, settings, _ = drawn
    records = results.read_runs(tmp / "out")
    assert results.comparison_figure(records, (("absent", "no.such.metric"),), "title") is None
    assert results.comparison_figure(records, (), "title") is None
    figure = tmp / "out" / "report" / "comparison.png"
    figure.unlink(missing_ok=True)
    monkeypatch.setattr(study_loading, "report_layout", lambda analysis: ((), (("absent", "no.such.metric"),)))
    _, notes = nnpd.report(None, str(settings), plot=True)
    assert notes == ["--plot: nothing to draw (no analysed run has a metric of the figure); no figure written"]
    assert not figure.exists()
