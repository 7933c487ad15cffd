"""Crash-safe, content-addressed artifact store (the README's storage section describes it).

Layout under an output root::

    cache/<name>/<key>/          committed artifact: data files + artifact.json
    cache/<name>/.tmp-<key>-...  build in progress (or left by a killed build)
    damaged/<name>/<key>-<time>  damaged entries moved aside, never deleted
    locks/<lock>.lock            fcntl lock files

A build writes into a temporary sibling directory, fsyncs every file, writes the
manifest last and commits with one atomic rename. Readers take no lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib
import io
import json
import os
import re
import secrets
import shutil
import stat
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

if TYPE_CHECKING:  # for annotations only: the store imports torch where it loads a model
    import torch

__all__ = [
    "MANIFEST",
    "NnpdError",
    "NnpdWarning",
    "DamagedArtifact",
    "MissingArtifact",
    "LaunchError",
    "RestoreError",
    "disk_problem",
    "refuse_link",
    "own_folder",
    "MAX_NUMBERS",
    "irregular_file",
    "read_npy",
    "canonical_json",
    "sha256_text",
    "digest",
    "record_checksum",
    "write_json_atomic",
    "ATOMIC_LEFTOVER",
    "write_bytes_atomic",
    "now_iso",
    "Writer",
    "Artifact",
    "Store",
    "EXPERIMENT_METHODS",
    "ROOT_MARKER",
    "import_class",
    "restore",
]

SCHEMA = 1
MANIFEST = "artifact.json"
TMP_PREFIX = ".tmp-"
SCRATCH_MAGIC = b"nnpd training state 1\n"  # heads a saved state: then a JSON line with key and checksum
_CHUNK = 4 << 20  # large reads keep deep verification near raw hashlib speed


# nnpd's errors share one root, kept here because every other module already imports this one
# and this one imports nothing of the project. Second bases stay only where callers catch them.
class NnpdError(Exception):
    """A problem nnpd found and names in one line that says how to fix it (not a bug)."""


class NnpdWarning(UserWarning):
    """Something nnpd computed but the user should know before trusting it (warnings.warn's category)."""


class DamagedArtifact(NnpdError):
    """A committed artifact or run record is damaged and cannot be repaired here."""


class MissingArtifact(NnpdError, LookupError):
    """Nothing is committed under the requested key (or file)."""


class LaunchError(NnpdError):
    """A launch cannot go on for a reason the user can fix; the message says how."""


class RestoreError(NnpdError, ValueError):
    """A run folder restore cannot reopen, or a restored run asked for what its study does not give."""


# ---------------------------------------------------------------- a full disk, links, odd files

# What a write into a full disk (or past a quota or a file size limit) fails with.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_problem(error, root=None):
    """A one-line explanation of a full or unwritable disk, or None for other OS errors."""
    where = error.filename or root or "the output root"
    if error.errno in DISK_FULL:
        return disk_full_line(where)
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {where}: it is not writable ({error.strerror}); fix the permissions or output.root"
    return None


def disk_full_line(where):
    """The one line that says a write into `where` found the disk full."""
    return f"cannot write {where}: the disk is full (or a file size limit was reached); free space and re-run"


def _disk_full(error, where):
    """A LaunchError with the disk-full line when `error` is a full disk's, else None."""
    if isinstance(error, OSError) and error.errno in DISK_FULL:
        return LaunchError(disk_full_line(error.filename or where))
    return None


def refuse_link(path):
    """Refuse a symbolic link where nnpd reads, writes or deletes inside its output root."""
    if os.path.islink(path):
        raise LaunchError(
            f"{path} is a symbolic link; nnpd never follows links inside its output root "
            f"(they could lead outside it); remove the link"
        )
    return path


def own_folder(path):
    """One of nnpd's folders: refused when it is a link, or a file where the folder belongs."""
    refuse_link(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise LaunchError(
            f"{path} is a file where nnpd keeps a folder of its own; move the file elsewhere or delete it"
        )
    return path


# Numbers nnpd reads from one .npy array (an infer input, a bank's x or θ): 0.8 GB as float64,
# checked against the header before anything is allocated.
MAX_NUMBERS = 10**8


def irregular_file(path):
    """Why `path` cannot be read as a file, or None for a regular file.

    Checked before opening: a FIFO blocks the open for ever and /dev/zero never ends.
    """
    try:
        kind = os.stat(path).st_mode
    except (OSError, ValueError) as error:
        return f"cannot be read ({getattr(error, 'strerror', None) or error})"
    if not stat.S_ISREG(kind):
        return "is not a regular file (a folder, FIFO or device)"
    return None


def read_npy(stream, cap=MAX_NUMBERS):
    """A real numeric array from an open .npy stream; ValueError naming what is wrong.

    The header's dtype and size are checked before any data are allocated or read, so a
    header declaring 10^12 rows or a deflate bomb costs nothing, and pickles are never loaded.
    """
    version = np.lib.format.read_magic(stream)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f".npy format version {version} holds no plain numbers")
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read_header(stream)
    if dtype.kind not in "biuf":
        raise ValueError(f"it holds {dtype}, not real numbers")
    count = int(np.prod(shape, dtype=object))
    if count > cap:
        raise ValueError(f"its header declares {count:,} numbers, over the {cap:,} nnpd reads from one array")
    array = np.empty(count, dtype)
    view = array.view(np.uint8).data
    filled = 0
    while filled < len(view) and (n := stream.readinto(view[filled:])):
        filled += n
    if filled < len(view):
        raise ValueError(f"it is truncated: {filled:,} of the {len(view):,} bytes its header declares")
    return array.reshape(shape[::-1]).T if fortran else array.reshape(shape)


# ---------------------------------------------------------------- JSON helpers


def canonical_json(value):
    """Return the canonical JSON text of value (sorted keys, compact, no NaN)."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError as exc:
        raise ValueError(f"cannot encode as JSON ({exc}); replace NaN/inf with a finite number or None") from None


def sha256_text(text):
    """Return the SHA-256 hex digest of a text's UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def digest(value):
    """Return the SHA-256 hex digest of canonical_json(value)."""
    return sha256_text(canonical_json(value))


def record_checksum(record):
    """The checksum of a JSON record (a manifest, run.json) over everything but its own checksum field."""
    return digest({key: value for key, value in record.items() if key != "checksum"})


def _pretty_json(value, what):
    """Return indented JSON text for value; NaN/inf raise a ValueError naming `what`."""
    try:
        return json.dumps(value, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except ValueError as exc:
        raise ValueError(f"{what}: cannot write JSON ({exc}); replace NaN/inf with a finite number or None") from None


def _fsync_dir(path):
    """Flush a directory entry table to disk (needed after create/rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path, data):
    """Write bytes to a new file and fsync it."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _makedirs_durable(path):
    """Create path and missing parents, fsyncing each parent that gained an entry."""
    path = Path(path)
    if path.is_dir():
        return
    _makedirs_durable(path.parent)
    try:
        os.mkdir(path)
    except FileExistsError:
        return  # another process created it; it is responsible for the fsync
    _fsync_dir(path.parent)


def write_json_atomic(path, value):
    """Write value as JSON to path via a synced temp file and an atomic replace."""
    write_bytes_atomic(path, _pretty_json(value, str(path)).encode("utf-8"))


# The temporary file of write_bytes_atomic: a killed write leaves it behind (the next launch removes it).
ATOMIC_LEFTOVER = re.compile(r"\..+\.tmp-[0-9]+-[0-9a-f]{8}")


def write_bytes_atomic(path, data):
    """Write bytes to path via a synced, uniquely named temp file and an atomic replace (a full disk: LaunchError)."""
    path = Path(path)
    try:
        _replace_atomically(path, data)
    except OSError as error:
        full = _disk_full(error, path)
        if full is None:
            raise
        raise full from error


def _replace_atomically(path, data):
    """Write bytes to a new temporary file beside path, sync it and rename it over path."""
    _makedirs_durable(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        _write_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


# ---------------------------------------------------------------- names, hashing


def check_name(name, what="name"):
    """Raise ValueError unless name is a safe single path component."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} must be a non-empty string, got {name!r}")
    if "/" in name or "\\" in name or "\0" in name or name.startswith(".") or ".." in name:
        raise ValueError(
            f"{what} {name!r} is unsafe: use letters, digits, '-', '_' (no path separators, '..' or leading dot)"
        )
    return name


def _file_name(name, ext):
    """Map a writer/reader name to its file name, adding ext unless already present."""
    check_name(name, "artifact file name")
    fname = name if name.endswith(ext) else name + ext
    if fname == MANIFEST:
        raise ValueError(f"artifact file name {name!r} is reserved for the manifest; choose another name")
    return fname


def _sha256_file(path):
    """Return (size, sha256 hex) of a file read in large chunks."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _npy_header(path):
    """Return (shape, dtype descr) read from an .npy header."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
    return list(shape), np.lib.format.dtype_to_descr(dtype)


def now_iso():
    """Return the current UTC time as ISO 8601 text."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# ---------------------------------------------------------------- directory helpers

KEY = re.compile(r"[0-9a-f]{64}")
MISPLACED = "a file stands where the artifact's folder belongs"


def _listdir(path):
    """Sorted names in a real directory; empty when it is missing, a file or a link."""
    if not _real_dir(path):
        return []
    return sorted(os.listdir(path))


def _real_dir(path):
    """True for a directory that is not a symbolic link."""
    return os.path.isdir(path) and not os.path.islink(path)


def _is_safe(name):
    """Whether check_name accepts the name."""
    try:
        check_name(name)
    except ValueError:
        return False
    return True


def _tree_size(path):
    """Bytes of the files under path (links not followed)."""
    if not _real_dir(path):
        return os.lstat(path).st_size
    return sum(os.lstat(os.path.join(top, f)).st_size for top, _, files in os.walk(path) for f in files)


def _remove_path(path):
    """Remove a file, link or directory tree without following links."""
    if _real_dir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _stamp_of(entry):
    """The time stamp a damaged entry's name ends with (sorts oldest first)."""
    return entry.rsplit("-", 1)[-1]


# ---------------------------------------------------------------- writer


class Writer:
    """Collects the files of one artifact inside its temporary build directory."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self._files = []
        self._memmaps = []

    def _register(self, fname):
        """Reserve a file name, rejecting duplicates."""
        if fname in self._files:
            raise ValueError(f"artifact file {fname!r} was written twice; give each file its own name")
        self._files.append(fname)
        return self.directory / fname

    def path(self, name):
        """Return the path of a raw file to write yourself (recorded in the manifest)."""
        return self._register(_file_name(name, ""))

    def array(self, name, value):
        """Save a numpy array as <name>.npy (object dtype rejected)."""
        value = np.asarray(value)
        _check_dtype(value.dtype, name)
        path = self._register(_file_name(name, ".npy"))
        with open(path, "xb") as f:
            np.lib.format.write_array(_Stream(f), value, allow_pickle=False)
        return path

    def allocate(self, name, shape, dtype):
        """Create <name>.npy as a writable memmap to fill in chunks."""
        dtype = np.dtype(dtype)
        _check_dtype(dtype, name)
        path = self._register(_file_name(name, ".npy"))
        mm = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=tuple(shape))
        self._memmaps.append(mm)
        return mm

    def json(self, name, value):
        """Save a JSON value as <name>.json (NaN/inf rejected)."""
        fname = _file_name(name, ".json")
        text = _pretty_json(value, f"artifact file {fname!r}")
        path = self._register(fname)
        path.write_text(text, encoding="utf-8")
        return path

    def weights(self, state_dict):
        """Save a tensors-only state dict as weights.pt."""
        import torch  # lazy: reading cached arrays must not pay for importing torch

        bad = [k for k, v in state_dict.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise ValueError(f"weights must map str names to tensors; bad entries: {bad[:5]}")
        path = self._register("weights.pt")
        # Into memory first: torch.save writing short says only "unexpected pos"; Python's write names a full disk.
        buffer = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in state_dict.items()}, buffer)
        with open(path, "xb") as f:
            f.write(buffer.getbuffer())
        return path

    def finish(self):
        """Flush and fsync every file; return the manifest's files table."""
        for mm in self._memmaps:
            mm.flush()
        self._memmaps.clear()
        stray = sorted(set(os.listdir(self.directory)) - set(self._files))
        if stray:
            raise ValueError(f"files {stray} were written without the writer; register them with writer.path(name)")
        table = {}
        for fname in self._files:
            path = self.directory / fname
            if not path.is_file():
                raise ValueError(f"artifact file {fname!r} was registered with writer.path() but never written")
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            size, sha = _sha256_file(path)
            entry = {"size": size, "sha256": sha}
            if fname.endswith(".npy"):
                entry["shape"], entry["dtype"] = _npy_header(path)
            table[fname] = entry
        return table


class _Stream:
    """A file that numpy writes as a plain stream, through Python's write.

    numpy writes real files with tofile, whose short write on a full disk raises an
    OSError without errno ("N requested and M written"); Python's write keeps the errno.
    """

    def __init__(self, file):
        self.write = file.write


def _check_dtype(dtype, name):
    """Reject dtypes that would need pickling to load."""
    if dtype.hasobject:
        raise ValueError(f"array {name!r} has object dtype; store numeric arrays only (convert or use writer.json)")


# ---------------------------------------------------------------- artifact


class Artifact:
    """A committed, read-only artifact directory and its manifest."""

    def __init__(self, path, manifest):
        self.path = Path(path)
        self.manifest = manifest
        self.name = manifest["name"]
        self.key = manifest["key"]
        self.recipe = manifest.get("recipe")
        self.metadata = manifest.get("metadata")
        self.files = sorted(manifest["files"])

    def __repr__(self):
        return f"Artifact({self.name!r}, {self.key[:12]}…, {self.path})"

    def _file(self, fname):
        """Return the path of a manifest-listed file."""
        if fname not in self.manifest["files"]:
            raise MissingArtifact(f"artifact {self.path} has no file {fname!r}; it has {self.files}")
        return self.path / fname

    def array(self, name, mmap=False):
        """Load <name>.npy (memory-mapped read-only when mmap)."""
        return np.load(self._file(_file_name(name, ".npy")), allow_pickle=False, mmap_mode="r" if mmap else None)

    def json(self, name):
        """Load <name>.json."""
        return json.loads(self._file(_file_name(name, ".json")).read_text(encoding="utf-8"))

    def state_dict(self, map_location="cpu"):
        """Load weights.pt as a state dict (weights_only=True)."""
        import torch

        return torch.load(self._file("weights.pt"), map_location=map_location, weights_only=True)

    def problems(self, deep=False):
        """Return a list of damage descriptions (empty when intact)."""
        return _problems(self.path, self.manifest, deep)

    def verify(self, deep=False):
        """Return True when every file exists with its size (and checksum when deep)."""
        return not self.problems(deep)


# Files this process has hashed and found equal to their manifest, with what stat said of them
# then. A launch opens the same artifact many times; one hash is enough unless the file has
# changed since, and any write changes its ctime, whatever a tool does to keep the rest.
_HASHED: dict[Path, tuple[int, int, int, int, str]] = {}  # path -> (inode, size, mtime, ctime, sha256)
# File times tick coarsely (a few milliseconds): a file changed within the same tick as the
# stat that vouched for it would keep its ctime, so only files settled for longer are remembered.
_SETTLED_NS = 2_000_000_000


def _problems(path, files_manifest, deep):
    """List what is wrong with the files of a manifest: missing, resized or (deep) altered.

    deep=False checks sizes only, deep=True hashes every file, deep="once" hashes a file
    unless this process already found it intact and it has not changed since.
    """
    out = []
    for fname, info in files_manifest["files"].items():
        fpath = os.path.join(path, fname)
        try:
            stat = os.stat(fpath)
        except OSError:
            out.append(f"{fname}: missing")
            continue
        if stat.st_size != info["size"]:
            out.append(f"{fname}: size {stat.st_size} != {info['size']}")
            continue
        if not deep:
            continue
        seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, info["sha256"])
        if deep == "once" and _HASHED.get(fpath) == seen:
            continue
        if _sha256_file(fpath)[1] == info["sha256"]:
            if time.time_ns() - stat.st_ctime_ns > _SETTLED_NS:
                _HASHED[fpath] = seen
        else:
            _HASHED.pop(fpath, None)
            out.append(f"{fname}: checksum mismatch")
    return out


def _read_manifest(path):
    """Return (manifest, None) or (None, reason); FileNotFoundError when there is no manifest."""
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        return None, f"manifest unreadable ({exc})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None, "manifest has no files table"
    if manifest.get("schema") != SCHEMA:
        return None, f"unknown manifest schema {manifest.get('schema')!r}"
    if "checksum" in manifest and manifest["checksum"] != record_checksum(manifest):
        return None, "manifest altered (its checksum does not match)"
    return manifest, None


def _open(path, deep="once"):
    """Return (Artifact, None), (None, reason) when damaged, or (None, None) when absent.

    Every file is checked against its checksum (see _problems for `deep`), so what a launch
    or restore reads is what was committed.
    """
    if os.path.islink(path):
        return None, "it is a symbolic link; nnpd never follows links in its store"
    if os.path.exists(path) and not os.path.isdir(path):
        return None, MISPLACED
    try:
        manifest, reason = _read_manifest(path)
    except FileNotFoundError:
        manifest, reason = None, "manifest missing"
    if reason is None:
        problems = _problems(path, manifest, deep)
        if problems:
            reason = "; ".join(problems)
        elif manifest.get("key") != os.path.basename(path):
            reason = f"manifest key {manifest.get('key')!r} does not match its directory"
    if reason is None:
        return Artifact(path, manifest), None
    if not os.path.isdir(path):
        return None, None  # absent (or pruned/moved while we looked), not damaged
    return None, reason


def _damaged_error(path, reason):
    """Build the DamagedArtifact for path with the standard fix."""
    return DamagedArtifact(
        f"artifact {path} is damaged ({reason}); re-run the step that builds it "
        f"(the entry is moved to damaged/ and rebuilt) or delete the directory"
    )


# ---------------------------------------------------------------- store


def untimed(name):
    """The default timing of a Store: none (a context manager that does nothing)."""
    return contextlib.nullcontext()


class Store:
    """Content-addressed artifacts under one output root (nothing is created until a write).

    `phase(name)` returns a context manager timing the store's lookups ("store.verify")
    and commits ("store.commit"); a launch passes its probes, the default times nothing.
    """

    def __init__(self, root, phase=untimed):
        self.root = Path(root)
        self.cache = self.root / "cache"
        self.locks = self.root / "locks"
        self.damaged = self.root / "damaged"
        self.phase = phase

    def __repr__(self):
        return f"Store({str(self.root)!r})"

    def key(self, name, recipe):
        """Return the key (digest of the canonical name + recipe)."""
        check_name(name, "artifact name")
        return digest({"name": name, "recipe": recipe})

    def _dir(self, name, key):
        """Return the committed directory of (name, key)."""
        # Plain string join: this is on the cache-hit path, where pathlib is measurably slow.
        return os.path.join(self.cache, check_name(name, "artifact name"), check_name(key, "artifact key"))

    @contextlib.contextmanager
    def lock(self, lock_name, blocking=True, shared=False):
        """Hold a flock on locks/<lock_name>.lock (exclusive, or shared); yields False if busy and not blocking."""
        check_name(lock_name, "lock name")
        # Checked before anything is created: a linked locks/ would put lock files outside the root.
        _makedirs_durable(own_folder(self.locks))
        fd = os.open(refuse_link(self.locks / f"{lock_name}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def scratch_file(self, name, key):
        """Where an unfinished build of (name, key) keeps its state between processes (training resumes).

        A link on the way is refused: the state is read, replaced and deleted there.
        """
        folder = own_folder(own_folder(self.root / "scratch") / check_name(name, "artifact name"))
        return refuse_link(folder / f"{check_name(key, 'artifact key')}.pt")

    def save_scratch(self, name, key, payload):
        """Keep an unfinished build's state (bytes) under scratch/, headed by its key and checksum."""
        header = canonical_json(
            {"name": name, "key": key, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
        )
        write_bytes_atomic(self.scratch_file(name, key), SCRATCH_MAGIC + header.encode() + b"\n" + payload)

    def load_scratch(self, name, key):
        """The bytes save_scratch kept for (name, key), or None; DamagedArtifact when damaged or another key's."""
        path = self.scratch_file(name, key)
        try:
            kind = os.lstat(path).st_mode
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(kind):  # a FIFO would block the read for ever, a folder fail every save
            moved = self._clear_scratch(path)
            raise DamagedArtifact(f"{path}: not a regular file; {moved}, and the build starts afresh")
        data = path.read_bytes()
        header, _, payload = data[len(SCRATCH_MAGIC) :].partition(b"\n")
        try:
            header = json.loads(header) if data.startswith(SCRATCH_MAGIC) else None
        except ValueError:
            header = None
        if not isinstance(header, dict):
            problem = "it is not a state nnpd saved (damaged, or written by an earlier release)"
        elif (header.get("name"), header.get("key")) != (name, key):
            problem = f"it belongs to {header.get('name')!r} {str(header.get('key'))[:12]}…, not this build"
        elif header.get("size") != len(payload) or header.get("sha256") != hashlib.sha256(payload).hexdigest():
            problem = "its checksum does not match (damaged)"
        else:
            return payload
        raise DamagedArtifact(f"{path}: {problem}")

    def drop_scratch(self, name, key):
        """Forget the saved state of a build once its artifact is committed."""
        with contextlib.suppress(FileNotFoundError):
            self._clear_scratch(self.scratch_file(name, key))

    @staticmethod
    def _clear_scratch(path):
        """Remove what lies at a scratch path: a file or a node is unlinked, a folder moved aside (never deleted)."""
        if stat.S_ISDIR(os.lstat(path).st_mode):
            aside = path.with_name(f"{path.name}.moved-{secrets.token_hex(4)}")
            os.rename(path, aside)
            return f"moved aside to {aside.name}"
        os.unlink(path)
        return "removed"

    def find(self, name, key):
        """Return the committed artifact for key, None if absent; DamagedArtifact if damaged."""
        path = self._dir(name, key)
        with self.phase("store.verify"):
            art, reason = _open(path)
        if reason:
            raise _damaged_error(path, reason)
        return art

    def artifact_at(self, path):
        """Open a committed artifact from its directory path."""
        path = Path(path)
        with self.phase("store.verify"):
            art, reason = _open(path)
        if reason:
            raise _damaged_error(path, reason)
        if art is None:
            raise MissingArtifact(
                f"no artifact at {path}; the output root may have been moved without its cache/ or pruned"
            )
        return art

    def get(self, name, recipe, build=None, metadata=None):
        """Return the artifact for (name, recipe), building it once under its lock if needed."""
        key = self.key(name, recipe)
        path = self._dir(name, key)
        with self.phase("store.verify"):
            art, reason = _open(path)
        if art is not None:
            return art  # cache hit: no lock
        if build is None:
            if reason:
                raise _damaged_error(path, reason)
            raise MissingArtifact(
                f"artifact {name!r} with key {key} is not built yet ({path}); run the step that builds it"
            )
        with self.lock(f"{name}-{key}"):
            art, reason = _open(path)  # another process may have committed meanwhile
            if art is not None:
                return art
            if reason:
                self._move_aside(name, key, path, reason)
            self._remove_stale(name, key)
            return self._build(name, key, recipe, build, metadata)

    def move_aside(self, path, group, reason, then="rebuilding", name=None):
        """Move a damaged file or entry to damaged/<group>/<name>-<time> (never deleted) and warn."""
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        # A linked damaged/ (or group folder) would carry the entry out of the root: refused first.
        folder = own_folder(own_folder(self.damaged) / check_name(group, "group"))
        target = folder / f"{name or os.path.basename(path)}-{stamp}"
        _makedirs_durable(target.parent)
        os.rename(path, target)
        _fsync_dir(os.path.dirname(path))
        _fsync_dir(target.parent)
        warnings.warn(f"{path} was damaged ({reason}); moved to {target}; {then}", stacklevel=3)
        return target

    def _move_aside(self, name, key, path, reason):
        """Move a damaged artifact to damaged/<name>/<key>-<time> and warn."""
        self.move_aside(path, name, reason)

    def _remove_stale(self, name, key):
        """Remove temp dirs of key left by killed builds (caller holds the key's lock)."""
        parent = self.cache / name
        if not parent.is_dir():
            return
        prefix = f"{TMP_PREFIX}{key}-"
        for entry in os.listdir(parent):
            if entry.startswith(prefix):
                shutil.rmtree(parent / entry, ignore_errors=True)

    def _build(self, name, key, recipe, build, metadata):
        """Run build in a temp sibling dir and commit it atomically (caller holds the lock)."""
        parent = own_folder(own_folder(self.cache) / name)
        tmp = parent / f"{TMP_PREFIX}{key}-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            _makedirs_durable(parent)
            os.mkdir(tmp)
            writer = Writer(tmp)
            produced = build(writer)
            if produced is not None and not isinstance(produced, dict):
                raise TypeError(
                    f"build for artifact {name!r} must return a metadata dict or None, got {type(produced).__name__}"
                )
            meta = {**(metadata or {}), **(produced or {})}
            with self.phase("store.commit"):
                final, manifest = self._commit(name, key, recipe, writer, meta, tmp)
        except BaseException as error:
            shutil.rmtree(tmp, ignore_errors=True)
            full = _disk_full(error, parent / key)
            if full is not None:
                raise full from error
            raise
        return Artifact(final, manifest)

    def _commit(self, name, key, recipe, writer, meta, tmp):
        """Checksum and sync the built files, write the manifest last, rename into place; (path, manifest)."""
        manifest = {
            "schema": SCHEMA,
            "name": name,
            "key": key,
            "created": now_iso(),
            "metadata": meta,
            "recipe": recipe,
            "files": writer.finish(),
        }
        manifest["checksum"] = record_checksum(manifest)
        _write_synced(tmp / MANIFEST, _pretty_json(manifest, f"manifest of {name!r}").encode("utf-8"))
        _fsync_dir(tmp)
        final = tmp.parent / key
        os.rename(tmp, final)
        _fsync_dir(tmp.parent)
        return final, manifest

    def entries(self):
        """Yield (name, key, path) for every committed entry: temp dirs, links and foreign names excluded."""
        for name in _listdir(self.cache):
            ndir = self.cache / name
            if not _is_safe(name) or not _real_dir(ndir):
                continue
            for key in _listdir(ndir):
                if KEY.fullmatch(key) and _real_dir(ndir / key):
                    yield name, key, ndir / key

    def misplaced(self):
        """Yield (name, key, path) for every file (not a link) that stands where an entry's folder belongs."""
        for name in _listdir(self.cache):
            ndir = self.cache / name
            if _is_safe(name) and _real_dir(ndir):
                for key in _listdir(ndir):
                    if KEY.fullmatch(key) and not os.path.isdir(ndir / key) and not os.path.islink(ndir / key):
                        yield name, key, ndir / key

    def move_misplaced(self, then):
        """Move aside every file standing where an entry's folder belongs (`then` says what follows); their paths."""
        moved = []
        for name, key, path in list(self.misplaced()):
            with self.lock(f"{name}-{key}"):
                self.move_aside(path, name, MISPLACED, then=then)
            moved.append(str(path))
        return moved

    def verify(self, repair=False):
        """Deep-check every committed artifact: (checked, damaged paths), moving damaged ones aside when repairing.

        A file standing where an entry's folder belongs is damage too.
        """
        checked, damaged = 0, []
        for name, key, path in list(self.entries()) + list(self.misplaced()):
            checked += 1
            with self.phase("store.verify"):
                _, reason = _open(path, deep=True)
            if reason:
                damaged.append(str(path))
                if repair:
                    with self.lock(f"{name}-{key}"):
                        self.move_aside(path, name, reason, then="the next launch that needs it rebuilds it")
        return checked, damaged

    def damaged_size(self):
        """(entries, bytes) kept under damaged/."""
        entries, size = 0, 0
        for group in _listdir(self.damaged):
            for entry in _listdir(self.damaged / group):
                entries += 1
                size += _tree_size(self.damaged / group / entry)
        return entries, size

    def tidy(self, keep_locks=(), keep_damaged=3):
        """Remove leftovers of killed processes: temp builds, prune renames, unused lock files, old damaged entries.

        A file standing where an entry's folder belongs is moved aside, so the entry is rebuilt.

        Call it only while no other process uses this output root (a launch holds the root's lease);
        a lock file may be removed only when nobody can be waiting on it.
        """
        for name in _listdir(self.cache):
            if _real_dir(self.cache / name):
                for entry in _listdir(self.cache / name):
                    if entry.startswith(TMP_PREFIX):
                        shutil.rmtree(self.cache / name / entry, ignore_errors=True)
        self.move_misplaced(then="the launch that needs it rebuilds it")
        for entry in _listdir(self.locks):
            if entry.endswith(".lock") and entry[: -len(".lock")] not in keep_locks:
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    os.unlink(self.locks / entry)
        for group in _listdir(self.damaged):
            for entry in sorted(_listdir(self.damaged / group), key=_stamp_of)[: -keep_damaged or None]:
                _remove_path(self.damaged / group / entry)

    def prune(self, keep_keys):
        """Delete committed artifacts whose key is not kept, skipping ones being built; return deleted paths."""
        keep = set(keep_keys)
        deleted = []
        for name, key, path in list(self.entries()):
            if key in keep:
                continue
            with self.lock(f"{name}-{key}", blocking=False) as held:
                if not held:
                    continue  # a builder holds it; leave it alone
                # Rename first so readers never see a half-deleted entry; a crash leaves a
                # .tmp- dir that the key's next builder removes.
                doomed = path.parent / f"{TMP_PREFIX}{key}-prune-{os.getpid()}-{secrets.token_hex(4)}"
                try:
                    os.rename(path, doomed)
                except FileNotFoundError:
                    continue
                _fsync_dir(path.parent)
                shutil.rmtree(doomed, ignore_errors=True)
                deleted.append(str(path))
        return deleted


class Restored:
    """A finished run reopened: settings, member, history, model and artifacts."""

    def __init__(
        self,
        run_dir: Path,
        run: dict[str, Any],
        model: torch.nn.Module,
        history: Any,
        artifacts: dict[str, Artifact],
        missing: Iterable[str] = (),
        experiment: Any = None,
    ) -> None:
        self.run_dir = run_dir
        self.experiment = experiment  # the study's experiment, constructed with the run's settings
        self.run = run
        self.settings = run["settings"]
        self.member = run["member"]
        self.model = model
        self.history = history
        self.artifacts = artifacts
        self.missing = list(missing)  # artifacts the run refers to that the store lacks or found damaged

    def posterior(self, observations: Any, truth: Any = None, device: str | torch.device | None = None) -> Any:
        """The posterior of the run's model for an observation (d,) or ensemble (m, d), as its analysis computed.

        For studies whose experiment gives one (those on the study kit: see posterior.py). It uses
        the run's analysis settings when it was analysed, and the study's defaults when it was only trained.
        """
        if not callable(getattr(self.experiment, "posterior", None)):
            raise RestoreError(f"{type(self.experiment).__name__} gives no posterior (studies on the study kit do)")
        device = device or next(self.model.parameters()).device
        posterior = self.experiment.posterior(
            self.member, self.model, self.analysis_settings(), observations, truth=truth, device=device
        )
        if callable(getattr(posterior, "report_flatness", None)):  # a kit posterior: warn as `infer` prints
            posterior.report_flatness(self.history, stacklevel=2)
        return posterior

    def analysis_settings(self) -> dict[str, Any]:
        """The analysis settings of the run's analysis, or {} (every default) for a run never analysed."""
        analysis = self.json("analysis")
        if analysis is None:
            return {}
        if not isinstance(analysis.get("settings"), dict) or analysis.get("checksum") != record_checksum(analysis):
            raise DamagedArtifact(
                f"{self.run_dir}: analysis.json is damaged (its settings are unreadable); run "
                "`python nnpd.py analyze` again, or delete analysis.json to use the default settings"
            )
        return analysis["settings"]

    def array(self, artifact: str, name: str, mmap: bool = False) -> np.ndarray:
        """An array of one of the run's artifacts."""
        return self.artifacts[artifact].array(name, mmap=mmap)

    def json(self, name: str) -> Any:
        """A JSON file of the run folder (e.g. "metrics", "status"), or None."""
        path = self.run_dir / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    @property
    def metrics(self) -> dict[str, Any] | None:
        """The run's metrics, or None unless its analysis is complete and intact."""
        analysis, metrics = self.json("analysis") or {}, self.json("metrics")
        complete = (
            analysis.get("state") == "complete"
            and analysis.get("checksum") == record_checksum(analysis)
            and metrics is not None
            and digest(metrics) == analysis.get("metrics")
            and not self.missing
        )
        return metrics if complete else None


# What restore needs of an experiment class: it instantiates only classes that have all of these.
EXPERIMENT_METHODS = (
    "members",
    "problem",
    "prior",
    "data_recipe",
    "sample_data",
    "model_recipe",
    "build_model",
    "train",
    "validate",
    "workload",
    "describe",
    "input_size",
)
ROOT_MARKER = ".nnpd-root"


def _module_source(module_name):
    """The source file that importing `module_name` would run, found without running anything, or None."""
    from importlib.machinery import PathFinder

    spec, path = None, list(sys.path)
    for depth in range(len(module_name.split("."))):
        spec = PathFinder.find_spec(".".join(module_name.split(".")[: depth + 1]), path)
        if spec is None:
            return None
        path = list(spec.submodule_search_locations or ())
    return spec.origin if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def check_defines_class(spec):
    """Refuse a "module:Class" whose module does not define that class at its top level, judged from its source.

    What a run folder names is checked this way before it is imported, so a name such as
    "setup:setup" never runs the module it names.
    """
    import ast

    module_name, _, class_name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not module_name or module_name in sys.modules:
        return  # a malformed name is import_class's to refuse; an imported module runs nothing again
    origin = _module_source(module_name)
    if origin is None:
        raise ImportError(f"no Python source for module {module_name!r} on the import path")
    tree = ast.parse(Path(origin).read_bytes(), origin)
    if not any(isinstance(node, ast.ClassDef) and node.name == class_name for node in tree.body):
        raise ValueError(f"{origin} does not define a class {class_name!r} (checked before importing it)")


def import_class(spec, methods=()):
    """The class named by "module:Class", refused unless it is a class with every one of `methods`.

    Standard-library modules are never imported this way: a name read from a file must not
    reach os, subprocess or a module that acts when imported.
    """
    module_name, _, class_name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not module_name or not class_name.isidentifier():
        raise ValueError(f"{spec!r} is not of the form 'module:Class'")
    if module_name.split(".")[0] in sys.stdlib_module_names:
        raise ValueError(f"{spec!r} names a standard-library module, not an nnpd experiment or analysis")
    module = importlib.import_module(module_name)
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"module {module_name!r} has no class {class_name!r}")
    missing = [name for name in methods if not callable(getattr(cls, name, None))]
    if missing:
        raise ValueError(f"{spec!r} is not an nnpd experiment or analysis class: it lacks {', '.join(missing)}")
    return cls


def find_root(run_dir):
    """The output root above a run folder: the nearest parent holding the root marker."""
    for parent in run_dir.parents:
        if (parent / ROOT_MARKER).is_file():
            return parent
    if len(run_dir.parents) > 2 and (run_dir.parents[2] / "cache").is_dir():
        return run_dir.parents[2]  # an output root written before roots carried the marker
    raise RestoreError(
        f"{run_dir}: no output root above it (no {ROOT_MARKER} marker and no cache/); "
        f"a run folder cannot be moved without its output root"
    )


def _read_run_record(run_dir):
    """run.json of a run folder, refused when its checksum does not match."""
    run_file = run_dir / "run.json"
    if not run_file.is_file():
        raise RestoreError(f"{run_dir}: not a run folder (no run.json)")
    try:
        run = json.loads(run_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DamagedArtifact(f"{run_file} is unreadable ({error}); re-run the training that wrote it") from None
    if not isinstance(run, dict) or run.get("checksum") != record_checksum(run):
        raise DamagedArtifact(f"{run_file} was altered (its checksum does not match); restore refuses it")
    return run


def _read_references(run_dir):
    """artifacts.json: artifact name -> path relative to the output root, the model's among them."""
    path = run_dir / "artifacts.json"
    if not path.is_file():  # missing, or not a regular file (a FIFO would block the read)
        raise RestoreError(
            f"{run_dir}: no artifacts.json (the record of its trained model); run train to make it again"
        )
    try:
        references = json.loads(path.read_text())
    except ValueError:
        references = None
    if not (
        isinstance(references, dict)
        and "model" in references
        and all(isinstance(key, str) and isinstance(value, str) for key, value in references.items())
    ):
        raise DamagedArtifact(
            f"{path}: damaged (not a record of the run's artifacts with its model); run train to make it again"
        )
    return references


def restore(
    run_dir: str | os.PathLike[str], device: str | torch.device = "cpu", experiment: type | None = None
) -> Restored:
    """Reopen a finished run with its trained model on `device` (CPU by default) in eval mode.

    Trust: unless `experiment` is given, restore imports the module run.json names and runs
    that class's code, so restore only run folders you would trust as code. The class must be
    importable, defined at the top of its module's source, outside the standard library, and
    have every method of EXPERIMENT_METHODS; nothing else a run folder names is called. A bad
    run folder or record raises RestoreError or DamagedArtifact (both NnpdError). Never joins
    a process group, and leaves sys.path as it found it. References are relative to the
    output root, so a moved output root still restores.
    """
    import torch

    run_dir = Path(run_dir).resolve()
    run = _read_run_record(run_dir)
    root = find_root(run_dir)
    references = _read_references(run_dir)
    artifacts, missing, store = {}, [], Store(root)
    for name, relative in references.items():
        path = (root / relative).resolve()
        try:
            if root.resolve() not in path.parents:
                raise MissingArtifact(f"{relative} lies outside the output root")
            artifacts[name] = store.artifact_at(path)  # every file checked against its checksum
        except (MissingArtifact, DamagedArtifact) as error:
            if name in ("model", "training-data"):
                raise RestoreError(
                    f"{run_dir}: artifact {relative} is missing from the output root {root} "
                    f"or damaged ({error}); re-run the training to rebuild it"
                ) from None
            missing.append(name)
    if missing:
        warnings.warn(
            f"{run_dir}: its analysis products {', '.join(missing)} are missing or damaged, so its "
            "metrics are not available; the next `run` or `analyze` rebuilds them",
            stacklevel=2,
        )
    experiment = _run_experiment(run_dir, run) if experiment is None else experiment
    instance = experiment(run["settings"])
    model = instance.build_model(run["member"])
    model.load_state_dict(artifacts["model"].state_dict())
    model = model.to(torch.device(device)).eval()
    return Restored(run_dir, run, model, artifacts["model"].json("history"), artifacts, missing, instance)


def _run_experiment(run_dir, run):
    """The experiment class run.json names, imported from the study's folder when the launch found it there."""
    spec, study_path = run["settings"]["experiment"], run.get("study_path")
    folder = study_path if isinstance(study_path, str) and Path(study_path).is_dir() else None
    try:
        with importable_from(folder):
            _forget_if_elsewhere(spec)
            check_defines_class(spec)
            return import_class(spec, EXPERIMENT_METHODS)
    except (ImportError, ValueError, SyntaxError, TypeError, AttributeError) as error:
        raise RestoreError(
            f"{run_dir}: cannot restore its experiment: {error}; pass restore(..., experiment=Class)"
        ) from None


@contextlib.contextmanager
def importable_from(folder):
    """Within the block, modules in `folder` (None: none) import as if it ended sys.path; sys.path is put back after."""
    saved = list(sys.path)
    if folder is not None and folder not in sys.path:
        sys.path.append(folder)  # last, as the launch found the study: beside its settings files
    try:
        yield
    finally:
        sys.path[:] = saved


def _forget_if_elsewhere(spec):
    """Drop an imported module of spec's name that is not the file the import path now finds.

    Two studies in different folders may use one module name; without this, the second
    restore would be served the first study's module. What was restored earlier keeps its class.
    """
    module_name = spec.partition(":")[0] if isinstance(spec, str) else ""
    module = sys.modules.get(module_name)
    if module is None or module_name.split(".")[0] in sys.stdlib_module_names:
        return
    found, loaded = _module_source(module_name), getattr(module, "__file__", None)
    if found and loaded and Path(found).resolve() != Path(loaded).resolve():
        del sys.modules[module_name]
