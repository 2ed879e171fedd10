"""The command reference of the documentation, generated from the parsers ``main`` uses.

``docs/reference/cli.md`` is written from :func:`cli_reference_markdown` when the documentation
is built (``scripts/docs_hooks.py``), so every subcommand and option in it is one the command
line accepts, with the help text ``--help`` prints.

Example:
    >>> text = cli_reference_markdown()
    >>> "## `torchmem estimate`" in text and "`--gpu GPU`" in text
    True
"""

from __future__ import annotations

import argparse

from torchmem.cli import SUBCOMMANDS, _available, _top_parser, subcommand_parser

__all__ = ["cli_reference_markdown", "option_names"]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flag(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    """The option as ``--help`` lists it: ``-o PATH, --output PATH`` or a positional's name."""
    return formatter._format_action_invocation(action)  # noqa: SLF001 - argparse's own wording


def option_names(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string and positional name of ``parser`` except ``-h``/``--help``.

    Example:
        >>> from torchmem.cli import subcommand_parser
        >>> "--depth" in option_names(subcommand_parser("peak"))
        True
    """
    names: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse keeps no public list
        if isinstance(action, argparse._HelpAction):  # noqa: SLF001
            continue
        names.extend(action.option_strings or [action.dest])
    return names


def _section(name: str, parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()  # noqa: SLF001
    usage = parser.format_usage().strip()
    lines = [f"## `torchmem {name}`", "", SUBCOMMANDS[name][1][:1].upper() + SUBCOMMANDS[name][1][1:] + ".", "",
             "```text", usage, "```", "", "| argument | what it does |", "|---|---|"]
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._HelpAction):  # noqa: SLF001
            continue
        text = formatter._expand_help(action) if action.help else ""  # noqa: SLF001
        if action.choices and "{" not in _flag(action, formatter):
            text += f" (one of: {', '.join(map(str, action.choices))})"
        lines.append(f"| `{_cell(_flag(action, formatter))}` | {_cell(text)} |")
    return lines + [""]


def cli_reference_markdown() -> str:
    """Markdown of every subcommand: its usage line and a table of its arguments."""
    top = _top_parser()
    out = [
        "# Command reference",
        "",
        "Generated from the command line's own parsers when the documentation is built "
        "(`torchmem.cli._reference`), so it lists exactly what `torchmem SUBCOMMAND --help` "
        "accepts. Every command exits 0 on success, 2 on bad usage or bad input (a one-line "
        "error), 1 on an internal error; `torchmem run` passes on the script's exit code and "
        "`torchmem estimate` exits 3 when the step does not fit.",
        "",
        "```text",
        top.format_usage().strip(),
        "```",
        "",
        "| subcommand | what it does |",
        "|---|---|",
    ]
    names = [n for n in SUBCOMMANDS if _available(n)]
    out += [f"| [`{n}`](#torchmem-{n}) | {_cell(SUBCOMMANDS[n][1])} |" for n in names]
    out.append("")
    for name in names:
        out += _section(name, subcommand_parser(name))
    return "\n".join(out)
