"""Guards of the output root: links and odd files refused or repaired before anything is written,
folders nnpd does not own left alone by verify and plan, leftovers of killed writes removed,
a full disk named in one line, and `~` in output.root."""

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, ahead, limit_file_size, made_ahead, main_in_process, one_error_line, run_cli, write_settings
from output_root import source_snapshot

# What the command line answers about the root does not depend on a fresh process: most commands below call
# nnpd.main in-process (conftest.main_in_process); the linked locks folder, killed writes' leftovers, the full
# disk's file-size limit and `~` (HOME) are real processes.


def tree(folder):
    """{relative path: content} of everything below folder, links not followed: bytes, "folder" or the link's target."""
    found = {}
    for path in sorted(Path(folder).rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            found[key] = f"link to {os.readlink(path)}"
        elif path.is_dir():
            found[key] = "folder"
        else:
            found[key] = path.read_bytes()
    return found


@pytest.fixture(scope="module")
def trained(trained_smoke_root):
    """A root the tiny smoke settings ran in, copied by the tests below."""
    return trained_smoke_root


def copy_root(trained, tmp_path, **patches):
    """A private copy of the trained root, and settings (patched as write_settings is) that point at it."""
    subprocess.run(["cp", "-a", str(trained), str(tmp_path / "out")], check=True)
    return tmp_path / "out", write_settings(tmp_path / "s", tmp_path / "out", **patches)


def outside_folder(tmp_path, files=()):
    """A folder outside the root, holding `files` (name: bytes)."""
    folder = tmp_path / "outside"
    folder.mkdir()
    for name, data in dict(files).items():
        (folder / name).write_bytes(data)
    return folder


def link_in_place(path, target):
    """Replace path (a folder or file, or nothing) by a symbolic link to target."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


def assert_refused_link(result, link):
    """Exit status 1 and one line naming the link and its fix."""
    line = one_error_line(result)
    assert result.returncode == 1 and str(link) in line and "symbolic link" in line and "remove the link" in line


# ---------------------------------------------------------------- links: refused before anything is written


def train_through_a_scratch_link(trained, folder, where):
    """`train` a copy of the trained root in `folder` with a model to train again and a link under scratch/:
    (the launch, the link, the folder it points into, that folder's tree before, the model's entry)."""
    root, settings = copy_root(trained, folder)
    model = next((root / "cache" / "model").iterdir())
    shutil.rmtree(model)  # so that one model trains again, using scratch/
    state = f"{model.name}.pt"
    outside = outside_folder(folder, {state: b"precious", "notes.txt": b"mine"})
    link = root / "scratch" / "model" if where == "folder" else root / "scratch" / "model" / state
    link_in_place(link, outside if where == "folder" else outside / state)
    before = tree(outside)
    return main_in_process("train", "--settings-dir", str(settings)), link, outside, before, model


@pytest.mark.parametrize("where", ["folder", "state"])
@pytest.mark.launch
def test_a_link_under_scratch_is_refused_and_what_it_points_to_is_kept(trained, tmp_path, where):
    result, link, outside, before, model = train_through_a_scratch_link(trained, tmp_path, where)
    assert_refused_link(result, link)
    assert tree(outside) == before
    assert not model.exists()  # nothing was trained through the link


def act_through_a_linked_locks_folder(trained, folder, action):
    """`action` on a copy of the trained root in `folder` whose locks/ is a link: (the launch, root, link target)."""
    root, settings = copy_root(trained, folder)
    outside = outside_folder(folder)
    link_in_place(root / "locks", outside)
    return run_cli(action, "--settings-dir", str(settings)), root, outside


@pytest.fixture(scope="module")
def linked_locks_launches(request, tmp_path_factory, trained):
    """The launches of the cases below, made side by side before the first one."""
    return ahead(
        request,
        tmp_path_factory,
        "test_a_linked_locks_folder_is_refused_before_any_lock_file_is_made",
        functools.partial(act_through_a_linked_locks_folder, trained),
    )


@pytest.mark.parametrize("action", ["train", "verify"])
@pytest.mark.launch
def test_a_linked_locks_folder_is_refused_before_any_lock_file_is_made(
    trained, linked_locks_launches, tmp_path, action
):
    _, (result, root, outside) = made_ahead(
        linked_locks_launches, functools.partial(act_through_a_linked_locks_folder, trained), tmp_path, action=action
    )
    assert_refused_link(result, root / "locks")
    assert tree(outside) == {}


def verify_through_a_linked_damaged_folder(trained, folder, linked):
    """`verify` a copy of the trained root in `folder` with damaged weights and `linked` a link:
    (the launch, root, link target, the damaged weights)."""
    root, settings = copy_root(trained, folder)
    weights = next(root.glob("cache/model/*/weights.pt"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # damage that verify finds and would move aside
    weights.write_bytes(bytes(data))
    outside = outside_folder(folder)
    link_in_place(root / linked, outside)
    return main_in_process("verify", "--settings-dir", str(settings)), root, outside, weights


@pytest.mark.parametrize("linked", ["damaged", "damaged/model"])
@pytest.mark.launch
def test_verify_never_moves_an_entry_out_of_the_root_through_a_linked_damaged_folder(trained, tmp_path, linked):
    result, root, outside, weights = verify_through_a_linked_damaged_folder(trained, tmp_path, linked)
    assert_refused_link(result, root / linked)
    assert tree(outside) == {} and weights.is_file()


# ---------------------------------------------------------------- verify refuses a folder nnpd does not own


@pytest.mark.unit
def test_verify_refuses_a_folder_without_the_marker_and_changes_nothing(tmp_path):
    root = tmp_path / "mine"
    for name, text in {
        "cache/notes.txt": "x",
        "runs/2023/a/metrics.json": "not json",
        "runs/2023/a/status.json": "{",
        "history.json": "[]",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    before = tree(root)
    result = main_in_process("verify", "--settings-dir", str(write_settings(tmp_path / "s", root)))
    assert result.returncode == 1 and "did not create" in one_error_line(result)
    assert tree(root) == before  # no locks/, no damaged/, the user's files in place


# ---------------------------------------------------------------- leftovers of killed atomic writes


@pytest.mark.launch
def test_leftovers_of_killed_atomic_writes_are_removed_by_the_next_launch_and_nothing_else(trained, tmp_path):
    root, settings = copy_root(trained, tmp_path)
    run = next(root.glob("runs/*/uniform-*"))
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = finished.pid  # the writer of a killed write is gone
    leftovers = [
        root / f".history.json.tmp-{dead}-0123abcd",
        root / f".settings_training.py.tmp-{dead}-ffffffff",
        run / f".run.json.tmp-{dead}-deadbeef",
        run / "metrics" / f".bias.json.tmp-{dead}-aaaaaaaa",
        run.parent / "plots" / f".priors.png.tmp-{dead}-00ff00ff",
        root / "report" / f".comparison.png.tmp-{dead}-abcdef01",
        root / "scratch" / "model" / f".{'0' * 64}.pt.tmp-{dead}-12345678",
    ]
    kept = [
        root / f".notes.tmp-{dead}-xyz",
        root / f"my.tmp-{dead}-abcdef01",
        run / f".a.tmp-{dead}-abcdef012",
        root / "report" / ".draft.tmp-abcdef01",
        root / "report" / f".comparison.png.tmp-{os.getpid()}-abcdef01",
    ]  # its writer still runs
    for path in leftovers + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half written")
    outside = outside_folder(tmp_path, {"precious.txt": b"precious"})
    link = root / ".timings.json.tmp-4-0a0b0c0d"
    link.symlink_to(outside / "precious.txt")  # named like a leftover, but a link: left alone
    result = run_cli("run", "--settings-dir", str(settings))
    assert result.returncode == 0, result.stderr
    assert [path for path in leftovers if path.exists()] == []
    assert all(path.read_bytes() == b"half written" for path in kept)
    assert link.is_symlink() and (outside / "precious.txt").read_bytes() == b"precious"


# ---------------------------------------------------------------- files where nnpd keeps folders


@pytest.mark.launch
def test_a_file_in_place_of_a_run_folder_is_refused_by_analyze_and_replaced_by_run(trained, tmp_path):
    root, settings = copy_root(trained, tmp_path)
    run = next(root.glob("runs/*/normal-*"))
    shutil.rmtree(run)
    run.write_text("not a run folder")
    refused = main_in_process("analyze", "--settings-dir", str(settings))
    assert refused.returncode == 1 and str(run) in one_error_line(refused) and "run train" in refused.stderr
    assert run.read_text() == "not a run folder"
    repaired = main_in_process("run", "--settings-dir", str(settings))
    assert repaired.returncode == 0 and "Traceback" not in repaired.stderr, repaired.stderr
    assert json.loads((run / "status.json").read_text())["state"] == "trained"
    assert json.loads((run / "analysis.json").read_text())["state"] == "complete"
    moved = list((root / "damaged" / "records").glob(f"*{run.name}-*"))
    assert len(moved) == 1 and moved[0].read_text() == "not a run folder"  # kept aside, not deleted


@pytest.mark.launch
def test_a_file_in_place_of_a_cache_entry_is_found_by_verify_and_rebuilt_by_a_launch(trained, tmp_path):
    root, settings = copy_root(trained, tmp_path)
    entry = next((root / "cache" / "model").iterdir())
    shutil.rmtree(entry)
    entry.write_text("not an artifact")
    checked = main_in_process("verify", "--settings-dir", str(settings))
    assert checked.returncode == 1 and str(entry) in json.loads(checked.stdout)["damaged"]
    assert not entry.exists() and len(list((root / "damaged" / "model").glob(f"{entry.name}-*"))) == 1
    entry.write_text("not an artifact")  # again, now for a launch to find
    rerun = main_in_process("run", "--settings-dir", str(settings))
    assert rerun.returncode == 0 and "Traceback" not in rerun.stderr, rerun.stderr
    assert (entry / "artifact.json").is_file()  # moved aside and rebuilt
    assert main_in_process("verify", "--settings-dir", str(settings)).returncode == 0


# ---------------------------------------------------------------- a full disk


def file_limit_above_the_snapshot(settings):
    """A file size limit that the source snapshot (the launch's largest small file) stays under."""
    _, data = source_snapshot(REPO, settings / "settings_training.py", settings / "settings_analysis.py")
    return len(data) + 100_000


@pytest.mark.parametrize("writer", ["numpy", "torch"])
@pytest.mark.launch
def test_a_short_write_of_numpy_or_torch_names_the_full_disk(tmp_path, writer):
    """numpy's tofile and torch.save, writing short, said "N requested and M written" or "unexpected pos"."""
    limit = file_limit_above_the_snapshot(write_settings(tmp_path / "s", tmp_path / "out"))
    if writer == "numpy":  # the training data's arrays outgrow the limit
        patch = f'settings["data"]["train"] = {limit // 8 * 2}\n'
    else:  # the weights do; no training state is saved before
        width = int((limit / 4) ** 0.5) + 64
        patch = f'settings["model"]["hidden"] = [{width}, {width}]\nsettings["runtime"]["resume_seconds"] = 0\n'
    settings = write_settings(tmp_path / "s", tmp_path / "out", training=patch)
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(
        [sys.executable, str(REPO / "nnpd.py"), "train", "--settings-dir", str(settings)],
        env={**environment, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit_file_size(limit),
    )
    assert result.returncode == 1
    line = one_error_line(result)
    assert "disk is full" in line and str(tmp_path / "out" / "cache") in line, line
    failed = "training-data" if writer == "numpy" else "model"
    assert not list((tmp_path / "out").glob(f"cache/{failed}/*/artifact.json"))  # nothing partial committed


# ---------------------------------------------------------------- plan checks the output root; `~`


def plan_in(folder, root, words):
    """`plan` with the output root `root`, run in `folder`, which holds the settings."""
    return main_in_process("plan", "--settings-dir", str(write_settings(folder / "s", root)), cwd=folder)


@pytest.mark.parametrize(
    "root, words",
    [
        ("/", "the filesystem's root; choose a folder of its own"),
        ("~", "your home folder; choose a folder of its own"),
        ("/dev/null", "not a folder"),
    ],
)
@pytest.mark.unit
def test_plan_reports_the_roots_a_launch_refuses(tmp_path, root, words):
    folder, result = tmp_path, plan_in(tmp_path, root, words)
    assert result.returncode == 2
    assert any(words in error for error in json.loads(result.stdout)["errors"])
    assert words in one_error_line(result) and one_error_line(result).startswith("nnpd: settings error:")
    assert not (folder / "~").exists()


@pytest.mark.launch
def test_plan_refuses_a_root_it_could_not_create_and_run_says_so_in_one_line(tmp_path):
    (tmp_path / "a-file").write_text("x")
    roots = [tmp_path / "a-file" / "out"] + ([Path("/proc/forbidden")] if Path("/proc").is_dir() else [])
    for root in roots:
        planned = plan_in(tmp_path, root, "")
        assert planned.returncode == 2 and "cannot be created" in one_error_line(planned), planned.stderr
        ran = main_in_process("run", "--settings-dir", str(tmp_path / "s"), cwd=tmp_path)
        assert ran.returncode != 0 and "cannot be created" in one_error_line(ran)
        assert "Traceback" not in ran.stderr and not root.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "s"]  # the probe left nothing


@pytest.mark.unit
def test_plan_reports_a_folder_nnpd_does_not_own(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("x")
    result = main_in_process("plan", "--settings-dir", str(write_settings(tmp_path / "s", tmp_path / "mine")))
    assert result.returncode == 2 and "did not create" in one_error_line(result)


@pytest.mark.launch
def test_a_tilde_in_output_root_is_the_home_folder_for_every_command(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    settings = write_settings(tmp_path / "s", "~/study")
    environment = {"HOME": str(home)}
    planned = run_cli("plan", "--settings-dir", str(settings), cwd=work, env=environment)
    assert planned.returncode == 0 and json.loads(planned.stdout)["output_root"] == str(home / "study")
    trained = run_cli("run", "--settings-dir", str(settings), cwd=work, env=environment)
    assert trained.returncode == 0, trained.stderr
    assert (home / "study" / ".nnpd-root").is_file() and list(work.iterdir()) == []  # no folder named "~"
    verified = run_cli("verify", "--settings-dir", str(settings), cwd=work, env=environment)
    assert verified.returncode == 0 and json.loads(verified.stdout)["root"] == str(home / "study")
    reported = run_cli("report", "--settings-dir", str(settings), cwd=work, env=environment)
    assert reported.returncode == 0 and "uniform" in reported.stdout, reported.stderr
