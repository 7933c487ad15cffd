"""The settings sections reach the code as typed values: mypy names a misspelt key before anything runs."""
import subprocess
import sys

import pytest

from helpers import REPO

READER = """from inference_schema import check_inference_settings
from trainer import check_training_settings

inference = check_inference_settings({{}}, 2)
training = check_training_settings({{}})
count: int = inference["candidates"]["{candidates_key}"]
epochs: int = training["{training_key}"]
"""


@pytest.mark.launch
def test_mypy_names_a_misspelt_settings_key_and_only_that(tmp_path):
    pytest.importorskip("mypy", reason="mypy is installed by `make typecheck` (README.md, \"Tests and benchmarks\")")
    readers = {"spelt": ("candidate_count", "epochs"), "inference": ("candidate_cuont", "epochs"),
               "training": ("candidate_count", "epoch")}
    for name, (candidates_key, training_key) in readers.items():
        (tmp_path / f"{name}.py").write_text(READER.format(candidates_key=candidates_key, training_key=training_key))
    result = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", "--cache-dir",
                             str(tmp_path / "cache"), "--config-file", str(REPO / "pyproject.toml"),
                             *(str(tmp_path / f"{name}.py") for name in readers)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    errors = sorted(line for line in result.stdout.splitlines() if ": error:" in line)
    assert len(errors) == 2, result.stdout
    assert errors[0].startswith(str(tmp_path / "inference.py"))
    assert 'TypedDict "Candidates" has no key "candidate_cuont"' in errors[0]
    assert errors[1].startswith(str(tmp_path / "training.py"))
    assert 'TypedDict "TrainingSettings" has no key "epoch"' in errors[1]
