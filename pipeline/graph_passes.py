"""What the pipeline adds to inductor's compile of the model (`compile_options`): graph rewrites
the model's code cannot express, applied from outside like compile itself.

`TiedGradInPlace`: with the token embedding tied to the LM head, the weight's gradient is the
head's (V x D, from the loss) plus the embedding's, which autograd's decomposition scatters into a
V x D buffer of zeros of its own: a pass writing V x D zeros, a pass reading both sums and writing
a third (at GPT-2's vocabulary, 51 MB each in fp32) for a scatter of B x T rows. Rewritten, the
rows are scattered into the head's gradient itself: one pass over V x D, and one V x D buffer
fewer at the end of backward (bench/results/step_ab_zen4.txt).

The pass's `uuid` is also the cache salt of what the pipeline compiles: inductor's FX graph
cache keys a compiled graph on its traced code, where one of our custom ops is only a name, so
after a change to an op's body (or to what its fake returns) the cache served the graph built
for the old one (stop 38: int32 kernels reading fp32 columns). The uuid hashes the files that
define our ops and this pass: any edit to them compiles afresh.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten
SCATTER_ADD = aten._unsafe_masked_index_put_accumulate.default  # (into, mask, indices, rows)


def _zeros(node) -> bool:
    return (isinstance(node, torch.fx.Node) and node.target is aten.full.default
            and node.args[1] == 0)


def _scatter_into_zeros(node) -> bool:
    """A scatter-add whose only use is one sum, into zeros made for it alone."""
    return (isinstance(node, torch.fx.Node) and node.target is SCATTER_ADD
            and len(node.users) == 1 and _zeros(node.args[0]) and len(node.args[0].users) == 1)


def _same_tensor_type(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.shape == vb.shape and va.dtype == vb.dtype)


class TiedGradInPlace(CustomGraphPass):
    """add(other, scatter_add(zeros, mask, indices, rows)) -> scatter_add(other, mask, indices,
    rows), where `other` has the sum's shape and dtype (the functional op leaves `other` as it
    is; inductor writes it into the output once, then scatters the rows into that)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for add in list(graph.nodes):
            if add.target is not aten.add.Tensor or len(add.args) != 2 or add.kwargs:
                continue
            for scatter, other in (add.args, add.args[::-1]):
                if (_scatter_into_zeros(scatter) and isinstance(other, torch.fx.Node)
                        and _same_tensor_type(other, add) and _same_tensor_type(scatter, add)):
                    zeros = scatter.args[0]
                    with graph.inserting_before(add):
                        into = graph.call_function(SCATTER_ADD, (other, *scatter.args[1:]))
                    into.meta = dict(add.meta)
                    add.replace_all_uses_with(into)
                    for dead in (add, scatter, zeros):
                        graph.erase_node(dead)
                    break

    def uuid(self) -> str:  # (inductor's FX graph cache keys compiled graphs on it)
        return get_hash_for_files(tuple(map(str, COMPILED_SOURCES))).hex()


# Every file that defines an op or pass of ours which a compiled graph can contain
# (tests/test_graph_passes.py checks that no custom op lives elsewhere).
COMPILED_SOURCES = tuple(Path(__file__).resolve().with_name(f) for f in
                         ("graph_passes.py", "loss.py", "attention.py"))


def compile_options() -> dict:
    """inductor options for every torch.compile of what trains (pipeline.parallelize, and the
    loss compiled on its own: pipeline.loss.select_loss)."""
    return {"post_grad_custom_pre_pass": TiedGradInPlace()}
