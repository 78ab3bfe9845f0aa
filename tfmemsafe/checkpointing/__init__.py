"""Gradient checkpointing: recompute activations instead of storing them.

Owns `Checkpointed` (a wrapper that keeps only a layer's inputs in the
forward pass and recomputes its activations in the backward pass, with
the same weights and the same random numbers) and `checkpoint_blocks`
(a chain of blocks checkpointed in about sqrt(n) segments). Inside: the
custom gradient that recomputes a call and releases its gradients
together, and the search for TensorFlow's stateful random ops, which a
recomputation cannot replay.
"""

from tfmemsafe.checkpointing._checkpointed import Checkpointed
from tfmemsafe.checkpointing._segments import checkpoint_blocks

__all__ = ["Checkpointed", "checkpoint_blocks"]
