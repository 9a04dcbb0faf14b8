"""The lean decode step's C structures (``moefit_kernels.h``), mirrored for ctypes: a weight
(``mf_mat``), one layer of a run (``mf_lean_layer``), the step (``mf_lean_step``), and the
chunk of (token, expert) pairs ``mf_moe`` runs at once. The field order and types are the
C declarations'; the loader checks them against the library's (``mf_abi_fields``,
:func:`moefit.runtime.kernels.native.abi_mismatches`) and refuses one that differs;
:mod:`moefit.runtime.layers.lean_step` fills them."""

from __future__ import annotations

import ctypes

from moefit.memory import cpu_kernels


class CMat(ctypes.Structure):
    """``mf_mat``: a weight's address, ggml type, rows x cols."""

    _fields_ = [("p", ctypes.c_void_p), ("type", ctypes.c_int32), ("rows", ctypes.c_int32),
                ("cols", ctypes.c_int32), ("pad", ctypes.c_int32)]


class CLayer(ctypes.Structure):
    """``mf_lean_layer``: what ``mf_lean_layers`` reads of one layer."""

    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                *((n, CMat) for n in ("q", "k", "v", "o", "router")),
                *((n, ctypes.c_void_p) for n in ("qb", "kb", "vb", "ob", "qn", "kn", "kc", "vc")),
                *((n, ctypes.c_int32) for n in ("heads", "kvh", "d", "dv", "cells", "window", "kcode", "vcode",
                                                "knb", "vnb")),
                ("scale", ctypes.c_float),
                *((n, ctypes.c_int32) for n in ("e", "topk", "inter", "gt", "ut", "dt")),
                *((n, ctypes.c_int64) for n in ("up_off", "down_off", "pchunk")),
                ("table", ctypes.c_void_p), ("mask", ctypes.c_void_p),
                ("hits", ctypes.c_int64), ("misses", ctypes.c_int64),
                ("cells_of", ctypes.c_void_p), ("ctx", ctypes.c_int64)]


class CStep(ctypes.Structure):
    """``mf_lean_step``: the step's sizes, flags and buffer addresses."""

    _fields_ = [*((n, ctypes.c_int32) for n in ("t", "h", "ad", "threads", "qk_norm", "renorm", "rot", "pdt")),
                ("eps", ctypes.c_float), ("off", ctypes.c_float), ("clip", ctypes.c_float),
                *((n, ctypes.c_void_p) for n in ("hidden", "normed", "delta", "acc", "gscratch", "q", "k", "v", "o",
                                                 "pos", "slot", "cs", "sn", "rlog", "bptr", "bounds", "tok", "wsel",
                                                 "stats", "mscratch", "pending"))]


def pchunk(t: int, h: int, inter: int, scratch: int) -> int:
    """(token, expert) pairs ``mf_moe`` runs at once in ``scratch`` bytes for ``t`` token rows
    of ``h`` values and experts of width ``inter``: what is left after the rows
    (:func:`moefit.memory.cpu_kernels.moe_scratch_bytes` of no pairs), by the bytes of a pair."""
    return (scratch - cpu_kernels.moe_scratch_bytes(t, h, inter, 0)) // cpu_kernels.pair_bytes(h, inter)
