"""ctypes harness over the CUDA kernels of gather_reduce_sum, for torch CUDA tensors.

The GPU machine has no TensorFlow, so the kernels in `cuda/` are also built by
nvcc alone into `libtf_ttemb_gpu_harness.so` (python/build_gpu_harness.sh),
with a C ABI (cuda/harness/gpu_harness_capi.cu). This module loads that
library and runs the same launchers the TF GPU OpKernels call, on torch's
current stream, with scratch memory from torch's allocator.

Inputs use the CSR form: `offsets` has B + 1 entries (offsets[0] == 0,
non-decreasing, offsets[B] == len(ids)), like the op's `row_splits`. Bad
input raises ValueError with the TF op's InvalidArgument message.

Example:
    import torch, gpu_harness
    params = torch.randn(100, 16, device="cuda")
    ids = torch.tensor([1, 2, 3, 4], device="cuda")
    offsets = torch.tensor([0, 3, 4], device="cuda")
    out = gpu_harness.gather_reduce_sum(params, ids, offsets, combiner="mean")
"""

from __future__ import annotations

import ctypes
import os
import pathlib
from typing import Optional, Tuple, Union

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_LIB = REPO / "build" / "gpu_harness" / "libtf_ttemb_gpu_harness.so"

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_INDEX_CODES = {torch.int32: 0, torch.int64: 1}
_COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2, "max": 3}
_REPORT_WORDS = 8

# When True, every output is filled with NaN (-7 for integers) before the
# kernels run, so an element they fail to write shows up in the checks.
POISON = False


class _Problem(ctypes.Structure):
    _fields_ = [
        ("num_rows", ctypes.c_int64),
        ("dim", ctypes.c_int64),
        ("num_bags", ctypes.c_int64),
        ("nnz", ctypes.c_int64),
        ("padding_id", ctypes.c_int64),
        ("combiner", ctypes.c_int32),
        ("has_weights", ctypes.c_int32),
        ("has_padding_id", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


_lib = None


def load(path: Optional[Union[str, os.PathLike]] = None) -> ctypes.CDLL:
    """Loads the harness library (once); path defaults to $TF_TTEMB_GPU_HARNESS or build/."""
    global _lib
    if _lib is not None:
        return _lib
    path = pathlib.Path(path or os.environ.get("TF_TTEMB_GPU_HARNESS", DEFAULT_LIB))
    lib = ctypes.CDLL(str(path))
    vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    prob = ctypes.POINTER(_Problem)
    sigs = {
        "ttemb_report_bytes": (i32, []),
        "ttemb_error_string": (ctypes.c_char_p, [i32]),
        "ttemb_forward_scratch_bytes": (sz, [i32, i32, prob]),
        "ttemb_forward": (i32, [i32, i32, prob, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]),
        "ttemb_params_grad_scratch_bytes": (sz, [i32, i32, prob, i32, i32]),
        "ttemb_params_grad_prepare": (i32, [i32, i32, prob, vp, vp, vp, vp, i32, i32, vp, sz, vp]),
        "ttemb_params_grad_reduce": (
            i32,
            [i32, i32, prob, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        ),
        "ttemb_weights_grad_scratch_bytes": (sz, [i32, i32, prob]),
        "ttemb_weights_grad": (i32, [i32, i32, prob, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    if lib.ttemb_report_bytes() != 8 * _REPORT_WORDS:
        raise RuntimeError("harness library and gpu_harness.py disagree on the report layout")
    _lib = lib
    return lib


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None or t.numel() == 0 else t.data_ptr()


_dummy = {}


def _out_ptr(t: torch.Tensor) -> int:
    """Pointer of an output; a 16-byte dummy for an empty one (the launchers take the
    form of the output from which pointer is set, and write nothing to an empty one)."""
    if t.numel():
        return t.data_ptr()
    if t.device not in _dummy:
        _dummy[t.device] = torch.empty(16, dtype=torch.uint8, device=t.device)
    return _dummy[t.device].data_ptr()


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _check_cuda(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed: {load().ttemb_error_string(code).decode()}")


def _poison(t: torch.Tensor) -> torch.Tensor:
    if POISON and t.numel():
        t.fill_(float("nan") if t.is_floating_point() else -7)
    return t


class _Call:
    """Validated inputs of one call and its problem struct."""

    def __init__(self, params, ids, offsets, weights, combiner, padding_id, num_rows=None):
        if combiner not in _COMBINERS:
            raise ValueError(
                f"combiner must be one of 'sum', 'mean', 'sqrtn', 'max', got '{combiner}'"
            )
        if combiner == "max" and weights is not None:
            raise ValueError("combiner 'max' does not take weights")
        if params.dim() != 2:
            raise ValueError(f"params must be a matrix [N, D], got shape {list(params.shape)}")
        if ids.dim() != 1:
            raise ValueError(f"indices must be a vector [nnz], got shape {list(ids.shape)}")
        if offsets.dim() != 1 or offsets.numel() < 1:
            raise ValueError(
                "row_splits must be a vector [B + 1] with at least 1 element, got shape "
                f"{list(offsets.shape)}"
            )
        if params.dtype not in _DTYPE_CODES:
            raise TypeError(f"params dtype {params.dtype} is not supported")
        if ids.dtype not in _INDEX_CODES:
            raise TypeError(f"ids dtype {ids.dtype} is not supported")
        if offsets.dtype != torch.int64:
            raise TypeError("offsets must be int64")
        if weights is not None:
            if weights.dtype != params.dtype:
                raise TypeError("weights must have the dtype of params")
            if weights.dim() != 1 or weights.numel() != ids.numel():
                raise ValueError(
                    f"weights has {weights.numel()} entries but indices has {ids.numel()}"
                )
        for t in (params, ids, offsets, weights):
            if t is not None and not t.is_cuda:
                raise ValueError("all tensors must be on the GPU")
        self.params = params.contiguous()
        self.ids = ids.contiguous()
        self.offsets = offsets.contiguous()
        self.weights = None if weights is None else weights.contiguous()
        self.combiner = combiner
        self.padding_id = padding_id
        self.dtype = _DTYPE_CODES[params.dtype]
        self.itype = _INDEX_CODES[ids.dtype]
        p = _Problem()
        p.num_rows = params.shape[0] if num_rows is None else num_rows
        p.dim = params.shape[1]
        p.num_bags = offsets.numel() - 1
        p.nnz = ids.numel()
        p.padding_id = -1 if padding_id is None else int(padding_id)
        p.combiner = _COMBINERS[combiner]
        p.has_weights = int(weights is not None)
        p.has_padding_id = int(padding_id is not None)
        self.problem = p
        self.device = params.device

    def report(self) -> torch.Tensor:
        return torch.empty(_REPORT_WORDS, dtype=torch.int64, device=self.device)

    def scratch(self, nbytes: int) -> torch.Tensor:
        return torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=self.device)

    def raise_for(self, report: torch.Tensor) -> list:
        """Reads a report back (waits for the stream) and raises the CPU op's message."""
        r = report.cpu().tolist()
        (first_bad_index, bad_value, first_bad_split, split_value, split_prev, first_split,
         last_split, _) = r
        p = self.problem
        if first_split != 0:
            raise ValueError(f"row_splits[0] = {first_split} must be 0")
        if first_bad_split >= 0:
            b = first_bad_split
            raise ValueError(
                f"row_splits must be non-decreasing: row_splits[{b + 1}] = {split_value} "
                f"< row_splits[{b}] = {split_prev}"
            )
        if last_split != p.nnz:
            raise ValueError(
                f"row_splits[{p.num_bags}] = {last_split} must equal the number of "
                f"indices ({p.nnz})"
            )
        if first_bad_index >= 0:
            msg = f"indices[{first_bad_index}] = {bad_value} is not in [0, {p.num_rows})"
            if self.padding_id is not None:
                msg += f" and is not padding_id ({self.padding_id})"
            raise ValueError(msg)
        return r


def forward_async(params, ids, offsets, weights=None, combiner="sum", padding_id=None):
    """Launches the forward only. Returns (out [B, D], argmax [B, D] or [0, D], call, report)."""
    lib = load()
    c = _Call(params, ids, offsets, weights, combiner, padding_id)
    p = c.problem
    out = _poison(torch.empty(p.num_bags, p.dim, dtype=params.dtype, device=c.device))
    argmax = _poison(
        torch.empty(p.num_bags if combiner == "max" else 0, p.dim, dtype=torch.int32,
                    device=c.device)
    )
    nbytes = lib.ttemb_forward_scratch_bytes(c.dtype, c.itype, ctypes.byref(p))
    scratch = c.scratch(nbytes)
    report = c.report()
    code = lib.ttemb_forward(
        c.dtype, c.itype, ctypes.byref(p), _ptr(c.params), _ptr(c.ids), c.offsets.data_ptr(),
        _ptr(c.weights), _ptr(out), _ptr(argmax), report.data_ptr(), scratch.data_ptr(),
        scratch.numel(), _stream(),
    )
    _check_cuda(code, "forward")
    return out, argmax, c, report


def gather_reduce_sum_with_argmax(params, ids, offsets, weights=None, combiner="sum",
                                  padding_id=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Forward; returns (out [B, D], argmax) and raises ValueError for bad input."""
    out, argmax, c, report = forward_async(params, ids, offsets, weights, combiner, padding_id)
    c.raise_for(report)
    return out, argmax


def gather_reduce_sum(params, ids, offsets, weights=None, combiner="sum",
                      padding_id=None) -> torch.Tensor:
    """Fused embedding bag: [B, D] from params [N, D], ids [nnz], offsets [B + 1]."""
    return gather_reduce_sum_with_argmax(params, ids, offsets, weights, combiner, padding_id)[0]


def backward_async(params, ids, offsets, weights, grad_out, combiner="sum", padding_id=None,
                   dense=True, output=None, argmax=None, fuse_weights_grad=True):
    """Launches the params gradient (and the fused weights gradient when weights are given).

    output: the forward result (needed for the weights gradient of mean and sqrtn);
    argmax: the forward argmax (needed by max). Returns (params_grad, weights_grad, call,
    report) where params_grad is [N, D] when dense, else (unique_ids, values); the
    deduplicated form reads the report back (to size the output) and raises on bad input.
    """
    lib = load()
    c = _Call(params, ids, offsets, weights, combiner, padding_id)
    p = c.problem
    if grad_out.shape != (p.num_bags, p.dim) or grad_out.dtype != params.dtype:
        raise ValueError(f"grad must have shape [{p.num_bags}, {p.dim}] and dtype of params")
    grad_out = grad_out.contiguous()
    fused = weights is not None and fuse_weights_grad
    if combiner == "max" and argmax is None:
        raise ValueError("combiner 'max' needs the forward argmax")
    if fused and combiner in ("mean", "sqrtn") and output is None:
        raise ValueError("the weights gradient of mean and sqrtn needs the forward output")
    nbytes = lib.ttemb_params_grad_scratch_bytes(c.dtype, c.itype, ctypes.byref(p), int(dense),
                                                 int(fused))
    scratch = c.scratch(nbytes)
    report = c.report()
    code = lib.ttemb_params_grad_prepare(
        c.dtype, c.itype, ctypes.byref(p), _ptr(c.ids), c.offsets.data_ptr(), _ptr(c.weights),
        report.data_ptr(), int(dense), int(fused), scratch.data_ptr(), scratch.numel(),
        _stream(),
    )
    _check_cuda(code, "params grad prepare")
    if dense:
        grad_params = _poison(torch.empty_like(c.params))
        unique_ids = values = None
    else:
        r = c.raise_for(report)
        num_unique = r[7]
        unique_ids = _poison(torch.empty(num_unique, dtype=ids.dtype, device=c.device))
        values = _poison(torch.empty(num_unique, p.dim, dtype=params.dtype, device=c.device))
        grad_params = None
    weights_grad = None
    if fused:
        weights_grad = _poison(torch.empty_like(c.weights))
    out_c = None if output is None else output.contiguous()
    code = lib.ttemb_params_grad_reduce(
        c.dtype, c.itype, ctypes.byref(p), _ptr(grad_out),
        None if argmax is None else _out_ptr(argmax), _ptr(unique_ids),
        None if dense else _out_ptr(values),
        _out_ptr(grad_params) if dense else None,
        _ptr(c.params) if fused else None, _ptr(out_c) if fused else None,
        _ptr(c.weights) if fused else None, _ptr(weights_grad),
        scratch.data_ptr(), scratch.numel(), _stream(),
    )
    _check_cuda(code, "params grad reduce")
    result = grad_params if dense else (unique_ids, values)
    return result, weights_grad, c, report


def weights_grad(params, ids, offsets, weights, grad_out, output=None, combiner="sum",
                 padding_id=None) -> torch.Tensor:
    """Gradient w.r.t. the weights by the stand-alone kernel (the TF op's path)."""
    lib = load()
    c = _Call(params, ids, offsets, weights, combiner, padding_id)
    p = c.problem
    if weights is None or combiner == "max":
        raise ValueError("the weights gradient needs weights and combiner sum, mean or sqrtn")
    if combiner in ("mean", "sqrtn") and output is None:
        output = gather_reduce_sum(params, ids, offsets, weights, combiner, padding_id)
    dw = _poison(torch.empty_like(c.weights))
    nbytes = lib.ttemb_weights_grad_scratch_bytes(c.dtype, c.itype, ctypes.byref(p))
    scratch = c.scratch(nbytes)
    report = c.report()
    code = lib.ttemb_weights_grad(
        c.dtype, c.itype, ctypes.byref(p), _ptr(grad_out.contiguous()), _ptr(c.params),
        _ptr(c.ids), c.offsets.data_ptr(), _ptr(c.weights),
        None if output is None else _ptr(output.contiguous()), _ptr(dw), report.data_ptr(),
        scratch.data_ptr(), scratch.numel(), _stream(),
    )
    _check_cuda(code, "weights grad")
    c.raise_for(report)
    return dw


def gather_reduce_sum_backward(params, ids, offsets, weights, grad_out, combiner="sum",
                               padding_id=None, dense=True):
    """Gradients of gather_reduce_sum: (params_grad, weights_grad).

    params_grad is a dense [N, D] tensor, or (unique_ids [U] ascending, rows [U, D]) when
    dense=False; weights_grad is [nnz] (None without weights). Bitwise deterministic.
    """
    output = argmax = None
    if combiner == "max" or (weights is not None and combiner in ("mean", "sqrtn")):
        output, argmax = gather_reduce_sum_with_argmax(params, ids, offsets, weights, combiner,
                                                       padding_id)
    grad_params, dw, c, report = backward_async(
        params, ids, offsets, weights, grad_out, combiner, padding_id, dense, output,
        argmax if combiner == "max" else None,
    )
    if dense:
        c.raise_for(report)
    return grad_params, dw
