"""What would make it fit: the memory levers, applied to the user's own model and optimizer.

- ``_choices``: the levers a user can ask for (:data:`LEVERS`), how two combine, which exclude
  each other;
- ``_levers`` (:class:`LeverRun`): a lever applied at run time to the model and optimizer as the
  step makes them (checkpointing, autocast, accumulation, 8-bit or Adafactor optimizers, LoRA,
  FSDP, offload), each as the same change written by hand would;
- ``_whatif``: the table (:func:`what_if`: one run per lever, the costs, the best combination
  that fits) and its printout;
- ``_pool``: independent runs side by side in forked workers.

The runs themselves are given to it (a ``run(levers, batch, option)`` function from
:mod:`torchmem.fit.search` or :mod:`torchmem.fit.targets`): it imports the fake GPU and
:mod:`torchmem.fit.verdict` only.

Example:
    >>> from torchmem.fit.levers._choices import check_levers
    >>> [lv.name for lv in check_levers(["activation_checkpointing", "bf16_autocast"])]
    ['activation_checkpointing', 'bf16_autocast']
"""
