"""ctypes harness over the CUDA kernels of gather_reduce_sum, for torch CUDA tensors.

The GPU machine has no TensorFlow, so the kernels in `cuda/` are also built by
nvcc alone into `libtf_ttemb_gpu_harness.so` (python/gpu_harness/build_gpu_harness.sh),
with a C ABI (python/gpu_harness/gpu_harness_capi.cu). This module loads that
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
import math
import os
import pathlib
from typing import Optional, Tuple, Union

import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_LIB = REPO / "build" / "gpu_harness" / "libtf_ttemb_gpu_harness.so"

DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_INDEX_CODES = {torch.int32: 0, torch.int64: 1}
_COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2, "max": 3}
REPORT_WORDS = 11  # cuda/common_types.h DeviceReport: 8 findings, 3 header words

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
    bind(lib, sigs)
    if lib.ttemb_report_bytes() != 8 * REPORT_WORDS:
        raise RuntimeError("harness library and harness.py disagree on the report layout")
    _lib = lib
    return lib


def bind(lib: ctypes.CDLL, sigs: dict) -> None:
    """Sets each named function's result and argument types: sigs maps name -> (res, args)."""
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    """Pointer of an input for the launchers: None for a missing or empty tensor."""
    return None if t is None or t.numel() == 0 else t.data_ptr()


_dummy = {}


def out_ptr(t: torch.Tensor) -> int:
    """Pointer of an output; a 16-byte dummy for an empty one (the launchers take the
    form of the output from which pointer is set, and write nothing to an empty one)."""
    if t.numel():
        return t.data_ptr()
    if t.device not in _dummy:
        _dummy[t.device] = torch.empty(16, dtype=torch.uint8, device=t.device)
    return _dummy[t.device].data_ptr()


def current_stream() -> int:
    """torch's current CUDA stream, on which every launcher runs."""
    return torch.cuda.current_stream().cuda_stream


def _check_cuda(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed: {load().ttemb_error_string(code).decode()}")


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fills a fresh output with NaN (-7 for integers) when POISON is set; returns it."""
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
        if params.dtype not in DTYPE_CODES:
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
        self.dtype = DTYPE_CODES[params.dtype]
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
        return torch.empty(REPORT_WORDS, dtype=torch.int64, device=self.device)

    def scratch(self, nbytes: int) -> torch.Tensor:
        return torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=self.device)

    def scratch_for(self, size_fn, *args) -> torch.Tensor:
        """Scratch of the bytes size_fn(dtype, itype, &problem, *args) asks for."""
        return self.scratch(size_fn(self.dtype, self.itype, ctypes.byref(self.problem), *args))

    def bag_pointers(self) -> tuple:
        """The inputs' pointers as the launchers take them: params, ids, offsets, weights."""
        return ptr(self.params), ptr(self.ids), self.offsets.data_ptr(), ptr(self.weights)

    def launch(self, fn, what: str, *args, scratch: torch.Tensor) -> None:
        """Runs launcher fn(dtype, itype, &problem, *args, scratch, its bytes, stream) on
        torch's current stream; raises RuntimeError naming `what` when it fails."""
        p = ctypes.byref(self.problem)
        code = fn(
            self.dtype, self.itype, p, *args, scratch.data_ptr(), scratch.numel(), current_stream()
        )
        _check_cuda(code, what)

    def raise_for(self, report: torch.Tensor) -> list:
        """Reads a report back (waits for the stream) and raises the CPU op's message."""
        r = report.cpu().tolist()
        (
            first_bad_index,
            bad_value,
            first_bad_split,
            split_value,
            split_prev,
            first_split,
            last_split,
        ) = r[:7]
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
    out = poison(torch.empty(p.num_bags, p.dim, dtype=params.dtype, device=c.device))
    argmax = poison(
        torch.empty(
            p.num_bags if combiner == "max" else 0, p.dim, dtype=torch.int32, device=c.device
        )
    )
    scratch = c.scratch_for(lib.ttemb_forward_scratch_bytes)
    report = c.report()
    pointers = (*c.bag_pointers(), ptr(out), ptr(argmax), report.data_ptr())
    c.launch(lib.ttemb_forward, "forward", *pointers, scratch=scratch)
    return out, argmax, c, report


def gather_reduce_sum_with_argmax(
    params, ids, offsets, weights=None, combiner="sum", padding_id=None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Forward; returns (out [B, D], argmax) and raises ValueError for bad input."""
    out, argmax, c, report = forward_async(params, ids, offsets, weights, combiner, padding_id)
    c.raise_for(report)
    return out, argmax


def gather_reduce_sum(
    params, ids, offsets, weights=None, combiner="sum", padding_id=None
) -> torch.Tensor:
    """Fused embedding bag: [B, D] from params [N, D], ids [nnz], offsets [B + 1]."""
    return gather_reduce_sum_with_argmax(params, ids, offsets, weights, combiner, padding_id)[0]


def backward_async(
    params,
    ids,
    offsets,
    weights,
    grad_out,
    combiner="sum",
    padding_id=None,
    dense=True,
    output=None,
    argmax=None,
    fuse_weights_grad=True,
):
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
    scratch = c.scratch_for(lib.ttemb_params_grad_scratch_bytes, int(dense), int(fused))
    report = c.report()
    _, ids_ptr, offsets_ptr, weights_ptr = c.bag_pointers()
    c.launch(
        lib.ttemb_params_grad_prepare,
        "params grad prepare",
        *(ids_ptr, offsets_ptr, weights_ptr, report.data_ptr(), int(dense), int(fused)),
        scratch=scratch,
    )
    if dense:
        grad_params = poison(torch.empty_like(c.params))
        unique_ids = values = None
    else:
        r = c.raise_for(report)
        num_unique = r[7]
        unique_ids = poison(torch.empty(num_unique, dtype=ids.dtype, device=c.device))
        values = poison(torch.empty(num_unique, p.dim, dtype=params.dtype, device=c.device))
        grad_params = None
    weights_grad = None
    if fused:
        weights_grad = poison(torch.empty_like(c.weights))
    out_c = None if output is None else output.contiguous()
    c.launch(
        lib.ttemb_params_grad_reduce,
        "params grad reduce",
        ptr(grad_out),
        None if argmax is None else out_ptr(argmax),
        ptr(unique_ids),
        None if dense else out_ptr(values),
        out_ptr(grad_params) if dense else None,
        ptr(c.params) if fused else None,
        ptr(out_c) if fused else None,
        ptr(c.weights) if fused else None,
        ptr(weights_grad),
        scratch=scratch,
    )
    result = grad_params if dense else (unique_ids, values)
    return result, weights_grad, c, report


def weights_grad(
    params, ids, offsets, weights, grad_out, output=None, combiner="sum", padding_id=None
) -> torch.Tensor:
    """Gradient w.r.t. the weights by the stand-alone kernel (the TF op's path)."""
    lib = load()
    c = _Call(params, ids, offsets, weights, combiner, padding_id)
    if weights is None or combiner == "max":
        raise ValueError("the weights gradient needs weights and combiner sum, mean or sqrtn")
    if combiner in ("mean", "sqrtn") and output is None:
        output = gather_reduce_sum(params, ids, offsets, weights, combiner, padding_id)
    dw = poison(torch.empty_like(c.weights))
    scratch = c.scratch_for(lib.ttemb_weights_grad_scratch_bytes)
    report = c.report()
    grad_c = grad_out.contiguous()
    out_c = None if output is None else output.contiguous()
    pointers = (ptr(grad_c), *c.bag_pointers(), ptr(out_c), ptr(dw), report.data_ptr())
    c.launch(lib.ttemb_weights_grad, "weights grad", *pointers, scratch=scratch)
    c.raise_for(report)
    return dw


def gather_reduce_sum_backward(
    params, ids, offsets, weights, grad_out, combiner="sum", padding_id=None, dense=True
):
    """Gradients of gather_reduce_sum: (params_grad, weights_grad).

    params_grad is a dense [N, D] tensor, or (unique_ids [U] ascending, rows [U, D]) when
    dense=False; weights_grad is [nnz] (None without weights). Bitwise deterministic.
    """
    output = argmax = None
    if combiner == "max" or (weights is not None and combiner in ("mean", "sqrtn")):
        output, argmax = gather_reduce_sum_with_argmax(
            params, ids, offsets, weights, combiner, padding_id
        )
    grad_params, dw, c, report = backward_async(
        params,
        ids,
        offsets,
        weights,
        grad_out,
        combiner,
        padding_id,
        dense,
        output,
        argmax if combiner == "max" else None,
    )
    if dense:
        c.raise_for(report)
    return grad_params, dw


# ---------------------------------------------------------------------------
# TT embedding bags (cuda/tt_embedding_kernels.cuh, C ABI in
# python/gpu_harness/tt_embedding_capi.cu). The composition is the TF layer's:
#   unique_ids, slots = TTUniqueIds(ids, table_splits)
#   rows = TTRows(unique_ids, cores)                       [U, D]
#   out  = gather_reduce_sum(rows, slots, offsets, weights, padding_id=-1)
# U stays on the device: unique_ids and rows are sized for nnz (U <= nnz) and the
# rows launcher reads U from the unique-ids report, so the forward has no host
# synchronisation unless check=True (the default), which reads the reports back
# and raises the op's messages.

TT_REPORT_WORDS = 16


class _TTProblem(ctypes.Structure):
    _fields_ = [
        ("num_cores", ctypes.c_int64),
        ("num_tables", ctypes.c_int64),
        ("p", ctypes.c_int64 * 8),
        ("q", ctypes.c_int64 * 8),
        ("r", ctypes.c_int64 * 9),
    ]


_tt_loaded = False


def load_tt() -> ctypes.CDLL:
    """The harness library with the TT embedding functions bound (once)."""
    global _tt_loaded
    lib = load()
    if _tt_loaded:
        return lib
    vp, sz, i32, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int64
    prob = ctypes.POINTER(_TTProblem)
    sigs = {
        "ttemb_tt_report_bytes": (i32, []),
        "ttemb_tt_unique_scratch_bytes": (sz, [i32, i64, i64, i64, i64, ctypes.c_int32, i64]),
        "ttemb_tt_unique": (
            i32,
            [i32, i64, i64, i64, i64, ctypes.c_int32, i64, vp, vp, vp, vp, vp, vp, sz, vp],
        ),
        "ttemb_tt_rows_scratch_bytes": (sz, [i32, prob, i64]),
        "ttemb_tt_rows": (i32, [i32, prob, vp, i64, vp, vp, vp, vp, vp, sz, vp]),
        "ttemb_tt_rows_grad_scratch_bytes": (sz, [i32, prob, i64]),
        "ttemb_tt_rows_grad_prepare": (i32, [i32, prob, vp, i64, vp, vp, vp, sz, vp]),
        "ttemb_tt_rows_grad_prepare_scratch_bytes": (sz, [i32, prob, i64]),
        "ttemb_tt_rows_grad_work_bytes": (sz, [i32, prob, i64, vp]),
        "ttemb_tt_rows_grad_compute": (
            i32,
            [i32, prob, vp, i64, vp, vp, vp, vp, vp, vp, vp, sz, vp, vp, sz, vp],
        ),
    }
    bind(lib, sigs)
    if lib.ttemb_tt_report_bytes() != 8 * TT_REPORT_WORDS:
        raise RuntimeError("harness library and harness.py disagree on the TT report layout")
    _tt_loaded = True
    return lib


def _ptr_array(tensors) -> ctypes.Array:
    arr = (ctypes.c_void_p * 8)()
    for k, t in enumerate(tensors):
        arr[k] = None if t is None else out_ptr(t)
    return arr


class TTShape:
    """The factorisation of a (table-batched) TT table, as in docs/tt_embedding_contract.md."""

    def __init__(self, p_shapes, q_shapes, ranks, num_tables=1):
        self.p = [int(x) for x in p_shapes]
        self.q = [int(x) for x in q_shapes]
        self.num_cores = len(self.p)
        if self.num_cores < 2 or self.num_cores > 8 or len(self.q) != self.num_cores:
            raise ValueError(
                f"p_shapes and q_shapes must have the same length in [2, 8], got "
                f"{self.p} and {self.q}"
            )
        if len(ranks) != self.num_cores - 1:
            raise ValueError(f"ranks must have {self.num_cores - 1} entries, got {list(ranks)}")
        self.r = [1] + [int(x) for x in ranks] + [1]
        if min(self.p + self.q + self.r) < 1:
            raise ValueError("p_shapes, q_shapes and ranks must be positive")
        self.num_tables = int(num_tables)
        self.rows_per_table = math.prod(self.p)
        self.dim = math.prod(self.q)
        self.widths = [self.r[k] * self.q[k] * self.r[k + 1] for k in range(self.num_cores)]
        pr = _TTProblem()
        pr.num_cores = self.num_cores
        pr.num_tables = self.num_tables
        for k in range(self.num_cores):
            pr.p[k] = self.p[k]
            pr.q[k] = self.q[k]
        for k in range(self.num_cores + 1):
            pr.r[k] = self.r[k]
        self.problem = pr

    def check_cores(self, cores):
        if len(cores) != self.num_cores:
            raise ValueError(f"expected {self.num_cores} cores, got {len(cores)}")
        dtype = cores[0].dtype
        for k, c in enumerate(cores):
            want = (self.num_tables * self.p[k], self.widths[k])
            if tuple(c.shape) != want:
                raise ValueError(f"core {k} must have shape {list(want)}, got {list(c.shape)}")
            if c.dtype != dtype or not c.is_cuda:
                raise ValueError("cores must be CUDA tensors of one dtype")
        if dtype not in DTYPE_CODES:
            raise TypeError(f"cores dtype {dtype} is not supported")
        return [c.contiguous() for c in cores]


def tt_unique_ids_async(
    ids, table_splits, num_embeddings, stride, padding_id=None, unique_fill=None
):
    """TTUniqueIds: (unique_ids [nnz] (first U valid), slots [nnz], report [16] int64).
    report[2] holds U on the device; nothing is read back. unique_fill: a value written to
    all nnz entries of unique_ids before the launch, so entries U.. hold it (the cached
    forward fills EMPTY_CACHE_ID, which the cache lookup skips)."""
    lib = load_tt()
    if ids.dtype not in _INDEX_CODES:
        raise TypeError(f"ids dtype {ids.dtype} is not supported")
    ids = ids.contiguous()
    nnz = ids.numel()
    num_tables = table_splits.numel() - 1
    dev = ids.device
    unique = poison(torch.empty(nnz, dtype=torch.int64, device=dev))
    if unique_fill is not None:
        unique.fill_(int(unique_fill))
    slots = poison(torch.empty(nnz, dtype=ids.dtype, device=dev))
    report = torch.empty(TT_REPORT_WORDS, dtype=torch.int64, device=dev)
    args = (
        _INDEX_CODES[ids.dtype],
        nnz,
        num_tables,
        int(num_embeddings),
        int(stride),
        int(padding_id is not None),
        -1 if padding_id is None else int(padding_id),
    )
    nbytes = lib.ttemb_tt_unique_scratch_bytes(*args)
    scratch = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=dev)
    code = lib.ttemb_tt_unique(
        *args,
        ptr(ids),
        table_splits.contiguous().data_ptr(),
        out_ptr(unique),
        out_ptr(slots),
        report.data_ptr(),
        scratch.data_ptr(),
        scratch.numel(),
        current_stream(),
    )
    _check_cuda(code, "tt unique ids")
    return unique, slots, report


def tt_rows_async(shape: TTShape, cores, ids, num_ids=None):
    """TTRows: rows [len(ids), D] of global ids (int64); num_ids: a 1-element int64 CUDA
    tensor holding how many ids are valid (rows past it are not written). Returns
    (rows, report)."""
    lib = load_tt()
    cores = shape.check_cores(cores)
    dtype = cores[0].dtype
    ids = ids.contiguous()
    n = ids.numel()
    rows = poison(torch.empty(n, shape.dim, dtype=dtype, device=ids.device))
    report = torch.empty(TT_REPORT_WORDS, dtype=torch.int64, device=ids.device)
    pr = ctypes.byref(shape.problem)
    nbytes = lib.ttemb_tt_rows_scratch_bytes(DTYPE_CODES[dtype], pr, n)
    if nbytes == 0:
        raise ValueError("TT shape not supported by the kernels")
    scratch = torch.empty(int(nbytes), dtype=torch.uint8, device=ids.device)
    code = lib.ttemb_tt_rows(
        DTYPE_CODES[dtype],
        pr,
        ptr(ids),
        n,
        None if num_ids is None else num_ids.data_ptr(),
        _ptr_array(cores),
        out_ptr(rows),
        report.data_ptr(),
        scratch.data_ptr(),
        scratch.numel(),
        current_stream(),
    )
    _check_cuda(code, "tt rows")
    return rows, report


def tt_rows_grad(
    shape: TTShape, cores, ids, grad, num_ids=None, dense=True, counts=None, host_report=None
):
    """TTRowsGrad: per core, the dense gradient [num_tables * p_k, width_k] (dense=True, no
    read-back) or (sorted distinct core rows [n_k] int64, values [n_k, width_k]) (dense=False:
    reads the counts back). Returns (grads, report).

    Scratch as the launchers allow it: with a read-back (dense=False, counts None) as the TF
    glue does, Prepare gets the index part alone and Compute a separate work buffer sized by
    the report; without one, a single buffer with the work part at its upper bound.

    dense=False only: counts, the n_k already known on the host (no read-back; they must be
    the ones prepare finds); host_report, a pinned int64 [16] CPU tensor the report is copied
    into before waiting for the stream (the TF glue's read-back), instead of report.cpu()."""
    lib = load_tt()
    cores = shape.check_cores(cores)
    dtype = cores[0].dtype
    ids = ids.contiguous()
    grad = grad.contiguous()
    n = ids.numel()
    if tuple(grad.shape) != (n, shape.dim) or grad.dtype != dtype:
        raise ValueError(f"grad must be [{n}, {shape.dim}] of the cores' dtype")
    dev = ids.device
    report = torch.empty(TT_REPORT_WORDS, dtype=torch.int64, device=dev)
    pr = ctypes.byref(shape.problem)
    code_t = DTYPE_CODES[dtype]
    read_back = not dense and counts is None
    if read_back:
        nbytes = lib.ttemb_tt_rows_grad_prepare_scratch_bytes(code_t, pr, n)
    else:
        nbytes = lib.ttemb_tt_rows_grad_scratch_bytes(code_t, pr, n)
    if nbytes == 0:
        raise ValueError("TT shape not supported by the kernels")
    scratch = torch.empty(int(nbytes), dtype=torch.uint8, device=dev)
    num_ptr = None if num_ids is None else num_ids.data_ptr()
    code = lib.ttemb_tt_rows_grad_prepare(
        code_t,
        pr,
        ptr(ids),
        n,
        num_ptr,
        report.data_ptr(),
        scratch.data_ptr(),
        scratch.numel(),
        current_stream(),
    )
    _check_cuda(code, "tt rows grad prepare")
    prepared, work = None, None
    if read_back:
        if host_report is not None:
            host_report.copy_(report, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            prepared = host_report
        else:
            prepared = report.cpu()
        counts = prepared.tolist()[4 : 4 + shape.num_cores]
        work = torch.empty(
            int(lib.ttemb_tt_rows_grad_work_bytes(code_t, pr, n, prepared.data_ptr())),
            dtype=torch.uint8,
            device=dev,
        )
    work_args = (
        None if prepared is None else prepared.data_ptr(),
        None if work is None else work.data_ptr(),
        0 if work is None else work.numel(),
    )
    if dense:
        grads = [
            poison(
                torch.empty(shape.num_tables * shape.p[k], shape.widths[k], dtype=dtype, device=dev)
            )
            for k in range(shape.num_cores)
        ]
        outputs = (None, None, _ptr_array(grads))
    else:
        counts = [int(c) for c in counts]
        idx = [poison(torch.empty(c, dtype=torch.int64, device=dev)) for c in counts]
        vals = [
            poison(torch.empty(c, shape.widths[k], dtype=dtype, device=dev))
            for k, c in enumerate(counts)
        ]
        outputs = (_ptr_array(idx), _ptr_array(vals), None)
        grads = list(zip(idx, vals))
    code = lib.ttemb_tt_rows_grad_compute(
        code_t,
        pr,
        ptr(ids),
        n,
        num_ptr,
        _ptr_array(cores),
        out_ptr(grad),
        *outputs,  # sparse indices, sparse values, dense gradients
        scratch.data_ptr(),
        scratch.numel(),
        *work_args,
        current_stream(),
    )
    _check_cuda(code, "tt rows grad compute")
    return grads, report


def tt_rows_grad_bytes(shape: TTShape, dtype, n, prepared=None) -> dict:
    """TTRowsGrad's scratch for n ids: `one_buffer` (index part + work part at its upper
    bound, no read-back), `index` (Prepare's part) and `work` (Compute's float part, for
    `prepared`, a CPU copy of Prepare's report for those ids; None: the upper bound)."""
    lib = load_tt()
    pr = ctypes.byref(shape.problem)
    code_t = DTYPE_CODES[dtype]
    return {
        "one_buffer": int(lib.ttemb_tt_rows_grad_scratch_bytes(code_t, pr, n)),
        "index": int(lib.ttemb_tt_rows_grad_prepare_scratch_bytes(code_t, pr, n)),
        "work": int(
            lib.ttemb_tt_rows_grad_work_bytes(
                code_t, pr, n, None if prepared is None else prepared.contiguous().data_ptr()
            )
        ),
    }


def tt_raise_unique(report, num_embeddings, padding_id):
    """Reads TTUniqueIds' report back and raises the op's message for a bad id."""
    r = report.cpu().tolist()
    if r[0] >= 0:
        msg = f"indices[{r[0]}] = {r[1]} is not in [0, {num_embeddings})"
        if padding_id is not None:
            msg += f" and is not padding_id ({padding_id})"
        raise ValueError(msg)
    return r


def tt_raise_global(report, limit):
    """Reads a TT rows (gradient) report back and raises for a global id not below limit."""
    r = report.cpu().tolist()
    if r[0] >= 0:
        raise ValueError(f"ids[{r[0]}] = {r[1]} is not in [0, {limit})")
    return r


class TTState:
    """What the forward keeps for the backward."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def tt_embedding_bag_forward(
    cores,
    p_shapes,
    q_shapes,
    ranks,
    ids,
    offsets,
    weights=None,
    combiner="sum",
    num_tables=1,
    table_splits=None,
    padding_id=None,
    num_embeddings=None,
    check=True,
):
    """Forward of a TT embedding bag; returns (out [B, D], TTState)."""
    shape = TTShape(p_shapes, q_shapes, ranks, num_tables)
    n_emb, table_splits = tt_check_ids_args(shape, ids, table_splits, num_embeddings)
    unique, slots, urep = tt_unique_ids_async(
        ids, table_splits, n_emb, shape.rows_per_table, padding_id
    )
    num_unique = urep[2:3]
    rows, rrep = tt_rows_async(shape, cores, unique, num_unique)
    return tt_bags_of_rows(
        TTState(shape=shape, cores=cores, unique=unique, slots=slots, num_unique=num_unique),
        rows,
        offsets,
        weights,
        combiner,
        urep,
        n_emb,
        padding_id,
        check,
    )


def tt_check_ids_args(shape, ids, table_splits, num_embeddings):
    """A TT forward's checked rows per table (num_embeddings; None: all of the shape's) and
    table_splits (None: one table holds every id); returns (n_emb, table_splits)."""
    n_emb = shape.rows_per_table if num_embeddings is None else int(num_embeddings)
    if not 1 <= n_emb <= shape.rows_per_table:
        raise ValueError(f"num_embeddings must be in [1, {shape.rows_per_table}], got {n_emb}")
    num_tables = shape.num_tables
    if table_splits is None:
        if num_tables != 1:
            raise ValueError("table_splits is needed when num_tables > 1")
        table_splits = torch.tensor([0, ids.numel()], dtype=torch.int64, device=ids.device)
    if table_splits.numel() != num_tables + 1:
        raise ValueError(f"table_splits must have num_tables + 1 = {num_tables + 1} entries")
    return n_emb, table_splits


def tt_bags_of_rows(
    state, rows, offsets, weights, combiner, unique_report, n_emb, padding_id, check
):
    """The last step of a TT forward: the bags' reduction over the rows [nnz, D] of the
    distinct ids (state.slots: each entry's row). With check, reads the unique-ids report
    and the reduction's back and raises the op's messages. Completes `state` (the forward's
    intermediates so far) with the rows, the bags and the output; returns (out, state)."""
    out, argmax, call, brep = forward_async(
        rows, state.slots, offsets, weights, combiner, padding_id=-1
    )
    if check:
        tt_raise_unique(unique_report, n_emb, padding_id)
        call.raise_for(brep)
    state.__dict__.update(
        rows=rows,
        offsets=offsets,
        weights=weights,
        combiner=combiner,
        out=out,
        argmax=argmax,
        unique_report=unique_report,
        n_emb=n_emb,
        padding_id=padding_id,
    )
    return out, state


def tt_embedding_bag_backward_from(state, grad_out, dense=True, check=True):
    """Backward from a forward state; returns (core_grads, weights_grad)."""
    s = state
    fused_w = s.weights is not None and s.combiner != "max"
    drows, dw, call, brep = backward_async(
        s.rows,
        s.slots,
        s.offsets,
        s.weights,
        grad_out,
        s.combiner,
        padding_id=-1,
        dense=True,
        output=s.out if fused_w and s.combiner in ("mean", "sqrtn") else None,
        argmax=s.argmax if s.combiner == "max" else None,
    )
    grads, grep = tt_rows_grad(s.shape, s.cores, s.unique, drows, s.num_unique, dense=dense)
    if check:
        call.raise_for(brep)
        tt_raise_global(grep, s.shape.num_tables * s.shape.rows_per_table)
    return grads, dw


def tt_embedding_bag(cores, p_shapes, q_shapes, ranks, ids, offsets, *args, **kwargs):
    """TT embedding bag on the GPU: out [B, D].

    cores: num_cores CUDA tensors, core k [num_tables * p_k, r_k q_k r_{k+1}] (the TF
    layer's layout); ids [nnz] (int32/int64, row ids inside their table), offsets [B + 1]
    int64 CSR, weights [nnz] or None, combiner sum/mean/sqrtn/max; table_splits [T + 1]
    int64 (entries of table t are table_splits[t] .. table_splits[t + 1] - 1), needed when
    num_tables > 1; padding_id: entries equal to it are skipped. Raises ValueError with the
    TF op's messages for bad ids. The arguments after offsets are
    tt_embedding_bag_forward's.

    Example:
        cores = [torch.randn(8, 1 * 2 * 3, device="cuda"), torch.randn(5, 3 * 4 * 1, device="cuda")]
        ids = torch.tensor([0, 39, 7], device="cuda")
        offsets = torch.tensor([0, 2, 3], device="cuda")
        out = tt_embedding_bag(cores, [8, 5], [2, 4], [3], ids, offsets)   # [2, 8]
    """
    return tt_embedding_bag_forward(
        cores, p_shapes, q_shapes, ranks, ids, offsets, *args, **kwargs
    )[0]


def tt_embedding_bag_backward(
    cores, p_shapes, q_shapes, ranks, ids, offsets, grad_out, *args, dense=True, **kwargs
):
    """Gradients of tt_embedding_bag: (core_grads, weights_grad).

    core_grads[k] is the dense gradient of core k [num_tables * p_k, width_k] (dense=True),
    or (sorted distinct core rows [n_k] int64, values [n_k, width_k]) (dense=False, the TF
    op's IndexedSlices form). weights_grad is [nnz] or None. Bitwise deterministic. The
    arguments after grad_out are tt_embedding_bag_forward's (weights, combiner, ...).
    """
    _, state = tt_embedding_bag_forward(
        cores, p_shapes, q_shapes, ranks, ids, offsets, *args, **kwargs
    )
    return tt_embedding_bag_backward_from(state, grad_out, dense=dense)
