"""The study kit's analysis: every product, metric and figure of a neural ratio estimator's study.

`NREAnalysis` works for any experiment whose `problem()` gives the parameters' `names`,
`low`, `high` and `grid_step`, the observation `dimension`, a batched `simulate(theta,
generator)` and, when the exact target or the likelihood metrics are selected,
`log_likelihood(x, theta)`; and whose `prior(member)` gives `sample`, `log_prob` and
`lattice_steps`. Studies written on `nre_study.Study` have all of these.

Products: truths shared by every prior, ensembles of observations at each truth, the
candidate design (adaptive, Sobol or a grid), the learned and exact highest-density (HPD)
summaries of every case, the test split's predictions and Bayes-optimal references.
Metrics: classification, bias, coverage, width, resolution, posterior, exact_reference,
expected_coverage, pairwise, reweighting, normalization (docs/results.md says what each holds).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence, cast

import numpy as np
import torch

import adaptive
import analysis_metrics
import case_blocks
import case_scores
import contrast
import designs
import flatness
import hpd
import inference_schema
import nre_figures
import priors
import probes
import runtime
import trainer
from inference_schema import check_inference_settings
from nre_figures import case_truths
from settings import SettingsError
from store import NnpdError
from study import Analysis, Context, ExperimentContract, Figure, Json, Member, Metric, Product
from study_loading import check_selection

__all__ = [
    "ANALYSIS_STACK",
    "COARSE_REACH",
    "CREDIBILITY_LEVELS",
    "Cases",
    "InvalidObservations",
    "KitExperiment",
    "MIN_COARSE_NEIGHBOURS",
    "NREAnalysis",
    "SUMMARY_FIELDS",
    "bayes_optimal_logits",
    "build_learned",
    "case_design",
    "chi_square_quantile",
    "coverage_curve",
    "posterior_share",
    "summarise_cases",
    "summarise_targets",
    "valid_cases",
]

# The modules of the analysis stack, whose sources enter every product's key (see NREAnalysis).
ANALYSIS_STACK = (inference_schema, designs, case_scores, hpd, analysis_metrics, adaptive, case_blocks)
SUMMARY_FIELDS = (
    "lower",
    "upper",
    "mass",
    "threshold",
    "covered",
    "mode",
    "ess",
    "log_normalizer",
    "region_ess",
    "edge_mass",
    "disagreement",
    "credibility",
    "credibility_upper",
)
# Credibility levels of the expected-coverage curve: 0.01, 0.02, ..., 0.99.
CREDIBILITY_LEVELS = tuple(round(0.01 * k, 2) for k in range(1, 100))
LIKELIHOOD_METRICS = ("exact_reference", "pairwise", "reweighting", "normalization")


class KitExperiment(ExperimentContract, Protocol):
    """What this analysis reads of its experiment beyond nnpd's contract: a kit study (nre_study.Study)."""

    def problem_recipe(self) -> Json: ...
    def prior_recipe(self, member: Member) -> Json: ...


def kit_experiment(ctx: Context) -> KitExperiment:
    """The run's experiment as this analysis reads it: the kit's analysis runs on kit studies only."""
    return cast(KitExperiment, ctx.experiment)


def problem_key(ctx):
    """What the truths and candidates depend on: the study's problem settings, and a later round's box
    (docs/rounds.md: its analysis tests it inside the box)."""
    recipe = kit_experiment(ctx).problem_recipe()
    return recipe if "box" not in ctx.member else {"problem": recipe, "box": ctx.member["box"]}


def candidate_lattice(ctx):
    """Lattice steps per coordinate of the candidates (None for continuous axes)."""
    return designs.candidate_lattice(
        ctx.prior.lattice_steps, ctx.problem.parameter_count, ctx.analysis_settings["inference"]["candidates"]
    )


def build_truths(ctx, writer):
    """Truth parameter points shared by every prior."""
    problem = ctx.problem
    settings = ctx.analysis_settings["inference"]["truths"]
    seed = runtime.derived_seed(ctx.settings["seed"], "truths")
    truths = designs.make_truths(problem.low, problem.high, problem.grid_step, settings, seed)
    writer.array("truths", truths.numpy())
    return {"count": int(truths.shape[0])}


class InvalidObservations(NnpdError, ValueError):
    """The simulator returned NaN or infinite values at analysis truths that may not be dropped."""


def build_observations(ctx, writer):
    """An ensemble of independent observations at every truth; with data.invalid = "drop", at the truths whose
    observations are all finite, the kept truths' indices written as `kept_cases` (see case_truths)."""
    truths = torch.from_numpy(ctx.require("truths").array("truths"))
    seed = runtime.derived_seed(ctx.settings["seed"], "observations")
    observations = designs.make_observations(
        ctx.problem.simulate, truths, ctx.analysis_settings["inference"]["observations"], seed
    )
    valid = valid_cases(observations, truths, ctx.settings.get("data", {}).get("invalid", "error"))
    if valid.all():
        writer.array("observations", observations.numpy())
        return {"shape": list(observations.shape)}
    writer.array("observations", observations[valid].numpy())
    writer.array("kept_cases", np.flatnonzero(valid.numpy()))
    return {"shape": list(observations[valid].shape), "truths": len(truths), "dropped_truths": int((~valid).sum())}


def valid_cases(observations, truths, policy):
    """Which truths' observations (cases, m, d) are all finite; others are an InvalidObservations unless
    `policy` (data.invalid) is "drop" and some truth is left."""
    valid = torch.isfinite(observations).flatten(1).all(1)
    count = int((~valid).sum())
    if not count or (policy == "drop" and count < len(valid)):
        return valid
    line = (
        f"inference.truths: the simulator returned NaN or infinite values at {count:,} of {len(valid):,} truths "
        f"({count / len(valid):.1%}), e.g. at θ = {[round(v, 6) for v in truths[~valid][0].tolist()]}"
    )
    if policy == "drop":
        raise InvalidObservations(f"{line}, every one: fix the simulator, or narrow the study's parameter box")
    raise InvalidObservations(
        f'{line}; fix the simulator there, or set data.invalid = "drop" to analyse the '
        "other truths (training drops such simulations too)"
    )


def build_candidates(ctx, writer):
    """The shared design (the adaptive kind's coarse first pass) with its log measure."""
    problem, design = ctx.problem, case_design(ctx)
    points, log_measure = case_blocks.shared_candidates(
        (problem.low, problem.high),
        design.lattice,
        ctx.analysis_settings["inference"]["candidates"],
        ctx.settings["seed"],
    )
    writer.array("points", points.numpy())
    writer.array("log_measure", log_measure.numpy())
    return {"count": int(points.shape[0]), "design": design.kind}


def inference_inputs(ctx):
    """Truths of the analysed cases, observations, candidate points and log measure as float64 tensors."""
    truths = torch.from_numpy(case_truths(ctx))
    observations = torch.from_numpy(ctx.require("observations").array("observations"))
    candidates = ctx.require("candidates")
    return (
        truths,
        observations,
        torch.from_numpy(candidates.array("points")),
        torch.from_numpy(candidates.array("log_measure")),
    )


def write_summary(outputs, writer, target, summary, start, cases):
    """Write a block of one target's summaries into memory-mapped arrays, allocated on first use."""
    for name in SUMMARY_FIELDS:
        value = np.asarray(summary[name])
        key = f"{target}_{name}"
        if key not in outputs:
            outputs[key] = writer.allocate(key, (cases,) + value.shape[1:], value.dtype)
        outputs[key][start : start + value.shape[0]] = value


class Cases(NamedTuple):
    """The cases a product summarises: the targets scored, the truths (T, p), the shared candidates
    (the adaptive design's coarse pass) and which scores to keep (see retain_settings)."""

    targets: list[str]
    truths: torch.Tensor
    shared: case_blocks.Candidates
    retain: dict[str, Any]


def retained_arrays(writer: Any, design: case_blocks.Design, work: Cases) -> dict[str, np.ndarray]:
    """The arrays that keep whole cases, by name: an adaptive design's kept cases' own points, log measure
    and scores (memory-mapped); a fixed design's scores, memory-mapped for `full`, else the first
    diagnostic cases (written at the end, see finish_retained)."""
    (cases, p), retain = work.truths.shape, work.retain
    kept, sizes = cases if retain["mode"] == "full" else min(retain["cases"], cases), design.refinement.sizes
    if sizes is not None:  # an adaptive design: each case has points of its own
        total = sizes["total"]
        if not kept:
            return {}
        arrays = {
            "design_points": writer.allocate("design_points", (kept, total, p), "float64"),
            "design_log_measure": writer.allocate("design_log_measure", (kept, total), "float64"),
        }
        arrays.update(
            {f"{t}_scores": writer.allocate(f"{t}_scores", (kept, total + 1), "float64") for t in work.targets}
        )
        return arrays
    candidates = work.shared.points.shape[0]
    if retain["mode"] == "full":
        return {f"{t}_scores": writer.allocate(f"{t}_scores", (cases, candidates + 1), "float64") for t in work.targets}
    return {f"{t}_scores": np.zeros((kept, candidates + 1)) for t in work.targets} if kept else {}


def retain_cases(arrays: dict[str, np.ndarray], start: int, result: Mapping[str, Any]) -> None:
    """Keep the cases start… of a block that the arrays hold: every target's scores, and an adaptive
    design's points and log measure."""
    kept = next(iter(arrays.values())).shape[0] if arrays else 0
    count = min(kept - start, next(iter(result["scores"].values())).shape[0])
    if count <= 0:
        return
    for name, key in (("design_points", "points"), ("design_log_measure", "log_measure")):
        if name in arrays:
            arrays[name][start : start + count] = result[key][:count].cpu().numpy()
    for target, scores in result["scores"].items():
        if f"{target}_scores" in arrays:
            arrays[f"{target}_scores"][start : start + count] = scores[:count].cpu().numpy()


def summarise_cases(
    writer: Any, scoring: case_blocks.Scoring, design: case_blocks.Design, work: Cases, progress: Callable[[int], None]
) -> dict[str, Any]:
    """Refine or score blocks of cases (case_blocks.blocks_of_cases) and write one HPD summary per case
    and target.

    Scores of all cases are never held at once: each block's summaries are written into
    memory-mapped arrays. Retained cases keep their scores (each case's truth last) and, on an
    adaptive design, their own points (design_points) and log measure (probes and repeated
    lattice points at −inf).
    """
    cases, arrays = work.truths.shape[0], retained_arrays(writer, design, work)
    outputs: dict[str, np.ndarray] = {}  # the summaries' arrays, by name
    for start, result in case_blocks.blocks_of_cases(
        design, work.shared, scoring, work.truths, len(work.targets), progress
    ):
        for target in work.targets:
            write_summary(outputs, writer, target, hpd.host_summary(result["summaries"][target]), start, cases)
        retain_cases(arrays, start, result)
    if design.kind != "adaptive" and work.retain["mode"] != "full":
        for name, array in arrays.items():
            writer.array(name, array)
    sizes = design.refinement.sizes
    candidates = work.shared.points.shape[0] if sizes is None else sizes["total"]
    return {"cases": cases, "candidates": candidates, "targets": list(work.targets)}


def retain_settings(ctx: Any) -> dict[str, Any]:
    """Which scores are kept: `full` (memory-mapped) or the first `diagnostic_cases`."""
    settings = ctx.analysis_settings["inference"]
    cases = settings["diagnostic_cases"] if settings["retain"] == "diagnostic" else 0
    return {"mode": settings["retain"], "cases": cases}


def case_design(ctx: Any, targets: int = 1) -> case_blocks.Design:
    """The design of this member's cases for `targets` targets scored together (case_blocks.decide_design)."""
    problem = ctx.problem
    return case_blocks.decide_design(
        (problem.low, problem.high),
        ctx.prior.lattice_steps,
        ctx.analysis_settings["inference"],
        targets,
        ctx.settings["seed"],
    )


def summarise_targets(ctx: Any, writer: Any, targets: list[str], scoring: case_blocks.Scoring) -> dict[str, Any]:
    """Summaries of every case for the targets `scoring` gives.

    Adaptive candidates are refined per case, in blocks (the shared design is their
    coarse pass); other designs score every case on the shared design.
    """
    truths, _, points, log_measure = inference_inputs(ctx)
    what = "+".join(targets)
    progress = lambda case: ctx.report_progress(what, case, truths.shape[0])  # noqa: E731
    design = case_design(ctx, len(targets))
    work = Cases(list(targets), truths, case_blocks.Candidates(points, log_measure), retain_settings(ctx))
    metadata = summarise_cases(writer, scoring, design, work, progress)
    progress(truths.shape[0])
    return {**metadata, "design": design.kind}


def build_learned(ctx, writer):
    """HPD summaries of the learned ratio and posterior targets for every case."""
    settings = ctx.analysis_settings["inference"]
    targets = [t for t in ("ratio", "posterior") if t in settings["targets"]]
    observations = torch.from_numpy(ctx.require("observations").array("observations"))
    counted = case_scores.Evaluations()
    scoring = case_blocks.learned_scoring(
        ctx.model, ctx.runtime.device, ctx.prior, observations, targets, settings, counted
    )
    with torch.no_grad():
        metadata = summarise_targets(ctx, writer, targets, scoring)
    probes.count("product.learned", evaluations=counted.rows, network_calls=counted.calls, call_rows=counted.call_rows)
    return {
        **metadata,
        "model_evaluations": counted.rows,
        "network_calls": counted.calls,
        "rows_per_call": counted.call_rows // max(counted.calls, 1),
    }


def build_exact(ctx, writer):
    """HPD summaries of the exact likelihood, on the same kind of candidates, on the analysis' device."""
    observations = torch.from_numpy(ctx.require("observations").array("observations"))
    counted = case_scores.Evaluations()
    scoring = case_blocks.exact_scoring(
        ctx.problem.log_likelihood,
        observations,
        ctx.runtime.device,
        ctx.analysis_settings["inference"]["chunk_rows"],
        counted,
    )
    with torch.no_grad():
        metadata = summarise_targets(ctx, writer, ["exact"], scoring)
    probes.count("product.exact", evaluations=counted.rows)
    return {**metadata, "likelihood_evaluations": counted.rows}


def split_pairs(ctx):
    """The test split's inputs and labels as tensors: its fixed pairs, or each simulation (label 1)
    followed by x re-paired with the θ of one other simulation drawn once (label 0; contrast.py)."""
    if "test_x.npy" not in ctx.data.files:
        return (
            torch.from_numpy(np.asarray(ctx.data.array("test_inputs"))),
            torch.from_numpy(np.asarray(ctx.data.array("test_labels"))),
        )
    x, theta = (torch.from_numpy(np.asarray(ctx.data.array(name))) for name in ("test_x", "test_theta"))
    return contrast.fixed_pairs(x, theta, runtime.derived_seed(ctx.settings["seed"], "test pairs"))


def build_test_predictions(ctx, writer):
    """The model's logits on the held-out test split."""
    inputs, labels = split_pairs(ctx)
    with torch.no_grad():
        logits = torch.cat(
            [
                ctx.model(chunk.to(ctx.runtime.device)).float().cpu().reshape(-1)
                for chunk in inputs.split(trainer.VALIDATION_CHUNK)
            ]
        )
    writer.array("logits", logits.numpy())
    writer.array("labels", labels.numpy())
    return {"rows": int(inputs.shape[0])}


EVIDENCE_DRAWS = 20_000  # prior points of the Monte Carlo evidence (a small lattice is enumerated instead)


def log_evidence(log_likelihood, x, points, log_weights, rows=64):
    """log Σ_k w_k p(x | θ_k) for every row of x (n, d), over weighted points θ_k, in blocks of rows."""
    # Blocks of about 2^18 (row, point, coordinate) cells keep the likelihood's temporaries small.
    rows = max(1, min(rows, 2**18 // max(1, len(points) * x.shape[1])))
    evidence = torch.empty(len(x), dtype=torch.float64)
    for start in range(0, len(x), rows):
        chunk = x[start : start + rows]
        values = log_likelihood(chunk[:, None, :], points[None, :, :]).to(torch.float64) + log_weights
        evidence[start : start + len(chunk)] = torch.logsumexp(values, dim=1)
    return evidence


def bayes_optimal_logits(problem, prior, inputs, draws=EVIDENCE_DRAWS, seed=0):
    """log p(x|θ) − log E_prior p(x|θ') for inputs [x, θ] (rows, d + p): the logit a perfect classifier returns.

    A problem with its own `log_evidence(x, points, log_weights)` (an analytic shortcut) uses it.
    """
    inputs = torch.as_tensor(inputs).detach().cpu().to(torch.float64)
    x, theta = inputs[:, : problem.dimension], inputs[:, problem.dimension :]
    points, log_weights = priors.quadrature_points(prior, draws, seed)
    if callable(getattr(problem, "log_evidence", None)):
        evidence = problem.log_evidence(x, points, log_weights)
    else:
        evidence = log_evidence(problem.log_likelihood, x, points, log_weights)
    return problem.log_likelihood(x, theta) - evidence


def build_reference_logits(ctx, writer):
    """Bayes-optimal logits log p(x|θ) − log p(x) of the test rows (evidence by Monte Carlo)."""
    inputs, _ = split_pairs(ctx)
    seed = runtime.derived_seed(ctx.settings["seed"], "evidence", ctx.member["name"])
    logits = bayes_optimal_logits(ctx.problem, ctx.prior, inputs.double(), seed=seed)
    writer.array("logits", logits.numpy())
    return {"rows": int(inputs.shape[0])}


def build_pairwise(ctx, writer):
    """Learned and exact log-ratio differences log r(x, θ1) − log r(x, θ0) over test pairs.

    Each joint test row (x, θ0) is paired with the θ of the next joint row as θ1; the
    evidence cancels in the difference, so the exact value is a likelihood ratio.
    """
    inputs, labels = split_pairs(ctx)
    joint = inputs[labels == 1]
    d = ctx.problem.dimension
    x, theta0 = joint[:, :d], joint[:, d:]
    theta1 = theta0.roll(1, 0)
    with torch.no_grad():
        learned = [
            ctx.model(torch.cat([x, t], 1).to(ctx.runtime.device)).double().cpu().reshape(-1) for t in (theta1, theta0)
        ]
    exact = [ctx.problem.log_likelihood(x.double(), t.double()) for t in (theta1, theta0)]
    writer.array("learned", (learned[0] - learned[1]).numpy())
    writer.array("exact", (exact[0] - exact[1]).numpy())
    return {"pairs": int(x.shape[0])}


def metric_pairwise(ctx):
    """How far the learned log-ratio differences are from the exact ones."""
    pairs = ctx.require("pairwise")
    learned, exact = pairs.array("learned"), pairs.array("exact")
    error = learned - exact
    correlation = np.corrcoef(learned, exact)[0, 1] if len(error) > 1 and learned.std() > 0 else None
    return {
        "pairs": int(len(error)),
        "mean_error": analysis_metrics.finite_or_none(error.mean()),
        "mean_absolute_error": analysis_metrics.finite_or_none(np.abs(error).mean()),
        "rmse": analysis_metrics.finite_or_none(np.sqrt((error**2).mean())),
        "correlation": analysis_metrics.finite_or_none(correlation) if correlation is not None else None,
    }


def metric_reweighting(ctx):
    """Sliced W1 from the joint sample to the product sample reweighted by the learned ratio.

    Baselines: the unweighted product sample and the one reweighted by the exact ratio.
    """
    inputs, labels = split_pairs(ctx)
    learned = torch.from_numpy(ctx.require("test_predictions").array("logits")).double()
    exact = torch.from_numpy(ctx.require("reference_logits").array("logits"))
    joint, product = inputs[labels == 1], inputs[labels == 0]
    seed = runtime.derived_seed(ctx.settings["seed"], "projections")
    product_mask = labels == 0
    return {
        "sliced_wasserstein": {
            "learned_weights": analysis_metrics.sliced_wasserstein(joint, product, learned[product_mask], seed=seed),
            "unweighted": analysis_metrics.sliced_wasserstein(joint, product, None, seed=seed),
            "exact_weights": analysis_metrics.sliced_wasserstein(joint, product, exact[product_mask], seed=seed),
        },
        "ess": {
            "learned_weights": analysis_metrics.effective_sample_size(learned[product_mask]),
            "exact_weights": analysis_metrics.effective_sample_size(exact[product_mask]),
            "sample": int(product_mask.sum()),
        },
    }


def metric_normalization(ctx):
    """Monte Carlo check that the mean of r(x, θ) over the prior's evidence is 1."""
    _, labels = split_pairs(ctx)
    product = labels == 0
    report: dict[str, Any] = {}
    for name, logits in (
        ("learned", ctx.require("test_predictions").array("logits")),
        ("exact", ctx.require("reference_logits").array("logits")),
    ):
        ratios = np.exp(np.asarray(logits, dtype=np.float64)[product.numpy()])
        error = ratios.std(ddof=1) / np.sqrt(len(ratios)) if len(ratios) > 1 else None
        report[name] = {
            "mean_ratio": analysis_metrics.finite_or_none(ratios.mean()),
            "standard_error": analysis_metrics.finite_or_none(error) if error is not None else None,
        }
    report["rows"] = int(product.sum())
    return report


def summary_of(artifact, target):
    """The HLD summary arrays of one target from a learned or exact product."""
    return {name: artifact.array(f"{target}_{name}") for name in SUMMARY_FIELDS}


def resolution_report(ctx, artifact, target):
    """Whether one target's candidates resolved its densities (see analysis_metrics.resolution_metrics)."""
    return analysis_metrics.resolution_metrics(
        summary_of(artifact, target),
        artifact.metadata["candidates"],
        ctx.analysis_settings["inference"]["levels"],
        artifact.metadata["design"],
    )


def target_report(ctx, artifact, target):
    """Bias, coverage, width and resolution of one target's summaries."""
    settings = ctx.analysis_settings["inference"]
    truths = case_truths(ctx)
    summary = summary_of(artifact, target)
    names = ctx.problem.names
    return {
        "bias": analysis_metrics.bias_metrics(summary["mode"], truths, names),
        "coverage": analysis_metrics.coverage_metrics(summary, truths, settings["levels"], names),
        "width": analysis_metrics.width_metrics(summary, settings["levels"], names),
        "resolution": resolution_report(ctx, artifact, target),
    }


def metric_classification(ctx):
    """Held-out test BCE, accuracy and AUC."""
    predictions = ctx.require("test_predictions")
    return analysis_metrics.classification_metrics(
        torch.from_numpy(predictions.array("logits")), torch.from_numpy(predictions.array("labels"))
    )


def metric_bias(ctx):
    """Error of the ratio mode against the truth."""
    return target_report(ctx, ctx.require("learned"), "ratio")["bias"]


def metric_coverage(ctx):
    """Coverage of the ratio target's highest-density regions."""
    return target_report(ctx, ctx.require("learned"), "ratio")["coverage"]


def metric_width(ctx):
    """Projected widths of the ratio target's highest-density regions."""
    return target_report(ctx, ctx.require("learned"), "ratio")["width"]


def metric_resolution(ctx):
    """Whether the candidates resolve the ratio target's densities."""
    return resolution_report(ctx, ctx.require("learned"), "ratio")


def metric_posterior(ctx):
    """Bias, coverage, width and resolution of the posterior target, and whether it is flat; or that it is off."""
    if "posterior" not in ctx.analysis_settings["inference"]["targets"]:
        return {"enabled": False}
    return {
        "enabled": True,
        **target_report(ctx, ctx.require("learned"), "posterior"),
        "flat": case_flatness(ctx),
        "truths_note": truths_note(ctx.prior),
    }


def metric_dropped_truths(ctx):
    """The truths dropped because the simulator failed there (data.invalid = "drop"), with a note when any were."""
    total = len(ctx.require("truths").array("truths"))
    dropped = int(ctx.require("observations").metadata.get("dropped_truths", 0))
    note = None
    if dropped:
        note = (
            f"{dropped:,} of {total:,} truths dropped: the simulator returned NaN or infinite values there "
            f'(data.invalid = "drop"), so every metric describes the other {total - dropped:,}'
        )
    return {"truths": total, "cases": total - dropped, "dropped": dropped, "note": note}


def truths_note(prior):
    """One line when the prior is not uniform: the truths fill the box evenly, so the posterior target's
    coverage is not expected at nominal (docs/results.md, "Coverage under a non-uniform prior"); else None."""
    if all(family in ("uniform", "grid") for family in getattr(prior, "families", ["own"])):
        return None
    return (
        "the posterior target's coverage is judged against truths spread evenly over the box, not drawn from "
        "this prior, so it is expected off nominal where the prior is not flat; the ratio target's coverage "
        "checks calibration under these truths"
    )


FLAT_CASES = 4  # analysis cases whose posterior the `posterior` metric checks for flatness


def case_flatness(ctx):
    """Flatness of the learned posterior of the first FLAT_CASES cases, each refined as its analysis was.

    `warning` is one line when at least half of them are flat, else None.
    """
    truths = case_truths(ctx)
    observations = ctx.require("observations").array("observations")
    names, cases = ctx.problem.names, min(FLAT_CASES, len(truths))
    auc = trainer.kept_validation(ctx.model_artifact.json("history")).get("auc")
    reports = []
    for case in range(cases):
        # The study's own posterior, as restore(run).posterior(x) gives it to the user.
        posterior = ctx.experiment.posterior(
            ctx.member,
            ctx.model,
            ctx.analysis_settings,
            observations[case],
            truth=truths[case],
            device=ctx.runtime.device,
            case=case,
        )
        reports.append(posterior.flatness(auc))
    flat = [report for report in reports if report["flat"]]
    parameters = [name for name in names if any(name in report["parameters"] for report in flat)]
    warning = None
    if flat and 2 * len(flat) >= cases:
        warning = (
            f"{len(flat)} of {cases} checked cases have a nearly flat posterior (in {', '.join(parameters)}: "
            f"sds above {flatness.FLAT_SD_SHARE:g} of the prior's, geometric mean); {flatness.flat_cause(auc)}"
        )
    return {
        "cases": cases,
        "flat_cases": len(flat),
        "parameters": parameters,
        "validation_auc": auc,
        "sd_share": [report["sd_share"] for report in reports],
        "warning": warning,
    }


def metric_exact_reference(ctx):
    """The exact likelihood's report, and how far the learned modes are from its modes."""
    exact = ctx.require("exact")
    report = target_report(ctx, exact, "exact")
    learned_modes = ctx.require("learned").array("ratio_mode")
    exact_modes = exact.array("exact_mode")
    report["mode_rmse_learned_vs_exact"] = float(np.sqrt(np.mean((learned_modes - exact_modes) ** 2)))
    return report


def coverage_curve(credibility, levels=CREDIBILITY_LEVELS):
    """Per credibility level α: the share of cases whose truth credibility is below α, with Wilson bands.

    A truth lies in the HPD region of level α exactly when the mass denser than it is below
    α, so at 0.68 and 0.95 this is the joint coverage; a calibrated posterior follows the
    diagonal. The bands hold 95% jointly over all the levels (Wilson intervals at the
    Bonferroni z), so a calibrated curve leaves its band anywhere only one time in twenty.
    """
    credibility = np.asarray(credibility, dtype=np.float64)
    inside = [int((credibility < level).sum()) for level in levels]
    cases = int(credibility.size)
    z = statistics.NormalDist().inv_cdf(1 - 0.025 / len(levels))
    bands = [analysis_metrics.wilson_interval(hits, cases, z) for hits in inside]
    return {
        "coverage": [hits / cases if cases else None for hits in inside],
        "lower": [band[0] if band else None for band in bands],
        "upper": [band[1] if band else None for band in bands],
    }


def metric_expected_coverage(ctx):
    """Expected coverage over every credibility level, for every target (see coverage_curve)."""
    targets = ctx.analysis_settings["inference"]["targets"]
    report: dict[str, Any] = {"levels": list(CREDIBILITY_LEVELS), "cases": None}
    for target in targets:
        artifact = ctx.require("exact" if target == "exact" else "learned")
        credibility = artifact.array(f"{target}_credibility")
        report["cases"] = int(credibility.size)
        report[target] = coverage_curve(credibility)
    return report


MIN_EXPECTED_INSIDE = 100  # design points a fixed design should put inside a 0.95 posterior region
# An adaptive design's coarse pass must put a point near each posterior for the refined passes to
# find it: in the bundled study a case is under-resolved about when no coarse point lies inside its
# 0.95 region doubled in radius (README, "The bundled study"), which a uniform coarse pass leaves
# empty with the Poisson probability exp(−expected count). Measured shares of flagged cases run up
# to twice that, so keeping twice it within the share the resolution warning allows needs this
# many coarse points expected there: ln(2 / 0.01) ≈ 5.3. Calibrated on the bundled study's
# posteriors; narrower ones need fewer points than this asks, so there it errs toward warning.
COARSE_REACH = 2.0
MIN_COARSE_NEIGHBOURS = math.log(2 / analysis_metrics.MAX_FLAGGED_SHARE)


def chi_square_quantile(level, dof):
    """The `level` quantile of a chi-square with `dof` degrees of freedom (bisection on its CDF)."""
    low, high = 0.0, 10.0 * dof + 100.0
    shape = torch.tensor(dof / 2, dtype=torch.float64)
    for _ in range(100):
        middle = (low + high) / 2
        if float(torch.special.gammainc(shape, torch.tensor(middle / 2, dtype=torch.float64))) < level:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def posterior_share(problem, lattice, observations, scale=1.0):
    """Expected share of a box-filling design inside a 0.95 posterior region: ellipsoid over box volume.

    `scale` multiplies the region's radius (2: the region doubled, 2^p times its volume).
    Needs the problem's `posterior_sds(observations)`: the posterior's sds per parameter, roughly.
    """
    p = problem.parameter_count
    radius = scale * math.sqrt(chi_square_quantile(0.95, p))
    log_ball = p / 2 * math.log(math.pi) - math.lgamma(p / 2 + 1) + p * math.log(radius)
    widths = [float(b - a) + (step or 0.0) for a, b, step in zip(problem.low, problem.high, lattice)]
    sds = torch.as_tensor(problem.posterior_sds(observations), dtype=torch.float64)
    log_share = log_ball + float(sds.log().sum()) - sum(map(math.log, widths))
    return min(1.0, math.exp(log_share))


class NREAnalysis(Analysis):
    """The whole analysis of a ratio-estimator study: products, metrics and figures."""

    SECTIONS = ()
    OPTIONAL_SECTIONS = ("inference",)  # every key has a default (inference_schema.py)
    # lat68 / lat95: the randomised coverage, nominal for the exact likelihood on lattice priors too.
    # exact68 / exact95: the exact likelihood's coverage on the same truths and candidates (a study with
    # log_likelihood), beside the learned one: what the analysis itself gives, so the gap is the model's.
    REPORT_COLUMNS = (
        ("cov68", "coverage.0.68.joint"),
        ("exact68", "exact_reference.coverage.0.68.joint"),
        ("lat68", "coverage.0.68.lattice"),
        ("cov95", "coverage.0.95.joint"),
        ("exact95", "exact_reference.coverage.0.95.joint"),
        ("lat95", "coverage.0.95.lattice"),
        ("width68", "width.0.68.mean"),
        ("bias rmse", "bias.rmse"),
        ("test AUC", "classification.auc"),
        ("unresolved", "resolution.flagged.any"),
    )
    FIGURE_METRICS = (
        ("joint 68% coverage", "coverage.0.68"),
        ("68% width", "width.0.68.mean"),
        ("bias RMSE", "bias.rmse"),
    )
    # Lines `run` and `report` print under the table; a path ending in "note" prints as a note.
    REPORT_WARNINGS = ("resolution.warning", "posterior.flat.warning", "posterior.truths_note", "dropped_truths.note")
    WORKLOAD_ADVICE = "reduce inference.truths, inference.candidates or inference.observations"

    products = {
        "truths": Product(
            build_truths,
            lambda ctx: {
                "problem": problem_key(ctx),
                "seed": ctx.settings["seed"],
                "truths": ctx.analysis_settings["inference"]["truths"],
            },
        ),
        "observations": Product(
            build_observations,
            lambda ctx: {"observations": ctx.analysis_settings["inference"]["observations"]},
            needs=("truths",),
        ),
        "candidates": Product(
            build_candidates,
            lambda ctx: {
                "problem": problem_key(ctx),
                "seed": ctx.settings["seed"],
                "candidates": ctx.analysis_settings["inference"]["candidates"],
                "lattice": candidate_lattice(ctx),
            },
        ),
        "learned": Product(
            build_learned,
            lambda ctx: {
                "prior": kit_experiment(ctx).prior_recipe(ctx.member),
                "inference": {
                    k: ctx.analysis_settings["inference"][k]
                    for k in ("targets", "levels", "retain", "diagnostic_cases", "precision")
                },
            },
            needs=("truths", "observations", "candidates"),
            uses_model=True,
        ),
        "exact": Product(
            build_exact,
            lambda ctx: {
                "inference": {
                    k: ctx.analysis_settings["inference"][k] for k in ("levels", "retain", "diagnostic_cases")
                }
            },
            needs=("truths", "observations", "candidates"),
        ),
        "test_predictions": Product(build_test_predictions, lambda ctx: {"data": ctx.data.key}, uses_model=True),
        "reference_logits": Product(
            build_reference_logits,
            lambda ctx: {
                "data": ctx.data.key,
                "problem": kit_experiment(ctx).problem_recipe(),
                "prior": kit_experiment(ctx).prior_recipe(ctx.member),
                "seed": ctx.settings["seed"],
                "member": ctx.member["name"],
            },
        ),
        "pairwise": Product(build_pairwise, lambda ctx: {"data": ctx.data.key}, uses_model=True),
    }

    metrics = {
        "classification": Metric(metric_classification, needs=("test_predictions",)),
        "bias": Metric(metric_bias, needs=("learned", "truths")),
        "coverage": Metric(metric_coverage, needs=("learned", "truths")),
        "width": Metric(metric_width, needs=("learned",)),
        "resolution": Metric(metric_resolution, needs=("learned",)),
        "posterior": Metric(metric_posterior, needs=("learned", "truths", "observations")),
        "exact_reference": Metric(metric_exact_reference, needs=("exact", "learned", "truths")),
        "expected_coverage": Metric(metric_expected_coverage, needs=("learned",)),
        "pairwise": Metric(metric_pairwise, needs=("pairwise",)),
        "reweighting": Metric(metric_reweighting, needs=("test_predictions", "reference_logits")),
        "normalization": Metric(metric_normalization, needs=("test_predictions", "reference_logits")),
        "dropped_truths": Metric(metric_dropped_truths, needs=("truths", "observations")),
    }
    NEEDS_RATIO = ("bias", "coverage", "width", "resolution", "exact_reference")

    # The figures a settings file that names none gets: calibration per run; training, estimates against
    # the truths and bias and width per configuration. A second or so each; diagnostic_cases (several
    # seconds a run) and priors are asked for by name.
    DEFAULT_PLOTS = ("expected_coverage",)
    DEFAULT_COHORT_PLOTS = ("training", "estimates", "bias_width")
    plots = {
        "diagnostic_cases": Figure(nre_figures.draw_diagnostic_cases),
        "expected_coverage": Figure(nre_figures.draw_expected_coverage),
        "rounds": Figure(nre_figures.draw_rounds),
    }
    cohort_plots = {
        "priors": Figure(nre_figures.draw_priors),
        "training": Figure(nre_figures.draw_training),
        "estimates": Figure(nre_figures.draw_estimates),
        "bias_width": Figure(nre_figures.draw_bias_width),
    }

    def __init__(self, settings: Mapping[str, Any], experiment: Any) -> None:
        self.experiment = experiment
        self.settings = self.with_defaults(settings)
        # The analysis stack (its designs, scores, refinement, summaries and metrics) and the
        # problem's code (its simulator and likelihood: the truths' observations, the exact
        # target) shape the products, so their sources enter every product's key.
        self.SOURCES = (
            ANALYSIS_STACK + (priors, runtime.derived_seed) + tuple(getattr(experiment, "SCIENCE_SOURCES", ()))
        )

    def with_defaults(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The analysis settings with the defaults of `inference`, `metrics` and the figures filled in for this
        study (DEFAULT_PLOTS, DEFAULT_COHORT_PLOTS: drawn where matplotlib is installed, skipped elsewhere)."""
        problem = self.experiment.problem()
        likelihood = callable(getattr(problem, "log_likelihood", None))
        inference = check_inference_settings(settings.get("inference", {}), problem.parameter_count, likelihood)
        return {
            **settings,
            "inference": inference,
            "metrics": settings.get("metrics", self.default_metrics(inference["targets"], likelihood)),
            "plots": settings.get("plots", list(self.DEFAULT_PLOTS)),
            "cohort_plots": settings.get("cohort_plots", list(self.DEFAULT_COHORT_PLOTS)),
        }

    def default_metrics(self, targets: Sequence[str], likelihood: bool) -> list[str]:
        """Every metric the targets and the study's likelihood allow; `dropped_truths` where data.invalid drops."""
        dropping = getattr(self.experiment, "settings", {}).get("data", {}).get("invalid") == "drop"
        return [
            name
            for name in self.metrics
            if (likelihood or name not in LIKELIHOOD_METRICS)
            and ("ratio" in targets or name not in self.NEEDS_RATIO)
            and ("exact" in targets or name != "exact_reference")
            and (dropping or name != "dropped_truths")
        ]

    def validate(self) -> None:
        """Check that every selected metric can be computed (the inference settings were checked when filled)."""
        self.check_adaptive_sizes()
        targets = self.settings["inference"]["targets"]
        self.check_likelihood(targets)
        for name in self.settings["metrics"]:
            if name in self.NEEDS_RATIO and "ratio" not in targets:
                raise SettingsError(
                    f"metrics: {name!r} needs the 'ratio' target; add it to inference.targets or remove the metric"
                )
            if name == "exact_reference" and "exact" not in targets:
                raise SettingsError(
                    "metrics: 'exact_reference' needs the 'exact' target; add it to "
                    "inference.targets or remove the metric"
                )
        lattice_priors = sorted(
            {
                member["prior"]
                for member in self.experiment.members()
                if any(step is not None for step in self.experiment.prior(member).lattice_steps)
            }
        )
        if (
            "posterior" in targets
            and lattice_priors
            and not self.settings["inference"]["candidates"]["native_grid_prior"]
        ):
            raise SettingsError(
                f"inference.targets: the 'posterior' target of lattice priors ({', '.join(lattice_priors)}) "
                "has no density on continuous candidates; set inference.candidates.native_grid_prior "
                "to True or remove 'posterior'"
            )
        check_selection("plots", self.settings["plots"], self.plots)
        check_selection("cohort_plots", self.settings["cohort_plots"], self.cohort_plots)
        inference = self.settings["inference"]
        if (
            "diagnostic_cases" in self.settings["plots"]
            and inference["retain"] == "diagnostic"
            and inference["diagnostic_cases"] == 0
        ):
            raise SettingsError(
                "plots: 'diagnostic_cases' draws retained scores; set inference.diagnostic_cases "
                "above 0 or inference.retain to 'full'"
            )

    def check_likelihood(self, targets: Sequence[str]) -> None:
        """The exact target and the likelihood metrics need the problem's log_likelihood."""
        if callable(getattr(self.experiment.problem(), "log_likelihood", None)):
            return
        wanted = ["target 'exact'"] * ("exact" in targets) + [
            f"metric {name!r}" for name in self.settings["metrics"] if name in LIKELIHOOD_METRICS
        ]
        if wanted:
            raise SettingsError(
                f"inference.targets / metrics: {', '.join(wanted)} need the exact likelihood, which "
                f"{type(self.experiment).__name__} does not give; define log_likelihood(x, theta) "
                "in the study, or remove them"
            )

    def learned_targets(self) -> list[str]:
        """The targets the learned product scores with the model."""
        return [t for t in ("ratio", "posterior") if t in self.settings["inference"]["targets"]]

    def design_of(self, member: Member) -> tuple[str, list[float | None]]:
        """The member's candidate design and its lattice steps."""
        problem = self.experiment.problem()
        candidates = self.settings["inference"]["candidates"]
        lattice = designs.candidate_lattice(
            self.experiment.prior(member).lattice_steps, problem.parameter_count, candidates
        )
        return designs.candidate_design(
            problem.parameter_count, lattice, problem.low, problem.high, candidates
        ), lattice

    def check_adaptive_sizes(self) -> None:
        """An adaptive design must fit its passes and probes into candidate_count."""
        candidates = self.settings["inference"]["candidates"]
        if candidates["kind"] != "adaptive":
            return
        groups = [len(self.learned_targets()), int("exact" in self.settings["inference"]["targets"])]
        try:
            for targets in filter(None, groups):
                designs.adaptive_sizes(self.experiment.problem().parameter_count, candidates, targets)
        except ValueError as error:
            raise SettingsError(f"inference.candidates: {error}") from None

    def workload(self, member: Member) -> dict[str, int]:
        """Model evaluations, saved bytes and candidate points this member's analysis needs."""
        settings = self.settings["inference"]
        problem = self.experiment.problem()
        p = problem.parameter_count
        design, lattice = self.design_of(member)
        cases = designs.truth_count(p, settings["truths"])
        shared = designs.candidate_count_for(p, lattice, problem.low, problem.high, settings["candidates"])
        per_case = designs.points_per_case(p, lattice, problem.low, problem.high, settings["candidates"])
        ensemble, levels = settings["observations"], len(settings["levels"])
        learned = self.learned_targets()
        evaluations = cases * (per_case + 1) * ensemble if learned else 0
        retained = cases if settings["retain"] == "full" else min(cases, settings["diagnostic_cases"])
        targets = len(learned) + ("exact" in settings["targets"])
        products = bool(learned) + ("exact" in settings["targets"])
        design_bytes = products * retained * per_case * (p + 1) if design == "adaptive" else 0
        saved = 8 * (
            cases * ensemble * problem.dimension
            + (p + 1) * shared
            + design_bytes
            + targets * (retained * (per_case + 1) + cases * (2 * levels * p + 3 * levels + p + 7))
        )
        return {"model_evaluations": int(evaluations), "saved_bytes": int(saved), "candidate_points": int(per_case)}

    def plan_errors(self) -> list[str]:
        """What stops the analysis (not the training) before any compute: a study with no simulator, trained
        on a bank, cannot simulate the observations of its truths."""
        if self.experiment.problem().simulate is not None:
            return []
        return [
            f"{type(self.experiment).__name__} defines no simulate(theta, generator): the analysis simulates "
            "observations at its truths; `train` on data.bank and `infer` work without it"
        ]

    def plan_warnings(self) -> list[str]:
        """One line per candidate design predicted to under-resolve the posteriors, before any compute:
        a fixed design too sparse for them, or an adaptive design whose coarse pass is."""
        candidates = self.settings["inference"]["candidates"]
        problem = self.experiment.problem()
        if not callable(getattr(problem, "posterior_sds", None)):
            return []  # nothing to predict the posterior's size from
        by_design: dict[tuple[str, tuple[float | None, ...]], list[str]] = {}
        for member in self.experiment.members():
            design, lattice = self.design_of(member)
            if design in ("sobol", "grid", "adaptive"):
                by_design.setdefault((design, tuple(lattice)), []).append(member["prior"])
        lines = self.coarse_warnings(
            {lattice: names for (design, lattice), names in by_design.items() if design == "adaptive"}
        )
        for (design, steps), prior_names in by_design.items():
            if design == "adaptive":
                continue
            count = designs.candidate_count_for(
                problem.parameter_count, list(steps), problem.low, problem.high, candidates
            )
            expected = count * posterior_share(problem, list(steps), self.settings["inference"]["observations"])
            if expected < MIN_EXPECTED_INSIDE:
                needed = math.ceil(count * MIN_EXPECTED_INSIDE / max(expected, 1e-300))
                knob = f"candidate_count to about {needed:,}" if design == "sobol" else "candidate_points_per_axis"
                lines.append(
                    f"inference.candidates: the fixed {design} design of {count} points puts about {expected:.3g} "
                    f"inside a 0.95 posterior region of the {problem.parameter_count} parameters (priors "
                    f"{', '.join(prior_names)}), fewer than {MIN_EXPECTED_INSIDE}, so coverage and widths describe the "
                    f"design; set inference.candidates.kind to 'adaptive' or raise {knob}"
                )
        return lines

    def coarse_warnings(self, lattices: Mapping[tuple[float | None, ...], list[str]]) -> list[str]:
        """The line for an adaptive design whose coarse pass is predicted to leave too many posteriors
        without a coarse point near them (see MIN_COARSE_NEIGHBOURS), or none.

        `lattices`: {lattice steps: the names of the priors refined on them}; one line names every prior
        that falls short and the coarse_count the sparsest of them needs.
        """
        candidates, inference = self.settings["inference"]["candidates"], self.settings["inference"]
        problem = self.experiment.problem()
        p, coarse = problem.parameter_count, int(candidates["coarse_count"])
        near = {
            lattice: coarse * posterior_share(problem, list(lattice), inference["observations"], COARSE_REACH)
            for lattice in lattices
        }
        short = [lattice for lattice in lattices if near[lattice] < MIN_COARSE_NEIGHBOURS]
        if not short:
            return []
        fewest = min(near[lattice] for lattice in short)
        needed = math.ceil(coarse * MIN_COARSE_NEIGHBOURS / max(fewest, 1e-300))
        targets = max(len(self.learned_targets()), int("exact" in inference["targets"]), 1)
        total = needed * (int(candidates["refinement_stages"]) + 1) + targets * 2 * p * (
            designs.PROBE_RADII + designs.PROBE_REFINE
        )
        fit = (
            f" and candidate_count to at least {total:,}, which that needs"
            if total > int(candidates["candidate_count"])
            else ""
        )
        names = ", ".join(name for lattice in short for name in lattices[lattice])
        return [
            f"inference.candidates: the adaptive design's coarse pass of {coarse} points puts about {fewest:.3g} "
            f"inside a 0.95 posterior region of the {p} parameters doubled in radius (priors {names}), fewer "
            f"than {MIN_COARSE_NEIGHBOURS:.2g}, so the refined passes may miss the posterior in roughly "
            f"{min(1.0, 2 * math.exp(-fewest)):.0%} of the cases; raise inference.candidates.coarse_count to "
            f"about {needed:,}{fit}"
        ]
