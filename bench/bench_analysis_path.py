"""The analysis path's model evaluation rate against a plain forward pass on device-resident rows.

bench_inference.py builds its rows on the device. A study's analysis does not: its
observations and candidates live on the host, nre_analysis.learned_case_scores wraps
the network so that inference.ensemble_scores copies every block of at most
inference.EVAL_BLOCK_ROWS rows to the device and the logits back (a host wait per block),
and each case is refined and summarised on the host (inference.refine_case for the
adaptive design, inference.hld_summaries for a fixed one). This bench runs that path
through the study's own drivers (nre_analysis.summarise_adaptive or
summarise_cases), on the network and settings of a bundled profile (mlp [64]*4, input
width 2 at dimension 1; freshly initialised: the rate depends on shapes, not weights),
and prints, side by side in one run and alternating:

  plain forward   the same number of rows, already on the device, in blocks of
                  EVAL_BLOCK_ROWS (what bench_inference calls "plain forward");
  case scoring    learned_case_scores alone on each case's candidate count of points
                  (host inputs, the copies and waits, no refinement);
  analysis path   the whole per-case analysis as a study runs it;

in model evaluations per second, with the ratios to the plain forward pass. Once the
analysis works on blocks of cases (a later change), the drivers it calls score those
blocks, so this bench measures them too.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere

import gaussian  # noqa: E402
import inference  # noqa: E402
import networks  # noqa: E402
import nre_analysis  # noqa: E402
import priors  # noqa: E402
import runtime  # noqa: E402
import settings  # noqa: E402
import settings_analysis  # noqa: E402
import settings_training  # noqa: E402
from bench_inference import plain_forward  # noqa: E402  (bench/ is on the path when run as a script)


class MemoryWriter:
    """The two writer calls the study's drivers make, kept in memory instead of a store."""

    def __init__(self):
        self.arrays = {}

    def allocate(self, key, shape, dtype):
        """A zeroed array the driver fills in place."""
        self.arrays[key] = np.zeros(shape, dtype)
        return self.arrays[key]

    def array(self, key, value):
        """Keep a finished array."""
        self.arrays[key] = np.asarray(value)


def profile_inputs(profile, dimension, cases):
    """The profile's problem, uniform prior, network settings, inference settings, truths and observations."""
    training = settings.resolve(settings_training.make_settings(profile))
    training["problem"]["dimension"] = dimension
    problem = gaussian.GaussianProblem.from_settings(training["problem"])
    prior = priors.make_prior(problem, training["priors"]["uniform"])
    analysis = settings_analysis.make_settings(profile)["inference"]
    truths = inference.make_truths(problem.low, problem.high, problem.grid_step, analysis["truths"], 1)[:cases]
    observations = inference.make_observations(problem.simulate, truths, analysis["observations"], 2)
    return problem, prior, training, analysis, truths.contiguous(), observations.contiguous()


class AnalysisPath:
    """One profile's analysis of `cases` cases with a model on a device, as the study runs it."""

    def __init__(self, device, profile, dimension, cases):
        problem, self.prior, training, self.settings, self.truths, self.observations = \
            profile_inputs(profile, dimension, cases)
        self.device = device
        self.input_size = problem.dimension + problem.parameter_count   # observation and inferred parameters
        torch.manual_seed(0)
        self.model = networks.build_network(training["model"], self.input_size).to(device).eval()
        self.targets = [t for t in ("ratio", "posterior") if t in self.settings["targets"]]
        candidates = self.settings["candidates"]
        lattice = inference.candidate_lattice(self.prior.lattice_steps, problem.parameter_count, candidates)
        self.design = inference.make_candidates(problem.low, problem.high, lattice, candidates, 3)
        self.adaptive = candidates["kind"] == "adaptive"
        if self.adaptive:
            self.sizes = inference.adaptive_sizes(problem.parameter_count, candidates, len(self.targets))
            self.box = inference.support_box(problem.low, problem.high, lattice)
        self.per_case = candidates["candidate_count"] if self.adaptive else self.design[0].shape[0]

    def case_scores(self, evaluations):
        """The study's own case_scores of the learned targets, counting rows into evaluations[0]."""
        return nre_analysis.learned_case_scores(self.model, self.device, self.prior, self.observations,
                                                  self.targets, self.settings["chunk_rows"], evaluations)

    def run(self):
        """Analyse every case through the study's driver; returns the model rows evaluated."""
        evaluations, writer = [0], MemoryWriter()
        scores, levels = self.case_scores(evaluations), self.settings["levels"]
        retain = {"mode": "diagnostic", "cases": 0}     # keep nothing: the bench times the work, not the store
        if self.adaptive:
            nre_analysis.summarise_adaptive(writer, self.targets, scores, self.truths, self.design, self.box,
                                              levels, retain, self.sizes, 4)
        else:
            points = self.design[0]
            nre_analysis.summarise_cases(writer, self.targets,
                                           lambda i: scores(i, torch.cat([points, self.truths[i:i + 1]])),
                                           self.truths, points, self.design[1], levels, retain)
        return evaluations[0]

    def score_only(self):
        """learned_case_scores alone on each case's candidate count of points; returns the rows evaluated."""
        evaluations = [0]
        scores = self.case_scores(evaluations)
        points = self.design[0].repeat(-(-self.per_case // self.design[0].shape[0]), 1)[:self.per_case]
        for case in range(self.truths.shape[0]):
            scores(case, points)
        return evaluations[0]


def forward_rows(model, rows):
    """bench_inference's plain forward pass over device-resident rows; returns the rows evaluated."""
    plain_forward(model, rows, inference.EVAL_BLOCK_ROWS)
    return rows.shape[0]


def timed(run):
    """Seconds one call of run() takes, and what it returns."""
    started = time.perf_counter()
    result = run()
    return time.perf_counter() - started, result


def measure(runs, repeats):
    """Alternate the runs `repeats` times after one untimed warm-up each; ({name: seconds}, {name: rows})."""
    with torch.no_grad():
        evaluations = {name: run() for name, run in runs.items()}
        seconds = {name: [] for name in runs}
        for repeat in range(repeats):
            # Alternate which goes first, so a drift of the machine's speed favours none.
            for name in (list(runs) if repeat % 2 == 0 else list(runs)[::-1]):
                elapsed, count = timed(runs[name])
                seconds[name].append(elapsed)
                evaluations[name] = count
    return seconds, evaluations


def report(seconds, evaluations, repeats):
    """Print each rate (best of the repeats) and its ratio to the plain forward pass."""
    rates = {name: evaluations[name] / min(values) for name, values in seconds.items()}
    for name, rate in rates.items():
        print(f"{name:14s} {rate / 1e6:9.3f} M evaluations/s  ({evaluations[name]:,} per run, best of {repeats})")
    for name in ("case scoring", "analysis path"):
        paired = sorted((evaluations[name] / a) / (evaluations["plain forward"] / f)
                        for a, f in zip(seconds[name], seconds["plain forward"]))
        print(f"ratio {name} / plain forward: best-of {rates[name] / rates['plain forward']:.3f}, "
              f"median of pairs {paired[len(paired) // 2]:.3f}")
    # One line for bench/gpu_checks.sh's summary table.
    print(f"figure: plain forward {rates['plain forward'] / 1e6:.3g} M/s, analysis path "
          f"{rates['analysis path'] / 1e6:.3g} M/s, ratio {rates['analysis path'] / rates['plain forward']:.3f}")
    return rates


def main(argv=None):
    """Build the network and the profile's cases, then time and print the three rates."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (as runtime.device)")
    parser.add_argument("--profile", default="default", choices=["default", "paper"],
                        help="default: adaptive candidates (refine_case); paper: a fixed Sobol design")
    parser.add_argument("--dimension", type=int, default=1, help="problem dimension (1: input width 2)")
    parser.add_argument("--cases", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    arguments = parser.parse_args(argv)
    training = settings.resolve(settings_training.make_settings(arguments.profile))
    # The analysis runs under the training's runtime section: one CPU thread, deterministic.
    rt = runtime.start(dict(training["runtime"], device=arguments.device, parallel="jobs"))
    try:
        path = AnalysisPath(rt.device, arguments.profile, arguments.dimension, arguments.cases)
        with torch.no_grad():
            rows = torch.randn(path.run(), path.input_size, device=rt.device)   # as many rows as the analysis
        print(f"device {rt.device}, profile {arguments.profile}, dimension {arguments.dimension}, "
              f"{path.truths.shape[0]} cases, {path.per_case:,} points per case, "
              f"{path.observations.shape[1]} observations, blocks of {inference.EVAL_BLOCK_ROWS} rows")
        runs = {"plain forward": lambda: forward_rows(path.model, rows),
                "case scoring": path.score_only,
                "analysis path": path.run}
        seconds, evaluations = measure(runs, arguments.repeats)
        return report(seconds, evaluations, arguments.repeats)
    finally:
        runtime.stop(rt)


if __name__ == "__main__":
    main()
