"""Node-keyed dropout: the right keep rate, and one mask per (seed, step, layer, node, feature)."""

from __future__ import annotations

import math

import pytest
import torch

from betty_trainer.models import NodeDropout, keyed_uniform, set_dropout_key


def test_keyed_uniform_is_uniform():
    u = keyed_uniform(seed=1, step=2, layer=0, node_ids=torch.arange(1000), num_features=500)
    n = u.numel()
    # mean of U(0,1) has std 1/sqrt(12 n); 5 sigma
    assert abs(u.mean().item() - 0.5) <= 5 / math.sqrt(12 * n)
    # each decile holds 10% ± 5 binomial sigma
    counts = torch.histc(u, bins=10, min=0, max=1)
    sigma = math.sqrt(n * 0.1 * 0.9)
    assert (counts - n * 0.1).abs().max() <= 5 * sigma
    # neighbouring rows and columns are uncorrelated (|r| ≤ 5/sqrt(n))
    centred = u - 0.5
    for a, b in ((centred[:-1], centred[1:]), (centred[:, :-1], centred[:, 1:])):
        r = (a * b).mean() / (centred.var())
        assert abs(r.item()) <= 5 / math.sqrt(a.numel())


def test_mask_depends_on_node_not_on_batch_composition():
    nodes = torch.tensor([5, 17, 2**40 + 3, 99])
    full = keyed_uniform(0, 3, 1, nodes, 64)
    part = keyed_uniform(0, 3, 1, nodes[[2, 0]], 64)
    assert torch.equal(part, full[[2, 0]])
    for other in ((1, 3, 1), (0, 4, 1), (0, 3, 0)):
        assert not torch.equal(keyed_uniform(*other, nodes, 64), full)


def test_node_dropout_keep_rate_scaling_and_eval():
    layer = NodeDropout(0.3)
    set_dropout_key(layer, seed=4, step=0)
    h = torch.ones(2000, 100)
    out = layer(h, torch.arange(2000), layer=0)
    kept = (out > 0).float().mean().item()
    assert abs(kept - 0.7) <= 5 * math.sqrt(0.7 * 0.3 / h.numel())  # the keep rate is binomial: 5 sigma
    assert torch.allclose(out[out > 0], torch.full_like(out[out > 0], 1 / 0.7))
    layer.eval()
    assert torch.equal(layer(h, torch.arange(2000), layer=0), h)


def test_chunked_mask_equals_whole_mask(monkeypatch):
    from betty_trainer.models import dropout

    monkeypatch.setattr(dropout, "compiled_kernels", lambda device, dtype: False)  # the chunked tensor path
    layer = NodeDropout(0.5)
    set_dropout_key(layer, seed=1, step=5)
    h, nodes = torch.randn(300, 70), torch.randperm(1000)[:300]
    whole = layer(h, nodes, layer=1)
    monkeypatch.setattr(dropout, "MASK_CHUNK_ELEMENTS", 1000)  # 14 rows per chunk, ragged last chunk
    assert torch.equal(layer(h, nodes, layer=1), whole)
    expected = h * (keyed_uniform(1, 5, 1, nodes, 70) >= 0.5) / 0.5
    assert torch.allclose(whole, expected)


def test_backward_applies_the_same_mask_and_keeps_no_mask():
    """The gradient is the forward's mask applied to the incoming gradient, and what autograd keeps for
    it is the node ids alone: the mask is remade from the key in backward, never stored."""
    layer = NodeDropout(0.4)
    set_dropout_key(layer, seed=3, step=7)
    h = torch.randn(500, 90, requires_grad=True)
    nodes = torch.randperm(5000)[:500]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(h, nodes, layer=2)
    assert len(saved) == 1 and saved[0] is nodes
    weights = torch.randn(500, 90)
    (out * weights).sum().backward()
    keep = (keyed_uniform(3, 7, 2, nodes, 90) >= 0.4).float()
    # float32 defaults (rtol 1.3e-6, atol 1e-5): the layer may scale by 1/0.6 where this divides, one rounding apart
    torch.testing.assert_close(out, h.detach() * keep / 0.6)
    torch.testing.assert_close(h.grad, weights * keep / 0.6)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_compiled_cpu_kernel_gives_the_tensor_path_bits(monkeypatch, p):
    """The fused CPU kernel (hash, mask and scale in one pass) and the chunked tensor ops (the path on
    other devices) produce identical bits, signed zeros included, out of place and in place."""
    from betty_trainer.models import dropout

    h = torch.randn(1000, 77, generator=torch.Generator().manual_seed(0))
    nodes = torch.randint(0, 1 << 40, (1000,), generator=torch.Generator().manual_seed(1))
    assert dropout.compiled_kernels(h.device, h.dtype)
    fused = dropout.apply_keyed_mask(h, nodes, 3, 1 << 33, 2, p)
    in_place = dropout.apply_keyed_mask(h.clone(), nodes, 3, 1 << 33, 2, p, inplace=True)
    monkeypatch.setattr(dropout, "compiled_kernels", lambda device, dtype: False)
    tensor_ops = dropout.apply_keyed_mask(h, nodes, 3, 1 << 33, 2, p)
    assert torch.equal(fused.view(torch.int32), tensor_ops.view(torch.int32))
    assert torch.equal(in_place.view(torch.int32), tensor_ops.view(torch.int32))
    assert not torch.equal(fused, h)

