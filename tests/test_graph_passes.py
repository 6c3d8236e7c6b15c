"""pipeline.graph_passes: the rewrites inductor runs on the compiled model (what they match,
what they leave alone, and that the compiled step's numbers stay eager's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from model import GPT, ModelConfig
from pipeline import graph_passes as gp
from pipeline import parallelize as par

aten = torch.ops.aten


def _sum_of_scatter(other_shape=(8, 4), zeros_shape=(8, 4), dtype=torch.float32,
                     zeros_users=1):
    """other + scatter_add(zeros, mask, [indices], rows), each node's meta 'val' set as
    inductor's post-grad graph has it."""
    g = torch.fx.Graph()

    def node(target, args, val):
        n = g.call_function(target, args) if target else g.placeholder(args)
        n.meta["val"] = val
        return n

    other = node(None, "other", torch.empty(other_shape, dtype=dtype))
    mask = node(None, "mask", torch.empty(5, 1, dtype=torch.bool))
    idx = node(None, "idx", torch.empty(5, dtype=torch.long))
    rows = node(None, "rows", torch.empty(5, 4, dtype=dtype))
    zeros = node(aten.full.default, (list(zeros_shape), 0), torch.empty(zeros_shape, dtype=dtype))
    put = node(gp.SCATTER_ADD, (zeros, mask, [idx], rows), torch.empty(zeros_shape, dtype=dtype))
    out = node(aten.add.Tensor, (other, put), torch.empty(torch.broadcast_shapes(other_shape,
                                                                                 zeros_shape)))
    for _ in range(zeros_users - 1):
        node(aten.neg.default, (zeros,), torch.empty(zeros_shape, dtype=dtype))
    g.output(out)
    return g


def _targets(g):
    return [n.target for n in g.nodes if n.op == "call_function"]


def test_the_scatter_goes_into_the_other_summand_not_into_zeros():
    g = _sum_of_scatter()
    gp.TiedGradInPlace()(g)
    assert _targets(g) == [gp.SCATTER_ADD]
    (put,) = [n for n in g.nodes if n.target is gp.SCATTER_ADD]
    assert put.args[0].name == "other" and put.args[1].name == "mask"
    assert put.args[2][0].name == "idx" and put.args[3].name == "rows"
    assert g.output_node().args[0] is put


@pytest.mark.parametrize("case", [
    dict(other_shape=(1, 4)),  # other broadcast: the sum is not other's shape
    dict(zeros_users=2),  # the zeros read elsewhere too
])
def test_a_sum_that_is_not_one_gradient_into_zeros_is_left_alone(case):
    g = _sum_of_scatter(**case)
    before = _targets(g)
    gp.TiedGradInPlace()(g)
    assert _targets(g) == before


def _compiled_grads(tied: bool):
    """The tied (or untied) weight's gradients of a small GPT, eager and compiled by
    pipeline.parallelize.compile_regions, and the scatter-adds of the compiled backward's graph
    after the pass."""
    cfg = ModelConfig(vocab_size=1000, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                      max_seq_len=64, tie_embeddings=tied)
    scatters = []

    class Recording(CustomGraphPass):  # runs after inductor's passes and ours
        def __call__(self, graph):
            scatters.extend(n for n in graph.nodes if n.target is gp.SCATTER_ADD)

        def uuid(self):
            return None

    g = torch.Generator().manual_seed(0)
    x_BT, y_BT = torch.randint(0, 1000, (2, 2, 48), generator=g)
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        if compiled:
            torch._dynamo.reset()
            par.compile_regions(model, per_block=False)
        with torch._inductor.config.patch(fx_graph_cache=False,
                                          post_grad_custom_post_pass=Recording()):
            model(x_BT, y_BT).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    return grads, scatters


def _assert_same_grads(compiled, eager):
    for name, grad in eager.items():
        torch.testing.assert_close(compiled[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_tied_weights_two_gradients_are_one_scatter_into_the_heads():
    (eager, compiled), scatters = _compiled_grads(True)
    assert len(scatters) == 1
    into = scatters[0].args[0]
    assert into.target is not aten.full.default, into.format_node()  # not into zeros of its own
    _assert_same_grads(compiled, eager)


def test_an_untied_embeddings_gradient_stays_its_own():
    (eager, compiled), scatters = _compiled_grads(False)
    assert len(scatters) == 1 and scatters[0].args[0].target is aten.full.default
    _assert_same_grads(compiled, eager)


def test_every_op_of_ours_a_graph_can_hold_salts_the_compile_cache():
    """TiedGradInPlace.uuid hashes COMPILED_SOURCES, which inductor's FX graph cache keys on. A
    custom op or pass defined in a file outside them could change its body while the cache kept
    serving the graph compiled for the old one."""
    root = Path(gp.__file__).resolve().parents[1]
    defining = {p for pkg in ("pipeline", "model") for p in (root / pkg).rglob("*.py")
                if "torch.library" in p.read_text() or "CustomGraphPass" in p.read_text()}
    assert defining == set(gp.COMPILED_SOURCES)
    assert len(gp.TiedGradInPlace().uuid()) == 64  # a sha256 of their contents
