"""The results reader and `nnpd.py report`: table, CSV and comparison figure of an output root."""

import csv
import json

import pytest
import torch

import jobs
import results
import runtime
import study
from helpers import main_in_process, run_cli, write_settings


@pytest.mark.unit
def test_lookup_follows_keys_that_hold_dots_and_flatten_names_every_scalar():
    metrics = {"coverage": {"0.68": {"joint": 0.7, "interval": [0.6, 0.8]}, "0.95": {"joint": 0.9}}}
    assert results.lookup(metrics, "coverage.0.68.joint") == 0.7
    assert results.lookup(metrics, "coverage.0.95.joint") == 0.9
    assert results.lookup(metrics, "coverage.0.5.joint", "absent") == "absent"
    assert results.flatten(metrics) == {
        "coverage.0.68.joint": 0.7,
        "coverage.0.68.interval.0": 0.6,
        "coverage.0.68.interval.1": 0.8,
        "coverage.0.95.joint": 0.9,
    }


def analysed_record(prior, metrics):
    """A record of an analysed baseline run of `prior` with these metrics."""
    return results.RunRecord(
        run=f"runs/baseline/{prior}",
        configuration="baseline",
        knob=None,
        value=None,
        member={"name": f"{prior}-r0", "prior": prior},
        settings={},
        status="complete",
        analysis="complete",
        metrics=metrics,
    )


def coverage(joint):
    """A coverage metric at 0.68 with its interval."""
    return {"0.68": {"joint": joint, "interval": [joint - 0.05, joint + 0.05]}}


@pytest.mark.unit
def test_the_table_shows_the_exact_coverage_beside_the_learned_one_when_a_study_has_it():
    import nre_analysis

    columns = nre_analysis.NREAnalysis.REPORT_COLUMNS
    with_exact = {"coverage": coverage(0.630), "exact_reference": {"coverage": coverage(0.686)}}
    lines = results.table([analysed_record("uniform", with_exact)], columns).splitlines()
    headings = lines[0].split()
    assert headings.index("exact68") == headings.index("cov68") + 1
    assert "0.630 [0.58, 0.68]  0.686 [0.64, 0.74]" in lines[1]
    # Without a likelihood no run has the column: it is left out, not a row of dashes.
    without = results.table([analysed_record("uniform", {"coverage": coverage(0.630)})], columns)
    assert "exact68" not in without and "cov68" in without
    records = [analysed_record("uniform", with_exact), analysed_record("normal", {"coverage": coverage(0.6)})]
    mixed = results.table(records, columns).splitlines()
    assert "exact68" in mixed[0] and mixed[2].endswith("0.65]  -")  # a run without it


@pytest.fixture(scope="module")
def swept_root(tmp_path_factory):
    """A smoke root with two configurations (the baseline and one more learning rate), analysed."""
    tmp = tmp_path_factory.mktemp("report")
    settings = write_settings(
        tmp / "s", tmp / "out", training='settings["training"]["learning_rate"] = Choice([1e-3, 3e-3])\n'
    )
    result = run_cli("run", "--settings-dir", str(settings))
    assert result.returncode == 0, result.stderr
    return tmp, settings, result.stdout


@pytest.mark.launch
def test_run_ends_with_the_table_of_its_runs(swept_root):
    _, _, stdout = swept_root
    assert "configuration" in stdout and "training.learning_rate=0.003" in stdout


@pytest.mark.launch
def test_report_writes_one_csv_row_per_run_with_the_swept_value(swept_root):
    tmp, settings, _ = swept_root
    result = main_in_process("report", "--settings-dir", str(settings), "--csv", str(tmp / "r.csv"))
    assert result.returncode == 0, result.stderr
    for prior in ("uniform", "normal", "exponential", "grid"):
        assert result.stdout.count(f" {prior} ") == 2, result.stdout  # both configurations name every prior
    with open(tmp / "r.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 8
    assert sorted({row["value"] for row in rows}) == ["", "0.003"]
    assert {row["knob"] for row in rows} == {"baseline", "training.learning_rate"}
    assert all(0 <= float(row["coverage.0.68.joint"]) <= 1 and row["coverage.0.68.interval.0"] for row in rows)


@pytest.mark.launch
def test_csv_rows_carry_every_swept_knobs_value_the_replica_and_the_training(swept_root):
    tmp, settings, _ = swept_root
    result = main_in_process("report", "--settings-dir", str(settings), "--csv", str(tmp / "fair.csv"))
    assert result.returncode == 0, result.stderr
    with open(tmp / "fair.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    columns = reader.fieldnames
    assert columns[:10] == [
        "run",
        "configuration",
        "prior",
        "member",
        "replica",
        "knob",
        "value",
        "training.learning_rate",
        "selected_epoch",
        "final_validation_loss",
    ]
    for row in rows:
        baseline = row["knob"] == "baseline"
        assert row["training.learning_rate"] == ("0.001" if baseline else "0.003")  # the baseline's value too
        assert row["replica"] == "0" and row["member"] == f"{row['prior']}-r0"
        run = tmp / "out" / row["run"]
        assert int(row["selected_epoch"]) == json.loads((run / "status.json").read_text())["selected_epoch"]
        model = json.loads((run / "artifacts.json").read_text())["model"]
        history = json.loads((tmp / "out" / model / "history.json").read_text())
        assert float(row["final_validation_loss"]) == pytest.approx(history["validation"][-1]["bce"], rel=1e-12)


@pytest.mark.launch
def test_the_swept_comparison_labels_every_panel_line_and_marker(swept_root):
    pytest.importorskip("matplotlib")
    from nre_analysis import NREAnalysis

    tmp, _, _ = swept_root
    figure = results.comparison_figure(results.read_runs(tmp / "out"), NREAnalysis.FIGURE_METRICS, "the title")
    assert figure.get_suptitle() == "the title"
    knob = "training.learning_rate"
    for axis, (title, _) in zip(figure.axes, NREAnalysis.FIGURE_METRICS, strict=True):
        assert axis.get_title() == f"{title} against {knob}"
        assert axis.get_xlabel() == knob and axis.get_ylabel() == title
        assert [label.get_text() for label in axis.get_xticklabels()] == ["0.001", "0.003"]
    legend = [text.get_text() for text in figure.axes[-1].get_legend().get_texts()]
    members = [f"{prior}-r0" for prior in ("exponential", "grid", "normal", "uniform")]
    assert legend[:4] == members
    assert sorted(legend[4:]) == ["bars: 95% Wilson interval", f"baseline: {knob} = 0.001", "nominal level 0.68"]


@pytest.mark.launch
def test_report_plot_draws_the_comparison_or_says_it_is_skipped(swept_root):
    tmp, settings, _ = swept_root
    result = main_in_process("report", "--settings-dir", str(settings), "--plot")
    assert result.returncode == 0, result.stderr
    figure = tmp / "out" / "report" / "comparison.png"
    if jobs.matplotlib_missing():
        assert "skipped" in result.stdout and not figure.exists()
    else:
        assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.launch
def test_report_before_any_analysis_is_a_clear_error(tmp_path):
    settings = write_settings(tmp_path / "s", tmp_path / "out")
    result = main_in_process("report", "--settings-dir", str(settings))
    assert result.returncode == 1 and "no analysed runs" in result.stderr
    assert json.dumps(result.stderr).count("\\n") == 1


@pytest.mark.unit
def test_case_progress_prints_quarters_of_a_long_product(capsys):
    launch = jobs.Launch("analyze", None, None, None, runtime.Runtime(device=torch.device("cpu")), {})
    progress = study.Progress(lambda line: launch.log(line, every_worker=True), "analyze runs/x/y")
    progress.tty, progress.QUIET_SECONDS = False, 0.0
    for done in range(9):
        progress("ratio", done, 8)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("ratio ")[1].split(" cases")[0] for line in lines] == ["0/8", "2/8", "4/8", "6/8", "8/8"]
    assert "s left" in lines[2] and "s left" not in lines[-1]
