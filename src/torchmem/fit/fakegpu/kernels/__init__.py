"""CUDA behaviour on a CPU-only build: what a fake run must do differently to allocate like CUDA.

An estimate runs the user's step on fake tensors on a CPU-only PyTorch build (fake *CPU* tensors
stand in for the GPU's memory: on such a build fake CUDA tensors abort the process in autograd,
whose engine asks the missing CUDA runtime for streams). Where a CUDA kernel allocates
differently from what the CPU/fake path would, :class:`CudaEmulation` makes the run follow CUDA:

- **autocast**: ``torch.autocast("cuda", dtype=...)`` in user code applies *CUDA's* autocast
  policy (the op lists of ``aten/src/ATen/autocast_mode.cpp``, CUDA section) to the fake tensors,
  with autocast's weight-cast cache. A CPU-only build compiles the AutocastCUDA kernels in, but
  they only see tensors whose device is CUDA; this module registers Python kernels for the
  *AutocastCPU* key that apply the CUDA policy whenever CUDA autocast is on, and neutralises the
  CPU-only autocast entries (CPU's policy is a different list).
- **scaled_dot_product_attention** picks its backend with CUDA's rules (``sdp_utils.cpp``: cuDNN
  first on sm90/sm10x, then flash, memory-efficient, math, from dtype, head dim, mask,
  dropout, compute capability)
  and calls the CUDA op, whose fake (meta) kernel allocates what the CUDA kernel does: output
  plus logsumexp, no S x S matrix.
- **accelerate** (and transformers' ``Trainer``, which runs on it) sees the CUDA device, so its
  ``fp16`` mixed precision autocasts with a gradient scaler (:mod:`torchmem.fit.fakegpu._accelerate`).
- **optimizers** default to the ``foreach`` implementation as on CUDA (``_foreach_*`` ops
  allocate whole intermediate lists; the CPU default is the per-parameter loop).
- :meth:`CudaEmulation.transients` gives the scratch buffers a CUDA kernel allocates after its
  outputs and frees before it returns (multi-block reduction staging), and
  :attr:`CudaEmulation.gemm_workspace_bytes` the cuBLAS workspace each (thread, stream) pins.

:data:`MODELLED` lists each case, what differs on CUDA and how it is modelled, for the docs.

One module per kernel family, each porting its rules from its PyTorch source:

- ``_autocast``: the policy's op lists (``autocast_mode.cpp``) and the weight-cast cache;
- ``_sdpa``: the attention backend choice (``sdp_utils.cpp``) and ``attention.cpp``'s mask handling;
- ``_attention_scratch``: the attention kernels' scratch (``flash_api.cpp``, ``attention.cu``);
- ``_reduce``: the reductions' launch configuration and staging (``Reduce.cuh``);
- ``_conv``: cuDNN's NHWC convolution workspaces;
- ``_cublas``: the cuBLAS / cuBLASLt workspaces (``CublasHandlePool.cpp``);
- ``_modelled``: the table of every case (:data:`MODELLED`), for the docs;
- ``_emulation``: :class:`CudaEmulation`, which installs them around a fake run and answers
  the engine's questions (workspaces, transients, host outputs).

Example:
    >>> import torch
    >>> from torch._subclasses import FakeTensorMode
    >>> with FakeTensorMode(), CudaEmulation((8, 0)):
    ...     x, w = torch.empty(4, 8), torch.empty(16, 8, requires_grad=True)
    ...     with torch.autocast("cuda", dtype=torch.bfloat16):
    ...         y = x @ w.T                   # CUDA: matmul runs in bf16
    ...         z = torch.exp(y)              # CUDA: exp runs in fp32
    >>> y.dtype, z.dtype
    (torch.bfloat16, torch.float32)
"""

from torchmem.fit.fakegpu.kernels._common import Transient
from torchmem.fit.fakegpu.kernels._emulation import CudaEmulation
from torchmem.fit.fakegpu.kernels._modelled import MODELLED

__all__ = ["MODELLED", "CudaEmulation", "Transient"]
