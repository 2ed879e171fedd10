"""Files a script writes under the estimate go to a scratch folder, never to the user's disk.

While an unmodified script runs under :func:`torchmem.estimate_script`, the file-system calls
that change files are redirected (:class:`ScratchFiles`):

- ``open`` / ``io.open`` (so ``Path.write_text``, ``json.dump`` into an opened file, ``numpy.save``,
  ``logging.FileHandler``, ``shutil.copy``) and ``os.open`` for writing, ``os.makedirs`` /
  ``os.mkdir`` (``Path.mkdir``): the file or folder is made under a scratch folder that mirrors
  the real path, and reads of it later in the same run see that copy (a script that writes its
  config and reads it back works); appending starts from a copy of the real file;
- ``os.remove`` / ``os.unlink`` / ``os.rmdir`` / ``shutil.rmtree``, ``os.rename`` /
  ``os.replace`` and ``os.chmod`` / ``os.utime`` of the user's files are skipped (a trainer
  that rotates its old checkpoints does not delete real ones); on scratch copies they act on
  the copies (an atomic save: a temporary file moved onto the target, then ``chmod``);
- ``os.stat`` / ``os.lstat`` (so ``os.path.exists``, ``isfile``, ``getsize``), ``os.statvfs``,
  ``os.listdir`` and ``os.scandir`` see the scratch copy of a file or folder the run made (a
  cache folder made by the run, then locked and listed).

One folder is written for real, and the report says so: the Hugging Face ``datasets`` cache
(:func:`_datasets_cache`). pyarrow writes and memory-maps its Arrow files in C++, where no
scratch copy can be seen, and what it holds is the tokenized real data (computed on the host,
not from fake values), the same cache a real run writes.

Each redirected or skipped call is recorded once per path (``record(where, what, path)``), and
the scratch folder is deleted when the run ends. Under the system's temporary folder only what
the run makes through ``tempfile`` (and ``multiprocessing``, which uses it) is real, with what
is written inside it: those files are scratch by design. A path the script names there itself
(transformers' ``--output_dir /tmp/test-clm``, nanoGPT's ``out_dir`` in a folder under
``/tmp``) goes to the scratch folder like any other. Left alone: ``/dev`` and ``/proc``, calls
made by torchmem itself and by torch's private modules (compiler caches), and functions a
library bound under another name before the run (``from os import makedirs``).

Example:
    >>> import os, tempfile
    >>> home = os.path.join(os.path.expanduser("~"), "torchmem_sandbox_example")
    >>> seen = []
    >>> with ScratchFiles(lambda where, what, path: seen.append((what, path))):
    ...     os.makedirs(home)
    ...     with open(os.path.join(home, "log.txt"), "w") as f:
    ...         _ = f.write("step 1")
    ...     print(open(os.path.join(home, "log.txt")).read())
    step 1
    >>> os.path.exists(home), [w for w, _ in seen]
    (False, ['os.makedirs', "open(mode='w')"])
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from torchmem.fit.fakegpu._checkpoints import PATH_RESOLVERS

__all__ = ["ScratchFiles", "owner"]

_TORCHMEM_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # torchmem/
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__))
_WRITE_MODES = frozenset("wax+")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def owner(frame: Any, through_torch_internals: bool) -> str:
    """Whose code ``frame`` is, looking through the standard library and generated ``<string>``
    code (and torch's private modules with ``through_torch_internals``): ``"torchmem"``,
    ``"torch"`` (a private torch module) or ``"other"`` (the script, a library, torch's public
    modules, or no frame).

    Example:
        >>> import sys
        >>> owner(sys._getframe(), True), owner(None, False)
        ('other', 'other')
    """
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_TORCHMEM_DIR + os.sep):
            return "torchmem"
        if path.startswith("<") or (path.startswith(_STDLIB_DIR + os.sep)
                                    and "-packages" + os.sep not in path):
            frame = frame.f_back
            continue
        if path.startswith(_TORCH_DIR + os.sep):
            rel = path[len(_TORCH_DIR) + 1:]
            if any(part.startswith("_") for part in rel.split(os.sep)):
                if not through_torch_internals:
                    return "torch"
                frame = frame.f_back  # torch's internals: dispatch, fake tensors, decompositions
                continue
        return "other"
    return "other"


def _ours(frame: Any) -> bool:
    """Whether the file call comes from torchmem or torch's private modules (passed through)."""
    return owner(frame, False) != "other"


def _where(frame: Any) -> str:
    """``file:line`` of the first caller outside the standard library and torchmem."""
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_TORCHMEM_DIR + os.sep) or path.startswith("<")
                or (path.startswith(_STDLIB_DIR + os.sep) and "-packages" + os.sep not in path)):
            return f"{os.path.abspath(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _datasets_cache() -> str:
    """The Hugging Face ``datasets`` cache folder, as ``datasets.config`` reads it from the
    environment (``HF_DATASETS_CACHE``, else ``HF_HOME/datasets``, else
    ``XDG_CACHE_HOME/huggingface/datasets``, else ``~/.cache/huggingface/datasets``).

    Example:
        >>> _datasets_cache().endswith("datasets")
        True
    """
    config = sys.modules.get("datasets.config")
    folder = getattr(config, "HF_DATASETS_CACHE", None)
    if folder is None:
        env = os.environ
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
            "huggingface")
        folder = env.get("HF_DATASETS_CACHE") or os.path.join(home, "datasets")
    return os.path.realpath(os.path.expanduser(os.fspath(folder)))


class ScratchFiles:
    """While active, writes to files go to a scratch folder and deletions or renames of the
    user's files are skipped; ``record(where, what, path)`` is called once per path and call.

    Example:
        >>> import os
        >>> target = os.path.join(os.path.expanduser("~"), "torchmem_scratch_doc.txt")
        >>> notes = []
        >>> with ScratchFiles(lambda *a: notes.append(a[1:])):
        ...     _ = open(target, "w").write("x")
        >>> os.path.exists(target), notes == [("open(mode='w')", target)]
        (False, True)
    """

    def __init__(self, record: Callable[[str, str, str], None]) -> None:
        self.record = record
        self.root = ""
        self.in_scratch: set[str] = set()  # real paths with a scratch copy, and their folders
        self.noted: set[tuple[str, str]] = set()
        self.saved: list[tuple[Any, str, Any]] = []
        self.keep = ("/dev", "/proc")
        self.temp = os.path.realpath(tempfile.gettempdir())
        self.made: list[str] = []  # made by tempfile during the run: real, as is what is inside
        self.noted_caches: set[str] = set()
        # the functions the stand-ins replace (read before they do)
        self._real_open, self._real_makedirs = builtins.open, os.makedirs
        self._real_lstat = os.lstat

    # -- paths ----------------------------------------------------------------------------------

    def _mirror(self, path: Any) -> str | None:
        """The scratch path of ``path``, or None where the call goes through as it is."""
        try:
            p = os.path.abspath(os.fsdecode(os.fspath(path)))
        except TypeError:
            return None
        real = os.path.realpath(p)
        if p == os.devnull or any(real == k or real.startswith(k + os.sep)
                                  for k in (*self.keep, self.root, *self.made) if k):
            return None
        cache = _datasets_cache()
        if real == cache or real.startswith(cache + os.sep):
            if cache not in self.noted_caches:
                self.noted_caches.add(cache)
                self.record(_where(sys._getframe(2)), "written for real: the Hugging Face "
                            "datasets cache (pyarrow writes and maps its Arrow files outside "
                            "Python, from the real data; a real run writes the same)", cache)
            return None
        return os.path.join(self.root, p.lstrip(os.sep))

    def _temp_made(self, frame: Any, path: Any) -> bool:
        """Whether ``path`` is made by ``tempfile`` (the caller's frame is its code) under the
        temporary folder: then it is real, and so is what the run writes inside it."""
        if frame is None or frame.f_code.co_filename != tempfile.__file__:
            return False
        try:
            real = os.path.realpath(os.path.abspath(os.fsdecode(os.fspath(path))))
        except TypeError:
            return False
        if real == self.temp:  # TemporaryFile: an unnamed file (O_TMPFILE) in the folder
            return True
        if real.startswith(self.temp + os.sep):
            self.made.append(real)
            return True
        return False

    def _made_in_scratch(self, m: str) -> None:
        """Remember that scratch path ``m`` (a file or folder) and its folders exist, under the
        real paths they stand for (what ``os.stat`` and ``os.listdir`` look up)."""
        while m.startswith(self.root + os.sep):
            real = os.sep + m[len(self.root) + 1:]
            if real in self.in_scratch:
                return
            self.in_scratch.add(real)
            m = os.path.dirname(m)

    def existing_copy(self, path: Any) -> str | None:
        """The scratch copy of ``path`` when the run made one (cheap: no ``realpath``, one set
        lookup for the paths the run never wrote, so ``os.stat`` can use it), else None."""
        if not self.in_scratch or isinstance(path, int):
            return None
        try:
            p = os.path.abspath(os.fsdecode(os.fspath(path)))
        except TypeError:
            return None
        if p not in self.in_scratch:
            return None
        m = os.path.join(self.root, p.lstrip(os.sep))
        try:
            self._real_lstat(m)
        except OSError:
            return None
        return m

    def write_for_run(self, path: Any, data: bytes, size: int | None = None) -> bool:
        """Put ``data`` where the run will find it under ``path`` (the scratch copy; the real
        file inside a folder ``tempfile`` made for the run), recording nothing: what stands in
        for a write the caller has listed already. With ``size``, the file is made that long,
        a hole after ``data`` (no disk used). False where no file is made (``/dev``, the
        datasets cache)."""
        m = self._mirror(path)
        if m is None:
            try:
                real = os.path.realpath(os.path.abspath(os.fsdecode(os.fspath(path))))
            except TypeError:
                return False
            if not any(real.startswith(k + os.sep) for k in self.made):
                return False
            m = real
        else:
            self._made_in_scratch(m)
        self._real_makedirs(os.path.dirname(m), exist_ok=True)
        with self._real_open(m, "wb") as f:
            f.write(data)
            if size is not None and size > len(data):
                f.truncate(size)
        return True

    def _note(self, what: str, path: Any) -> None:
        shown = os.path.abspath(os.fsdecode(os.fspath(path)))
        if (what, shown) not in self.noted:
            self.noted.add((what, shown))
            self.record(_where(sys._getframe(2)), what, shown)

    # -- the stand-ins --------------------------------------------------------------------------

    def _install(self) -> None:
        real_open, real_os_open = builtins.open, os.open
        real_makedirs, real_mkdir = os.makedirs, os.mkdir
        real_remove, real_unlink, real_rmdir = os.remove, os.unlink, os.rmdir
        real_rename, real_replace, real_rmtree = os.rename, os.replace, shutil.rmtree
        exists = os.path.lexists

        def parent(m: str) -> None:
            self._made_in_scratch(m)
            real_makedirs(os.path.dirname(m), exist_ok=True)

        def scratch_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("opener") is not None and sys._getframe(1).f_code.co_filename \
                    == tempfile.__file__:
                # NamedTemporaryFile(dir=D) opens D through an opener that makes the file (an
                # os.open of its own name, seen there): D itself is not made by tempfile
                return real_open(file, mode, *args, **kwargs)
            if isinstance(file, int) or self._temp_made(sys._getframe(1), file) \
                    or _ours(sys._getframe(1)):
                return real_open(file, mode, *args, **kwargs)
            m = self._mirror(file)
            if m is None:
                return real_open(file, mode, *args, **kwargs)
            if _WRITE_MODES & set(mode):
                parent(m)
                if ("a" in mode or "+" in mode) and not exists(m) and os.path.isfile(file):
                    shutil.copyfile(file, m)
                self._note(f"open(mode={mode!r})", file)
                return real_open(m, mode, *args, **kwargs)
            return real_open(m if exists(m) else file, mode, *args, **kwargs)

        def scratch_os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            m = None if kwargs.get("dir_fd") is not None \
                or self._temp_made(sys._getframe(1), path) or _ours(sys._getframe(1)) \
                else self._mirror(path)
            if m is None:
                return real_os_open(path, flags, *args, **kwargs)
            if flags & _WRITE_FLAGS:
                parent(m)
                if flags & (os.O_APPEND | os.O_RDWR) and not exists(m) and os.path.isfile(path):
                    shutil.copyfile(path, m)
                self._note("os.open(for writing)", path)
                return real_os_open(m, flags, *args, **kwargs)
            return real_os_open(m if exists(m) else path, flags, *args, **kwargs)

        def scratch_makedirs(name: Any, mode: int = 0o777, exist_ok: bool = False) -> None:
            m = None if _ours(sys._getframe(1)) else self._mirror(name)
            if m is None:
                return real_makedirs(name, mode, exist_ok)
            if os.path.isdir(name) or os.path.isdir(m):
                if exist_ok:
                    return None
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(name))
            self._note("os.makedirs", name)
            self._made_in_scratch(m)
            return real_makedirs(m, mode, True)

        def scratch_mkdir(path: Any, mode: int = 0o777, *, dir_fd: Any = None) -> None:
            m = None if dir_fd is not None or self._temp_made(sys._getframe(1), path) \
                or _ours(sys._getframe(1)) else self._mirror(path)
            if m is None:
                return real_mkdir(path, mode, dir_fd=dir_fd)
            if exists(path) or exists(m):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(path))
            parent_dir = os.path.dirname(os.path.abspath(os.fsdecode(os.fspath(path))))
            if not os.path.isdir(parent_dir) and not os.path.isdir(os.path.dirname(m)):
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fsdecode(path))
            self._note("os.mkdir", path)
            parent(m)
            return real_mkdir(m, mode)

        def deleting(real: Callable[..., Any], label: str) -> Callable[..., Any]:
            # also chmod and utime: on the scratch copy, else not done to the user's file
            def scratch_delete(path: Any, *args: Any, **kwargs: Any) -> Any:
                m = None if kwargs.get("dir_fd") is not None or _ours(sys._getframe(1)) \
                    else self._mirror(path)
                if m is None:
                    return real(path, *args, **kwargs)
                if exists(m):
                    return real(m, *args, **kwargs)
                if not exists(path):
                    return real(path, *args, **kwargs)  # raises as it would have
                self._note(f"{label} (not done)", path)
                return None
            return scratch_delete

        def renaming(real: Callable[..., Any], label: str) -> Callable[..., Any]:
            def scratch_rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
                ours = bool(args or kwargs) or _ours(sys._getframe(1))
                ms = None if ours else self._mirror(src)
                if ms is None:
                    md = None if ours else self._mirror(dst)
                    if md is not None and exists(src):
                        # a real file (a temporary one: an atomic save) moved onto a path of the
                        # user's: it lands in the scratch folder, not on their disk
                        parent(md)
                        self._note(f"{label} from {os.path.abspath(os.fsdecode(os.fspath(src)))}",
                                   dst)
                        return real(src, md)
                    return real(src, dst, *args, **kwargs)
                if exists(ms):  # a file the run wrote: moved within the scratch folder
                    md = self._mirror(dst)
                    if md is None:
                        return real(ms, dst)  # to a place left alone (the temporary folder)
                    parent(md)
                    return real(ms, md)
                if not exists(src):
                    return real(src, dst)  # raises as it would have
                self._note(f"{label} to {os.path.abspath(os.fsdecode(os.fspath(dst)))} "
                           "(not done)", src)
                return None
            return scratch_rename

        real_stat, real_lstat = os.stat, os.lstat
        scratch_copy = self.existing_copy

        def looking(real: Callable[..., Any]) -> Callable[..., Any]:
            def scratch_stat(path: Any, *args: Any, **kwargs: Any) -> Any:
                m = None if args or kwargs.get("dir_fd") is not None else scratch_copy(path)
                return real(m if m is not None else path, *args, **kwargs)
            return scratch_stat

        real_listdir, real_scandir = os.listdir, os.scandir

        def really_there(path: Any) -> bool:  # not the scratch copy: the user's own
            try:
                real_lstat(path)
            except (OSError, ValueError):
                return False
            return True

        def scratch_listdir(path: Any = ".") -> list[Any]:
            m = scratch_copy(path)
            if m is None:
                return real_listdir(path)
            if not really_there(path):
                return real_listdir(m)
            names = real_listdir(path)  # the real folder's entries and the run's own
            return names + [n for n in real_listdir(m) if n not in set(names)]

        def scratch_scandir(path: Any = ".") -> Any:
            m = scratch_copy(path)
            return real_scandir(m if m is not None and not really_there(path) else path)

        stand_ins: list[tuple[Any, str, Any]] = [
            (os, "stat", looking(real_stat)), (os, "lstat", looking(real_lstat)),
            (os, "statvfs", looking(os.statvfs)),
            (os, "listdir", scratch_listdir), (os, "scandir", scratch_scandir),
            (os, "chmod", deleting(os.chmod, "os.chmod")),
            (os, "utime", deleting(os.utime, "os.utime")),
            (builtins, "open", scratch_open), (io, "open", scratch_open),
            (os, "open", scratch_os_open), (os, "makedirs", scratch_makedirs),
            (os, "mkdir", scratch_mkdir), (os, "remove", deleting(real_remove, "os.remove")),
            (os, "unlink", deleting(real_unlink, "os.unlink")),
            (os, "rmdir", deleting(real_rmdir, "os.rmdir")),
            (shutil, "rmtree", deleting(real_rmtree, "shutil.rmtree")),
            (os, "rename", renaming(real_rename, "os.rename")),
            (os, "replace", renaming(real_replace, "os.replace")),
        ]
        for owner, name, new in stand_ins:
            self.saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, new)

    def __enter__(self) -> ScratchFiles:
        self.root = tempfile.mkdtemp(prefix="torchmem-scratch-")
        self._install()
        PATH_RESOLVERS.append(self.existing_copy)  # torch.load finds the run's own files
        return self

    def __exit__(self, *exc: object) -> None:
        if self.existing_copy in PATH_RESOLVERS:
            PATH_RESOLVERS.remove(self.existing_copy)
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)
        self.saved.clear()
        shutil.rmtree(self.root, ignore_errors=True)
