"""A trained ratio estimator's posterior for one observation: density, samples, HPD regions, moments.

    r = restore("outputs/smoke/runs/baseline-…/uniform-r0-…")
    post = r.posterior(x_o)          # x_o: one observation (d,) or an ensemble (m, d)
    post.sample(1000, seed=0)        # (1000, p), with post.ess the effective sample size
    post.hpd(0.95)                   # {"threshold", "mass", "lower", "upper"}
    post.mode(), post.mean(), post.cov(), post.log_prob(theta)

The candidates are those of the run's analysis (the `inference.candidates` settings it
was analysed with): an adaptive design is refined for this observation by the same passes
as every analysis case, so for a case's observations and truth the HPD bounds are the
analysis' own. The density is p(θ | x_o) ∝ r(x_o, θ) p(θ), the learned ratio of every
observation of the ensemble times the member's prior, normalised with the candidates'
measure weights; on lattice axes it is a mass per lattice point.
"""

import numpy as np
import torch

import adaptive
import inference
import runtime
from nre_analysis import check_inference_settings, learned_scoring

MIN_ESS = 100            # effective candidates below which sampling is refused: too few to resample from


class PosteriorError(ValueError):
    """A posterior that cannot be computed or sampled as asked; the message says why and what to change."""


class Posterior:
    """The normalised posterior on a refined candidate design (see the module's docstring)."""

    def __init__(self, names, score, points, log_measure, scores, summary, levels, enumerated=False):
        self.names = list(names)
        self.enumerated = enumerated                # every support point is a candidate: the masses are exact
        self._score = score                         # score(θ (n, p)) -> unnormalised log density (n,)
        measured = torch.isfinite(log_measure)      # zero-measure probes only sharpen projected bounds
        self.points, self.scores, self.log_measure = points[measured], scores[measured], log_measure[measured]
        self.log_weights = self.scores + self.log_measure
        self.log_normalizer = float(torch.logsumexp(self.log_weights, 0))
        self.masses = torch.exp(self.log_weights - self.log_normalizer)
        self.ess = float(1.0 / (self.masses * self.masses).sum())
        self.levels = list(levels)
        self._summary = summary                     # the analysis-style summary at `levels`, probes included

    def log_prob(self, theta):
        """log p(θ | x_o) at rows θ (n, p): −inf outside the prior's support."""
        theta = torch.as_tensor(theta, dtype=torch.float64).reshape(-1, len(self.names))
        return self._score(theta) - self.log_normalizer

    def sample(self, n, seed=0):
        """n draws (n, p) by importance resampling of the weighted candidates; refused when too few are effective.

        On an enumerated lattice the masses are exact, so drawing from them is exact however few they are.
        """
        if self.ess < MIN_ESS and not self.enumerated:
            raise PosteriorError(f"only {self.ess:.1f} effective candidates (at least {MIN_ESS} needed to "
                                 "resample); raise inference.candidates.candidate_count")
        generator = torch.Generator().manual_seed(int(seed))
        index = torch.multinomial(self.masses, int(n), replacement=True, generator=generator)
        return self.points[index]

    def hpd(self, level):
        """The HPD region holding `level` of the mass: its score threshold, attained mass and per-axis bounds."""
        if level in self.levels:
            i = self.levels.index(level)
            summary = self._summary
        else:
            summary = inference.hld_summaries(self.scores[None], self.log_measure, self.points, self.scores[:1],
                                              [level])
            i = 0
        return {"level": float(level), "threshold": float(summary["threshold"][0, i]),
                "mass": float(summary["mass"][0, i]), "lower": summary["lower"][0, i].tolist(),
                "upper": summary["upper"][0, i].tolist()}

    def mode(self):
        """The densest point scored (p,): a candidate, or a probe of the bounds where one was denser."""
        return torch.as_tensor(self._summary["mode"][0], dtype=torch.float64)

    def mean(self):
        """The posterior mean (p,)."""
        return self.masses @ self.points

    def cov(self):
        """The posterior covariance (p, p)."""
        centred = self.points - self.mean()
        return (self.masses[:, None] * centred).T @ centred

    def summary(self, levels=None):
        """A JSON-able summary: mode, mean, sd and HPD bounds per level, with the effective sample size."""
        return {"parameters": self.names, "mode": self.mode().tolist(), "mean": self.mean().tolist(),
                "sd": torch.sqrt(torch.diagonal(self.cov())).tolist(), "ess": self.ess,
                "candidates": int(self.points.shape[0]),
                "hpd": {inference.level_key(level): self.hpd(level) for level in (levels or self.levels)}}

    def draw_corner(self, figure, samples, truth=None):
        """Marginals on the diagonal, pairwise sample densities below it, HPD bounds and the truth if given."""
        draw_corner(figure, self, np.asarray(samples), None if truth is None else np.asarray(truth, dtype=float))


def observation_ensemble(observations, dimension):
    """An observation as an ensemble (m, d) float64, or a PosteriorError naming the expected shapes."""
    x = torch.as_tensor(np.asarray(observations, dtype=np.float64))
    if x.dim() == 1:
        x = x[None]
    if x.dim() != 2 or x.shape[1] != dimension or x.shape[0] == 0 or not bool(torch.isfinite(x).all()):
        raise PosteriorError(f"observations of shape {tuple(np.shape(observations))}: expected finite numbers of "
                             f"shape ({dimension},) for one observation or (m, {dimension}) for m of them")
    return x


def host_scores(scoring):
    """The scores of a one-case Scoring as a function of points (n, p), returning host tensors."""
    def score_fn(points):
        scored = scoring.scores(torch.zeros(1, dtype=torch.long), points.to(scoring.device)[None])
        return {target: values[0].cpu() for target, values in scored.items()}

    return score_fn


def for_observation(problem, prior, model, analysis_settings, observations, seed, truth=None, device="cpu", case=0):
    """The posterior of `model` (a member's trained network) for an observation (see the module's docstring).

    `seed` is the training settings' seed, from which the analysis derives its designs;
    `case` picks the refinement's stream, so a case's index, observations and truth give
    that case's design. Without a truth, the box's centre stands in (it changes nothing
    but the truth-only fields of the analysis' summary).
    """
    # Every key the analysis settings leave out (all of them for a run never analysed) takes its default.
    settings = check_inference_settings((analysis_settings or {}).get("inference", {}), problem.parameter_count,
                                        callable(getattr(problem, "log_likelihood", None)))
    x = observation_ensemble(observations, problem.dimension)
    candidates = dict(settings["candidates"])
    if any(step is not None for step in prior.lattice_steps):
        candidates["native_grid_prior"] = True      # a lattice prior has no density between its points
    p = problem.parameter_count
    lattice = inference.candidate_lattice(prior.lattice_steps, p, candidates)
    targets = [t for t in ("ratio", "posterior") if t in settings["targets"]]
    targets = targets if "posterior" in targets else ["posterior"]
    score_fn = host_scores(learned_scoring(model, torch.device(device), prior, x[None], targets, settings,
                                           inference.Evaluations()))
    truth = (problem.low + problem.high) / 2 if truth is None else torch.as_tensor(truth, dtype=torch.float64)
    with torch.no_grad():
        points, log_measure = inference.make_candidates(problem.low, problem.high, lattice, candidates,
                                                        runtime.derived_seed(seed, "candidates"))
        design = inference.candidate_design(p, lattice, problem.low, problem.high, candidates)
        if design == "adaptive":
            box = adaptive.support_box(problem.low, problem.high, lattice)
            sizes = inference.adaptive_sizes(p, candidates, len(targets))
            result = adaptive.refine_case(score_fn, points, log_measure, truth, box, settings["levels"], sizes,
                                           runtime.derived_seed(seed, "refine"), case=case)
            points, log_measure = result["points"], result["log_measure"]
            scores, summary = result["scores"]["posterior"][:-1], result["summaries"]["posterior"]
        else:   # as the analysis scores a fixed design: the truth in the same call
            scored = score_fn(torch.cat([points, truth[None]]))["posterior"]
            scores = scored[:-1]
            summary = inference.hld_summaries(scores[None], log_measure, points, scored[-1:], settings["levels"])
    if not bool(torch.isfinite(scores).any()):
        raise PosteriorError("the posterior is zero on every candidate: the observation is impossible under "
                             "the prior and the trained model")
    return Posterior(problem.names, lambda theta: score_fn(theta)["posterior"], points, log_measure, scores,
                     summary, settings["levels"], enumerated=design == "enumerate")


def draw_corner(figure, posterior, samples, truth):
    """The corner plot of `Posterior.draw_corner`."""
    p = len(posterior.names)
    axes = figure.subplots(p, p, squeeze=False)
    levels = sorted(posterior.levels)
    for i in range(p):
        for j in range(p):
            axis = axes[i][j]
            if j > i:
                axis.set_visible(False)
                continue
            if i == j:
                axis.hist(samples[:, i], bins=40, density=True, color="tab:blue", alpha=0.6, label="samples")
                for level, style in zip(levels, ("-", "--", ":")):
                    region = posterior.hpd(level)
                    for bound in (region["lower"][i], region["upper"][i]):
                        axis.axvline(bound, color="tab:orange", linestyle=style,
                                     label=f"{level:g} HPD bounds" if bound == region["lower"][i] else None)
                axis.set_title(posterior.names[i], fontsize="small")
                axis.set_ylabel("posterior density")
            else:
                axis.hist2d(samples[:, j], samples[:, i], bins=40, cmap="Blues")
                axis.set_ylabel(posterior.names[i])
            if truth is not None:
                axis.axvline(truth[j], color="tab:red", linewidth=1, label="truth" if i == j else None)
                if i != j:
                    axis.axhline(truth[i], color="tab:red", linewidth=1)
                    axis.plot(truth[j], truth[i], "o", color="tab:red", markersize=4)
            axis.set_xlabel(posterior.names[j])
    axes[0][0].legend(fontsize="x-small")
    figure.suptitle(f"Posterior for the observation\n{len(samples)} samples, {posterior.ess:.0f} effective candidates",
                    fontsize="medium")
