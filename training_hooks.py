"""The hooks a caller passes to train(), and the runner that calls them: resumes, saves and
stops at steps every rank agrees on, and reports epochs.

Apart from the loop (trainer.py) because this is where the trainer meets its caller's
storage and signals: jobs.py builds TrainingHooks from it without the loop, and the runner
joins the resumable state (training_state.py) with DDP's flag exchange (ddp.py).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable

import probes
import runtime
import training_state
from ddp import FlagExchange
from settings import is_number
from training_state import TrainingState

__all__ = ["TrainingHooks", "HookRunner"]


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
      at the same step, saves (when saving) and raises Preempted (runtime.Preempted).
    - on_epoch(epoch, record): after each epoch (under DDP rank 0 only); record holds train_loss, bce,
      accuracy, auc, objective and balance (the validation objective and balance defect, see
      trainer.validation_objective), objective_name (what that objective is called: trainer.LOSS_NAMES),
      seconds (the epoch's wall time) and epochs (the total).
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
            raise ValueError(
                f"TrainingHooks.save_seconds: expected a number >= 0 (0 = never save); got {self.save_seconds!r}"
            )
        if self.save_seconds > 0 and self.save_state is None:
            raise ValueError("TrainingHooks.save_seconds > 0 needs a save_state callable")

    @property
    def saving(self) -> bool:
        """True when states are saved (periodically and at epoch ends)."""
        return self.save_state is not None and self.save_seconds > 0


# ---------------------------------------------------------------- hooks at agreed steps


class HookRunner:
    """Calls the hooks: resumes, saves and stops at steps every rank agrees on, reports epochs.

    `stop_requested` is polled after every step. One process acts on it, and on its clock
    for periodic saves, at once; under DDP a ddp.FlagExchange agrees on both (rank 0's clock
    alone decides when a save is due), and every epoch end agrees on stopping.
    """

    def __init__(
        self,
        hooks: TrainingHooks | None,
        rt: runtime.Runtime,
        identity: dict | None,
        n_batches: int,
        exchange_seconds: float,
    ):
        # No hooks are hooks with nothing set: every call below then finds its callable None.
        self.hooks = hooks if hooks is not None else TrainingHooks()
        self.rt, self.identity, self.n_batches = rt, identity or {}, n_batches
        self.polling = self.hooks.stop_requested is not None
        self.saving = self.hooks.saving
        self.active = self.polling or self.saving
        self.exchange = FlagExchange(rt, exchange_seconds) if rt.ddp and self.active else None
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
            saved = training_state.saved_state(state, self.rt, self.identity)
            if saved is not None and self.hooks.save_state is not None:
                self.hooks.save_state(saved)
        self.last_save = time.monotonic()

    def _stop(self, state: TrainingState) -> None:
        """Raise Preempted once every rank is done, so no rank leaves while rank 0 still writes."""
        if self.saving and self.rt.ddp:
            runtime.barrier(self.rt)
        raise runtime.Preempted(*self.progress(state), saved=self.saving)

    def after_step(self, state: TrainingState) -> None:
        """Poll for a stop; save and stop when agreed; under DDP offer this step's flags."""
        if not self.active:
            return
        poll = self.hooks.stop_requested
        self.stop_seen = self.stop_seen or (poll is not None and bool(poll()))
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
        if self.hooks.on_epoch is not None and self.rt.leads_training:
            self.hooks.on_epoch(state.epoch, record)
        if stop:
            self._stop(state)

    def _load(self, state: TrainingState) -> tuple[bool, str | None, str | None]:
        """Load and apply this rank's saved state: (found one, why it is unusable, its save id)."""
        saved, problem, load = None, None, self.hooks.load_state
        try:
            saved = load() if load is not None else None
            if saved is not None:
                problem = training_state.state_problem(saved, state, self.identity, self.n_batches)
                if problem is None:
                    training_state.apply_saved_state(saved, state, self.rt)
        except KeyboardInterrupt:  # a stop (runtime.Interrupted is also an Exception) is never swallowed
            raise
        except Exception as error:  # a damaged state must never stop a training that can start afresh
            problem = training_state.one_line(error)
        save_id = saved.get("save_id") if isinstance(saved, dict) else None
        return saved is not None or problem is not None, problem, save_id

    def resume(self, state: TrainingState) -> None:
        """Continue from the saved state when every rank can; otherwise warn once and start afresh."""
        if self.hooks.load_state is None:
            return
        fresh = state.state_dict(), training_state.global_rng(self.rt.device)
        report = self._load(state)
        reports = runtime.all_gather_object(self.rt, report) if self.rt.ddp else [report]
        if not any(found for found, _, _ in reports):
            return
        problem = training_state.first_problem(reports)
        if problem is None:
            if self.hooks.on_resume is not None and self.rt.leads_training:
                self.hooks.on_resume(*self.progress(state))
            return
        state.load_state_dict(fresh[0])
        training_state.set_global_rng(fresh[1], self.rt.device)
        if self.rt.leads_training:
            warnings.warn(
                f"ignoring the saved training state ({problem}); training starts from the beginning", stacklevel=3
            )
