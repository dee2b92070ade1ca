import pytest
import torch

from sparsekit.prune.patterns import (
    is_nm,
    lowest_k_masks,
    nm_mask,
    parse_pattern,
    prune_count,
    row_mask,
)


@pytest.mark.parametrize("text,expected", [("2:4", (2, 4)), ("1:4", (1, 4)), ("4:8", (4, 8))])
def test_parse_nm(text, expected):
    assert parse_pattern(text) == expected


@pytest.mark.parametrize("bad", ["3:2", "4:4", "0:4", "2-4", "structured", "2:"])
def test_parse_rejects(bad):
    with pytest.raises(ValueError, match="pattern"):
        parse_pattern(bad)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8), (3, 8)])
def test_nm_mask_keeps_top_n_per_group(n, m):
    scores = torch.rand(16, 8 * m)
    mask = nm_mask(scores, n, m)
    groups = mask.reshape(16, -1, m)
    assert (groups.sum(-1) == n).all()
    # reference: every kept score is >= every pruned score in its group
    g = scores.reshape(16, -1, m)
    kept_min = torch.where(groups, g, torch.inf).amin(-1)
    pruned_max = torch.where(~groups, g, -torch.inf).amax(-1)
    assert (kept_min >= pruned_max).all()
    assert is_nm(scores * mask, n, m)


def test_nm_mask_conv_groups_run_along_flattened_input():
    # conv weight (out=2, in=2, k=2): flattened input order is (in, k) -> groups of 4 = one row
    scores = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[4.0, 3.0], [2.0, 1.0]]])
    mask = nm_mask(scores, 2, 4)
    assert mask.shape == scores.shape
    assert mask[0].flatten().tolist() == [False, False, True, True]
    assert mask[1].flatten().tolist() == [True, True, False, False]


def test_nm_mask_respects_existing_mask():
    scores = torch.rand(4, 8)
    keep = torch.ones(4, 8, dtype=torch.bool)
    keep[:, 0] = False
    scores[:, 0] = 10.0  # highest score, but already pruned: must stay pruned
    mask = nm_mask(scores, 2, 4, keep)
    assert not mask[:, 0].any()


def test_lowest_k_exact_count_and_matches_sorted_reference():
    scores = [torch.rand(37, 11), torch.rand(5, 3, 3) * 2, torch.rand(100)]
    total = sum(s.numel() for s in scores)
    k = prune_count(total, 0.63)
    masks = lowest_k_masks(scores, k)
    assert sum(int((~m).sum()) for m in masks) == k
    flat = torch.cat([s.flatten().double() for s in scores])
    threshold = flat.sort().values[k - 1]
    for s, m in zip(scores, masks):
        assert (s[~m].double() <= threshold).all()
        assert (s[m].double() >= threshold).all()


def test_lowest_k_ties_exact():
    scores = [torch.zeros(10), torch.ones(10)]
    masks = lowest_k_masks(scores, 4)
    assert int((~masks[0]).sum()) == 4 and masks[1].all()
    masks = lowest_k_masks([torch.full((10,), 0.5)], 7)
    assert int((~masks[0]).sum()) == 7


def test_lowest_k_already_pruned_first():
    s = torch.rand(50)
    keep = torch.ones(50, dtype=torch.bool)
    keep[s.argsort(descending=True)[:5]] = False  # the 5 largest were pruned earlier
    (m,) = lowest_k_masks([s], 20, [keep])
    assert not m[~keep].any()
    assert int((~m).sum()) == 20


def test_row_mask_per_row_count():
    scores = torch.rand(6, 20)
    mask = row_mask(scores, 0.3)
    assert ((~mask).sum(1) == prune_count(20, 0.3)).all()
