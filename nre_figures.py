"""Figures of the study kit's analysis (optional: they need matplotlib).

Cohort figures compare the members of one configuration: their priors (a study's own
prior objects too), training curves and ROC, estimates against truths with
highest-density bands, and bias and width against the true value (binned over many
continuous truths). Run figures show the retained diagnostic cases, every parameter of
each, and the expected coverage against credibility. Every figure is titled with its
configuration (and member), its axes are labelled with the parameters' names, and every
line and marker is in a legend (docs/results.md, "Figures").
"""

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

import analysis_metrics
import infer
import results
import trainer

__all__ = [
    "TRUTH_BINS",
    "case_truths",
    "draw_priors",
    "draw_training",
    "draw_estimates",
    "draw_bias_width",
    "draw_diagnostic_cases",
    "draw_expected_coverage",
    "draw_rounds",
]

MAX_AXES = 6  # parameters drawn per figure; the rest are left out
CUSTOM_PRIOR_DRAWS = 20_000  # draws of a study's own prior per histogram: 400 a bin if flat, about 5% noise
PRIOR_BINS = 50
TRUTH_BINS = 20  # bins of bias_width along a parameter with more distinct truths than this
# Truths above which `estimates` draws a member's modes as a 2-D histogram with median bands per truth bin:
# one vertical band and marker per truth fills the panel solid long before a thousand truths.
MANY_TRUTHS = 200
PANEL_WIDTH = 2.6  # inches a parameter's panel needs beside its neighbours for its title and labels
TARGET_TITLES = {
    "ratio": "learned ratio (flat prior)",
    "posterior": "learned posterior",
    "exact": "exact likelihood (flat prior)",
}
# Line styles of the diagnostic densities: the ratio wide and pale, so that a posterior equal to it
# (under a uniform prior) is drawn visibly on top of it rather than hiding it.
TARGET_STYLES = {
    "ratio": {"color": "tab:blue", "linestyle": "-", "linewidth": 4.0, "alpha": 0.45},
    "posterior": {"color": "tab:orange", "linestyle": "--", "linewidth": 1.8},
    "exact": {"color": "tab:green", "linestyle": ":", "linewidth": 2.2},
}


def configuration_label(ctx):
    """'baseline' or 'knob=value': the configuration of a context's run (from its run.json)."""
    try:
        run = json.loads((Path(ctx.run_dir) / "run.json").read_text(encoding="utf-8"))
    except (OSError, TypeError, ValueError):
        return Path(str(ctx.run_dir)).parent.name
    return "baseline" if run.get("knob") is None else f"{run['knob']}={json.dumps(run.get('value'))}"


def member_styles(contexts):
    """{member name: (colour, line style, marker)}: the colour by prior, line style and marker by replica."""
    priors = list(dict.fromkeys(str(ctx.member.get("prior", ctx.member["name"])) for ctx in contexts))
    styles = {}
    for ctx in contexts:
        colour, marker, style = results.member_style(
            priors, ctx.member.get("prior", ctx.member["name"]), ctx.member.get("replica")
        )
        styles[ctx.member["name"]] = colour, style, marker
    return styles


def figure_legend(figure, axes):
    """One legend for the whole figure, below its panels: every label of `axes`, once.

    Inside a panel a legend covers curves, a legend per panel repeats itself, and one at the
    side runs into the centred title; the figure's constrained layout makes room below.
    """
    entries: dict[str, Any] = {}
    for axis in axes:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    figure.legend(
        list(entries.values()), list(entries), loc="outside lower center", fontsize="small", ncols=min(4, len(entries))
    )


def parameter_axes(figure, count, rows=1):
    """A row (or rows) of subplots, one per parameter, at most MAX_AXES."""
    count = min(count, MAX_AXES)
    return figure.subplots(rows, count, squeeze=False)


def prior_curve(prior, j, points=400):
    """Values, density and whether coordinate j of a prior is a lattice (whose mass is divided by its step)."""
    step = prior.lattice_steps[j]
    low, high = float(prior.problem.low[j]), float(prior.problem.high[j])
    values = prior.support(j) if step is not None else torch.linspace(low, high, points, dtype=torch.float64)
    density = torch.exp(prior.coordinate_log_prob(j, values)).numpy()
    return values.numpy(), density / step if step is not None else density, step is not None


def draw_priors(contexts, figure):
    """Each member's prior density per inferred parameter (a lattice's mass per step), once per prior.

    The bundled families are drawn from their per-coordinate densities; a study's own prior
    object from its log_prob (one parameter) or a histogram of its draws; a prior that cannot
    be drawn is named in the legend as not drawable, so no prior is left out unsaid.
    """
    names = contexts[0].problem.names
    axes = parameter_axes(figure, len(names))[0]
    styles, drawn = member_styles(contexts), set()
    for ctx in contexts:
        prior_name = str(ctx.member.get("prior", ctx.member["name"]))
        if prior_name in drawn:
            continue  # replicas share one prior
        drawn.add(prior_name)
        colour = styles[ctx.member["name"]][0]
        if hasattr(ctx.prior, "coordinate_log_prob"):
            draw_family_prior(axes, ctx.prior, prior_name, colour)
        else:
            draw_custom_prior(axes, ctx.prior, ctx.problem, prior_name, colour)
    for j, axis in enumerate(axes):
        axis.set(title=f"prior of {names[j]}", xlabel=names[j], ylabel="prior density")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize="small")
    figure.suptitle(f"Priors of the members of configuration {configuration_label(contexts[0])}")


def draw_family_prior(axes, prior, prior_name, colour):
    """A bundled prior's exact density (a lattice's mass per step, as points) on each parameter's axis."""
    for j, axis in enumerate(axes):
        x, y, lattice = prior_curve(prior, j)
        if lattice:
            axis.plot(x, y, "o", color=colour, markersize=3, label=f"{prior_name} (lattice: mass / step)")
        else:
            axis.plot(x, y, color=colour, label=prior_name)


def draw_custom_prior(axes, prior, problem, prior_name, colour):
    """A study's own prior object on each parameter's axis, or a legend entry saying why it cannot be drawn."""
    try:
        curves = custom_prior_curves(prior, problem, len(axes))
    except KeyboardInterrupt:  # a stop (runtime.Interrupted is also an Exception) is never swallowed
        raise
    except Exception as error:  # any failure of the study's object: name it rather than fail the figure
        reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        for axis in axes:
            axis.plot([], [], " ", label=f"{prior_name}: not drawable ({reason[:60]})")
        return
    for axis, (x, y, kind) in zip(axes, curves):
        if kind == "lattice":
            axis.plot(
                x,
                y,
                "s",
                color=colour,
                markersize=3,
                label=f"{prior_name} (own prior, lattice of {CUSTOM_PRIOR_DRAWS:,} draws: mass / step)",
            )
        elif kind == "histogram":
            axis.stairs(
                y,
                x,
                color=colour,
                linewidth=1.5,
                label=f"{prior_name} (own prior, histogram of {CUSTOM_PRIOR_DRAWS:,} draws)",
            )
        else:
            axis.plot(x, y, color=colour, linestyle="-.", label=f"{prior_name} (own prior, from its log_prob)")


def custom_prior_curves(prior, problem, count, points=400):
    """Per parameter, (x, y, kind) of a study's own prior: kind 'density', 'histogram' or 'lattice'.

    With one continuous parameter its log_prob is that parameter's density; otherwise (or
    when that fails) the marginals come from CUSTOM_PRIOR_DRAWS seeded draws, binned over the
    parameter's box (mass outside the box is left out, not spread over it). Raises when
    neither works.
    """
    steps = list(getattr(prior, "lattice_steps", None) or [None] * len(problem.names))
    if not callable(getattr(prior, "sample", None)) and not callable(getattr(prior, "log_prob", None)):
        raise TypeError("neither sample() nor log_prob()")
    if len(problem.names) == 1 and steps[0] is None and callable(getattr(prior, "log_prob", None)):
        x = torch.linspace(float(problem.low[0]), float(problem.high[0]), points, dtype=torch.float64)
        y: np.ndarray
        try:
            y = torch.exp(torch.as_tensor(prior.log_prob(x[:, None]), dtype=torch.float64).reshape(-1)).numpy()
        except KeyboardInterrupt:  # a stop is never swallowed
            raise
        except Exception:  # a log_prob that fails on a grid of values: its draws may still serve
            y = np.full(points, np.nan)
        if np.isfinite(y).all() and y.max() > 0:
            return [(x.numpy(), y, "density")]
    generator = torch.Generator().manual_seed(0)  # the same histogram on every redraw
    drawn = torch.as_tensor(prior.sample(CUSTOM_PRIOR_DRAWS, generator), dtype=torch.float64)
    draws = drawn.reshape(CUSTOM_PRIOR_DRAWS, len(problem.names)).numpy()
    return [marginal_curve(draws[:, j], float(problem.low[j]), float(problem.high[j]), steps[j]) for j in range(count)]


def marginal_curve(values, low, high, step):
    """(x, y, kind) of one parameter's draws: mass per lattice point over the step, or a density histogram."""
    n = len(values)
    if step is not None:
        x, counts = np.unique(np.round(values, 9), return_counts=True)
        return x, counts / n / step, "lattice"
    counts, edges = np.histogram(values, bins=PRIOR_BINS, range=(low, high))
    return edges, counts / n / np.diff(edges), "histogram"


def roc_curve(logits, labels):
    """False- and true-positive rates at every distinct threshold (tied logits form one step)."""
    order = np.argsort(-logits, kind="stable")
    logits, labels = logits[order], labels[order]
    ends = np.r_[np.flatnonzero(np.diff(logits)), len(logits) - 1]  # last index of each run of equal logits
    positives, negatives = labels.sum(), len(labels) - labels.sum()
    tpr = np.concatenate([[0.0], np.cumsum(labels)[ends] / max(positives, 1)])
    fpr = np.concatenate([[0.0], np.cumsum(1 - labels)[ends] / max(negatives, 1)])
    return fpr, tpr


def draw_training(contexts, figure):
    """The trained objective per epoch, training and validation, with the kept epoch, and the test ROC with its
    AUC, per member."""
    from matplotlib.ticker import MaxNLocator  # matplotlib is there whenever a figure is drawn

    curves, roc = figure.subplots(1, 2)
    styles = member_styles(contexts)
    loss = "BCE"
    for ctx in contexts:
        name = ctx.member["name"]
        colour, style, marker = styles[name]
        history = ctx.model_artifact.json("history")
        epochs = np.arange(1, len(history["train_loss"]) + 1)
        loss = trainer.objective_name(history)  # train_loss is the objective's; compare it with its own
        validation = history.get("validation_objective") or [v["bce"] for v in history["validation"]]
        curves.plot(epochs, history["train_loss"], color=colour, linestyle="-", marker=marker, label=name)
        curves.plot(epochs, validation, color=colour, linestyle="--", marker=marker, fillstyle="none")
        selected = history.get("selected_epoch")
        if selected:
            curves.plot(
                [selected], [validation[selected - 1]], "*", color=colour, markersize=12, markeredgecolor="black"
            )
        predictions = ctx.require("test_predictions")
        logits, labels = predictions.array("logits").reshape(-1), predictions.array("labels").reshape(-1)
        auc = analysis_metrics.classification_metrics(torch.from_numpy(logits), torch.from_numpy(labels))["auc"]
        fpr, tpr = roc_curve(logits, labels)
        roc.plot(fpr, tpr, color=colour, linestyle=style, label=f"{name} (AUC {auc:.3f})" if auc is not None else name)
    for label, style in ((f"training {loss}", "-"), (f"validation {loss}", "--")):
        curves.plot([], [], color="grey", linestyle=style, label=label)
    curves.plot([], [], "*", color="grey", markersize=12, markeredgecolor="black", label="selected epoch")
    curves.xaxis.set_major_locator(MaxNLocator(integer=True))
    curves.set(title=f"{loss} per epoch (solid: training, dashed: validation)", xlabel="epoch", ylabel=loss)
    curves.legend(fontsize="small")
    roc.plot([0, 1], [0, 1], ":", color="black", label="chance (AUC 0.5)")
    roc.set(
        title="ROC on the held-out test pairs",
        xlabel="false-positive rate",
        ylabel="true-positive rate",
        xlim=(0, 1),
        ylim=(0, 1.01),
    )
    roc.legend(fontsize="small", loc="lower right")
    figure.suptitle(f"Training of the members of configuration {configuration_label(contexts[0])}")


def case_truths(ctx):
    """The truths of the analysed cases (cases, p): every truth, less those whose observations were invalid.

    The observations product names the truths it kept (`kept_cases`) when data.invalid = "drop"
    dropped some (nre_analysis.build_observations); the analysis and its figures read the
    truths through here, so each case's truth stays beside its summaries.
    """
    truths = ctx.require("truths").array("truths")
    observations = ctx.require("observations")
    return truths[observations.array("kept_cases")] if "kept_cases.npy" in observations.files else truths


def ratio_estimates(ctx):
    """Truths (cases, p) and the learned ratio's modes, lower and upper bounds of a context."""
    learned = ctx.require("learned")
    return case_truths(ctx), *(learned.array(f"ratio_{n}") for n in ("mode", "lower", "upper"))


def draw_estimate(axis, ctx, j, levels, estimates):
    """One member's ratio mode against the truth of parameter j, with its highest-density bands: one mark
    and band per truth, or for more than MANY_TRUTHS their density (draw_estimate_density)."""
    name = ctx.problem.names[j]
    truths, modes, lower, upper = estimates
    if len(truths) > MANY_TRUTHS:
        draw_estimate_density(axis, truths[:, j], modes[:, j], lower[:, :, j], upper[:, :, j], levels)
    else:
        for level in range(len(levels))[::-1]:  # widest first, the narrower on top, darker
            axis.vlines(
                truths[:, j],
                lower[:, level, j],
                upper[:, level, j],
                linewidth=2 + 2 * (level == 0),
                alpha=0.8 - 0.5 * level / max(len(levels) - 1, 1),
                label=f"{levels[level]:g} HPD region (projected)",
            )
        axis.plot(truths[:, j], modes[:, j], ".", color="black", markersize=4, label="mode of the ratio")
    span = [truths[:, j].min(), truths[:, j].max()]
    axis.plot(span, span, ":", color="gray", label="estimate = truth")
    axis.set_title(f"{ctx.member['name']}: {name}", fontsize="small")
    axis.set_xlabel(f"true {name}", fontsize="small")
    axis.set_ylabel(f"estimated {name}", fontsize="small")


def draw_estimate_density(axis, truth, mode, lower, upper, levels):
    """Many truths along one parameter: the modes as a 2-D histogram (darker: more truths) and, per quantile bin
    of the truth (truth_groups), the median mode and the median bounds of each level's projected HPD region."""
    span = [min(truth.min(), mode.min()), max(truth.max(), mode.max())]
    axis.hist2d(truth, mode, bins=50, range=[[truth.min(), truth.max()], span], cmap="Greys", cmin=1)
    axis.fill_between([], [], [], color="0.35", label="modes of the ratio (2-D histogram: darker, more truths)")
    group, _ = truth_groups(truth)
    centre = group_medians(group, truth)
    for level in range(len(levels))[::-1]:  # widest first, the narrower on top, darker
        axis.fill_between(
            centre,
            group_medians(group, lower[:, level]),
            group_medians(group, upper[:, level]),
            color="tab:blue",
            alpha=0.45 - 0.25 * level / max(len(levels) - 1, 1),
            linewidth=0,
            label=f"{levels[level]:g} HPD region (projected), median per truth bin",
        )
    axis.plot(centre, group_medians(group, mode), color="tab:orange", label="median mode per truth bin")


def group_medians(group, values):
    """The median of `values` in each group (0, 1, ...)."""
    return np.array([np.median(values[group == g]) for g in range(group.max() + 1)])


def draw_estimates(contexts, figure):
    """Ratio mode against the truth with the highest-density bands, per member and parameter.

    A row per member and a column per parameter; with one parameter, the members four to a row.
    The figure grows taller with the rows, so that no panel is squeezed.
    """
    count = min(len(contexts[0].problem.names), MAX_AXES)
    levels = contexts[0].analysis_settings["inference"]["levels"]
    columns = min(4, len(contexts)) if count == 1 else count
    rows = -(-len(contexts) * count // columns)
    figure.set_size_inches(figure.get_figwidth(), max(figure.get_figheight(), 2.6 * rows))
    fit_columns(figure, columns)
    axes = list(figure.subplots(rows, columns, squeeze=False).ravel())
    for axis in axes[len(contexts) * count :]:
        axis.remove()  # the last row's empty places
    for i, ctx in enumerate(contexts):
        estimates = ratio_estimates(ctx)
        for j in range(count):
            draw_estimate(axes[i * count + j], ctx, j, levels, estimates)
    figure_legend(figure, axes[:count])
    figure.suptitle(f"Learned-ratio estimates against the truth, configuration {configuration_label(contexts[0])}")


def draw_bias_width(contexts, figure):
    """Mean bias and mean width of the first level against the true value, per parameter.

    A few distinct truths along a parameter (a grid) are drawn one point each, joined in
    order; many (Sobol truths) are grouped into TRUTH_BINS quantile bins, each drawn at its
    truths' mean with a band of ±2 standard errors of its means, since joining a thousand
    single cases in order draws their scatter, not the trend. Which of the two is in the
    figure's title, and one legend beside the panels, so that no label runs into another.
    """
    names = contexts[0].problem.names
    level = contexts[0].analysis_settings["inference"]["levels"][0]
    bias_axes, width_axes = parameter_axes(figure, len(names), rows=2)
    fit_columns(figure, len(bias_axes))
    styles = member_styles(contexts)
    truths = case_truths(contexts[0])
    groups = [truth_groups(truths[:, j]) for j in range(len(bias_axes))]  # truths are shared by every member
    for ctx in contexts:
        colour, style, marker = styles[ctx.member["name"]]
        _, modes, lower, upper = ratio_estimates(ctx)
        for j, (bias_axis, width_axis) in enumerate(zip(bias_axes, width_axes)):
            group, binned = groups[j]
            bias, width = modes[:, j] - truths[:, j], upper[:, 0, j] - lower[:, 0, j]
            for axis, values in ((bias_axis, bias), (width_axis, width)):
                x, mean, error = group_means(group, truths[:, j], values)
                axis.plot(x, mean, marker=marker, linestyle=style, color=colour, label=ctx.member["name"])
                if binned:
                    axis.fill_between(x, mean - 2 * error, mean + 2 * error, color=colour, alpha=0.2, linewidth=0)
    for j, (bias_axis, width_axis) in enumerate(zip(bias_axes, width_axes)):
        bias_axis.axhline(0, color="gray", linestyle=":", label="no bias")
        bias_axis.set(title=f"bias: {names[j]}", xlabel=f"true {names[j]}")
        width_axis.set(title=f"{level:g} width: {names[j]}", xlabel=f"true {names[j]}")
    bias_axes[0].set_ylabel("mean of mode − truth")
    width_axes[0].set_ylabel(f"mean projected width, {level:g} region")
    if any(binned for _, binned in groups):
        bias_axes[-1].fill_between([], [], [], color="gray", alpha=0.2, linewidth=0, label="±2 s.e. of a bin's mean")
    figure_legend(figure, bias_axes)
    hows = dict.fromkeys(
        f"bin means: {group.max() + 1} quantile bins of {len(truths)} truths" if binned else "mean per true value"
        for group, binned in groups
    )
    figure.suptitle(
        f"Bias and width against the true value, configuration {configuration_label(contexts[0])}\n"
        f"(the ratio's mode and its {level:g} HPD region projected; {'; '.join(hows)})"
    )


def fit_columns(figure, columns):
    """Widen the figure so that each of `columns` panels gets PANEL_WIDTH inches (and room for the labels)."""
    figure.set_size_inches(max(figure.get_figwidth(), PANEL_WIDTH * columns + 1.5), figure.get_figheight())


def truth_groups(values, bins=None):
    """Each truth's group along one parameter (0, 1, ...), and whether the groups are bins rather than values.

    Up to `bins` (TRUTH_BINS) distinct values each form a group; more are cut at quantiles,
    so every bin holds about as many truths wherever the truths are dense.
    """
    bins = bins or TRUTH_BINS
    distinct, group = np.unique(np.round(values, 9), return_inverse=True)
    if len(distinct) <= bins:
        return group.reshape(-1), False
    edges = np.unique(np.quantile(values, np.linspace(0, 1, bins + 1)))
    group = np.clip(np.searchsorted(edges, values, side="right") - 1, 0, len(edges) - 2)
    return np.unique(group, return_inverse=True)[1].reshape(-1), True


def group_means(group, truths, values):
    """Per group, in order of the truth: the truths' mean, the values' mean and its standard error."""
    counts = np.bincount(group).astype(float)
    mean = np.bincount(group, weights=values) / counts
    spread = np.bincount(group, weights=(values - mean[group]) ** 2) / np.maximum(counts - 1, 1)
    return np.bincount(group, weights=truths) / counts, mean, np.sqrt(spread / counts)


def case_design(artifact, candidates, case):
    """Points (n, p) and log measure (n,) a retained case was scored on: its own when refined."""
    if "design_points.npy" in artifact.files:
        return artifact.array("design_points")[case], artifact.array("design_log_measure")[case]
    return candidates.array("points"), candidates.array("log_measure")


def case_density(artifact, target, candidates, case, j=0):
    """(x, density) of a retained case along parameter j, sorted along it.

    With one parameter, the normalised density at each candidate (per unit measure: refined
    designs weigh their points unequally); with more, the marginal density of parameter j,
    the mass of the candidates summed over bins of it (about √n bins of n candidates).
    """
    points, log_measure = case_design(artifact, candidates, case)
    measured = np.isfinite(log_measure)  # refined designs also hold padding and zero-measure probes
    scores = artifact.array(f"{target}_scores")[case, :-1][measured]
    points, log_measure = points[measured], log_measure[measured]
    log_mass = scores + log_measure - np.logaddexp.reduce(scores + log_measure)
    if points.shape[1] == 1:
        order = np.argsort(points[:, 0], kind="stable")
        return points[order, 0], np.exp(log_mass - log_measure)[order]
    bins = int(np.clip(np.sqrt(len(points)), 8, 60))
    mass, edges = np.histogram(points[:, j], bins=bins, weights=np.exp(log_mass))
    return (edges[:-1] + edges[1:]) / 2, mass / np.diff(edges)


def draw_diagnostic_cases(ctx, figure):
    """Per retained case (a column) and parameter (a row), the normalised density of every target, with the truth.

    With several parameters each row is that parameter's marginal density, so every
    parameter of a case is seen, not the first alone. The figure grows taller with the rows.
    """
    learned = ctx.require("learned")
    exact = ctx.require("exact") if "exact" in ctx.analysis_settings["inference"]["targets"] else None
    candidates = ctx.require("candidates")
    sources = [(learned, t) for t in ("ratio", "posterior") if f"{t}_scores.npy" in learned.files]
    if exact is not None:
        sources.append((exact, "exact"))
    cases = min(4, learned.array(f"{sources[0][1]}_scores").shape[0]) if sources else 0
    names = ctx.problem.names[:MAX_AXES]
    many = len(ctx.problem.names) > 1
    figure.set_size_inches(figure.get_figwidth(), max(figure.get_figheight(), 3.0 * len(names)))
    axes = figure.subplots(len(names), max(cases, 1), squeeze=False, sharey=False)
    truths = case_truths(ctx)
    for j, name in enumerate(names):
        for case, axis in zip(range(cases), axes[j]):
            draw_case(axis, ctx, sources, candidates, case, j, truths[case, j])
        axes[j][0].set_ylabel(f"density of {name}")  # "normalised" and "marginal" are in the title
    fit_columns(figure, max(cases, 1))
    if cases:
        figure_legend(figure, [axes[0][0]])
        along = names[0] if not many else "each parameter (rows: marginal densities)"
        title = (
            f"Retained cases of {ctx.member['name']}, configuration {configuration_label(ctx)}: "
            f"normalised density along {along}"
        )
    else:
        title = f"{ctx.member['name']}: no retained case to draw (inference.diagnostic_cases is 0)"
    figure.suptitle(title)


def draw_case(axis, ctx, sources, candidates, case, j, truth):
    """One retained case's densities of every target along parameter j, and its true value."""
    name = ctx.problem.names[j]
    for artifact, target in sources:
        x, density = case_density(artifact, target, candidates, case, j)
        axis.plot(x, density, label=TARGET_TITLES.get(target, target), **TARGET_STYLES.get(target, {}))
    axis.axvline(truth, color="black", linestyle=(0, (1, 2)), linewidth=1.2, label="truth")
    # The member is in the figure's title: repeated here, it made neighbouring titles run into each other.
    axis.set_title(f"case {case}: true {name} = {truth:.3g}", fontsize="medium")
    axis.set_xlabel(name)


def draw_expected_coverage(ctx, figure):
    """Per target, the share of truths inside the HPD region against its credibility level, with the diagonal."""
    report = ctx.analysis.metrics["expected_coverage"].compute(ctx)
    levels = np.asarray(report["levels"])
    targets = ctx.analysis_settings["inference"]["targets"]
    axes = figure.subplots(1, len(targets), squeeze=False, sharey=True)[0]
    for target, axis in zip(targets, axes):
        colour = TARGET_STYLES.get(target, {}).get("color")
        curve = report[target]
        axis.fill_between(
            levels, curve["lower"], curve["upper"], color=colour, alpha=0.25, label="95% band (all levels jointly)"
        )
        axis.plot(levels, curve["coverage"], color=colour, label="empirical coverage")
        axis.plot([0, 1], [0, 1], ":", color="black", label="calibrated (diagonal)")
        axis.set(
            xlim=(0, 1),
            ylim=(0, 1),
            aspect="equal",
            title=TARGET_TITLES.get(target, target),
            xlabel="credibility level of the HPD region",
        )
    axes[0].set_ylabel("share of truths inside the region")
    axes[0].legend(fontsize="small", loc="upper left")
    figure.suptitle(
        f"Expected coverage of {ctx.member['name']}, configuration {configuration_label(ctx)}, "
        f"over {report['cases']} cases (below the diagonal: overconfident)"
    )


def draw_rounds(ctx, figure):
    """A run trained in rounds (docs/rounds.md): each round's box over the prior's, per parameter pair,
    with x_o's final posterior samples; a note for a run trained without rounds."""
    history = ctx.member.get("history")
    if not history:
        figure.text(0.5, 0.5, f"{ctx.member['name']} was not trained in rounds", ha="center")
        return
    full, names = ctx.experiment.problem(), ctx.problem.names
    x_o = infer.read_array(ctx.settings["rounds"]["observation"], "rounds.observation")
    # The posterior's own default design (as for a run never analysed): one observation affords more points.
    samples = ctx.experiment.posterior(ctx.member, ctx.model, {}, x_o).sample(2000, seed=0).numpy()
    p = len(names)
    axes = figure.subplots(p, p, squeeze=False)
    colours = [f"C{k % 10}" for k in range(len(history))]
    for i in range(p):
        for j in range(p):
            axis = axes[i][j]
            if j > i:
                axis.axis("off")
                continue
            axis.set_xlim(float(full.low[j]), float(full.high[j]))
            if i == j:
                axis.hist(samples[:, j], bins=40, color="grey")
                for row, colour in zip(history, colours):
                    for bound in (row["box"][0][j], row["box"][1][j]):
                        axis.axvline(bound, color=colour, linewidth=1)
            else:
                axis.set_ylim(float(full.low[i]), float(full.high[i]))
                axis.scatter(samples[:, j], samples[:, i], s=1, color="grey")
                for row, colour in zip(history, colours):
                    (low, high) = row["box"]
                    axis.add_patch(
                        _box_patch(
                            low[j],
                            low[i],
                            high[j] - low[j],
                            high[i] - low[i],
                            colour,
                            f"round {row['round']}: {100 * row['volume']:.3g}% of the volume",
                        )
                    )
            axis.set_xlabel(names[j] if i == p - 1 else "")
            axis.set_ylabel(names[i] if j == 0 and i > 0 else "")
    if p > 1:
        axes[1][0].legend(fontsize="small", loc="upper right")
    figure.suptitle(
        f"Rounds of {ctx.member['name']}: each round's box over the prior's, and x_o's posterior "
        f"samples of the last round ({len(samples)} draws)"
    )


def _box_patch(x, y, width, height, colour, label):
    """An unfilled rectangle: one round's box on a pair of parameters."""
    from matplotlib.patches import Rectangle  # matplotlib is optional: only drawing imports it

    return Rectangle((x, y), width, height, fill=False, edgecolor=colour, linewidth=1.2, label=label)
