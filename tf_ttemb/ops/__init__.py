"""TensorFlow ops of tf_ttemb: wrappers, registered gradients and composite fallbacks.

`tf_ttemb.ops.gather_reduce_sum` is the module (with `COMPOSITE_CHUNK_BYTES`); the function
is `tf_ttemb.gather_reduce_sum`.
"""

from tf_ttemb.ops import gather_reduce_sum
from tf_ttemb.ops._loader import OpLibraryNotFoundError, load_op_library

__all__ = ["OpLibraryNotFoundError", "gather_reduce_sum", "load_op_library"]
