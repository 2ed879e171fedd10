"""The GPU catalog: every card has figures and a source; names and sizes resolve; unknown
names list the catalog."""

from __future__ import annotations

import re

import pytest

from torchmem.errors import InvalidInputError
from torchmem.fit import CONTEXT_BYTES, GPUS, gpu

GiB = 1 << 30

EXPECTED = {"A100-40GB", "A100-80GB", "H100-80GB", "H100-PCIe", "H200", "L4", "L40S", "A10G",
            "T4", "V100-16GB", "V100-32GB", "RTX-3090", "RTX-4090", "RTX-5090", "A6000"}


def test_catalog_covers_the_common_cards():
    assert EXPECTED <= set(GPUS)


@pytest.mark.parametrize("name", sorted(GPUS))
def test_every_entry_is_consistent(name):
    g = GPUS[name]
    assert g.name == name and g.source and g.marketed
    assert g.compute_capability[0] in CONTEXT_BYTES
    assert 0 < g.usable_bytes == g.total_bytes - g.context_bytes < g.total_bytes
    # cudaMemGetInfo's total is below the marketed size (GiB for these cards), within 12%
    marketed = float(re.search(r"(\d+) GB", g.marketed).group(1))
    assert 0.88 * marketed * GiB < g.total_bytes < marketed * GiB


def test_known_figures():
    assert gpu("T4").total_bytes == round(14.75 * GiB)
    assert gpu("H100-80GB").compute_capability == (9, 0)
    assert gpu("a100 80gb") is GPUS["A100-80GB"] and gpu("rtx_4090") is GPUS["RTX-4090"]
    assert gpu("4090") is GPUS["RTX-4090"]


def test_sizes():
    g = gpu("23.5 GiB")
    assert g.total_bytes == int(23.5 * GiB) and g.source == "size given by the user"
    assert gpu("24GB").total_bytes == 24 * 10**9
    assert gpu(8 * GiB).total_bytes == 8 * GiB


@pytest.mark.parametrize("bad", ["H9000", "", "0 GiB", -5, None, True])
def test_unknown_lists_the_catalog(bad):
    with pytest.raises(InvalidInputError) as ei:
        gpu(bad)
    msg = str(ei.value)
    assert "expected one of: A100-40GB" in msg and "RTX-4090" in msg and "'23.5 GiB'" in msg
