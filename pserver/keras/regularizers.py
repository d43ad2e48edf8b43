"""keras.regularizers: L1, L2, L1L2 and the names "l1", "l2", "l1_l2" for a layer's
kernel_regularizer, bias_regularizer (Dense, Conv2D), embeddings_regularizer (Embedding) and
activity_regularizer (all three): the penalty joins the loss, as Keras's
(pserver.layers.regularizers)."""

from pserver.keras._names import missing as _missing
from pserver.layers.regularizers import L1, L1L2, L2, Regularizer, get

__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["Regularizer", "L1", "L2", "L1L2", "get"]
