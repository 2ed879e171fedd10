"""MkDocs hooks: the pages and pictures that the documentation build generates (mkdocs.yml).

Nothing here is pasted into docs/: each build writes, from the code as it is now,

- ``reference/cli.md``: every subcommand and option, from the command line's own parsers
  (``torchmem.cli._reference``);
- ``ARCHITECTURE.md``, ``BENCHMARKS.md``: the repository's files, so the guides can link them;
- ``assets/generated/``: the built-in example (``torchmem run --example``'s training run)
  tracked, its timeline plot (torchmem's own plot code), its offline viewer page and, when
  Debian's Chromium and Playwright are there, a screenshot of that viewer;
- the top-level names of the API reference (``torchmem.__all__``, where a page says
  ``<!-- generated: api torchmem -->``: the names are exported lazily, so no static reading
  finds them);
- the fit report of the built-in example's model (``torchmem.estimate`` on a T4), put where a
  page says ``<!-- generated: fit-report -->``, and the viewer picture where a page says
  ``<!-- generated: viewer -->``.
"""

from __future__ import annotations

import io
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.torchmem")
ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
_state: dict[str, Any] = {}


def _example_trace() -> Any:
    """The built-in example tracked as ``torchmem run --example`` tracks it."""
    import torchmem
    from torchmem._example_train import main

    with torchmem.track(stacks=False) as tr:
        main()
    return tr.trace


def _fit_report() -> str:
    """``torchmem estimate``'s text report for the built-in example's model on a T4."""
    import torch

    import torchmem
    from torchmem._example_train import build_model
    from torchmem.cli.estimate import render_text

    def build(batch_size: int) -> Any:
        model = build_model().to("cuda")
        opt = torch.optim.Adam(model.parameters())
        x = torch.randn(batch_size, 64, device="cuda")
        y = torch.randint(0, 10, (batch_size,), device="cuda")

        def step() -> None:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        return step

    est = torchmem.estimate(build, gpu="T4", batch_size=4096)
    out = io.StringIO()
    render_text(est, file=out)
    return out.getvalue()


def _screenshot(html: Path, png: Path) -> str | None:
    """A PNG of the viewer in headless Chromium; the reason when there is none."""
    if not Path(CHROMIUM).exists():
        return f"Chromium is not installed here ({CHROMIUM})"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return "Playwright is not installed here"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 760})
            page.goto(html.resolve().as_uri())
            page.wait_for_timeout(1500)
            page.screenshot(path=str(png))
        finally:
            browser.close()
    return None


def _generate(out: Path) -> None:
    import torchmem
    from torchmem.cli._reference import cli_reference_markdown

    (out / "reference").mkdir(parents=True)
    (out / "reference" / "cli.md").write_text(cli_reference_markdown())
    for name in ("ARCHITECTURE.md", "BENCHMARKS.md"):
        shutil.copy(ROOT / name, out / name)
    assets = out / "assets" / "generated"
    assets.mkdir(parents=True)
    trace = _example_trace()
    torchmem.render.plot.plot_timeline(trace, assets / "timeline.png",
                                       title="torchmem run --example: live bytes by category")
    torchmem.write_viewer(trace, str(assets / "viewer-example.html"))
    _state["no_screenshot"] = _screenshot(assets / "viewer-example.html", assets / "viewer.png")
    if _state["no_screenshot"]:
        log.info("no viewer screenshot: %s", _state["no_screenshot"])
    _state["fit_report"] = _fit_report()


def on_startup(command: str, dirty: bool) -> None:
    """Read torchmem's ``Example:`` docstring sections as examples (code), as doctest runs them.

    Google style names the section ``Examples:``; griffe reads any other title as an admonition
    of plain Markdown. torchmem's 1,000-odd docstrings say ``Example:``, so the one word is added
    to griffe's table of section titles (checked, so that a griffe that moves it fails here).
    """
    from griffe._internal.docstrings import google
    from griffe._internal.enumerations import DocstringSectionKind

    table = google._section_kind
    if table.get("examples") is not DocstringSectionKind.examples:
        raise RuntimeError("griffe's table of Google section titles moved; update scripts/docs_hooks.py")
    table["example"] = DocstringSectionKind.examples


def on_pre_build(config: Any) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="torchmem-docs-"))
    _state["dir"] = tmp
    _generate(tmp)


def on_files(files: Files, config: Any) -> Files:
    tmp: Path = _state["dir"]
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        uri = path.relative_to(tmp).as_posix()
        old = files.get_file_from_path(uri)
        if old is not None:
            files.remove(old)
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    up = "../" * page.file.src_uri.count("/")
    if "<!-- generated: fit-report -->" in markdown:
        block = "```text\n" + _state["fit_report"].rstrip() + "\n```"
        markdown = markdown.replace("<!-- generated: fit-report -->", block)
    if "<!-- generated: viewer -->" in markdown:
        link = f"[the viewer page itself]({up}assets/generated/viewer-example.html)"
        if _state["no_screenshot"]:
            shown = (f"*(No screenshot in this build: {_state['no_screenshot']}. Open {link}; "
                     "it works offline.)*")
        else:
            shown = (f"![torchmem view of the built-in example]({up}assets/generated/viewer.png)"
                     f"\n\nOpen {link} (it works offline).")
        markdown = markdown.replace("<!-- generated: viewer -->", shown)
    if "<!-- generated: api torchmem -->" in markdown:
        import torchmem

        members = "".join(f"        - {name}\n" for name in torchmem.__all__)
        block = f"::: torchmem\n    options:\n      show_root_heading: false\n      members:\n{members}"
        markdown = markdown.replace("<!-- generated: api torchmem -->", block)
    return markdown


def on_post_build(config: Any) -> None:
    shutil.rmtree(_state.pop("dir"), ignore_errors=True)
