"""The bundled trainer: exact global-batch sharding, mixed precision, clipping, checkpoints."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import runtime
from inference import classification_metrics
from settings import SettingsError, is_integer, is_number

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
}
OPTIMIZERS = ("adam", "adamw")
CHECKPOINTS = ("best", "last")
VALIDATION_CHUNK = 65536  # rows per validation forward, bounding memory on large sets


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


def _positive_int(settings: dict, key: str) -> None:
    """Require settings[key] to be an integer >= 1."""
    value = settings[key]
    if not is_integer(value) or value < 1:
        raise SettingsError(f"training.{key}: expected an integer >= 1; got {value!r}")


def check_training_settings(training_settings: dict | None) -> dict:
    """Validate the `training` settings and return them with defaults filled in."""
    given = dict(training_settings or {})
    unknown = sorted(set(given) - set(TRAINING_DEFAULTS))
    if unknown:
        raise SettingsError(f"training.{unknown[0]}: unknown setting; valid keys are {sorted(TRAINING_DEFAULTS)}")
    s = {**TRAINING_DEFAULTS, **given}
    _positive_int(s, "epochs")
    _positive_int(s, "batch_size")
    if s["optimizer"] not in OPTIMIZERS:
        raise SettingsError(f"training.optimizer: {s['optimizer']!r} is not valid; use \"adam\" or \"adamw\"")
    for key in ("learning_rate", "epsilon"):
        if not is_number(s[key]) or not s[key] > 0 or not math.isfinite(s[key]):
            raise SettingsError(f"training.{key}: expected a finite number > 0; got {s[key]!r}")
    if not is_number(s["weight_decay"]) or not 0 <= s["weight_decay"] < math.inf:
        raise SettingsError(f"training.weight_decay: expected a finite number >= 0; got {s['weight_decay']!r}")
    betas = s["betas"]
    if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(is_number(b) and 0 <= b < 1 for b in betas):
        raise SettingsError(f"training.betas: expected two numbers in [0, 1), e.g. [0.9, 0.999]; got {betas!r}")
    clip = s["gradient_clip"]
    if clip is not None and (not is_number(clip) or not 0 < clip < math.inf):
        raise SettingsError(f"training.gradient_clip: expected None or a finite number > 0; got {clip!r}")
    if s["precision"] not in runtime.PRECISIONS:
        raise SettingsError(f"training.precision: {s['precision']!r} is not valid; use \"off\", \"float16\" or \"bfloat16\"")
    if s["checkpoint"] not in CHECKPOINTS:
        raise SettingsError(f"training.checkpoint: {s['checkpoint']!r} is not valid; use \"best\" or \"last\"")
    s["betas"] = [float(b) for b in betas]
    return s


# ---------------------------------------------------------------- training state


@dataclass
class TrainingState:
    """All mutable training state in one place: saved and resumed as a whole."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    generator: torch.Generator
    epoch: int = 0
    position: int = 0
    # Generator state before the current epoch's permutation, so a resume redraws it.
    epoch_rng: torch.Tensor | None = None

    def state_dict(self) -> dict:
        """Everything needed to continue training exactly where it stopped."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "generator": self.generator.get_state(),
            "epoch_rng": self.epoch_rng,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.generator.set_state(state["generator"])
        self.epoch_rng = state["epoch_rng"]
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])

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


def make_optimizer(params, settings: dict, device: torch.device) -> torch.optim.Optimizer:
    """Adam or AdamW with the settings' hyper-parameters."""
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


# ---------------------------------------------------------------- the loop


def _check_data(data: dict) -> None:
    """Refuse data the trainer cannot use, naming the key."""
    for key in ("train_inputs", "train_labels", "validation_inputs", "validation_labels"):
        if key not in data:
            raise KeyError(f"training data lacks {key!r}")
    for part in ("train", "validation"):
        inputs, labels = data[f"{part}_inputs"], data[f"{part}_labels"]
        if inputs.ndim != 2 or labels.ndim != 1 or inputs.shape[0] != labels.shape[0] or inputs.shape[0] == 0:
            raise ValueError(f"{part} data must be non-empty (rows, features) inputs with (rows,) labels")


def _validate(model, inputs, labels, device, precision) -> dict:
    """Validation metrics of the unwrapped model; a non-finite logit is an error."""
    was_training = model.training
    model.eval()
    with torch.no_grad(), _autocast(device, precision):
        logits = torch.cat([model(chunk).float().reshape(-1) for chunk in inputs.split(VALIDATION_CHUNK)])
    model.train(was_training)
    if not bool(torch.isfinite(logits).all()):
        raise FloatingPointError("non-finite validation logit; the model diverged (lower training.learning_rate?)")
    return classification_metrics(logits, labels)


def _shared_validation(model, vx, vy, precision, rt) -> dict:
    """Validate on rank 0 only (DDP) and share the result, errors included, with every rank."""
    if not rt.ddp:
        return _validate(model, vx, vy, rt.device, precision)
    outcome = None
    if rt.is_main:
        try:
            outcome = _validate(model, vx, vy, rt.device, precision)
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


def _run_epoch(state, net, x, y, settings, rt, device):
    """One epoch of consecutive global batches; returns this rank's per-batch loss sums and grad norms."""
    rows = x.shape[0]
    world = rt.train_world_size
    perm = state.permutation(rows).to(device)
    # One gather per epoch makes every global batch a contiguous view.
    xs, ys = x.index_select(0, perm), y.index_select(0, perm)
    batches = epoch_batches(rows, settings["batch_size"])
    batch_losses = torch.zeros(len(batches), device=device)
    clip, precision = settings["gradient_clip"], settings["precision"]
    norms = torch.zeros(len(batches), device=device) if clip is not None else None
    params = [p for p in state.model.parameters() if p.requires_grad]
    scaled = state.scaler.is_enabled()
    for index in range(state.position, len(batches)):
        start, stop = batches[index]
        part = shard_slice(stop - start, rt.rank if rt.ddp else 0, world)
        xb, yb = xs[start:stop][part], ys[start:stop][part]
        with _autocast(device, precision):
            logits = net(xb).reshape(-1)
        # The shard mean times loss_scale: an empty shard (sum 0, scale 0) still joins the
        # all-reduce with zero gradients, and DDP's averaging yields the global-batch mean's gradient.
        shard_len = yb.shape[0]
        loss_sum = F.binary_cross_entropy_with_logits(logits.float(), yb, reduction="sum")
        loss = loss_sum / max(shard_len, 1) * loss_scale(shard_len, stop - start, world)
        state.optimizer.zero_grad(set_to_none=True)
        if scaled:
            state.scaler.scale(loss).backward()
        else:
            loss.backward()
        if clip is not None:
            if scaled:
                state.scaler.unscale_(state.optimizer)
            norms[index] = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        if scaled:
            state.scaler.step(state.optimizer)
            state.scaler.update()
        else:
            state.optimizer.step()
        batch_losses[index] = loss_sum.detach()
        state.position = index + 1
    if scaled and norms is not None:
        # With float16 an overflowing norm is the scaler's business: it skips that step.
        norms = None
    return batch_losses, norms


def train(model: torch.nn.Module, data: dict, training_settings: dict, rt: runtime.Runtime, seed: int):
    """Train a logit-returning classifier; returns (CPU state dict, history)."""
    settings = check_training_settings(training_settings)
    device = rt.device
    runtime.check_precision(settings["precision"], device)
    _check_data(data)
    x = data["train_inputs"].to(device=device, dtype=torch.float32)
    y = data["train_labels"].to(device=device, dtype=torch.float32)
    vx = data["validation_inputs"].to(device=device, dtype=torch.float32)
    vy = data["validation_labels"].to(device=device, dtype=torch.float32)
    model = model.to(device)
    model.train()
    net = model
    if rt.ddp:
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    state = TrainingState(
        model=model,
        optimizer=make_optimizer([p for p in model.parameters() if p.requires_grad], settings, device),
        scaler=torch.amp.GradScaler(device.type, enabled=settings["precision"] == "float16"),
        generator=runtime.seeded_generator(seed, "permutation"),
    )
    history = {
        "train_loss": [],
        "validation": [],
        "rows_per_epoch": int(x.shape[0]),
        "global_batch_size": settings["batch_size"],
        "world_size": rt.train_world_size,
        "selected_epoch": None,
        "epochs": settings["epochs"],
    }
    # Dropout draws from torch's global stream: seed it per rank from the job's seed so the
    # same recipe gives the same weights whatever ran before in this process.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(runtime.derived_seed(seed, "dropout", rt.rank if rt.ddp else 0))
        return _train_epochs(state, net, model, (x, y, vx, vy), settings, rt, history)


def _train_epochs(state, net, model, tensors, settings, rt, history):
    """The epoch loop with validation and checkpoint selection; returns (weights, history)."""
    x, y, vx, vy = tensors
    device = rt.device
    best_bce, best_weights = math.inf, None
    while state.epoch < settings["epochs"]:
        batch_losses, norms = _run_epoch(state, net, x, y, settings, rt, device)
        if rt.ddp:
            # One collective per epoch: every rank sees the same losses and fails together.
            # Gradient norms need no reduction: after the all-reduce every rank has the same grads.
            runtime.all_reduce_sum(rt, batch_losses)
        total = batch_losses.sum()
        finite = bool(torch.isfinite(total)) and (norms is None or bool(torch.isfinite(norms).all()))
        if not finite:
            _raise_non_finite(state.epoch, batch_losses, norms)
        history["train_loss"].append(total.item() / x.shape[0])
        metrics = _shared_validation(model, vx, vy, settings["precision"], rt)
        history["validation"].append(metrics)
        last = state.epoch + 1 == settings["epochs"]
        if (settings["checkpoint"] == "best" and metrics["bce"] < best_bce) or (
            settings["checkpoint"] == "last" and last
        ):
            best_bce = metrics["bce"]
            best_weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            history["selected_epoch"] = state.epoch + 1
        state.epoch += 1
        state.position = 0
    return best_weights, history
