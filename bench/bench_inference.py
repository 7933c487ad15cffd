"""Ensemble-score evaluation rate against a plain batched forward pass of the same rows.

Both evaluate the default study's network (mlp [64]*4, input width 2) on
candidates × observations rows, side by side in one run, alternating. Here the rows are
built on the device; bench_analysis.py measures a job's whole analysis as a study runs it.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import case_scores  # noqa: E402
import networks  # noqa: E402
import runtime  # noqa: E402


def plain_forward(model, rows, batch):
    """A plain batched forward pass over pre-built rows."""
    total = torch.zeros((), device=rows.device)
    for chunk in rows.split(batch):
        total += model(chunk).sum()
    return total.item()  # waits for the device, so both timings include the whole computation


def main():
    """Print evaluations per second of both and their ratio (target >= 0.9)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--candidates", type=int, default=16_385)
    parser.add_argument("--observations", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    arguments = parser.parse_args()
    device = torch.device(arguments.device)
    runtime.start({"device": arguments.device, "cpu_threads": 1, "deterministic": False})  # as nnpd runs analyses
    torch.manual_seed(0)
    model = networks.build_network({"kind": "mlp", "hidden": [64] * 4, "activation": "relu", "dropout": 0.0}, 2)
    model.to(device).eval()
    observations = torch.randn(arguments.observations, 1, dtype=torch.float64, device=device) + 5
    points = torch.rand(arguments.candidates, 1, dtype=torch.float64, device=device) * 10
    rows = torch.randn(arguments.candidates * arguments.observations, 2, device=device)
    evaluations = rows.shape[0]
    timings = {"ensemble_scores": [], "plain forward": []}
    # Both at the rows per network call the analysis uses on this device.
    per_call = case_scores.call_policy(device.type, 1 << 24, case_scores.network_row_bytes(model, 2)).rows_per_call
    runs = {
        "ensemble_scores": lambda: case_scores.ensemble_scores(model, observations, points, per_call).sum().item(),
        "plain forward": lambda: plain_forward(model, rows, per_call),
    }
    with torch.no_grad():
        for run in runs.values():  # warm-up, untimed
            run()
        for repeat in range(arguments.repeats):
            # Alternate which goes first, so a drift of the machine's speed favours neither.
            for name in list(runs) if repeat % 2 == 0 else list(runs)[::-1]:
                started = time.perf_counter()
                runs[name]()
                timings[name].append(time.perf_counter() - started)
    rates = {name: evaluations / min(values) for name, values in timings.items()}
    for name, rate in rates.items():
        print(f"{name:16s} {rate / 1e6:8.2f} M evaluations/s (best of {arguments.repeats})")
    paired = sorted(p / e for e, p in zip(timings["ensemble_scores"], timings["plain forward"]))
    print(
        f"ratio ensemble_scores / plain forward: best-of {rates['ensemble_scores'] / rates['plain forward']:.2f}, "
        f"median of pairs {paired[len(paired) // 2]:.2f} (target >= 0.9)"
    )
    # One line for bench/gpu_checks.sh's summary table.
    print(
        f"figure: ensemble_scores {rates['ensemble_scores'] / 1e6:.3g} M/s, plain forward "
        f"{rates['plain forward'] / 1e6:.3g} M/s, ratio {rates['ensemble_scores'] / rates['plain forward']:.2f}"
    )


if __name__ == "__main__":
    main()
