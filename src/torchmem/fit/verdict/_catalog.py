"""The GPU catalog: memory of common CUDA cards, with the source of every figure.

Each :class:`GPU` has

- ``total_bytes``: what ``torch.cuda.get_device_properties(i).total_memory`` (cudaMemGetInfo's
  total) reports on that card. That is less than the marketed size: the driver keeps some memory
  for itself (ECC, page tables). The figure is the "GPU 0 has a total capacity of X GiB" of
  PyTorch's out-of-memory message on that card, quoted from public reports (``source``); it
  varies by a few MiB with the driver, so the GiB figure is taken as printed (2 decimals).
- ``context_bytes``: the CUDA context (driver state, kernel images loaded lazily, the default
  ``CUDA_MODULE_LOADING=LAZY`` since CUDA 12.2) that every process holds outside PyTorch's
  allocator. It depends on the GPU generation, the driver and the libraries loaded; the figures
  are per generation and approximate (see ``CONTEXT_BYTES``).
- ``usable_bytes``: ``total_bytes - context_bytes``, what cudaMalloc can get: the capacity the
  simulated caching allocator is given.
- ``compute_capability``: decides the cuBLAS workspace size and the attention kernels.

Example:
    >>> from torchmem.fit import gpu
    >>> g = gpu("H100-80GB")
    >>> g.name, g.compute_capability, round(g.total_bytes / 2**30, 2)
    ('H100-80GB', (9, 0), 79.11)
    >>> g.usable_bytes == g.total_bytes - g.context_bytes
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from torchmem.errors import InvalidInputError
from torchmem.units import format_bytes, parse_bytes

__all__ = ["GPU", "GPUS", "CONTEXT_BYTES", "gpu"]

_MiB = 1 << 20
_GiB = 1 << 30

#: CUDA context per compute-capability major version (bytes, approximate). What a process holds
#: on the device outside PyTorch's allocator (driver state and the kernels loaded so far) with
#: lazy module loading (CUDA >= 11.7, PyTorch's default): nvidia-smi's per-process figure minus
#: ``torch.cuda.memory_reserved()``. Public figures: "around 300MB" and "around 400MB if CUDA
#: >= 11.7 is used and lazy module loading enabled" (PyTorch maintainer, pytorch/pytorch#107667
#: and #109888), 256 MiB for a bare context on an RTX 3090 (invoke-ai/InvokeAI#9413), ~616 MiB
#: on a datacenter GPU with pinned-memory registration (LMCache/LMCache#4019). The figures
#: below sit in that range by generation (newer GPUs load larger kernel images); they vary with
#: the driver and the libraries used, which is why an estimate shows the context as its own
#: line. Measure yours and pass ``GPU(..., context_override=...)`` for an exact figure.
#: Measured on Hopper (``tests/data/gpu``: H100 80GB HBM3, driver 580.159.04, torch 2.11 with
#: CUDA 13.0): 548,995,072 B (523.6 MiB) right after CUDA starts, close to the 530 MiB below;
#: then 619 to 767 MiB outside the allocator at the end of the 26 reference runs, as cuBLAS and
#: cuDNN kernels load on first use: up to 255 MB more than the context, which the fit margin
#: (1% of peak reserved + 256 MiB, :mod:`torchmem.fit.verdict._margin`) covers.
CONTEXT_BYTES: dict[int, int] = {
    7: 310 * _MiB,  # Volta (V100), Turing (T4: 7.5)
    8: 430 * _MiB,  # Ampere (A100, A10G, RTX 30xx, A6000), Ada (L4, L40S, RTX 40xx: 8.9)
    9: 530 * _MiB,  # Hopper (H100, H200)
    10: 560 * _MiB,  # Blackwell datacenter (B200)
    12: 560 * _MiB,  # Blackwell consumer (RTX 50xx)
}


@dataclass(frozen=True)
class GPU:
    """One GPU model: memory figures, compute capability and where the figures come from.

    Example:
        >>> g = GPU("mine", total_bytes=8 << 30, compute_capability=(8, 6), source="measured")
        >>> g.usable_bytes == (8 << 30) - CONTEXT_BYTES[8]
        True
    """

    name: str
    total_bytes: int
    compute_capability: tuple[int, int]
    source: str
    marketed: str = ""
    context_override: int | None = None
    #: Streaming multiprocessors (NVIDIA's specifications); sizes reductions' staging buffers.
    #: ``None``: a typical card of the compute capability.
    multiprocessors: int | None = None

    @property
    def context_bytes(self) -> int:
        """The CUDA context's bytes for this card (per generation unless overridden).

        Example:
            >>> GPU("x", 1 << 30, (9, 0), "").context_bytes == CONTEXT_BYTES[9]
            True
        """
        if self.context_override is not None:
            return self.context_override
        return CONTEXT_BYTES.get(self.compute_capability[0], CONTEXT_BYTES[9])

    @property
    def usable_bytes(self) -> int:
        """What cudaMalloc can get: ``total_bytes - context_bytes`` (never below 0).

        Example:
            >>> GPU("x", 100, (9, 0), "", context_override=30).usable_bytes
            70
        """
        return max(0, self.total_bytes - self.context_bytes)

    def to_dict(self) -> dict[str, object]:
        """The figures as JSON-able data.

        Example:
            >>> sorted(gpu("T4").to_dict())[:3]
            ['compute_capability', 'context_bytes', 'marketed']
        """
        return {
            "name": self.name,
            "marketed": self.marketed,
            "total_bytes": self.total_bytes,
            "context_bytes": self.context_bytes,
            "usable_bytes": self.usable_bytes,
            "compute_capability": list(self.compute_capability),
            "multiprocessors": self.multiprocessors,
            "source": self.source,
        }


def _g(name: str, gib: float, cc: tuple[int, int], sms: int, marketed: str, source: str) -> GPU:
    """A catalog entry; ``sms``: multiprocessors, from NVIDIA's product specifications."""
    return GPU(name, int(round(gib * _GiB)), cc, source, marketed, multiprocessors=sms)


_OOM = "PyTorch OOM message 'total capacity of {} GiB' in "
#: The catalog, by name. Names are matched case-insensitively, ignoring spaces, '-' and '_'.
GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        _g("A100-40GB", 39.59, (8, 0), 108, "A100 SXM4 40 GB",
           _OOM.format("39.59") + "github.com/raoyongming/DenseCLIP/issues/52"),
        _g("A100-80GB", 79.15, (8, 0), 108, "A100 SXM4/PCIe 80 GB",
           _OOM.format("79.15") + "many public reports (79.14-79.25 across drivers)"),
        _g("H100-80GB", 79.11, (9, 0), 132, "H100 SXM5 80 GB HBM3",
           _OOM.format("79.11") + "github.com/vllm-project/vllm/issues/27508"),
        _g("H100-PCIe", 79.11, (9, 0), 114, "H100 PCIe 80 GB HBM2e",
           "same 80 GB HBM as H100-80GB (" + _OOM.format("79.11") + "vllm-project/vllm#27508)"),
        _g("H200", 139.80, (9, 0), 132, "H200 SXM 141 GB HBM3e",
           "141 GB (NVIDIA H200 datasheet) less the driver's share as on H100: 139.80 GiB"),
        _g("L4", 22.05, (8, 9), 58, "L4 24 GB GDDR6",
           "NVIDIA L4 24 GB (datasheet); cudaMemGetInfo total 22.05 GiB as commonly reported"),
        _g("L40S", 44.53, (8, 9), 142, "L40S 48 GB GDDR6",
           _OOM.format("44.53") + "github.com/Wan-Video/Wan2.1/issues/205"),
        _g("A10G", 22.19, (8, 6), 80, "A10G 24 GB (AWS g5)",
           "A10G 24 GB; cudaMemGetInfo total 22.19 GiB as commonly reported on AWS g5"),
        _g("T4", 14.75, (7, 5), 40, "Tesla T4 16 GB",
           _OOM.format("14.75") + "github.com/hpcaitech/Open-Sora/issues/697"),
        _g("V100-16GB", 15.78, (7, 0), 80, "Tesla V100 SXM2 16 GB HBM2",
           _OOM.format("15.78") + "public reports of V100-SXM2-16GB; nvidia-smi's 16160MiB "
           "total in transformers' docs (model_memory_anatomy.md) is the same 15.78 GiB"),
        _g("V100-32GB", 31.74, (7, 0), 80, "V100 32 GB",
           _OOM.format("31.74") + "public reports of V100-SXM2-32GB"),
        _g("RTX-3090", 23.69, (8, 6), 82, "GeForce RTX 3090 24 GB",
           _OOM.format("23.69-23.70") + "github.com/tatsu-lab/stanford_alpaca/issues/76 (24 GB cards)"),
        _g("RTX-4090", 23.64, (8, 9), 128, "GeForce RTX 4090 24 GB",
           _OOM.format("23.64") + "github.com/ali-vilab/VGen/issues/104"),
        _g("RTX-5090", 31.36, (12, 0), 170, "GeForce RTX 5090 32 GB",
           "GeForce RTX 5090 32 GB; cudaMemGetInfo total 31.36 GiB as commonly reported"),
        _g("A6000", 47.54, (8, 6), 84, "RTX A6000 48 GB",
           _OOM.format("47.54") + "public reports of RTX A6000"),
    )
}


def _norm(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


_ALIASES = {
    "h100": "H100-80GB", "h100sxm": "H100-80GB", "h10080gbhbm3": "H100-80GB",
    "a100": "A100-80GB", "3090": "RTX-3090", "4090": "RTX-4090", "5090": "RTX-5090",
    "rtxa6000": "A6000", "v100": "V100-32GB", "teslat4": "T4",
}
_INDEX = {_norm(n): n for n in GPUS} | {k: v for k, v in _ALIASES.items()}


def _sized(size: int, given: object) -> GPU:
    """A GPU of ``size`` total bytes with a Hopper context; an error when the context leaves
    nothing to PyTorch's allocator."""
    card = GPU(format_bytes(size), size, (9, 0), "size given by the user")
    if card.usable_bytes <= 0:
        raise InvalidInputError(
            f"a GPU of {card.name} is no larger than its CUDA context "
            f"({format_bytes(card.context_bytes)}, outside PyTorch's allocator), got {given!r}; "
            "expected the card's total memory, e.g. '24 GiB' or '80GB'; fix: give the total "
            "(not the free) memory, or a catalog name (torchmem estimate --list-gpus)"
        )
    return card


def gpu(name: str | int | GPU) -> GPU:
    """A catalog GPU by name (case, spaces and dashes ignored), or a byte size as a GPU.

    A size (``"23.5 GiB"``, ``"24GB"``, an int) gives a GPU of that total memory with a Hopper
    context (``compute_capability`` (9, 0)); a size no larger than that context (nothing left
    for PyTorch's allocator) is an error. An unknown name raises
    :class:`~torchmem.errors.InvalidInputError` listing the catalog.

    Example:
        >>> gpu("rtx 4090").name, gpu("a100-80gb").name
        ('RTX-4090', 'A100-80GB')
        >>> gpu("23.5 GiB").total_bytes == int(23.5 * 2**30)
        True
        >>> gpu("400 MiB")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.InvalidInputError: a GPU of 400.00 MiB is no larger than its CUDA context (530.00 MiB, ...
        >>> gpu("B9000")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchmem.errors.InvalidInputError: unknown GPU 'B9000'; expected one of: A100-40GB, ...
    """
    if isinstance(name, GPU):
        return name
    if isinstance(name, str):
        hit = _INDEX.get(_norm(name))
        if hit is not None:
            return GPUS[hit]
        if name.strip()[:1].isdigit():
            try:
                size = parse_bytes(name.strip())
            except InvalidInputError:
                size = -1
            if size > 0:
                return _sized(size, name)
    elif isinstance(name, int) and not isinstance(name, bool) and name > 0:
        return _sized(name, name)
    raise InvalidInputError(
        f"unknown GPU {name!r}; expected one of: {', '.join(GPUS)}, or a memory size such as "
        "'23.5 GiB'; fix: pick a name from the list (see torchmem.fit.GPUS) or give the size"
    )
