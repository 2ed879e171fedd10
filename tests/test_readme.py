"""The README does not contradict itself or the code (issue 26).

Each claim that something is missing or unbounded is checked against the code that builds it:
the "Not built yet" paragraph names nothing that exists, the limits name nothing that is
modelled, and each topic has one top-level section.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torchmem
from torchmem.capture.host import HostSampler
from torchmem.fit import Estimate
from torchmem.model.aggregate import Aggregate

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _not_built() -> str:
    """The "Not built yet" paragraph, up to the sentence that lists what is built."""
    m = re.search(r"^Not built yet.*?(?=\n\n|Built, though)", README, re.M | re.S)
    assert m, "the README has no 'Not built yet' paragraph"
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
    }
    assert all(built.values()), built
    text = _not_built()
    named = [phrase for phrase in built if phrase.lower() in text.lower()]
    assert not named, f"'Not built yet' names what exists: {named}: {text}"


def test_limits_do_not_deny_what_is_built() -> None:
    flat = " ".join(README.split())
    assert Aggregate().within > 0  # step-less aggregated runs are compacted midway
    for wrong, right in (
        ("without step markers are never compacted",
         "Runs without step markers (an inference loop) are bounded too"),
        # FSDP2's CPUOffloadPolicy is estimated (tests/test_fit_placement.py)
        ("CPU offload are not modelled", "`CPUOffloadPolicy` is:"),
    ):
        assert wrong not in flat, f"the README says {wrong!r}"
        assert right in flat, f"the README does not say {right!r}"


def test_each_topic_has_one_top_level_section() -> None:
    heads = re.findall(r"^## (.+)$", README, re.M)
    assert len(heads) == len(set(heads)), heads
    rank_sections = [h for h in heads if re.search(r"\brank", h, re.I)]
    assert rank_sections == ["Many ranks: every rank of a `torch.distributed` job tracked"], (
        rank_sections)
    many = README.split("## Many ranks", 1)[1].split("\n## ", 1)[0]
    assert "### One view of the job: `torchmem merge`" in many
    assert "torchmem merge NAME.rank*.tmtrace" in many
