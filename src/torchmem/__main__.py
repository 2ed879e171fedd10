"""``python -m torchmem``: the same as the ``torchmem`` command.

Example:
    $ python -m torchmem --version
"""

from torchmem.cli import entry_point

if __name__ == "__main__":
    entry_point()
