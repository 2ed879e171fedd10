"""oom_report from the allocator simulator: the state at the OOM and what-if settings.

The snapshots are written by the simulator itself from a scenario worked out by hand below (a
real allocator would do the same: see ../shared/docs/cuda-caching-allocator-2.13.md), then read
back through PyTorch's format; the figures in the assertions are the hand-computed ones, and the
what-ifs are checked against direct runs of the same requests under each setting.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import snapshot_synth as synth
from torchmem.analysis._oom import oom_report
from torchmem.errors import SimulatedOutOfMemoryError
from torchmem.io.pytorch_snapshot import from_pytorch, to_pytorch_dict
from torchmem.model.snapshot import Snapshot
from torchmem.sim import CachingAllocator

MiB = 1 << 20
CAP = 1000 * MiB


def _scenario(config: str | None = None, fraction: float | None = None) -> CachingAllocator:
    """600 MiB allocated and freed (one cached 600 MiB segment), 50 MiB allocated (best fit:
    the front of that segment, split), then 560 MiB requested: the 550 MiB tail is too small, a
    new 560 MiB segment would make 1160 MiB > 1000 MiB, and emptying the cache frees nothing
    (the one segment is split). Out of memory, with 400 MiB free on the device."""
    a = CachingAllocator(capacity=CAP, config=config, memory_fraction=fraction)
    x = a.malloc(600 * MiB)
    a.free(x)
    a.malloc(50 * MiB)
    a.malloc(560 * MiB)
    return a


def _oom_snapshot() -> Snapshot:
    a = CachingAllocator(capacity=CAP)
    x = a.malloc(600 * MiB)
    a.free(x)
    a.malloc(50 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError):
        a.malloc(560 * MiB)
    return from_pytorch(to_pytorch_dict(a.snapshot()))  # through PyTorch's format


WHAT_IF = {  # setting -> would the 560 MiB request have fitted (worked out by hand)
    # pages of 20 MiB: the 50 MiB block splits off the mapped 600 MiB, and the 550 MiB free tail
    # grows by one more page: 620 MiB reserved
    "expandable_segments:True": True,
    # 50 MiB < 128 MiB may not split the 600 MiB block: a 50 MiB segment; then 560 MiB frees the
    # oversize cached 600 MiB block (release_available_cached_blocks): 610 MiB reserved
    "max_split_size_mb:128": True,
    "max_split_size_mb:512": True,
    # garbage collection frees only unsplit cached blocks: there is none
    "garbage_collection_threshold:0.8 (memory fraction 1.0)": False,
    "garbage_collection_threshold:0.5 (memory fraction 1.0)": False,
}


def test_the_state_at_the_oom_is_the_simulators() -> None:
    (o,) = oom_report(_oom_snapshot())
    assert (o.requested_bytes, o.device_free_bytes) == (560 * MiB, 400 * MiB)
    sim = o.simulated
    assert sim is not None and sim["exact"] and sim["reproduces_oom"]
    assert (sim["allocated_bytes"], sim["reserved_bytes"]) == (50 * MiB, 600 * MiB)
    assert sim["free"] == [{"stream": 0, "pool": "large", "blocks": 1, "free_bytes": 550 * MiB,
                            "largest_free_block": 550 * MiB}]
    assert sim["pending_free_bytes"] == 0
    assert (o.cached_free_bytes, o.largest_free_block) == (550 * MiB, 550 * MiB)
    assert o.verdict == "fragmentation"  # 400 + 550 >= 560, but no single block


def test_what_if_settings_agree_with_the_hand_computation_and_direct_runs() -> None:
    (o,) = oom_report(_oom_snapshot())
    got = {a["setting"]: a["avoided"] for a in o.alternatives}
    assert got == WHAT_IF
    direct = {
        "expandable_segments:True": ("expandable_segments:True", None),
        "max_split_size_mb:128": ("max_split_size_mb:128", None),
        "max_split_size_mb:512": ("max_split_size_mb:512", None),
        "garbage_collection_threshold:0.8 (memory fraction 1.0)": ("garbage_collection_threshold:0.8", 1.0),
        "garbage_collection_threshold:0.5 (memory fraction 1.0)": ("garbage_collection_threshold:0.5", 1.0),
    }
    for label, (conf, fraction) in direct.items():
        try:
            _scenario(conf, fraction)
            fits = True
        except SimulatedOutOfMemoryError:
            fits = False
        assert fits == WHAT_IF[label], label
    reserved = {a["setting"]: a["detail"] for a in o.alternatives}
    assert "620.00 MiB reserved after it" in reserved["expandable_segments:True"]
    assert "610.00 MiB reserved after it" in reserved["max_split_size_mb:128"]
    assert "Would have avoided it" in o.explanation and "expandable_segments:True" in o.explanation


def test_a_mid_run_trace_replays_from_its_rebuilt_start() -> None:
    # keep only the last two entries (the 50 MiB alloc and the oom): the 600 MiB segment was
    # there before the trace, free. Its state was made without expandable segments, so from
    # there expandable segments cannot help (the new expandable range needs 560 MiB more), while
    # max_split_size still frees the oversize block.
    raw = to_pytorch_dict(_oom_snapshot())
    raw["device_traces"][0] = raw["device_traces"][0][-2:]
    (o,) = oom_report(from_pytorch(raw))
    assert o.simulated is not None and o.simulated["start"] == "rebuilt" and o.simulated["exact"]
    assert o.simulated["free"][0]["largest_free_block"] == 550 * MiB
    got = {a["setting"]: a["avoided"] for a in o.alternatives}
    assert got["expandable_segments:True"] is False and got["max_split_size_mb:128"] is True
    assert "which the real settings made" in o.explanation


def test_a_mid_run_expandable_trace_at_driver_addresses_gets_what_ifs() -> None:
    # expandable_segments:True, 1000 MiB: 600 MiB, 4 KiB (the small pool's range) and 100 MiB;
    # the 600 MiB freed and unmapped by empty_cache; the trace starts there (the large range's
    # lowest page mapped at the start is 600 MiB above its start), then 300 + 300 MiB map the
    # range's first pages and 400 MiB runs out of memory. The ranges are moved to addresses of
    # the driver's choosing, as on a real GPU, so the replay must find them in the trace.
    a = CachingAllocator(capacity=CAP, config="expandable_segments:True")
    x = a.malloc(600 * MiB)
    a.malloc(4096)
    a.malloc(100 * MiB)
    a.free(x)
    a.empty_cache()
    cut = len(a.events)
    a.malloc(300 * MiB)
    a.malloc(300 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError):
        a.malloc(400 * MiB)
    small = next(e[1] for e in a.events if e[0] == "segment_map" and e[2] == 2 * MiB)

    def moved(addr: int) -> int:
        return addr - small + 0x1948000000 if addr >= small else addr - x + 0x302000000

    raw = to_pytorch_dict(a.snapshot())
    raw["device_traces"][0] = raw["device_traces"][0][cut:]
    for e in raw["device_traces"][0]:
        if e["action"] != "oom":
            e["addr"] = moved(e["addr"])
    for seg in raw["segments"]:
        seg["address"] = moved(seg["address"])
        for b in seg["blocks"]:
            b["address"] = moved(b["address"])
    (o,) = oom_report(from_pytorch(raw))
    assert o.simulated is not None and o.simulated["start"] == "rebuilt" and o.simulated["exact"]
    got = {a["setting"]: a["avoided"] for a in o.alternatives}
    assert got and not any(got.values())  # 700 MiB live, 400 MiB more: nothing helps
    assert "did not reproduce" not in o.explanation
    # the run's own setting is not offered as a what-if: it is the replay that ran out of memory
    assert o.simulated["expandable_segments"] is True
    assert [a["setting"] for a in o.alternatives if a.get("already_set")] == [
        "expandable_segments:True"]
    assert "Already set in this run: expandable_segments:True." in o.explanation
    assert "Would not have: max_split_size_mb:128" in o.explanation
    assert "expandable_segments:True," not in o.explanation.split("Would not have:")[1]


def test_a_trace_the_simulator_does_not_reproduce_gets_no_what_ifs() -> None:
    # the hand-written OOM file makes a 40 MiB segment for a 10 MiB request: not the allocator
    (o,) = oom_report(from_pytorch(synth.oom(fragmented=True)))
    assert o.simulated is not None and o.simulated["exact"] is False
    assert o.alternatives == []
    assert "approximate" in o.explanation and o.verdict == "fragmentation"


def test_torchmem_stats_prints_the_simulated_oom(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import json
    import pickle

    from torchmem.cli import main

    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(to_pytorch_dict(_oom_snapshot())))
    assert main(["stats", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Simulated at the OOM: stream 0 large pool 550.00 MiB free, largest block 550.00 MiB" in out
    assert "Would have avoided it (replayed on a device of the same size): expandable_segments:True" in out
    assert main(["stats", str(path), "--json"]) == 0
    (o,) = json.loads(capsys.readouterr().out)["oom"]
    assert {a["setting"]: a["avoided"] for a in o["alternatives"]} == WHAT_IF
