"""The README and the documentation do not contradict themselves or the code (issues 26, 27).

The README is a front page (at most 300 lines) whose links all lead somewhere; the guides under
docs/ hold the reference text. Each claim that something is missing or unbounded is checked
against the code that builds it: the "Not built yet" paragraph (docs/index.md) names nothing
that exists, the limits name nothing that is modelled, and each topic has one section.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torchmem
from torchmem.capture.host import HostSampler
from torchmem.fit import Estimate
from torchmem.model.aggregate import Aggregate

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = {p.relative_to(ROOT / "docs").as_posix(): p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))}
DOCS = "\n".join(PAGES.values())
INDEX = PAGES["index.md"]


def _headings(text: str, levels: str = "1,6") -> list[str]:
    """The Markdown headings of ``text`` (comments in fenced code blocks are not headings)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.findall(rf"^#{{{levels}}} (.+)$", prose, re.M)


def _slug(heading: str) -> str:
    """The anchor Markdown renderers (GitHub's, MkDocs' toc) give a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", text)


def test_readme_is_a_front_page() -> None:
    assert len(README.splitlines()) <= 300
    # the two set-up commands, unchanged (CI and users run them)
    assert '```bash\npython -m pip install "torch==2.13.0" ".[plot]" && torchmem run --example\n```' in README
    assert "```bash\nbash scripts/test.sh\n```" in README
    for words in ("A 30-second tour", "Track a training run", "Read a snapshot", "Will it fit?",
                  "Why it ran out of memory", "Building the docs", "mkdocs build --strict",
                  "mkdocs serve"):
        assert words in README, words


def test_readme_links_lead_to_existing_pages_and_headings() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert len(local) >= 12, local
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README links to {path}, which does not exist"
        if anchor:
            heads = _headings(target.read_text())
            assert anchor in {_slug(h) for h in heads}, f"{path} has no heading #{anchor}"
    # every guide is linked from the capability table
    for page in PAGES:
        if page.startswith("guides/"):
            assert f"](docs/{page})" in README, f"the README does not link {page}"


def _not_built() -> str:
    """The "Not built yet" paragraph, up to the sentence that lists what is built."""
    m = re.search(r"^Not built yet.*?(?=\n\n|Built, though)", INDEX, re.M | re.S)
    assert m, "docs/index.md has no 'Not built yet' paragraph"
    return " ".join(m[0].split())


def test_not_built_names_nothing_that_exists() -> None:
    import torchmem.cli._live as live

    # what the paragraph could name -> the code that shows it exists
    built = {
        "multi-rank estimates": "world_size" in inspect.signature(torchmem.estimate).parameters,
        "per-rank estimates": "world_size" in inspect.signature(torchmem.estimate).parameters,
        "inference estimates from a config": callable(torchmem.estimate_hf),
        "estimates from a config": callable(torchmem.estimate_hf),
        "host memory kept apart": "host_peak_bytes" in Estimate.__dataclass_fields__,
        "live view of host memory": "HostRow" in vars(live) and HostSampler is not None,
        "memory levers": "what_if" in inspect.signature(torchmem.estimate).parameters,
        "MemLord drop-in": hasattr(torchmem.compat, "MemLord"),
        "documentation site": (ROOT / "mkdocs.yml").is_file() and "guides/fit.md" in PAGES,
    }
    assert all(built.values()), built
    text = _not_built()
    named = [phrase for phrase in built if phrase.lower() in text.lower()]
    assert not named, f"'Not built yet' names what exists: {named}: {text}"


def test_limits_do_not_deny_what_is_built() -> None:
    flat = " ".join((README + DOCS).split())
    assert Aggregate().within > 0  # step-less aggregated runs are compacted midway
    for wrong, right, page in (
        ("without step markers are never compacted",
         "Runs without step markers (an inference loop) are bounded too", "guides/tracking.md"),
        # FSDP2's CPUOffloadPolicy is estimated (tests/test_fit_placement.py)
        ("CPU offload are not modelled", "`CPUOffloadPolicy` is:", "guides/fit.md"),
    ):
        assert wrong not in flat, f"the documentation says {wrong!r}"
        assert right in " ".join(PAGES[page].split()), f"{page} does not say {right!r}"


def test_each_topic_has_one_section() -> None:
    heads = [h for text in PAGES.values() for h in _headings(text, "1,2")]
    assert len(heads) == len(set(heads)), sorted(h for h in heads if heads.count(h) > 1)
    rank_sections = [h for h in heads if re.search(r"\brank", h, re.I)]
    assert rank_sections == ["Many ranks: every rank of a `torch.distributed` job tracked"], (
        rank_sections)
    many = PAGES["guides/many-ranks.md"]
    assert "### One view of the job: `torchmem merge`" in many
    assert "torchmem merge NAME.rank*.tmtrace" in many
