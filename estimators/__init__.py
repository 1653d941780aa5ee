"""Estimators of Maeng et al. (NeurIPS 2023): Jacobian traces, dFIL, prior terms, bounds and noise calibration.

Pure tensor functions: no I/O, no printing; the audit wiring lives in splitaudit.stages.leakage.
"""

from splitaudit.estimators.jacobian import TraceEstimate, TraceOptions
from splitaudit.estimators.mean_trace import MeanOptions, MeanTrace, TraceCheckError, estimate_mean_trace
from splitaudit.estimators.methods import jacobian_sq_norm, jacobian_trace

__all__ = [
    "MeanOptions",
    "MeanTrace",
    "TraceCheckError",
    "TraceEstimate",
    "TraceOptions",
    "estimate_mean_trace",
    "jacobian_sq_norm",
    "jacobian_trace",
]
