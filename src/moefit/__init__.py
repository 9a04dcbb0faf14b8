"""moefit: one solved GPU memory budget for Mixture-of-Experts inference.

The planning path (:mod:`moefit.ingest.geometry`, :mod:`moefit.ingest.families`, :mod:`moefit.memory`,
:mod:`moefit.plan`, :mod:`moefit.devices`) is pure Python and imports no torch.
"""

__version__ = "0.1.0"
