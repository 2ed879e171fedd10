"""torchmem.sim.AllocatorConfig: PyTorch 2.13's option parsing, bounds, precedence, snapshot settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchmem.errors import InvalidInputError
from torchmem.io import load_snapshot
from torchmem.sim import AllocatorConfig, CachingAllocator

MiB = 1 << 20
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "snapshots"
DATA = Path(__file__).resolve().parent / "data"


def test_defaults_are_pytorchs() -> None:
    c = AllocatorConfig()
    assert c.max_split_size == (1 << 64) - 1  # SIZE_MAX: unlimited
    assert c.large_segment_size == 20 * MiB
    assert c.max_non_split_rounding_size == 20 * MiB  # = large_segment_size
    assert c.roundup_power2_divisions == (0,) * 16
    assert (c.garbage_collection_threshold, c.expandable_segments) == (0.0, False)
    assert AllocatorConfig.parse("") == c


def test_every_option_parses() -> None:
    c = AllocatorConfig.parse(
        "large_segment_size_mb:32, max_split_size_mb:64,max_non_split_rounding_mb:48,"
        "garbage_collection_threshold:0.7,expandable_segments:True,release_lock_on_cudamalloc:True,"
        "roundup_power2_divisions:[256:1,512:2,>:4],per_process_memory_fraction:0.5,backend:native,"
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:8,"
        "graph_capture_record_stream_reuse:True,pinned_use_background_threads:True,"
        "throw_on_cudamalloc_oom:False"
    )
    assert (c.large_segment_size, c.max_split_size, c.max_non_split_rounding_size) == (
        32 * MiB, 64 * MiB, 48 * MiB,
    )
    assert c.garbage_collection_threshold == 0.7
    assert c.expandable_segments and c.release_lock_on_cudamalloc
    assert c.per_process_memory_fraction == 0.5
    assert c.pinned_use_cuda_host_register and c.pinned_num_register_threads == 8
    assert c.graph_capture_record_stream_reuse
    assert ("pinned_use_background_threads", "True") in c.host_options
    # [256:1,512:2,>:4]: 256 MiB is interval 8 and fills 0..8 with 1; 512 MiB is interval 9;
    # ">" fills from interval 10 (2.13: last index + 1)
    assert c.roundup_power2_divisions == (1,) * 9 + (2,) + (4,) * 6


def test_roundup_list_forms() -> None:
    c = AllocatorConfig.parse("roundup_power2_divisions:[1:2,4:8,>:16]")
    # key 1 MiB -> interval 0 (first key: fills nothing lower), 4 MiB -> interval 2; interval 1
    # (2..4 MiB) is listed by no key and stays 0; ">" fills 3..15
    assert c.roundup_power2_divisions == (2, 0, 8) + (16,) * 13
    assert AllocatorConfig.parse("roundup_power2_divisions:[64:4]").roundup_power2_divisions == (
        (4,) * 7 + (0,) * 9
    )
    # keys past 32 GiB clamp to the last interval
    assert AllocatorConfig.parse("roundup_power2_divisions:[65536:8]").roundup_power2_divisions[15] == 8
    assert AllocatorConfig.parse("roundup_power2_divisions:2").roundup_power2_divisions == (2,) * 16


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("max_split_size_mb:19", r"max_split_size_mb: got 19, expected an integer >= large_segment_size_mb \(20 MiB\)"),
        ("large_segment_size_mb:32,max_split_size_mb:24", r"max_split_size_mb: got 24.*>= large_segment_size_mb \(32 MiB\)"),
        ("max_non_split_rounding_mb:10", "max_non_split_rounding_mb: got 10"),
        ("large_segment_size_mb:10", r"large_segment_size_mb: got 10, expected an integer > 10"),
        ("garbage_collection_threshold:1.0", r"garbage_collection_threshold: got '1.0', expected a number strictly between 0.0 and 1.0"),
        ("garbage_collection_threshold:0", "garbage_collection_threshold: got '0'"),
        ("garbage_collection_threshold:x", "garbage_collection_threshold: got 'x', expected a number"),
        ("roundup_power2_divisions:3", r"roundup_power2_divisions: got '3', expected 0 \(plain rounding\) or a power of two"),
        ("roundup_power2_divisions:[3:2]", "roundup_power2_divisions: got '3', expected an interval start"),
        ("roundup_power2_divisions:[256:3]", "roundup_power2_divisions: got '3'"),
        ("roundup_power2_divisions:[256:2", "a list closed by"),
        ("expandable_segments:true", r"expandable_segments: got 'true', expected True or False"),
        ("expandable_segments:1", "expandable_segments: got '1'"),
        ("max_split_size_mb:big", "max_split_size_mb: got 'big', expected an integer"),
        ("max_split_size_mb", "expected ':' and a value"),
        ("per_process_memory_fraction:1.5", r"per_process_memory_fraction: got 1.5, expected a number in \[0.0, 1.0\]"),
        ("pinned_num_register_threads:3", "pinned_num_register_threads: got 3, expected a power of two"),
        ("max_split_sizemb:64", "unrecognized allocator option 'max_split_sizemb'.*known options: .*max_split_size_mb"),
        ("backend:cudaMallocAsync", r"backend: got 'cudaMallocAsync'.*cannot simulate"),
        ("backend:foo", "backend: got 'foo', expected native"),
        ("throw_on_cudamalloc_oom:True", "throw_on_cudamalloc_oom: got 'True'.*cannot simulate"),
        ("max_split_size_mb:64:3", "expected ',' after option max_split_size_mb"),
        ("max_split_size_mb:64 max_non_split_rounding_mb:64", "got '64max_non_split_rounding_mb'"),  # spaces are dropped
    ],
)
def test_bad_options_name_the_option_value_and_range(text: str, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        AllocatorConfig.parse(text)


def test_hip_aliases() -> None:
    c = AllocatorConfig.parse("release_lock_on_hipmalloc:True,pinned_use_hip_host_register:True")
    assert c.release_lock_on_cudamalloc and c.pinned_use_cuda_host_register


def test_environment_precedence_of_2_13() -> None:
    both = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    c = AllocatorConfig.from_env(both)
    assert c.expandable_segments and c.max_split_size_mb is None  # CUDA's wins, not merged
    # set but empty still wins (2.13 takes the first variable that is set)
    assert AllocatorConfig.from_env({**both, "PYTORCH_CUDA_ALLOC_CONF": ""}) == AllocatorConfig(settings="")
    assert AllocatorConfig.from_env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}).max_split_size_mb == 64
    assert AllocatorConfig.from_env({"PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:32",
                                     "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}).max_split_size_mb == 32
    with pytest.raises(InvalidInputError, match="PYTORCH_NO_CUDA_MEMORY_CACHING"):
        AllocatorConfig.from_env({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    with pytest.raises(InvalidInputError, match="max_split_size_mb: got 5"):
        AllocatorConfig.from_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:5"})


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.25")
    assert AllocatorConfig.from_env().garbage_collection_threshold == 0.25


def test_settings_round_trip_and_recovery_from_the_string() -> None:
    c = AllocatorConfig.parse("large_segment_size_mb:40,max_split_size_mb:100,roundup_power2_divisions:[2:4,>:2]")
    s = c.to_settings()
    assert s["max_split_size"] == 100 * MiB
    assert s["roundup_power2_divisions"] == {str(1 << k): d for k, d in enumerate(c.roundup_power2_divisions)}
    back = AllocatorConfig.from_settings(s)
    assert back == c  # large_segment_size_mb comes back from the settings string
    assert back.large_segment_size == 40 * MiB
    assert AllocatorConfig.from_settings(None) == AllocatorConfig()
    with pytest.raises(InvalidInputError, match="max_split_size: got 123"):
        AllocatorConfig.from_settings({"max_split_size": 123})
    with pytest.raises(InvalidInputError, match="allocator_settings must be a dict"):
        AllocatorConfig.from_settings([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name",
    ["DeComFL__memory.pickle", "MAGMA27_a2__memory_snapshot.pickle",
     "notHanmin_a2__memory_snapshot_forward.pickle", "SketchKV2__my_snapshot.pickle"],
)
def test_real_snapshots_settings_parse(name: str) -> None:
    path = SHARED / name if (SHARED / name).exists() else DATA / name
    if not path.exists():
        pytest.skip(f"{name} not available")
    snap = load_snapshot(path)
    raw = snap.allocator_settings
    assert raw is not None and raw["max_split_size"] == -1
    c = AllocatorConfig.from_settings(raw)
    assert c == AllocatorConfig(settings=raw["PYTORCH_CUDA_ALLOC_CONF"])  # all defaults
    assert c.max_split_size_mb is None and not c.expandable_segments
    # what the simulator writes back has the same keys and values PyTorch wrote (2.11 set)
    ours = c.to_settings()
    assert {k: ours[k] for k in raw} == raw


def test_allocator_takes_a_string_or_a_config() -> None:
    assert CachingAllocator(config="max_split_size_mb:64").config.max_split_size_mb == 64
    with pytest.raises(InvalidInputError, match="config must be an AllocatorConfig"):
        CachingAllocator(config=64)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="needs the device's capacity"):
        CachingAllocator(memory_fraction=0.5)
    with pytest.raises(InvalidInputError, match=r"memory_fraction must be a number in \[0.0, 1.0\]"):
        CachingAllocator(capacity=1 << 30, memory_fraction=2.0)
    a = CachingAllocator(capacity=1000 * MiB, config="per_process_memory_fraction:0.25")
    assert a.allowed_bytes == 250 * MiB


def test_equality_ignores_how_the_options_were_written() -> None:
    a = AllocatorConfig.parse("max_split_size_mb:64,expandable_segments:True")
    b = AllocatorConfig.parse(" expandable_segments : True , max_split_size_mb : 64 ")
    assert a == b and hash(a) == hash(b) and a.settings != b.settings
    assert a != AllocatorConfig.parse("max_split_size_mb:64")


def test_notes_on_older_snapshots() -> None:
    new = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "graph_capture_record_stream_reuse": False}
    old = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:64",
           "max_split_size": 64 * MiB, "expandable_segments": True}
    assert len(AllocatorConfig.from_settings(new).notes) == 1  # only: what the dict lacks
    notes = AllocatorConfig.from_settings(old).notes
    assert any("torch <= about 2.8" in n for n in notes)
    assert any("also freed expandable blocks" in n for n in notes)
    assert AllocatorConfig.from_settings(old) == AllocatorConfig.parse(old["PYTORCH_CUDA_ALLOC_CONF"])


def test_a_memory_fraction_set_later_ages_the_blocks_cached_before() -> None:
    """``set_memory_fraction`` after blocks were cached (a program calling
    ``torch.cuda.set_per_process_memory_fraction`` mid-run): the collector of
    ``garbage_collection_threshold`` runs from then on, its allowed bytes a fraction of the
    device's whole memory. By hand: a 300 MiB segment cached; allowed 0.5 x 1000 MiB = 500 MiB,
    collected above 0.5 x 500 = 250 MiB; a 400 MiB request finds no block, so the collector
    first frees the cached segment (no retry needed), then a 400 MiB segment is made."""
    a = CachingAllocator(capacity=900 * MiB, config="garbage_collection_threshold:0.5")
    a.free(a.malloc(300 * MiB))
    a.set_memory_fraction(0.5, total=1000 * MiB)
    assert a.allowed_bytes == 500 * MiB
    a.malloc(400 * MiB)
    assert [e[0] for e in a.events[-3:]] == ["segment_free", "segment_alloc", "alloc"]
    assert a.events[-3][2] == 300 * MiB and a.reserved_bytes == 400 * MiB
    assert a.num_alloc_retries == 0
    # without the collector the same request frees the cached segment only on the retry
    b = CachingAllocator(capacity=900 * MiB)
    b.free(b.malloc(300 * MiB))
    b.set_memory_fraction(0.5, total=1000 * MiB)
    b.malloc(400 * MiB)
    assert b.num_alloc_retries == 1 and b.reserved_bytes == 400 * MiB
    with pytest.raises(InvalidInputError, match=r"memory_fraction must be a number in \[0.0, 1.0\], got 1.5"):
        a.set_memory_fraction(1.5)
