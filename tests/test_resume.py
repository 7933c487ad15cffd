"""Trainer hooks: resumable state saved to real files, cooperative preemption, progress reports."""

import io
import math
import pickle

import pytest
import torch

import runtime
import trainer
from helpers import BATCHES, CPU, EPOCHS, SEED, SETTINGS, Recorder, make_data, make_model, save_atomically

pytestmark = pytest.mark.unit


def train(hooks=None, model=None, settings=None, data=None):
    """Train the test problem."""
    return trainer.train(model or make_model(), data or make_data(), settings or SETTINGS, CPU, SEED, hooks=hooks)


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted training, without hooks."""
    return train()


def assert_same_training(result, reference):
    """Bitwise-equal weights and an equal history."""
    weights, history = result
    assert weights.keys() == reference[0].keys()
    assert all(torch.equal(weights[k], reference[0][k]) for k in weights)
    assert history == reference[1]


def stop_with_saved_state(path, stop_after, **settings_changes):
    """Train until the stop request after `stop_after` steps; return the Preempted raised."""
    recorder = Recorder(path, stop_after=stop_after)
    with pytest.raises(trainer.Preempted) as stopped:
        train(recorder.hooks(), settings={**SETTINGS, **settings_changes})
    return stopped.value


# ---------------------------------------------------------------- resume after a stop


@pytest.mark.parametrize("stop_after", [1, 6, 10, 11, 20, 29, 30])
def test_resume_after_a_stop_is_bitwise_identical(tmp_path, reference, stop_after):
    """Stops mid-epoch, at the last batch of an epoch and at the very last step all resume exactly."""
    path = tmp_path / "state.pt"
    stopped = stop_with_saved_state(path, stop_after)
    epoch, batch = (stop_after - 1) // BATCHES + 1, (stop_after - 1) % BATCHES + 1
    assert (stopped.epoch, stopped.batch, stopped.saved) == (epoch, batch, True)
    assert "run the same command again to resume" in str(stopped)
    recorder = Recorder(path)
    # Another initialisation: everything must come from the saved state.
    result = train(recorder.hooks(), model=make_model(seed=99))
    assert recorder.resumed == [(epoch, batch)]
    assert_same_training(result, reference)
    assert [e for e, _ in recorder.epochs] == list(range(epoch, EPOCHS + 1))


def test_every_periodic_save_resumes_bitwise(reference):
    """Saving after every step leaves the result unchanged, and each saved state resumes exactly."""
    states = []

    def keep(state):
        """Serialise each state as a file would hold it."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        states.append(buffer.getvalue())

    hooks = trainer.TrainingHooks(save_state=keep, save_seconds=1e-9)
    assert_same_training(train(hooks), reference)
    assert len(states) == EPOCHS * BATCHES + EPOCHS  # each step, and each epoch end
    for index in range(0, len(states), 4):
        blob = states[index]
        resumed = train(trainer.TrainingHooks(load_state=lambda: torch.load(io.BytesIO(blob), weights_only=True)))
        assert_same_training(resumed, reference)


def test_epoch_ends_are_saved_and_reported(tmp_path, reference):
    """An infinite interval saves at epoch ends only; on_epoch reports what the history holds."""
    saved = []
    recorder = Recorder(tmp_path / "state.pt")
    hooks = recorder.hooks(load=False)
    hooks.save_state = lambda state: saved.append((state["state"]["epoch"], state["state"]["position"]))
    assert_same_training(train(hooks), reference)
    assert saved == [(1, 0), (2, 0), (3, 0)]
    assert [epoch for epoch, _ in recorder.epochs] == [1, 2, 3]
    for (_, record), loss, metrics in zip(recorder.epochs, reference[1]["train_loss"], reference[1]["validation"]):
        assert record["train_loss"] == loss and record["epochs"] == EPOCHS and record["seconds"] >= 0
        assert {k: record[k] for k in ("bce", "accuracy", "auc")} == metrics
    assert recorder.resumed == []


def test_a_completed_state_returns_the_finished_training(tmp_path, reference):
    """A state saved at the last epoch end resumes into the same result without training more."""
    path = tmp_path / "state.pt"
    recorder = Recorder(path)
    assert_same_training(train(recorder.hooks()), reference)
    again = Recorder(path)
    assert_same_training(train(again.hooks()), reference)
    assert again.resumed == [(EPOCHS, BATCHES)] and again.epochs == [] and again.saves == 0


def test_stop_without_saving_raises_and_saves_nothing(tmp_path):
    """With save_seconds 0 a stop still stops, but nothing is written and the message says so."""
    recorder = Recorder(tmp_path / "state.pt", save_seconds=0, stop_after=4)
    with pytest.raises(trainer.Preempted, match="no state was saved") as stopped:
        train(recorder.hooks())
    assert (stopped.value.epoch, stopped.value.batch, stopped.value.saved) == (1, 4, False)
    assert recorder.saves == 0 and recorder.polls == 4
    assert not (tmp_path / "state.pt").exists()


def test_hooks_that_never_fire_change_nothing(reference):
    """Polling that never asks to stop gives the same result as no hooks at all."""
    hooks = trainer.TrainingHooks(stop_requested=lambda: False)
    assert_same_training(train(hooks), reference)
    assert_same_training(train(trainer.TrainingHooks()), reference)


def test_preempted_is_the_runtime_interruption_and_pickles_with_its_fields():
    assert trainer.Preempted is runtime.Preempted and issubclass(trainer.Preempted, KeyboardInterrupt)
    error = pickle.loads(pickle.dumps(trainer.Preempted(2, 7, True)))
    assert (error.epoch, error.batch, error.saved) == (2, 7, True)
    assert str(error) == str(trainer.Preempted(2, 7, True))


@pytest.mark.parametrize(
    "hooks, message",
    [
        (trainer.TrainingHooks(save_seconds=-1, save_state=print), "save_seconds"),
        (trainer.TrainingHooks(save_seconds=math.nan, save_state=print), "save_seconds"),
        (trainer.TrainingHooks(save_seconds="60", save_state=print), "save_seconds"),
        (trainer.TrainingHooks(save_seconds=60), "needs a save_state"),
    ],
)
def test_hooks_refuse_bad_intervals(hooks, message):
    with pytest.raises(ValueError, match=message):
        train(hooks)


# ---------------------------------------------------------------- damaged or incompatible states


def _rewrite(path, change):
    """Load the state at `path`, apply `change` to it, and save it back."""
    state = torch.load(path, weights_only=True)
    change(state)
    save_atomically(state, path)


def _truncate(path):
    """Keep the first half of the file: a torn write without the atomic rename."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _optimizer_shapes(state):
    """Give the first parameter's Adam moments the wrong shape."""
    entry = state["state"]["optimizer"]["state"][0]
    entry["exp_avg"] = entry["exp_avg"].reshape(-1)


DAMAGES = {
    "garbage": (lambda path: path.write_bytes(b"not a torch file at all"), "Error"),
    "truncated": (_truncate, "Error"),
    "format": (lambda path: _rewrite(path, lambda s: s.update(format="nnpd-training-state-0")), "format"),
    "missing key": (lambda path: _rewrite(path, lambda s: s.pop("ranks")), "keys"),
    "world size": (
        lambda path: _rewrite(path, lambda s: s["identity"].update(world_size=2)),
        "number of training ranks",
    ),
    "settings": (
        lambda path: _rewrite(path, lambda s: s["identity"]["settings"].update(learning_rate=0.5)),
        "settings",
    ),
    "data": (lambda path: _rewrite(path, lambda s: s["identity"].update(data="0" * 64)), "data"),
    "optimizer shapes": (lambda path: _rewrite(path, _optimizer_shapes), "optimizer"),
    "progress": (lambda path: _rewrite(path, lambda s: s["state"].update(position=BATCHES + 1)), "progress"),
    "history": (lambda path: _rewrite(path, lambda s: s["state"]["history"]["train_loss"].append(1.0)), "history"),
    # Passes every check and fails while loading, after the model was loaded: must be rolled back.
    "generator": (
        lambda path: _rewrite(path, lambda s: s["state"].update(generator=torch.zeros(3, dtype=torch.uint8))),
        "RuntimeError",
    ),
    "not a dict": (lambda path: save_atomically([1, 2, 3], path), "format"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_or_incompatible_state_is_ignored_with_one_warning(tmp_path, reference, damage):
    """The training starts afresh (bitwise the uninterrupted one), with one warning naming why."""
    path = tmp_path / "state.pt"
    stop_with_saved_state(path, stop_after=15)
    spoil, reason = DAMAGES[damage]
    spoil(path)
    recorder = Recorder(path)
    with pytest.warns(UserWarning) as caught:
        result = train(recorder.hooks(load=True))
    messages = [str(w.message) for w in caught if "saved training state" in str(w.message)]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert messages[0].startswith("ignoring the saved training state (") and reason in messages[0]
    assert recorder.resumed == []
    assert_same_training(result, reference)


def test_a_state_of_another_model_shape_is_ignored(tmp_path, reference):
    """Same settings and data but a wider network: the shapes give it away."""
    path = tmp_path / "state.pt"
    recorder = Recorder(path, stop_after=5)
    with pytest.raises(trainer.Preempted):
        train(recorder.hooks(), model=make_model(hidden=8))
    with pytest.warns(UserWarning, match="shapes differ"):
        result = train(Recorder(path).hooks())
    assert_same_training(result, reference)
