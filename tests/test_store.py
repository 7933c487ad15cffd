"""Tests for store.py: atomic commits, locking across real processes, damage handling."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import store  # noqa: E402
from store import DamagedArtifact, MissingArtifact, Store  # noqa: E402

WORKER = str(Path(__file__).with_name("store_worker.py"))
RECIPE = {"n": 1000, "seed": 7}  # must match store_worker.RECIPE


def spawn(*args):
    """Start a store_worker subprocess with piped text stdout."""
    return subprocess.Popen([sys.executable, WORKER, *map(str, args)], stdout=subprocess.PIPE, text=True)


def build_xy(writer):
    """Small two-array build used by many tests."""
    writer.array("x", np.arange(10.0))
    writer.array("y", np.arange(6, dtype=np.int32).reshape(2, 3))
    return {"rows": 10}


def tmp_dirs(root):
    """List leftover temp build dirs under the cache."""
    return sorted(p.name for p in Path(root, "cache").glob("*/.tmp-*"))


# ---------------------------------------------------------------- concurrency (real processes)


@pytest.mark.launch
def test_six_processes_race_build_once(tmp_path):
    root, counter, go = tmp_path / "out", tmp_path / "count", tmp_path / "go"
    procs = [spawn("race", root, counter, go) for _ in range(6)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    go.touch()
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(counter.read_text().splitlines()) == 1  # the builder ran exactly once
    expected = hashlib.sha256((np.arange(1000, dtype=np.float64) * 7).tobytes()).hexdigest()
    assert {o[0] for o in outs} == {expected}
    assert len({o[1] for o in outs}) == 1
    assert tmp_dirs(root) == []
    art = Store(root).get("data", RECIPE)
    assert art.metadata["builder"] == int(counter.read_text())


@pytest.mark.launch
def test_sigkilled_build_leaves_store_usable(tmp_path):
    root = tmp_path / "out"
    proc = spawn("hang", root)
    try:
        assert proc.stdout.readline().strip() == "half"
        stale = tmp_dirs(root)
        assert len(stale) == 1
        s = Store(root)
        assert s.find("data", s.key("data", RECIPE)) is None  # a temp dir is never an artifact
        assert list(s.entries()) == []
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    s = Store(root)
    with pytest.raises(MissingArtifact):
        s.get("data", RECIPE)

    def full(writer):
        writer.array("a", np.ones(100))
        writer.array("b", np.ones(100))

    art = s.get("data", RECIPE, full)
    assert art.files == ["a.npy", "b.npy"]
    assert art.verify(deep=True)
    assert tmp_dirs(root) == []  # the next builder removed the stale temp dir
    assert s.verify() == (1, [])


@pytest.mark.launch
def test_nonblocking_lock_from_second_process_reports_busy(tmp_path):
    s = Store(tmp_path)
    with s.lock("job-1") as held:
        assert held is True
        assert (
            subprocess.run(
                [sys.executable, WORKER, "trylock", tmp_path, "job-1"], capture_output=True, text=True, timeout=30
            ).stdout.strip()
            == "busy"
        )
    out = subprocess.run(
        [sys.executable, WORKER, "trylock", tmp_path, "job-1"], capture_output=True, text=True, timeout=30
    )
    assert out.stdout.strip() == "held"


# ---------------------------------------------------------------- failures


@pytest.mark.unit
def test_build_that_raises_commits_nothing(tmp_path):
    s = Store(tmp_path)

    def broken(writer):
        writer.array("x", np.zeros(3))
        raise RuntimeError("simulator exploded")

    with pytest.raises(RuntimeError, match="exploded"):
        s.get("data", {"a": 1}, broken)
    assert list(s.entries()) == [] and tmp_dirs(tmp_path) == []
    assert s.get("data", {"a": 1}, build_xy).array("x").tolist() == list(np.arange(10.0))


@pytest.mark.parametrize("bad", ["../x", "a/b", ".hidden", "", "a\\b"])
@pytest.mark.unit
def test_unsafe_names_rejected(tmp_path, bad):
    s = Store(tmp_path)
    with pytest.raises(ValueError, match="unsafe|non-empty"):
        s.get("data", {"bad": bad}, lambda w: w.array(bad, np.zeros(2)))
    with pytest.raises(ValueError, match="unsafe|non-empty"):
        s.get(bad, {}, build_xy)
    with pytest.raises(ValueError, match="unsafe|non-empty"):
        with s.lock(bad):
            pass
    assert list(s.entries()) == [] and tmp_dirs(tmp_path) == []


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda w: w.array("o", np.array([1, "a", None], dtype=object)), "object dtype"),
        (lambda w: w.allocate("o", (3,), object), "object dtype"),
        (lambda w: w.json("m", {"loss": float("nan")}), "NaN"),
        (lambda w: {"loss": float("inf")}, "NaN"),
        (lambda w: w.json("artifact", {}), "reserved"),
        (lambda w: (w.array("x", np.zeros(1)), w.array("x", np.zeros(1))), "twice"),
        (lambda w: [w.path("raw.bin")] and None, "never written"),
        (lambda w: [(w.directory / "sneaky.txt").write_text("x")] and None, "without the writer"),
        (lambda w: w.weights({"w": np.zeros(2)}), "tensors"),
    ],
)
@pytest.mark.unit
def test_invalid_content_rejected_and_nothing_committed(tmp_path, build, match):
    s = Store(tmp_path)
    with pytest.raises(ValueError, match=match):
        s.get("data", {}, build)
    assert list(s.entries()) == [] and tmp_dirs(tmp_path) == []


@pytest.mark.unit
def test_nan_in_recipe_and_canonical_json():
    with pytest.raises(ValueError, match="NaN"):
        store.canonical_json({"x": float("nan")})
    assert store.canonical_json({"b": 1, "a": [1, 2]}) == '{"a":[1,2],"b":1}'
    assert store.digest({"b": 1, "a": 2}) == hashlib.sha256(b'{"a":2,"b":1}').hexdigest()


# ---------------------------------------------------------------- damage


@pytest.mark.unit
def test_same_size_byte_flip_is_found_by_every_read(tmp_path):
    s = Store(tmp_path)
    art = s.get("data", {"k": 1}, build_xy)
    assert s.find("data", art.key).path == art.path  # read once: found intact
    f = art.path / "x.npy"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(raw)
    assert art.verify() is True  # the size check alone passes
    assert art.verify(deep=True) is False
    for read in (lambda: s.find("data", art.key), lambda: s.get("data", {"k": 1}), lambda: s.artifact_at(art.path)):
        with pytest.raises(DamagedArtifact, match="checksum mismatch"):
            read()
    assert s.verify() == (1, [str(art.path)])
    with pytest.warns(UserWarning, match="damaged"):
        again = s.get("data", {"k": 1}, build_xy)  # moved aside and rebuilt
    assert again.verify(deep=True) and list((tmp_path / "damaged" / "data").iterdir())


@pytest.mark.unit
def test_a_file_read_before_and_changed_later_is_hashed_again(tmp_path, monkeypatch):
    s = Store(tmp_path)
    art = s.get("data", {"k": 3}, build_xy)
    monkeypatch.setattr(store, "_SETTLED_NS", 0)  # remember even a file written just now
    assert s.find("data", art.key) is not None and str(art.path / "x.npy") in store._HASHED
    time.sleep(0.02)  # past the file-time tick
    with open(art.path / "x.npy", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(DamagedArtifact, match="checksum mismatch"):
        s.find("data", art.key)


@pytest.mark.unit
def test_an_altered_manifest_is_damage(tmp_path):
    s = Store(tmp_path)
    art = s.get("data", {"k": 4}, build_xy, metadata={"rows": 10})
    manifest = (art.path / "artifact.json").read_text()
    (art.path / "artifact.json").write_text(manifest.replace('"rows": 10', '"rows": 90'))  # same size, valid JSON
    with pytest.raises(DamagedArtifact, match="manifest altered"):
        s.find("data", art.key)


@pytest.mark.unit
def test_training_states_carry_their_key_and_checksum(tmp_path):
    s = Store(tmp_path)
    key, other = "a" * 64, "b" * 64
    assert s.load_scratch("model", key) is None
    s.save_scratch("model", key, b"state bytes")
    assert s.load_scratch("model", key) == b"state bytes"
    path = s.scratch_file("model", key)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01  # one flipped bit in the state
    path.write_bytes(raw)
    with pytest.raises(DamagedArtifact, match="checksum"):
        s.load_scratch("model", key)
    s.save_scratch("model", other, b"another model's state")
    os.replace(s.scratch_file("model", other), path)  # a valid state, of another model
    with pytest.raises(DamagedArtifact, match="belongs to"):
        s.load_scratch("model", key)
    path.write_bytes(b"PK\x03\x04 a plain torch.save file")  # what an earlier release saved
    with pytest.raises(DamagedArtifact, match="not a state nnpd saved"):
        s.load_scratch("model", key)


@pytest.mark.parametrize("make", ["fifo", "folder"])
@pytest.mark.unit
def test_a_non_regular_file_where_a_training_state_belongs_is_cleared_not_read(tmp_path, make):
    # A FIFO blocked the read for ever; a folder failed every save, so the model was never committed.
    s = Store(tmp_path)
    key = "c" * 64
    path = s.scratch_file("model", key)
    path.parent.mkdir(parents=True, exist_ok=True)
    if make == "fifo":
        os.mkfifo(path)
    else:
        (path / "inside").mkdir(parents=True)
    with pytest.raises(DamagedArtifact, match="not a regular file"):
        s.load_scratch("model", key)
    assert not path.exists()
    assert [p.name.split(".moved-")[0] for p in path.parent.iterdir()] == ([path.name] if make == "folder" else [])
    s.save_scratch("model", key, b"state")
    assert s.load_scratch("model", key) == b"state"
    path.unlink()
    path.mkdir()
    s.drop_scratch("model", key)  # a committed build forgets it all the same
    assert not path.exists()


@pytest.mark.unit
def test_truncation_found_by_fast_check_moved_aside_and_rebuilt(tmp_path):
    s = Store(tmp_path)
    art = s.get("data", {"k": 1}, build_xy)
    with open(art.path / "y.npy", "r+b") as f:
        f.truncate(50)
    with pytest.raises(DamagedArtifact, match=re.escape(str(art.path))):
        s.find("data", art.key)
    with pytest.raises(DamagedArtifact, match="damaged"):
        s.get("data", {"k": 1})
    with pytest.warns(UserWarning, match="damaged"):
        again = s.get("data", {"k": 1}, build_xy)
    assert again.path == art.path and again.verify(deep=True)
    moved = list((tmp_path / "damaged" / "data").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith(art.key + "-")
    assert (moved[0] / "y.npy").stat().st_size == 50  # kept, not deleted
    assert s.verify() == (1, [])


@pytest.mark.unit
def test_unreadable_manifest_is_damage(tmp_path):
    s = Store(tmp_path)
    art = s.get("data", {"k": 2}, build_xy)
    (art.path / "artifact.json").write_text("{not json")
    with pytest.raises(DamagedArtifact, match="manifest"):
        s.find("data", art.key)
    assert s.verify() == (1, [str(art.path)])


# ---------------------------------------------------------------- round trips


@pytest.mark.unit
def test_store_construction_creates_nothing(tmp_path):
    s = Store(tmp_path / "out")
    assert s.find("data", "0" * 64) is None
    assert list(s.entries()) == [] and s.verify() == (0, []) and s.prune(set()) == []
    with pytest.raises(MissingArtifact, match="no artifact"):
        s.artifact_at(tmp_path / "out" / "cache" / "data" / ("0" * 64))
    assert not (tmp_path / "out").exists()


@pytest.mark.unit
def test_arrays_json_weights_round_trip(tmp_path):
    s = Store(tmp_path)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    x = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)

    def build(writer):
        writer.array("x", x)
        big = writer.allocate("big", (1000, 4), np.float64)
        for start in range(0, 1000, 300):  # filled in chunks, like a simulator would
            stop = min(start + 300, 1000)
            big[start:stop] = np.arange(start * 4, stop * 4).reshape(-1, 4)
        writer.json("summary", {"mean": 1.5, "names": ["a", "b"]})
        writer.weights(net.state_dict())
        writer.path("notes.txt").write_text("hello")
        return {"source": "test"}

    art = s.get("study", {"n": 5}, build, metadata={"stage": "simulate"})
    for loaded in (art, s.get("study", {"n": 5}), s.artifact_at(art.path)):
        np.testing.assert_array_equal(loaded.array("x"), x)
        mm = loaded.array("big", mmap=True)
        assert isinstance(mm, np.memmap) and not mm.flags.writeable
        np.testing.assert_array_equal(mm, np.arange(4000.0).reshape(1000, 4))
        assert loaded.json("summary") == {"mean": 1.5, "names": ["a", "b"]}
        sd = loaded.state_dict()
        assert sd.keys() == net.state_dict().keys()
        assert all(torch.equal(sd[k], v) for k, v in net.state_dict().items())
        assert (loaded.path / "notes.txt").read_text() == "hello"
    m = json.loads((art.path / "artifact.json").read_text())
    assert m["schema"] == 1 and m["name"] == "study" and m["key"] == art.key == art.path.name
    assert m["recipe"] == {"n": 5} and m["metadata"] == {"stage": "simulate", "source": "test"}
    assert m["created"].endswith("Z")
    assert set(m["files"]) == {"x.npy", "big.npy", "summary.json", "weights.pt", "notes.txt"}
    assert m["files"]["big.npy"]["shape"] == [1000, 4] and m["files"]["big.npy"]["dtype"] == "<f8"
    assert m["files"]["x.npy"]["dtype"] == "<f4"
    for fname, info in m["files"].items():
        data = (art.path / fname).read_bytes()
        assert info["size"] == len(data) and info["sha256"] == hashlib.sha256(data).hexdigest()
    with pytest.raises(MissingArtifact, match="no file"):
        art.array("nope")


recipes = st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5), st.booleans()), max_size=6)


@settings(max_examples=50, deadline=None)
@given(recipes)
@pytest.mark.property
def test_key_stable_under_dict_reordering(recipe):
    s = Store("/nonexistent-root")
    reordered = dict(reversed(list(recipe.items())))
    assert s.key("data", recipe) == s.key("data", reordered)
    assert s.key("data", {"nested": recipe}) == s.key("data", {"nested": reordered})
    assert s.key("data", recipe) != s.key("other", recipe)


@pytest.mark.unit
def test_prune_keeps_keep_set_and_skips_locked(tmp_path):
    s = Store(tmp_path)
    arts = [s.get("data", {"i": i}, build_xy) for i in range(4)]
    keep = {arts[0].key, arts[1].key}
    with s.lock(f"data-{arts[2].key}"):  # a "builder" holds this one: prune must skip it
        deleted = s.prune(keep)
    assert deleted == [str(arts[3].path)]
    assert {k for _, k, _ in s.entries()} == {arts[0].key, arts[1].key, arts[2].key}
    assert s.prune(keep) == [str(arts[2].path)]
    assert {k for _, k, _ in s.entries()} == keep and tmp_dirs(tmp_path) == []
    assert s.verify() == (2, [])


@pytest.mark.unit
def test_write_json_atomic(tmp_path):
    target = tmp_path / "sub" / "status.json"
    store.write_json_atomic(target, {"b": 1, "a": [1.5]})
    assert json.loads(target.read_text()) == {"a": [1.5], "b": 1}
    with pytest.raises(ValueError, match="status.json"):
        store.write_json_atomic(target, {"a": float("nan")})
    assert json.loads(target.read_text()) == {"a": [1.5], "b": 1}  # old content intact
    assert sorted(p.name for p in target.parent.iterdir()) == ["status.json"]  # no temp left


@pytest.mark.unit
def test_commit_survives_rerun_and_is_reused(tmp_path):
    s = Store(tmp_path)
    calls = []

    def counted(writer):
        calls.append(1)
        return build_xy(writer)

    a = s.get("data", {"k": 3}, counted)
    b = s.get("data", {"k": 3}, counted)
    c = Store(tmp_path).get("data", {"k": 3}, counted)
    assert len(calls) == 1 and a.path == b.path == c.path
    assert a.manifest == c.manifest
