"""The settings sections reach the code as typed values: mypy names a misspelt key before anything runs."""

import subprocess
import sys

import pytest

from helpers import REPO

READER = """from inference_schema import check_inference_settings
from nre_study import DataSettings
from trainer import check_training_settings

inference = check_inference_settings({{}}, 2)
training = check_training_settings({{}})
count: int = inference["candidates"]["{candidates}"]
epochs: int = training["{training}"]


def simulations(data: DataSettings) -> int:
    return data["{data}"]
"""
SPELT = {"candidates": "candidate_count", "training": "epochs", "data": "train"}
# Each reader misspells one section's key; mypy must name that key in that file, and nothing else.
MISSPELT = {
    "candidates": ("candidate_cuont", 'TypedDict "Candidates" has no key "candidate_cuont"'),
    "training": ("epoch", 'TypedDict "TrainingSettings" has no key "epoch"'),
    "data": ("trian", 'TypedDict "DataSettings" has no key "trian"'),
}


@pytest.mark.launch
def test_mypy_names_a_misspelt_settings_key_and_only_that(tmp_path):
    pytest.importorskip("mypy", reason='mypy is installed by `make typecheck` (README.md, "Tests and benchmarks")')
    (tmp_path / "spelt.py").write_text(READER.format(**SPELT))
    for section, (key, _) in MISSPELT.items():
        (tmp_path / f"{section}.py").write_text(READER.format(**{**SPELT, section: key}))
    files = [str(tmp_path / f"{name}.py") for name in ("spelt", *MISSPELT)]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--follow-imports=silent",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--config-file",
            str(REPO / "pyproject.toml"),
            *files,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == len(MISSPELT), result.stdout
    for section, (_, message) in MISSPELT.items():
        assert any(line.startswith(str(tmp_path / f"{section}.py")) and message in line for line in errors), errors
