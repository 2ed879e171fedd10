"""bitsandbytes' 8-bit Adam for estimates: what it allocates on CUDA, without bitsandbytes.

bitsandbytes' optimizers run CUDA kernels (and do not install on every machine), so an estimate
cannot run them on fake tensors. :class:`Adam8bitStandIn` takes ``bnb.optim.Adam8bit``'s
arguments and allocates the optimizer state bitsandbytes allocates, at the same moment (the
first ``step()``, parameter by parameter), from bitsandbytes' ``Optimizer2State.init_state``
(``bitsandbytes/optim/optimizer.py``):

- a parameter with fewer than ``min_8bit_size`` elements (default 4096) keeps 32-bit state:
  two float32 buffers of its shape (``state1``, ``state2``);
- a larger one: two uint8 buffers of its shape (one byte per element each) and, block-wise
  (the default), two float32 ``absmax`` vectors of ``ceil(n / blocksize)`` elements; the block
  size is 256 in bitsandbytes since its blockwise optimizers moved to 256-element blocks
  (``blocks = n // 256`` in ``init_state``, e.g. commit 51294d9 of
  bitsandbytes-foundation/bitsandbytes) and 2048 before (``n // 2048``, e.g. commit 06029dd,
  and the 2022 releases);
- the quantization maps: ``create_dynamic_map(signed=True)`` and ``(signed=False)``, 256
  float32 values each, made once per optimizer and moved to the parameters' device.

The update is one in-place CUDA kernel per parameter (``optimizer_update_8bit_blockwise`` /
``optimizer_update_32bit``) that allocates nothing, so :meth:`Adam8bitStandIn.step` allocates
nothing after the state. With ``percentile_clipping < 100`` each parameter also keeps a
100-element float32 ``gnorm_vec``. The values are not computed (an estimate has none).

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(64, 128))      # 8192 elements: 8-bit state
    >>> b = torch.nn.Parameter(torch.zeros(64))           # 64 elements: 32-bit state
    >>> w.grad, b.grad = torch.zeros_like(w), torch.zeros_like(b)
    >>> opt = Adam8bitStandIn([w, b])
    >>> opt.step()
    >>> Adam8bitStandIn.state_bytes(w.numel()), Adam8bitStandIn.state_bytes(b.numel())
    (16640, 512)
    >>> list(opt.state[w])
    ['step', 'qmap1', 'qmap2', 'state1', 'state2', 'absmax1', 'absmax2']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Adam8bitStandIn"]

#: Entries of bitsandbytes' dynamic quantization maps (``create_dynamic_map``: 256 values).
QMAP_ENTRIES = 256


class Adam8bitStandIn(torch.optim.Optimizer):
    """A stand-in for ``bitsandbytes.optim.Adam8bit`` (and ``AdamW8bit``) inside estimates: the
    same arguments, the same state tensors on the parameters' device, no arithmetic.

    ``blocksize`` is the absmax block (256 in current bitsandbytes, 2048 in its 2022
    releases); ``min_8bit_size``, ``percentile_clipping`` and ``block_wise`` mean what they
    mean in bitsandbytes. Use it where the real code builds ``bnb.optim.Adam8bit``; the
    module docstring gives the sources.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(5000))
        >>> p.grad = torch.zeros_like(p)
        >>> opt = Adam8bitStandIn([{"params": [p], "weight_decay": 0.01}], lr=1e-3)
        >>> opt.step()
        >>> opt.state[p]["state1"].dtype, tuple(opt.state[p]["absmax1"].shape)
        (torch.uint8, (20,))
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        optim_bits: int = 8,
        args: Any = None,
        min_8bit_size: int = 4096,
        percentile_clipping: int = 100,
        block_wise: bool = True,
        is_paged: bool = False,
        blocksize: int = 256,
    ) -> None:
        if amsgrad:
            raise ValueError("Adam8bit does not support amsgrad (neither does bitsandbytes')")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.optim_bits = optim_bits
        self.min_8bit_size = min_8bit_size
        self.percentile_clipping = percentile_clipping
        self.block_wise = block_wise
        self.blocksize = blocksize
        self._qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def state_bytes(numel: int, blocksize: int = 256, min_8bit_size: int = 4096) -> int:
        """The state bytes of one parameter of ``numel`` elements (the maps not included).

        Example:
            >>> Adam8bitStandIn.state_bytes(1 << 20)            # 2 bytes + 2 absmax per block
            2129920
        """
        if numel < max(min_8bit_size, 4096):
            return 2 * 4 * numel
        return 2 * numel + 2 * 4 * -(-numel // blocksize)

    def _maps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._qmaps:
            self._qmaps[device] = (torch.zeros(QMAP_ENTRIES, device=device),
                                   torch.zeros(QMAP_ENTRIES, device=device))
        return self._qmaps[device]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Allocate each parameter's state at its first step, as bitsandbytes does."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
        return loss

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        n = p.numel()
        state["step"] = 0
        if self.optim_bits == 32 or n < self.min_8bit_size or n < 4096:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32)
        else:
            state["qmap1"], state["qmap2"] = self._maps(p.device)  # moved there first
            state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
            state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
            if self.block_wise:
                blocks = -(-n // self.blocksize)
                state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
            else:
                for k in ("max1", "new_max1", "max2", "new_max2"):
                    state[k] = torch.zeros(1, dtype=torch.float32, device=p.device)
        if self.percentile_clipping < 100:
            state["gnorm_vec"] = torch.zeros(100, device=p.device)
