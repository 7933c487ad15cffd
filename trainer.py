"""The bundled trainer: exact global-batch sharding, mixed precision, clipping, checkpoints,
the balanced NRE objective, resumable state and cooperative preemption."""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
import traceback
import uuid
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.optim.adam import adam as adam_update
from torch.optim.adamw import adamw as adamw_update

import contrast
import probes
import runtime
from inference import classification_metrics
from settings import SettingsError, integer, is_integer, is_number, known_keys, number, one_of

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
OPTIMIZERS = ("adam", "adamw")
CHECKPOINTS = ("best", "last")
OBJECTIVES = ("bce", "balanced", "contrastive")
# Which validation loss `checkpoint: "best"` minimises: the BCE, or the trained objective.
SELECTIONS = ("bce", "objective")
# The phases of one training step (_step) and of DDP's gradient all-reduce within its backward pass.
STEP_PHASES = ("train.forward", "train.loss", "train.backward", "train.optimizer")
COMMUNICATE = "train.communicate"
VALIDATION_CHUNK = 65536  # rows per validation forward, bounding memory on large sets
# Written into every saved state; a state of another format is ignored, never misread.
STATE_FORMAT = "nnpd-training-state-1"


# ---------------------------------------------------------------- sharding math (pure)


def epoch_batches(rows: int, batch_size: int) -> list[tuple[int, int]]:
    """Consecutive global batches (start, stop) over one permutation; the last may be short."""
    if rows < 0 or batch_size < 1:
        raise ValueError(f"need rows >= 0 and batch_size >= 1, got {rows}, {batch_size}")
    return [(start, min(start + batch_size, rows)) for start in range(0, rows, batch_size)]


def shard_slice(batch_len: int, rank: int, world_size: int) -> slice:
    """Rank's strided part `rank::world_size` of a global batch (empty when rank >= batch_len)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return slice(rank, batch_len, world_size)


def shard_sizes(batch_len: int, world_size: int) -> list[int]:
    """Number of rows each rank takes from a global batch of `batch_len` rows."""
    return [max(0, -(-(batch_len - rank) // world_size)) for rank in range(world_size)]


def loss_scale(shard_len: int, batch_len: int, world_size: int) -> float:
    """Factor for a rank's mean shard loss so DDP's averaged gradient is the global-batch mean's."""
    if batch_len < 1:
        raise ValueError("a global batch has at least one row")
    return world_size * shard_len / batch_len


# ---------------------------------------------------------------- settings


def check_training_settings(training_settings: dict) -> dict:
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
        raise SettingsError(f"training.selection: {s['selection']!r} is not valid; use \"bce\" (keep the epoch of "
                            "the lowest validation BCE) or \"objective\" (of the lowest validation objective)")
    integer(s["classes"], "training.classes", 2, 1000)
    number(s["gamma"], "training.gamma", 0, 1e6, low_open=True)
    if s["patience"] is not None:
        integer(s["patience"], "training.patience", 1, 10**6)
    s["betas"] = [float(b) for b in betas]
    s["balance_weight"] = float(s["balance_weight"])
    s["gamma"] = float(s["gamma"])
    return s


# ---------------------------------------------------------------- hooks


@dataclass
class TrainingHooks:
    """Optional callbacks through which a caller resumes, saves, stops and follows a training.

    Epochs are numbered from 1; `batch` counts the batches of that epoch already trained.
    - load_state() -> dict | None: a state `save_state` received earlier (called on every rank).
    - save_state(state): persist `state`, a dict of CPU tensors and plain values that
      torch.save and torch.load(weights_only=True) round-trip (under DDP rank 0 only; write
      atomically).
    - save_seconds: seconds between periodic saves; a state is also saved at each epoch end.
      0 saves nothing; math.inf saves at epoch ends only.
    - stop_requested() -> bool: polled after every step; True on any rank stops every rank
      at the same step, saves (when saving) and raises Preempted.
    - on_epoch(epoch, record): after each epoch (under DDP rank 0 only); record holds train_loss, bce,
      accuracy, auc, objective and balance (the validation objective and balance defect, see
      validation_objective), seconds (the epoch's wall time) and epochs (the total).
    - on_resume(epoch, batch): when training continues from a loaded state (under DDP rank 0 only).
    Under DDP every rank passes hooks with the same fields set: they decide which
    collectives run.
    """

    load_state: Callable[[], dict | None] | None = None
    save_state: Callable[[dict], None] | None = None
    save_seconds: float = 0.0
    stop_requested: Callable[[], bool] | None = None
    on_epoch: Callable[[int, dict], None] | None = None
    on_resume: Callable[[int, int], None] | None = None

    def check(self) -> None:
        """Refuse an interval that is not a number >= 0, or one without a place to save."""
        if not is_number(self.save_seconds) or not self.save_seconds >= 0:
            raise ValueError(f"TrainingHooks.save_seconds: expected a number >= 0 (0 = never save); got {self.save_seconds!r}")
        if self.save_seconds > 0 and self.save_state is None:
            raise ValueError("TrainingHooks.save_seconds > 0 needs a save_state callable")

    @property
    def saving(self) -> bool:
        """True when states are saved (periodically and at epoch ends)."""
        return self.save_state is not None and self.save_seconds > 0


Preempted = runtime.Preempted      # the one class; trainer.Preempted is the name callers of train() know


# ---------------------------------------------------------------- training state


def _cpu_copy(value):
    """A deep copy with every tensor copied to the CPU: safe to keep while training goes on."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _cpu_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copy(item) for item in value)
    return value


@dataclass
class TrainingState:
    """All mutable training state of one rank in one place: saved and resumed as a whole."""

    model: torch.nn.Module
    optimizer: object   # a FunctionalAdam, or torch.optim's Adam/AdamW under float16's gradient scaler
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
    # BCE or the objective. Named for the BCE, which it was before the choice: saved states keep the name.
    best_bce: float = math.inf
    best_weights: dict | None = None

    def state_dict(self) -> dict:
        """Everything needed to continue training exactly where it stopped, as CPU copies."""
        return _cpu_copy({
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
            "best_bce": self.best_bce,
            "best_weights": self.best_weights,
        })

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved (copying, so `state` can be reused)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(_cpu_copy(state["optimizer"]))
        self.scaler.load_state_dict(state["scaler"])
        self.generator.set_state(state["generator"])
        self.epoch_rng = state["epoch_rng"]
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.batch_losses, self.norms = (None if t is None else t.to(self.device, copy=True)
                                         for t in (state["batch_losses"], state["norms"]))
        self.history = _cpu_copy(state["history"])
        self.best_bce = float(state["best_bce"])
        self.best_weights = _cpu_copy(state["best_weights"])

    def permutation(self, rows: int) -> torch.Tensor:
        """This epoch's permutation; identical on every rank and redrawn identically on resume."""
        if self.position == 0 or self.epoch_rng is None:
            self.epoch_rng = self.generator.get_state()
        else:
            self.generator.set_state(self.epoch_rng)
        return torch.randperm(rows, generator=self.generator)


def _fast_flag(device: torch.device) -> dict:
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

    def __init__(self, params, settings: dict, device: torch.device):
        self.params = list(params)
        self.update = adam_update if settings["optimizer"] == "adam" else adamw_update
        beta1, beta2 = settings["betas"]
        self.hyper = {"lr": settings["learning_rate"], "beta1": beta1, "beta2": beta2, "eps": settings["epsilon"],
                      "weight_decay": settings["weight_decay"], "amsgrad": False, "maximize": False}
        self.flags = _fast_flag(device)
        self.param_groups = [{"params": self.params}]   # what clipping and the state checks read
        self.state = [self._fresh_state(p) for p in self.params]

    def _fresh_state(self, p) -> dict:
        """Zero moments; as in torch.optim, the fused kernels keep the step count on the device."""
        fused = self.flags.get("fused", False)
        step = torch.zeros((), dtype=torch.float32, device=p.device) if fused else torch.tensor(0.0)
        return {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (always to None)."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One Adam step over the parameters that have a gradient."""
        live = [(p, s) for p, s in zip(self.params, self.state) if p.grad is not None]
        self.update([p for p, _ in live], [p.grad for p, _ in live], [s["exp_avg"] for _, s in live],
                    [s["exp_avg_sq"] for _, s in live], [], [s["step"] for _, s in live],
                    **self.flags, **self.hyper)

    def state_dict(self) -> dict:
        """torch.optim's layout: each parameter's state by index, and one parameter group."""
        hyper = {name: value for name, value in self.hyper.items() if name not in ("beta1", "beta2")}
        group = {**hyper, "betas": (self.hyper["beta1"], self.hyper["beta2"]), **self.flags,
                 "params": list(range(len(self.params)))}
        return {"state": {i: dict(s) for i, s in enumerate(self.state)}, "param_groups": [group]}

    def load_state_dict(self, state: dict) -> None:
        """Restore moments and step counts saved by state_dict (or by torch.optim's Adam)."""
        for i, own in enumerate(self.state):
            for name, value in state["state"].get(i, {}).items():
                own[name].copy_(value)


def make_optimizer(params, settings: dict, device: torch.device, scaled: bool = False):
    """Adam or AdamW with the settings' hyper-parameters (torch.optim's only under a gradient scaler)."""
    if not scaled:      # float16's GradScaler drives torch.optim's fused step itself
        return FunctionalAdam(params, settings, device)
    cls = torch.optim.Adam if settings["optimizer"] == "adam" else torch.optim.AdamW
    return cls(
        params,
        lr=settings["learning_rate"],
        betas=tuple(settings["betas"]),
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


# ---------------------------------------------------------------- saved states


_FILE_KEYS = {"format", "save_id", "identity", "state", "ranks"}
_SHARED_KEYS = {"model", "optimizer", "scaler", "generator", "epoch_rng", "epoch", "position", "norms",
                "history", "best_bce", "best_weights"}
_IDENTITY_PHRASES = {"world_size": "it was saved by a launch with another number of training ranks",
                     "settings": "its training settings differ", "seed": "its training seed differs",
                     "data": "its training or validation data differ"}


def _identity(settings: dict, seed: int, rt: runtime.Runtime, tensors) -> dict:
    """What a saved state must share with this training to continue it."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().to("cpu").contiguous().numpy())
    return {"world_size": rt.train_world_size, "settings": settings, "seed": seed, "data": digest.hexdigest()}


def _global_rng(device: torch.device) -> dict:
    """This process's global torch streams: dropout draws from them."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def _set_global_rng(streams: dict, device: torch.device) -> None:
    """Put back what `_global_rng` returned."""
    torch.set_rng_state(streams["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(streams["cuda"], device)


def _saved_state(state: TrainingState, rt: runtime.Runtime, identity: dict) -> dict | None:
    """One file's worth of state on the worker that writes it (None on the other DDP ranks).

    The shared parts once, and every rank's own parts.
    """
    own = {"rng": _global_rng(rt.device), "batch_losses": _cpu_copy(state.batch_losses)}
    # A collective: every rank gets here at the same step, so one file restores every rank.
    ranks = runtime.all_gather_object(rt, own) if rt.ddp else [own]
    if not rt.leads_training:
        return None
    shared = state.state_dict()
    del shared["batch_losses"]
    return {"format": STATE_FORMAT, "save_id": uuid.uuid4().hex, "identity": identity, "state": shared,
            "ranks": ranks}


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
    if not (is_integer(epoch) and is_integer(position) and 0 <= epoch <= epochs and 0 <= position <= n_batches) \
            or (epoch == epochs and position):
        return f"its progress (epoch index {epoch}, batch {position}) does not fit {epochs} epochs of {n_batches} batches"
    history = shared["history"]
    if any(len(history.get(name, ())) != epoch for name in ("train_loss", "validation", "validation_objective",
                                                             "validation_balance")):
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


def _state_problem(saved, state: TrainingState, identity: dict, n_batches: int) -> str | None:
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
    return _tensors_problem(saved["state"], state) or _progress_problem(saved, epochs, n_batches,
                                                                         identity["world_size"])


def _apply_saved_state(saved: dict, state: TrainingState, rt: runtime.Runtime) -> None:
    """Load the shared parts and this rank's own streams and losses."""
    own = saved["ranks"][rt.rank if rt.ddp else 0]
    state.load_state_dict({**saved["state"], "batch_losses": own["batch_losses"]})
    _set_global_rng(own["rng"], rt.device)


def _first_problem(reports: list) -> str | None:
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


def _one_line(error: Exception) -> str:
    """An exception as one short line."""
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."


# ---------------------------------------------------------------- hooks at agreed steps


# Weak references to (default group, its Gloo side group) under NCCL: c10d holds both until
# destroy_process_group, which must end them (see runtime.stop).
_side_group = (lambda: None, lambda: None)


def _flag_group(rt: runtime.Runtime):
    """The group carrying stop and save flags: the default one on CPU (Gloo).

    Under NCCL a Gloo side group keeps the flags on the host, so reading them never
    waits for the GPU; it is made once per default group (all ranks train together).
    """
    global _side_group
    if rt.device.type != "cuda":
        return None
    world, side = dist.group.WORLD, _side_group[1]()
    if side is None or _side_group[0]() is not world:
        side = dist.new_group(backend="gloo")
        _side_group = (weakref.ref(world), weakref.ref(side))
    return side


FLAG_EXCHANGE_SECONDS = 0.1  # DDP: about this much training time between stop/save flag exchanges


class _FlagExchange:
    """DDP's agreement on [stop, save due]: an asynchronous all-reduce every few steps.

    Each exchange is waited for one step after it was posted, so its latency hides behind
    that step. Rank 0 sets how many steps pass until the next exchange (about
    FLAG_EXCHANGE_SECONDS of them, at least one) and the count travels with the flags, so
    every rank posts at the same steps: one exchange after every step added a quarter or
    more to a small model's step time on CPU Gloo (bench/bench_resume.py).
    """

    def __init__(self, rt: runtime.Runtime):
        self.rt, self.group = rt, _flag_group(rt)
        self.step = 0                              # steps trained in this call
        self.next_post = 1                         # the step that posts next, the same on every rank
        self.last_post = (0, time.monotonic())     # step and time of the latest post
        self.pending = None

    def collect(self) -> tuple[bool, bool]:
        """Wait for the pending exchange: the agreed (stop, save due); (False, False) without one."""
        if self.pending is None:
            return False, False
        work, flags = self.pending
        self.pending = None
        work.wait()
        stop, due, interval = flags.tolist()
        self.next_post = self.last_post[0] + int(interval)
        return stop > 0, due > 0

    def offer(self, stop: bool, due: bool) -> None:
        """Count a step, and post this rank's flags when this is an exchange step."""
        self.step += 1
        if self.step < self.next_post:
            return
        interval = self._interval() if self.rt.is_main else 0.0
        flags = torch.tensor([float(stop), float(due), interval])
        self.pending = (dist.all_reduce(flags, group=self.group, async_op=True), flags)
        self.last_post = (self.step, time.monotonic())

    def _interval(self) -> float:
        """Rank 0's steps until the next exchange, from the step time since the latest post."""
        step, posted_at = self.last_post
        per_step = max((time.monotonic() - posted_at) / max(self.step - step, 1), 1e-9)
        return float(min(max(int(FLAG_EXCHANGE_SECONDS / per_step), 1), 10_000))

    def agree_at_epoch_end(self, stop: bool) -> bool:
        """Finish the pending exchange, then agree on stopping (one blocking exchange per epoch)."""
        self.collect()
        flag = torch.tensor([float(stop)])
        dist.all_reduce(flag, group=self.group)
        return flag.item() > 0


class _HookRunner:
    """Calls the hooks: resumes, saves and stops at steps every rank agrees on, reports epochs.

    `stop_requested` is polled after every step. One process acts on it, and on its clock
    for periodic saves, at once; under DDP a _FlagExchange agrees on both (rank 0's clock
    alone decides when a save is due), and every epoch end agrees on stopping.
    """

    def __init__(self, hooks: TrainingHooks | None, rt: runtime.Runtime, identity: dict | None, n_batches: int):
        self.hooks, self.rt, self.identity, self.n_batches = hooks, rt, identity, n_batches
        self.polling = hooks is not None and hooks.stop_requested is not None
        self.saving = hooks is not None and hooks.saving
        self.active = self.polling or self.saving
        self.exchange = _FlagExchange(rt) if rt.ddp and self.active else None
        self.stop_seen = False
        self.last_save = time.monotonic()

    def _save_due(self) -> bool:
        """True on the worker that writes the state (rank 0 in DDP) when the save interval has passed."""
        return self.saving and self.rt.leads_training and time.monotonic() - self.last_save >= self.hooks.save_seconds

    def progress(self, state: TrainingState) -> tuple[int, int]:
        """(epoch from 1, batches of it trained); an epoch boundary reads as the end of the epoch before."""
        if state.position == 0 and state.epoch > 0:
            return state.epoch, self.n_batches
        return state.epoch + 1, state.position

    def _save(self, state: TrainingState) -> None:
        """Save the whole state (a collective under DDP, where rank 0 writes)."""
        with probes.phase("train.save"):
            saved = _saved_state(state, self.rt, self.identity)
            if saved is not None:
                self.hooks.save_state(saved)
        self.last_save = time.monotonic()

    def _stop(self, state: TrainingState) -> None:
        """Raise Preempted once every rank is done, so no rank leaves while rank 0 still writes."""
        if self.saving and self.rt.ddp:
            runtime.barrier(self.rt)
        raise Preempted(*self.progress(state), saved=self.saving)

    def after_step(self, state: TrainingState) -> None:
        """Poll for a stop; save and stop when agreed; under DDP offer this step's flags."""
        if not self.active:
            return
        self.stop_seen = self.stop_seen or (self.polling and bool(self.hooks.stop_requested()))
        stop, due = (self.stop_seen, self._save_due()) if self.exchange is None else self.exchange.collect()
        if self.saving and (stop or due):
            self._save(state)
        if stop:
            self._stop(state)
        if self.exchange is not None:
            self.exchange.offer(self.stop_seen, self._save_due())

    def drain(self) -> bool:
        """At an epoch end (before its collectives): True when every rank agrees to stop there."""
        return self.exchange is not None and self.exchange.agree_at_epoch_end(self.stop_seen)

    def epoch_done(self, state: TrainingState, stop: bool, record: dict) -> None:
        """Save at the epoch end, report the epoch (under DDP from rank 0), then stop when asked."""
        if self.saving:
            self._save(state)
        if self.hooks is not None and self.hooks.on_epoch is not None and self.rt.leads_training:
            self.hooks.on_epoch(state.epoch, record)
        if stop:
            self._stop(state)

    def _load(self, state: TrainingState) -> tuple[bool, str | None, str | None]:
        """Load and apply this rank's saved state: (found one, why it is unusable, its save id)."""
        saved, problem = None, None
        try:
            saved = self.hooks.load_state()
            if saved is not None:
                problem = _state_problem(saved, state, self.identity, self.n_batches)
                if problem is None:
                    _apply_saved_state(saved, state, self.rt)
        except Exception as error:  # a damaged state must never stop a training that can start afresh
            problem = _one_line(error)
        save_id = saved.get("save_id") if isinstance(saved, dict) else None
        return saved is not None or problem is not None, problem, save_id

    def resume(self, state: TrainingState) -> None:
        """Continue from the saved state when every rank can; otherwise warn once and start afresh."""
        if self.hooks is None or self.hooks.load_state is None:
            return
        fresh = state.state_dict(), _global_rng(self.rt.device)
        report = self._load(state)
        reports = runtime.all_gather_object(self.rt, report) if self.rt.ddp else [report]
        if not any(found for found, _, _ in reports):
            return
        problem = _first_problem(reports)
        if problem is None:
            if self.hooks.on_resume is not None and self.rt.leads_training:
                self.hooks.on_resume(*self.progress(state))
            return
        state.load_state_dict(fresh[0])
        _set_global_rng(fresh[1], self.rt.device)
        if self.rt.leads_training:
            warnings.warn(f"ignoring the saved training state ({problem}); training starts from the beginning",
                          stacklevel=3)


# ---------------------------------------------------------------- the loop


# Fixed pairs: network inputs [x, θ] with labels (1 joint, 0 product), used as given every epoch.
TRAINING_ARRAYS = ("train_inputs", "train_labels", "validation_inputs", "validation_labels")
# Joint pairs: simulations (x, θ), re-paired with other rows' θ in every batch (contrast.py).
JOINT_ARRAYS = ("train_x", "train_theta", "validation_x", "validation_theta")


def training_tensors(data) -> dict:
    """The training arrays as tensors, from a dict of arrays or tensors, or the data artifact `train` receives."""
    names = TRAINING_ARRAYS + JOINT_ARRAYS
    if callable(getattr(data, "array", None)):      # a store artifact: its arrays, checked as they are read
        data = {name: data.array(name) for name in names if f"{name}.npy" in data.files}
    if not isinstance(data, dict):
        raise TypeError(f"training data must be a dict of arrays or the data artifact train() receives, "
                        f"not {type(data).__name__}")
    return {name: value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
            for name, value in data.items() if name in names}


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


def contrast_classes(settings: dict) -> int:
    """Atoms per joint pair: `classes` for the contrastive objective, one re-paired row for the binary ones."""
    return settings["classes"] if settings["objective"] == "contrastive" else 1


def joint_validation(x, theta, settings: dict, seed: int) -> tuple:
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


def validation_objective(bce: float, balance: float, settings: dict, contrastive: float | None = None) -> float:
    """The trained objective on the validation set: its BCE, plus for "balanced" λ times the squared defect,
    or for "contrastive" the mean NRE-C loss of the validation rows and their fixed atoms.

    The defect is that of the whole validation set, not a mean over batches of batch_size
    rows: a batch's squared defect also holds the batch mean's sampling variance, which falls
    as 1/batch_size (docs/training.md).
    """
    if settings["objective"] == "balanced":
        return bce + settings["balance_weight"] * balance**2
    if settings["objective"] == "contrastive":
        return contrastive
    return bce


def _validate(model, validation: tuple, device, settings: dict) -> dict:
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
    return {**classification_metrics(logits, labels), "balance": balance_defect(logits, labels),
            "contrastive": contrastive}


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


def batch_loss(logits: torch.Tensor, labels: torch.Tensor | None, batch_len: int, settings: dict,
               rt: runtime.Runtime):
    """This rank's loss to back-propagate for its shard of a global batch, and the shard's record.

    The record sums to the global batch's objective times its rows over ranks: the shard's
    BCE sum, plus (under DDP on rank 0 only) the balancing regulariser times the batch's rows.
    For "contrastive" (labels None) a row is a joint pair's K + 1 logits and the record the
    sum of their NRE-C losses.
    """
    if settings["objective"] == "contrastive":
        losses = contrast.contrastive_losses(logits.reshape(-1, settings["classes"] + 1), settings["gamma"])
        loss_sum, shard_len = losses.sum(), losses.shape[0]
        return loss_sum / max(shard_len, 1) * loss_scale(shard_len, batch_len, rt.train_world_size), loss_sum.detach()
    shard_len = labels.shape[0]
    loss_sum = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    # The shard mean times loss_scale: an empty shard (sum 0, scale 0) still joins the
    # all-reduce with zero gradients, and DDP's averaging yields the global-batch mean's gradient.
    loss = loss_sum / max(shard_len, 1) * loss_scale(shard_len, batch_len, rt.train_world_size)
    record = loss_sum.detach()
    if settings["objective"] == "balanced":
        surrogate, penalty = _balance_terms(logits, labels, settings["balance_weight"], rt)
        loss = loss + surrogate
        if rt.leads_training:   # the penalty is counted once, not once per DDP rank
            record = record + batch_len * penalty.detach()
    return loss, record


def _step(state: TrainingState, net, params, shard: tuple, batch_len: int, index: int, settings, rt) -> None:
    """One optimizer step on this rank's shard of a global batch; records its loss and gradient norm.

    Its parts are timed as the phases train.forward, train.loss, train.backward (with DDP's
    gradient communication inside) and train.optimizer (clipping included).
    """
    xb, yb = shard
    device = rt.device
    with probes.phase("train.forward", device=device), _autocast(device, settings["precision"]):
        logits = net(xb).reshape(-1)
    with probes.phase("train.loss", device=device):
        loss, record = batch_loss(logits.float(), yb, batch_len, settings, rt)
    scaled, clip = state.scaler.is_enabled(), settings["gradient_clip"]
    with probes.phase("train.backward", device=device):
        state.optimizer.zero_grad(set_to_none=True)
        (state.scaler.scale(loss) if scaled else loss).backward()
    with probes.phase("train.optimizer", device=device):
        if clip is not None:
            if scaled:
                state.scaler.unscale_(state.optimizer)
            state.norms[index] = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        if scaled:
            state.scaler.step(state.optimizer)
            state.scaler.update()
        else:
            state.optimizer.step()
    state.batch_losses[index] = record


def _joint_shard(state: TrainingState, xs, thetas, batch: tuple, index: int, settings, rt) -> tuple:
    """This rank's rows of a global batch of joint pairs, each followed by its atoms' re-paired rows.

    Returns ((inputs, labels), loss units of the global batch): labels 1/0 and 2B units for
    the binary objectives, no labels and B units (one NRE-C loss per pair) for "contrastive".
    """
    start, stop = batch
    atoms = contrast.batch_atoms(start, stop, contrast_classes(settings), state.seed, state.epoch, index)
    part = shard_slice(stop - start, rt.rank if rt.ddp else 0, rt.train_world_size)
    own = torch.arange(start, stop)[part]
    inputs = contrast.pair_rows(xs[start:stop][part], thetas, own.to(xs.device), atoms[part].to(xs.device))
    if settings["objective"] == "contrastive":
        return (inputs, None), stop - start
    return (inputs, contrast.binary_labels(own.shape[0], xs.device)), 2 * (stop - start)


def _run_epoch(state: TrainingState, net, x, y, settings, rt, runner: _HookRunner, joint: bool):
    """The rest of the current epoch; returns this rank's per-batch loss sums and gradient norms.

    `y` holds the labels of fixed pairs, or the θ of joint pairs (x then being their x).
    """
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
            shard, units = _joint_shard(state, xs, ys, (start, stop), index, settings, rt)
        else:
            part = shard_slice(stop - start, rt.rank if rt.ddp else 0, rt.train_world_size)
            shard, units = (xs[start:stop][part], ys[start:stop][part]), stop - start
        _step(state, net, params, shard, units, index, settings, rt)
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


def patience_exhausted(history: dict, settings: dict) -> bool:
    """True when the selected validation loss has not improved for `patience` epochs (never without patience)."""
    scores = selection_scores(history)
    if settings["patience"] is None or not scores:
        return False
    best = min(range(len(scores)), key=scores.__getitem__)      # the first epoch of the lowest loss
    return len(scores) - 1 - best >= settings["patience"]


def _close_epoch(state: TrainingState, batch_losses, norms, validation: tuple, settings, rt) -> dict:
    """Reduce the epoch's losses, validate, keep the checkpoint; returns the epoch's metrics."""
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
    if (settings["checkpoint"] == "best" and score < state.best_bce) or (
        settings["checkpoint"] == "last" and last
    ):
        state.best_bce = score
        state.best_weights = _cpu_copy(state.model.state_dict())
        history["selected_epoch"] = state.epoch + 1
    state.epoch += 1
    state.position = 0
    return {"train_loss": train_loss, **metrics, "objective": objective, "balance": balance}


def _train_epochs(state: TrainingState, net, tensors: tuple, validation: tuple, settings: dict, rt,
                  runner: _HookRunner) -> None:
    """The epoch loop: train, close and report each epoch, saving and stopping where agreed.

    It ends after `epochs`, or earlier once the selected validation loss has not improved
    for `patience` epochs (decided from the history, so a resumed training ends alike).
    """
    x, y = tensors
    joint = validation[1] is None
    while state.epoch < settings["epochs"] and not patience_exhausted(state.history, settings):
        began = time.monotonic()
        batch_losses, norms = _run_epoch(state, net, x, y, settings, rt, runner, joint)
        stop = runner.drain()
        metrics = _close_epoch(state, batch_losses, norms, validation, settings, rt)
        record = {**metrics, "seconds": time.monotonic() - began, "epochs": settings["epochs"]}
        runner.epoch_done(state, stop, record)


def timed_allreduce(rt: runtime.Runtime):
    """A DDP communication hook doing DDP's own averaging all-reduce, timed as the phase train.communicate.

    DDP's own averaging multiplies each gradient by 1/world as it fills the bucket (not a
    division: with 3 workers the two differ in the last bit), then sums over the workers.
    """
    if rt.device.type == "cuda":
        return _nccl_timed_allreduce(rt.device, rt.world_size)
    return _gloo_timed_allreduce(rt.world_size)


def _gloo_timed_allreduce(world: int):
    """The CPU (Gloo) hook: each bucket's all-reduce is waited for inside the hook.

    No Python then runs in Gloo's own threads: a Python callback there (what Future.then
    would run) can abort the process when it exits meanwhile. The price, for models of
    several buckets only (the bundled ones have one), is the all-reduce's overlap with the
    rest of the backward pass.
    """

    def hook(_, bucket):
        """Average one bucket's gradients over the workers, timing the all-reduce."""
        tensor = bucket.buffer().mul_(1.0 / world)
        with probes.phase(COMMUNICATE):
            dist.all_reduce(tensor)
        done = torch.futures.Future()
        done.set_result(tensor)
        return done
    return hook


def _nccl_timed_allreduce(device: torch.device, world: int):
    """The CUDA (NCCL) hook: a span from the hook's call to the all-reduce's completion callback.

    NCCL completes the future as it enqueues the work, so the callback runs at once in this
    thread and the host span is short. With NNPD_PROBES_CUDA=1 the device time is taken on a
    stream of its own that waits for the gradients, then (in the callback, whose current
    stream has waited for the all-reduce) for the all-reduce, so the compute stream waits
    for nothing more than it would. A bucket posted while another's span is still open
    counts as nested (no time).
    """
    timing = torch.cuda.Stream(device) if probes.DEVICE_TIMER is not None else None

    def hook(_, bucket):
        """Average one bucket's gradients over the workers, timing the all-reduce."""
        tensor = bucket.buffer().mul_(1.0 / world)
        if timing is not None:
            timing.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(timing) if timing is not None else contextlib.nullcontext():
            span = probes.phase(COMMUNICATE, device=device)
            span.__enter__()
        future = dist.all_reduce(tensor, async_op=True).get_future()

        def close(done):
            """End the span once the all-reduce is done; DDP reads the averaged bucket."""
            if timing is not None:
                timing.wait_stream(torch.cuda.current_stream(device))
            span.__exit__(None, None, None)
            return done.value()[0]
        return future.then(close)
    return hook


def _new_history(settings: dict, rows: int, rt: runtime.Runtime) -> dict:
    """The history of a training that has not started."""
    return {
        "train_loss": [],
        "validation": [],
        # Per epoch: the trained objective on the validation set (validation_objective) and the
        # set's balance defect (balance_defect); "selection" says which loss chose selected_epoch.
        "validation_objective": [],
        "validation_balance": [],
        "selection": settings["selection"],
        # Loss terms per epoch (train_loss is their mean): the rows of fixed pairs, twice the
        # joint pairs (each and its re-paired row) under "bce"/"balanced", the pairs under "contrastive".
        "rows_per_epoch": rows,
        "global_batch_size": settings["batch_size"],
        "world_size": rt.train_world_size,
        "selected_epoch": None,
        "epochs": settings["epochs"],
        "patience": settings["patience"],
        "stopped_epoch": None,      # the epoch after which `patience` ended training, if it did
    }


def _new_state(model, settings: dict, rt: runtime.Runtime, seed: int, rows: int) -> TrainingState:
    """A fresh training state for a model already on the device."""
    device = rt.device
    return TrainingState(
        model=model,
        optimizer=make_optimizer([p for p in model.parameters() if p.requires_grad], settings, device,
                                 scaled=settings["precision"] == "float16"),
        scaler=torch.amp.GradScaler(device.type, enabled=settings["precision"] == "float16"),
        generator=runtime.seeded_generator(seed, "permutation"),
        device=device,
        seed=seed,
        history=_new_history(settings, rows, rt),
    )


def _wrapped(model: torch.nn.Module, rt: runtime.Runtime):
    """The network the steps call: the model itself, or under DDP its wrapper (with a timed all-reduce)."""
    if not rt.ddp:
        return model
    device = rt.device
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if probes.MODE != "off":
        net.register_comm_hook(None, timed_allreduce(rt))
    return net


def train(model: torch.nn.Module, data, training_settings: dict, rt: runtime.Runtime, seed: int,
          hooks: TrainingHooks | None = None):
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
            _release_frames(error)
        raise


def _release_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames in a failed DDP training's tracebacks.

    They hold the DDP wrapper, whose reducer holds the process group, for as long as the
    exception lives: past runtime.stop, which must destroy the group (see there). The
    tracebacks keep their lines.
    """
    pending, seen = [error], set()
    while pending:
        error = pending.pop()
        if error is not None and id(error) not in seen:
            seen.add(id(error))
            traceback.clear_frames(error.__traceback__)
            pending += [error.__cause__, error.__context__]


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
        raise ValueError('training.objective "contrastive" needs joint pairs (train_x, train_theta, validation_x, '
                         'validation_theta), not fixed pairs with labels')
    with probes.phase("train.setup"):
        given = tuple(data[name] for name in (JOINT_ARRAYS if joint else TRAINING_ARRAYS))
        tensors = tuple(tensor.to(device=device, dtype=torch.float32) for tensor in given)
        validation = joint_validation(*tensors[2:], settings, seed) if joint else (*tensors[2:], None)
        model = model.to(device)
        model.train()
        net = _wrapped(model, rt)
        rows = int(tensors[0].shape[0])
        binary_pairs = joint and settings["objective"] != "contrastive"    # each joint row and its re-paired row
        state = _new_state(model, settings, rt, seed, 2 * rows if binary_pairs else rows)
        keeps_state = hooks is not None and (hooks.load_state is not None or hooks.saving)
        # Hashed as given (on the host, as the store loads it), not copied back from the GPU.
        identity = _identity(settings, seed, rt, given) if keeps_state else None
        runner = _HookRunner(hooks, rt, identity, len(epoch_batches(rows, settings["batch_size"])))
    # Dropout draws from torch's global stream: seed it per rank from the job's seed so the
    # same recipe gives the same weights whatever ran before in this process.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(runtime.derived_seed(seed, "dropout", rt.rank if rt.ddp else 0))
        runner.resume(state)
        _train_epochs(state, net, tensors[:2], validation, settings, rt, runner)
    return state.best_weights, state.history
