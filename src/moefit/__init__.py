"""moefit: one solved GPU memory budget for Mixture-of-Experts inference.

The planning path (:mod:`moefit.ingest.geometry`, :mod:`moefit.ingest.families`, :mod:`moefit.memory`,
:mod:`moefit.plan`, :mod:`moefit.devices`) is pure Python and imports no torch.
"""

import os as _os

__version__ = "0.1.0"

# OpenMP threads (torch's and the runtime's C kernels, one libgomp) spin 300000 times at a
# barrier by default before they sleep: on a busy machine a 2-thread decode then ran at 2
# tokens/s against 23 with a bounded spin (moefit.runtime.kernels.qmatmul). Set here, before any
# torch import (libgomp reads it when it loads); a value the user set is kept.
_os.environ.setdefault("GOMP_SPINCOUNT", "10000")
