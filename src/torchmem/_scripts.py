"""The file ``python SCRIPT`` runs, found the same way by ``torchmem run`` and ``torchmem
estimate`` (torch-free: checked before anything heavy is imported).

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp(); _ = open(os.path.join(d, "__main__.py"), "w").write("")
    >>> script_file(d, "run") == os.path.join(d, "__main__.py")
    True
"""

from __future__ import annotations

import os

from torchmem.errors import InvalidInputError, MissingFileError

__all__ = ["module_command", "script_file"]


def script_file(script: str, command: str) -> str:
    """The script, or a folder's ``__main__.py``; a clear error (naming ``torchmem
    COMMAND``'s usage) for a folder without one or a missing file.

    Example:
        >>> script_file("no/such.py", "estimate")
        Traceback (most recent call last):
        ...
        torchmem.errors.MissingFileError: script 'no/such.py' not found; expected a path to a Python file, as 'python no/such.py' would run it (check the path and the current folder)
    """
    if os.path.isdir(script):
        main_py = os.path.join(script, "__main__.py")
        if not os.path.isfile(main_py):
            raise InvalidInputError(
                f"{script!r} is a directory with no __main__.py; expected a Python file "
                f"('torchmem {command} train.py'), a folder with a __main__.py, or a module "
                f"to run with -m ('torchmem {command} -m package.module')"
            )
        return main_py
    if not os.path.isfile(script):
        raise MissingFileError(
            f"script {script!r} not found; expected a path to a Python file, as 'python "
            f"{script}' would run it (check the path and the current folder)",
            path=script, kind="script",
        )
    return script


def module_command(argv: list[str], script: str | None, command: str) -> tuple[str, list[str]]:
    """``-m MODULE ARGS`` (argparse's remainder) as ``(MODULE, ARGS)``; an error when the name
    is missing or a script was given too.

    Example:
        >>> module_command(["pkg.train", "--lr", "1"], None, "run")
        ('pkg.train', ['--lr', '1'])
    """
    if not argv:
        raise InvalidInputError(f"expected a module name after -m, e.g. 'torchmem {command} -m "
                                "mypkg.train --epochs 1'")
    if script:
        raise InvalidInputError(
            f"got both a script ({script!r}) and -m {argv[0]}; pass one of them "
            "(torchmem's options go before -m, the module's after it)"
        )
    return argv[0], list(argv[1:])
