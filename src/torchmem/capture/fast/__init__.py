"""Fast tracking (``torchmem.track(..., mode="fast")``): see :mod:`torchmem.capture.fast._tracker`.

Example:
    >>> from torchmem.capture.fast import FastTracker, native_available
    >>> FastTracker().peak()
    {}
"""

from torchmem.capture.fast._build import FastModeUnavailable, native_available
from torchmem.capture.fast._tracker import FastTracker

__all__ = ["FastTracker", "FastModeUnavailable", "native_available"]
