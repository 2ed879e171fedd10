"""The documentation site builds with warnings as errors, offline, from the code (issue 27).

One ``mkdocs build --strict`` (mkdocs.yml) into a temporary folder, then what it must hold: the
command reference lists every subcommand and option of the parsers, the API reference every
public name, the pictures generated from the built-in example, and no page fetches anything
from the network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import torchmem
from torchmem.cli import SUBCOMMANDS, subcommand_parser
from torchmem.cli._reference import option_names

ROOT = Path(__file__).resolve().parents[1]
# one worker runs this file (bash scripts/test.sh: pytest -n auto --dist loadgroup): its module
# fixtures and caches are built once, not once per worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("docs_site")]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    return out


def _text(html: str) -> str:
    """The page's text, tags and entities removed (what a reader sees)."""
    import html as h

    return h.unescape(re.sub(r"<[^>]+>", "", html))


def test_command_reference_lists_every_subcommand_and_option(site: Path) -> None:
    text = _text((site / "reference" / "cli.html").read_text())
    missing = []
    for name in SUBCOMMANDS:
        if f"torchmem {name}" not in text:
            missing.append(name)
        for opt in option_names(subcommand_parser(name)):
            if opt.startswith("-") and not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text):
                missing.append(f"{name} {opt}")
    assert not missing, missing
    # the help text itself, not only the flags
    assert "only this device, e.g. cpu or cuda:0" in text


def test_api_reference_documents_every_public_name(site: Path) -> None:
    html = (site / "reference" / "api.html").read_text()
    ids = set(re.findall(r'id="(torchmem[\w.]*)"', html))
    assert not [n for n in torchmem.__all__ if f"torchmem.{n}" not in ids]
    for ns in ("fit", "sim", "analysis", "io", "capture", "transfer", "ledger", "compat",
               "devices", "errors", "units"):
        mod = getattr(torchmem, ns)
        # a function named as the module that defines it is documented under that module
        undocumented = [n for n in mod.__all__ if f"torchmem.{ns}.{n}" not in ids
                        and f"torchmem.{ns}.{n}.{n}" not in ids]
        assert not undocumented, (ns, undocumented)
    # docstring examples are code, not prose (``Example:`` sections read as examples)
    assert "language-pycon" in html or 'class="pycon' in html or "highlight" in html


def test_pictures_are_generated_from_the_built_in_example(site: Path) -> None:
    gen = site / "assets" / "generated"
    assert (gen / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    viewer = (gen / "viewer-example.html").read_text()
    assert "Content-Security-Policy" in viewer
    fit = _text((site / "guides" / "fit.html").read_text())
    assert re.search(r"T4, batch 4096: (FITS|DOES NOT FIT)", fit), "no generated fit report"
    tracking = (site / "guides" / "tracking.html").read_text()
    assert "assets/generated/timeline.png" in tracking
    snapshots = (site / "guides" / "snapshots.html").read_text()
    assert "assets/generated/viewer-example.html" in snapshots
    if shutil.which("chromium") and Path("/usr/bin/chromium").exists():
        assert (gen / "viewer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "assets/generated/viewer.png" in snapshots
    else:
        assert "No screenshot in this build" in snapshots


def test_no_page_fetches_from_the_network(site: Path) -> None:
    fetched = []
    for page in site.rglob("*.html"):
        html = page.read_text()
        fetched += [f"{page.name}: {u}" for u in
                    re.findall(r'<(?:script|img|iframe)[^>]*\ssrc="(https?://[^"]+)', html)]
        fetched += [f"{page.name}: {u}" for u in
                    re.findall(r'<link[^>]*\shref="(https?://[^"]+)', html)]
        assert "fonts.googleapis" not in html and "fonts.gstatic" not in html, page
    for sheet in site.rglob("*.css"):  # fonts and imports of the stylesheets
        fetched += [f"{sheet.name}: {u}" for u in
                    re.findall(r'(?:url\(\s*["\']?|@import\s+["\'])(https?://[^"\')\s]+)', sheet.read_text())]
    assert not fetched, fetched


# `browser`: conftest.py's headless Chromium (skips without chromium or Playwright)
def _open(browser: Any, url: str) -> tuple[Any, list[str], list[str]]:
    """A page at ``url`` with every request and script error it makes recorded."""
    page = browser.new_page()
    requests: list[str] = []
    errors: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.goto(url)
    return page, requests, errors


def _pages_with(site: Path, term: str) -> set[str]:
    """The pages whose indexed text holds ``term`` (from the built search index, not the browser)."""
    import json

    docs = json.loads((site / "search" / "search_index.json").read_text())["docs"]
    return {d["location"].split("#")[0] for d in docs
            if term in (d["title"] + " " + d["text"]).lower()}


@pytest.mark.browser
def test_search_works_opened_from_disk(site: Path, browser: Any) -> None:
    """Search on a page opened as a file (file://, no server), and nothing fetched from the web."""
    word = "fsdpmemtracker"  # PyTorch's FSDPMemTracker: named in the fit guide, not on index.html
    assert word not in (site / "index.html").read_text().lower()  # results come from the index
    expected = _pages_with(site, word)
    assert "guides/fit.html" in expected, expected
    page, requests, errors = _open(browser, (site / "index.html").as_uri() + "?q=" + word)
    page.wait_for_selector(".md-search-result__item", timeout=30000)
    found = page.evaluate("Array.from(document.querySelectorAll('.md-search-result__item > a'))"
                          ".map(a => a.getAttribute('href'))")
    found = {h.split("?")[0].split("#")[0].removeprefix(site.as_uri() + "/") for h in found}
    assert found and found <= expected, (found, expected)
    assert "guides/fit.html" in found
    meta = page.evaluate("document.querySelector('.md-search-result__meta').textContent")
    assert re.fullmatch(r"\d+ matching documents?", meta.strip()), meta
    page.close()
    # a word on no page: the search ran and says so
    page, more, more_errors = _open(browser, (site / "index.html").as_uri() + "?q=zzqxwv")
    page.wait_for_function("document.querySelector('.md-search-result__meta').textContent"
                           ".includes('No matching')", timeout=30000)
    page.close()
    assert not [u for u in requests + more if not u.startswith(("file:", "data:", "blob:", "about:"))]
    assert not errors + more_errors, errors + more_errors


@pytest.mark.browser
def test_no_page_fetches_from_the_network_when_viewed(site: Path, browser: Any) -> None:
    """Every built page in Chromium, from disk: all it loads (scripts, fonts, styles) is local."""
    foreign = []
    pages = sorted(p for p in site.rglob("*.html") if "generated" not in p.parts)
    assert len(pages) >= 14, pages
    for html in pages:
        page, requests, errors = _open(browser, html.as_uri())
        page.wait_for_load_state("load")
        page.evaluate("document.fonts.ready.then(() => 0)")
        page.close()
        foreign += [f"{html.name}: {u}" for u in requests
                    if not u.startswith(("file:", "data:", "blob:", "about:"))]
        if html.name != "404.html":  # the server's page for a missing one: site-root links
            foreign += [f"{html.name}: {e}" for e in errors]
    assert not foreign, foreign
