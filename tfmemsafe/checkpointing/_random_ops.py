"""TensorFlow's stateful random ops: the randomness a recomputation changes."""

from __future__ import annotations

# TensorFlow ops whose random numbers come from hidden state. A block that
# uses them gives different numbers when it is recomputed, so its gradient
# would not match its forward pass.
_STATEFUL_RANDOM_OPS = frozenset(
    [
        "Multinomial",
        "ParameterizedTruncatedNormal",
        "RandomCrop",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
        "RandomShuffle",
        "RandomStandardNormal",
        "RandomUniform",
        "RandomUniformInt",
        "RngReadAndSkip",
        "RngSkip",
        "StatefulRandomBinomial",
        "StatefulStandardNormal",
        "StatefulStandardNormalV2",
        "StatefulTruncatedNormal",
        "StatefulUniform",
        "StatefulUniformFullInt",
        "StatefulUniformInt",
        "TruncatedNormal",
    ]
)


def stateful_random_op_types(graph, operations) -> set[str]:
    """The stateful random op types among `operations` and their functions."""
    found = set()
    library = None
    for op in operations:
        if op.type in _STATEFUL_RANDOM_OPS:
            found.add(op.type)
        function_names = _called_functions(op.node_def)
        if function_names:
            if library is None:
                library = {
                    f.signature.name: f
                    for f in graph.as_graph_def().library.function
                }
            found |= _stateful_random_ops_in_functions(function_names, library)
    return found


def _stateful_random_ops_in_functions(names, library) -> set[str]:
    found, seen, pending = set(), set(), list(names)
    while pending:
        name = pending.pop()
        if name in seen or name not in library:
            continue
        seen.add(name)
        for node in library[name].node_def:
            if node.op in _STATEFUL_RANDOM_OPS:
                found.add(node.op)
            pending.extend(_called_functions(node))
    return found


def _called_functions(node_def) -> list[str]:
    names = []
    for value in node_def.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names.extend(f.name for f in value.list.func)
    return names
