"""Benchmark: the bundled trainer vs a plain DataLoader loop doing the same maths, side by side.

Default size: 70,000 train rows of width 2, 15,000 validation rows, MLP [64, 64, 64, 64],
batch 128, 5 epochs, Adam. In one process: target the bundled trainer at least 1.3x faster.

Whole processes (--processes N, on by default): `nnpd.py train` of one default-size model
(dimension 1, one prior: sampling, training, validation, commits and all) against a
process running the plain loop on data of the same size, alternated. Target: the nnpd
process at most 0.8x the plain one's wall.
"""

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import analysis_metrics  # noqa: E402
import runtime  # noqa: E402
import trainer  # noqa: E402


def make_data(train_rows: int, validation_rows: int, width: int) -> dict:
    """Pairs-like rows with a noisy linear label rule."""
    g = torch.Generator().manual_seed(0)
    rows = train_rows + validation_rows
    x = torch.randn(rows, width, generator=g)
    y = (x.sum(1) + 0.5 * torch.randn(rows, generator=g) > 0).float()
    return {
        "train_inputs": x[:train_rows],
        "train_labels": y[:train_rows],
        "validation_inputs": x[train_rows:],
        "validation_labels": y[train_rows:],
    }


def make_model(width: int, hidden: list[int]) -> torch.nn.Module:
    """An MLP returning one logit per row, always initialised the same way."""
    torch.manual_seed(0)
    layers, size = [], width
    for h in hidden:
        layers += [torch.nn.Linear(size, h), torch.nn.ReLU()]
        size = h
    return torch.nn.Sequential(*layers, torch.nn.Linear(size, 1), torch.nn.Flatten(0))


def plain_loop(model, data, epochs, batch_size, lr) -> list[float]:
    """A typical hand-written loop: DataLoader shuffling, non-fused Adam, per-epoch validation."""
    loader = DataLoader(TensorDataset(data["train_inputs"], data["train_labels"]), batch_size=batch_size, shuffle=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
    losses = []
    for _ in range(epochs):
        model.train()
        total = 0.0
        for xb, yb in loader:
            loss = F.binary_cross_entropy_with_logits(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(xb)
        losses.append(total / len(loader.dataset))
        model.eval()
        with torch.no_grad():
            logits = model(data["validation_inputs"])
        analysis_metrics.classification_metrics(logits, data["validation_labels"])
    return losses


def plain_process(args) -> None:
    """What the plain whole process does: data, the plain loop, the weights saved."""
    torch.set_num_threads(args.threads)
    data = make_data(args.train_rows, args.validation_rows, 2)
    model = make_model(2, [64, 64, 64, 64])
    plain_loop(model, data, args.epochs, args.batch_size, 1e-3)
    torch.save(model.state_dict(), io.BytesIO())


def timed_process(command, cwd) -> float:
    """Seconds one whole process takes; fails loudly if it fails."""
    began = time.perf_counter()
    subprocess.run(command, cwd=cwd, check=True, capture_output=True)
    return time.perf_counter() - began


def whole_processes(repeats: int) -> None:
    """Print the wall of `nnpd.py train` (one default-size model) against the plain loop's process."""
    from bench_probes import one_model_settings  # the same one-model settings as the probes' cost

    plain = [sys.executable, os.path.abspath(__file__), "--plain-process"]
    times = {"nnpd train": [], "plain loop": []}
    with tempfile.TemporaryDirectory() as work:
        for index in range(repeats + 1):  # round 0 is an untimed warm-up of both
            settings = one_model_settings(Path(work, f"s{index}"), Path(work, f"out{index}"))
            nnpd = [
                sys.executable,
                str(REPO / "nnpd.py"),
                "train",
                "--profile",
                "default",
                "--settings-dir",
                str(settings),
            ]
            walls = {"nnpd train": timed_process(nnpd, work), "plain loop": timed_process(plain, work)}
            for name, wall in walls.items():
                if index:
                    times[name].append(wall)
    print(f"whole processes, {repeats} alternating rounds (one default-size model, 1 thread):")
    for name, walls in times.items():
        print(
            f"  {name:12s} best {min(walls):.2f} s  median {statistics.median(walls):.2f} s  "
            f"{[round(t, 2) for t in walls]}"
        )
    ratio = statistics.median(times["nnpd train"]) / statistics.median(times["plain loop"])
    print(f"nnpd / plain (medians): {ratio:.2f} (target <= 0.8) {'OK' if ratio <= 0.8 else 'ABOVE TARGET'}")


def main() -> None:
    """Time both loops alternately and print the ratio; then whole processes."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--train-rows", type=int, default=70_000)
    parser.add_argument("--validation-rows", type=int, default=15_000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="alternating rounds of each loop")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--processes", type=int, default=3, help="alternating rounds of whole processes (0: none)")
    parser.add_argument("--plain-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_process:
        plain_process(args)
        return

    torch.set_num_threads(args.threads)
    data = make_data(args.train_rows, args.validation_rows, 2)
    hidden = [64, 64, 64, 64]
    rt = runtime.Runtime(device=torch.device("cpu"), cpu_threads=args.threads, deterministic=False)
    settings = {"epochs": args.epochs, "batch_size": args.batch_size, "learning_rate": 1e-3, "checkpoint": "last"}
    # Untimed warm-up: the plain loop's first torch.optim optimizer imports torch._dynamo
    # (about 1 s; the bundled trainer's FunctionalAdam does not), a one-off cost of the
    # process that the whole-process comparison below counts and this one leaves out.
    small = make_data(512, 64, 2)
    trainer.train(make_model(2, hidden), small, {**settings, "epochs": 1}, rt, seed=0)
    plain_loop(make_model(2, hidden), small, 1, args.batch_size, 1e-3)
    times = {"bundled": [], "plain": []}
    for _ in range(args.repeats):
        began = time.perf_counter()
        _, history = trainer.train(make_model(2, hidden), data, settings, rt, seed=0)
        times["bundled"].append(time.perf_counter() - began)
        began = time.perf_counter()
        plain = plain_loop(make_model(2, hidden), data, args.epochs, args.batch_size, 1e-3)
        times["plain"].append(time.perf_counter() - began)
    bundled, baseline = min(times["bundled"]), min(times["plain"])
    print(f"rows={args.train_rows} epochs={args.epochs} batch={args.batch_size} mlp={hidden} threads={args.threads}")
    print(f"final train loss: bundled {history['train_loss'][-1]:.4f}  plain {plain[-1]:.4f}")
    print(f"bundled trainer: {bundled:.2f} s (best of {args.repeats})")
    print(f"plain DataLoader loop: {baseline:.2f} s (best of {args.repeats})")
    ratio = baseline / bundled
    print(f"speed-up: {ratio:.2f}x (target >= 1.3x) {'OK' if ratio >= 1.3 else 'BELOW TARGET'}")
    if args.processes:
        whole_processes(args.processes)


if __name__ == "__main__":
    main()
