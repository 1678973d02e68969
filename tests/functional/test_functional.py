"""The pure statistics against independent computations (torch.linalg, get_total_norm, numpy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import reference_total_norm
from torch import nn

from lightning_gradguard.functional import (
    device_histograms,
    foreach_norms,
    group_index,
    grouped_norms,
    layer_name,
    layer_names,
    nonfinite_counts,
    percentile,
    suggest_clip_value,
    total_norm,
)


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (3,), (7, 2, 2), (1,), (11,)]
    return [torch.randn(s, generator=g) * (10.0**i) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0, 3.0])
def test_foreach_norms_match_vector_norm(norm_type: float) -> None:
    ts = _tensors()
    got = foreach_norms(ts, norm_type)
    want = torch.stack([torch.linalg.vector_norm(t, ord=norm_type) for t in ts])
    torch.testing.assert_close(got, want)


def test_foreach_norms_mixed_dtypes_keep_order() -> None:
    ts = _tensors()
    mixed = [ts[0].double(), ts[1], ts[2].bfloat16(), ts[3], ts[4].double()]
    got = foreach_norms(mixed)
    want = torch.stack([torch.linalg.vector_norm(t.double()).float() for t in mixed])
    torch.testing.assert_close(got, want, rtol=1e-2, atol=0)
    assert got.dtype == torch.float32


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_grouped_norms_total_equals_get_total_norm(norm_type: float) -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
    model(torch.randn(4, 6)).pow(2).sum().backward()
    names = [n for n, _ in model.named_parameters()]
    grads = [p.grad for p in model.parameters()]
    labels, index = group_index(layer_names(names))
    assert labels == ["0", "2.0", "2.1"]
    per_param, per_layer, total = grouped_norms(grads, index, norm_type)
    torch.testing.assert_close(total, reference_total_norm(grads, norm_type=norm_type))
    for j, label in enumerate(labels):
        members = [g.reshape(-1) for n, g in zip(names, grads, strict=True) if n.rsplit(".", 1)[0] == label]
        torch.testing.assert_close(per_layer[j], torch.linalg.vector_norm(torch.cat(members), ord=norm_type))
    torch.testing.assert_close(total_norm(per_param, norm_type), total)


def test_layer_name_depth_and_root_parameters() -> None:
    assert layer_name("encoder.blocks.3.attn.qkv.weight") == "encoder.blocks.3.attn.qkv"
    assert layer_name("encoder.blocks.3.attn.qkv.weight", depth=2) == "encoder.blocks"
    assert layer_name("encoder.blocks.3.attn.qkv.weight", depth=9) == "encoder.blocks.3.attn.qkv"
    assert layer_name("pos_embedding") == "pos_embedding"
    with pytest.raises(ValueError, match="depth"):
        layer_name("a.b", depth=0)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(4))  # a parameter on a container: its own layer
        self.act = nn.ReLU()


class _Scale(nn.Module):
    """A leaf with a parameter-free child: its parameter still names the module."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.act = nn.GELU()


class _ViTLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(4))
        self.net = nn.Module()
        self.net.pos_embed = nn.Parameter(torch.zeros(4))
        self.net.patch = nn.Linear(4, 4)
        self.net.blocks = nn.ModuleList(_Block() for _ in range(11))
        self.net.scale = _Scale()


def _structural_layers(model: nn.Module, depth: int | None) -> list[str]:
    """Each parameter's layer read from the module tree itself (not from the names)."""
    out = []
    for owner_name, owner in model.named_modules():
        container = any(any(True for _ in c.parameters()) for c in owner.children())
        for local, _ in owner.named_parameters(recurse=False):
            full = f"{owner_name}.{local}" if owner_name else local
            label = full if (container or not owner_name) else owner_name
            out.append((full, label if depth is None else ".".join(label.split(".")[:depth])))
    order = [n for n, _ in model.named_parameters()]
    return [dict(out)[n] for n in order]


@pytest.mark.parametrize("depth", [None, 1, 2, 3])
def test_a_parameter_on_a_container_is_its_own_layer(depth: int | None) -> None:
    model = _ViTLike()
    names = [n for n, _ in model.named_parameters()]
    assert layer_names(names, depth) == _structural_layers(model, depth)
    labels = layer_names(names)
    assert labels[:3] == ["cls_token", "net.pos_embed", "net.patch"]
    assert "net" not in labels and "net.blocks.10.gain" in labels and "net.blocks.1.gain" in labels
    assert labels.count("net.scale") == 1  # a leaf's parameter-free children do not make it a container


def test_container_of_a_subset_is_told_by_the_other_names() -> None:
    names = ["net.pos_embed", "net.blocks.0.weight"]
    assert layer_names(names[:1]) == ["net"]  # alone, the names cannot tell
    assert layer_names(names[:1], among=names) == ["net.pos_embed"]
    assert layer_name("net.pos_embed", container=True) == "net.pos_embed"
    assert layer_name("net.pos_embed", depth=1, container=True) == "net"
    # FSDP1's flat parameter of a wrapped unit stands for its module, nested units or not
    assert layer_names(["net._flat_param", "net.inner._flat_param"]) == ["net", "net.inner"]


def test_nonfinite_values_propagate_and_are_counted() -> None:
    ts = _tensors()
    ts[1][0] = float("nan")
    ts[2][0, 0, 0] = float("inf")
    ts[2][1, 0, 1] = float("-inf")
    norms = foreach_norms(ts)
    assert torch.isnan(norms[1]) and torch.isinf(norms[2])
    assert torch.isfinite(norms[[0, 3, 4]]).all()
    assert nonfinite_counts(ts).tolist() == [0, 1, 2, 0, 0]


@pytest.mark.parametrize("method", ["fused", "per_tensor"])
def test_histograms_match_numpy(method: str) -> None:
    ts = _tensors()
    ts[0][0, 0] = float("nan")
    spec = device_histograms(ts, bins=10, method=method)
    for i, t in enumerate(ts):
        x = t.reshape(-1).numpy()
        x = x[np.isfinite(x)]
        counts, edges = np.histogram(x, bins=10, range=(x.min(), x.max()))
        if x.min() == x.max():  # one value: all in one bucket
            assert spec.counts[i].sum() == len(x)
            continue
        np.testing.assert_allclose(spec.edges[i].numpy(), edges, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(spec.counts[i].numpy(), counts)
        lo, hi, num, s, sq = spec.stats[i].tolist()
        assert num == len(x)
        np.testing.assert_allclose([lo, hi, s, sq], [x.min(), x.max(), x.sum(), (x * x).sum()], rtol=1e-4)
    assert spec.nonfinite.tolist() == [1, 0, 0, 0, 0]


@pytest.mark.parametrize("method", ["fused", "per_tensor"])
def test_log10_histogram_spans_decades_and_skips_zeros(method: str) -> None:
    t = torch.tensor([0.0, 1e-8, 1e-6, 1e-4, 1e-2, 1.0, -1.0])
    spec = device_histograms([t], bins=8, log10=True, method=method)
    lo, hi, num, _, _ = spec.stats[0].tolist()
    assert num == 6  # the zero is not on a log axis
    assert lo == pytest.approx(-8.0) and hi == pytest.approx(0.0)
    assert spec.counts[0].sum() == 6


def test_percentile_and_suggested_clip() -> None:
    x = torch.arange(1, 101, dtype=torch.float32)
    x[3] = float("nan")
    p = percentile(x, [50, 90])
    finite = x[torch.isfinite(x)].numpy()
    np.testing.assert_allclose(p.numpy(), np.percentile(finite, [50, 90]), rtol=1e-5)
    norms = torch.tensor([0.5, 0.7, 1.2, 1.9, 2.2, 0.8, 1.1, 1.4, 1.0, 50.0])
    suggested = suggest_clip_value(norms)
    assert suggested is not None
    assert np.quantile(norms.numpy(), 0.9) <= suggested < 1.1 * np.quantile(norms.numpy(), 0.9)
    assert suggest_clip_value([float("nan")]) is None


def test_bad_norm_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="norm_type"):
        foreach_norms([torch.ones(2)], 0.0)


def test_histograms_in_chunks_equal_one_pass() -> None:
    ts = _tensors()
    whole = device_histograms(ts, bins=7, method="fused")
    chunked = device_histograms(ts, bins=7, chunk_elements=20, method="fused")
    for field in ("stats", "edges", "counts", "nonfinite"):
        torch.testing.assert_close(getattr(chunked, field), getattr(whole, field))


@pytest.mark.parametrize("log10", [False, True])
def test_fused_and_per_tensor_histograms_agree(log10: bool) -> None:
    ts = _tensors()
    ts[1][0] = float("inf")
    fused = device_histograms(ts, bins=9, log10=log10, method="fused")
    per = device_histograms(ts, bins=9, log10=log10, method="per_tensor")
    for field in ("stats", "edges", "counts", "nonfinite"):
        torch.testing.assert_close(getattr(per, field), getattr(fused, field), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="method"):
        device_histograms(ts, method="gpu")


def test_sparse_gradients_have_the_norms_of_their_dense_form() -> None:
    emb = torch.nn.Embedding(50, 4, sparse=True)
    emb(torch.tensor([[1, 3, 3, 7]])).pow(2).sum().backward()
    grad = emb.weight.grad
    assert grad is not None and grad.is_sparse
    dense = grad.to_dense()
    for norm_type in (2.0, math.inf):
        torch.testing.assert_close(
            foreach_norms([grad, dense], norm_type), torch.linalg.vector_norm(dense, norm_type).repeat(2)
        )
    assert nonfinite_counts([grad]).tolist() == [0]
    spec = device_histograms([grad], bins=4)
    assert spec.stats[0, 2] == 12  # the stored values of rows 1, 3 and 7 (row 3 coalesced), not the zeros


def test_layer_moments_counts_the_entries_adam_holds_per_layer() -> None:
    """A layer split between optimizers (Muon's matrix, AdamW's bias: one state for both in the sweep's
    ViT + Muon) is averaged, and counted, over the entries with a second moment only: the eps rule weighs
    a layer by those (a key bias that softmax ignores is 64 entries, not the 4160 of its layer)."""
    from lightning_gradguard.functional.optimizer_state import layer_moments

    labels, index = ["k_proj", "norm"], [0, 0, 1]  # k_proj.weight, k_proj.bias, norm.weight
    second = {1: (64 * 1e-20, 64, 1.0, 1e-8), 2: (32 * 1e-6, 32, 1.0, 1e-8)}  # sum(v), numel, 1-b2^t, eps
    m = layer_moments(labels, index, {}, {}, second)
    assert m.entries == {"k_proj": 64, "norm": 32}
    assert m.exp_avg_sq_rms == pytest.approx({"k_proj": 1e-10, "norm": 1e-3})


def test_class_profile_sums_each_class_s_centred_scaled_scores_as_a_loop_does() -> None:
    from lightning_gradguard.functional.health import class_profile

    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(16, 5, generator=g) * 3, torch.randint(0, 5, (16,), generator=g)
    targets[0] = -100  # an ignore_index counts for nothing
    sums, counts = class_profile(logits, targets)
    z = logits.double().numpy()
    z = z - z.mean(axis=0, keepdims=True)
    z = z - z.mean(axis=1, keepdims=True)
    z = z / np.sqrt((z**2).mean())
    want_sums, want_counts = np.zeros((5, 5)), np.zeros(5)
    for i in range(16):
        if int(targets[i]) >= 0:
            want_sums[int(targets[i])] += z[i]
            want_counts[int(targets[i])] += 1
    np.testing.assert_allclose(sums.double().numpy(), want_sums, atol=1e-5)
    np.testing.assert_allclose(counts.numpy(), want_counts)
    # a shift per row (log-probabilities for logits), one shared by the batch and a scale change nothing
    shifted = 7 * logits.log_softmax(1) + torch.randn(1, 5, generator=g)
    torch.testing.assert_close(class_profile(shifted, targets)[0], sums, atol=1e-5, rtol=1e-5)


def test_label_lean_is_rare_among_relabelings_only_for_outputs_that_learned_the_labels() -> None:
    from lightning_gradguard.functional.health import label_lean

    g = torch.Generator().manual_seed(0)
    # a profile whose every class scores its own class highest: the labels beat every relabeling
    for k, rarest in [(4, 1 / 24), (6, 1 / 720), (10, 1 / 2001)]:
        lean, p = label_lean(torch.eye(k) * k - 1, torch.ones(k))
        assert lean == pytest.approx(k - 1) and p == pytest.approx(rarest)
    # a profile blind to the names of the classes (random structure, as an initialization gives): p is
    # uniform, so about 5 % of them fall at 0.05 or under (binomial: 200 draws, within 4 standard errors)
    ps = [label_lean(torch.randn(8, 8, generator=g) * 3, torch.ones(8))[1] for _ in range(200)]
    assert 0.0 < sum(p <= 0.05 for p in ps) / 200 < 0.05 + 4 * math.sqrt(0.05 * 0.95 / 200)
    # the profile's counts weigh its sums (a class mean), and classes never seen are left out
    sums, counts = torch.eye(5) * 2 * 5, torch.tensor([2.0, 2, 2, 2, 0])
    assert label_lean(sums, counts)[0] == pytest.approx(5.0)
    # 2 or 3 classes: no relabeling is ever rare
    assert label_lean(torch.eye(3), torch.ones(3)) == (pytest.approx(math.nan, nan_ok=True), 1.0)
