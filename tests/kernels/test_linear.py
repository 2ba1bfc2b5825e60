import pytest
import torch
import torch.nn.functional as F

from kernels.linear import LINEAR, linear_onednn, onednn_works, resolve_linear


def _weights(gen, sizes, inner, bias):
    ws = [torch.randn(n, inner, generator=gen) * 0.05 for n in sizes]
    bs = [torch.randn(n, generator=gen) if bias else None for n in sizes]
    return ws, bs


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_onednn_grouped_projection_matches_plain_linear(bias, rows):
    assert onednn_works(torch.float32), "this torch build on this CPU should run oneDNN"
    gen = torch.Generator().manual_seed(rows)
    ws, bs = _weights(gen, [96, 32, 32], 80, bias)
    x = torch.randn(rows, 80, generator=gen)
    got = LINEAR["onednn"](ws, bs)(x)
    ref = LINEAR["reference"](ws, bs)(x)
    assert [g.shape for g in got] == [(rows, 96), (rows, 32), (rows, 32)]
    for g, r, w, b in zip(got, ref, ws, bs):
        assert torch.equal(r, F.linear(x, w, b))
        assert torch.allclose(g, r, atol=1e-5, rtol=1e-5)


def test_onednn_projection_keeps_a_bias_on_one_member_only():
    gen = torch.Generator().manual_seed(3)
    ws, _ = _weights(gen, [16, 8], 24, False)
    bias = torch.full((8,), 5.0)
    x = torch.randn(2, 24, generator=gen)
    a, b = linear_onednn(ws, [None, bias])(x)
    assert torch.allclose(a, F.linear(x, ws[0]), atol=1e-5)
    assert torch.allclose(b, F.linear(x, ws[1]) + 5.0, atol=1e-5)


def test_resolve_linear():
    cpu = torch.device("cpu")
    assert resolve_linear("auto", cpu, torch.float32) == "onednn"
    assert resolve_linear("reference", cpu, torch.float32) == "reference"
    assert resolve_linear("auto", torch.device("meta"), torch.float32) == "reference"
    with pytest.raises(ValueError, match="linear must be"):
        resolve_linear("fast", cpu, torch.float32)
    with pytest.raises(ValueError, match="runs on CPU"):
        linear_onednn([torch.empty(4, 4, device="meta")], [None])


def test_a_packed_projection_runs_inside_a_compiled_graph_as_it_runs_outside():
    """The compiled step calls oneDNN's packed weights through one opaque op (inductor takes no packed tensor as a
    graph input): whole-graph, the same outputs as the direct call, and a projection let go leaves no weights
    behind in the op's table."""
    import gc

    from kernels import linear

    gen = torch.Generator().manual_seed(5)
    ws, bs = _weights(gen, [24, 8], 16, True)
    packed = linear_onednn(ws, bs)
    x = torch.randn(3, 16, generator=gen)
    step = torch.compile(lambda x: [y * 2 for y in packed.traced(x)], fullgraph=True, dynamic=False)
    got = step(x)
    want = packed(x)
    assert [g.shape for g in got] == [(3, 24), (3, 8)]
    assert all(torch.allclose(g, 2 * w, atol=1e-5) for g, w in zip(got, want))
    assert linear._PACKED[packed.handle] is packed

    def let_go() -> int:
        return linear_onednn(ws, bs).handle

    handle = let_go()
    gc.collect()
    assert handle not in linear._PACKED and packed.handle in linear._PACKED
