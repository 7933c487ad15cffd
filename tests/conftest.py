"""Shared fixtures: tiny settings files written into a temporary directory."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

TINY_TRAINING = """
    settings["data"] = {"train": 256, "validation": 64, "test": 64}
    settings["model"]["hidden"] = [16]
    settings["training"]["epochs"] = 2
    settings["training"]["batch_size"] = 64
    settings["runtime"]["device"] = "cpu"
"""
TINY_ANALYSIS = """
    settings["inference"]["truths"]["truth_points_per_axis"] = 4
    settings["inference"]["candidates"]["candidate_count"] = 64
    settings["inference"]["observations"] = 5
"""


def write_settings(directory, root, training="", analysis="", tiny=True):
    """Copy the repository's settings files into `directory`, patched by the given code.

    The patch code runs inside make_settings with `settings` and `profile` in scope.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, patch, tiny_patch in (("settings_training.py", training, TINY_TRAINING),
                                    ("settings_analysis.py", analysis, TINY_ANALYSIS)):
        body = textwrap.dedent(tiny_patch if tiny else "")
        if name == "settings_training.py":
            body += f'settings["output"]["root"] = {str(root)!r}\n'
        body += textwrap.dedent(patch)
        source = (REPO / name).read_text()
        source += "\n\n_repository_make_settings = make_settings\n\n\ndef make_settings(profile):\n"
        source += "    settings = _repository_make_settings(profile)\n"
        source += textwrap.indent(body, "    ") + "    return settings\n"
        (directory / name).write_text(source)
    return directory


@pytest.fixture
def study_dir(tmp_path):
    """A settings directory with tiny smoke settings writing to tmp_path/out."""
    return write_settings(tmp_path / "settings", tmp_path / "out")


def run_cli(*args, cwd=None, env=None, timeout=600):
    """Run `python nnpd.py ...` in a subprocess and return the completed process."""
    environment = {**os.environ, **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(name, None)
    return subprocess.run([sys.executable, str(REPO / "nnpd.py"), *args], cwd=cwd or REPO, env=environment,
                          capture_output=True, text=True, timeout=timeout)
