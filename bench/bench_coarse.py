"""How sparse a coarse pass the adaptive design survives: the exact target against coarse_count.

For each (dimension, coarse_count) row, runs the exact target alone (no training) on the
bundled study's Sobol truths with an adaptive design and prints the projected 68% coverage
and width, the share of under-resolved cases (`resolution.flagged.any`), whether the
resolution warning fires, and what `plan` predicts from the settings alone: the expected
number of coarse points inside the 0.95 posterior region (E) and inside that region
doubled in radius (2^d·E), the quantity plan's coarse-pass warning checks
(nre_analysis.MIN_COARSE_NEIGHBOURS). The default rows take about five minutes.

    python bench/bench_coarse.py                          # d = 6: coarse_count 64 to 1024, then d = 1, 3 at 64
    python bench/bench_coarse.py --rows 4:32 4:64 --cases 256 --observations 60
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_resolution  # noqa: E402

import analysis_metrics  # noqa: E402
import designs  # noqa: E402
import nre_analysis  # noqa: E402

ROWS = ["6:64", "6:128", "6:256", "6:512", "6:1024", "1:64", "3:64"]


def row(p, coarse, candidate_count, stages, cases, observations):
    """One table row for the exact target at dimension p with an adaptive design of coarse_count `coarse`."""
    problem = bench_resolution.study_problem(p)
    truths = bench_resolution.bench_truths(problem, cases)
    observed = designs.make_observations(problem.simulate, truths, observations, 2)
    candidates = {
        "kind": "adaptive",
        "candidate_count": candidate_count,
        "coarse_count": coarse,
        "refinement_stages": stages,
    }

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        arrays, per_case = bench_resolution.summarise(
            problem, truths, observed, candidates, ["exact"], bench_resolution.exact_scoring(problem, observed), folder
        )
    summary = {f: arrays[f"exact_{f}"] for f in nre_analysis.SUMMARY_FIELDS}
    levels = bench_resolution.LEVELS
    coverage = analysis_metrics.coverage_metrics(summary, truths.numpy(), levels, problem.names)["0.68"]
    width = analysis_metrics.width_metrics(summary, levels, problem.names)["0.68"]["mean"]
    resolution = analysis_metrics.resolution_metrics(summary, per_case, levels, "adaptive")
    inside = coarse * nre_analysis.posterior_share(problem, [None] * p, observations)
    doubled = coarse * nre_analysis.posterior_share(problem, [None] * p, observations, nre_analysis.COARSE_REACH)
    flagged = resolution["flagged"]["any"]
    return (
        f"| {p} | {coarse} | {candidate_count} | {truths.shape[0]} | {inside:.3g} | {doubled:.3g} | "
        f"{coverage['mean']:.3f} | {width:.2f} | {flagged} ({flagged / truths.shape[0]:.1%}) | "
        f"{'yes' if resolution['warning'] else 'none'} | {time.perf_counter() - started:.0f} s |"
    )


def main():
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", default=ROWS, help="dimension:coarse_count pairs")
    parser.add_argument("--cases", type=int, default=256, help="truth cases per row")
    parser.add_argument("--candidate-count", type=int, default=16_384)
    parser.add_argument("--stages", type=int, default=3, help="refinement_stages (the base settings' 3)")
    parser.add_argument("--observations", type=int, default=15)
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| d | coarse_count | candidate_count | cases | E: coarse points in 0.95 region | 2^d·E | "
        "projected 68% | width 68% | under-resolved | resolution warning | time |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for spec in arguments.rows:
        p, coarse = map(int, spec.split(":"))
        print(
            row(p, coarse, arguments.candidate_count, arguments.stages, arguments.cases, arguments.observations),
            flush=True,
        )


if __name__ == "__main__":
    main()
