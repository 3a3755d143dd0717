"""GAE over fragments: bootstrap from the extra step, truncation bootstraps, termination does not."""

from __future__ import annotations

import numpy as np
import pytest

from rollhub.experience import SampleFragment
from rollhub.train.ppo import compute_gae


def _fragment(values: list[float], terminated: list[bool], truncated: list[bool], final: list[float],
              bootstrap: float) -> SampleFragment:  # fmt: skip
    n = len(values)
    return SampleFragment(
        obs=np.zeros((n, 1), np.float32), actions=np.zeros(n, np.int64), rewards=np.ones(n, np.float32),
        terminated=np.array(terminated), truncated=np.array(truncated), logp=np.zeros(n, np.float32),
        values=np.array(values, np.float32), final_values=np.array(final, np.float32),
        bootstrap_obs=np.zeros(1, np.float32), bootstrap_value=bootstrap, state_in=None,
        versions=np.zeros(n, np.int64), episode_ids=np.zeros(n, np.int64),
    )  # fmt: skip


def test_last_step_bootstraps_from_the_extra_step() -> None:
    _adv, ret = compute_gae(_fragment([0.0], [False], [False], [0.0], bootstrap=5.0), gamma=0.9, lam=1.0)
    assert ret[0] == pytest.approx(1 + 0.9 * 5.0)


def test_termination_does_not_bootstrap_and_truncation_does() -> None:
    values = [1.0, 2.0, 3.0]
    term = _fragment(values, [False, True, False], [False, False, False], [0, 0, 0], bootstrap=4.0)
    trunc = _fragment(values, [False, False, False], [False, True, False], [0, 7.0, 0], bootstrap=4.0)
    g = 0.5
    _, ret_term = compute_gae(term, gamma=g, lam=1.0)
    _, ret_trunc = compute_gae(trunc, gamma=g, lam=1.0)
    assert ret_term[1] == pytest.approx(1.0)  # terminal: nothing after
    assert ret_trunc[1] == pytest.approx(1.0 + g * 7.0)  # cut: the final observation's value continues
    assert ret_term[0] == pytest.approx(1 + g * 1.0) and ret_trunc[0] == pytest.approx(1 + g * (1 + g * 7))
    # the step after a done belongs to the next episode and bootstraps from the extra step
    assert ret_term[2] == pytest.approx(1 + g * 4.0) and ret_trunc[2] == pytest.approx(1 + g * 4.0)


def test_advantages_are_returns_minus_values() -> None:
    frag = _fragment([0.5, -1.0, 2.0], [False, False, True], [False, False, False], [0, 0, 0], bootstrap=9.0)
    adv, ret = compute_gae(frag, gamma=0.99, lam=0.95)
    np.testing.assert_allclose(ret - adv, frag.values, rtol=1e-6)
