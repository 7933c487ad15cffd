"""Analysis truths where the simulator fails (NaN or infinite observations): dropped under data.invalid =
"drop", else one line naming the fix (nre_analysis.valid_cases)."""

import pytest
import torch

from nre_analysis import InvalidObservations, valid_cases
from store import NnpdError

pytestmark = pytest.mark.unit

TRUTHS = torch.tensor([[0.5], [2.7], [1.0], [2.9]], dtype=torch.float64)


def observations(truths):
    """Two observations (cases, 2, 3) per truth, NaN in one number above 2.5, as a failing simulator gives."""
    x = truths[:, None, :].expand(-1, 2, 3).clone()
    x[truths[:, 0] > 2.5, 1, 2] = float("nan")
    return x


def test_drop_keeps_the_truths_whose_observations_are_all_finite():
    assert valid_cases(observations(TRUTHS), TRUTHS, "drop").tolist() == [True, False, True, False]


def test_without_drop_the_error_names_the_share_a_truth_and_the_fix():
    with pytest.raises(
        InvalidObservations,
        match=r"2 of 4 truths \(50.0%\), e.g. at θ = \[2.7\]; fix the "
        r"simulator there, or set data.invalid = \"drop\"",
    ) as caught:
        valid_cases(observations(TRUTHS), TRUTHS, "error")
    assert isinstance(caught.value, NnpdError)


def test_every_truth_invalid_is_refused_even_when_dropping():
    with pytest.raises(InvalidObservations, match="every one: fix the simulator"):
        valid_cases(observations(TRUTHS[[1, 3]]), TRUTHS[[1, 3]], "drop")


def test_finite_observations_keep_every_truth_under_either_policy():
    finite = observations(TRUTHS[[0, 2]])
    for policy in ("error", "drop"):
        assert valid_cases(finite, TRUTHS[[0, 2]], policy).all()
