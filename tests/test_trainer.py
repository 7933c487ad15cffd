"""The bundled trainer: sharding properties, metrics, and real training on tiny data."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import analysis_metrics
import runtime
import trainer
from settings import SettingsError

CPU = runtime.Runtime(device=torch.device("cpu"))
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---------------------------------------------------------------- sharding math


@given(rows=st.integers(0, 500), batch_size=st.integers(1, 80))
@pytest.mark.property
def test_epoch_batches_cover_every_row_once_in_order(rows, batch_size):
    batches = trainer.epoch_batches(rows, batch_size)
    covered = [i for start, stop in batches for i in range(start, stop)]
    assert covered == list(range(rows))
    assert all(stop - start == batch_size for start, stop in batches[:-1])
    assert all(0 < stop - start <= batch_size for start, stop in batches)


@given(batch_len=st.integers(1, 300), world_size=st.integers(1, 400))
@pytest.mark.property
def test_every_index_of_a_batch_is_in_exactly_one_shard(batch_len, world_size):
    indices = range(batch_len)
    shards = [list(indices[trainer.shard_slice(batch_len, r, world_size)]) for r in range(world_size)]
    assert sorted(i for shard in shards for i in shard) == list(indices)
    sizes = trainer.shard_sizes(batch_len, world_size)
    assert sizes == [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == batch_len
    # World sizes beyond the batch leave the high ranks empty, never the low ones.
    assert sizes.count(0) == max(0, world_size - batch_len)
    if world_size > batch_len:
        assert sizes[batch_len:] == [0] * (world_size - batch_len)


@given(batch_len=st.integers(1, 200), world_size=st.integers(1, 300))
@pytest.mark.property
def test_shard_slices_work_on_tensors_including_empty_ones(batch_len, world_size):
    batch = torch.arange(batch_len)
    parts = [batch[trainer.shard_slice(batch_len, r, world_size)] for r in range(world_size)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, batch)
    assert [len(p) for p in parts] == trainer.shard_sizes(batch_len, world_size)


@settings(max_examples=200)
@given(
    losses=st.lists(st.floats(0, 50, allow_nan=False), min_size=1, max_size=120),
    world_size=st.integers(1, 150),
)
@pytest.mark.property
def test_loss_scales_sum_to_world_size_and_reproduce_the_global_mean(losses, world_size):
    batch_len = len(losses)
    scales, weighted = [], 0.0
    for rank in range(world_size):
        shard = losses[trainer.shard_slice(batch_len, rank, world_size)]
        scale = trainer.loss_scale(len(shard), batch_len, world_size)
        scales.append(scale)
        if shard:  # an empty shard contributes zero weight
            weighted += scale * (sum(shard) / len(shard))
    assert math.isclose(sum(scales), world_size, rel_tol=1e-12)
    assert math.isclose(weighted / world_size, sum(losses) / batch_len, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.unit
def test_sharding_rejects_bad_arguments():
    with pytest.raises(ValueError):
        trainer.shard_slice(4, 2, 2)
    with pytest.raises(ValueError):
        trainer.epoch_batches(4, 0)
    with pytest.raises(ValueError):
        trainer.loss_scale(0, 0, 2)


# ---------------------------------------------------------------- metrics


@pytest.mark.unit
def test_classification_metrics_by_hand():
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0])
    m = analysis_metrics.classification_metrics(logits, labels)
    bce = [math.log1p(math.exp(-2.0)), math.log1p(math.exp(-1.0)), math.log1p(math.exp(0.5)), math.log1p(math.exp(3.0))]
    assert m["bce"] == pytest.approx(sum(bce) / 4, rel=1e-12)
    assert m["accuracy"] == pytest.approx(0.5)  # rows 1 and 2 right
    # pairs (pos, neg): (2,-1) win, (2,0.5) win, (-3,-1) loss, (-3,0.5) loss -> 2/4
    assert m["auc"] == pytest.approx(0.5)


@pytest.mark.unit
def test_auc_counts_ties_as_half():
    logits = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0])
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0])
    # positives 1.0 and 2.0 vs negatives 1.0,1.0,0.0: 1.0 -> 0.5+0.5+1, 2.0 -> 3 ; total 5/6
    assert analysis_metrics.classification_metrics(logits, labels)["auc"] == pytest.approx(5 / 6)
    all_tied = analysis_metrics.classification_metrics(torch.zeros(4), torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert all_tied["auc"] == pytest.approx(0.5)


@pytest.mark.unit
def test_auc_is_none_when_one_class_is_absent_and_bce_is_stable():
    m = analysis_metrics.classification_metrics(torch.tensor([800.0, -800.0]), torch.tensor([1.0, 1.0]))
    assert m["auc"] is None
    assert m["bce"] == pytest.approx(400.0) and m["accuracy"] == 0.5


# ---------------------------------------------------------------- settings


@pytest.mark.unit
def test_training_settings_validation():
    assert trainer.check_training_settings({}) == trainer.TRAINING_DEFAULTS
    for changed, key in [
        ({"epochs": 0}, "training.epochs"),
        ({"batch_size": 2.0}, "training.batch_size"),
        ({"optimizer": "sgd"}, "training.optimizer"),
        ({"learning_rate": -1}, "training.learning_rate"),
        ({"betas": [0.9]}, "training.betas"),
        ({"epsilon": 0}, "training.epsilon"),
        ({"weight_decay": -0.1}, "training.weight_decay"),
        ({"gradient_clip": 0}, "training.gradient_clip"),
        ({"precision": "half"}, "training.precision"),
        ({"checkpoint": "first"}, "training.checkpoint"),
        ({"epoch": 3}, "training.epoch"),
        ({"objective": "focal"}, "training.objective"),
        ({"balance_weight": -1}, "training.balance_weight"),
        ({"balance_weight": math.inf}, "training.balance_weight"),
        ({"balance_weight": math.nan}, "training.balance_weight"),
        ({"balance_weight": "100"}, "training.balance_weight"),
        ({"balance_weight": True}, "training.balance_weight"),
        ({"selection": "balanced"}, "training.selection"),
        ({"selection": None}, "training.selection"),
        ({"selection": ["bce"]}, "training.selection"),
    ]:
        with pytest.raises(SettingsError, match=key):
            trainer.check_training_settings(changed)


@pytest.mark.unit
def test_float16_on_cpu_is_refused_before_training():
    model = _model()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(SettingsError, match="training.precision"):
        trainer.train(model, _data(), {"precision": "float16"}, CPU, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---------------------------------------------------------------- training on tiny data


def _data(rows=300, validation=100, seed=0):
    """A linearly separable-ish problem with a little label noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows + validation, 2, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] + 0.3 * torch.randn(rows + validation, generator=g) > 0).float()
    return {
        "train_inputs": x[:rows],
        "train_labels": y[:rows],
        "validation_inputs": x[rows:],
        "validation_labels": y[rows:],
    }


def _model(seed=0):
    """A tiny MLP returning (rows,) logits."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1), torch.nn.Flatten(0))


def _train(settings, data=None, model=None, seed=0, rt=CPU):
    """Train with defaults for the tests."""
    return trainer.train(model or _model(), data or _data(), {"batch_size": 32, **settings}, rt, seed)


@pytest.mark.unit
def test_training_lowers_the_loss_and_reports_history():
    weights, history = _train({"epochs": 4, "learning_rate": 0.02})
    losses = history["train_loss"]
    assert len(losses) == 4 and losses[-1] < losses[0] * 0.8
    assert history["validation"][-1]["accuracy"] > 0.8 and history["validation"][-1]["auc"] > 0.85
    assert history["rows_per_epoch"] == 300 and history["global_batch_size"] == 32
    assert history["world_size"] == 1 and history["epochs"] == 4
    assert all(t.device.type == "cpu" for t in weights.values())
    assert set(weights) == set(_model().state_dict())


@pytest.mark.unit
def test_epoch_loss_is_the_per_row_mean_over_the_epoch():
    # With learning rate ~0, the epoch loss equals the BCE of the initial model on all train rows.
    data = _data()
    model = _model()
    with torch.no_grad():
        expected = torch.nn.functional.binary_cross_entropy_with_logits(
            model(data["train_inputs"]), data["train_labels"]
        ).item()
    _, history = _train({"epochs": 1, "learning_rate": 1e-12, "batch_size": 37}, data=data, model=_model())
    assert history["train_loss"][0] == pytest.approx(expected, rel=1e-5)


@pytest.mark.unit
def test_best_keeps_the_lowest_validation_epoch_and_last_the_final_one():
    # A learning rate this high makes validation BCE bounce, so best and last differ.
    settings = {"epochs": 6, "learning_rate": 0.5, "batch_size": 16}
    best, h_best = _train({**settings, "checkpoint": "best"})
    last, h_last = _train({**settings, "checkpoint": "last"})
    bces = [v["bce"] for v in h_best["validation"]]
    assert h_best["selected_epoch"] == bces.index(min(bces)) + 1
    assert h_last["selected_epoch"] == 6
    assert h_best["train_loss"] == h_last["train_loss"]  # same run, different keep
    model = _model()
    model.load_state_dict(best)
    data = _data()
    logits = model(data["validation_inputs"]).detach()
    again = analysis_metrics.classification_metrics(logits, data["validation_labels"])["bce"]
    assert again == pytest.approx(min(bces), rel=1e-5)
    if h_best["selected_epoch"] != 6:
        assert any(not torch.equal(best[k], last[k]) for k in best)


@pytest.mark.unit
def test_adamw_with_clipping_trains_and_differs_from_adam():
    plain, _ = _train({"epochs": 2, "learning_rate": 0.05})
    decayed, history = _train(
        {"epochs": 2, "learning_rate": 0.05, "optimizer": "adamw", "weight_decay": 0.5, "gradient_clip": 0.01}
    )
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert any(not torch.allclose(plain[k], decayed[k]) for k in plain)


def _step_size(weights, start):
    """L2 norm of the change of all parameters."""
    return math.sqrt(sum(float(((weights[k] - start[k]) ** 2).sum()) for k in start))


@pytest.mark.unit
def test_gradient_clip_bounds_the_global_norm():
    # One full-batch Adam step with a huge epsilon moves parameters by about lr * gradient,
    # so the step's L2 norm shows the (clipped) global gradient norm.
    start = _model().state_dict()
    settings = {"epochs": 1, "learning_rate": 1.0, "epsilon": 10.0, "batch_size": 300, "checkpoint": "last"}
    clipped, _ = _train({**settings, "gradient_clip": 1e-3})
    free, _ = _train(settings)
    assert 0 < _step_size(clipped, start) <= 1e-3 / 10 * 1.001
    assert _step_size(free, start) > 20 * _step_size(clipped, start)


def _layer_output_dtypes(precision):
    """(dtypes the model's linear layers computed in, weights, history) of a short training at a precision."""
    model, seen = _model(), set()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_hook(lambda module, inputs, output: seen.add(output.dtype))
    weights, history = _train({"epochs": 2, "learning_rate": 0.02, "precision": precision}, model=model)
    return seen, weights, history


@pytest.mark.unit
def test_bfloat16_on_cpu_runs():
    seen, weights, history = _layer_output_dtypes("bfloat16")
    assert seen == {torch.bfloat16}  # autocast: the layers compute in bfloat16
    assert _layer_output_dtypes("off")[0] == {torch.float32}  # (which the hooks would see otherwise)
    assert len(history["train_loss"]) == 2 and all(math.isfinite(v) for v in history["train_loss"])
    assert all(math.isfinite(record["bce"]) for record in history["validation"])
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in weights.values())  # master weights


@pytest.mark.unit
def test_non_finite_input_raises_naming_epoch_and_batch():
    data = _data()
    data["train_inputs"] = data["train_inputs"].clone()
    data["train_inputs"][5, 0] = math.inf
    with pytest.raises(FloatingPointError, match=r"epoch 1, batch \d+"):
        _train({"epochs": 2}, data=data)


@pytest.mark.unit
def test_non_finite_validation_logit_raises():
    data = _data()
    data["validation_inputs"] = data["validation_inputs"].clone()
    data["validation_inputs"][0, 0] = math.nan
    with pytest.raises(FloatingPointError, match="validation"):
        _train({"epochs": 1}, data=data)


@pytest.mark.unit
def test_same_seed_gives_identical_weights_and_other_seed_differs():
    a, ha = _train({"epochs": 2}, seed=3)
    b, hb = _train({"epochs": 2}, seed=3)
    c, _ = _train({"epochs": 2}, seed=4)
    assert all(torch.equal(a[k], b[k]) for k in a) and ha == hb
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.unit
def test_dropout_training_is_reproducible_whatever_ran_before():
    def dropout_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1), torch.nn.Flatten(0)
        )

    models = dropout_model(), dropout_model()
    first, _ = _train({"epochs": 2}, model=models[0], seed=5)
    torch.rand(1000)  # the global stream moves on between the two trainings
    second, _ = _train({"epochs": 2}, model=models[1], seed=5)
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.unit
def test_training_state_round_trips_and_redraws_the_epoch_permutation():
    model = _model()
    settings = trainer.check_training_settings({})
    state = trainer.TrainingState(
        model=model,
        optimizer=trainer.make_optimizer(model.parameters(), settings, torch.device("cpu")),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        generator=runtime.seeded_generator(1, "permutation"),
    )
    model(torch.randn(4, 2)).sum().backward()
    state.optimizer.step()
    first = state.permutation(50)
    state.epoch, state.position = 2, 7  # mid-epoch
    saved = state.state_dict()
    other_model = _model(seed=9)
    other = trainer.TrainingState(
        model=other_model,
        optimizer=trainer.make_optimizer(other_model.parameters(), settings, torch.device("cpu")),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        generator=torch.Generator(),
    )
    other.load_state_dict(saved)
    assert (other.epoch, other.position) == (2, 7)
    assert all(torch.equal(model.state_dict()[k], other_model.state_dict()[k]) for k in model.state_dict())
    assert torch.equal(
        other.optimizer.state_dict()["state"][0]["exp_avg"], state.optimizer.state_dict()["state"][0]["exp_avg"]
    )
    assert torch.equal(other.permutation(50), first)  # resume mid-epoch redraws the same order
    other.position = 0
    assert not torch.equal(other.permutation(50), first)  # a new epoch draws a new one


# ---------------------------------------------------------------- balanced objective


def _balanced_formula(logits, labels, weight):
    """Mean BCE plus weight * (mean sigmoid of joint rows + mean sigmoid of product rows - 1)^2."""
    p = torch.sigmoid(logits)
    gap = p[labels > 0.5].mean() + p[labels < 0.5].mean() - 1
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels) + weight * gap**2


def _gradients(loss, model):
    """Gradients of `loss` with respect to the model's parameters."""
    return torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.unit
def test_balanced_loss_gradient_is_autograd_of_the_formula_on_the_full_batch():
    data, model = _data(), _model()
    x, y = data["train_inputs"], data["train_labels"]
    settings = trainer.check_training_settings({"objective": "balanced", "balance_weight": 3.0})
    loss, record = trainer.batch_loss(model(x), y, len(y), trainer.objective_of(settings), CPU)
    formula = _balanced_formula(model(x), y, 3.0)
    for got, want in zip(_gradients(loss, model), _gradients(formula, model)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert record.item() / len(y) == pytest.approx(formula.item(), rel=1e-6)
    # The regulariser really matters here: BCE alone has another gradient.
    bce = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
    formula = _balanced_formula(model(x), y, 3.0)
    assert any(not torch.allclose(a, b, rtol=1e-3) for a, b in zip(_gradients(bce, model), _gradients(formula, model)))


@pytest.mark.unit
def test_a_batch_of_one_class_has_no_balance_term():
    model = _model()
    x = _data()["train_inputs"][:10]
    settings = trainer.check_training_settings({"objective": "balanced", "balance_weight": 50.0})
    for labels in (torch.ones(10), torch.zeros(10)):
        loss, record = trainer.batch_loss(model(x), labels, 10, trainer.objective_of(settings), CPU)
        bce = torch.nn.functional.binary_cross_entropy_with_logits(model(x), labels)
        assert loss.item() == pytest.approx(bce.item(), rel=1e-6)
        assert record.item() == pytest.approx(10 * bce.item(), rel=1e-6)
        for got, want in zip(_gradients(loss, model), _gradients(bce, model)):
            torch.testing.assert_close(got, want)


@pytest.mark.unit
def test_one_balanced_training_step_follows_the_formula_gradient():
    # Adam's first full-batch step moves each parameter by -lr * g / (|g| + epsilon).
    start, data, lr, epsilon = _model(), _data(), 0.01, 0.1
    settings = {
        "epochs": 1,
        "batch_size": 300,
        "learning_rate": lr,
        "epsilon": epsilon,
        "checkpoint": "last",
        "objective": "balanced",
        "balance_weight": 5.0,
    }
    trained, _ = _train(settings, data=data)
    want = _gradients(_balanced_formula(start(data["train_inputs"]), data["train_labels"], 5.0), start)
    for (name, before), gradient in zip(start.state_dict().items(), want):
        step = lr * gradient / (gradient.abs() + epsilon)
        torch.testing.assert_close(before - trained[name], step, rtol=1e-3, atol=3e-7)


@pytest.mark.unit
def test_balanced_with_zero_weight_trains_exactly_like_bce():
    plain, plain_history = _train({"epochs": 2, "learning_rate": 0.05})
    zero, zero_history = _train({"epochs": 2, "learning_rate": 0.05, "objective": "balanced", "balance_weight": 0.0})
    weighted, _ = _train({"epochs": 2, "learning_rate": 0.05, "objective": "balanced", "balance_weight": 10.0})
    assert all(torch.equal(plain[k], zero[k]) for k in plain)
    assert (plain_history.pop("objective"), zero_history.pop("objective")) == ("bce", "balanced")  # it names them
    assert plain_history == zero_history
    assert any(not torch.allclose(plain[k], weighted[k]) for k in plain)


# ---------------------------------------------------------------- selection of the kept epoch


@pytest.mark.unit
def test_selection_setting_is_validated_in_one_line_naming_the_fix():
    assert trainer.check_training_settings({"selection": "objective"})["selection"] == "objective"
    assert trainer.check_training_settings({})["selection"] == "bce"
    with pytest.raises(SettingsError) as refused:
        trainer.check_training_settings({"selection": "loss"})
    message = str(refused.value)
    assert message.startswith("training.selection: 'loss' is not valid;") and "\n" not in message
    assert '"bce"' in message and '"objective"' in message


@pytest.mark.unit
def test_the_validation_objective_and_balance_are_recorded_per_epoch():
    data = _data()
    weights, history = _train(
        {"epochs": 3, "learning_rate": 0.05, "objective": "balanced", "balance_weight": 10.0, "checkpoint": "last"},
        data=data,
    )
    assert history["selection"] == "bce"
    assert len(history["validation_objective"]) == len(history["validation_balance"]) == 3
    for metrics, objective, balance in zip(
        history["validation"], history["validation_objective"], history["validation_balance"]
    ):
        assert set(metrics) == {"bce", "accuracy", "auc"}
        assert objective == metrics["bce"] + 10.0 * balance**2
    # The last epoch's record is the formula on the whole validation set, for the kept (last) weights.
    model = _model()
    model.load_state_dict(weights)
    with torch.no_grad():
        logits = model(data["validation_inputs"])
    labels = data["validation_labels"]
    want = _balanced_formula(logits.double(), labels.double(), 10.0).item()
    assert history["validation_objective"][-1] == pytest.approx(want, rel=1e-5)
    p = torch.sigmoid(logits.double())
    assert history["validation_balance"][-1] == pytest.approx(
        (p[labels > 0.5].mean() + p[labels < 0.5].mean() - 1).item(), abs=1e-6
    )
    # Under the BCE objective the validation objective is the validation BCE.
    _, plain = _train({"epochs": 2, "learning_rate": 0.05})
    assert plain["validation_objective"] == [v["bce"] for v in plain["validation"]]


@pytest.mark.unit
def test_selection_objective_keeps_the_epoch_of_the_lowest_validation_objective():
    # A high learning rate with a weighted balance term: here validation BCE falls to the last
    # epoch while the validation objective is lowest at epoch 4, so the two criteria disagree.
    settings = {"epochs": 6, "learning_rate": 0.2, "batch_size": 16, "objective": "balanced", "balance_weight": 10.0}
    data = _data()
    by_objective, h_objective = _train({**settings, "selection": "objective"}, data=data)
    by_bce, h_bce = _train({**settings, "selection": "bce"}, data=data)
    assert h_objective["train_loss"] == h_bce["train_loss"]  # the same run, another keep
    assert h_objective["validation_objective"] == h_bce["validation_objective"]
    objectives, bces = h_objective["validation_objective"], [v["bce"] for v in h_objective["validation"]]
    assert h_objective["selected_epoch"] == objectives.index(min(objectives)) + 1
    assert h_bce["selected_epoch"] == bces.index(min(bces)) + 1
    assert h_objective["selected_epoch"] != h_bce["selected_epoch"]  # the constructed disagreement
    assert (h_objective["selection"], h_bce["selection"]) == ("objective", "bce")
    # The kept weights are those of that epoch: they reproduce its validation objective.
    model = _model()
    model.load_state_dict(by_objective)
    with torch.no_grad():
        logits = model(data["validation_inputs"]).double()
    again = _balanced_formula(logits, data["validation_labels"].double(), 10.0).item()
    assert again == pytest.approx(min(objectives), rel=1e-5)
    assert any(not torch.equal(by_objective[k], by_bce[k]) for k in by_bce)


@pytest.mark.unit
def test_a_resumed_objective_selection_keeps_the_same_epoch_and_weights():
    # Resumed after epoch 4 (the objective's best in this run), epochs 5 and 6 must not displace it.
    import io

    settings = {
        "epochs": 6,
        "learning_rate": 0.2,
        "batch_size": 16,
        "objective": "balanced",
        "balance_weight": 10.0,
        "selection": "objective",
    }
    states = []

    def keep(state):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        states.append(buffer.getvalue())

    saving = trainer.TrainingHooks(save_state=keep, save_seconds=math.inf)  # at epoch ends only
    reference = trainer.train(_model(), _data(), settings, CPU, 0, hooks=saving)
    assert reference[1]["selected_epoch"] == 4 and len(states) == 6
    resumes = []
    resumed = trainer.train(
        _model(),
        _data(),
        settings,
        CPU,
        0,
        hooks=trainer.TrainingHooks(
            load_state=lambda: torch.load(io.BytesIO(states[3]), weights_only=True),
            on_resume=lambda epoch, batch: resumes.append((epoch, batch)),
        ),
    )
    assert resumes == [(4, 19)]  # 300 rows in batches of 16: 19 per epoch
    assert resumed[1] == reference[1]
    assert all(torch.equal(resumed[0][k], reference[0][k]) for k in reference[0])


@pytest.mark.unit
def test_the_model_key_differs_between_selections_and_an_absent_one_is_the_kits_default(tmp_path):
    import jobs
    import nnpd
    from helpers import write_settings
    from store import digest

    def model_keys(patch):
        directory = write_settings(tmp_path / f"s{len(seen)}", tmp_path / "out", training=patch)
        plan = nnpd.make_plan(nnpd.load("smoke", directory))
        assert not plan.errors
        recipes = [jobs.model_recipe(job, "data-key", {"backend": "cpu"}) for job in plan.jobs]
        seen.append(recipes)
        return [digest({"name": "model", "recipe": recipe}) for recipe in recipes]

    seen = []
    absent = model_keys('settings["training"].pop("selection", None)\n')
    bce = model_keys('settings["training"]["selection"] = "bce"\n')
    objective = model_keys('settings["training"]["selection"] = "objective"\n')
    # A kit study's model recipe holds its resolved training settings: the kit's recipe filled in.
    assert all(recipe["experiment"]["training"]["selection"] == "objective" for recipe in seen[0])
    assert len(set(objective)) == len(objective) and set(objective) == set(absent) and not set(objective) & set(bce)


# ---------------------------------------------------------------- CUDA (skipped without a GPU)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["off", "float16", "bfloat16"])
@pytest.mark.unit
def test_single_gpu_training(precision):
    if precision == "bfloat16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16 support")
    rt = runtime.Runtime(device=torch.device("cuda", 0))
    weights, history = _train({"epochs": 3, "learning_rate": 0.02, "precision": precision, "gradient_clip": 1.0}, rt=rt)
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert all(t.device.type == "cpu" for t in weights.values())


# ---------------------------------------------------------------- joint pairs, contrastive NRE, patience


def _joint_data(rows=240, validation=60, seed=3):
    """Joint simulations of a 1-parameter problem: x (2 numbers) scattered about (θ, −θ)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(rows + validation, 1, generator=g) * 4 - 2
    x = torch.cat([theta, -theta], 1) + 0.4 * torch.randn(rows + validation, 2, generator=g)
    return {
        "train_x": x[:rows],
        "train_theta": theta[:rows],
        "validation_x": x[rows:],
        "validation_theta": theta[rows:],
    }


def _joint_model(seed=0):
    """A small classifier of rows [x (2), θ (1)]."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1), torch.nn.Flatten(0))


@given(
    rows=st.integers(2, 300),
    batch_size=st.integers(1, 64),
    classes=st.integers(1, 6),
    seed=st.integers(0, 99),
    epoch=st.integers(0, 3),
)
@settings(max_examples=60, deadline=None)
@pytest.mark.property
def test_batch_atoms_are_other_rows_of_the_batch_and_depend_only_on_seed_epoch_and_batch(
    rows, batch_size, classes, seed, epoch
):
    import contrast

    for index, (start, stop) in enumerate(trainer.epoch_batches(rows, batch_size)):
        atoms = contrast.batch_atoms(start, stop, classes, seed, epoch, index)
        assert atoms.shape == (stop - start, classes)
        own = torch.arange(start, stop)[:, None]
        assert bool((atoms != own).all())  # never the row's own θ
        if stop - start >= 2:
            assert bool(((atoms >= start) & (atoms < stop)).all())
        else:  # a one-row batch borrows a neighbour
            assert atoms.unique().tolist() == [start - 1 if start else 1]
        assert torch.equal(atoms, contrast.batch_atoms(start, stop, classes, seed, epoch, index))


@pytest.mark.unit
def test_batch_atoms_are_new_in_every_epoch_and_batch_and_cover_the_batch():
    import contrast

    draws = [contrast.batch_atoms(0, 200, 1, 5, epoch, batch) for epoch in range(2) for batch in range(2)]
    assert all(not torch.equal(a, b) for i, a in enumerate(draws) for b in draws[i + 1 :])
    counts = torch.bincount(torch.cat(draws).reshape(-1), minlength=200)
    assert counts.min() >= 0 and counts.max() < 12 and (counts > 0).float().mean() > 0.9


@pytest.mark.unit
def test_contrastive_loss_equals_the_classification_it_defines():
    import contrast

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 4, generator=g, dtype=torch.float64) * 2
    for gamma in (0.5, 1.0, 3.0):
        k = logits.shape[1] - 1
        ratio = logits.exp()
        # Class 0: all K atoms from the product; class 1: the joint θ_i with K − 1 atoms.
        p_marginal = k / (k + gamma * ratio[:, 1:].sum(1))
        p_joint = gamma * ratio[:, 0] / (k + gamma * ratio[:, :k].sum(1))
        want = -(torch.log(p_marginal) / (1 + gamma) + gamma / (1 + gamma) * torch.log(p_joint))
        torch.testing.assert_close(contrast.contrastive_losses(logits, gamma), want)
    # One atom with γ = 1 is half the binary cross-entropy of the pair.
    pair = logits[:, :2]
    bce = torch.nn.functional.softplus(-pair[:, 0]) + torch.nn.functional.softplus(pair[:, 1])
    torch.testing.assert_close(contrast.contrastive_losses(pair, 1.0), bce / 2)


@pytest.mark.unit
def test_joint_pairs_train_every_objective_and_record_the_contrastive_validation_loss():
    import contrast

    data = _joint_data()
    histories = {}
    for objective in ("bce", "contrastive"):
        settings = {"epochs": 8, "batch_size": 32, "learning_rate": 0.01, "objective": objective, "classes": 3}
        weights, history = trainer.train(_joint_model(), data, settings, CPU, seed=4)
        assert history["validation"][-1]["auc"] > 0.8 and history["train_loss"][-1] < history["train_loss"][0]
        histories[objective] = history
        model = _joint_model()
        model.load_state_dict(weights)
        # The recorded objective is that of the validation rows with their atoms, fixed from the seed.
        atoms = contrast.fixed_atoms(60, settings["classes"] if objective == "contrastive" else 1, 4)
        rows = contrast.pair_rows(data["validation_x"], data["validation_theta"], torch.arange(60), atoms)
        with torch.no_grad():
            grid = model(rows).double().reshape(60, -1)
        selected = history["selected_epoch"] - 1
        if objective == "contrastive":
            want = contrast.contrastive_losses(grid, 1.0).mean().item()
        else:
            want = torch.nn.functional.binary_cross_entropy_with_logits(
                grid.reshape(-1), torch.tensor([1.0, 0.0]).repeat(60).double()
            ).item()
        assert history["validation_objective"][selected] == pytest.approx(want, rel=1e-5)
    assert histories["bce"]["rows_per_epoch"] == 480 and histories["contrastive"]["rows_per_epoch"] == 240
    with pytest.raises(ValueError, match="contrastive.*needs joint pairs"):
        trainer.train(_model(), _data(), {"objective": "contrastive"}, CPU, 0)


@pytest.mark.unit
def test_patience_stops_training_once_the_selected_loss_stops_improving_and_resumes_exactly():
    import io

    settings = {"epochs": 60, "batch_size": 16, "learning_rate": 0.05, "patience": 3}
    states = []

    def keep(state):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        states.append(buffer.getvalue())

    saving = trainer.TrainingHooks(save_state=keep, save_seconds=math.inf)
    weights, history = trainer.train(_joint_model(), _joint_data(), settings, CPU, 0, hooks=saving)
    bces = [v["bce"] for v in history["validation"]]
    stopped = history["stopped_epoch"]
    assert stopped == len(bces) < 60 and len(states) == stopped
    best = bces.index(min(bces))
    assert stopped - 1 - best == 3 and history["selected_epoch"] == best + 1
    assert all(e - bces.index(min(bces[: e + 1])) < 3 for e in range(stopped - 1))  # no earlier stop was due
    for saved in (states[stopped - 2], states[stopped - 1]):  # the epoch before the stop, and the stop's own
        resumed = trainer.train(
            _joint_model(),
            _joint_data(),
            settings,
            CPU,
            0,
            hooks=trainer.TrainingHooks(
                load_state=lambda saved=saved: torch.load(io.BytesIO(saved), weights_only=True)
            ),
        )
        assert resumed[1] == history
        assert all(torch.equal(resumed[0][k], weights[k]) for k in weights)
    with pytest.raises(SettingsError, match=r"^training\.patience: expected an integer from 1"):
        trainer.check_training_settings({"patience": 0})
    for key, value in (("classes", 1), ("gamma", 0), ("objective", "nre-b")):
        with pytest.raises(SettingsError, match=rf"^training\.{key}"):
            trainer.check_training_settings({key: value})


@pytest.mark.unit
def test_the_outcome_line_says_where_patience_stopped_training_and_which_epoch_it_kept():
    _, history = _train({"epochs": 60, "learning_rate": 0.2, "patience": 3})
    stopped, kept = history["stopped_epoch"], history["selected_epoch"]
    assert stopped is not None and stopped == len(history["validation"]) < 60 and kept == stopped - 3
    assert trainer.training_outcome(history) == (
        f"stopped early at epoch {stopped} of 60 (patience 3: the validation BCE had not improved for 3 epochs), "
        f"kept epoch {kept} (validation BCE {history['validation'][kept - 1]['bce']:.4f})"
    )


@pytest.mark.unit
def test_the_outcome_line_of_a_training_that_ran_every_epoch_names_the_watched_objective():
    _, history = _train({"epochs": 2, "objective": "balanced", "selection": "objective", "checkpoint": "last"})
    assert trainer.training_outcome(history) == (
        f"ran all 2 epochs, kept epoch 2 (validation balanced loss {history['validation_objective'][1]:.4f})"
    )
    del history["objective"]  # a history saved before it named its objective
    assert "kept epoch 2 (validation objective " in trainer.training_outcome(history)
    assert trainer.training_outcome({"loss": [1.0]}) is None  # another trainer's history
