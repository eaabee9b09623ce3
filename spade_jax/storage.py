"""One path type for every file a run writes or reads, local or remote: ``etils.epath``.

A run directory, its checkpoints, metrics, TensorBoard events, report, tokenizer, a corpus,
a program pool or a Hugging Face checkpoint may each be a local path or a URL such as
``gs://bucket/run``. ``epath.Path`` (the path layer Orbax uses) reads and writes both;
wrapping a URL in ``pathlib.Path`` instead would quietly create a local ``./gs:/...`` tree.

Two things remote object stores do not offer are handled here:

- Libraries that need a real local file (sentencepiece, ``tokenizers``, tensorboardX's
  event writer, ``logging.FileHandler``) work on a local copy: :func:`local_copy` downloads
  what they read, :class:`MirroredDir` keeps a local directory whose files are uploaded to
  the remote one on :meth:`MirroredDir.sync` (whole files; an object store has no append).
- Appending: a file that a resumed run continues (``metrics.jsonl``, ``train.log``) is
  downloaded into the mirror first, appended to locally and uploaded whole again.

For a local path both are pass-through: the files are written in place, nothing is copied.
gs:// goes through ``gcsfs`` (``etils[epath-gcs]``); set ``STORAGE_EMULATOR_HOST`` to point
it at an emulator (the tests do).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterable

from etils import epath

PathLike = str | os.PathLike

# Files of a model directory that a tokenizer never needs (and that can be many GB).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf")


def as_path(path: PathLike) -> epath.Path:
    """``path`` as an ``epath.Path``: a local path or a URL (``gs://...``) kept as one."""
    return epath.Path(path)


def is_remote(path: PathLike) -> bool:
    """True for a URL such as ``gs://bucket/x`` (anything with a scheme)."""
    return "://" in os.fspath(path)


def absolute(path: PathLike) -> epath.Path:
    """A local path made absolute; a URL as it is (it is absolute already)."""
    path = as_path(path)
    return path if is_remote(path) else path.absolute()


def write_bytes_atomic(path: PathLike, data: bytes) -> None:
    """Writes ``data`` so that no reader ever sees a partial file: locally through a
    temporary file and a rename; on an object store directly (an object appears only once
    its upload is complete, and a rename there would be a second full copy)."""
    path = as_path(path)
    if is_remote(path):
        path.write_bytes(data)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def local_copy(path: PathLike, *, want: Callable[[str], bool] | None = None) -> pathlib.Path:
    """A local ``pathlib.Path`` with ``path``'s content, for libraries that open files
    themselves. A local path is returned as it is. A remote file is downloaded into a new
    temporary directory; a remote directory's top-level files (those ``want(name)``
    accepts, all by default) are. Raises FileNotFoundError naming ``path``."""
    if not is_remote(path):
        return pathlib.Path(path)
    source = as_path(path)
    if not source.exists():
        raise FileNotFoundError(f"{path} does not exist")
    target = pathlib.Path(tempfile.mkdtemp(prefix="spade_remote_"))
    if not source.is_dir():
        (target / source.name).write_bytes(source.read_bytes())
        return target / source.name
    for child in source.iterdir():
        if (want is None or want(child.name)) and not child.is_dir():
            (target / child.name).write_bytes(child.read_bytes())
    return target


def tokenizer_copy(path: PathLike) -> pathlib.Path:
    """:func:`local_copy` of a tokenizer file or directory without model weights: a
    remote file comes with its directory's other small files (the chat template)."""
    if not is_remote(path):
        return pathlib.Path(path)
    source = as_path(path)
    if not source.exists():
        raise FileNotFoundError(f"tokenizer path {path} does not exist")
    if source.is_dir():
        return local_copy(source, want=lambda name: not name.endswith(_WEIGHT_SUFFIXES))
    directory = local_copy(source.parent, want=lambda name: name == source.name or (
        not name.endswith(_WEIGHT_SUFFIXES) and name.endswith((".json", ".jinja"))))
    return directory / source.name


class MirroredDir:
    """A local working directory for a (possibly remote) directory.

    ``local`` is the directory itself when ``target`` is local; otherwise a fresh temporary
    directory whose files :meth:`sync` uploads to ``target`` (each file whose size or
    modification time changed since the last sync, whole). ``resume`` names files to
    download first, so that appending continues the remote copy (a resumed run).
    """

    def __init__(self, target: PathLike, resume: Iterable[str] = ()) -> None:
        self.target = as_path(target)
        self.remote = is_remote(self.target)
        self._synced: dict[str, tuple[int, int]] = {}
        if not self.remote:
            self.local = pathlib.Path(self.target)
            self.local.mkdir(parents=True, exist_ok=True)
            return
        self.local = pathlib.Path(tempfile.mkdtemp(prefix="spade_mirror_"))
        for name in resume:
            remote_file = self.target / name
            if remote_file.exists():
                local_file = self.local / name
                local_file.parent.mkdir(parents=True, exist_ok=True)
                local_file.write_bytes(remote_file.read_bytes())
                self._synced[name] = _signature(local_file)

    def sync(self) -> None:
        """Uploads every local file that changed since the last sync (no-op when local)."""
        if not self.remote:
            return
        for local_file in sorted(p for p in self.local.rglob("*") if p.is_file()):
            name = local_file.relative_to(self.local).as_posix()
            signature = _signature(local_file)
            if self._synced.get(name) == signature:
                continue
            (self.target / name).parent.mkdir(parents=True, exist_ok=True)
            (self.target / name).write_bytes(local_file.read_bytes())
            self._synced[name] = signature

    def close(self) -> None:
        """Uploads what changed and removes the temporary directory."""
        self.sync()
        if self.remote:
            shutil.rmtree(self.local, ignore_errors=True)

    def __enter__(self) -> MirroredDir:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Uploads on an error too: what was written (a resumable progress file) is kept.
        self.close()


def _signature(path: pathlib.Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns
