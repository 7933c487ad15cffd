"""The posterior sampler against importance resampling: C2ST to exact draws, and what a sample costs.

First table: the two exact-likelihood posteriors of tests/test_sampler.py (a ten-parameter
linear Gaussian, a five-parameter posterior with four modes), each sampled by
Posterior.sample and by the old resampling of the weighted candidates, scored by C2ST
against exact i.i.d. draws; a second set of exact draws gives the test's own noise level.
Second table: CPU seconds per observation on the bundled study, the default profile's
design (10,240 adaptive candidates, 15 observations), with a network of the default
profile's size (4 × 64 ReLU) whose output is added, times 1e-9, to the exact logit: the
network's cost with the exact posterior's shape. One thread throughout. About three minutes.

    python bench/bench_sampler.py
    python bench/bench_sampler.py --draws 4000 --dimensions 1 6
"""

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_sampler  # noqa: E402
from test_posterior import OBSERVATIONS, ExactLogit  # noqa: E402
from test_resolution import study_problem  # noqa: E402

import networks  # noqa: E402
import posterior as post  # noqa: E402
import priors  # noqa: E402
import settings_analysis  # noqa: E402
from c2st import c2st  # noqa: E402


class CostlyExactLogit(ExactLogit):
    """The exact logit, plus a default-sized network's output times 1e-9: the network's cost, the exact shape."""

    def __init__(self, problem):
        super().__init__(problem)
        width = problem.dimension + problem.parameter_count
        self.network = networks.build_network({"kind": "mlp", "hidden": [64] * 4, "activation": "relu"}, width)

    def forward(self, rows):
        return super().forward(rows) + 1e-9 * self.network(rows.float()).reshape(-1)


def c2st_rows(draws):
    """One row per problem and sampler: C2ST to exact draws, distinct draws and the sampler's CPU seconds."""
    problems = {
        "linear Gaussian, p = 10": (test_sampler.gaussian_posterior, test_sampler.gaussian_reference),
        "four modes, p = 5": (test_sampler.four_mode_posterior, test_sampler.four_mode_reference),
    }
    print(f"C2ST to {draws} exact draws (0.5: indistinguishable)")
    print(f"{'problem':<26}{'sampler':<22}{'C2ST':>7}{'distinct':>10}{'CPU s':>8}{'C2ST s':>8}")
    for name, (build, reference) in problems.items():
        posterior, exact = build(), reference(draws, seed=5)
        for label, sample in (
            ("Posterior.sample", lambda: posterior.sample(draws, seed=0)),
            ("old resampling", lambda: test_sampler.old_resampling(posterior, draws)),
            ("exact (noise level)", lambda: reference(draws, seed=6)),
        ):
            started = time.process_time()
            drawn = sample()
            cost = time.process_time() - started
            started = time.process_time()
            score = c2st(drawn, exact)
            print(
                f"{name:<26}{label:<22}{score:>7.3f}{torch.unique(drawn, dim=0).shape[0]:>10}{cost:>8.2f}"
                f"{time.process_time() - started:>8.2f}"
            )
        print(
            f"{'':<26}(candidates' ESS {posterior.ess:.0f}; sampler: {posterior.sampling['method']}, "
            f"acceptance {posterior.sampling['acceptance']:.3f}, "
            f"{posterior.sampling['evaluations']} evaluations, mixture of {posterior.sampling['components']})"
        )


def timing_rows(dimensions, draws):
    """CPU seconds per observation of the bundled study: the posterior, then each sampler's draws."""
    print(f"\nCPU seconds per observation, {draws} draws (bundled study, default design, 4 x 64 network)")
    print(f"{'d':>2}{'posterior':>11}{'old':>8}{'sampler':>9}{'acceptance':>12}{'evaluations':>13}{'ESS':>8}")
    analysis = settings_analysis.make_settings("default")
    for d in dimensions:
        problem = study_problem(d)
        prior = priors.make_prior(problem, {"family": "uniform"})
        truth = torch.full((d,), 4.0, dtype=torch.float64)
        x = problem.simulate(truth.expand(OBSERVATIONS, -1), torch.Generator().manual_seed(7))
        started = time.process_time()
        posterior = post.for_observation(post.Learned(problem, prior, CostlyExactLogit(problem), analysis, 1), x)
        built = time.process_time() - started
        started = time.process_time()
        test_sampler.old_resampling(posterior, draws)
        old = time.process_time() - started
        started = time.process_time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the sampling dict says what a warning would
            posterior.sample(draws, seed=0)
        info = posterior.sampling
        print(
            f"{d:>2}{built:>11.2f}{old:>8.3f}{time.process_time() - started:>9.2f}{info['acceptance']:>12.3f}"
            f"{info['evaluations']:>13}{posterior.ess:>8.0f}  {info['method']}"
        )


def main():
    """Both tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=10_000)
    parser.add_argument("--dimensions", type=int, nargs="*", default=[1, 3, 6])
    args = parser.parse_args()
    torch.set_num_threads(1)
    c2st_rows(args.draws)
    timing_rows(args.dimensions, args.draws)


if __name__ == "__main__":
    main()
