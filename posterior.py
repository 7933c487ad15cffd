"""A trained ratio estimator's posterior for one observation: density, samples, HPD regions, moments.

    r = restore("outputs/smoke/runs/baseline-…/uniform-r0-…")
    post = r.posterior(x_o)          # x_o: one observation (d,) or an ensemble (m, d)
    post.sample(1000, seed=0)        # (1000, p) independent draws; post.sampling says how they were made
    post.hpd(0.95)                   # {"threshold", "mass", "lower", "upper"}
    post.mode(), post.mean(), post.cov(), post.log_prob(theta)

The candidates are those of the run's analysis (the `inference.candidates` settings it
was analysed with): an adaptive design is refined for this observation by the same passes
as every analysis case, so for a case's observations and truth the HPD bounds are the
analysis' own. The density is p(θ | x_o) ∝ r(x_o, θ) p(θ), the learned ratio of every
observation of the ensemble times the member's prior, normalised with the candidates'
measure weights; on lattice axes it is a mass per lattice point.

Samples (`sample`, see sampler.py) are fresh points, not candidates: a Gaussian
mixture is fitted to the weighted candidates and refitted on its own weighted draws, or,
where the candidates resolve the posterior too poorly for that (a narrow, correlated
posterior in many parameters), found by a tempered search and adapted by population Monte Carlo;
it is widened and mixed with a wider copy and the uniform box, and its draws are accepted by
rejection against the largest importance weight seen. What is exact: every accepted draw
is an independent draw of the density p(θ | x_o) itself (the model's, evaluated at that
point, not interpolated between candidates) wherever p/q stays below that largest weight;
what is approximated: a region the proposal almost never visits and where p/q would
exceed it is under-drawn, as with any rejection sampler whose bound is estimated. When
rejection would need more than `budget` proposal draws per draw asked, the draws are
an importance resample of the proposal's draws instead and a warning names the setting
to raise; `post.sampling` says which happened. An enumerated lattice is drawn exactly
from its masses; a design with lattice axes that is not enumerated is importance-resampled
from its candidates (c2st.py scores samples against reference draws).

Moments and HPD bounds are the candidates' (weighted by their masses), except on a continuous
box whose candidates hold fewer than MIN_ESS effective points: there they come from
SUMMARY_DRAWS of the sampler's draws (`summary_draws`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import torch

import adaptive
import analysis_metrics
import case_blocks
import case_scores
import designs
import flatness
import hpd
import sampler
import study
import trainer
from inference_schema import check_inference_settings
from sampler import PosteriorError
from store import NnpdWarning

__all__ = [
    "POSTERIOR_CANDIDATES",
    "Learned",
    "Posterior",
    "PosteriorError",
    "PosteriorWarning",
    "Support",
    "draw_corner",
    "for_observation",
    "from_scores",
    "marginal_interval",
    "posterior_settings",
]

# Network rows one posterior may score: candidate points × observations of the ensemble. At about 2.4 µs
# a row for the kit's network on one CPU core, 10^8 is some four minutes; more is refused before any work.
MAX_EVALUATIONS = 10**8
MIN_ESS = 100  # effective candidates below which resampling them is refused: too few to draw from
# The design of a posterior for one observation when no analysis chose one: an analysis scores
# many cases, one posterior can afford more points. On a 10-parameter linear Gaussian (exact
# likelihood, posterior sd about half the prior's, box ±5 prior sds) the analysis' default
# (1,024·p points, a coarse pass of 128·p) left 1.6 to 120 effective candidates; this design
# 85 to 380, in 0.06 to 0.08 CPU s.
POSTERIOR_CANDIDATES = {"kind": "adaptive", "candidate_count": 40_960, "coarse_count": 4096}
# An importance resample of proposal draws whose draws are this share distinct or more (an effective
# size of about five times the draws) is as good as independent draws: on a four-mode 5-parameter
# posterior, 94% distinct draws and exact rejection draws of the same learned posterior scored the
# same C2ST against the reference (0.900 and 0.895). Fewer distinct draws are warned of.
DISTINCT_ENOUGH = 0.9
# Draws that stand in for the candidates in the moments and HPD bounds of a continuous posterior
# whose candidates hold fewer than MIN_ESS effective points: on the narrow 10-parameter problem of
# bench/posterior_problems.py the candidates hold 1 to 9, and their weighted mean misses the exact
# one by up to a posterior sd, where 10,000 draws' is within 0.03 sd of it (tests/test_sampler.py).
SUMMARY_DRAWS = 10_000


class PosteriorWarning(NnpdWarning):
    """A posterior computed, but not one to trust as it is: nearly flat, or samples that are not independent."""


class Support(NamedTuple):
    """The candidates a posterior lives on: points θ (n, p), their log measure (n,) and log posterior scores (n,)."""

    points: torch.Tensor
    log_measure: torch.Tensor
    scores: torch.Tensor
    enumerated: bool = False  # every support point is a candidate: the masses are exact
    box: adaptive.Box | None = None  # the prior's support; None: the candidates' hull


class Learned(NamedTuple):
    """A trained member's network and what its posterior needs beside it."""

    problem: Any
    prior: Any
    model: torch.nn.Module
    analysis_settings: Mapping[str, Any] | None  # those the run was analysed with; None: never analysed
    seed: int  # the training settings' seed: the analysis' designs derive from it


class Posterior:
    """The normalised posterior on a refined candidate design (see the module's docstring)."""

    def __init__(
        self,
        names: Sequence[str],
        score: Callable[[torch.Tensor], torch.Tensor],
        support: Support,
        summary: Mapping[str, Any],
        levels: Sequence[float],
    ) -> None:
        self.names = list(names)
        self.enumerated = support.enumerated
        self._score = score  # score(θ (n, p)) -> unnormalised log density (n,)
        measured = torch.isfinite(support.log_measure)  # zero-measure probes only sharpen projected bounds
        self.points, self.scores = support.points[measured], support.scores[measured]
        self.log_measure = support.log_measure[measured]
        self.log_weights = self.scores + self.log_measure
        self.log_normalizer = float(torch.logsumexp(self.log_weights, 0))
        self.masses = torch.exp(self.log_weights - self.log_normalizer)
        self.ess = float(1.0 / (self.masses * self.masses).sum())
        self.levels = list(levels)
        self._summary = summary  # the analysis-style summary at `levels`, probes included
        self.box = support.box
        self.sampling: dict[str, Any] | None = None  # how the last sample() drew (see sample)
        self.prior_sd: torch.Tensor | None = (
            None  # the prior's marginal sds (p,), for flatness(); set by for_observation
        )
        self.information: float | None = None  # KL from the prior, nats per parameter; set by for_observation
        self.flat: dict[str, Any] | None = None  # flatness() as report_flatness warned it
        self.warnings: list[str] = []  # every PosteriorWarning this posterior gave, in order
        self._draws: torch.Tensor | None = None  # summary_draws(), once drawn

    def log_prob(self, theta: Any) -> torch.Tensor:
        """log p(θ | x_o) at rows θ (n, p): −inf outside the prior's support."""
        theta = torch.as_tensor(theta, dtype=torch.float64).reshape(-1, len(self.names))
        return self._score(theta) - self.log_normalizer

    def sample(self, n: int, seed: int = 0, budget: int | None = None) -> torch.Tensor:
        """n draws (n, p), as good as independent draws of the posterior; `self.sampling` says how they were made.

        Continuous posteriors: rejection sampling from a mixture fitted to the weighted
        candidates, or found by a tempered search and adapted by population Monte Carlo
        where they are too few effective (sampler.rejection_sample), every draw a fresh point. An enumerated lattice:
        exact draws from its masses. A design with lattice axes, or a rejection sampler
        over its budget (proposal draws per draw asked, sampler.BUDGET by default): importance
        resampling, with a warning naming the setting to raise when the draws repeat (on
        lattice axes, beyond the effective candidates; of the proposal's draws, when fewer
        than DISTINCT_ENOUGH of them are distinct). Refused on lattice axes when too few
        candidates are effective to resample from.

        `self.sampling` is then a dict: `method` ("rejection", "lattice", "resampled" or
        "resampled-proposal"), `draws`, `distinct_fraction` (distinct rows over draws),
        `acceptance` (accepted over proposal evaluations; None without a proposal),
        `evaluations` (log_prob evaluations the draws cost), `components` (the fitted
        mixture's), `path` (what placed the proposal: "candidates" or "population Monte
        Carlo"; None without a proposal), `passes` (population Monte Carlo's), `effective`
        (Kish's effective size of the rejection stage's proposal draws) and `warning` (None,
        or the line that was warned).
        """
        n = int(n)
        if n < 1:
            raise PosteriorError(f"sample({n}): draw at least one sample")
        generator = torch.Generator().manual_seed(int(seed))
        if self.enumerated:
            index = torch.multinomial(self.masses, n, replacement=True, generator=generator)
            return self._sampled(self.points[index], {"method": "lattice"})
        if self.box is None or bool(self.box.lattice.any()):
            if self.ess < MIN_ESS:
                raise PosteriorError(
                    f"only {self.ess:.1f} effective candidates (at least {MIN_ESS} needed to "
                    "sample); raise inference.candidates.candidate_count"
                )
            index = torch.multinomial(self.masses, n, replacement=True, generator=generator)
            return self._sampled(self.points[index], {"method": "resampled"})
        with torch.no_grad():
            samples, info = sampler.rejection_sample(
                self.log_prob,
                self.points,
                self.masses,
                self.box,
                n,
                generator,
                sampler.BUDGET if budget is None else budget,
            )
        return self._sampled(samples, info)

    def _sampled(self, samples, info):
        """The draws, with `self.sampling` filled in and the warning given when they repeat where they should not."""
        distinct = int(torch.unique(samples, dim=0).shape[0])
        info = {
            "method": info["method"],
            "draws": int(samples.shape[0]),
            "distinct_fraction": distinct / samples.shape[0],
            "acceptance": info.get("acceptance"),
            "evaluations": int(info.get("evaluations", 0)),
            "components": info.get("components"),
            "path": info.get("path"),
            "passes": info.get("passes"),
            "effective": info.get("effective"),
            "warning": None,
        }
        # A lattice's draws repeat by nature; elsewhere a repeat is a draw that is not independent.
        repeated = distinct < samples.shape[0] and not (info["method"] == "resampled" and samples.shape[0] <= self.ess)
        resampled_few = info["method"] == "resampled-proposal" and distinct < DISTINCT_ENOUGH * samples.shape[0]
        if resampled_few or (info["method"] not in ("lattice", "resampled-proposal") and repeated):
            info["warning"] = (
                f"posterior samples: {distinct} distinct of {samples.shape[0]} ({info['method']}"
                f"{self._acceptance_note(info)}): not independent draws; raise "
                "inference.candidates.candidate_count for a closer proposal, or sample()'s budget"
            )
            self._warn(info["warning"], 4)  # at the line that called sample()
        self.sampling = info
        return samples

    @staticmethod
    def _acceptance_note(info):
        """', acceptance a over e evaluations' where a proposal was used, else nothing."""
        if info["acceptance"] is None:
            return ""
        return f", acceptance {info['acceptance']:.2g} over {info['evaluations']} evaluations"

    def flatness(self, validation_auc: float | None = None) -> dict[str, Any]:
        """Whether the posterior is nearly flat against its prior, with one line saying why (flatness.py).

        `validation_auc`, the model's, names the likely cause.
        """
        return flatness.flatness_report(
            self.names, torch.sqrt(torch.diagonal(self.cov())), self.prior_sd, validation_auc, self.information
        )

    def report_flatness(self, history: Mapping[str, Any] | None = None, stacklevel: int = 1) -> dict[str, Any]:
        """flatness() with the validation AUC of the training `history`'s kept epoch, warned when flat; kept as
        `self.flat`. restore(run).posterior calls it, so a Python user sees what `infer` prints.

        `stacklevel` 1 warns at the line that called this, 2 at the line that called that (restore's).
        """
        self.flat = self.flatness(trainer.kept_validation(dict(history or {})).get("auc"))
        if self.flat["warning"]:
            self._warn(self.flat["warning"], stacklevel + 2)
        return self.flat

    def _warn(self, line: str, stacklevel: int) -> None:
        """Warn `line` as a PosteriorWarning (stacklevel counted from here) and list it in `self.warnings`."""
        self.warnings.append(line)
        warnings.warn(line, PosteriorWarning, stacklevel=stacklevel)

    def summary_draws(self) -> torch.Tensor | None:
        """SUMMARY_DRAWS draws (seed 0) that the moments and HPD bounds come from where the candidates are too
        few effective (under MIN_ESS, on a continuous box) to place the mass; None where they are not."""
        continuous = not self.enumerated and self.box is not None and not bool(self.box.lattice.any())
        if not continuous or self.ess >= MIN_ESS:
            return None
        if self._draws is None:
            generator = torch.Generator().manual_seed(0)
            with torch.no_grad():  # the sampler's own draws: self.sampling and the warnings stay the caller's
                self._draws, _ = sampler.rejection_sample(
                    self.log_prob, self.points, self.masses, self.box, SUMMARY_DRAWS, generator
                )
        return self._draws

    def hpd(self, level: float) -> dict[str, Any]:
        """The HPD region holding `level` of the mass: its score threshold, attained mass and per-axis bounds."""
        draws = self.summary_draws()
        if draws is not None:  # the region's threshold is the draws' (1 − level) score quantile
            scores = self._score(draws)
            threshold = torch.quantile(scores, 1 - float(level))
            region = draws[scores >= threshold]
            return {
                "level": float(level),
                "threshold": float(threshold),
                "mass": float(region.shape[0] / draws.shape[0]),
                "lower": region.min(0).values.tolist(),
                "upper": region.max(0).values.tolist(),
            }
        if level in self.levels:
            i = self.levels.index(level)
            summary = self._summary
        else:
            summary = hpd.hld_summaries(self.scores[None], self.log_measure, self.points, self.scores[:1], [level])
            i = 0
        return {
            "level": float(level),
            "threshold": float(summary["threshold"][0, i]),
            "mass": float(summary["mass"][0, i]),
            "lower": summary["lower"][0, i].tolist(),
            "upper": summary["upper"][0, i].tolist(),
        }

    def mode(self) -> torch.Tensor:
        """The densest point scored (p,): a candidate, or a probe of the bounds where one was denser."""
        return torch.as_tensor(self._summary["mode"][0], dtype=torch.float64)

    def mean(self) -> torch.Tensor:
        """The posterior mean (p,): of the candidates' masses, or of summary_draws() where those are too few."""
        draws = self.summary_draws()
        return self.masses @ self.points if draws is None else draws.mean(0)

    def cov(self) -> torch.Tensor:
        """The posterior covariance (p, p), from the same points as mean()."""
        draws = self.summary_draws()
        if draws is not None:
            return torch.cov(draws.T, correction=0).reshape(len(self.names), len(self.names))
        centred = self.points - self.mean()
        return (self.masses[:, None] * centred).T @ centred

    def summary(self, levels: Sequence[float] | None = None) -> dict[str, Any]:
        """A JSON-able summary: mode, mean, sd and HPD bounds per level, with the effective sample size."""
        return {
            "parameters": self.names,
            "mode": self.mode().tolist(),
            "mean": self.mean().tolist(),
            "sd": torch.sqrt(torch.diagonal(self.cov())).tolist(),
            "ess": self.ess,
            "candidates": int(self.points.shape[0]),
            "moments": "candidates" if self.summary_draws() is None else f"{SUMMARY_DRAWS} draws",
            "hpd": {analysis_metrics.level_key(level): self.hpd(level) for level in (levels or self.levels)},
        }

    def draw_corner(
        self, figure: Any, samples: Any, truth: Any = None, run: str | None = None, prior: str | None = None
    ) -> None:
        """Marginals on the diagonal, pairwise sample densities below it, HPD intervals and the truth if given.

        `run` and `prior` name the run and its prior in the title (infer passes them).
        """
        draw_corner(
            figure,
            self,
            np.asarray(samples),
            None if truth is None else np.asarray(truth, dtype=float),
            run=run,
            prior=prior,
        )


# ---------------------------------------------------------------- one observation's posterior


def observation_ensemble(observations, dimension):
    """An observation as an ensemble (m, d) float64, or a PosteriorError naming the expected shapes."""
    given = real_array(observations)
    x = torch.as_tensor(given.astype(np.float64))
    if x.dim() == 1:
        x = x[None]
    if x.dim() != 2 or x.shape[1] != dimension or x.shape[0] == 0 or not bool(torch.isfinite(x).all()):
        raise PosteriorError(
            f"observations of shape {given.shape}: expected finite numbers of "
            f"shape ({dimension},) for one observation or (m, {dimension}) for m of them"
        )
    if bool((x.abs() > torch.finfo(torch.float32).max).any()):
        raise PosteriorError(
            "observations hold values beyond float32's range (±3.4e38), which the network reads as "
            "infinite; give them in the units the model was trained on"
        )
    return x


def real_array(observations):
    """The observations as a numpy array of real numbers, or a PosteriorError naming what they are."""
    if isinstance(observations, np.ma.MaskedArray):  # np.asarray would drop the mask and keep the masked values
        raise PosteriorError(
            "observations: a masked array; fill or drop the masked values first (numpy.ma.filled, "
            ".compressed()) and pass a plain array"
        )
    if isinstance(observations, torch.Tensor):
        observations = observations.detach().cpu()
        observations = observations if observations.is_complex() else observations.to(torch.float64)
    try:
        array = np.asarray(observations)
    except (TypeError, ValueError) as error:  # a ragged list
        raise PosteriorError(
            f"observations: not an array of numbers ({error}); pass a numpy array (d,) or (m, d)"
        ) from None
    if array.dtype.kind not in "biuf":
        raise PosteriorError(
            f"observations: {type(observations).__name__} of {array.dtype}, not real numbers; pass "
            "a numpy array or tensor of floats, (d,) or (m, d)"
        )
    return array


def check_ensemble_cost(problem, prior, settings, observations):
    """The points the design scores; refused, before any work, when its network evaluations (candidate points ×
    observations, each observation's log ratio summed) exceed MAX_EVALUATIONS. `settings`: posterior_settings'."""
    p = len(problem.names)
    lattice = designs.candidate_lattice(prior.lattice_steps, p, settings["candidates"])
    points = designs.points_per_case(
        p,
        lattice,
        designs.as_f64(problem.low),
        designs.as_f64(problem.high),
        settings["candidates"],
        len(score_targets(settings)),
    )
    if points * observations <= MAX_EVALUATIONS:
        return points
    raise PosteriorError(
        f"{observations:,} observations × {points:,} candidate points are "
        f"{points * observations:.1e} network evaluations, over the {MAX_EVALUATIONS:.0e} one "
        "posterior may take (minutes on one CPU core); pass fewer observations (each one's "
        "log ratio is summed, as for independent draws) or lower "
        "inference.candidates.candidate_count"
    )


class ScoredPoints:
    """A score function that reports, through study.report_progress, how many of the design's points it has
    scored while the posterior is built (the long part of a large ensemble); silent after finish()."""

    def __init__(self, score_fn, total):
        self.score_fn, self.total, self.done, self.building = score_fn, total, 0, True
        study.report_progress("posterior", 0, total)  # the clock of its rate starts here

    def __call__(self, points):
        """The scores of `points`, counted."""
        scores = self.score_fn(points)
        if self.building:
            self.done = min(self.done + len(points), self.total)
            study.report_progress("posterior", self.done, self.total)
        return scores

    def finish(self):
        """The posterior is built: report it whole and stop counting (sampling evaluates it further)."""
        study.report_progress("posterior", self.total, self.total)
        self.building = False


def host_scores(scoring):
    """The scores of a one-case Scoring as a function of points (n, p), returning host tensors."""

    def score_fn(points):
        scored = scoring.scores(torch.zeros(1, dtype=torch.long), points.to(scoring.device)[None])
        return {target: values[0].cpu() for target, values in scored.items()}

    return score_fn


def one_case_scores(score_fn):
    """A one-case score function (points (n, p) -> {target: (n,)}) as a block's (B = 1), in float64."""

    def block_scores(points):
        return {
            target: torch.as_tensor(values, dtype=torch.float64)[None] for target, values in score_fn(points[0]).items()
        }

    return block_scores


def score_targets(settings):
    """The targets a posterior's score function returns, for the analysis' `inference` settings: the
    analysis' own, with the posterior always among them."""
    targets = [t for t in ("ratio", "posterior") if t in settings["targets"]]
    return targets if "posterior" in targets else ["posterior"]


def inference_section(problem, analysis_settings):
    """The analysis' `inference` settings, every key they leave out at its default; for a run never analysed,
    the design of POSTERIOR_CANDIDATES."""
    inference = (analysis_settings or {}).get("inference") or {"candidates": dict(POSTERIOR_CANDIDATES)}
    return check_inference_settings(inference, len(problem.names), callable(getattr(problem, "log_likelihood", None)))


def posterior_settings(problem, lattice_steps, analysis_settings):
    """inference_section with native_grid_prior set for a lattice prior, whose posterior has no density
    between its lattice points: the settings the posterior's design is decided and priced with."""
    settings = inference_section(problem, analysis_settings)
    if any(step is not None for step in lattice_steps):
        settings["candidates"] = dict(settings["candidates"], native_grid_prior=True)
    return settings


def for_observation(learned, observations, truth=None, device="cpu", case=0):
    """The posterior of a member's trained network (`learned`, a Learned) for an observation (see the
    module's docstring).

    `case` picks the refinement's stream, so a case's index, observations and truth give
    that case's design. Without a truth, the box's centre stands in (it changes nothing
    but the truth-only fields of the analysis' summary).
    """
    problem, prior = learned.problem, learned.prior
    settings = posterior_settings(problem, prior.lattice_steps, learned.analysis_settings)
    x = observation_ensemble(observations, problem.dimension)
    points = check_ensemble_cost(problem, prior, settings, len(x))
    score_fn = host_scores(
        case_blocks.learned_scoring(
            learned.model,
            torch.device(device),
            prior,
            x[None],
            score_targets(settings),
            settings,
            case_scores.Evaluations(),
        )
    )
    counted = ScoredPoints(score_fn, points)
    posterior = from_scores(problem, prior.lattice_steps, counted, learned.analysis_settings, learned.seed, truth, case)
    counted.finish()
    posterior.prior_sd = flatness.prior_sds(prior, problem.parameter_count)
    log_prior = torch.as_tensor(prior.log_prob(posterior.points), dtype=torch.float64)
    posterior.information = flatness.information_per_parameter(
        posterior.masses, posterior.log_measure, log_prior, problem.parameter_count
    )
    return posterior


def from_scores(problem, lattice_steps, score_fn, analysis_settings, seed, truth=None, case=0):
    """The posterior of a score function on the analysis' candidate design (see for_observation).

    `problem` gives the parameters' `names` and the prior's box (`low`, `high`);
    `score_fn(θ (n, p)) -> {target: scores (n,)}` returns score_targets(settings), the
    posterior's being the unnormalised log density (log ratio or likelihood plus log prior,
    −inf outside the prior's support). A trained model's posterior is built through here,
    and so is one of an exact likelihood, which checks the candidates and the sampler alone.
    """
    settings = posterior_settings(problem, lattice_steps, analysis_settings)
    box = designs.as_f64(problem.low), designs.as_f64(problem.high)
    truth = (box[0] + box[1]) / 2 if truth is None else torch.as_tensor(truth, dtype=torch.float64)
    design = case_blocks.decide_design(box, lattice_steps, settings, len(score_targets(settings)), seed)
    with torch.no_grad():
        shared = case_blocks.shared_candidates(box, design.lattice, settings["candidates"], seed)
        result = case_blocks.analyse_block(design, shared, one_case_scores(score_fn), truth[None], [case])
    # An adaptive design's points are the case's own; a fixed design's are the shared ones.
    own = design.kind == "adaptive"
    points, log_measure = (result[key][0] if own else result[key] for key in ("points", "log_measure"))
    scores, summary = result["scores"]["posterior"][0, :-1], hpd.host_summary(result["summaries"]["posterior"])
    if not bool(torch.isfinite(scores).any()):
        raise PosteriorError(
            "the posterior is zero on every candidate: the observation is impossible under "
            "the prior and the trained model"
        )
    support = Support(points, log_measure, scores, enumerated=design.kind == "enumerate", box=design.refinement.box)
    return Posterior(problem.names, lambda theta: score_fn(theta)["posterior"], support, summary, settings["levels"])


def draw_corner(figure, posterior, samples, truth, run=None, prior=None):
    """The corner plot of `Posterior.draw_corner`.

    On the diagonal, two kinds of bounds: the joint HPD region's bounds projected on the
    axis (orange lines; with several parameters usually wider than a marginal interval of
    the same level), and the marginal HPD interval of that axis alone, the shortest single
    interval holding the level's share of its samples (shaded).
    """
    p = len(posterior.names)
    axes = figure.subplots(p, p, squeeze=False)
    levels = sorted(posterior.levels)
    for i in range(p):
        for j in range(p):
            axis = axes[i][j]
            if j > i:
                axis.axis("off")  # empty, but the top right one holds the legend
                continue
            if i == j:
                draw_corner_marginal(axis, posterior, samples[:, i], i, levels)
            else:
                axis.hist2d(samples[:, j], samples[:, i], bins=40, cmap="Blues")
                axis.set_ylabel(posterior.names[i])
            if truth is not None:
                axis.axvline(truth[j], color="tab:red", linewidth=1, label="truth" if i == j else None)
                if i != j:
                    axis.axhline(truth[i], color="tab:red", linewidth=1)
                    axis.plot(truth[j], truth[i], "o", color="tab:red", markersize=4)
            axis.set_xlabel(posterior.names[j])
    # The legend stays clear of the histograms: in the empty top right, or below a single panel.
    handles = axes[0][0].get_legend_handles_labels()
    if p > 1:
        axes[0][-1].legend(*handles, fontsize="x-small", loc="upper right")
    else:
        axes[0][0].legend(*handles, fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.15))
    figure.suptitle(
        f"{corner_title(run, prior)}; {len(samples)} samples, {posterior.ess:.0f} effective candidates",
        fontsize="small",
    )


def corner_title(run, prior):
    """The corner plot's title but its counts: the run, then its prior, each when known."""
    return f"Posterior of run {run or '(not given)'}\nprior {prior or '(not given)'}"


def draw_corner_marginal(axis, posterior, values, i, levels):
    """One parameter's sample histogram with its marginal HPD intervals and the joint region's projected bounds."""
    axis.hist(values, bins=40, density=True, color="tab:blue", alpha=0.6, label="samples")
    for level, style, shade in zip(levels, ("-", "--", ":"), (0.25, 0.12, 0.06)):
        low, high = marginal_interval(values, level)
        axis.axvspan(
            low,
            high,
            color="tab:green",
            alpha=shade,
            linewidth=0,
            label=f"marginal {level:g} HPD interval (from the samples)",
        )
        region = posterior.hpd(level)
        for k, bound in enumerate((region["lower"][i], region["upper"][i])):
            axis.axvline(
                bound,
                color="tab:orange",
                linestyle=style,
                label=f"joint {level:g} HPD region, projected" if k == 0 else None,
            )
    axis.set_title(posterior.names[i], fontsize="small")
    axis.set_ylabel("posterior density")


def marginal_interval(values, level):
    """The shortest interval holding at least `level` of one parameter's samples: its marginal HPD interval
    (a single interval, also where the marginal has several modes)."""
    ordered = np.sort(values)
    inside = min(len(ordered), max(1, math.ceil(level * len(ordered) - 1e-9)))  # 0.07 · 100 is 7.000000000000001
    widths = ordered[inside - 1 :] - ordered[: len(ordered) - inside + 1]
    start = int(np.argmin(widths))
    return float(ordered[start]), float(ordered[start + inside - 1])
