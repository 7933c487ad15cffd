"""The resumable training state: what one rank's training holds, what a saved state file
contains, the checks a loaded file must pass, and how it is applied.

Apart from the loop (trainer.py) because the saved layout is a contract of its own: files
written by one launch are read by the next (under DDP one file restores every rank), and
every way a file can fail to fit this training is named here, so the trainer only asks
whether and how to resume.
"""

from __future__ import annotations

import hashlib
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import torch

import runtime
from settings import is_integer

__all__ = [
    "Optimizer",
    "cpu_copy",
    "TrainingState",
    "state_identity",
    "global_rng",
    "set_global_rng",
    "saved_state",
    "state_problem",
    "apply_saved_state",
    "first_problem",
    "one_line",
]

# Written into every saved state; a state of another format is ignored, never misread.
STATE_FORMAT = "nnpd-training-state-1"


# ---------------------------------------------------------------- training state


def cpu_copy(value):
    """A deep copy with every tensor copied to the CPU: safe to keep while training goes on."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: cpu_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(item) for item in value)
    return value


class Optimizer(Protocol):
    """What a training state holds of its optimizer: trainer.FunctionalAdam, or torch.optim's Adam/AdamW."""

    param_groups: list[dict[str, Any]]

    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def step(self) -> Any: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class TrainingState:
    """All mutable training state of one rank in one place: saved and resumed as a whole."""

    model: torch.nn.Module
    optimizer: Optimizer  # a FunctionalAdam, or torch.optim's Adam/AdamW under float16's gradient scaler
    scaler: torch.amp.GradScaler
    generator: torch.Generator
    epoch: int = 0
    position: int = 0
    # Generator state before the current epoch's permutation, so a resume redraws it.
    epoch_rng: torch.Tensor | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # The training's seed: joint pairs draw each batch's atoms from it (contrast.batch_atoms).
    seed: int = 0
    # This rank's per-batch loss sums (and clipped gradient norms) of the epoch in progress.
    batch_losses: torch.Tensor | None = None
    norms: torch.Tensor | None = None
    history: dict = field(default_factory=dict)
    # The lowest validation value so far of the selection criterion (training.selection): the
    # BCE or the objective. Saved states keep its earlier name, "best_bce", so theirs still resume.
    best_loss: float = math.inf
    best_weights: dict | None = None

    def state_dict(self) -> dict:
        """Everything needed to continue training exactly where it stopped, as CPU copies."""
        return cpu_copy(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "generator": self.generator.get_state(),
                "epoch_rng": self.epoch_rng,
                "epoch": self.epoch,
                "position": self.position,
                "batch_losses": self.batch_losses,
                "norms": self.norms,
                "history": self.history,
                "best_bce": self.best_loss,
                "best_weights": self.best_weights,
            }
        )

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved (copying, so `state` can be reused)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(cpu_copy(state["optimizer"]))
        self.scaler.load_state_dict(state["scaler"])
        self.generator.set_state(state["generator"])
        self.epoch_rng = state["epoch_rng"]
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.batch_losses, self.norms = (
            None if t is None else t.to(self.device, copy=True) for t in (state["batch_losses"], state["norms"])
        )
        self.history = cpu_copy(state["history"])
        self.best_loss = float(state["best_bce"])
        self.best_weights = cpu_copy(state["best_weights"])

    def permutation(self, rows: int) -> torch.Tensor:
        """This epoch's permutation; identical on every rank and redrawn identically on resume."""
        if self.position == 0 or self.epoch_rng is None:
            self.epoch_rng = self.generator.get_state()
        else:
            self.generator.set_state(self.epoch_rng)
        return torch.randperm(rows, generator=self.generator)


# ---------------------------------------------------------------- saved states


_FILE_KEYS = {"format", "save_id", "identity", "state", "ranks"}
_SHARED_KEYS = {
    "model",
    "optimizer",
    "scaler",
    "generator",
    "epoch_rng",
    "epoch",
    "position",
    "norms",
    "history",
    "best_bce",
    "best_weights",
}
_IDENTITY_PHRASES = {
    "world_size": "it was saved by a launch with another number of training ranks",
    "settings": "its training settings differ",
    "seed": "its training seed differs",
    "data": "its training or validation data differ",
}


def state_identity(settings: Mapping[str, Any], seed: int, rt: runtime.Runtime, tensors) -> dict:
    """What a saved state must share with this training to continue it."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().to("cpu").contiguous().numpy())
    return {"world_size": rt.train_world_size, "settings": settings, "seed": seed, "data": digest.hexdigest()}


def global_rng(device: torch.device) -> dict:
    """This process's global torch streams: dropout draws from them."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_global_rng(streams: dict, device: torch.device) -> None:
    """Put back what `global_rng` returned."""
    torch.set_rng_state(streams["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(streams["cuda"], device)


def saved_state(state: TrainingState, rt: runtime.Runtime, identity: dict) -> dict | None:
    """One file's worth of state on the worker that writes it (None on the other DDP ranks).

    The shared parts once, and every rank's own parts.
    """
    own = {"rng": global_rng(rt.device), "batch_losses": cpu_copy(state.batch_losses)}
    # A collective: every rank gets here at the same step, so one file restores every rank.
    ranks = runtime.all_gather_object(rt, own) if rt.ddp else [own]
    if not rt.leads_training:
        return None
    shared = state.state_dict()
    del shared["batch_losses"]
    return {"format": STATE_FORMAT, "save_id": uuid.uuid4().hex, "identity": identity, "state": shared, "ranks": ranks}


def _shapes(tensors: dict) -> dict:
    """Name -> (shape, dtype) of a state dict."""
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


def _tensors_problem(shared: dict, state: TrainingState) -> str | None:
    """Why the saved weights or optimizer state do not fit this model (None when they do)."""
    live = _shapes(state.model.state_dict())
    if _shapes(shared["model"]) != live:
        return "the model's parameter names or shapes differ"
    if shared["best_weights"] is not None and _shapes(shared["best_weights"]) != live:
        return "the kept best weights do not fit the model"
    groups = state.optimizer.param_groups
    if [len(g["params"]) for g in shared["optimizer"]["param_groups"]] != [len(g["params"]) for g in groups]:
        return "the optimizer's parameter groups differ"
    params = [p for group in groups for p in group["params"]]
    for index, entry in shared["optimizer"]["state"].items():
        shapes = {tuple(v.shape) for v in entry.values() if isinstance(v, torch.Tensor) and v.ndim > 0}
        if not 0 <= index < len(params) or shapes - {tuple(params[index].shape)}:
            return "the optimizer state's shapes differ from the parameters'"
    return None


def _progress_problem(saved: dict, epochs: int, n_batches: int, world_size: int) -> str | None:
    """Why the saved progress, history or per-rank parts are inconsistent (None when they are not)."""
    shared = saved["state"]
    epoch, position = shared["epoch"], shared["position"]
    if not (is_integer(epoch) and is_integer(position) and 0 <= epoch <= epochs and 0 <= position <= n_batches) or (
        epoch == epochs and position
    ):
        return (
            f"its progress (epoch index {epoch}, batch {position}) does not fit {epochs} epochs of {n_batches} batches"
        )
    history = shared["history"]
    if any(
        len(history.get(name, ())) != epoch
        for name in ("train_loss", "validation", "validation_objective", "validation_balance")
    ):
        return "its history does not match its progress"
    ranks, ongoing = saved["ranks"], position > 0
    if len(ranks) != world_size:
        return f"it holds {len(ranks)} ranks' streams for {world_size} ranks"
    per_batch = [part["batch_losses"] for part in ranks] + [shared["norms"]]
    if ongoing and any(t is not None and tuple(t.shape) != (n_batches,) for t in per_batch):
        return "its per-batch records do not fit the epoch"
    if ongoing and any(t is None for t in per_batch[:-1]):
        return "it lacks a rank's per-batch losses"
    return None


def state_problem(saved, state: TrainingState, identity: dict, n_batches: int) -> str | None:
    """Why a loaded state cannot continue this training (None when it can)."""
    found = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
    if found != STATE_FORMAT:
        return f"its format is {found!r}, not {STATE_FORMAT!r}"
    if set(saved) != _FILE_KEYS or not isinstance(saved["state"], dict) or set(saved["state"]) != _SHARED_KEYS:
        return "its keys are not those of a training state"
    for key, value in identity.items():
        if saved["identity"].get(key) != value:
            return _IDENTITY_PHRASES[key]
    epochs = identity["settings"]["epochs"]
    return _tensors_problem(saved["state"], state) or _progress_problem(
        saved, epochs, n_batches, identity["world_size"]
    )


def apply_saved_state(saved: dict, state: TrainingState, rt: runtime.Runtime) -> None:
    """Load the shared parts and this rank's own streams and losses."""
    own = saved["ranks"][rt.rank if rt.ddp else 0]
    state.load_state_dict({**saved["state"], "batch_losses": own["batch_losses"]})
    set_global_rng(own["rng"], rt.device)


def first_problem(reports: list) -> str | None:
    """The first reason, over ranks' (found, problem, save id) reports, not to resume (None: resume)."""
    several = len(reports) > 1
    for rank, (found, problem, _) in enumerate(reports):
        if problem is not None:
            return f"rank {rank}: {problem}" if several else problem
        if not found:
            return f"rank {rank} found no saved state"
    if len({save_id for _, _, save_id in reports}) > 1:
        return "the ranks loaded different saved states"
    return None


def one_line(error: Exception) -> str:
    """An exception as one short line."""
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."
