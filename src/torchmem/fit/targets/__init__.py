"""The programs an estimate runs, each turned into a build function for :mod:`torchmem.fit.search`.

- ``_script`` (:func:`~torchmem.fit.estimate_script`): an unmodified script or module
  (``python train.py args``, ``python -m``), run whole as the step, stopped after a few optimizer
  steps or at its time limit; ``_options`` reads and rewrites its command-line options (the one
  ``--max`` varies, the batch size a lever changes);
- ``_stop``: stopping the script where it is safe (the time limit, argparse's exits);
- ``_saves`` and ``_sandbox``: what the script saves is recorded, never written; its other
  writes go to a scratch folder;
- ``_hf`` (:func:`~torchmem.fit.estimate_hf`): a transformers model from its config alone
  (``forward``, ``generate`` with its KV cache, ``train``), no weights read.

This is the top room of :mod:`torchmem.fit`: the CLI and the public names come here first.

Example:
    >>> from torchmem.fit.targets._options import with_option
    >>> with_option(["--lr", "3e-4", "--batch-size", "8"], "--batch-size", 16)
    ['--lr', '3e-4', '--batch-size', '16']
"""
