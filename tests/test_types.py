"""The settings sections reach the code as typed values: mypy names a misspelt key before anything runs."""
import subprocess
import sys

import pytest

from helpers import REPO

READER = """from inference_schema import check_inference_settings

section = check_inference_settings({{}}, 2)
count: int = section["candidates"]["{key}"]
"""


@pytest.mark.launch
def test_mypy_names_a_misspelt_settings_key_and_only_that(tmp_path):
    pytest.importorskip("mypy", reason="mypy is installed by `make typecheck` (README.md, \"Tests and benchmarks\")")
    (tmp_path / "spelt.py").write_text(READER.format(key="candidate_count"))
    (tmp_path / "misspelt.py").write_text(READER.format(key="candidate_cuont"))
    result = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", "--cache-dir",
                             str(tmp_path / "cache"), "--config-file", str(REPO / "pyproject.toml"),
                             str(tmp_path / "spelt.py"), str(tmp_path / "misspelt.py")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith(str(tmp_path / "misspelt.py")), result.stdout
    assert 'TypedDict "Candidates" has no key "candidate_cuont"' in errors[0]
