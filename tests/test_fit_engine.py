"""``torchmem.estimate``'s engine against figures computed by hand from the allocator's rules
(512-byte rounding, 2 MiB small segments, 20 MiB segments for 1-10 MiB requests, sizes of
10 MiB and more rounded up to 2 MiB, cuBLAS workspaces of 8 MiB + 128 KiB before compute
capability 9.0 and 32 MiB from 9.0), its out-of-memory report, the batch search, the fake CUDA
environment and the bad-input errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torchmem
from torchmem.errors import InvalidInputError
from torchmem.fit import GPU, estimate

MiB = 1 << 20
WS_OLD = 8 * MiB + 128 * 1024
WS_HOPPER = 32 * MiB
WS_LT = MiB  # cuBLASLt's own workspace (CUBLASLT_WORKSPACE_SIZE's default, 1024 KiB)
HERE = os.path.abspath(__file__)


def exact_gpu(total: int) -> GPU:
    """A GPU whose whole memory is usable (no context), for hand-computed capacities."""
    return GPU("test", total, (9, 0), "test", context_override=0)


def rows(batch: int):
    """1 MiB per row; the step allocates a second tensor of the same size."""
    x = torch.zeros(batch, 1 << 18)
    return lambda: x * 2


def linear(train: bool):
    def build(batch: int):
        net = torch.nn.Linear(64, 64)
        x = torch.randn(batch, 64)

        def step():
            if train:
                net(x).sum().backward()
            else:
                with torch.no_grad():
                    net(x)
        return step
    return build


def test_workspaces_by_thread_and_generation():
    # inference: one GEMM thread -> one workspace; training adds autograd's thread. The
    # forward's addmm with a bias runs through cuBLASLt, whose own 1 MiB workspace comes on
    # top (forward thread only: the backward's GEMMs are plain mm)
    inf = estimate(linear(False), gpu="RTX-4090", batch_size=16, default_device="cuda")
    assert inf.workspace_bytes == WS_OLD + WS_LT
    # an 8.125 MiB request takes a 20 MiB large segment; the tensors and the 1 MiB cuBLASLt
    # workspace a 2 MiB small one
    assert inf.peak_reserved_bytes == 22 * MiB
    tr = estimate(linear(True), gpu="RTX-4090", batch_size=16, default_device="cuda")
    assert tr.workspace_bytes == 2 * WS_OLD + WS_LT
    assert tr.peak_reserved_bytes == 22 * MiB  # the second workspace fits the 20 MiB segment
    h = estimate(linear(True), gpu="H100-80GB", batch_size=16, default_device="cuda")
    assert h.workspace_bytes == 2 * WS_HOPPER + WS_LT
    assert h.peak_reserved_bytes == (32 + 32 + 2) * MiB  # >= 10 MiB: exact-size segments


def test_clearing_cublas_workspaces_gives_them_back_and_the_next_gemm_makes_its_own():
    # torch._C._cuda_clearCublasWorkspaces() (a CUDA build's; PyTorch's memory tests call it
    # before each reading) frees every workspace to the allocator; the next GEMM of the thread
    # allocates one again, so a step that clears between two forwards reads it twice
    readings: list[int] = []

    def build(batch: int):
        net = torch.nn.Linear(64, 64, bias=False)  # plain mm: the cuBLAS workspace only
        x = torch.randn(batch, 64)

        def step():
            with torch.no_grad():
                net(x)
                readings.append(torch.cuda.memory_allocated())
                torch._C._cuda_clearCublasWorkspaces()
                readings.append(torch.cuda.memory_allocated())
                net(x)
                readings.append(torch.cuda.memory_allocated())
        return step

    e = estimate(build, gpu="H100-80GB", batch_size=16, steps=1, default_device="cuda")
    weights_and_input = 64 * 64 * 4 + 16 * 64 * 4  # each a 512 B multiple already
    assert readings == [weights_and_input + WS_HOPPER, weights_and_input,
                        weights_and_input + WS_HOPPER]
    assert e.workspace_bytes == WS_HOPPER  # the most held at once
    assert not hasattr(torch._C, "_cuda_clearCublasWorkspaces") or torch.cuda.is_available()


def test_exact_small_figures():
    e = estimate(rows, gpu=exact_gpu(1 << 30), batch_size=3, steps=1, default_device="cuda")
    # x: 3 MiB (a 20 MiB segment, split); x*2: 3 MiB from the same segment's remainder
    assert (e.peak_requested_bytes, e.peak_allocated_bytes, e.peak_reserved_bytes) == (
        6 * MiB, 6 * MiB, 20 * MiB)
    assert e.fragmentation_bytes == 14 * MiB
    assert e.headroom_bytes == (1 << 30) - 20 * MiB


def test_out_of_memory_site():
    e = estimate(rows, gpu=exact_gpu(1 << 30), batch_size=600, default_device="cuda")
    assert not e.fits
    o = e.oom
    assert o is not None and o.op == "aten::mul" and o.requested_bytes == 600 * MiB
    assert o.reserved_bytes == 600 * MiB and o.allocated_bytes == 600 * MiB
    assert o.stack[-1] == f"{HERE}:{_line_of(rows, 'x * 2')}:<lambda>"   # the user's line
    assert e.to_dict()["oom"]["op"] == "aten::mul"


def test_oom_module_and_phase():
    def build(batch):
        net = torch.nn.Sequential(torch.nn.Linear(1024, 1 << 16))
        x = torch.zeros(batch, 1024)
        return lambda: net(x).sum().backward()
    e = estimate(build, gpu=exact_gpu(2 << 30), batch_size=4096, default_device="cuda")   # output: 1 GiB
    assert not e.fits and e.oom is not None
    assert e.oom.module == "Sequential.0" and e.oom.phase == "forward"


def test_max_batch_size_search():
    # 2 * (batch MiB rounded up to 2 MiB) <= 1024 MiB  ->  512 (margin=0: the simulation alone;
    # the margin's own boundary is tested in test_fit_params.py)
    e = estimate(rows, gpu=exact_gpu(1 << 30), max_batch_size=True, steps=1, margin=0, default_device="cuda")
    assert e.max_batch_size == 512 and e.batch_size == 512 and e.fits
    assert e.to_dict()["max_batch_size"] == 512
    fits = dict(e.probes)
    assert fits[512] and not fits[513] and not fits[1024]
    assert [b for b, _ in e.probes[:11]] == [1 << i for i in range(11)]
    # an independent run agrees at the boundary
    assert not estimate(rows, gpu=exact_gpu(1 << 30), batch_size=513, steps=1, margin=0, default_device="cuda").fits


def test_max_batch_size_nothing_fits():
    seen = []
    e = estimate(rows, gpu=exact_gpu(1 * MiB), max_batch_size=True, progress=seen.append, default_device="cuda")
    assert e.max_batch_size == 0 and not e.fits and e.oom is not None
    assert seen and "batch 1: does not fit" in seen[0]


def test_fake_cuda_in_user_code():
    seen = {}

    def build(batch):
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        dev = torch.device("cuda")
        net = torch.nn.Linear(256, 256).cuda()
        x = torch.randn(batch, 256).to(dev)
        torch.set_default_device("cuda")
        try:
            y = torch.zeros(batch, 256)
        finally:
            torch.set_default_device(None)

        def step():
            big = net(x) + y
            seen["allocated"] = torch.cuda.memory_allocated()
            del big
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            seen["reserved_after_empty"] = torch.cuda.memory_reserved()
            seen["name"] = torch.cuda.get_device_name()
            seen["total"] = torch.cuda.get_device_properties(0).total_memory
            seen["free"] = torch.cuda.mem_get_info()
            side = torch.cuda.Stream()
            with torch.cuda.stream(side), torch.cuda.device(0):
                seen["pinned"] = torch.ones(4).pin_memory().to("cuda", non_blocking=True).shape
            torch.cuda.current_stream().wait_stream(side)
        return step

    e = estimate(build, gpu="A10G", batch_size=8, steps=1)
    assert e.fits and seen["name"] == "A10G" and seen["allocated"] > 0
    # the workspace block (20 MiB segment, never freed) and the 2 MiB small segment remain
    assert seen["reserved_after_empty"] == 22 * MiB
    a10g = torchmem.fit.gpu("A10G")
    assert seen["total"] == a10g.total_bytes
    assert seen["free"] == (a10g.usable_bytes - 22 * MiB, a10g.total_bytes)
    assert seen["pinned"] == (4,)
    assert not torch.cuda.is_available()  # restored
    assert torch.nn.Module._apply is torch.nn.modules.module.Module.__dict__["_apply"]


def test_environment_restored_after_failure():
    apply = torch.nn.Module._apply

    def build(batch):
        raise RuntimeError("boom")
    with pytest.raises(InvalidInputError):
        estimate(build, gpu="T4", default_device="cuda")
    assert torch.nn.Module._apply is apply and not torch.cuda.is_available()


# -- bad input ---------------------------------------------------------------------------------


def _line_of(fn, text):
    import inspect

    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, s in enumerate(src) if text in s)


def test_build_that_raises_names_the_line():
    def build(batch):
        raise ValueError("no data folder")
    with pytest.raises(InvalidInputError) as ei:
        estimate(build, gpu="T4", batch_size=2, default_device="cuda")
    msg = str(ei.value)
    assert f"{HERE}:{_line_of(build, 'raise ValueError')}" in msg
    assert "build(2) raised ValueError" in msg and "no data folder" in msg


def test_build_returning_no_callable():
    def build(batch):
        return torch.nn.Linear(2, 2).weight
    with pytest.raises(InvalidInputError, match=r"returned FakeTensor, expected a zero-argument"):
        estimate(build, gpu="T4", default_device="cuda")


@pytest.mark.parametrize("snippet,hint", [
    ("x.sum().item()", "reads a tensor's value"),
    ("x.numpy()", "no data"),
    ("torch.nonzero(x)", "shape depends on tensor values"),
    ("x[x > 0]", "shape depends on tensor values"),
])
def test_real_memory_work_is_named(tmp_path, snippet, hint):
    path = tmp_path / "user_train.py"
    path.write_text(textwrap.dedent(f"""
        import torch
        def build(batch):
            x = torch.randn(batch, 4)
            def step():
                y = x * 2
                return {snippet}
            return step
    """))
    from torchmem.cli._objects import load_object

    build = load_object(f"{path}:build", call=False)
    with pytest.raises(InvalidInputError) as ei:
        estimate(build, gpu="T4", strict_values=True, default_device="cuda")   # value reads refused, as before
    msg = str(ei.value)
    assert f"{path}:7" in msg and snippet in msg and hint in msg and "step() raised" in msg


def test_bad_arguments():
    with pytest.raises(InvalidInputError, match="build must be a function"):
        estimate(3, gpu="T4", default_device="cuda")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="steps must be an int >= 1"):
        estimate(rows, gpu="T4", steps=0, default_device="cuda")
    with pytest.raises(InvalidInputError, match="batch_size must be an int >= 1"):
        estimate(rows, gpu="T4", batch_size=0, default_device="cuda")
    with pytest.raises(InvalidInputError, match="not both"):
        estimate(rows, gpu="T4", batch_size=2, max_batch_size=True, default_device="cuda")
    with pytest.raises(InvalidInputError, match="unknown GPU 'H9000'; expected one of: A100-40GB"):
        estimate(rows, gpu="H9000", default_device="cuda")


def test_no_real_memory_is_allocated(tmp_path):
    """4 GiB of parameters plus AdamW (16 GiB in all, estimated) in a process whose peak RSS
    stays far below: nothing was really allocated."""
    code = textwrap.dedent("""
        import resource, torch, torchmem
        def build(batch):
            with torch.device("cuda"):
                net = torch.nn.Sequential(*[torch.nn.Linear(16384, 16384) for _ in range(4)])
            opt = torch.optim.AdamW(net.parameters())
            x = torch.randn(batch, 16384, device="cuda")
            def step():
                net(x).sum().backward(); opt.step(); opt.zero_grad()
            return step
        e = torchmem.estimate(build, gpu="H200", batch_size=2)
        print(e.by_category["parameter"], e.peak_requested_bytes,
              resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    params, peak, rss = map(int, out.stdout.split())
    assert params == 4 * (16384 * 16384 + 16384) * 4
    assert peak >= 4 * params                     # params + grads + two AdamW states
    assert rss < 1536 * MiB < params


def test_top_level_names():
    assert torchmem.estimate is estimate
    assert torchmem.Estimate is torchmem.fit.Estimate


@pytest.mark.parametrize("select", ["gather", "max"])
def test_backward_scatter_into_zeros_is_in_place(select):
    """gather's and max(dim)'s backward make a zero tensor of the input's size and scatter the
    gradient into it in place; under fake tensors (a tensor subclass) PyTorch picks the
    out-of-place form, one more input-sized tensor, which a GPU run never allocates.
    By hand: x (64 MiB) and x.grad (64 MiB, the zeros scattered into) live together; the rest
    (indices, selected values, the gradient of the sum) is under 1 MiB."""
    n = 64 * MiB

    def build(batch):
        x = torch.zeros(256, n // 4 // 256, requires_grad=True)
        idx = torch.zeros(256, 1, dtype=torch.long)

        def step():
            y = x.gather(1, idx) if select == "gather" else x.max(dim=1).values
            y.sum().backward()
            x.grad = None
        return step

    e = estimate(build, gpu="H100-80GB", steps=1, default_device="cuda")
    assert 2 * n <= e.peak_requested_bytes < 2 * n + MiB


def test_oom_in_backward_stops_cleanly():
    """x (300 MiB) and y = x * x (300 MiB, freed after the sum) fit in 700 MiB; backward's two
    products grad * x (300 MiB each, before they are added) do not."""
    def build(batch):
        x = torch.zeros(300 * MiB // 4, requires_grad=True)
        return lambda: (x * x).sum().backward()
    e = estimate(build, gpu=exact_gpu(700 * MiB), batch_size=1, steps=1, default_device="cuda")
    assert not e.fits and e.oom is not None
    assert e.oom.phase == "backward" and e.oom.op == "aten::mul"
    assert e.oom.requested_bytes == 300 * MiB and e.oom.allocated_bytes == 600 * MiB + 1024
    # x and the first product, with the loss and ones_like (y was freed after the sum)
    assert e.peak_requested_bytes == 600 * MiB + 8
    assert not torch.cuda.is_available()


def test_second_step_sees_the_gradients():
    """Step 1: x, y = 2x (freed after the sum), x.grad: 600 MiB at most. Step 2's y finds
    x.grad still there: 900 MiB do not fit in 700."""
    def build(batch):
        x = torch.zeros(300 * MiB // 4, requires_grad=True)
        return lambda: (x * 2).sum().backward()
    one = estimate(build, gpu=exact_gpu(700 * MiB), batch_size=1, steps=1, default_device="cuda")
    assert one.fits and one.peak_requested_bytes == 600 * MiB + 8
    two = estimate(build, gpu=exact_gpu(700 * MiB), batch_size=1, steps=2, default_device="cuda")
    assert not two.fits and two.oom is not None and two.oom.phase == "other"
    assert two.oom.allocated_bytes == 600 * MiB   # x and x.grad; step 1's loss is gone


class _StreamingStyleLoader(torch.utils.data.DataLoader):
    """A loader that overrides ``_get_iterator`` and ``__iter__`` as litdata's
    ``StreamingDataLoader`` does (its own multiprocessing iterator unless ``num_workers`` is 0;
    batches counted as they pass)."""

    def _get_iterator(self):  # type: ignore[no-untyped-def]
        from torch.utils.data.dataloader import (
            _MultiProcessingDataLoaderIter,
            _SingleProcessDataLoaderIter,
        )

        if self.num_workers == 0:
            return _SingleProcessDataLoaderIter(self)
        return _MultiProcessingDataLoaderIter(self)

    def __iter__(self):  # type: ignore[no-untyped-def]
        self.seen = 0
        for batch in super().__iter__():
            self.seen += 1
            yield batch


@pytest.mark.parametrize("kind", ["DataLoader", "streaming"])
def test_dataloader_workers_load_in_the_main_process(kind):
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader if kind == "DataLoader" else _StreamingStyleLoader

    def build(workers):
        def inner(batch):
            net = torch.nn.Linear(16, 4)
            data = loader(TensorDataset(torch.randn(64, 16)), batch_size=batch,
                          shuffle=True, num_workers=workers)

            def step():
                for (x,) in data:
                    net(x).sum().backward()
            return step
        return inner
    figures = {w: estimate(build(w), gpu="T4", batch_size=8, default_device="cuda") for w in (0, 2)}
    assert figures[0].peak_requested_bytes == figures[2].peak_requested_bytes > 64 * 16 * 4
    from torch.utils.data import DataLoader as DL

    assert DL._get_iterator.__name__ == "_get_iterator"   # restored
    assert DL.__iter__.__qualname__ == "DataLoader.__iter__"


def test_a_gpu_size_not_above_its_cuda_context_is_bad_input(capsys):
    from torchmem.cli import main
    from torchmem.fit import CONTEXT_BYTES

    hopper = CONTEXT_BYTES[9]
    with pytest.raises(InvalidInputError, match=r"no larger than its CUDA context \(530\.00 MiB"):
        torchmem.fit.gpu(hopper)
    assert torchmem.fit.gpu(hopper + 2 * MiB).usable_bytes == 2 * MiB
    assert main(["estimate", "x.py:build", "--gpu", "100 MiB"]) == 2
    err = capsys.readouterr().err
    assert "a GPU of 100.00 MiB is no larger than its CUDA context" in err and "Traceback" not in err


def _sgd_build(closure: bool):  # type: ignore[no-untyped-def]
    def build(batch: int):  # type: ignore[no-untyped-def]
        model = torch.nn.Sequential(torch.nn.Linear(512, 4096), torch.nn.GELU(),
                                    torch.nn.Linear(4096, 512)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.zeros(batch, 512, device="cuda")

        def fb() -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        def step() -> None:
            if closure:
                opt.step(fb)  # Lightning's automatic optimization steps this way
            else:
                fb()
                opt.step()

        return step

    return build


def test_a_closure_step_reports_the_categories_and_modules_of_the_plain_step() -> None:
    plain = estimate(_sgd_build(False), "T4", 256, steps=2)
    closure = estimate(_sgd_build(True), "T4", 256, steps=2)
    assert closure.peak_reserved_bytes == plain.peak_reserved_bytes
    assert closure.by_category == plain.by_category
    assert closure.by_module == plain.by_module
    # the GELU's input and output (256 x 4096 float32 each) are activations, not the optimizer's
    assert closure.by_category["activation"] >= 2 * 256 * 4096 * 4
    assert not [m for m in closure.by_module if m.startswith(("Identity", "optimizer"))]


def test_by_module_lists_every_module_and_the_text_report_the_top_15(tmp_path, capsys):
    from torchmem.cli import main

    (tmp_path / "deep.py").write_text(textwrap.dedent("""
        import torch
        net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(30)]).cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            net(torch.zeros(8, 64, device="cuda")).sum().backward(); opt.step(); opt.zero_grad()
    """))
    import json

    assert main(["estimate", "--gpu", "T4", "--json", str(tmp_path / "deep.py")]) == 0
    by_module = json.loads(capsys.readouterr().out)["by_module"]
    layers = [m for m in by_module if m.startswith("Sequential.")]
    assert len(layers) == 30          # before: the JSON held the 15 largest only
    assert list(by_module.values()) == sorted(by_module.values(), reverse=True)
    assert main(["estimate", "--gpu", "T4", str(tmp_path / "deep.py")]) == 0
    out = capsys.readouterr().out
    assert f"... and {len(by_module) - 15} more modules (--json lists all)" in out


def test_multihead_attention_out_proj_weights_are_parameters_in_an_estimate() -> None:
    """The estimate's categories for ``nn.MultiheadAttention`` (its forward reads
    ``out_proj.weight`` without calling ``out_proj``): parameters and gradients are the
    parameters' sizes, 1,052,672 B each, nothing "other" (before: 789,504 B of parameters and
    gradients, 526,336 B "other")."""
    def build(batch: int):  # noqa: ANN202
        m = torch.nn.MultiheadAttention(256, 4, batch_first=True, device="cuda")
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x = torch.randn(batch, 32, 256, device="cuda")

        def step() -> None:
            out, _ = m(x, x, x)
            out.sum().backward()
            opt.step()
            opt.zero_grad()

        return step

    e = torchmem.estimate(build, gpu="T4", batch_size=4)
    want = 4 * (3 * 256 * 256 + 3 * 256 + 256 * 256 + 256)
    assert want == 1_052_672
    assert e.by_category["parameter"] == want and e.by_category["gradient"] == want
    assert e.by_category["other"] == 0


class _EightBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def test_the_split_at_an_out_of_memory_point_is_the_one_at_that_moment() -> None:
    """A run out of memory in its first forward (a 630 MiB card, eight 1024 x 1024 blocks,
    batch 2048): the split at the out-of-memory point counts the parameters of every block,
    the six the forward never reached included (before: 8,396,800 B of parameters and
    25,190,400 B "other"), and the forward's live tensors as what they were then (before: the
    unwinding after the error freed them inside the forward, and they read "temporary")."""
    def build(batch: int):  # noqa: ANN202
        net = _EightBlocks().cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x = torch.randn(batch, 1024, device="cuda")

        def step() -> None:
            net(x).sum().backward()
            opt.step()
            opt.zero_grad()

        return step

    e = torchmem.estimate(build, gpu="630 MiB", batch_size=2048)
    assert not e.fits and e.oom is not None and e.oom.phase == "forward"
    params = sum(p.numel() * 4 for p in _EightBlocks().parameters())
    one = 2048 * 1024 * 4  # an activation of the batch
    cats = e.by_category
    assert cats["parameter"] == params == 33_587_200
    assert cats["other"] == 0 and cats["input"] == one
    # at the peak: the first block's output (freed after its ReLU: a temporary) and the ReLU's
    # output (kept for backward: an activation)
    assert (cats["activation"], cats["temporary"]) == (one, one)
    assert params + 3 * one == e.peak_requested_bytes


def test_hub_kernels_are_off_inside_an_estimate_and_the_environment_is_put_back(monkeypatch):
    # transformers 5.25+ downloads CUDA kernels from the Hub for a model on a GPU (RoPE's
    # kernels-community/rotary), failing offline; under the estimate its own switch is off
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    seen = []

    def build(batch):
        seen.append(os.environ.get("USE_HUB_KERNELS"))
        x = torch.zeros(batch, device="cuda")
        return lambda: seen.append(os.environ.get("USE_HUB_KERNELS")) or x.sum()

    estimate(build, gpu="T4", batch_size=4, steps=1)
    assert seen == ["NO", "NO"] and "USE_HUB_KERNELS" not in os.environ
    monkeypatch.setenv("USE_HUB_KERNELS", "YES")  # the program's own choice is left alone
    estimate(build, gpu="T4", batch_size=4, steps=1)
    assert seen[2:] == ["YES", "YES"] and os.environ["USE_HUB_KERNELS"] == "YES"
