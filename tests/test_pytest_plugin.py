"""torchmem's pytest plugin, driven through pytest's own ``pytester``.

Ground truth: the byte counts are hand-computed from the tensors' shapes (float32: 4 bytes per
element), the estimate's verdict is :func:`torchmem.fit.estimate` called directly.
"""

from __future__ import annotations

import os

import pytest
import torch._dynamo  # noqa: F401 - imported once here: inline pytester runs must not re-import it

import torchmem

# Inline pytester runs drop the modules they imported from sys.modules afterwards; imported
# here first, the plugin's lazy imports stay the same objects for the tests that run later.
import torchmem.capture.tracker  # noqa: F401,E402,I001
import torchmem.cli.estimate  # noqa: F401,E402
import torchmem.fit  # noqa: F401,E402
import torchmem.io  # noqa: F401,E402

pytest_plugins = ["pytester"]



def _plugin_args() -> tuple[str, ...]:
    """``-p torchmem.pytest_plugin`` unless the installed entry point already loads it (pytest
    refuses one module registered under two names)."""
    from importlib.metadata import entry_points

    installed = any(ep.value == "torchmem.pytest_plugin" for ep in entry_points(group="pytest11"))
    return () if installed else ("-p", "torchmem.pytest_plugin")


PLUGIN = _plugin_args()
MiB = 1 << 20


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(*PLUGIN, "-p", "no:cacheprovider", *args)


def test_entry_point_registers_the_plugin() -> None:
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    assert meta["project"]["entry-points"]["pytest11"] == {"torchmem": "torchmem.pytest_plugin"}


def test_limit_memory_passes_and_fails_with_the_peak_and_the_top_allocations(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import pytest, torch

        def make(n):
            return torch.zeros(n)

        @pytest.mark.limit_memory("5 MiB")
        def test_small():
            a = torch.zeros(1 << 20)          # 4 MiB
            del a
            b = torch.zeros(1 << 20)          # 4 MiB again: the peak stays 4 MiB

        @pytest.mark.limit_memory("5 MiB", device="cpu")
        def test_big():
            a = make(1 << 20)                 # 4 MiB
            b = torch.ones(1 << 19)           # 2 MiB -> peak 6 MiB
            del a, b
        """
    )
    result = run(pytester, "-v")
    result.assert_outcomes(passed=1, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*test_small PASSED*",
        "*test used too much tensor memory on cpu: peak 6.00 MiB (6291456 bytes) > limit "
        "5.00 MiB (5242880 bytes)*",
        "*largest allocations live at the peak:*",
        "*4.00 MiB*1*aten::zeros / - / test_limit_memory_passes_and_fails*.py:*make*",
        "*2.00 MiB*1*aten::ones / - / test_limit_memory_passes_and_fails*.py:*test_big*",
    ])


def test_module_attribution_and_decimal_units(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.limit_memory("28 MB")           # decimal: 28_000_000 bytes
        def test_net():
            net = torch.nn.Linear(1000, 1000)        # 4_000_000 + 4_000 bytes of parameters
            x = torch.randn(2000, 1000)              # 8_000_000
            y = net(x)                               # 8_000_000
            z = net(y)                               # 8_000_000 -> 28_004_000 > 28 MB
        """
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*peak 26.71 MiB (28004000 bytes) > limit 26.70 MiB (28000000 bytes)*",
        "*7.63 MiB      1  aten::addmm / Linear / *.py:7:test_net",   # y = net(x)
        "*7.63 MiB      1  aten::addmm / Linear / *.py:8:test_net",   # z = net(y)
        "*7.63 MiB      1  aten::randn / - / *.py:6:test_net",
        "*3.82 MiB      2  aten::empty / Linear / *.py:5:test_net",   # weight and bias
    ])


def test_limit_leaks_lists_what_leaked_and_where(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest, torch

        CACHE = []

        @pytest.mark.limit_leaks("1 MiB")
        def test_clean():
            a = torch.zeros(1 << 20)                 # freed when the test returns

        @pytest.mark.limit_leaks("1 MiB")
        def test_cycle_is_collected():
            class Node:
                pass
            n = Node(); n.self = n; n.t = torch.zeros(1 << 20)   # freed only by gc

        @pytest.mark.limit_leaks("1 MiB")
        def test_leaky():
            CACHE.append(torch.zeros(1 << 19))       # 2 MiB kept by the module
            CACHE.append(torch.ones(1000))           # 4000 bytes
        """
    )
    result = run(pytester, "-v")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*test_clean PASSED*",
        "*test_cycle_is_collected PASSED*",
        "*test leaked 2.00 MiB (2101152 bytes) of tensor memory > limit 1.00 MiB (1048576 bytes): "
        "2 storage(s) allocated in the test are alive after it (after gc)*",
        "*2.00 MiB  aten::zeros / - / test_limit_leaks_lists*.py:*test_leaky  [[]cpu[]]*",
        "*held by: test_limit_leaks_lists* global CACHE (list) [[]0[]] -> Tensor float32[[]524288[]] 2.00 MiB*",
        "*3.91 KiB  aten::ones / - / test_limit_leaks_lists*.py:*test_leaky  [[]cpu[]]*",
        "*held by: test_limit_leaks_lists* global CACHE (list) [[]1[]] -> Tensor float32[[]1000[]] 3.91 KiB*",
    ])


def test_fixtures_are_not_tracked_parametrize_and_x(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.fixture
        def weights():
            return torch.zeros(4 << 20)              # 16 MiB, made outside the test body

        @pytest.mark.limit_memory("1 MiB")
        def test_uses_fixture(weights):
            assert weights.sum().item() == 0         # a 4-byte result only

        @pytest.mark.parametrize("n", [1 << 16, 1 << 18, 1 << 20])
        @pytest.mark.limit_memory("1 MiB")
        def test_param(n):
            x = torch.zeros(n)                       # 256 KiB, 1 MiB, 4 MiB

        def test_after():
            pass
        """
    )
    result = run(pytester, "-v")
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines([
        "*test_uses_fixture PASSED*",
        "*test_param?65536? PASSED*",
        "*test_param?262144? PASSED*",
        "*test_param?1048576? FAILED*",
        "*test_after PASSED*",
        "*peak 4.00 MiB (4194304 bytes) > limit 1.00 MiB (1048576 bytes)*",
    ])
    result = run(pytester, "-x")
    result.assert_outcomes(passed=3, failed=1)  # stopped at the first failure
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_the_test_own_failure_wins_over_the_limit(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.limit_memory("1 KiB")
        def test_boom():
            x = torch.zeros(1 << 20)
            raise ValueError("the test's own error")
        """
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ValueError: the test's own error*"])
    result.stdout.no_fnmatch_line("*too much tensor memory*")


@pytest.mark.parametrize(
    "marker, expected",
    [
        ('limit_memory("lots")', "*@pytest.mark.limit_memory: could not parse 'lots' as a size*"),
        ('limit_leaks("lots")', "*@pytest.mark.limit_leaks: could not parse 'lots' as a size*"),
        ('limit_memory("1 MiB", device="tpu")', "*unknown device 'tpu'*"),
        ('limit_memory("1 MiB", metric="allocated")',
         "*metric='allocated' reads the CUDA allocator's peak, but device is 'cpu'*"),
        ('limit_memory("1 MiB", metric="peak", device="cuda")', "*metric must be one of*"),
        ("limit_memory()", "*limit_memory needs a limit*"),
        ('limit_memory("1 MiB", devcie="cpu")', "*unknown keyword(s) devcie*"),
        ('fits_on("T4", batch_size=0)', "*batch_size must be an int >= 1, got 0*"),
    ],
)
def test_bad_marker_arguments_are_collection_errors(
    pytester: pytest.Pytester, marker: str, expected: str
) -> None:
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.{marker}
        def test_x():
            pass

        def test_fine():
            pass
        """
    )
    result = run(pytester)
    assert result.ret == pytest.ExitCode.INTERRUPTED  # errors during collection
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*ERROR collecting*", "*torchmem: bad marker arguments*", expected])
    result.stdout.no_fnmatch_line("*Traceback*")


def test_zero_overhead_without_markers(pytester: pytest.Pytester) -> None:
    # Unmarked tests: the plugin does not even import torch (so no tracker can have started).
    pytester.makepyfile(
        test_plain="""
        import sys
        import pytest

        def test_plain():
            assert "torch" not in sys.modules

        @pytest.mark.parametrize("i", [1, 2])
        def test_param(i):
            assert "torch" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider", "test_plain.py")
    result.assert_outcomes(passed=3)


def test_the_tracker_starts_only_for_marked_tests(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import torchmem.capture.tracker._tracker as t

        STARTED = []
        _enter = t.Tracker.__enter__

        def counting_enter(self):
            STARTED.append(1)
            return _enter(self)

        t.Tracker.__enter__ = counting_enter
        """
    )
    pytester.makepyfile(
        """
        import pytest
        import conftest

        def test_plain():
            assert conftest.STARTED == []

        @pytest.mark.parametrize("i", [1, 2])
        def test_param(i):
            assert conftest.STARTED == []

        @pytest.mark.limit_memory("1 GiB")
        def test_marked():
            assert conftest.STARTED == [1]           # started for the marked test only

        def test_later():
            assert conftest.STARTED == [1]
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)


def test_torchmem_option_lists_the_highest_peaks_and_keeps_traces(
    pytester: pytest.Pytester, tmp_path: os.PathLike[str]
) -> None:
    pytester.makepyfile(
        """
        import torch

        def test_a():
            x = torch.zeros(1 << 18)                 # 1 MiB

        def test_b():
            x = torch.zeros(1 << 20)                 # 4 MiB

        def test_c():
            x = torch.zeros(1 << 19)                 # 2 MiB

        def test_none():
            pass
        """
    )
    out = os.path.join(str(tmp_path), "traces")
    result = run(pytester, "--torchmem", "--torchmem-top", "2", "--torchmem-dir", out)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines([
        "*torchmem: highest tensor-memory peaks*",
        "*4.00 MiB  cpu*test_torchmem_option_lists*.py::test_b",
        "*2.00 MiB  cpu*test_torchmem_option_lists*.py::test_c",
        f"traces in {out}*",
    ])
    result.stdout.no_fnmatch_line("*::test_a")
    files = sorted(os.listdir(out))
    assert len(files) == 4 and all(f.endswith(".tmtrace") for f in files)
    b = [f for f in files if f.endswith("test_b.tmtrace")]
    assert torchmem.load_trace(os.path.join(out, b[0])).peak() == {"cpu": 4 << 20}


def _build_source(width: int) -> str:
    return f"""
        def build(batch):
            net = torch.nn.Linear({width}, {width})
            opt = torch.optim.Adam(net.parameters())
            x = torch.randn(batch, {width}, device="cuda")
            def step():
                net.to("cuda")(x).sum().backward(); opt.step(); opt.zero_grad()
            return step
    """


def test_fits_on_runs_the_estimate_on_cpu(pytester: pytest.Pytester) -> None:
    import textwrap

    import torch

    ns: dict[str, object] = {"torch": torch}
    exec(textwrap.dedent(_build_source(1024)), ns)
    # ground truth: the estimator called directly agrees with the verdicts below
    assert torchmem.estimate(ns["build"], gpu="T4", batch_size=8).fits  # type: ignore[arg-type]
    exec(textwrap.dedent(_build_source(32768)), ns)
    big = torchmem.estimate(ns["build"], gpu="T4", batch_size=8)  # type: ignore[arg-type]
    assert not big.fits and big.oom is not None
    pytester.makepyfile(
        "import pytest, torch\n"
        + textwrap.dedent(_build_source(1024))
        + textwrap.dedent(
            """
            @pytest.mark.fits_on("T4", batch_size=8)
            def test_small_fits():
                return build

            @pytest.fixture
            def width():
                return 1024

            @pytest.mark.fits_on("T4", batch_size=8)
            def test_yields(width):
                yield build
                print("after the yield: teardown ran")

            def build_big(batch):                    # 32768^2 floats: 4 GiB of weights,
                net = torch.nn.Linear(32768, 32768)  # + 4 GiB of gradients + 8 GiB of Adam
                opt = torch.optim.Adam(net.parameters())
                x = torch.randn(batch, 32768, device="cuda")
                def step():
                    net.to("cuda")(x).sum().backward(); opt.step(); opt.zero_grad()
                return step

            @pytest.mark.fits_on("T4", batch_size=8)
            def test_too_big():
                return build_big

            @pytest.mark.fits_on("T4", batch_size=8)
            def test_no_build():
                return 42
            """
        )
    )
    result = run(pytester, "-v", "-s")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines([
        "*test_small_fits PASSED*",
        "*after the yield: teardown ran*",
        "*torchmem: the training step does not fit on T4 at batch size 8*",
        "T4, batch 8: DOES NOT FIT*",
        "*out of memory at: *",
        "    *test_fits_on_runs_the_estimate_on_cpu.py:*:step",  # the user's frame stays
        "*expects the test to return (or yield) a build(batch_size) function*returned int: 42*",
    ])
    result.stdout.no_fnmatch_line("*/pluggy/*")  # pytest's own frames are dropped


@pytest.mark.cuda
def test_cuda_allocator_peak_after_warm_up(pytester: pytest.Pytester) -> None:
    # The first matmul on a device allocates cuBLAS's workspace (MiBs): the plugin warms it up
    # before the test, so a 256x256 float matmul (256 KiB out) stays under 1 MiB. The 64 MiB
    # tensor is over 48 MiB by the tracker and by the allocator's reserved peak: no block the
    # warm-up left cached can hold it, so the allocator must reserve a new 64 MiB segment. (A
    # 4 MiB tensor did not grow reserved on an H100: the warm-up's 20 MiB segment, made for a
    # request between 1 and 10 MiB, had room for it; reserved counts only what the test made
    # the allocator take from the device.)
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.limit_memory("1 MiB", device="cuda", metric="allocated")
        def test_matmul_first_use_is_not_counted():
            a = torch.ones(256, 256, device="cuda")
            (a @ a).sum().item()

        @pytest.mark.limit_memory("48 MiB", device="cuda", metric="reserved")
        def test_over():
            x = torch.zeros(16 << 20, device="cuda")
            torch.cuda.synchronize()
        """
    )
    result = run(pytester, "-v")
    result.assert_outcomes(passed=1, failed=1)
    dev = f"cuda:{__import__('torch').cuda.current_device()}"
    result.stdout.fnmatch_lines([
        f"*test used too much tensor memory on {dev}: peak 64.00 MiB (67108864 bytes)*",
        f"*the CUDA allocator's reserved peak on {dev} was *",
    ])


def test_warns_when_pytest_memray_acts_on_the_same_markers(pytester: pytest.Pytester) -> None:
    # pytest-memray also reads limit_memory/limit_leaks (host memory, other units); a stand-in
    # module of that name is enough for the check, which looks at the loaded plugins' names.
    pytester.mkpydir("pytest_memray")
    pytester.makepyfile(**{"pytest_memray/plugin": "def pytest_configure(config):\n    pass\n"})
    pytester.makepyfile("def test_x():\n    pass\n")
    pytester.syspathinsert()
    result = run(pytester, "-p", "pytest_memray.plugin")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*torchmem: pytest-memray is also loaded*-p no:memray*"])
    result = run(pytester)
    result.stdout.no_fnmatch_line("*pytest-memray is also loaded*")


def test_torchmem_report_under_xdist_workers(pytester: pytest.Pytester) -> None:
    # The peaks are measured in the workers and travel to the controller with the reports.
    pytest.importorskip("xdist")
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.parametrize("n", [1 << 17, 1 << 18, 1 << 20])
        def test_p(n):
            x = torch.zeros(n)                       # 512 KiB, 1 MiB, 4 MiB
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider", "-n", "2",
                                           "--torchmem", "--torchmem-top", "2")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([
        "*torchmem: highest tensor-memory peaks*",
        "*4.00 MiB  cpu*::test_p?1048576?",
        "*1.00 MiB  cpu*::test_p?262144?",
    ])
