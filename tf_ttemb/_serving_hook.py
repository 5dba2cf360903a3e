"""Where tf_ttemb's layers ask whether `tf_ttemb.export_for_serving` is tracing them.

The layers import this module, not `tf_ttemb.serving` (which needs the layer classes to
build their substitutes): while an export traces a model, `serving_table(layer)` returns
the plain-TensorFlow table the layer reads instead of its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol


class ExportSession(Protocol):
    """What an export provides: the substitute table for each layer it traces."""

    def table_for(self, layer: Any) -> Any: ...


_STATE = threading.local()


@contextlib.contextmanager
def exporting(session: ExportSession) -> Iterator[ExportSession]:
    """Makes `session` answer `serving_table` in this thread while the context is open."""
    previous = getattr(_STATE, "session", None)
    _STATE.session = session
    try:
        yield session
    finally:
        _STATE.session = previous


def serving_table(layer: Any) -> Any:
    """The table `export_for_serving` substitutes for `layer`'s, while it traces a model.

    tf_ttemb's layers call this at the start of their table read: it returns None at any
    other time (and in other threads), and the layer reads its table as usual.

    Args:
      layer: An `EmbeddingBag`, `TTEmbeddingBag`, `TableBatchedTTEmbeddingBag` or
        `ProductKeyMemory`.

    Returns:
      The `tf_ttemb.serving.ServingTable` whose `lookup` the layer uses instead of its
      own, or None.
    """
    session = getattr(_STATE, "session", None)
    return None if session is None else session.table_for(layer)
