"""keras_rs.losses: the loss a two-tower retrieval model trains with on pserver.

`InBatchSoftmax` is softmax cross-entropy over the batch's own candidates, the loss Keras-RS's
retrieval examples compute in an overridden `compute_loss` (labels `ops.eye(n)`, logits
`queries @ candidates.T`) and TFRS's Retrieval task computed; a pserver model has no
compute_loss, so the loss takes the towers' outputs side by side and computes the logits itself.
Its options are Keras-RS's retrieval layers (SamplingProbabilityCorrection, RemoveAccidentalHits,
HardNegativeMining) applied to those logits. An accidental hit leaves the softmax, as in TFRS
(keras-rs 0.4.0's RemoveAccidentalHits adds about 1e-40 to its logit, which changes nothing).
The class is pserver.models.losses's, so that a saved model's compiled loss loads without this
package.
"""

from pserver.models.losses import InBatchSoftmax

__all__ = ["InBatchSoftmax"]
