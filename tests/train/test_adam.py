"""rollhub's Adam: the arithmetic of ``torch.optim.Adam``, its state layout, and no ``torch._dynamo`` import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from rollhub.errors import ConfigError
from rollhub.train.adam import Adam


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def _train(model: nn.Module, optimizer: object, steps: range, lrs: list[float]) -> None:
    for t in steps:
        torch.manual_seed(100 + t)
        x, y = torch.randn(32, 4), torch.randn(32, 3)
        optimizer.param_groups[0]["lr"] = lrs[t]  # a schedule changes it between steps
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()


@pytest.mark.parametrize("eps", [1e-8, 1e-5])
def test_steps_match_torch_adam(eps: float) -> None:
    ours, theirs = _model(), _model()
    lrs = [1e-2 * (1 - t / 40) for t in range(40)]
    _train(ours, Adam(ours.parameters(), lr=1.0, eps=eps), range(40), lrs)
    _train(theirs, torch.optim.Adam(theirs.parameters(), lr=1.0, eps=eps), range(40), lrs)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(ours[0].weight, _model()[0].weight)  # it did train


def test_state_moves_between_torch_adam_and_ours_both_ways() -> None:
    lrs = [3e-3] * 30
    reference = _model()
    _train(reference, torch.optim.Adam(reference.parameters(), lr=1.0, eps=1e-5), range(30), lrs)

    first = _model()
    torch_opt = torch.optim.Adam(first.parameters(), lr=1.0, eps=1e-5)
    _train(first, torch_opt, range(10), lrs)
    ours = Adam(first.parameters(), lr=5.0)
    ours.load_state_dict(torch_opt.state_dict())  # a checkpoint written with torch's Adam
    _train(first, ours, range(10, 20), lrs)
    back = torch.optim.Adam(first.parameters(), lr=1.0, eps=1e-5)
    back.load_state_dict(ours.state_dict())  # and ours read by torch's
    _train(first, back, range(20, 30), lrs)
    for a, b in zip(first.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_parameters_without_a_gradient_are_left_alone() -> None:
    model = _model()
    frozen = model[2].weight.detach().clone()
    optimizer = Adam(model.parameters(), lr=0.1)
    model[2].weight.requires_grad_(False)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    assert torch.equal(model[2].weight, frozen) and not torch.equal(model[0].weight, _model()[0].weight)


def test_bad_settings_and_mismatched_state_are_refused() -> None:
    with pytest.raises(ConfigError, match="no parameters"):
        Adam([])
    with pytest.raises(ConfigError, match=r"betas in \[0, 1\)"):
        Adam(_model().parameters(), betas=(0.9, 1.0))
    small = nn.Linear(2, 2)
    optimizer = Adam(small.parameters())
    small(torch.randn(3, 2)).sum().backward()
    optimizer.step()
    with pytest.raises(ConfigError, match="this model has 4 in one"):
        Adam(_model().parameters()).load_state_dict(optimizer.state_dict())
    decayed = torch.optim.Adam(small.parameters(), weight_decay=0.01)
    with pytest.raises(ConfigError, match=r"uses \{'weight_decay': 0\.01\}"):
        Adam(small.parameters()).load_state_dict(decayed.state_dict())


def test_building_a_ppo_learner_does_not_import_torch_dynamo() -> None:
    code = (
        "import sys\n"
        "from rollhub.train.ppo import PPOLearner\n"
        "PPOLearner(4, 2)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
