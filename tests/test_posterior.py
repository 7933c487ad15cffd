"""A trained model's posterior for one observation: against the analytic posterior, the analysis' own bounds,
and the `infer` command."""

import io
import json
import math
import os
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

import infer
import nnpd
import posterior as post
import priors
import settings_analysis
import study
from helpers import main_in_process, run_cli, study_problem, write_settings
from store import restore

SIGMA = 2.0  # the bundled problem's fixed standard deviation
OBSERVATIONS = 15


class ExactLogit(torch.nn.Module):
    """A 'network' whose logit is the exact log-likelihood of rows [x, θ]: the evidence cancels on normalising."""

    def __init__(self, problem):
        super().__init__()
        self.problem = problem

    def forward(self, rows):
        d = self.problem.dimension
        return self.problem.log_likelihood(rows[:, :d].double(), rows[:, d:].double()).float()


class FlatteningExactLogit(ExactLogit):
    """The same logits from a network that flattens its rows with `view`, which needs them contiguous."""

    def forward(self, rows):
        return super().forward(rows.view(-1).view(rows.shape))


@pytest.mark.unit
def test_a_network_that_needs_contiguous_rows_gives_the_same_posterior():
    problem = study_problem(2)
    prior = priors.make_prior(problem, {"family": "uniform"})
    x = problem.simulate(torch.full((OBSERVATIONS, 2), 5.0, dtype=torch.float64), torch.Generator().manual_seed(7))
    analysis = settings_analysis.make_settings("default")
    analysis["inference"]["candidates"].update(kind="adaptive", candidate_count=2048, coarse_count=256)
    plain, flattening = (
        post.for_observation(post.Learned(problem, prior, network, analysis, 1), x)
        for network in (ExactLogit(problem), FlatteningExactLogit(problem))
    )
    assert torch.equal(plain.points, flattening.points) and torch.equal(plain.scores, flattening.scores)


def exact_posterior(dimension, prior_settings=None, truth=None, kind="adaptive"):
    """The posterior object of the exact likelihood under a prior, for observations simulated at a truth."""
    problem = study_problem(dimension)
    prior = priors.make_prior(problem, prior_settings or {"family": "uniform"})
    truth = torch.full((dimension,), 5.0, dtype=torch.float64) if truth is None else truth
    x = problem.simulate(truth.expand(OBSERVATIONS, -1), torch.Generator().manual_seed(7))
    analysis = settings_analysis.make_settings("default")
    analysis["inference"]["candidates"].update(kind=kind, candidate_count=4096, coarse_count=512)
    return post.for_observation(post.Learned(problem, prior, ExactLogit(problem), analysis, 1), x), x


@pytest.mark.parametrize("dimension", [1, 3])
@pytest.mark.unit
def test_samples_match_the_analytic_posterior(dimension):
    posterior, x = exact_posterior(dimension)
    samples = posterior.sample(4000, seed=0)
    # Means inferred, σ known, flat prior far from the box's edges: N(x̄, σ²/m) per axis.
    mean, sd = x.mean(0), SIGMA / math.sqrt(OBSERVATIONS)
    effective = min(4000, posterior.ess)
    assert posterior.ess > 500
    assert torch.all((samples.mean(0) - mean).abs() < 4 * sd / math.sqrt(effective))
    assert torch.all((posterior.mean() - mean).abs() < 4 * sd / math.sqrt(posterior.ess))
    covariance = torch.cov(samples.T).reshape(dimension, dimension)
    tolerance = 4 * sd * sd * math.sqrt(2 / effective)
    assert torch.all((covariance - sd * sd * torch.eye(dimension, dtype=torch.float64)).abs() < tolerance)
    region = posterior.hpd(0.68)
    if dimension == 1:  # the 68% interval is x̄ ± 0.994 sd
        assert region["lower"][0] == pytest.approx(float(mean[0]) - 0.9945 * sd, abs=0.05 * sd)
        assert region["upper"][0] == pytest.approx(float(mean[0]) + 0.9945 * sd, abs=0.05 * sd)
    assert region["mass"] >= 0.68
    theta = samples[:5]
    density = posterior.log_prob(theta)
    analytic = torch.distributions.Normal(mean, sd).log_prob(theta).sum(-1)
    assert torch.allclose(density, analytic, atol=0.02)  # normalised by the design's measure weights


@hsettings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 300), lattice=st.booleans())
@pytest.mark.property
def test_sampling_is_deterministic_from_its_seed_and_stays_in_the_support(seed, n, lattice):
    posterior = LATTICE if lattice else EDGE
    first, again = posterior.sample(n, seed), posterior.sample(n, seed)
    assert torch.equal(first, again) and first.shape == (n, 1)
    assert bool(((first >= 0.0) & (first <= 10.0)).all())
    if lattice:  # on the bundled 0.2 lattice
        assert torch.allclose(first / 0.2, torch.round(first / 0.2), atol=1e-9)


# A posterior against the box's edge (the truth at 0.3) and one on the grid prior's lattice.
EDGE = exact_posterior(1, truth=torch.tensor([0.3], dtype=torch.float64))[0]
LATTICE = exact_posterior(1, {"family": "grid"})[0]


@pytest.mark.unit
def test_a_posterior_its_candidates_miss_is_found_on_a_continuous_box_and_refused_on_a_lattice():
    # 4096 fixed points over [0, 10]^5: about 2 effective. Continuous: population Monte Carlo from the best.
    posterior, x = exact_posterior(5, kind="sobol")
    assert posterior.ess < 10
    samples = posterior.sample(2000, 0)
    assert posterior.sampling["path"] == "population Monte Carlo" and posterior.sampling["warning"] is None
    assert torch.all((samples.mean(0) - x.mean(0)).abs() < 4 * SIGMA / math.sqrt(OBSERVATIONS) / math.sqrt(2000))
    # On the grid prior's lattice the candidates are resampled: too few to draw from.
    lattice, _ = exact_posterior(5, {"family": "grid"}, kind="sobol")
    with pytest.raises(post.PosteriorError, match="effective candidates"):
        lattice.sample(10, 0)


@pytest.mark.unit
def test_infer_names_the_path_that_placed_the_proposal():
    for kind, path in (("adaptive", "the candidates"), ("sobol", r"population Monte Carlo \(\d+ passes\)")):
        posterior, _ = exact_posterior(5, kind=kind)
        posterior.sample(200, 0)
        line = infer.report_lines({"sampling": posterior.sampling, "flat": {"warning": None}}, [], None)[0]
        assert re.search(rf"^samples: 200 by rejection, .*; proposal from {path}, \d+ effective draws$", line), line


# ---------------------------------------------------------------- through restore and the command line


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    """A tiny smoke study on adaptive candidates, run and analysed (retaining every case's design)."""
    folder = tmp_path_factory.mktemp("posterior")
    study = write_settings(
        folder / "settings",
        folder / "out",
        training='settings["cohort"]["priors"] = ["uniform", "grid"]\n',
        analysis='settings["inference"]["candidates"].update(kind="adaptive", candidate_count=512, coarse_count=64)\n',
    )
    result = run_cli("run", "--settings-dir", str(study))
    assert result.returncode == 0, result.stderr
    return folder / "out"


@pytest.mark.launch
def test_hpd_bounds_equal_the_analysis_bounds_of_the_same_case(analysed):
    for run_json in sorted(analysed.glob("runs/*/*/run.json")):
        restored = restore(run_json.parent)
        truths, observations = restored.array("truths", "truths"), restored.array("observations", "observations")
        settings = restored.json("analysis")["settings"]
        for case in range(len(truths)):
            posterior = restored.experiment.posterior(
                restored.member, restored.model, settings, observations[case], truth=truths[case], case=case
            )
            for i, level in enumerate(settings["inference"]["levels"]):
                region = posterior.hpd(level)
                assert region["lower"] == restored.array("learned", "posterior_lower")[case, i].tolist()
                assert region["upper"] == restored.array("learned", "posterior_upper")[case, i].tolist()
            assert posterior.mode().tolist() == restored.array("learned", "posterior_mode")[case].tolist()
        with pytest.warns(post.PosteriorWarning, match="learned little"):  # the tiny models learn nothing
            assert restored.posterior(observations[0]).summary()["hpd"].keys() == {"0.68", "0.95"}


@pytest.mark.launch
def test_building_a_posterior_and_sampling_it_report_their_progress(analysed):
    restored = restore(next(analysed.glob("runs/*/uniform-r0-*")))
    reported = []
    with (
        study.progress_to(lambda what, done, total: reported.append((what, done, total))),
        pytest.warns(post.PosteriorWarning, match="nearly flat"),
    ):
        posterior = restored.posterior(restored.array("observations", "observations")[0])
        built = len(reported)
        posterior.sample(200, seed=0)
    building, sampling = reported[:built], reported[built:]
    assert built > 2 and building[0][1] == 0 and {what for what, _, _ in building} == {"posterior"}
    done = [count for _, count, _ in building]
    assert done == sorted(done) and done[-1] == building[-1][2]  # counted up to the whole design
    assert sampling[0] == ("samples", 0, 200) and sampling[-1] == ("samples", 200, 200)


@pytest.mark.launch
def test_infer_writes_a_summary_samples_and_a_corner_plot(analysed, tmp_path):
    run = next(analysed.glob("runs/*/uniform-r0-*"))
    restored = restore(run)
    np.save(tmp_path / "x.npy", restored.array("observations", "observations")[2])
    np.save(tmp_path / "truth.npy", restored.array("truths", "truths")[2])
    result = main_in_process(
        "infer",
        str(run),
        "--observations",
        str(tmp_path / "x.npy"),
        "--truth",
        str(tmp_path / "truth.npy"),
        "--samples",
        "500",
        "--plot",
    )  # README's infer is a launch
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "x-uniform-r0.posterior.json").read_text())
    assert summary["samples"] == 500 and summary["parameters"] == ["mean:0"] and summary["ess"] > 0
    assert set(summary["hpd"]) == {"0.68", "0.95"} and len(summary["hpd"]["0.95"]["lower"]) == 1
    samples = np.load(tmp_path / "x-uniform-r0.samples.npy")
    assert samples.shape == (500, 1) and np.all((samples >= 0) & (samples <= 10))
    assert (tmp_path / "x-uniform-r0.corner.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "content, message",
    [
        (np.zeros((3, 2)), r"shape \(3, 2\): expected finite numbers of shape \(1,\)"),
        (np.array([np.nan]), "NaN or infinite"),
        (b"not numpy", "not a readable .npy file"),
    ],
)
@pytest.mark.launch
def test_infer_refuses_a_bad_observation_with_one_line_and_writes_nothing(analysed, tmp_path, capsys, content, message):
    run = next(analysed.glob("runs/*/uniform-r0-*"))
    path = tmp_path / "bad.npy"
    path.write_bytes(content) if isinstance(content, bytes) else np.save(path, content)
    assert nnpd.main(["infer", str(run), "--observations", str(path), "--plot"]) == 2  # the command line, in-process
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nnpd: error:")
    assert re.search(message, lines[0]), lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npy"]


@pytest.mark.unit
def test_infer_names_a_missing_run(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.zeros(1))
    assert nnpd.main(["infer", str(tmp_path / "nowhere"), "--observations", str(tmp_path / "x.npy")]) == 2
    line = capsys.readouterr().err.strip()
    assert "not a run folder" in line and line.count(str(tmp_path / "nowhere")) == 1  # the path said once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]


@pytest.mark.launch
def test_infer_says_how_it_sampled_and_scores_the_samples_against_a_reference(analysed, tmp_path, capsys):
    run = next(analysed.glob("runs/*/uniform-r0-*"))
    restored = restore(run)
    observation = restored.array("observations", "observations")[2]
    np.save(tmp_path / "x.npy", observation)
    with pytest.warns(post.PosteriorWarning, match="nearly flat"):
        own = restored.posterior(observation).sample(2000, seed=5).numpy()  # its own draws: C2ST ≈ 0.5
    np.save(tmp_path / "same.npy", own)
    np.save(tmp_path / "far.npy", own + 6 * own.std(0))  # shifted by six sds: C2ST ≈ 1
    scores = {}
    for name in ("same", "far"):
        assert (
            nnpd.main(
                [
                    "infer",
                    str(run),
                    "--observations",
                    str(tmp_path / "x.npy"),
                    "--samples",
                    "2000",
                    "--reference",
                    str(tmp_path / f"{name}.npy"),
                    "--output",
                    str(tmp_path / name),
                ]
            )
            == 0
        )
        out = capsys.readouterr().out
        assert re.search(r"^samples: 2000 by rejection, 100% distinct, acceptance", out, re.M), out
        scores[name] = json.loads(next((tmp_path / name).glob("*.posterior.json")).read_text())["c2st"]
        assert f"c2st: {scores[name]:.3f}, 2000 samples against 2000 of the 2000 reference draws" in out
    assert scores["same"] < 0.56 and scores["far"] > 0.95
    np.save(tmp_path / "wide.npy", np.zeros((20, 3)))
    assert (
        nnpd.main(
            ["infer", str(run), "--observations", str(tmp_path / "x.npy"), "--reference", str(tmp_path / "wide.npy")]
        )
        == 2
    )
    assert "--reference" in capsys.readouterr().err and not list(tmp_path.glob("x-*"))


def _infer(run, observations, *extra):
    """The infer command line in-process: (exit status, the one stderr line)."""
    result = main_in_process("infer", str(run), "--observations", str(observations), *map(str, extra))
    return result.returncode, result.stderr.strip()


@pytest.mark.launch
def test_infer_refuses_hostile_inputs_in_one_line_and_writes_nothing(analysed, tmp_path):
    run = next(analysed.glob("runs/*/uniform-r0-*"))
    good = tmp_path / "x.npy"
    np.save(good, np.array([5.0]))
    os.mkfifo(tmp_path / "fifo.npy")  # opening it would block for ever
    np.save(tmp_path / "complex.npy", np.array([5.0 + 1j]))
    np.save(tmp_path / "nan.npy", np.array([np.nan]))
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (10**12, 1)})
    (tmp_path / "huge.npy").write_bytes(header.getvalue())  # a header claiming 10^12 rows, no data
    (tmp_path / "afile").write_text("not a folder")
    np.save(tmp_path / "ensemble.npy", np.full((2 * 10**6, 1), 5.0))  # hours of network evaluations
    cases = [
        (
            (tmp_path / "ensemble.npy",),
            r"2,000,000 observations × [\d,]+ candidate points are .* network "
            r"evaluations, over the 1e\+08",
        ),
        ((tmp_path / "fifo.npy",), "not a regular file"),
        ((good, "--truth", tmp_path / "fifo.npy"), "not a regular file"),
        ((tmp_path / "complex.npy",), "not real numbers"),
        ((good, "--truth", tmp_path / "nan.npy"), "NaN or infinite"),
        ((tmp_path / "huge.npy",), "not a readable .npy file|over the"),
        ((good, "--samples", 10**12), "draw from 1 to 10,000,000 samples"),
        ((good, "--output", tmp_path / "afile"), "exists and is not a folder"),
        ((good, "--output", run), "inside the output root"),
        ((good, "--output", next(analysed.glob("cache/model/*"))), "inside the output root"),
    ]
    before = sorted(p.name for p in tmp_path.iterdir())
    for arguments, message in cases:
        status, line = _infer(run, *arguments)
        assert status == 2 and len(line.splitlines()) == 1 and line.startswith("nnpd: error:"), (arguments, line)
        assert re.search(message, line), (arguments, line)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not list(run.glob("x-*")) and not list(analysed.glob("cache/model/*/x-*"))


@pytest.mark.launch
def test_infer_names_its_files_from_a_safe_cut_of_the_member_name(analysed, tmp_path):
    import shutil

    from store import record_checksum

    source = next(analysed.glob("runs/*/uniform-r0-*"))
    copy = tmp_path / "root"
    shutil.copytree(analysed, copy, symlinks=True)
    run = copy / source.relative_to(analysed)
    record = json.loads((run / "run.json").read_text())
    record["member"]["name"] = "../../escape"
    record["checksum"] = record_checksum(record)
    (run / "run.json").write_text(json.dumps(record))
    (tmp_path / "obs").mkdir()
    np.save(tmp_path / "obs" / "x.npy", np.array([5.0]))
    status, line = _infer(run, tmp_path / "obs" / "x.npy", "--samples", "50")
    assert status == 0, line
    assert sorted(p.name for p in (tmp_path / "obs").iterdir()) == [
        "x-___escape.posterior.json",
        "x-___escape.samples.npy",
        "x.npy",
    ]
    assert not list(tmp_path.glob("*escape*")) and not list(tmp_path.parent.glob("*escape*"))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda run: (run / "artifacts.json").write_text("[1, 2]"), "artifacts.json: damaged"),
        (lambda run: (run / "artifacts.json").unlink(), "no artifacts.json"),
        (lambda run: ((run / "artifacts.json").unlink(), os.mkfifo(run / "artifacts.json")), "no artifacts.json"),
        (
            lambda run: _recorded(
                run / "analysis.json",
                lambda record: record["settings"]["inference"]["candidates"].update(candidate_count=1e10),
            ),
            "candidate_count",
        ),
    ],
)
@pytest.mark.launch
def test_infer_answers_a_damaged_run_record_in_one_line(analysed, tmp_path, change, message):
    import shutil

    copy = tmp_path / "root"
    shutil.copytree(analysed, copy, symlinks=True)
    run = next(copy.glob("runs/*/uniform-r0-*"))
    change(run)
    np.save(tmp_path / "x.npy", np.array([5.0]))
    status, line = _infer(run, tmp_path / "x.npy", "--samples", "20")
    assert status == 2 and len(line.splitlines()) == 1 and re.search(message, line), line
    assert "Traceback" not in line and not list(tmp_path.glob("x-*"))


def _recorded(path, edit):
    """Edit a run record and give it a matching checksum (what a careful attacker would do)."""
    from store import record_checksum

    record = json.loads(path.read_text())
    edit(record)
    record["checksum"] = record_checksum(record)
    path.write_text(json.dumps(record))
