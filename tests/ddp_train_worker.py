"""torchrun worker: DDP training of a small MLP (Gloo on CPU); rank 0 saves what the test checks.

Usage: ddp_train_worker.py OUTPUT_FILE MODE ROWS BATCH EPOCHS DEVICE [ARGUMENT...]
  train                 the BCE objective at batch BATCH and the balanced one at BALANCED_BATCH
  joint                 joint pairs re-paired in every batch: BCE at BATCH, contrastive at BALANCED_BATCH
  fail                  rank 1 raises after a few batches
  preempt DIR STEP...   the uninterrupted resumable recipe, then one run per STEP whose rank 1
                        asks to stop after STEP steps, saving at every flag exchange to
                        DIR/stop-STEP.pt (exchanging after every step unless STEP is "~N")
  resume FILE...        continue the resumable recipe from each saved state; a FILE prefixed
                        with "rank0:" is offered to rank 0 only
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import runtime  # noqa: E402
import trainer  # noqa: E402

SEED = 7
BALANCED_BATCH = 5  # with 41 rows: shards of 3 and 2, then a last batch of one row (rank 1 empty)
RESUMABLE = {
    "batch_size": 5,
    "learning_rate": 0.05,
    "gradient_clip": 1.0,
    "objective": "balanced",
    "balance_weight": 2.0,
    "checkpoint": "best",
}


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


def make_model(seed: int = SEED, dropout: float = 0.0) -> torch.nn.Module:
    """A small MLP returning one logit per row, initialised from `seed`."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 16),
        torch.nn.Tanh(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 1),
        torch.nn.Flatten(0),
    )


def objective_settings(batch: int, epochs: int) -> dict:
    """The two recipes the `train` mode compares with one process: BCE and balanced."""
    common = {"epochs": epochs, "learning_rate": 0.05, "checkpoint": "last"}
    return {
        "bce": {**common, "batch_size": batch},
        "balanced": {**common, "batch_size": BALANCED_BATCH, "objective": "balanced", "balance_weight": 3.0},
    }


def make_joint_data(rows: int, seed: int = SEED) -> dict:
    """Joint simulations (x (rows, 2), θ (rows, 1)): x scattered about θ, for re-pairing in every batch."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(rows + 40, 1, generator=g) * 4 - 2
    x = torch.cat([theta, -theta], 1) + 0.5 * torch.randn(rows + 40, 2, generator=g)
    return {
        "train_x": x[:rows],
        "train_theta": theta[:rows],
        "validation_x": x[rows:],
        "validation_theta": theta[rows:],
    }


def joint_settings(batch: int, epochs: int) -> dict:
    """The recipes of the `joint` mode: BCE on re-paired batches, and contrastive NRE with three atoms."""
    common = {"epochs": epochs, "learning_rate": 0.02, "checkpoint": "last"}
    return {
        "bce": {**common, "batch_size": batch},
        "contrastive": {**common, "batch_size": BALANCED_BATCH, "objective": "contrastive", "classes": 3, "gamma": 2.0},
    }


def save_atomically(state: dict, path: str) -> None:
    """Write to a temporary file, fsync, then rename over the target."""
    with open(f"{path}.tmp", "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(f"{path}.tmp", path)


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


def train_objectives(rt, rows, batch, epochs, joint=False) -> dict:
    """Both objectives' weights and histories, on fixed pairs or on joint ones."""
    results = {}
    recipes, data = (joint_settings, make_joint_data) if joint else (objective_settings, make_data)
    for name, settings in recipes(batch, epochs).items():
        weights, history = trainer.train(make_model(), data(rows), settings, rt, seed=SEED)
        results[name] = {"weights": weights, "history": history}
    return results


def stop_request_on_rank_one(rt, after: int):
    """A stop_requested hook: rank 1 asks from its `after`-th poll on, rank 0 never does."""
    polls = [0]

    def requested() -> bool:
        """Count the poll; rank 1 answers True once enough steps ran."""
        polls[0] += 1
        return rt.rank == 1 and polls[0] >= after

    return requested


def preempt(rt, rows, epochs, directory, steps) -> dict:
    """The uninterrupted reference, then a stopped run per step; every rank's Preempted fields.

    A step written "~N" keeps the trainer's adaptive flag exchange; the others exchange
    flags after every step, so the stop lands at a step the test can predict.
    """
    settings = {**RESUMABLE, "epochs": epochs}
    weights, history = trainer.train(make_model(dropout=0.2), make_data(rows), settings, rt, seed=SEED)
    adaptive, stops = trainer.FLAG_EXCHANGE_SECONDS, {}
    for step in steps:
        path = os.path.join(directory, f"stop-{step}.pt")
        trainer.FLAG_EXCHANGE_SECONDS = adaptive if step.startswith("~") else 0.0
        hooks = trainer.TrainingHooks(
            save_state=lambda state, path=path: save_atomically(state, path),
            save_seconds=1e-9,
            stop_requested=stop_request_on_rank_one(rt, int(step.lstrip("~"))),
        )
        try:
            trainer.train(make_model(dropout=0.2), make_data(rows), settings, rt, seed=SEED, hooks=hooks)
            stopped = None
        except trainer.Preempted as error:
            stopped = (error.epoch, error.batch, error.saved)
        stops[step] = runtime.all_gather_object(rt, stopped)
    return {"reference": {"weights": weights, "history": history}, "stops": stops}


def resume(rt, rows, epochs, files) -> dict:
    """Continue the resumable recipe from each file (offered to rank 0 only after "rank0:")."""
    results = {}
    for name in files:
        path = name.removeprefix("rank0:")
        offered = rt.is_main or path == name
        resumed = []
        hooks = trainer.TrainingHooks(
            load_state=lambda: torch.load(path, weights_only=True) if offered else None,
            on_resume=lambda epoch, batch: resumed.append((epoch, batch)),
        )
        weights, history = trainer.train(
            make_model(dropout=0.2), make_data(rows), {**RESUMABLE, "epochs": epochs}, rt, seed=SEED, hooks=hooks
        )
        results[name] = {"weights": weights, "history": history, "resumed": resumed}
    return results


def run_mode(rt, mode, rows, batch, epochs, arguments):
    """The mode's result (rank 0's is saved)."""
    if mode in ("train", "joint"):
        return train_objectives(rt, rows, batch, epochs, joint=mode == "joint")
    if mode == "preempt":
        return preempt(rt, rows, epochs, arguments[0], arguments[1:])
    if mode == "resume":
        return resume(rt, rows, epochs, arguments)
    settings = {"epochs": epochs, "batch_size": batch, "learning_rate": 0.05, "checkpoint": "last"}
    trainer.train(FailOnRank(make_model(), rt.rank, after=3), make_data(rows), settings, rt, seed=SEED)
    raise AssertionError("the failing rank did not fail")


def main() -> None:
    """Run the mode under the torchrun launch and save rank 0's result."""
    output, mode, rows, batch, epochs = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
    rt = runtime.start({"device": device, "parallel": "ddp"})
    try:
        result = run_mode(rt, mode, rows, batch, epochs, sys.argv[7:])
        if rt.is_main:
            torch.save({"result": result, "identity": runtime.backend_identity(rt)}, output)
        runtime.barrier(rt)
    finally:
        runtime.stop(rt)
        check_group_ended(rt)


def gloo_threads() -> list:
    """Names of this process's Gloo threads (none where /proc is missing)."""
    names = []
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{task}/comm") as handle:
                names.append(handle.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(name for name in names if "gloo" in name)


def check_group_ended(rt) -> None:
    """Fail the launch when runtime.stop left Gloo threads running.

    Left to interpreter exit, such a thread aborts the process if it frees a tensor then
    ("terminate called without an active exception"), which happens only now and then;
    threads left running are seen every time.
    """
    deadline = time.monotonic() + 5  # a thread of a destroyed group may take a moment to end
    while (left := gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        raise RuntimeError(f"rank {rt.rank}: the process group's Gloo threads outlived runtime.stop: {left}")


if __name__ == "__main__":
    main()
