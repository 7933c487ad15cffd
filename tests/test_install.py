"""A normal (non-editable) `pip install` of a copy of the repository, used from other directories.

No network is needed: the package is installed with --no-deps --no-build-isolation --no-index
into a fresh virtual environment that sees the packages of the interpreter running the tests.
"""

import ast
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from helpers import REPO, repository_copy


def clean_environment():
    """The environment without PYTHONPATH (it would shadow the installed modules) or torchrun variables."""
    dropped = ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {
        **{k: v for k, v in os.environ.items() if k not in dropped},
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_INPUT": "1",
    }


def make_environment(venv):
    """A virtual environment that also sees this interpreter's packages (torch, numpy, pip, setuptools).

    A venv made from inside a venv sees only the base interpreter's packages, so this
    interpreter's site-packages folders are added with a .pth file; without pip of its own
    (--without-pip) it uses this interpreter's pip and setuptools.
    """
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
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
    result = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            str(copy),
        ],
        capture_output=True,
        text=True,
        env=clean_environment(),
        cwd=work,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    shutil.rmtree(copy)  # the installed script must not need the source tree
    return venv, purelib


def run_installed(venv, *args, cwd):
    """Run the installed `nnpd` console script in `cwd`."""
    return subprocess.run(
        [str(venv / "bin" / "nnpd"), *args],
        cwd=cwd,
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def have_c_compiler():
    """Whether the compiler Python's build uses is on PATH (without it _probes is not built)."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(compiler) is not None


def repository_modules():
    """Names of the repository's top-level Python modules (setup.py is the build, not a module)."""
    return sorted(path.stem for path in REPO.glob("*.py") if path.name != "setup.py")


@pytest.mark.unit
def test_pyproject_packages_every_module_of_the_repository():
    packaged = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["py-modules"]
    assert sorted(packaged) == repository_modules()


@pytest.mark.launch
def test_every_module_is_installed_and_imported_from_the_environment(installed, tmp_path):
    venv, purelib = installed
    for name in repository_modules():
        assert (purelib / f"{name}.py").is_file(), name
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import nnpd, probes; print(nnpd.__file__, probes.NATIVE)"],
        cwd=tmp_path,
        env=clean_environment(),
        capture_output=True,
        text=True,
    )
    assert where.returncode == 0, where.stderr
    path, native = where.stdout.split()
    assert Path(path).parent == purelib
    if have_c_compiler():
        assert native == "True"  # the C extension was built and installed with the modules


@pytest.mark.launch
def test_installed_script_plans_from_another_directory(installed, tmp_path):
    venv, purelib = installed
    result = run_installed(venv, "plan", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["profile"] == "smoke" and report["jobs"] == 4
    assert Path(report["settings_dir"]) == purelib  # the settings installed with the code
    assert not list(tmp_path.iterdir())  # plan writes nothing


@pytest.mark.slow
@pytest.mark.launch
def test_installed_script_runs_smoke_from_an_empty_directory(installed, tmp_path):
    venv, _ = installed
    result = run_installed(venv, "run", "--profile", "smoke", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["outputs"]
    root = tmp_path / "outputs" / "smoke"
    metrics = list(root.glob("runs/*/*/metrics.json"))
    assert len(metrics) == 4 and all(json.loads(path.read_text())["coverage"] for path in metrics)
    assert (root / "settings_training.py").is_file()  # the copy to edit and re-run with --settings-dir
    edited = root / "settings_training.py"
    edited.write_text(edited.read_text().replace('"epochs": 2', '"epochs": 3'))
    again = run_installed(venv, "plan", "--settings-dir", str(root), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert report["settings_dir"] == str(root)
    assert report["configurations"][0]["jobs"][0]["workload"]["training_examples"] == 1024 * 3


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.launch
def test_make_installs_torch_alone_from_the_given_index(tmp_path):
    def set_up_commands(*variables):
        """The commands `make` would run to set up a virtual environment at tmp_path (none is run)."""
        result = subprocess.run(
            ["make", "-n", "-B", f"{tmp_path}/.ready", f"VENV={tmp_path}", *variables],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        return result.stdout.splitlines()

    index = "file:///a/torch/wheel/index"
    torch_line = next(line for line in set_up_commands(f"TORCH_INDEX_URL={index}") if "torch==" in line)
    assert f'pip install --index-url "{index}" "torch==' in torch_line
    assert all(index not in line for line in set_up_commands(f"TORCH_INDEX_URL={index}") if "torch==" not in line)
    assert all("--index-url" not in line for line in set_up_commands())


# ---------------------------------------------------------------- which torch an install takes


def supported_torch():
    """(first, last) (major, minor) torch versions of the README's "Supported:" sentence."""
    found = re.search(r"Supported:.*?torch (\d+)\.(\d+)\s+to\s+(\d+)\.(\d+)", (REPO / "README.md").read_text(), re.S)
    assert found, 'README.md no longer says "Supported: ... torch A.B to C.D"'
    major, minor, last_major, last_minor = map(int, found.groups())
    return (major, minor), (last_major, last_minor)


def declared(name):
    """The requirement on `name` among pyproject.toml's run-time dependencies."""
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(requirement for requirement in map(Requirement, dependencies) if requirement.name == name)


@pytest.mark.unit
def test_the_declared_torch_is_the_supported_range():
    (major, minor), (last_major, last_minor) = supported_torch()
    specifier = declared("torch").specifier
    pinned = re.search(r"^TORCH\s*\?=\s*torch==(\S+)", (REPO / "Makefile").read_text(), re.M)
    supported = [f"{major}.{minor}.0", f"{last_major}.{last_minor}.0", f"{last_major}.{last_minor}.9", pinned[1]]
    unsupported = [
        f"{major}.{minor - 1}.9" if minor else f"{major - 1}.99.9",
        f"{last_major}.{last_minor + 1}.0rc1",
        f"{last_major}.{last_minor + 1}.0",
        f"{last_major}.{last_minor + 1}.1",
        f"{last_major + 1}.0.0",
    ]
    assert [version for version in supported if not specifier.contains(version)] == [], specifier
    assert [version for version in unsupported if specifier.contains(version, prereleases=True)] == [], specifier


@pytest.mark.unit
def test_every_package_the_tests_import_is_declared_and_installed_by_make():
    """A package the tests import at the top of a file is torch, numpy or in an extra of pyproject.toml, and
    `make setup` installs the test extra's (a test dependency nobody declared breaks a fresh machine)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    test_extra = {Requirement(line).name for line in project["optional-dependencies"]["test"]}
    requirements = [*project["dependencies"], *sum(project["optional-dependencies"].values(), [])]
    ours = {path.stem for path in [*REPO.glob("*.py"), *REPO.glob("tests/*.py")]} | {"_probes"}
    imported = set()
    for path in REPO.glob("tests/*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = {name for name in imported if name not in sys.stdlib_module_names and name not in ours}
    assert {"torch", "pytest", "packaging"} <= third_party  # the scan sees the imports
    assert third_party - {Requirement(line).name for line in requirements} == set()
    checked = re.search(r'-c "import (numpy, pytest[^"]*)" 2>/dev/null', (REPO / "Makefile").read_text())
    assert checked and test_extra <= set(checked[1].split(", ")), "make setup must install the test extra"


def fake_wheel(folder, name, version):
    """An empty pure-Python wheel of `name` `version`: enough for pip to resolve with."""
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{name}/__init__.py", "")
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: nnpd-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


@pytest.mark.launch
def test_pip_install_picks_the_newest_supported_torch(tmp_path):
    """`pip install .` offered torch on both sides of the README's range (offline: empty stand-in
    wheels on a local index) resolves to the newest supported one, never a newer release."""
    (major, minor), (last_major, last_minor) = supported_torch()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    newest_supported = f"{last_major}.{last_minor}.1"
    for version in (
        f"{major}.{minor - 1}.1" if minor else f"{major - 1}.9.1",
        f"{major}.{minor}.0",
        newest_supported,
        f"{last_major}.{last_minor + 1}.1",
        f"{last_major + 1}.0.0",
    ):
        fake_wheel(wheels, "torch", version)
    for version in ("1.23.5", "2.4.0"):
        fake_wheel(wheels, "numpy", version)
    copy = repository_copy(tmp_path / "nnpd-copy")
    report = tmp_path / "report.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--no-index",
            "--find-links",
            str(wheels),
            "--no-build-isolation",
            "--quiet",
            "--report",
            str(report),
            str(copy),
        ],
        capture_output=True,
        text=True,
        env=clean_environment(),
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    chosen = {
        item["metadata"]["name"]: item["metadata"]["version"] for item in json.loads(report.read_text())["install"]
    }
    assert chosen["torch"] == newest_supported, chosen
    assert chosen["numpy"] == "2.4.0", chosen


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.launch
def test_make_gives_the_environment_a_torchrun_when_torch_is_installed_outside_it(tmp_path):
    """A venv reusing the system's torch has no torchrun of its own: the set-up writes one that runs
    torch.distributed.run with the venv's python, so activation puts a working torchrun on PATH."""
    printed = subprocess.run(
        ["make", "-n", "-B", f"{tmp_path}/.ready", f"VENV={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    step = next(line for line in re.sub(r"\\\n\s*", " ", printed).splitlines() if "torch.distributed.run" in line)
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"  # the venv's python, here saying what it was asked to run
    python.write_text('#!/bin/sh\necho "$0" "$@"\n')
    python.chmod(0o755)
    subprocess.run(["bash", "-euc", step], cwd=REPO, check=True, timeout=60)
    torchrun = tmp_path / "bin" / "torchrun"
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node=2", "nnpd.py", "run"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout == f"{python} -m torch.distributed.run --standalone --nproc_per_node=2 nnpd.py run\n", result
    torchrun.write_text("#!/bin/sh\n# torch's own\n")
    subprocess.run(["bash", "-euc", step], cwd=REPO, check=True, timeout=60)
    assert torchrun.read_text() == "#!/bin/sh\n# torch's own\n"  # an existing torchrun is left alone
