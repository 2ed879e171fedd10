"""A script's command-line options: the one a search varies (``--max NAME``) and the batch size
the levers change (:data:`BATCH_OPTIONS`), read and rewritten in the script's arguments.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from torchmem.errors import InvalidInputError

# -- the API -------------------------------------------------------------------------------------


def _option(name: str, args: Sequence[str], source: str = "") -> str:
    """The command-line option ``--max NAME`` searches: ``--NAME`` as given, or with ``-`` and
    ``_`` swapped when the script's arguments (or else its source) use that spelling.

    Example:
        >>> _option("batch_size", ["--batch-size", "8"]), _option("seq-len", [], "'--seq_len'")
        ('--batch-size', '--seq_len')
    """
    bare = name.lstrip("-")
    if not bare or not bare.replace("-", "_").isidentifier():
        raise InvalidInputError(
            f"maximize={name!r}: expected the name of one of the script's integer options, "
            "e.g. 'batch-size' to search --batch-size"
        )
    flags = (f"--{bare}", f"--{bare.replace('_', '-')}", f"--{bare.replace('-', '_')}")
    for flag in flags:
        if any(a == flag or a.startswith(flag + "=") for a in args):
            return flag
    for flag in flags:
        if f"'{flag}'" in source or f'"{flag}"' in source:
            return flag
    return f"--{bare}"


def _current(flag: str, args: Sequence[str]) -> int | None:
    """The int value ``flag`` has in ``args`` (the last one), ``None`` when absent."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.partition("=")[2]
    try:
        return int(value) if value is not None else None
    except ValueError:
        raise InvalidInputError(
            f"{flag} {value!r} in the script's arguments: --max searches an integer option, "
            f"and {value!r} is not an int; fix: give an int or drop it"
        ) from None


#: the batch options the accumulation levers divide, in the order they are looked for
BATCH_OPTIONS = ("--batch-size", "--batch_size", "--per_device_train_batch_size",
                 "--per-device-train-batch-size", "--train-batch-size", "--train_batch_size",
                 "--train.micro_batch_size", "--train.micro-batch-size", "--micro_batch_size",
                 "--micro-batch-size", "--bs")

#: batch options of programs that derive their accumulation from a fixed global batch (litgpt:
#: ``--train.global_batch_size`` over ``--train.micro_batch_size``): dividing the micro-batch
#: is the whole change, the program accumulates itself
SELF_ACCUMULATING = frozenset({"--train.micro_batch_size", "--train.micro-batch-size"})
_HF_IMPORT = re.compile(r"^\s*(?:from|import)\s+(?:transformers|trl)\b", re.M)


def makes_hf_trainer(source: str) -> bool:
    """Whether a script imports transformers or TRL and names a ``Trainer`` (``Trainer``,
    ``SFTTrainer``, ``Seq2SeqTrainer``): its batch, when no option sets it, is the Trainer's.

    Example:
        >>> makes_hf_trainer("from trl import SFTConfig, SFTTrainer")
        True
        >>> makes_hf_trainer("import lightning as L; trainer = L.Trainer()")
        False
    """
    return "Trainer" in source and _HF_IMPORT.search(source) is not None

#: a script's own gradient accumulation option (nanoGPT's configurator global, an argparse
#: option): where the script defines one, the accumulation levers multiply it
ACCUM_OPTIONS = ("--gradient_accumulation_steps", "--gradient-accumulation-steps",
                 "--grad_accum_steps", "--grad-accum-steps", "--accumulation_steps",
                 "--accumulation-steps")


def _batch_option(args: Sequence[str]) -> tuple[str, int] | None:
    """The script's batch option as given in ``args`` (one of :data:`BATCH_OPTIONS` with an
    int value): ``(flag, value)``, or ``None``.

    Example:
        >>> _batch_option(["--lr", "1e-3", "--batch-size=16"]), _batch_option(["--lr", "1"])
        (('--batch-size', 16), None)
        >>> _batch_option(["--per_device_train_batch_size", "4"])
        ('--per_device_train_batch_size', 4)
    """
    for flag in BATCH_OPTIONS:
        if any(a == flag or a.startswith(flag + "=") for a in args):
            try:
                value = _current(flag, args)
            except InvalidInputError:
                continue
            if value is not None and value > 0:
                return flag, value
    return None


def _defined(flag: str, source: str) -> bool:
    """The script itself defines ``flag``: an argparse option spelled so, or (a configurator
    script, nanoGPT's) a global of that name assigned at the start of a line."""
    import re

    name = flag.lstrip("-")
    if f"'{flag}'" in source or f'"{flag}"' in source:
        return True
    # a configurator's --name=value sets the global `name` (nanoGPT: exec of configurator.py;
    # or the script's own loop over globals()); a global alone is no option
    return (name.isidentifier() and ("configurator" in source or "globals()[" in source)
            and re.search(rf"^{re.escape(name)}\s*=", source, re.M) is not None)


def script_batch(args: Sequence[str], source: str,
                 folder: str = ".") -> tuple[str, int] | None:
    """The batch option the accumulation levers divide: as given in ``args``
    (:func:`_batch_option`), else one the script defines with a default it sets itself
    (``default=N``, a configurator's global ``batch_size = 12``, a config file among ``args``).

    Example:
        >>> script_batch([], "batch_size = 12\\nexec(open('configurator.py').read())\\n")
        ('--batch_size', 12)
        >>> script_batch(["--bs", "4"], ""), script_batch([], "print(1)")
        (('--bs', 4), None)
    """
    got = _batch_option(args)
    if got is not None:
        return got
    for flag in BATCH_OPTIONS:
        if _defined(flag, source):
            value = _default(flag, source, args, folder)
            if value is not None and value > 0:
                return flag, value
    return None


def script_accumulation(args: Sequence[str], source: str,
                        folder: str = ".") -> tuple[str, int] | None:
    """The script's own gradient accumulation option (:data:`ACCUM_OPTIONS`) and its value
    (the command line's, else the script's default), where the script defines one; ``None``
    otherwise (a Trainer script's ``--gradient_accumulation_steps`` is the Trainer's, adjusted
    in the Trainer).

    Example:
        >>> src = "gradient_accumulation_steps = 5 * 8\\nexec(open('configurator.py').read())\\n"
        >>> script_accumulation([], src), script_accumulation(["--gradient_accumulation_steps=2"], src)
        (('--gradient_accumulation_steps', 40), ('--gradient_accumulation_steps', 2))
    """
    for flag in ACCUM_OPTIONS:
        if not _defined(flag, source):
            continue
        try:
            value = _current(flag, args)
        except InvalidInputError:
            return None
        if value is None:
            value = _default(flag, source, args, folder)
        if value is not None and value > 0:
            return flag, value
    return None


#: litgpt's training commands: with ``--devices N`` (N > 1) each shards the model itself
#: (``FSDPStrategy`` wrapping every transformer block), its own way to spread over N GPUs
LITGPT_SHARDING = frozenset({"finetune", "finetune_lora", "finetune_full", "finetune_adapter",
                             "finetune_adapter_v2", "finetune_lora_legacy", "pretrain"})


def litgpt_command(args: Sequence[str], name: str, module: bool, source: str) -> str | None:
    """The litgpt command run (``finetune_full`` of ``litgpt finetune_full CKPT ...``, as
    ``-m litgpt`` or its ``litgpt`` command), or ``None`` for any other program.

    Example:
        >>> litgpt_command(["finetune_full", "ckpt"], "litgpt", True, "")
        'finetune_full'
        >>> litgpt_command(["finetune_full"], "train.py", False, "import torch")
    """
    litgpt = (module and name.split(".")[0] == "litgpt") or (
        not module and "from litgpt.__main__ import" in source)
    return args[0] if litgpt and args else None


def script_devices(args: Sequence[str], name: str, module: bool,
                   source: str) -> int | None:
    """The devices a program that shards over its ``--devices`` itself runs on (litgpt's
    training commands, :data:`LITGPT_SHARDING`, run as ``-m litgpt`` or its ``litgpt``
    command): the command line's ``--devices``, else litgpt's default 1; ``None`` for any
    other program or a value that is no int (``auto``).

    Example:
        >>> script_devices(["finetune_lora", "ckpt", "--devices", "1"], "litgpt", True, "")
        1
        >>> script_devices(["pretrain"], "litgpt", True, ""), script_devices([], "x.py", False, "")
        (1, None)
    """
    if litgpt_command(args, name, module, source) not in LITGPT_SHARDING:
        return None
    try:
        value = _current("--devices", args)
    except InvalidInputError:
        return None
    return 1 if value is None else value


def with_option(args: Sequence[str], flag: str, value: int) -> list[str]:
    """``args`` with ``flag value`` replaced (every occurrence) or appended.

    Example:
        >>> with_option(["--lr", "1", "--batch-size", "8"], "--batch-size", 64)
        ['--lr', '1', '--batch-size', '64']
        >>> with_option(["--batch-size=8"], "--batch-size", 64), with_option([], "--bs", 2)
        (['--batch-size=64'], ['--bs=2'])
    """
    out, found, i = [], False, 0
    args = list(args)
    while i < len(args):
        a = args[i]
        if a == flag and i + 1 < len(args):
            out += [flag, str(value)]
            found = True
            i += 2
            continue
        if a.startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        else:
            out.append(a)
        i += 1
    # appended as one word: argparse, click and HfArgumentParser read ``--name=value`` too, and
    # configurators like nanoGPT's take only that form
    return out if found else [*out, f"{flag}={value}"]


def _default(flag: str, source: str, args: Sequence[str] = (), folder: str = ".") -> int | None:
    """The value the script gives ``flag`` when the command line does not: an argparse
    ``default=N``, a dataclass field's ``= N`` / ``default=N`` (HfArgumentParser), or a global
    ``name = N`` (a configurator script, nanoGPT's) where a ``.py`` file among ``args`` (a
    config file, read after the script) may set it again; ``None`` when none is found.

    Example:
        >>> src = "p.add_argument('--batch-size', type=int, default=32)"
        >>> _default("--batch-size", src), _default("--batch_size", "batch_size = 12\\n")
        (32, 12)
    """
    import re

    ident = re.escape(flag.lstrip("-").replace("-", "_"))
    patterns = (
        rf"""add_argument\(\s*['"]{re.escape(flag)}['"][^()]*?default\s*=\s*(\d+)""",
        rf"^\s*{ident}\s*:\s*int\s*=\s*(?:field\([^()]*?default\s*=\s*)?(\d+)",
        rf"^{ident}\s*=\s*(\d+(?:\s*[*+]\s*\d+)*)(?![\d.\w])",
    )
    texts = [source]
    for a in args:
        if a.endswith(".py") and not a.startswith("-"):
            try:
                with open(os.path.join(folder, a)) as f:
                    texts.append(f.read())
            except OSError:
                continue
    value = None
    for text in texts:
        for pat in patterns:
            hits = re.findall(pat, text, re.M | re.S)
            if hits:
                value = _int_expr(hits[-1])
    return value


def _int_expr(text: str) -> int:
    """An int written as a product or sum of ints (``5 * 8``), evaluated left to right with
    ``*`` before ``+``.

    Example:
        >>> _int_expr("12"), _int_expr("5 * 8"), _int_expr("2 * 3 + 1")
        (12, 40, 7)
    """
    total = 0
    for term in text.split("+"):
        prod = 1
        for factor in term.split("*"):
            prod *= int(factor)
        total += prod
    return total
