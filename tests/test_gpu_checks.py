"""bench/gpu_checks.sh without a GPU: every check reported skipped with its reason, exit 0; its
bookkeeping on faked GPUs (a failing check, or a broken CUDA set-up, fails the run); and the
analysis bench on CPU."""

import os
import re
import subprocess
import sys

import pytest

from helpers import REPO

SCRIPT = REPO / "bench" / "gpu_checks.sh"
ONE_GPU_CHECKS = [
    "cuda tests, one GPU",
    "float16 smoke run + verify",
    "bfloat16 smoke run + verify",
    "CUDA-event timing smoke run",
    "inference rate (bench_inference)",
    "analysis (bench_analysis)",
    "default profile end to end",
]
TWO_GPU_CHECKS = ["cuda tests, two GPUs", "two-GPU DDP event timing (NCCL)"]
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # hides any GPU from torch, on a GPU machine too


def run_script(extra_env, timeout=180):
    """Run the script with extra environment variables; returns the finished process."""
    env = {**os.environ, "PYTHON": sys.executable, **extra_env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def summary(stdout):
    """{check: (result, figure)} from the table the script ends with (fixed-width columns)."""
    lines = stdout.split("== summary of bench/gpu_checks.sh", 1)[1].splitlines()[1:]
    assert lines[0].split() == ["check", "result", "figure"], lines[0]
    return {line[:38].strip(): (line[39:47].strip(), line[48:].strip()) for line in lines[1:] if line.strip()}


@pytest.mark.launch
def test_an_empty_cuda_visible_devices_hides_every_gpu_from_torch():
    code = "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"
    result = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **NO_GPU}, capture_output=True, text=True, timeout=120
    )
    assert result.stdout.split() == ["False", "0"], result.stderr


@pytest.mark.launch
def test_without_cuda_every_check_is_skipped_with_its_reason_and_the_run_succeeds():
    result = run_script(NO_GPU)
    assert result.returncode == 0, result.stdout + result.stderr
    table = summary(result.stdout)
    assert list(table) == ONE_GPU_CHECKS + TWO_GPU_CHECKS
    for check in ONE_GPU_CHECKS:
        outcome, reason = table[check]
        assert outcome == "SKIPPED" and "CUDA" in reason, (check, table[check])
    for check in TWO_GPU_CHECKS:
        assert table[check] == ("NOT RUN", "needs two GPUs (0 visible)")
    # Nothing was started: each part prints an "== name" header when it runs.
    assert re.findall(r"^== (?!summary)", result.stdout, re.M) == []


FAKE_PYTHON = r"""#!/usr/bin/env bash
# A stand-in interpreter that reports $FAKE_GPUS GPUs and answers each part of the script.
echo "$*" >> "$FAKE_LOG"
if [ "$1" = - ] && [ $# -eq 1 ]; then cat > /dev/null; echo "$FAKE_GPUS 1 a fake GPU"; exit 0; fi
if [ "$1" = - ]; then exec @PYTHON@ "$@"; fi          # device_time's check of timings.json
forward='"train.forward": {"device_s": 0.1}'
case "$*" in
  *"nnpd.py run --profile default"*)
    dir=${@: -1}
    mkdir -p "$dir/out"
    throughput='"throughput": {"product.learned": {"evaluations_per_s": 5e8, "rows_per_call": 4194304}}'
    echo "{\"workers\": {}, $throughput}" > "$dir/out/timings.json" ;;
  "-m pytest"*"-k not"*) echo "15 passed, 104 deselected, 2 warnings in 1.00s" ;;
  "-m pytest"*) echo "==== 4 passed in 9.00s ====" ;;
  *"nnpd.py run"*)
    dir=${@: -1}
    mkdir -p "$dir/out"
    echo "{\"workers\": {\"0\": {\"phases\": {$forward}}}}" > "$dir/out/timings.json"
    case "$dir" in *bfloat16) exit 3 ;; esac ;;
  *"nnpd.py train"*)
    dir=${@: -1}
    mkdir -p "$dir/out"
    communicate='"train.communicate": {"device_s": 0.1}'
    echo "{\"workers\": {\"0\": {\"phases\": {$forward, $communicate}}, \"1\": {\"phases\": {}}}}" \
      > "$dir/out/timings.json" ;;
  *bench_inference.py*) sleep 30 ;;
  *bench_analysis.py*) echo "figure: plain forward 9 M/s, learned 8.5 M/s, ratio 0.944, 8,192 rows per call" ;;
esac
exit 0
"""


def run_on_fake_gpus(tmp_path, gpus):
    """Run the script with the stand-in interpreter reporting `gpus` GPUs; (process, its calls)."""
    fake, log = tmp_path / "python", tmp_path / "calls.log"
    fake.write_text(FAKE_PYTHON.replace("@PYTHON@", sys.executable))
    fake.chmod(0o755)
    result = run_script(
        {"PYTHON": str(fake), "FAKE_LOG": str(log), "FAKE_GPUS": str(gpus), "LIMIT_BENCH": "1"}, timeout=120
    )
    return result, log.read_text()


@pytest.mark.launch
def test_on_a_faked_gpu_each_outcome_is_recorded_and_a_failure_fails_the_run(tmp_path):
    result, calls = run_on_fake_gpus(tmp_path, 1)
    assert result.returncode == 1, result.stdout + result.stderr
    table = summary(result.stdout)
    assert table["cuda tests, one GPU"] == ("PASS", "15 passed in 1.00s")
    assert table["float16 smoke run + verify"][0] == "PASS"
    assert table["bfloat16 smoke run + verify"] == ("FAIL", "run: exit status 3")
    assert table["CUDA-event timing smoke run"][0] == "PASS"
    assert "phases with device time: 1" in table["CUDA-event timing smoke run"][1]
    assert table["inference rate (bench_inference)"] == ("FAIL", "over its 1 s limit")
    assert table["analysis (bench_analysis)"] == (
        "PASS",
        "plain forward 9 M/s, learned 8.5 M/s, ratio 0.944, 8,192 rows per call",
    )
    outcome, figure = table["default profile end to end"]
    assert outcome == "PASS" and figure.endswith("s, learned 500 M evaluations/s, 4,194,304 rows per call")
    assert table["cuda tests, two GPUs"] == ("NOT RUN", "needs two GPUs (1 visible)")
    assert "-m pytest -q -m cuda -k not (two_gpus or two_nccl)" in calls
    assert "bench_analysis.py --device cuda --cases 1024" in calls and "torch.distributed.run" not in calls
    assert "nnpd.py run --profile default" in calls


@pytest.mark.launch
def test_on_two_faked_gpus_the_two_gpu_parts_run_and_report(tmp_path):
    result, calls = run_on_fake_gpus(tmp_path, 2)
    table = summary(result.stdout)
    assert table["cuda tests, two GPUs"] == ("PASS", "4 passed in 9.00s")
    assert table["two-GPU DDP event timing (NCCL)"][0] == "PASS"
    assert "incl. train.communicate" in table["two-GPU DDP event timing (NCCL)"][1]
    assert "-m pytest -q -m cuda -k two_gpus or two_nccl" in calls
    assert "-m torch.distributed.run --standalone --nproc_per_node=2 nnpd.py train" in calls
    assert result.returncode == 1  # the faked bfloat16 run and bench_inference still fail


def two_gpu_terms():
    """The name fragments by which the script picks the cuda tests that need two GPUs."""
    terms = re.search(r'^TWO_GPU_TESTS="(.*)"$', SCRIPT.read_text(), re.M).group(1)
    return terms.split(" or ")


@pytest.mark.unit
def test_the_script_picks_by_name_exactly_the_cuda_tests_needing_a_second_gpu():
    needing, named = set(), set()
    for path in (REPO / "tests").glob("test_*.py"):
        source = path.read_text()
        if "mark.cuda" not in source:  # pytest -m cuda never selects these
            continue
        # A skip below two GPUs applies to the next test function defined after it.
        needing |= {m.group(1) for m in re.finditer(r"device_count\(\) < 2.*?\ndef (test_\w+)", source, re.S)}
        named |= {
            name
            for name in re.findall(r"^def (test_\w+)", source, re.M)
            if any(term in name for term in two_gpu_terms())
        }
    assert needing and needing == named


@pytest.mark.launch
def test_the_analysis_bench_runs_on_cpu_through_the_study_s_own_analysis():
    result = subprocess.run(
        [
            sys.executable,
            "bench/bench_analysis.py",
            "--device",
            "cpu",
            "--cases",
            "1",
            "--dimension",
            "1",
            "--repeats",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    counts = dict(re.findall(r"^(plain forward|learned|exact) .*\(([\d,]+) per run", result.stdout, re.M))
    # One default-profile case: 10,240 adaptive points and the truth, 15 observations each.
    assert counts == {"plain forward": "153,615", "learned": "153,615", "exact": "153,615"}
    assert re.search(
        r"^figure: plain forward \S+ M/s, learned \S+ M/s, ratio \d\.\d{3}, [\d,]+ rows per call$", result.stdout, re.M
    )


@pytest.mark.launch
def test_a_broken_cuda_set_up_is_a_failure_not_a_skip(tmp_path):
    missing = run_script({"PYTHON": str(tmp_path / "no-such-python")}, timeout=60)
    assert missing.returncode == 1
    assert summary(missing.stdout)["CUDA probe"][0] == "FAIL"
    # A driver that lists a GPU while torch sees none: stand-ins for nvidia-smi and for a CPU-only torch.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (
        ("nvidia-smi", "echo 'GPU 0: a stand-in GPU (UUID: GPU-0)'"),
        ("python", "cat > /dev/null; echo '0 0 a stand-in torch built without CUDA'"),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHON=str(bin_dir / "python"), PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    hidden = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert hidden.returncode == 1
    table = summary(hidden.stdout)
    assert table["CUDA probe"] == ("FAIL", "the driver lists 1 GPU(s), torch none: a stand-in torch built without CUDA")
    assert table["cuda tests, one GPU"] == ("SKIPPED", "a stand-in torch built without CUDA")
