"""The bundled trainer: its settings, the training loop and train(): mixed precision, clipping,
checkpoints, the balanced and contrastive NRE objectives, early stopping.

The loop leans on three modules split from it, each holding one concern: ddp.py (global-batch
sharding and the DDP machinery), training_state.py (the resumable state and its saved file)
and training_hooks.py (the caller's hooks and the runner that calls them at agreed steps).
The names callers know stay reachable here as trainer.X (see the re-exports below).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, NamedTuple, TypedDict, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch.optim.adam import adam as adam_update
from torch.optim.adamw import adamw as adamw_update

import contrast
import ddp
import probes
import runtime
import training_hooks
import training_state
from analysis_metrics import classification_metrics

# Re-exported: studies, the tests, benchmarks and docs reach these as trainer.X.
from ddp import epoch_batches, loss_scale, shard_sizes, shard_slice, timed_allreduce  # noqa: F401
from probes import COMMUNICATE, STEP_PHASES  # noqa: F401
from settings import SettingsError, integer, is_number, known_keys, number, one_of
from training_hooks import (
    HookRunner,
    TrainingHooks,  # noqa: F401
)
from training_state import TrainingState, cpu_copy, state_identity

__all__ = [
    "Preempted",
    "PARTS",
    "TRAINING_DEFAULTS",
    "VALIDATION_CHUNK",
    "FLAG_EXCHANGE_SECONDS",
    "TrainingSettings",
    "Objective",
    "objective_of",
    "check_training_settings",
    "FunctionalAdam",
    "make_optimizer",
    "training_tensors",
    "batch_loss",
    "kept_validation",
    "LOSS_NAMES",
    "objective_name",
    "watched_loss",
    "training_outcome",
    "train",
]

Preempted = runtime.Preempted  # the one class; trainer.Preempted is the name callers of train() know
# The modules split from this one: their code shapes every model it trains, so they enter a
# model's key beside trainer.py (study_loading.experiment_sources).
PARTS = (ddp, training_state, training_hooks)

TRAINING_DEFAULTS = {
    "epochs": 2,
    "batch_size": 128,
    "optimizer": "adam",
    "learning_rate": 1e-3,
    "betas": [0.9, 0.999],
    "epsilon": 1e-8,
    "weight_decay": 0.0,
    "gradient_clip": None,
    "precision": "off",
    "checkpoint": "best",
    "objective": "bce",
    "balance_weight": 100.0,
    "selection": "bce",
    "classes": 5,
    "gamma": 1.0,
    "patience": None,
}


class TrainingSettings(TypedDict):
    """The `training` section, every default filled in and checked (check_training_settings): mypy names a
    key misspelt where it is read."""

    epochs: int
    batch_size: int
    optimizer: str
    learning_rate: float
    betas: list[float]
    epsilon: float
    weight_decay: float
    gradient_clip: float | None
    precision: str
    checkpoint: str
    objective: str
    balance_weight: float
    selection: str
    classes: int
    gamma: float
    patience: int | None


class Objective(NamedTuple):
    """What a training loss reads of the settings: the trained objective and its two hyper-parameters."""

    kind: str  # "bce", "balanced" or "contrastive" (training.objective)
    classes: int  # atoms per joint pair: training.classes for "contrastive", else one re-paired row
    gamma: float  # the contrastive loss' γ
    balance_weight: float  # the balanced loss' λ


def objective_of(settings: TrainingSettings) -> Objective:
    """The objective the settings train."""
    return Objective(settings["objective"], contrast_classes(settings), settings["gamma"], settings["balance_weight"])


OPTIMIZERS = ("adam", "adamw")
CHECKPOINTS = ("best", "last")
OBJECTIVES = ("bce", "balanced", "contrastive")
# Which validation loss `checkpoint: "best"` minimises: the BCE, or the trained objective.
SELECTIONS = ("bce", "objective")
VALIDATION_CHUNK = 65536  # rows per validation forward, bounding memory on large sets
# DDP: about this much training time between stop/save flag exchanges (ddp.FlagExchange). Read
# at each train() call, so tests and bench/bench_resume.py tune it here.
FLAG_EXCHANGE_SECONDS = 0.1


# ---------------------------------------------------------------- settings


def check_training_settings(training_settings: dict) -> TrainingSettings:
    """Validate the `training` settings and return them with defaults filled in."""
    known_keys(training_settings, tuple(TRAINING_DEFAULTS), "training")
    s = {**TRAINING_DEFAULTS, **training_settings}
    integer(s["epochs"], "training.epochs", 1, 10**6)
    integer(s["batch_size"], "training.batch_size", 1, 10**9)
    one_of(s["optimizer"], OPTIMIZERS, "training.optimizer")
    # Beyond these bounds a value is surely a typo (training would only diverge).
    number(s["learning_rate"], "training.learning_rate", 0, 10, low_open=True)
    number(s["epsilon"], "training.epsilon", 0, 1e6, low_open=True)
    number(s["weight_decay"], "training.weight_decay", 0, 1000)
    betas = s["betas"]
    if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(is_number(b) and 0 <= b < 1 for b in betas):
        raise SettingsError(f"training.betas: expected two numbers in [0, 1), e.g. [0.9, 0.999]; got {betas!r}")
    if s["gradient_clip"] is not None:
        number(s["gradient_clip"], "training.gradient_clip", 0, 1e6, low_open=True)
    one_of(s["precision"], runtime.PRECISIONS, "training.precision")
    one_of(s["checkpoint"], CHECKPOINTS, "training.checkpoint")
    one_of(s["objective"], OBJECTIVES, "training.objective")
    number(s["balance_weight"], "training.balance_weight", 0, 1e6)
    if not isinstance(s["selection"], str) or s["selection"] not in SELECTIONS:
        raise SettingsError(
            f'training.selection: {s["selection"]!r} is not valid; use "bce" (keep the epoch of '
            'the lowest validation BCE) or "objective" (of the lowest validation objective)'
        )
    integer(s["classes"], "training.classes", 2, 1000)
    number(s["gamma"], "training.gamma", 0, 1e6, low_open=True)
    if s["patience"] is not None:
        integer(s["patience"], "training.patience", 1, 10**6)
    s["betas"] = [float(b) for b in betas]
    s["balance_weight"] = float(s["balance_weight"])
    s["gamma"] = float(s["gamma"])
    return cast(TrainingSettings, s)


# ---------------------------------------------------------------- the optimizer


def _fast_flag(device: torch.device) -> dict[str, Any]:
    """Optimizer keyword choosing the fused (or foreach) implementation for speed."""
    return {"fused": True} if device.type in ("cpu", "cuda") else {"foreach": True}


class FunctionalAdam:
    """Adam or AdamW as torch.optim's functional update, without a torch.optim.Optimizer.

    The same tensors reach the same fused (or foreach) kernels as torch.optim.Adam(fused=True)
    .step(), so the weights are bitwise the same; but no torch.optim.Optimizer is built, which
    imports torch._dynamo (about 1 s of every training process, seen as the phase
    train.setup). Its state_dict keeps torch.optim's per-parameter state, so saved training
    states load either way.
    """

    def __init__(self, params, settings: TrainingSettings, device: torch.device):
        self.params = list(params)
        self.update = adam_update if settings["optimizer"] == "adam" else adamw_update
        beta1, beta2 = settings["betas"]
        self.hyper: dict[str, Any] = {
            "lr": settings["learning_rate"],
            "beta1": beta1,
            "beta2": beta2,
            "eps": settings["epsilon"],
            "weight_decay": settings["weight_decay"],
            "amsgrad": False,
            "maximize": False,
        }
        self.flags = _fast_flag(device)
        self.param_groups = [{"params": self.params}]  # what clipping and the state checks read
        self.state = [self._fresh_state(p) for p in self.params]

    def _fresh_state(self, p) -> dict:
        """Zero moments; as in torch.optim, the fused kernels keep the step count on the device."""
        fused = self.flags.get("fused", False)
        step = torch.zeros((), dtype=torch.float32, device=p.device) if fused else torch.tensor(0.0)
        return {
            "step": step,
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (always to None)."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One Adam step over the parameters that have a gradient."""
        live = [(p, s) for p, s in zip(self.params, self.state) if p.grad is not None]
        self.update(
            [p for p, _ in live],
            [p.grad for p, _ in live],
            [s["exp_avg"] for _, s in live],
            [s["exp_avg_sq"] for _, s in live],
            [],
            [s["step"] for _, s in live],
            **self.flags,
            **self.hyper,
        )

    def state_dict(self) -> dict:
        """torch.optim's layout: each parameter's state by index, and one parameter group."""
        hyper = {name: value for name, value in self.hyper.items() if name not in ("beta1", "beta2")}
        group = {
            **hyper,
            "betas": (self.hyper["beta1"], self.hyper["beta2"]),
            **self.flags,
            "params": list(range(len(self.params))),
        }
        return {"state": {i: dict(s) for i, s in enumerate(self.state)}, "param_groups": [group]}

    def load_state_dict(self, state: dict) -> None:
        """Restore moments and step counts saved by state_dict (or by torch.optim's Adam)."""
        for i, own in enumerate(self.state):
            for name, value in state["state"].get(i, {}).items():
                own[name].copy_(value)


def make_optimizer(params, settings: TrainingSettings, device: torch.device, scaled: bool = False):
    """Adam or AdamW with the settings' hyper-parameters (torch.optim's only under a gradient scaler)."""
    if not scaled:  # float16's GradScaler drives torch.optim's fused step itself
        return FunctionalAdam(params, settings, device)
    cls = torch.optim.Adam if settings["optimizer"] == "adam" else torch.optim.AdamW
    return cls(
        params,
        lr=settings["learning_rate"],
        betas=(settings["betas"][0], settings["betas"][1]),
        eps=settings["epsilon"],
        weight_decay=settings["weight_decay"],
        **_fast_flag(device),
    )


def _autocast(device: torch.device, precision: str):
    """Autocast context for the precision (a no-op context for "off")."""
    if precision == "off":
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "float16" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


# ---------------------------------------------------------------- the loop


# Fixed pairs: network inputs [x, θ] with labels (1 joint, 0 product), used as given every epoch.
TRAINING_ARRAYS = ("train_inputs", "train_labels", "validation_inputs", "validation_labels")
# Joint pairs: simulations (x, θ), re-paired with other rows' θ in every batch (contrast.py).
JOINT_ARRAYS = ("train_x", "train_theta", "validation_x", "validation_theta")


def training_tensors(data) -> dict:
    """The training arrays as tensors, from a dict of arrays or tensors, or the data artifact `train` receives."""
    names = TRAINING_ARRAYS + JOINT_ARRAYS
    if callable(getattr(data, "array", None)):  # a store artifact: its arrays, checked as they are read
        data = {name: data.array(name) for name in names if f"{name}.npy" in data.files}
    if not isinstance(data, dict):
        raise TypeError(
            f"training data must be a dict of arrays or the data artifact train() receives, not {type(data).__name__}"
        )
    return {
        name: value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
        for name, value in data.items()
        if name in names
    }


def _check_data(data: dict) -> bool:
    """Refuse data the trainer cannot use, naming the key; True for joint pairs, False for fixed ones."""
    joint = "train_x" in data
    for key in JOINT_ARRAYS if joint else TRAINING_ARRAYS:
        if key not in data:
            raise KeyError(f"training data lacks {key!r}")
    for part in ("train", "validation"):
        if joint:
            x, theta = data[f"{part}_x"], data[f"{part}_theta"]
            if x.ndim != 2 or theta.ndim != 2 or x.shape[0] != theta.shape[0] or x.shape[0] < 2:
                raise ValueError(f"{part} data must be at least two rows of (rows, d) x and (rows, p) theta")
            continue
        inputs, labels = data[f"{part}_inputs"], data[f"{part}_labels"]
        if inputs.ndim != 2 or labels.ndim != 1 or inputs.shape[0] != labels.shape[0] or inputs.shape[0] == 0:
            raise ValueError(f"{part} data must be non-empty (rows, features) inputs with (rows,) labels")
    return joint


def contrast_classes(settings: TrainingSettings) -> int:
    """Atoms per joint pair: `classes` for the contrastive objective, one re-paired row for the binary ones."""
    return settings["classes"] if settings["objective"] == "contrastive" else 1


def joint_validation(x, theta, settings: TrainingSettings, seed: int) -> tuple:
    """The validation set as (inputs, None, columns): each row with its atoms, drawn once for every epoch."""
    columns = contrast_classes(settings) + 1
    atoms = contrast.fixed_atoms(x.shape[0], columns - 1, seed).to(x.device)
    return contrast.pair_rows(x, theta, torch.arange(x.shape[0], device=x.device), atoms), None, columns


def balance_defect(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """mean σ(f) over joint rows (label 1) + mean σ(f) over product rows (label 0) − 1, on the host in float64.

    Zero for a perfectly balanced classifier (the exact ratio's is, in expectation); 0 when a
    class is absent, as for a training batch.
    """
    probability = torch.sigmoid(logits.detach().reshape(-1).to("cpu", torch.float64))
    joint = labels.detach().reshape(-1).to("cpu") > 0.5
    if bool(joint.all()) or not bool(joint.any()):
        return 0.0
    return (probability[joint].mean() + probability[~joint].mean() - 1).item()


def validation_objective(
    bce: float, balance: float, settings: TrainingSettings, contrastive: float | None = None
) -> float:
    """The trained objective on the validation set: its BCE, plus for "balanced" λ times the squared defect,
    or for "contrastive" the mean NRE-C loss of the validation rows and their fixed atoms.

    The defect is that of the whole validation set, not a mean over batches of batch_size
    rows: a batch's squared defect also holds the batch mean's sampling variance, which falls
    as 1/batch_size (docs/training.md).
    """
    if settings["objective"] == "balanced":
        return bce + settings["balance_weight"] * balance**2
    if settings["objective"] == "contrastive":
        if contrastive is None:
            raise ValueError("the contrastive objective's validation needs its contrastive loss")
        return contrastive
    return bce


def _validate(model, validation: tuple, device, settings: TrainingSettings) -> dict:
    """Validation metrics of the unwrapped model, with its balance defect; a non-finite logit is an error.

    `validation` is (inputs, labels, None) for fixed pairs, or (inputs, None, K + 1) for
    joint pairs each followed by its K atoms: their BCE metrics are those of each joint
    row against its first re-paired row, and the contrastive loss reads all K + 1.
    """
    inputs, labels, columns = validation
    was_training = model.training
    model.eval()
    with torch.no_grad(), _autocast(device, settings["precision"]):
        logits = torch.cat([model(chunk).float().reshape(-1) for chunk in inputs.split(VALIDATION_CHUNK)])
    model.train(was_training)
    if not bool(torch.isfinite(logits).all()):
        raise FloatingPointError("non-finite validation logit; the model diverged (lower training.learning_rate?)")
    # The metrics work on the host in float64: copy there once.
    logits, contrastive = logits.to("cpu", torch.float64), None
    if columns is not None:
        grid = logits.reshape(-1, columns)
        if settings["objective"] == "contrastive":
            contrastive = contrast.contrastive_losses(grid, settings["gamma"]).mean().item()
        logits, labels = grid[:, :2].reshape(-1), contrast.binary_labels(grid.shape[0], "cpu")
    labels = labels.to("cpu", torch.float64)
    return {
        **classification_metrics(logits, labels),
        "balance": balance_defect(logits, labels),
        "contrastive": contrastive,
    }


def _shared_validation(model, validation, settings, rt) -> dict:
    """Validate on rank 0 only (DDP) and share the result, errors included, with every rank."""
    if not rt.ddp:
        return _validate(model, validation, rt.device, settings)
    outcome = None
    if rt.is_main:
        try:
            outcome = _validate(model, validation, rt.device, settings)
        except FloatingPointError as error:
            outcome = {"error": str(error)}
    outcome = runtime.broadcast_object(rt, outcome)
    if "error" in outcome:
        raise FloatingPointError(outcome["error"])
    return outcome


def _raise_non_finite(epoch: int, batch_losses: torch.Tensor, norms: torch.Tensor | None) -> None:
    """Name the first batch whose loss (or clipped gradient norm) was not finite."""
    bad_loss = (~torch.isfinite(batch_losses)).nonzero()
    bad_norm = None if norms is None else (~torch.isfinite(norms)).nonzero()
    loss_at = int(bad_loss[0]) if len(bad_loss) else None
    norm_at = int(bad_norm[0]) if bad_norm is not None and len(bad_norm) else None
    if norm_at is not None and (loss_at is None or norm_at < loss_at):
        raise FloatingPointError(f"non-finite gradient norm in epoch {epoch + 1}, batch {norm_at + 1}")
    if loss_at is not None:
        raise FloatingPointError(f"non-finite training loss or logit in epoch {epoch + 1}, batch {loss_at + 1}")


def _balance_terms(logits: torch.Tensor, labels: torch.Tensor, weight: float, rt: runtime.Runtime):
    """The balancing regulariser λ(mean_joint σ(f) + mean_product σ(f) − 1)² of the global batch.

    Returns (surrogate to back-propagate, the regulariser's value). Joint rows have label 1,
    product rows label 0. Under DDP the sums and counts are all-reduced, and the surrogate
    2λ·g·W·(s_joint/N_joint + s_product/N_product), with the gap g = m_joint + m_product − 1
    held constant and s this rank's sums, has a DDP-averaged gradient equal to the global
    regulariser's. A global batch lacking joint or product rows states no balance: its
    regulariser is zero (with no host synchronisation).
    """
    probability = torch.sigmoid(logits)
    joint = (labels > 0.5).to(probability.dtype)
    own = torch.stack([(probability * joint).sum(), (probability * (1 - joint)).sum()])
    totals = torch.stack([own.detach()[0], joint.sum(), own.detach()[1], (1 - joint).sum()])
    if rt.ddp:
        runtime.all_reduce_sum(rt, totals)
    joint_sum, joint_count, product_sum, product_count = totals
    present = (joint_count > 0) & (product_count > 0)
    joint_count, product_count = joint_count.clamp(min=1), product_count.clamp(min=1)
    gap = torch.where(present, joint_sum / joint_count + product_sum / product_count - 1, 0.0)
    surrogate = 2 * weight * rt.train_world_size * gap * (own[0] / joint_count + own[1] / product_count)
    return surrogate, weight * gap**2


def batch_loss(
    logits: torch.Tensor, labels: torch.Tensor | None, batch_len: int, objective: Objective, rt: runtime.Runtime
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's loss to back-propagate for its shard of a global batch, and the shard's record.

    The record sums to the global batch's objective times its rows over ranks: the shard's
    BCE sum, plus (under DDP on rank 0 only) the balancing regulariser times the batch's rows.
    For "contrastive" (labels None) a row is a joint pair's K + 1 logits and the record the
    sum of their NRE-C losses.
    """
    if objective.kind == "contrastive":
        losses = contrast.contrastive_losses(logits.reshape(-1, objective.classes + 1), objective.gamma)
        loss_sum, shard_len = losses.sum(), losses.shape[0]
        return loss_sum / max(shard_len, 1) * loss_scale(shard_len, batch_len, rt.train_world_size), loss_sum.detach()
    if labels is None:
        raise ValueError(f"the {objective.kind!r} objective needs labels (fixed pairs) or re-paired rows")
    shard_len = labels.shape[0]
    loss_sum = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    # The shard mean times loss_scale: an empty shard (sum 0, scale 0) still joins the
    # all-reduce with zero gradients, and DDP's averaging yields the global-batch mean's gradient.
    loss = loss_sum / max(shard_len, 1) * loss_scale(shard_len, batch_len, rt.train_world_size)
    record = loss_sum.detach()
    if objective.kind == "balanced":
        surrogate, penalty = _balance_terms(logits, labels, objective.balance_weight, rt)
        loss = loss + surrogate
        if rt.leads_training:  # the penalty is counted once, not once per DDP rank
            record = record + batch_len * penalty.detach()
    return loss, record


class Fit(NamedTuple):
    """What every step of one training reads: its state, the network to call (DDP's wrapper under DDP),
    the checked `training` settings and the runtime."""

    state: TrainingState
    net: torch.nn.Module
    settings: TrainingSettings
    rt: runtime.Runtime


def _step(fit: Fit, params: list, shard: tuple, batch_len: int, index: int) -> None:
    """One optimizer step on this rank's shard of a global batch; records its loss and gradient norm.

    Its parts are timed as the phases train.forward, train.loss, train.backward (with DDP's
    gradient communication inside) and train.optimizer (clipping included).
    """
    state, net, settings, rt = fit
    xb, yb = shard
    device = rt.device
    with probes.phase("train.forward", device=device), _autocast(device, settings["precision"]):
        logits = net(xb).reshape(-1)
    with probes.phase("train.loss", device=device):
        loss, record = batch_loss(logits.float(), yb, batch_len, objective_of(settings), rt)
    scaled, clip = state.scaler.is_enabled(), settings["gradient_clip"]
    norms, batch_losses = state.norms, state.batch_losses  # made with the epoch (norms when clipping)
    assert batch_losses is not None, "an epoch's buffers are made before its first step"
    with probes.phase("train.backward", device=device):
        state.optimizer.zero_grad(set_to_none=True)
        (state.scaler.scale(loss) if scaled else loss).backward()
    with probes.phase("train.optimizer", device=device):
        # Under the scaler the optimizer is torch.optim's (make_optimizer), which the scaler drives.
        scaled_optimizer = cast(torch.optim.Optimizer, state.optimizer)
        if clip is not None:
            if scaled:
                state.scaler.unscale_(scaled_optimizer)
            norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            if norms is not None:
                norms[index] = norm
        if scaled:
            state.scaler.step(scaled_optimizer)
            state.scaler.update()
        else:
            state.optimizer.step()
    batch_losses[index] = record


def _joint_shard(fit: Fit, xs, thetas, batch: tuple, index: int) -> tuple:
    """This rank's rows of a global batch of joint pairs, each followed by its atoms' re-paired rows.

    Returns ((inputs, labels), loss units of the global batch): labels 1/0 and 2B units for
    the binary objectives, no labels and B units (one NRE-C loss per pair) for "contrastive".
    """
    state, _, settings, rt = fit
    start, stop = batch
    atoms = contrast.batch_atoms(start, stop, contrast_classes(settings), state.seed, state.epoch, index)
    part = shard_slice(stop - start, rt.rank if rt.ddp else 0, rt.train_world_size)
    own = torch.arange(start, stop)[part]
    inputs = contrast.pair_rows(xs[start:stop][part], thetas, own.to(xs.device), atoms[part].to(xs.device))
    if settings["objective"] == "contrastive":
        return (inputs, None), stop - start
    return (inputs, contrast.binary_labels(own.shape[0], xs.device)), 2 * (stop - start)


def _run_epoch(fit: Fit, x, y, runner: HookRunner, joint: bool):
    """The rest of the current epoch; returns this rank's per-batch loss sums and gradient norms.

    `y` holds the labels of fixed pairs, or the θ of joint pairs (x then being their x).
    """
    state, _, settings, rt = fit
    rows, device = x.shape[0], rt.device
    perm = state.permutation(rows).to(device)
    # One gather per epoch makes every global batch a contiguous view.
    xs, ys = x.index_select(0, perm), y.index_select(0, perm)
    batches = epoch_batches(rows, settings["batch_size"])
    if state.position == 0:
        state.batch_losses = torch.zeros(len(batches), device=device)
        clipping = settings["gradient_clip"] is not None
        state.norms = torch.zeros(len(batches), device=device) if clipping else None
    params = [p for p in state.model.parameters() if p.requires_grad]
    for index in range(state.position, len(batches)):
        start, stop = batches[index]
        if joint:
            shard, units = _joint_shard(fit, xs, ys, (start, stop), index)
        else:
            part = shard_slice(stop - start, rt.rank if rt.ddp else 0, rt.train_world_size)
            shard, units = (xs[start:stop][part], ys[start:stop][part]), stop - start
        _step(fit, params, shard, units, index)
        state.position = index + 1
        runner.after_step(state)
    # With float16 an overflowing norm is the scaler's business: it skips that step.
    norms = None if state.scaler.is_enabled() else state.norms
    return state.batch_losses, norms


def kept_validation(history: dict) -> dict:
    """The validation metrics (bce, accuracy, auc) of the kept epoch (selected_epoch counts from 1), or {}."""
    epoch, validation = history.get("selected_epoch"), history.get("validation") or []
    if not isinstance(epoch, int) or not 1 <= epoch <= len(validation) or not isinstance(validation[epoch - 1], dict):
        return {}
    return validation[epoch - 1]


def selection_scores(history: dict) -> list:
    """Per epoch, the validation loss that chooses the kept epoch and stops training (training.selection)."""
    if history["selection"] == "objective":
        return list(history["validation_objective"])
    return [metrics["bce"] for metrics in history["validation"]]


# The validation loss each objective trains, as the log, `report` and the `training` figure name it.
LOSS_NAMES = {"bce": "BCE", "balanced": "balanced loss", "contrastive": "contrastive loss"}


def objective_name(history: dict) -> str:
    """The trained objective's name ("contrastive loss", ...); "objective" for a history saved before it said."""
    return LOSS_NAMES.get(str(history.get("objective")), "objective")


def watched_loss(history: dict) -> str:
    """The validation loss that chose the kept epoch and that patience watched (training.selection)."""
    return "validation " + (objective_name(history) if history.get("selection") == "objective" else "BCE")


def training_outcome(history: dict) -> str | None:
    """One line: stopped early (the epoch, patience and the watched loss) or ran every epoch, then the kept epoch
    and its loss; None for a history this trainer did not write."""
    if not isinstance(history, dict) or history.get("selection") not in SELECTIONS:
        return None
    epochs, kept, stopped = history.get("epochs"), history.get("selected_epoch"), history.get("stopped_epoch")
    scores = selection_scores(history)
    if not isinstance(kept, int) or not 1 <= kept <= len(scores) or not isinstance(epochs, int):
        return None
    watched = watched_loss(history)
    kept_text = f"kept epoch {kept} ({watched} {scores[kept - 1]:.4f})"
    if isinstance(stopped, int):
        return (
            f"stopped early at epoch {stopped} of {epochs} (patience {history.get('patience')}: the {watched} "
            f"had not improved for {history.get('patience')} epochs), {kept_text}"
        )
    return f"ran all {epochs} epochs, {kept_text}"


def patience_exhausted(history: dict, settings: TrainingSettings) -> bool:
    """True when the selected validation loss has not improved for `patience` epochs (never without patience)."""
    scores = selection_scores(history)
    if settings["patience"] is None or not scores:
        return False
    best = min(range(len(scores)), key=scores.__getitem__)  # the first epoch of the lowest loss
    return len(scores) - 1 - best >= settings["patience"]


def _close_epoch(fit: Fit, batch_losses, norms, validation: tuple) -> dict:
    """Reduce the epoch's losses, validate, keep the checkpoint; returns the epoch's metrics."""
    state, _, settings, rt = fit
    if rt.ddp:
        # One collective per epoch: every rank sees the same losses and fails together.
        # Gradient norms need no reduction: after the all-reduce every rank has the same grads.
        runtime.all_reduce_sum(rt, batch_losses)
    total = batch_losses.sum()
    finite = bool(torch.isfinite(total)) and (norms is None or bool(torch.isfinite(norms).all()))
    if not finite:
        _raise_non_finite(state.epoch, batch_losses, norms)
    history = state.history
    train_loss = total.item() / history["rows_per_epoch"]
    history["train_loss"].append(train_loss)
    with probes.phase("train.validation", device=rt.device):
        metrics = _shared_validation(state.model, validation, settings, rt)
    balance = metrics.pop("balance")
    objective = validation_objective(metrics["bce"], balance, settings, metrics.pop("contrastive"))
    history["validation"].append(metrics)
    history["validation_objective"].append(objective)
    history["validation_balance"].append(balance)
    score = selection_scores(history)[-1]
    converged = patience_exhausted(history, settings)
    if converged:
        history["stopped_epoch"] = state.epoch + 1
    last = state.epoch + 1 == settings["epochs"] or converged
    if (settings["checkpoint"] == "best" and score < state.best_loss) or (settings["checkpoint"] == "last" and last):
        state.best_loss = score
        state.best_weights = cpu_copy(state.model.state_dict())
        history["selected_epoch"] = state.epoch + 1
    state.epoch += 1
    state.position = 0
    return {"train_loss": train_loss, **metrics, "objective": objective, "balance": balance}


def _train_epochs(fit: Fit, tensors: tuple, validation: tuple, runner: HookRunner) -> None:
    """The epoch loop: train, close and report each epoch, saving and stopping where agreed.

    It ends after `epochs`, or earlier once the selected validation loss has not improved
    for `patience` epochs (decided from the history, so a resumed training ends alike).
    """
    state, settings = fit.state, fit.settings
    x, y = tensors
    joint = validation[1] is None
    while state.epoch < settings["epochs"] and not patience_exhausted(state.history, settings):
        began = time.monotonic()
        batch_losses, norms = _run_epoch(fit, x, y, runner, joint)
        stop = runner.drain()
        metrics = _close_epoch(fit, batch_losses, norms, validation)
        record = {
            **metrics,
            "seconds": time.monotonic() - began,
            "epochs": settings["epochs"],
            "objective_name": LOSS_NAMES[settings["objective"]],
        }
        runner.epoch_done(state, stop, record)


def _new_history(settings: TrainingSettings, rows: int, rt: runtime.Runtime) -> dict:
    """The history of a training that has not started."""
    return {
        "train_loss": [],
        "validation": [],
        # Per epoch: the trained objective on the validation set (validation_objective) and the
        # set's balance defect (balance_defect); "selection" says which loss chose selected_epoch.
        "validation_objective": [],
        "validation_balance": [],
        "selection": settings["selection"],
        "objective": settings["objective"],  # names the losses (objective_name); absent in earlier histories
        # Loss terms per epoch (train_loss is their mean): the rows of fixed pairs, twice the
        # joint pairs (each and its re-paired row) under "bce"/"balanced", the pairs under "contrastive".
        "rows_per_epoch": rows,
        "global_batch_size": settings["batch_size"],
        "world_size": rt.train_world_size,
        "selected_epoch": None,
        "epochs": settings["epochs"],
        "patience": settings["patience"],
        "stopped_epoch": None,  # the epoch after which `patience` ended training, if it did
    }


def _new_state(model, settings: TrainingSettings, rt: runtime.Runtime, seed: int, rows: int) -> TrainingState:
    """A fresh training state for a model already on the device."""
    device = rt.device
    return TrainingState(
        model=model,
        optimizer=make_optimizer(
            [p for p in model.parameters() if p.requires_grad],
            settings,
            device,
            scaled=settings["precision"] == "float16",
        ),
        scaler=torch.amp.GradScaler(device.type, enabled=settings["precision"] == "float16"),
        generator=runtime.seeded_generator(seed, "permutation"),
        device=device,
        seed=seed,
        history=_new_history(settings, rows, rt),
    )


def train(
    model: torch.nn.Module,
    data,
    training_settings: dict,
    rt: runtime.Runtime,
    seed: int,
    hooks: TrainingHooks | None = None,
):
    """Train a logit-returning classifier; returns (CPU state dict, history).

    `data` is the data artifact an experiment's `train` receives, or a dict of the arrays
    `train_inputs`, `train_labels`, `validation_inputs`, `validation_labels` (numpy or torch).

    `hooks` (optional, see TrainingHooks) resume a saved state, save the state, stop on
    request by raising Preempted, and report progress; without them nothing is saved or polled.
    """
    try:
        return _train(model, data, training_settings, rt, seed, hooks)
    except BaseException as error:
        if rt.ddp:
            ddp.release_frames(error)
        raise


def _train(model, data: dict, training_settings: dict, rt: runtime.Runtime, seed: int, hooks):
    """train's body: the DDP wrapper lives in this frame and those below it."""
    settings = check_training_settings(training_settings)
    if hooks is not None:
        hooks.check()
    device = rt.device
    runtime.check_precision(settings["precision"], device)
    data = training_tensors(data)
    joint = _check_data(data)
    if settings["objective"] == "contrastive" and not joint:
        raise ValueError(
            'training.objective "contrastive" needs joint pairs (train_x, train_theta, validation_x, '
            "validation_theta), not fixed pairs with labels"
        )
    with probes.phase("train.setup"):
        given = tuple(data[name] for name in (JOINT_ARRAYS if joint else TRAINING_ARRAYS))
        tensors = tuple(tensor.to(device=device, dtype=torch.float32) for tensor in given)
        validation = joint_validation(tensors[2], tensors[3], settings, seed) if joint else (*tensors[2:], None)
        model = model.to(device)
        model.train()
        net = ddp.wrapped(model, rt)
        rows = int(tensors[0].shape[0])
        binary_pairs = joint and settings["objective"] != "contrastive"  # each joint row and its re-paired row
        state = _new_state(model, settings, rt, seed, 2 * rows if binary_pairs else rows)
        keeps_state = hooks is not None and (hooks.load_state is not None or hooks.saving)
        # Hashed as given (on the host, as the store loads it), not copied back from the GPU.
        identity = state_identity(settings, seed, rt, given) if keeps_state else None
        n_batches = len(epoch_batches(rows, settings["batch_size"]))
        runner = HookRunner(hooks, rt, identity, n_batches, FLAG_EXCHANGE_SECONDS)
    # Dropout draws from torch's global stream: seed it per rank from the job's seed so the
    # same recipe gives the same weights whatever ran before in this process.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(runtime.derived_seed(seed, "dropout", rt.rank if rt.ddp else 0))
        runner.resume(state)
        _train_epochs(Fit(state, net, settings, rt), tensors[:2], validation, runner)
    return state.best_weights, state.history
