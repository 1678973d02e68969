"""A pre-flight check that fails inside our own code is never a quiet "skipped".

OverfitBatchSanity and GradientCheck catch what a model or loader they cannot drive raises (one warning,
training goes on). On torch 2.3 the overfit trial called ``torch.nn.utils.get_total_norm`` (torch 2.6), and
that catch turned the missing API into "could not run the check; skipped" even under
``GRADGUARD_STRICT=1``. Our own failure is now raised under strict mode and named as ours otherwise; the
user's model still gets the one-time warning.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer, random_loader
from torch import Tensor, nn

from lightning_gradguard import GradientCheck, OverfitBatchSanity
from lightning_gradguard.core.state import STRICT_ENV, raised_by_us
from lightning_gradguard.monitors.gradcheck import callback as gradcheck_callback
from lightning_gradguard.monitors.overfit import trial

#: an attribute no torch or Lightning has: what calling an API of a newer release looks like on an older one
NEWER_API = "api_of_a_newer_release"


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _checks() -> dict[str, tuple[Any, Any, str]]:
    """Each check, the module whose name our code calls, and the name: replaced by a lookup that fails
    in our own frame, as ``torch.nn.utils.get_total_norm`` did on torch 2.3 (a C call: no frame of the
    test's in the traceback)."""
    return {
        "OverfitBatchSanity": (OverfitBatchSanity, trial, "foreach_norms"),
        "GradientCheck": (GradientCheck, gradcheck_callback, "first_train_batch"),
    }


@pytest.mark.parametrize("name", ["OverfitBatchSanity", "GradientCheck"])
def test_an_internal_error_in_a_check_is_raised_under_strict_mode(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_type, module, attribute = _checks()[name]
    monkeypatch.setenv(STRICT_ENV, "1")
    monkeypatch.setattr(module, attribute, operator.attrgetter(NEWER_API))
    trainer = make_trainer([check_type()], max_steps=2)
    with pytest.raises(AttributeError, match=NEWER_API):
        trainer.fit(Classifier(), random_loader(n=32))


@pytest.mark.parametrize("name", ["OverfitBatchSanity", "GradientCheck"])
def test_an_internal_error_in_a_check_is_named_as_ours_outside_strict_mode(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_type, module, attribute = _checks()[name]
    monkeypatch.setenv(STRICT_ENV, "0")
    monkeypatch.setattr(module, attribute, operator.attrgetter(NEWER_API))
    check = check_type()
    trainer = make_trainer([check], max_steps=2)
    with pytest.warns(UserWarning, match=f"{name} failed inside lightning_gradguard") as caught:
        trainer.fit(Classifier(), random_loader(n=32))
    assert trainer.global_step == 2 and check.result is None
    assert not any("could not run the check" in str(w.message) for w in caught)


def _users_error() -> Exception:
    try:
        nn.Linear(8, 4)(torch.zeros(2, 7))  # raised inside torch, called from here (the user's code)
    except RuntimeError as err:
        return err
    raise AssertionError("no error")


def _our_error() -> Exception:
    try:
        trial.foreach_norms([torch.zeros(2)], norm_type=-1.0)  # raised in our own frame
    except ValueError as err:
        return err
    raise AssertionError("no error")


def test_raised_by_us_tells_our_code_from_the_users() -> None:
    assert raised_by_us(_our_error())
    assert not raised_by_us(_users_error())
    try:
        copy.deepcopy(i for i in range(3))  # the standard library on the user's object
    except TypeError as err:
        assert not raised_by_us(err)
    assert not raised_by_us(ValueError("never raised: no traceback"))
