"""Each off-policy correction against values computed by hand, the presets, and the loss they enter."""

from __future__ import annotations

import math

import pytest
import torch

from rollhub.errors import InvalidInput
from rollhub.train.offpolicy import (
    PRESETS,
    Correction,
    correction_weights,
    ess_fraction,
    geo_mask,
    preset,
    seq_mask,
    seq_tis,
    token_mask,
    token_tis,
)

LN = math.log
# two sequences of three completion tokens; the second one's last position is padding (mask 0)
LOG_W = torch.tensor([[LN(0.5), LN(1.0), LN(4.0)], [LN(3.0), LN(0.25), 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_tis_truncates_each_ratio_at_the_cap() -> None:
    w, capped = token_tis(LOG_W, cap=2.0)
    assert torch.allclose(w, torch.tensor([[0.5, 1.0, 2.0], [2.0, 0.25, 1.0]]))
    assert capped.tolist() == [[False, False, True], [True, False, False]]


def test_token_mask_keeps_ratios_inside_the_bounds() -> None:
    assert token_mask(LOG_W, 0.5, 3.0).tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]


def test_sequence_corrections_use_the_product_over_completion_tokens() -> None:
    # products: 0.5 * 1 * 4 = 2 and 3 * 0.25 = 0.75 (the padded position does not count)
    w, capped = seq_tis(LOG_W, MASK, cap=1.5)
    assert torch.allclose(w, torch.tensor([[1.5] * 3, [0.75] * 3]))
    assert capped.tolist() == [[True] * 3, [False] * 3]
    assert seq_mask(LOG_W, MASK, 0.8, 5.0).tolist() == [[1.0] * 3, [0.0] * 3]


def test_geometric_mask_uses_the_mean_log_ratio() -> None:
    # geometric means: 2 ** (1/3) = 1.26 and 0.75 ** (1/2) = 0.866
    assert geo_mask(LOG_W, MASK, 0.85, 1.25).tolist() == [[0.0] * 3, [1.0] * 3]
    assert geo_mask(LOG_W, MASK, 0.85, 1.27).tolist() == [[1.0] * 3, [1.0] * 3]


def test_effective_sample_size_fraction() -> None:
    # weights 0.5, 1, 4, 3, 0.25: (8.75)^2 / (5 * 26.3125)
    assert ess_fraction(LOG_W, MASK) == pytest.approx(8.75**2 / (5 * 26.3125), rel=1e-6)
    assert ess_fraction(torch.zeros(2, 3), MASK) == pytest.approx(1.0)
    assert ess_fraction(torch.full((2, 3), 60.0), MASK) == pytest.approx(1.0)  # huge but equal: no overflow


@pytest.mark.parametrize(
    ("name", "weights", "capped", "masked"),
    [
        ("ppo", [[1, 1, 1], [1, 1, 1]], 0, 0),
        ("none", [[1, 1, 1], [1, 1, 1]], 0, 0),
        ("tis", [[0.5, 1, 2], [2, 0.25, 1]], 2, 0),
        ("decoupled", [[0.5, 1, 4], [3, 0.25, 1]], 0, 0),
        ("icepop", [[1, 1, 1], [1, 0, 1]], 0, 1),
        ("seq_tis", [[2] * 3, [0.75] * 3], 0, 0),
        ("geo_mask", [[0] * 3, [0] * 3], 0, 5),
    ],
)
def test_presets_weigh_tokens_as_documented(name: str, weights: list, capped: int, masked: int) -> None:
    w, c, m = correction_weights(PRESETS[name], LOG_W, MASK)
    assert torch.allclose(w * MASK, torch.tensor(weights, dtype=torch.float32) * MASK)
    assert (int(c.sum()), int(m.sum())) == (capped, masked)


def test_weights_are_detached() -> None:
    log_w = LOG_W.clone().requires_grad_(True)
    w, _, _ = correction_weights(PRESETS["tis"], log_w, MASK)
    assert not w.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"anchor": "behaviour", "weight": "token_tis"}, "weight"),
        ({"weight": "bogus"}, "weight"),
        ({"anchor": "bogus"}, "anchor"),
        ({"cap": 0.0}, "cap"),
        ({"low": 2.0, "high": 1.0}, "low"),
    ],
)
def test_bad_corrections_are_refused_by_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidInput) as info:
        Correction("custom", **kwargs)
    assert info.value.field == field


def test_presets_by_name_and_values_replaced() -> None:
    assert preset("tis").cap == 2.0 and preset("decoupled").cap == 5.0 and preset("ppo").anchor == "behaviour"
    assert preset("icepop").with_values(bounds=(0.2, 8.0)).high == 8.0
    assert preset("tis").with_values() is preset("tis")
    with pytest.raises(InvalidInput, match="decoupled"):
        preset("bogus")
