"""TensorFlow ops of tf_ttemb: wrappers, registered gradients and composite fallbacks.

`tf_ttemb.ops.gather_reduce_sum` is the module of `tf_ttemb.gather_reduce_sum`;
`tf_ttemb.ops.sparse_apply` holds `gather_reduce_sum_sparse_apply` (also importable from
`tf_ttemb.ops.gather_reduce_sum`); `tf_ttemb.ops.composite` the plain-TensorFlow
implementation and its memory budget, `COMPOSITE_CHUNK_BYTES`. `tf_ttemb.ops.tt_embedding`
holds `tt_embedding_bag` and `tt_rows` (also `tf_ttemb.tt_embedding_bag` and
`tf_ttemb.tt_rows`). `tf_ttemb.ops.grouped` holds `grouped_gather_reduce_sum` (also
`tf_ttemb.grouped_gather_reduce_sum`), many features' tables in one lookup.
"""

from tf_ttemb.ops import composite, gather_reduce_sum, grouped, sparse_apply, tt_embedding
from tf_ttemb.ops._loader import OpLibraryNotFoundError, load_op_library

__all__ = [
    "OpLibraryNotFoundError",
    "composite",
    "gather_reduce_sum",
    "grouped",
    "load_op_library",
    "sparse_apply",
    "tt_embedding",
]
