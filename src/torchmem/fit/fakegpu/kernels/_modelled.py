"""The table of CUDA behaviours an estimate models (:data:`MODELLED`): each case, what differs
on CUDA, and how the estimate follows it (the docs print it).
"""

from __future__ import annotations

MODELLED: list[tuple[str, str, str]] = [
    (
        "autocast (fp16/bf16)",
        "torch.autocast('cuda') switches itself off on a CPU-only build; CUDA's op lists differ "
        "from CPU's (exp, pow, rsqrt, sum, softmax, norms and losses run in fp32 on CUDA)",
        "Python kernels on the AutocastCPU key apply CUDA's lists (lower precision, fp32, "
        "fp32-with-dtype, promote, banned) while CUDA autocast is on; casts of leaf fp32 "
        "parameters are cached for the autocast region as CUDA's cast cache does; 'cpu' and "
        "'cuda' name one autocast state (the fake tensors' device is cpu), so activation "
        "checkpointing recomputes under the autocast state it captured, as on CUDA",
    ),
    (
        "scaled_dot_product_attention",
        "CUDA runs cuDNN, flash or memory-efficient kernels that keep no S x S matrix",
        "the backend is chosen with CUDA's rules for the target compute capability (cuDNN "
        "attention first on sm90/sm10x, as PyTorch's CUDA 13 wheels do with cuDNN >= 9.15.1, "
        "unless TORCH_CUDNN_SDPA_DEPRIORITIZED is set; then flash, memory-efficient, math) "
        "and the CUDA "
        "op is called (its fake kernel allocates output + logsumexp (+ RNG state); the flash "
        "backward's scratch (softmax_d, fp32 dq accumulator, contiguous grad_out) comes from "
        "transients(), and so do the memory-efficient backward's delta and fp32 dQ (dK/dV) "
        "workspace and its forward's fp32 output accumulator (head dims > 128 in half "
        "precision); its forward's philox seed and offset stay on the host; head dims not "
        "a multiple of 8 are padded for flash; boolean masks are converted to additive masks, "
        "padded to a multiple of 16 for the memory-efficient kernel); math fallback otherwise. "
        "cuDNN's own workspace (sized by its heuristics at run time) is not modelled",
    ),
    (
        "accelerate's mixed precision (Accelerator(mixed_precision=\"fp16\"), the Trainer's fp16)",
        "on a CUDA device accelerate autocasts the forward in float16 and scales the loss "
        "with a GradScaler; on a CPU device it ignores fp16 and trains in float32",
        "accelerate's default device is CUDA and its per-process state the estimate's own "
        "(torchmem.fit.fakegpu._accelerate), so it autocasts (CUDA's policy, above) with a gradient "
        "scaler as on the GPU",
    ),
    (
        "optimizers (Adam, AdamW, SGD, ...)",
        "on CUDA the default implementation is foreach, whose _foreach_* ops allocate whole "
        "intermediate lists; the fake CPU run would take the per-parameter loop",
        "parameters on the fake device count as foreach-capable, so the optimizer takes the "
        "foreach path; fused=True runs the fused kernel (in place, like CUDA)",
    ),
    (
        "dropout (nn.Dropout, F.dropout)",
        "CUDA runs the fused native_dropout kernel, which saves a bool mask (1 B per element); "
        "the CPU path saves a noise tensor of the input's dtype (4 B per element in fp32)",
        "aten::dropout takes CUDA's path (native_dropout) in training for 0 < p < 1; the "
        "in-place dropout_ keeps its noise tensor on CUDA too",
    ),
    (
        "multi-block reductions",
        "CUDA reductions that split one output over several blocks allocate a staging buffer "
        "and a semaphore after the output and free them before returning",
        "CudaEmulation.transients(): sizes from Reduce.cuh's launch configuration",
    ),
    (
        "cuBLAS / cuBLASLt workspace",
        "one workspace per (thread, stream) becomes an allocator block at its first GEMM; "
        "cuBLASLt GEMMs (addmm with a bias, as nn.Linear runs) allocate a second one of their "
        "own unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=1",
        "CudaEmulation.gemm_workspace_bytes: CUBLAS_WORKSPACE_CONFIG's default for the "
        "compute capability (8,519,680 B before Hopper, 32 MiB from 9.0); "
        "CudaEmulation.lt_workspace_bytes (CUBLASLT_WORKSPACE_SIZE, 1 MiB by default) at the "
        "first cuBLASLt GEMM of each thread (CudaEmulation.uses_cublaslt)",
    ),
    (
        "cuDNN convolution workspace (nn.Conv1d/2d/3d)",
        "cuDNN's tensor-core engines work in NHWC; on NCHW tensors they transpose the "
        "input, output and filter through a workspace the caching allocator hands out after "
        "the output and takes back when the call returns (the backward: input gradient, then "
        "weight gradient)",
        "CudaEmulation.transients(): input + output + filter bytes for each cuDNN call whose "
        "channels per group are a multiple of 4 (TF32, fp32 with "
        "torch.backends.cudnn.allow_tf32, from sm80) or 8 (fp16/bf16); none for channels-last "
        "tensors. The weight gradient's split-K partial filters and engines that skip a "
        "transpose come from cuDNN's closed heuristics and are not modelled",
    ),
    (
        "the math attention's softmax (aten::_safe_softmax)",
        "a composite kernel: on CUDA it allocates the softmax, then a bool -inf mask (1 B per "
        "element), its all-masked rows (1 B per row) and a zero scalar, and writes the result "
        "into the softmax's storage; a fake run calls its meta kernel, which allocates only "
        "the output",
        "CudaEmulation.transients(): the mask, the rows and the scalar after the output, freed "
        "in reverse order when the call returns (allocation sizes as on the recorded H100's "
        "hf_trainer run)",
    ),
    (
        "cuDNN RNN workspace and reserve (nn.LSTM/GRU/RNN)",
        "cuDNN allocates a workspace and a reserve space whose size comes from cuDNN at run time",
        "not modelled: the estimate shows the CPU implementation's memory for these modules",
    ),
]
