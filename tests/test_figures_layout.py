"""The kit's figures laid out for reading: no label runs into another and no legend covers a panel, for one
to six parameters, and estimates of thousands of truths drawn as a density, not a mark per truth. Drawn from
stand-in contexts (a few arrays each, no training), so they run in the unit layer."""

import types
from pathlib import Path

import numpy as np
import pytest

import nre_figures

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.collections import LineCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

pytestmark = pytest.mark.unit

NAMES = ["frequency", "damping", "noise", "amplitude", "phase", "offset"]
CASES = 4


class Artifact:
    """A stand-in product: its arrays by name."""

    def __init__(self, **arrays):
        self.arrays, self.files, self.metadata = arrays, [f"{name}.npy" for name in arrays], {}

    def array(self, name):
        return self.arrays[name]


def scores(truths, points, sharpness):
    """Each retained case's log density on the points (its truth's score last), peaked at its truth."""
    log_density = -sharpness * ((points[None] - truths[:CASES, None]) ** 2).sum(-1)
    return np.concatenate([log_density, np.zeros((CASES, 1))], 1)


def context(p, truths_count, member, seed):
    """A stand-in analysis context of a run: p parameters in [0, 3], its truths, modes, HPD bounds and scores."""
    rng = np.random.default_rng(seed)
    truths = rng.uniform(0, 3, (truths_count, p))
    modes = truths + rng.normal(0, 0.3, truths.shape) * (1 + truths)
    half = np.stack([np.full_like(modes, 0.4), np.full_like(modes, 0.8)], 1) * (1 + truths[:, None])
    points = rng.uniform(0, 3, (400, p))
    learned = Artifact(
        ratio_mode=modes,
        ratio_lower=modes[:, None] - half,
        ratio_upper=modes[:, None] + half,
        ratio_scores=scores(truths, points, 3.0),
        posterior_scores=scores(truths, points, 3.5),
    )
    products = {
        "truths": Artifact(truths=truths),
        "observations": Artifact(observations=np.zeros((truths_count, 1))),
        "learned": learned,
        "exact": Artifact(exact_scores=scores(truths, points, 4.0)),
        "candidates": Artifact(points=points, log_measure=np.zeros(len(points))),
    }
    return types.SimpleNamespace(
        problem=types.SimpleNamespace(names=NAMES[:p]),
        member={"name": member, "prior": member[:-3], "replica": 0},
        analysis_settings={"inference": {"levels": [0.68, 0.95], "targets": ["ratio", "posterior", "exact"]}},
        run_dir=Path("outputs/study/runs/baseline-0") / member,
        require=products.__getitem__,
    )


def drawn(draw, target):
    """A figure as jobs.draw_figures makes it, drawn and laid out."""
    figure = Figure(figsize=(12, 7), layout="constrained")
    draw(target, figure)
    FigureCanvasAgg(figure).draw()
    return figure


def tick_labels(axis):
    """The tick labels matplotlib draws: those of ticks inside the axis' view."""
    shown = []
    for ticks, limits in ((axis.xaxis, axis.get_xlim()), (axis.yaxis, axis.get_ylim())):
        low, high = sorted(limits)
        shown += [tick.label1 for tick in ticks.get_major_ticks() if low <= tick.get_loc() <= high]
    return shown


def labels(figure):
    """(what, window extent) of every visible text of the figure: titles, axis labels, tick labels, legends."""
    renderer = figure.canvas.get_renderer()
    found = [("suptitle", figure._suptitle)] if figure._suptitle else []
    for index, axis in enumerate(figure.axes):
        found += [
            (f"axes {index} title", axis.title),
            (f"axes {index} xlabel", axis.xaxis.label),
            (f"axes {index} ylabel", axis.yaxis.label),
        ]
        found += [(f"axes {index} tick {text.get_text()}", text) for text in tick_labels(axis)]
    texts = [(what, text.get_window_extent(renderer)) for what, text in found if text.get_visible() and text.get_text()]
    legends = figure.legends + [axis.get_legend() for axis in figure.axes if axis.get_legend()]
    return texts + [(f"legend {index}", legend.get_window_extent(renderer)) for index, legend in enumerate(legends)]


def collisions(figure):
    """Pairs of labels that overlap, and legends that cover a panel."""
    boxes = labels(figure)
    pairs = [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1 :] if box.overlaps(other)]
    renderer = figure.canvas.get_renderer()
    covered = [
        (what, f"axes {index}")
        for what, box in boxes
        if what.startswith("legend")
        for index, axis in enumerate(figure.axes)
        if box.overlaps(axis.get_window_extent(renderer))
    ]
    return pairs + covered


@pytest.mark.parametrize(
    "draw, p",
    [
        (nre_figures.draw_bias_width, 1),
        (nre_figures.draw_bias_width, 3),
        (nre_figures.draw_bias_width, 6),
        (nre_figures.draw_diagnostic_cases, 1),
        (nre_figures.draw_diagnostic_cases, 3),
        (nre_figures.draw_estimates, 3),
    ],
)
def test_no_label_runs_into_another_and_no_legend_covers_a_panel(draw, p):
    contexts = [context(p, 512, member, seed) for seed, member in enumerate(["uniform-r0", "normal-r0"])]
    figure = drawn(draw, contexts[0] if draw is nre_figures.draw_diagnostic_cases else contexts)
    assert collisions(figure) == [], figure.get_suptitle()


def test_estimates_of_thousands_of_truths_are_a_density_with_binned_bands():
    contexts = [context(2, 2048, member, seed) for seed, member in enumerate(["uniform-r0", "normal-r0"])]
    figure = drawn(nre_figures.draw_estimates, contexts)
    for axis in figure.axes:
        bands = [collection for collection in axis.collections if isinstance(collection, LineCollection)]
        marks = [len(line.get_xdata()) for line in axis.get_lines()] + [len(band.get_segments()) for band in bands]
        assert max(marks) <= nre_figures.TRUTH_BINS, marks  # no mark or band per truth
        assert axis.collections and axis.get_xlabel().startswith("true ")
    texts = [text.get_text() for legend in figure.legends for text in legend.get_texts()]
    assert {
        "0.68 HPD region (projected), median per truth bin",
        "median mode per truth bin",
        "estimate = truth",
    } <= set(texts)


def test_estimates_of_few_truths_keep_a_mark_per_truth():
    figure = drawn(nre_figures.draw_estimates, [context(1, 49, "uniform-r0", 0)])
    (modes,) = [line for line in figure.axes[0].get_lines() if line.get_label() == "mode of the ratio"]
    assert len(modes.get_xdata()) == 49
