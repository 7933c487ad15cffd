"""The documentation runs: every block of the README and docs/ marked `# runs on CPU`, the
paths they mention, the Slurm script of docs/clusters.md and a scheduler's preemption.

A block is a fenced ```sh or ```python block whose first line is `# runs on CPU`. The
blocks of one document run in order, in one fresh copy of the repository, as a reader
would type them there after the README's set-up: each in a fresh `bash` that has sourced
`.venv/bin/activate` (the README's one step after `make`), so `python` and `torchrun` are
the virtual environment's own, with nothing else added to PATH or PYTHONPATH; a python
block is typed into that `python`. Each must exit with status 0.
"""

import ast
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import jobs
from helpers import (
    LAUNCH_VARIABLES,
    REPO,
    TIMEOUT,
    ahead,
    finish_agent,
    free_port,
    made_ahead,
    repository_copy,
    run_cli,
    toy_environment,
    toy_settings,
    train_command,
    write_settings,
)

MARKER = "# runs on CPU"
BLOCK = re.compile(r"^```(sh|python)\n(.*?)^```", re.MULTILINE | re.DOTALL)
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# What a fresh shell does not inherit from the one running the tests: an active virtual
# environment, startup files of non-interactive shells and interpreters.
SHELL_VARIABLES = ("VIRTUAL_ENV", "VIRTUAL_ENV_PROMPT", "BASH_ENV", "ENV", "PYTHONHOME", "PYTHONSTARTUP")
# The README's step after the set-up, then the strict mode the blocks are held to.
ACTIVATE = ". .venv/bin/activate\nset -euo pipefail\n"


def runnable_blocks(document):
    """(language, code) of every block of a document marked as runnable on CPU, in order."""
    return [
        (language, code) for language, code in BLOCK.findall(document.read_text()) if code.startswith(MARKER + "\n")
    ]


def set_up_environment():
    """The virtual environment `make` set up, which the documents' reader activates: the tests' own."""
    venv = Path(sys.prefix)
    if sys.prefix == sys.base_prefix or not (venv / "bin" / "activate").is_file():
        pytest.skip(
            "the documents' commands run in the set-up's virtual environment: run the tests with its "
            "interpreter (make test, or .venv/bin/python -m pytest)"
        )
    return venv


def reader_copy(target):
    """A copy of the repository at `target` as a reader's checkout after `make`: with its `.venv`."""
    copy = repository_copy(target)
    (copy / ".venv").symlink_to(set_up_environment(), target_is_directory=True)
    return copy


def fresh_shell_environment():
    """The environment of a fresh shell on this machine: no virtual environment active, its bin/
    not on PATH, no PYTHONPATH or torchrun variables; CPU only."""
    venv_bin = (Path(sys.prefix) / "bin").resolve()
    path = [
        folder
        for folder in os.environ.get("PATH", "").split(os.pathsep)
        if folder and Path(folder).resolve() != venv_bin
    ]
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES + SHELL_VARIABLES}
    return {**environment, "PATH": os.pathsep.join(path), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def reader_command(language, code):
    """(argv, standard input) of a block typed into an activated fresh shell, or into its `python`."""
    if language == "sh":
        return ["bash", "-c", ACTIVATE + code], ""
    return ["bash", "-c", ACTIVATE + "exec python -"], code


def reader_environment(code_dir, commands, extra=None):
    """The environment of a launch of code at `code_dir`: CPU only, the given commands first on PATH."""
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    environment.update(
        PATH=f"{commands}{os.pathsep}{environment.get('PATH', '')}",
        PYTHONPATH=str(code_dir),
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
    )
    return {**environment, **(extra or {})}


@pytest.mark.launch
def test_activating_the_environment_gives_its_python_and_torchrun(tmp_path):
    """After `. .venv/bin/activate` in a fresh shell, `python` and `torchrun` are the set-up's.

    (The documents' blocks then run them for real; this says plainly when the set-up lacks one.)"""
    venv = set_up_environment()
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / ".venv").symlink_to(venv, target_is_directory=True)
    script = ACTIVATE + 'command -v python torchrun\npython -c "import sys; print(sys.prefix)"\n'
    result = subprocess.run(
        ["bash", "-c", script], cwd=checkout, env=fresh_shell_environment(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, (
        f"`python` or `torchrun` is missing after activation:\n{result.stdout}{result.stderr}"
    )
    python, torchrun, prefix = result.stdout.split()
    assert Path(python).parent == Path(torchrun).parent == venv / "bin"
    assert Path(prefix) == venv


def run_the_documents_blocks(folder, name):
    """The blocks of document `name` run in order in a reader's copy in `folder`, up to the first that fails:
    [(block, completed process)]."""
    document = next(path for path in DOCUMENTS if path.name == name)
    copy = reader_copy(folder / "nnpd")
    environment = fresh_shell_environment()
    ran = []
    for language, code in runnable_blocks(document):
        command, typed = reader_command(language, code)
        ran.append(
            (
                code,
                subprocess.run(
                    command, cwd=copy, env=environment, input=typed, capture_output=True, text=True, timeout=TIMEOUT
                ),
            )
        )
        if ran[-1][1].returncode != 0:
            break
    return ran


@pytest.fixture(scope="module")
def documents_run(request, tmp_path_factory):
    """Every document's blocks, the documents side by side (each in its own copy), before the first case."""
    return ahead(request, tmp_path_factory, "test_the_documented_commands_run", run_the_documents_blocks)


@pytest.mark.parametrize("name", [path.name for path in DOCUMENTS if runnable_blocks(path)])
@pytest.mark.slow
@pytest.mark.launch
def test_the_documented_commands_run(documents_run, name, tmp_path):
    _, ran = made_ahead(documents_run, run_the_documents_blocks, tmp_path, name=name)
    for code, result in ran:
        assert result.returncode == 0, f"{name}, block:\n{code}\n--- output:\n{result.stdout}\n{result.stderr}"


@pytest.mark.unit
def test_every_document_has_blocks_that_run():
    for document in [
        REPO / "README.md",
        REPO / "docs" / "storage.md",
        REPO / "docs" / "results.md",
        REPO / "docs" / "extending.md",
        REPO / "docs" / "devices.md",
    ]:
        assert runnable_blocks(document), document.name


@pytest.mark.unit
def test_the_paths_the_documents_name_exist():
    mentioned = re.compile(r"(?<![\w/.<-])((?:docs|examples|bench|tests)/[\w.-]+(?:/[\w.-]+)*\.(?:md|py|sh|sbatch))")
    for document in DOCUMENTS:
        text = document.read_text()
        links = re.findall(r"\]\(([^)#]+)\)", text)
        for target in links:
            assert (document.parent / target).exists(), f"{document.name} links to {target}"
        for path in mentioned.findall(text):
            assert (REPO / path).exists(), f"{document.name} names {path}"


@pytest.mark.unit
def test_clusters_shows_the_tested_several_nodes_command():
    def several_nodes(document):
        return [line for line in document.read_text().splitlines() if line.startswith("torchrun --nnodes")]

    # tests/test_distributed.py runs the README's line on the loopback interface
    assert several_nodes(REPO / "docs" / "clusters.md") == several_nodes(REPO / "README.md") != []


# ---------------------------------------------------------------- docs/clusters.md's promises


def slurm_stand_ins(folder):
    """`srun` (starts its command once per node, here) and `scontrol` (nodes node1.., each at NodeAddr 127.0.0.1)."""
    folder.mkdir()
    (folder / "srun").write_text(
        "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\npids=()\n"
        'for node in $(seq "$SLURM_JOB_NUM_NODES"); do "$@" & pids+=($!); done\n'
        'status=0\nfor pid in "${pids[@]}"; do wait "$pid" || status=1; done\nexit $status\n'
    )
    (folder / "scontrol").write_text(
        '#!/bin/bash\ncase "$1 $2" in\n'
        '"show hostnames") for node in $(seq "$SLURM_JOB_NUM_NODES"); do echo "node$node"; done ;;\n'
        '"show node") echo "NodeName=$3 Arch=x86_64"; echo "   NodeAddr=127.0.0.1 NodeHostName=$3" ;;\n'
        "*) exit 2 ;;\nesac\n"
    )
    for name in ("srun", "scontrol"):
        (folder / name).chmod(0o755)
    return folder


@pytest.mark.slow
@pytest.mark.launch
def test_the_slurm_script_runs_a_two_node_launch(tmp_path):
    settings = write_settings(tmp_path / "s", tmp_path / "out")
    slurm = {
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(REPO),
        "NNPD_RDZV_PORT": str(free_port()),
        "NNPD_WORKERS_PER_NODE": "1",
        "PYTHON": sys.executable,
    }
    environment = reader_environment(REPO, slurm_stand_ins(tmp_path / "bin"), slurm)
    job = subprocess.Popen(
        ["bash", str(REPO / "examples" / "slurm.sbatch"), "run", "--settings-dir", str(settings)],
        cwd=tmp_path,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output = job.communicate(timeout=TIMEOUT)[0]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)  # the script, the srun stand-in and both torchrun agents
        raise
    assert job.returncode == 0, output
    assert "2 nodes x 1 workers, rendezvous 127.0.0.1:" in output
    analysed = list((tmp_path / "out" / "runs").glob("*/*/metrics.json"))
    assert len(analysed) == 4


def wait_for_saved_state(root, process, seconds=300):
    """Wait until a training state is saved under the root's scratch/ (or the process ended)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and process.poll() is None:
        if list((root / "scratch" / "model").glob("*.pt")):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
@pytest.mark.launch
def test_a_preempted_torchrun_launch_resumes(tmp_path):
    """SIGTERM to the torchrun agent, as a scheduler sends it: the workers save, stop, and a re-run resumes."""
    # Three models of four epochs: each worker is inside its first model when the first state is saved (at an
    # epoch's end), and the re-run trains what is left in seconds.
    settings = toy_settings(tmp_path, train=20000, epochs=4)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    agent = subprocess.Popen(
        train_command(*launcher, settings=settings),
        env=toy_environment(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    saved = wait_for_saved_state(tmp_path / "out", agent)
    agent.send_signal(signal.SIGTERM)
    output = finish_agent(agent)
    assert saved, "no training state was saved:\n" + output
    assert agent.returncode != 0 and "training stopped on request" in output, output
    again = subprocess.run(
        train_command(settings=settings), env=toy_environment(), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed runs/" in again.stdout
    assert len(list((tmp_path / "out" / "cache" / "model").glob("*/artifact.json"))) == 3


# ---------------------------------------------------------------- what the code's messages point to

# A section named in a message: `README.md, "Heading"` or `docs/<page>.md, "Heading"`.
SECTION_REFERENCE = re.compile(r'(README\.md|docs/[\w-]+\.md), \\?"([^"\\]+)\\?"')
CODE = sorted(REPO.glob("*.py"))


def headings(document):
    """The headings of a markdown document, without their #s."""
    return {line.lstrip("#").strip() for line in (REPO / document).read_text().splitlines() if line.startswith("#")}


def settings_error_texts(path):
    """The literal text of every SettingsError(...) call of a module, its f-strings' literal parts joined."""
    texts = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "SettingsError":
            parts = [
                part.value for part in ast.walk(node) if isinstance(part, ast.Constant) and isinstance(part.value, str)
            ]
            texts.append("".join(parts))
    return texts


@pytest.mark.unit
def test_every_section_the_code_names_is_a_heading_of_that_document():
    named = [
        (path.name, document, heading)
        for path in CODE
        for document, heading in SECTION_REFERENCE.findall(path.read_text())
    ]
    assert any(document == "README.md" for _, document, _ in named)  # the scan sees the settings' own
    missing = [
        f'{name} names {document}, "{heading}"'
        for name, document, heading in named
        if heading not in headings(document)
    ]
    assert not missing, missing


@pytest.mark.unit
def test_a_settings_error_that_says_see_names_a_document():
    vague = [
        (path.name, text)
        for path in CODE
        for text in settings_error_texts(path)
        if re.search(r"\bsee (?!docs/|README)", text)
    ]
    assert not vague, vague


@pytest.mark.unit
def test_a_settings_file_without_either_form_names_a_real_section(tmp_path):
    import settings

    (tmp_path / "settings_training.py").write_text("x = 1\n")
    (tmp_path / "settings_analysis.py").write_text("x = 1\n")
    with pytest.raises(settings.SettingsError) as info:
        settings.load_profile(tmp_path)
    ((document, heading),) = SECTION_REFERENCE.findall(str(info.value))
    assert heading in headings(document)


# ---------------------------------------------------------------- the README's smallest study

SMALLEST = "examples/line"


def smallest_study_blocks():
    """{path: code} of the README's blocks that show a file of the smallest study (first line: `# <path>`)."""
    shown = {}
    for _, code in BLOCK.findall((REPO / "README.md").read_text()):
        first, _, rest = code.partition("\n")
        if first.startswith(f"# {SMALLEST}/"):
            shown[first[2:]] = rest
    return shown


@pytest.mark.unit
def test_the_readme_shows_the_smallest_study_whole_in_under_twenty_lines():
    shown = smallest_study_blocks()
    files = sorted(str(path.relative_to(REPO)) for path in (REPO / SMALLEST).glob("*.py"))
    assert sorted(shown) == files
    assert all(shown[path] == (REPO / path).read_text() for path in files)  # the files, as they are
    assert sum(len(code.splitlines()) for code in shown.values()) < 20


@pytest.mark.launch
def test_the_readmes_smallest_study_runs_and_reports(tmp_path):
    copy = reader_copy(tmp_path / "nnpd")
    block = next(
        code
        for language, code in BLOCK.findall((REPO / "README.md").read_text())
        if language == "sh" and f"--settings-dir {SMALLEST}" in code
    )
    command, typed = reader_command("sh", block)
    result = subprocess.run(
        command, cwd=copy, env=fresh_shell_environment(), input=typed, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert (copy / "outputs" / "line").is_dir() and len(list(copy.glob("outputs/line/runs/*/*/metrics.json"))) == 1
    report = result.stdout.split("run done")[-1]  # what `report` printed after the run
    assert "baseline       uniform" in report and "training: baseline uniform: " in report


@pytest.mark.unit
def test_every_function_the_documents_call_by_module_exists_there():
    import importlib

    called = re.compile(r"`([a-z_]\w*)\.([A-Za-z_]\w*)\(")  # `module.function(...)`, as a reader would call it
    modules = {path.stem for path in CODE}
    named = [
        (document.name, module, name)
        for document in DOCUMENTS
        for module, name in called.findall(document.read_text())
        if module in modules
    ]
    assert ("results.md", "c2st", "c2st") in named
    missing = [found for found in named if not hasattr(importlib.import_module(found[1]), found[2])]
    assert not missing, missing


@pytest.mark.unit
def test_extending_describes_the_pairs_and_recipe_the_kit_trains_the_weibull_example_on():
    text = (REPO / "docs" / "extending.md").read_text()
    assert "balanced joint\nand product pairs" not in text and "balanced joint and product pairs" not in text
    assert "re-pairs each x" in text and "contrastive NRE with 10 contrasting θ (`nre_study.KIT_TRAINING`)" in text
    weibull = (REPO / "examples" / "weibull" / "settings_training.py").read_text()
    assert '"training": {"epochs": 12, "batch_size": 256, "learning_rate": 3e-3}' in weibull  # the three keys named


def named_tests(text):
    """(file, test) for every `test_file.py::test_name` of a page, `::test_name` alone naming the last file's."""
    found, current = [], None
    for file, name in re.findall(r"(test_\w+\.py)?(?:::(test_\w+))?", text):
        current = file or current
        if name:
            found.append((current, name))
    return found


@pytest.mark.unit
def test_every_test_the_bitwise_list_names_exists():
    # docs/testing.md says why each bitwise assertion holds on any CPU; a renamed test must not leave it stale.
    named = named_tests((REPO / "docs" / "testing.md").read_text())
    assert len(named) > 40
    missing = [(file, name) for file, name in named if f"def {name}(" not in (REPO / "tests" / file).read_text()]
    assert not missing, missing


# ---------------------------------------------------------------- docs/extending.md's failing simulator

FRAGILE = REPO / "examples" / "fragile"
# The example's sizes, and the tiny ones its test trains with: seconds, and still about a sixth of the
# truths where the simulator fails.
FRAGILE_SIZES = {
    '"train": 6000, "validation": 500, "test": 500': '"train": 600, "validation": 100, "test": 100',
    '"epochs": 20': '"epochs": 2',
    '"sobol_truths": 256': '"sobol_truths": 64',
    '"root": f"outputs/fragile-{profile}"': '"root": {root!r}',
}


def fragile_copy(folder, root):
    """examples/fragile in `folder` with tiny sizes, writing to `root`."""
    folder.mkdir(parents=True)
    for path in FRAGILE.glob("*.py"):
        text = path.read_text()
        for old, new in FRAGILE_SIZES.items():
            text = text.replace(old, new.format(root=str(root)))
        (folder / path.name).write_text(text)
    return folder


@pytest.mark.launch
def test_the_failing_simulator_runs_through_run_and_report(tmp_path):
    """The docs' Fragile study fails (NaN) above θ = 2.5: `run` drops those truths, counts them and goes on."""
    settings = fragile_copy(tmp_path / "settings", tmp_path / "out")
    result = run_cli("run", "--settings-dir", str(settings))
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = json.loads(next((tmp_path / "out").glob("runs/*/*/metrics.json")).read_text())
    dropped = metrics["dropped_truths"]
    assert dropped["truths"] == 64 and 0 < dropped["dropped"] < 64 and dropped["cases"] == 64 - dropped["dropped"]
    assert metrics["expected_coverage"]["cases"] == dropped["cases"]
    note = f"note: baseline lognormal: {dropped['dropped']} of 64 truths dropped"
    assert note in result.stdout
    report = run_cli("report", "--settings-dir", str(settings), "--csv", str(tmp_path / "fragile.csv"))
    assert report.returncode == 0 and note in report.stdout, report.stdout + report.stderr
    with open(tmp_path / "fragile.csv", newline="") as file:
        row = next(csv.DictReader(file))
    assert int(row["dropped_truths.dropped"]) == dropped["dropped"] and int(row["dropped_train"]) > 0
    if not jobs.matplotlib_missing():  # the kit's default figures, drawn from the cases analysed
        assert sorted(path.name for path in (tmp_path / "out").glob("runs/*/**/*.png")) == [
            "bias_width.png",
            "estimates.png",
            "expected_coverage.png",
            "training.png",
        ]
