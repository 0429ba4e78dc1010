"""The packed layout (relayrl.models.packed): attention per segment over gathered keys equals attention over the
whole row under the dense segment / parent mask (outputs and gradients), with GQA and a sliding window; its
buckets cover every query once and pad each at most PAD_LIMIT; and it computes far fewer query-key pairs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from relayrl.models import CausalLM
from relayrl.models.packed import PAD_LIMIT, PackedLayout, _group
from relayrl.models.transformer import build_attention_mask, sdpa_attention

from conftest import tiny_config

pytestmark = pytest.mark.unit


def _row(g: torch.Generator):
    """A row of two prompts with 3 and 1 responses, then two sequences of their own, in that order:
    (segments, segment_ids, parent_ids, positions)."""
    segments, seg, par, pos = [], [], [], []
    off = 0

    def put(n: int, start_pos: int, parent: tuple[int, int] | None, sid: int, pid: int):
        nonlocal off
        segments.append((off, off + n, parent))
        seg.extend([sid] * n), par.extend([pid] * n), pos.extend(range(start_pos, start_pos + n))
        off += n
        return off - n, off

    sid = 0
    for responses in (3, 1):
        p = int(torch.randint(2, 7, (1,), generator=g))
        prompt = put(p, 0, None, sid, -2)
        prompt_sid = sid
        sid += 1
        for _ in range(responses):
            put(int(torch.randint(1, 9, (1,), generator=g)), p, prompt, sid, prompt_sid)
            sid += 1
    for _ in range(2):
        put(int(torch.randint(1, 12, (1,), generator=g)), 0, None, sid, -2)
        sid += 1
    return segments, torch.tensor([seg]), torch.tensor([par]), torch.tensor([pos])


@pytest.mark.parametrize("heads,kv,window", [(4, 4, None), (4, 2, None), (4, 2, 3)], ids=["mha", "gqa", "window"])
def test_attention_and_gradients_equal_the_dense_mask(heads, kv, window):
    g = torch.Generator().manual_seed(0)
    segments, seg, par, pos = _row(g)
    N, D = seg.shape[1], 8
    q = torch.randn(1, heads, N, D, generator=g, requires_grad=True)
    k = torch.randn(1, kv, N, D, generator=g, requires_grad=True)
    v = torch.randn(1, kv, N, D, generator=g, requires_grad=True)
    w = torch.randn(1, heads, N, D, generator=g)
    dense = build_attention_mask(torch.ones(1, N, dtype=torch.long), N, 0, window, seg, par, pos)
    want = sdpa_attention(q, k, v, dense, kv != heads)
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
    layout = PackedLayout.build(segments, pos[0], window)
    got = layout.attend(q, k, v, sdpa_attention, kv != heads)
    got_grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_buckets_cover_each_query_once_and_pad_at_most_the_limit():
    g = torch.Generator().manual_seed(1)
    segments, seg, _, pos = _row(g)
    layout = PackedLayout.build(segments, pos[0])
    slots = torch.cat([b.q_idx.reshape(-1)[b.read] for b in layout.buckets])
    assert sorted(slots.tolist()) == list(range(seg.shape[1]))
    shapes = [(e - s, e - s + (0 if p is None else p[1] - p[0])) for s, e, p in segments]
    for members in _group(shapes):
        if len(members) > 1:
            real = sum(shapes[i][0] * shapes[i][1] for i in members)
            padded = len(members) * max(shapes[i][0] for i in members) * max(shapes[i][1] for i in members)
            assert padded <= PAD_LIMIT * real
    # by hand, limit 2: a 4-token prompt (keys 4), responses of 3, 2, 4 (keys 7, 6, 8) taken longest keys first:
    # (4, 8) then (3, 7): 2 x 4 x 8 = 64 <= 2 (32 + 21); (2, 6): 3 x 4 x 8 = 96 <= 2 x 65; (4, 4): 128 <= 2 x 81.
    # At 1.25: 64 <= 66.25, then 96 > 81.25 closes the bucket; (2, 6) and (4, 4): 2 x 4 x 6 = 48 > 35
    assert _group([(4, 4), (3, 7), (2, 6), (4, 8)], 2.0) == [[3, 1, 2, 0]]
    assert _group([(4, 4), (3, 7), (2, 6), (4, 8)], 1.25) == [[3, 1], [2], [0]]


def test_a_prompt_with_its_responses_computes_far_fewer_pairs_than_the_dense_row():
    P, G, R = 64, 8, 32
    segments = [(0, P, None)] + [(P + i * R, P + (i + 1) * R, (0, P)) for i in range(G)]
    pos = torch.cat([torch.arange(P)] + [torch.arange(P, P + R)] * G)
    layout = PackedLayout.build(segments, pos)
    pairs = sum(b.mask.shape[0] * b.mask.shape[2] * b.mask.shape[3] for b in layout.buckets)
    assert pairs == P * P + G * R * (P + R)  # 4096 + 24576, against (P + G R)^2 = 102400 for the dense mask


def test_segments_must_cover_the_row_once():
    with pytest.raises(ValueError, match="exactly once"):
        PackedLayout.build([(0, 3, None), (2, 5, None)], torch.arange(5))
    with pytest.raises(ValueError, match="exactly once"):
        PackedLayout.build([(0, 3, None)], torch.arange(5))


def test_a_model_forward_with_the_layout_equals_each_sequence_alone():
    """Two sequences packed in one row through CausalLM (a sliding window of 4): each one's logits equal its own
    unpacked forward, and a layout built for another window is refused."""
    model = CausalLM(tiny_config(sliding_window=4))
    model.reset_parameters(std=0.3, seed=0)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(3, 60, (1, 7), generator=g), torch.randint(3, 60, (1, 5), generator=g)
    pos = torch.cat([torch.arange(7), torch.arange(5)])
    with pytest.raises(ValueError, match="sliding_window=None, but the model's is 4"):
        model(torch.cat([a, b], 1), position_ids=pos[None], layout=PackedLayout.build([(0, 7, None), (7, 12, None)],
                                                                                      pos))
    layout = PackedLayout.build([(0, 7, None), (7, 12, None)], pos, sliding_window=4)
    packed = model(torch.cat([a, b], 1), position_ids=pos[None], layout=layout)
    torch.testing.assert_close(packed[:, :7], model(a), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[:, 7:], model(b), atol=1e-5, rtol=1e-5)
    assert F.mse_loss(packed[:, 7:], model(a)[:, :5]) > 1e-3  # the two sequences do differ
