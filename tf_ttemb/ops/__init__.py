"""TensorFlow ops of tf_ttemb: wrappers, registered gradients and composite fallbacks.

`tf_ttemb.ops.gather_reduce_sum` is the module (with `COMPOSITE_CHUNK_BYTES`); the function
is `tf_ttemb.gather_reduce_sum`. `tf_ttemb.ops.tt_embedding` holds `tt_embedding_bag` and
`tt_rows` (also `tf_ttemb.tt_embedding_bag` and `tf_ttemb.tt_rows`).
"""

from tf_ttemb.ops import gather_reduce_sum, tt_embedding
from tf_ttemb.ops._loader import OpLibraryNotFoundError, load_op_library

__all__ = ["OpLibraryNotFoundError", "gather_reduce_sum", "load_op_library", "tt_embedding"]
