"""Shared fixtures, and the check that every test belongs to exactly one layer: unit, property or launch.

The helpers the test modules share are in tests/helpers.py.
"""

import pytest
import torch

from helpers import LayerCheck, run_cli, write_settings


def pytest_configure(config):
    config.pluginmanager.register(LayerCheck(), "nnpd-test-layers")


@pytest.fixture
def study_dir(tmp_path):
    """A settings directory with tiny smoke settings writing to tmp_path/out."""
    return write_settings(tmp_path / "settings", tmp_path / "out")


@pytest.fixture(scope="session")
def trained_smoke_root(tmp_path_factory):
    """An output root that `run` of the tiny smoke settings (study_dir's) made: for tests to copy, never to change.

    Shared by the modules that each would train the same root (tests/test_root.py, tests/test_root_guards.py).
    """
    tmp = tmp_path_factory.mktemp("trained")
    result = run_cli("run", "--settings-dir", str(write_settings(tmp / "s", tmp / "out")))
    assert result.returncode == 0, result.stderr
    return tmp / "out"


@pytest.fixture
def one_thread():
    """One intra-op thread, as analyses run (runtime.cpu_threads): small operations stay fast on busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
