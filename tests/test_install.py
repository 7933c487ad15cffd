"""A normal (non-editable) `pip install` of a copy of the repository, used from other directories.

No network is needed: the package is installed with --no-deps --no-build-isolation --no-index
into a fresh virtual environment that sees the packages of the interpreter running the tests.
"""
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from conftest import REPO
from test_docs import repository_copy


def clean_environment():
    """The environment without PYTHONPATH (it would shadow the installed modules) or torchrun variables."""
    dropped = ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in dropped},
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def make_environment(venv):
    """A virtual environment that also sees this interpreter's packages (torch, numpy, pip, setuptools).

    A venv made from inside a venv sees only the base interpreter's packages, so this
    interpreter's site-packages folders are added with a .pth file; without pip of its own
    (--without-pip) it uses this interpreter's pip and setuptools.
    """
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    folders = [path for path in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if Path(path).is_dir()]
    (Path(purelib) / "outer-packages.pth").write_text("\n".join(dict.fromkeys(folders)) + "\n")
    return Path(purelib)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv folder, its site-packages) with nnpd installed from a copy of the repository."""
    work = tmp_path_factory.mktemp("install")
    copy = repository_copy(work / "nnpd-copy")
    venv = work / "venv"
    purelib = make_environment(venv)
    result = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                             "--no-index", str(copy)], capture_output=True, text=True, env=clean_environment(),
                            cwd=work, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    shutil.rmtree(copy)                          # the installed script must not need the source tree
    return venv, purelib


def run_installed(venv, *args, cwd):
    """Run the installed `nnpd` console script in `cwd`."""
    return subprocess.run([str(venv / "bin" / "nnpd"), *args], cwd=cwd, env=clean_environment(),
                          capture_output=True, text=True, timeout=600)


def have_c_compiler():
    """Whether the compiler Python's build uses is on PATH (without it _probes is not built)."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(compiler) is not None


def repository_modules():
    """Names of the repository's top-level Python modules (setup.py is the build, not a module)."""
    return sorted(path.stem for path in REPO.glob("*.py") if path.name != "setup.py")


def test_pyproject_packages_every_module_of_the_repository():
    packaged = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["py-modules"]
    assert sorted(packaged) == repository_modules()


def test_every_module_is_installed_and_imported_from_the_environment(installed, tmp_path):
    venv, purelib = installed
    for name in repository_modules():
        assert (purelib / f"{name}.py").is_file(), name
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import nnpd, probes; print(nnpd.__file__, probes.NATIVE)"],
                           cwd=tmp_path, env=clean_environment(), capture_output=True, text=True)
    assert where.returncode == 0, where.stderr
    path, native = where.stdout.split()
    assert Path(path).parent == purelib
    if have_c_compiler():
        assert native == "True"                  # the C extension was built and installed with the modules


def test_installed_script_plans_from_another_directory(installed, tmp_path):
    venv, purelib = installed
    result = run_installed(venv, "plan", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["profile"] == "smoke" and report["jobs"] == 4
    assert Path(report["settings_dir"]) == purelib     # the settings installed with the code
    assert not list(tmp_path.iterdir())                 # plan writes nothing


@pytest.mark.slow
def test_installed_script_runs_smoke_from_an_empty_directory(installed, tmp_path):
    venv, _ = installed
    result = run_installed(venv, "run", "--profile", "smoke", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["outputs"]
    root = tmp_path / "outputs" / "smoke"
    metrics = list(root.glob("runs/*/*/metrics.json"))
    assert len(metrics) == 4 and all(json.loads(path.read_text())["coverage"] for path in metrics)
    assert (root / "settings_training.py").is_file()   # the copy to edit and re-run with --settings-dir
    edited = root / "settings_training.py"
    edited.write_text(edited.read_text().replace('"epochs": 2', '"epochs": 3'))
    again = run_installed(venv, "plan", "--settings-dir", str(root), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert report["settings_dir"] == str(root)
    assert report["configurations"][0]["jobs"][0]["workload"]["training_examples"] == 1024 * 3


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_installs_torch_alone_from_the_given_index(tmp_path):
    def set_up_commands(*variables):
        """The commands `make` would run to set up a virtual environment at tmp_path (none is run)."""
        result = subprocess.run(["make", "-n", "-B", f"{tmp_path}/.ready", f"VENV={tmp_path}", *variables],
                                cwd=REPO, capture_output=True, text=True, check=True)
        return result.stdout.splitlines()

    index = "file:///a/torch/wheel/index"
    torch_line = next(line for line in set_up_commands(f"TORCH_INDEX_URL={index}") if "torch==" in line)
    assert f'pip install --index-url "{index}" "torch==' in torch_line
    assert all(index not in line for line in set_up_commands(f"TORCH_INDEX_URL={index}") if "torch==" not in line)
    assert all("--index-url" not in line for line in set_up_commands())
