"""LRFinderPlus's rule: its declaration, and its check right above it (a range test that applied no
learning rate: an unsupported setup, or a sweep that gave no suggestion, and what to change then). The check
reads a :class:`Tested`; the callback runs :data:`RULES` after each test (``run_rules``)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_gradguard.alerts import Finding, Rule, declare
from lightning_gradguard.monitors.lr_finder.engine import CAPPED, Unsupported
from lightning_gradguard.monitors.lr_finder.result import LRFinderResult, SearchResult

#: a sweep whose smoothed loss fell by less than this share of its level is flat (no descent to read)
FLAT_SHARE = 0.02


@dataclass(frozen=True, kw_only=True)
class Tested:
    """A range test: its ``result`` (the test that did not run, with ``problem``), its ``epoch``, and the
    callback's ``min_points``."""

    result: LRFinderResult
    epoch: int
    min_points: int
    problem: Unsupported | None = None


# ------------------------------------------------------------------ lr_finder_failed
def range_test_failed(test: Tested) -> Finding | None:
    """The check of a test: no LR was applied because the setup is unsupported (``problem``) or the sweep
    gave no suggestion; ``None`` when it gave one."""
    result, epoch, min_points, problem = test.result, test.epoch, test.min_points, test.problem
    if problem is not None:
        message, hint = f"No LR range test: {problem.message}.", problem.hint
    elif result.suggestion is None:
        message, hint = f"LR range test gave no suggestion: {result.reason}.", _hint(result, min_points)
    else:
        return None
    return Finding(
        LR_FINDER_FAILED,
        f"{message} The learning rate was left unchanged.",
        {"points": float(len(result.lrs))},
        hint=hint,
        where=f"epoch {epoch}",
    )


def _hint(result: LRFinderResult, min_points: int) -> str:
    """What to change after a sweep that gave no suggestion."""
    if result.limited_to is not None and len(result.lrs) < min_points:
        return (
            "The Trainer's batch limit left too few batches for the sweep: raise "
            "limit_train_batches (or overfit_batches), or run lr_find() without the limit."
        )
    check = result.descent
    if result.stop_reason == CAPPED and result.lrs and (len(result.lrs) < min_points or check is None):
        return (
            f"The optimizer caps its step from lr {result.lrs[-1]:.2e} on (torch's Adafactor steps by "
            "min(lr, 1/sqrt(t))), so a higher max_lr changes nothing: lower min_lr or raise num_training "
            "for more points below the cap."
        )
    if len(result.lrs) < min_points or check is None or check.stands_out:
        return (
            "Widen the sweep (lower min_lr if it diverged at once, raise max_lr if the loss never fell), "
            "raise num_training, or check that the loss depends on the learning rate at all."
        )
    if result.search is not None and result.search.blind and result.search.trials:
        return _searched_hint(result.search)
    if _flat(result):
        return _plateau_hint(result)
    averaged = f"the mean of {result.sweeps} sweeps was still too noisy; " if result.sweeps > 1 else ""
    return (
        f"If the loss should fall, {averaged}make the curve less noisy: a larger batch size or "
        "accumulate_grad_batches, more sweeps averaged (max_sweeps), or num_training (more points in the "
        "descent). If it should not, check that it depends on the trained weights (a detached output, "
        "frozen layers, a loss computed from constants)."
    )


def _searched_hint(search: SearchResult) -> str:
    """What to change after a sweep refused for noise whose blind search learned nothing either."""
    longest = max(t.steps for t in search.trials)
    return (
        f"Candidate LRs trained up to {longest} steps each did not get the held-out loss clearly below its "
        "start either. Either the loss cannot fall (check that it depends on the trained weights: a "
        "detached output, frozen layers, a loss computed from constants), or the model leaves its start "
        "only after longer training (deep tanh or sigmoid stacks, recurrent nets on long-range tasks): "
        "raise search_steps or search_retries for longer trials, or sweep with num_training of 500 to 1000 "
        "to see where the plateau ends."
    )


def _flat(result: LRFinderResult) -> bool:
    """Whether the smoothed curve hardly moved: a fall under :data:`FLAT_SHARE` of its level, or under twice
    its noise."""
    check = result.descent
    if check is None or not result.curve:
        return False
    level = abs(result.curve[check.start]) or 1.0
    return check.fall < FLAT_SHARE * level or check.ratio < 2.0


def _plateau_hint(result: LRFinderResult) -> str:
    """What to do about a sweep whose loss stayed flat: a loss that cannot fall, or a plateau."""
    blew_up = _blow_up_lr(result)
    top = blew_up if blew_up is not None else (result.lrs[-1] if result.lrs else None)
    where, scale = "over the sweep", ""
    if top is not None:
        where = f"until it blew up at lr {top:.2e}" if blew_up is not None else f"up to lr {top:.2e}"
        scale = f" at a third to a tenth of {top:.2e}"
    return (
        f"The loss stayed flat {where}. Either it cannot fall (check that it depends on the trained "
        f"weights: a detached output, frozen layers, a loss computed from constants), or the model sits on "
        f"a plateau that a {len(result.lrs)}-step sweep cannot see: deep tanh or sigmoid stacks and ViTs "
        f"break away only after hundreds of steps. Sweep with num_training of 500 to 1000 to see where the "
        f"plateau ends, or train a few hundred steps{scale} and watch the loss"
        + _past_the_top(result, blew_up)
    )


def _past_the_top(result: LRFinderResult, blew_up: float | None) -> str:
    """The plateau hint's last words: whether a higher ``max_lr`` could show more."""
    if blew_up is not None:
        return "."
    if result.stop_reason == CAPPED:
        return (
            "; every LR above the sweep's last takes the same capped step (torch's Adafactor), so a higher "
            "max_lr changes nothing."
        )
    return ", or raise max_lr if it never blew up."


def _blow_up_lr(result: LRFinderResult) -> float | None:
    """The LR where the sweep diverged (its tail's first point, or where the stop rule ended it)."""
    if result.divergence_at is not None:
        return result.lrs[result.divergence_at]
    if result.stop_reason in ("diverged", "non-finite loss") and result.lrs:
        return result.lrs[-1]
    return None


LR_FINDER_FAILED: Rule[Tested] = Rule(
    kind="lr_finder_failed",
    severity="warning",
    monitor="LRFinderPlus",
    summary="the LR range test gave no suggestion; the learning rate was left unchanged",
    when=(
        "the range test gave no suggestion (too few points before divergence or NaN, a curve that "
        "never falls, a fall smaller than 6 times its own noise (measured margins: a loss that "
        "cannot fall ≤ 5.1 with 20 to 100 points, models learning at batch size ≥ 4 ≥ 7.8) where "
        "short trainings across the sweep's range then learned nothing either, an unsupported "
        "setup); the learning rate is left as it was. See [LR finder](lr_finder.md)."
    ),
    check=range_test_failed,
)

#: every kind this monitor reports
RULES: tuple[Rule[Tested], ...] = declare(LR_FINDER_FAILED)
