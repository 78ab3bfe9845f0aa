"""Recovery inside the training step: `SplitBatchOnOOM`.

A Keras callback that holds each batch Keras' step reads and, when the
step runs out of memory, trains the same batch again as micro-batches
whose gradients make one update: the batch, the data pipeline and the
epoch are untouched. Inside, one room per concern: the held step that
takes the place of Keras' step functions (`_held_step`), one attempt at
a batch in measured micro-batches (`_micro_batches`), the split of one
batch into micro-batches of one update (`_split`) and its per-output
loss logs (`_output_losses`), the micro-batch size
that halves on failure and grows back after clean steps
(`_micro_batch_size`), what can be split exactly (`_exact_split`), and
the agreement of every worker on a multi-worker job (`_agreed_step`).
docs/architecture.md draws them.
"""

from tfmemsafe.recovery._exact_split import after_an_oom
from tfmemsafe.recovery._exact_split import split_refusal
from tfmemsafe.recovery._on_oom import SplitBatchOnOOM

__all__ = [
    "SplitBatchOnOOM",
    "after_an_oom",
    "split_refusal",
]
