"""torchrun worker: CPU Gloo DDP training of a small MLP; rank 0 saves weights and history.

Usage: ddp_train_worker.py OUTPUT_FILE {train,fail} ROWS BATCH EPOCHS [DEVICE]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import runtime  # noqa: E402
import trainer  # noqa: E402

SEED = 7


def make_data(rows: int, seed: int = SEED) -> dict:
    """A small, deterministic binary classification problem."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows + 40, 3, generator=g)
    y = (x[:, 0] - 0.7 * x[:, 1] + 0.3 * torch.randn(rows + 40, generator=g) > 0).float()
    return {
        "train_inputs": x[:rows],
        "train_labels": y[:rows],
        "validation_inputs": x[rows:],
        "validation_labels": y[rows:],
    }


def make_model(seed: int = SEED) -> torch.nn.Module:
    """A small MLP returning one logit per row, initialised from `seed`."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 1), torch.nn.Flatten(0),
    )


class FailOnRank(torch.nn.Module):
    """Wraps a model so one rank raises after a few forward passes (a crash mid-training)."""

    def __init__(self, inner, rank, after):
        super().__init__()
        self.inner, self.rank, self.after, self.calls = inner, rank, after, 0

    def forward(self, x):
        """Delegate, or raise on the failing rank once enough batches ran."""
        self.calls += 1
        if self.rank == 1 and self.calls > self.after:
            raise RuntimeError("injected failure on rank 1")
        return self.inner(x)


def main() -> None:
    """Train under the torchrun launch and save rank 0's result."""
    output, mode, rows, batch, epochs = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
    rt = runtime.start({"device": device, "parallel": "ddp"})
    try:
        model = make_model()
        if mode == "fail":
            model = FailOnRank(model, rt.rank, after=3)
        settings = {"epochs": epochs, "batch_size": batch, "learning_rate": 0.05, "checkpoint": "last"}
        weights, history = trainer.train(model, make_data(rows), settings, rt, seed=SEED)
        if rt.is_main:
            torch.save({"weights": weights, "history": history, "identity": runtime.backend_identity(rt)}, output)
        runtime.barrier(rt)
    finally:
        runtime.stop(rt)


if __name__ == "__main__":
    main()
