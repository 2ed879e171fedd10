"""ToDevice / DeviceSpec / Chain semantics on CPU and meta: forward, adjoint, normal,
composition, split, errors and reprs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchmem
from torchmem.errors import DeviceError, InvalidInputError, TransferError
from torchmem.transfer import (
    Chain,
    DeviceSpec,
    Identity,
    LinearOp,
    ToDevice,
    adjoint_of,
    transfer,
    transfer_async,
    transfer_stream,
)


def matrix_op(M: torch.Tensor, name: str) -> LinearOp:
    return LinearOp(lambda x: M @ x, adjoint=lambda y: M.mT.conj() @ y, name=name)


# ---------------------------------------------------------------- forward / adjoint / normal


def test_exports_resolve_to_transfer_package():
    assert torchmem.ToDevice is ToDevice
    assert torchmem.DeviceSpec is DeviceSpec
    assert torchmem.chunked_transfer.__module__ == "torchmem.transfer.engine"


def test_forward_to_meta_keeps_shape_dtype_and_is_a_module():
    T = ToDevice("cpu", "meta", ioshape=("B", "N"))
    assert isinstance(T, nn.Module)
    x = torch.randn(4, 5, dtype=torch.float64)
    y = T(x)
    assert y.device.type == "meta" and y.shape == x.shape and y.dtype == x.dtype
    # usable inside ordinary modules
    seq = nn.Sequential(nn.Linear(5, 3), ToDevice("cpu", "meta"))
    assert seq(torch.ones(2, 5)).shape == (2, 3)
    assert seq[1].state_dict() == {}


def test_same_device_forward_returns_input_like_tensor_to():
    x = torch.arange(6)
    T = ToDevice("cpu", "cpu")
    assert T(x) is x and T.H(x) is x
    assert x.to("cpu") is x  # the behaviour we mirror


def test_adjoint_swaps_devices_and_is_cached_both_ways():
    T = ToDevice("cpu", "meta", ioshape=("N",))
    A = T.H
    assert A.idevice == torch.device("meta") and A.odevice == torch.device("cpu")
    assert A.ioshape == ("N",)
    assert T.H is A and A.H is T
    assert T.adjoint() is not A  # adjoint() builds a new one; .H caches
    assert T.adjoint().idevice == A.idevice


def test_adjoint_of_shape_only_tensor_raises_naming_both_devices():
    T = ToDevice("cpu", "meta")
    y = T(torch.ones(3))
    with pytest.raises(TransferError) as e:
        T.H(y)
    msg = str(e.value)
    assert "meta" in msg and "cpu" in msg and "no data" in msg


def test_normal_is_identity_operator():
    T = ToDevice("cpu", "meta", ioshape=("N",))
    N = T.normal()
    assert isinstance(N, Identity) and N.ioshape == ("N",)
    x = torch.randn(3)
    assert N(x) is x
    assert T.N is T.N  # cached


def test_wrong_device_raises_transfer_error_naming_both_devices():
    T = ToDevice("cpu", "meta")
    with pytest.raises(TransferError) as e:
        T(torch.ones(2, device="meta"))
    msg = str(e.value)
    assert "expected its input on cpu" in msg and "got a tensor on meta" in msg
    assert "Fix:" in msg
    with pytest.raises(TransferError, match="expected its input on meta"):
        T.H(torch.ones(2))


def test_ioshape_rank_checked_and_non_tensor_rejected():
    T = ToDevice("cpu", "meta", ioshape=("A", "B"))
    with pytest.raises(InvalidInputError, match=r"expected a tensor with 2 dimensions"):
        T(torch.ones(3))
    assert ToDevice("cpu", "meta", ioshape=("...", "B"))(torch.ones(2, 3, 4)).shape == (2, 3, 4)
    with pytest.raises(InvalidInputError, match="expected a torch.Tensor"):
        ToDevice("cpu", "meta")([1, 2])


def test_sparse_input_rejected():
    sp = torch.eye(3).to_sparse()
    with pytest.raises(torchmem.errors.UnsupportedTensorError):
        ToDevice("cpu", "meta")(sp)


def test_absent_accelerator_raises_device_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError, match="not available"):
        transfer(torch.ones(2), "cuda:0")
    T = ToDevice("cpu", "cuda:0")  # constructible for planning and reprs
    assert T.is_gpu2gpu is False and ToDevice("cuda:0", "cuda:1").is_gpu2gpu
    with pytest.raises(DeviceError):
        T(torch.ones(2))


# ---------------------------------------------------------------- composition


def test_composition_adjoint_reverses_order_numerically():
    g = torch.Generator().manual_seed(0)
    M1 = torch.randn(5, 4, generator=g, dtype=torch.float64)
    M2 = torch.randn(3, 5, generator=g, dtype=torch.float64)
    A, B = matrix_op(M2, "M2"), matrix_op(M1, "M1")
    T = ToDevice("cpu", "cpu")
    C = A @ T @ B  # B, then T, then A
    assert isinstance(C, Chain) and C.ops == (B, T, A)
    x = torch.randn(4, generator=g, dtype=torch.float64)
    y = torch.randn(3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(C(x), M2 @ (M1 @ x))
    # (A @ T @ B).H == B.H @ T.H @ A.H, checked against explicit transposes ...
    torch.testing.assert_close(C.H(y), M1.T @ (M2.T @ y))
    assert C.H.ops[0].name == "M2.H" and C.H.ops[-1].name == "M1.H"
    assert C.H.ops[1].idevice == T.odevice
    # ... and by the dot-product test <C x, y> == <x, C^H y>
    torch.testing.assert_close(torch.dot(C(x), y), torch.dot(x, C.H(y)))
    # normal: the transfer's own normal (identity) replaces the round trip
    torch.testing.assert_close(C.N(x), M1.T @ (M2.T @ (M2 @ (M1 @ x))))


def test_composition_adjoint_structure_with_transfers():
    T1 = ToDevice("cpu", "meta")
    f = LinearOp(lambda x: x * 2, adjoint=lambda y: y * 2, name="f")
    C = T1 @ f
    CH = C.H
    assert CH.ops[0] is T1.H and CH.ops[1].name == "f.H"
    assert C.H.H.ops[0].name == "f" and C.H.H.ops[1] is T1
    # (A @ B).H == B.H @ A.H, compared operator by operator
    rhs = f.H @ T1.H
    assert [type(o) for o in CH.ops] == [type(o) for o in rhs.ops]
    assert CH.ops[0] is rhs.ops[0]
    # normal of a chain that ends in a transfer contains no transfer at all
    assert not any(isinstance(o, ToDevice) for o in C.N.ops)
    assert C(torch.ones(3)).device.type == "meta"


def test_chain_with_plain_callables_and_modules():
    T = ToDevice("cpu", "cpu")
    lin = nn.Linear(3, 3)
    c = T @ lin  # module, then transfer
    assert c.ops == (lin, T)
    assert list(c.parameters())[0] is lin.weight  # module elements are registered
    x = torch.randn(2, 3)
    torch.testing.assert_close(c(x), lin(x))

    def double(x):
        return 2 * x

    d = double @ T  # transfer, then the plain function (via __rmatmul__)
    assert d.ops == (T, double)
    torch.testing.assert_close(d(x), 2 * x)
    with pytest.raises(InvalidInputError, match="has no adjoint"):
        _ = d.H
    assert T @ x is x  # operator @ tensor applies it


def test_chain_flattens_and_drops_identity():
    T = ToDevice("cpu", "meta")
    f = LinearOp(abs, adjoint=abs, name="f")
    c = Chain(Chain(f, Identity()), Chain(T))
    assert c.ops == (f, T) and len(c) == 2
    assert Chain().N.__class__ is Identity
    with pytest.raises(InvalidInputError, match="must be callables"):
        Chain(3)


def test_adjoint_of_duck_types_H_and_adjoint_methods():
    class HasH:
        H = "the adjoint"

        def __call__(self, x):
            return x

    class HasAdjoint:
        def __call__(self, x):
            return x

        def adjoint(self):
            return "adj"

    assert adjoint_of(HasH()) == "the adjoint"
    assert adjoint_of(HasAdjoint()) == "adj"


# ---------------------------------------------------------------- split


def test_split_forward_returns_independent_copy():
    T = ToDevice("cpu", "meta", ioshape=("B", "N"))
    _ = T.H  # populate the adjoint cache; the copy must not share it
    S = T.split_forward([slice(0, 2), slice(None)], [slice(0, 2), slice(None)])
    assert S is not T and isinstance(S, ToDevice)
    assert S.ispec is not T.ispec and S.ospec is not T.ospec
    assert S.ispec == T.ispec and S.ospec == T.ospec and S.ioshape == T.ioshape
    assert S.H is not T.H and S.H.H is S
    S.ospec.device = torch.device("cpu")  # mutating the copy leaves the original alone
    assert T.odevice == torch.device("meta")
    x = torch.ones(2, 3)
    assert T(x).device.type == "meta" and S(x) is x
    assert T.split_forward() is not T


def test_split_forward_validates_tiles():
    T = ToDevice("cpu", "meta", ioshape=("N",))
    with pytest.raises(InvalidInputError, match="must match"):
        T.split_forward([slice(0, 2)], [slice(1, 3)])
    with pytest.raises(InvalidInputError, match="one slice per dimension"):
        T.split_forward([slice(0, 2), slice(None)], None)
    with pytest.raises(InvalidInputError, match="sequence of slices"):
        T.split_forward([0], [0])


def test_torchlinops_style_split_with_named_tile():
    T = ToDevice("cpu", "meta", ioshape=("B", "N"))
    S = ToDevice.split(T, {"B": slice(0, 2)})
    assert S is not T and S.ispec == T.ispec and S.ispec is not T.ispec
    with pytest.raises(InvalidInputError, match="not dimensions"):
        ToDevice.split(T, {"K": slice(0, 2)})
    with pytest.raises(InvalidInputError, match="map dimension names"):
        ToDevice.split(T, [slice(0, 2)])


def test_chain_split_forward_splits_each_element():
    T = ToDevice("cpu", "meta")
    f = LinearOp(abs, adjoint=abs, name="f")
    c = Chain(f, T)
    s = c.split_forward([slice(0, 1)], [slice(0, 1)])
    assert s is not c and s.ops[1] is not T and s.ops[1].ospec == T.ospec
    assert s.ops[0] is not f and s.ops[0].name == "f"


# ---------------------------------------------------------------- DeviceSpec and streams


def test_devicespec_canonical_and_validated():
    assert DeviceSpec("cpu").device == torch.device("cpu")
    assert DeviceSpec(DeviceSpec("meta")).device == torch.device("meta")
    assert DeviceSpec("cuda").device == torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    with pytest.raises(DeviceError, match="expected a device"):
        DeviceSpec("nonsense:x")
    with pytest.raises(InvalidInputError, match="must be a torch.Stream"):
        DeviceSpec("cpu", compute_stream=object())
    with pytest.raises(InvalidInputError, match="lives on a cpu device"):
        DeviceSpec("meta", transfer_stream=torch.Stream("cpu"))
    s = torch.Stream("cpu")
    spec = DeviceSpec("cpu", compute_stream=s)
    assert spec.compute_stream is s and spec.copy() == spec and spec.copy() is not spec
    assert spec != DeviceSpec("cpu")
    assert DeviceSpec("cpu").compute() is None and DeviceSpec("cpu").stream_to("meta") is None


def test_no_streams_without_an_accelerator_pair():
    assert transfer_stream("cpu", "meta") is None
    assert transfer_stream("meta", "cpu") is None


# ---------------------------------------------------------------- reprs


def test_repr_shows_devices_and_streams():
    s1, s2 = torch.Stream("cpu"), torch.Stream("cpu")
    T = ToDevice(DeviceSpec("cpu", transfer_stream=s1), DeviceSpec("cpu", compute_stream=s2), ("N",))
    r = repr(T)
    assert r == (
        f"ToDevice(cpu, transfer=cpu#0x{s1.stream_id:x} -> cpu, "
        f"compute=cpu#0x{s2.stream_id:x}, ioshape=('N',))"
    )
    assert repr(T.H).startswith("ToDevice(cpu, compute=")
    assert repr(ToDevice("cpu", "meta")) == "ToDevice(cpu -> meta)"


def test_repr_and_module_walks_never_recurse_through_adjoint_caches():
    T = ToDevice("cpu", "meta")
    C = T @ LinearOp(abs, adjoint=abs, name="f")
    _ = C.H.H, C.N, T.H.H, T.N
    for op in (T, T.H, C, C.H, C.N):
        assert len(repr(op)) < 200
        assert len(list(op.modules())) <= 3
        op.to("cpu")  # nn.Module._apply walks children: must terminate


def test_repr_of_chain_containing_itself():
    c = Chain(ToDevice("cpu", "meta"))
    c.append(c)
    assert repr(c) == "Chain(ToDevice(cpu -> meta) -> <cycle>)"
    assert list(c.modules()) == [c, c.ops[0]]  # the self-reference is not a submodule
    c.to("cpu")
    with pytest.raises(InvalidInputError, match="contains itself"):
        _ = c.H
    with pytest.raises(InvalidInputError, match="contains itself"):
        c.split_forward()
    # a chain appended to another chain is flattened, so no mutual cycle can form that way
    a, b = Chain(abs), Chain(abs)
    a.append(b)
    b.append(a)
    assert repr(a) == "Chain(abs -> abs)" and repr(b) == "Chain(abs -> abs -> abs)"


def test_repr_of_deep_and_long_chains_is_bounded():
    long = Chain(*[ToDevice("cpu", "cpu") for _ in range(5000)])
    r = repr(long)
    assert r.endswith("... (4988 more))") and r.count("ToDevice") == 12
    x = torch.ones(2)
    assert long(x) is x
    assert len(long.H) == 5000
    op = LinearOp(abs, adjoint=abs, name="leaf")
    for _ in range(3000):  # nested wrappers: repr must not walk 3000 levels
        inner = op
        op = LinearOp(inner, adjoint=inner, name=None)
    assert repr(op) == "leaf"
    nested = Chain(abs)
    for _ in range(50):
        nested = Chain(LinearOp(nested, adjoint=nested, name=None), abs)
    assert len(repr(nested)) < 400


# ---------------------------------------------------------------- functional transfers


def test_todevice_reports_results_to_the_real_ledger():
    import gc

    led = torchmem.Ledger()
    T = ToDevice("cpu", "meta", ledger=led)
    y = T(torch.ones(10, 10))
    assert led.allocated("meta")[0] == 400 == y.untyped_storage().nbytes()
    assert T.H.ledger is led and T.split_forward().ledger is led
    del y
    gc.collect()
    assert led.allocated("meta")[0] == 0 and led.freed("meta")[0] == 400


def test_transfer_functions_on_cpu_and_meta():
    x = torch.randn(3, 4)
    assert transfer(x, "cpu") is x
    y = transfer(x, "meta")
    assert y.is_meta and y.shape == x.shape
    p = transfer_async(x, "meta")
    assert p.ready() and p.wait().is_meta
    with pytest.raises(TransferError, match="expected its input on meta"):
        transfer(x, "cpu", source="meta")
    with pytest.raises(TransferError, match="no data"):
        transfer(y, "cpu")
