"""Conditioning row operations and the FlowModel protocol check."""
import pytest
import torch

from flowforge.models.base import Conditioning, FlowModel


def _cond(b=3, s=4, d=5, p=6, with_negative=True):
    g = torch.Generator().manual_seed(b)
    neg = Conditioning(torch.randn(b, s, d, generator=g), torch.randn(b, p, generator=g)) if with_negative else None
    return Conditioning(torch.randn(b, s, d, generator=g), torch.randn(b, p, generator=g),
                        torch.randint(0, 2, (b, s), generator=g), negative=neg)


def test_index_selects_rows_everywhere():
    c = _cond()
    sub = c.index(torch.tensor([2, 0]))
    assert torch.equal(sub.prompt_embeds, c.prompt_embeds[[2, 0]])
    assert torch.equal(sub.pooled, c.pooled[[2, 0]])
    assert torch.equal(sub.mask, c.mask[[2, 0]])
    assert torch.equal(sub.negative.pooled, c.negative.pooled[[2, 0]])
    assert torch.equal(c.index([1]).prompt_embeds, c.prompt_embeds[1:2])


def test_repeat_interleave_and_cat():
    c = _cond(b=2)
    r = c.repeat_interleave(3)
    assert r.batch_size == 6
    assert torch.equal(r.pooled, c.pooled.repeat_interleave(3, dim=0))
    assert torch.equal(r.negative.prompt_embeds, c.negative.prompt_embeds.repeat_interleave(3, dim=0))
    both = Conditioning.cat([c, c.index([1])])
    assert both.batch_size == 3
    assert torch.equal(both.prompt_embeds[2], c.prompt_embeds[1])
    assert torch.equal(both.negative.pooled[2], c.negative.pooled[1])
    with pytest.raises(ValueError, match="negative"):
        Conditioning.cat([c, _cond(b=2, with_negative=False)])


def test_to_casts_floats_but_not_mask():
    c = _cond().to("cpu", torch.bfloat16)
    assert c.prompt_embeds.dtype == torch.bfloat16 and c.pooled.dtype == torch.bfloat16
    assert c.negative.prompt_embeds.dtype == torch.bfloat16
    assert c.mask.dtype == torch.int64


def test_shape_validation():
    with pytest.raises(ValueError, match="prompt_embeds"):
        Conditioning(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="pooled"):
        Conditioning(torch.zeros(2, 3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="negative"):
        Conditioning(torch.zeros(2, 3, 4), negative=Conditioning(torch.zeros(1, 3, 4)))


def test_protocol_runtime_check():
    class Missing:
        transformer = torch.nn.Linear(1, 1)

    assert not isinstance(Missing(), FlowModel)
