"""Figures of the Gaussian study (optional: they need matplotlib).

Cohort figures compare the members of one configuration: their priors, training
curves and ROC, estimates against truths with highest-density bands, and bias and
width against the true value. The run figure shows the retained diagnostic cases.
"""
import numpy as np
import torch

COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray")
MAX_AXES = 6   # parameters drawn per figure; the rest are left out


def parameter_axes(figure, count, rows=1):
    """A row (or rows) of subplots, one per parameter, at most MAX_AXES."""
    count = min(count, MAX_AXES)
    return figure.subplots(rows, count, squeeze=False)


def prior_curve(prior, j, points=400):
    """Values, density (or lattice mass) and whether coordinate j of a prior is a lattice."""
    lattice = prior.lattice_steps[j] is not None
    low, high = float(prior.problem.low[j]), float(prior.problem.high[j])
    values = prior.support(j) if lattice else torch.linspace(low, high, points, dtype=torch.float64)
    return values.numpy(), torch.exp(prior.coordinate_log_prob(j, values)).numpy(), lattice


def draw_priors(contexts, figure):
    """Each member's prior density (or lattice mass), per inferred parameter."""
    names = contexts[0].problem.names
    axes = parameter_axes(figure, len(names))[0]
    for colour, ctx in zip(COLOURS, contexts):
        for j, axis in enumerate(axes):
            x, y, lattice = prior_curve(ctx.prior, j)
            if lattice:
                axis.plot(x, y, ".", color=colour, label=ctx.member["name"], markersize=3)
            else:
                axis.plot(x, y, color=colour, label=ctx.member["name"])
            axis.set_xlabel(names[j])
    axes[0].set_ylabel("prior density (dots: lattice mass)")
    axes[0].legend(fontsize="small")


def roc_curve(logits, labels):
    """False- and true-positive rates over every threshold."""
    order = np.argsort(-logits, kind="stable")
    labels = labels[order]
    positives, negatives = labels.sum(), len(labels) - labels.sum()
    tpr = np.concatenate([[0.0], np.cumsum(labels) / max(positives, 1)])
    fpr = np.concatenate([[0.0], np.cumsum(1 - labels) / max(negatives, 1)])
    return fpr, tpr


def draw_training(contexts, figure):
    """Training and validation BCE per epoch, and the ROC on the test split, per member."""
    curves, roc = figure.subplots(1, 2)
    for colour, ctx in zip(COLOURS, contexts):
        history = ctx.model_artifact.json("history")
        epochs = np.arange(1, len(history["train_loss"]) + 1)
        curves.plot(epochs, history["train_loss"], color=colour, label=f"{ctx.member['name']} train")
        curves.plot(epochs, [v["bce"] for v in history["validation"]], "--", color=colour, label="validation")
        predictions = ctx.require("test_predictions")
        fpr, tpr = roc_curve(predictions.array("logits"), predictions.array("labels"))
        roc.plot(fpr, tpr, color=colour, label=ctx.member["name"])
    curves.set_xlabel("epoch")
    curves.set_ylabel("BCE")
    curves.legend(fontsize="x-small")
    roc.plot([0, 1], [0, 1], ":", color="black")
    roc.set_xlabel("false-positive rate")
    roc.set_ylabel("true-positive rate")


def draw_estimates(contexts, figure):
    """Ratio mode against the truth with the highest-density bands, per member and parameter."""
    names = contexts[0].problem.names
    grid = parameter_axes(figure, len(names), rows=len(contexts))
    levels = contexts[0].analysis_settings["inference"]["levels"]
    for row, ctx in zip(grid, contexts):
        learned = ctx.require("learned")
        truths = ctx.require("truths").array("truths")
        modes, lower, upper = (learned.array(f"ratio_{n}") for n in ("mode", "lower", "upper"))
        for j, axis in enumerate(row):
            for level in range(len(levels))[::-1]:     # widest first, the narrower on top, darker
                axis.vlines(truths[:, j], lower[:, level, j], upper[:, level, j], linewidth=2 + 2 * (level == 0),
                            alpha=0.8 - 0.5 * level / max(len(levels) - 1, 1), label=f"{levels[level]:g} region")
            axis.plot(truths[:, j], modes[:, j], ".", color="black", markersize=3, label="mode")
            span = [truths[:, j].min(), truths[:, j].max()]
            axis.plot(span, span, ":", color="gray")
            axis.set_title(f"{ctx.member['name']}: {names[j]}", fontsize="small")
            axis.set_xlabel(f"true {names[j]}", fontsize="small")
            axis.set_ylabel("ratio estimate", fontsize="small")
    grid[0][0].legend(fontsize="x-small")


def draw_bias_width(contexts, figure):
    """Mean bias and mean width of the first level against the true value, per parameter."""
    names = contexts[0].problem.names
    bias_axes, width_axes = parameter_axes(figure, len(names), rows=2)
    for colour, ctx in zip(COLOURS, contexts):
        learned = ctx.require("learned")
        truths = ctx.require("truths").array("truths")
        modes, lower, upper = (learned.array(f"ratio_{n}") for n in ("mode", "lower", "upper"))
        for j, (bias_axis, width_axis) in enumerate(zip(bias_axes, width_axes)):
            values, group = np.unique(np.round(truths[:, j], 9), return_inverse=True)
            counts = np.bincount(group)
            bias = np.bincount(group, weights=modes[:, j] - truths[:, j]) / counts
            width = np.bincount(group, weights=upper[:, 0, j] - lower[:, 0, j]) / counts
            bias_axis.plot(values, bias, ".-", color=colour, label=ctx.member["name"])
            width_axis.plot(values, width, ".-", color=colour)
            width_axis.set_xlabel(f"true {names[j]}")
    bias_axes[0].axhline(0, color="gray", linestyle=":")
    bias_axes[0].set_ylabel("mean bias of the mode")
    width_axes[0].set_ylabel("mean width")
    bias_axes[0].legend(fontsize="x-small")


def case_design(artifact, candidates, case):
    """Points (n, p) and log measure (n,) a retained case was scored on: its own when refined."""
    if "design_points.npy" in artifact.files:
        return artifact.array("design_points")[case], artifact.array("design_log_measure")[case]
    return candidates.array("points"), candidates.array("log_measure")


def draw_diagnostic_cases(ctx, figure):
    """Normalised densities of the retained cases at their candidates, against the first parameter, per target."""
    learned = ctx.require("learned")
    exact = ctx.require("exact") if "exact" in ctx.analysis_settings["inference"]["targets"] else None
    candidates = ctx.require("candidates")
    sources = [(learned, t) for t in ("ratio", "posterior") if f"{t}_scores.npy" in learned.files]
    if exact is not None:
        sources.append((exact, "exact"))
    cases = min(4, learned.array(f"{sources[0][1]}_scores").shape[0]) if sources else 0
    axes = figure.subplots(1, max(cases, 1), squeeze=False)[0]
    truths = ctx.require("truths").array("truths")
    for case, axis in zip(range(cases), axes):
        for colour, (artifact, target) in zip(COLOURS, sources):
            points, log_measure = case_design(artifact, candidates, case)
            measured = np.isfinite(log_measure)      # refined designs also hold padding and zero-measure probes
            scores = artifact.array(f"{target}_scores")[case, :-1][measured]
            # The density, not the mass per point: refined designs weigh their points unequally.
            density = np.exp(scores - np.logaddexp.reduce(scores + log_measure[measured]))
            order = np.argsort(points[measured, 0], kind="stable")
            axis.plot(points[measured, 0][order], density[order], ".", color=colour, markersize=2, label=target)
        axis.axvline(truths[case, 0], color="black", linestyle=":")
        axis.set_xlabel(ctx.problem.names[0])
    axes[0].set_ylabel("normalised density (per unit measure)")
    axes[0].legend(fontsize="x-small")
