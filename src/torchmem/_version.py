"""torchmem's version string (single source for packaging and ``torchmem --version``)."""

__version__ = "0.2.0.dev0"
