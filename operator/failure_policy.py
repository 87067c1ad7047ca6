"""spec.failurePolicy as pure functions: which rule a failed attempt matches, and how many failures
count against maxRestarts (all of them, or those of the last restartWindowSeconds).

The preemption contract comes first: rules apply only to attempts classify.py already judged real
failures (outcome ``Failed``). A preemption (exit 75, Kueue eviction, node loss, a disruption) or a
suspension never reaches a rule, so no rule can make one fail the job or count; and the exit codes a
rule sees are only those of containers that failed on their own (never 75, never a rank stopped
because a peer was gone, never a SIGKILL at a grace deadline).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from preemptible_operator.models import FailurePolicyAction, FailurePolicyRule, FailurePolicySpec
from preemptible_operator.timestamps import parse_rfc3339

__all__ = [
    "DEFAULT_ACTION",
    "MAX_FAILURE_TIMES",
    "FailureVerdict",
    "counted_failures",
    "decide_failure",
    "keep_failure_times",
    "rule_label",
]

DEFAULT_ACTION: FailurePolicyAction = "Restart"
"""What a failure that matches no rule gets (the behaviour without a failure policy)."""

MAX_FAILURE_TIMES = 1000
"""Upper bound of status.failureTimes (25 bytes each), whatever maxRestarts is."""


@dataclass(frozen=True)
class FailureVerdict:
    """What the failure policy decided for one failed attempt."""

    action: FailurePolicyAction
    rule: str | None = None
    """Label of the matching rule (rule_label); None when no rule matched."""

    @property
    def counts(self) -> bool:
        """Whether the failure counts against maxRestarts (Ignore: it does not)."""
        return self.action != "Ignore"


def rule_label(rule: FailurePolicyRule, index: int) -> str:
    """How Events and conditions name a rule: its name, else its place in the list."""
    return rule.name or f"rules[{index}]"


def _matches(rule: FailurePolicyRule, reason: str, exit_codes: Iterable[int]) -> bool:
    # An unset (or empty) list matches anything; with both set, both must match.
    if rule.on_reasons and reason not in rule.on_reasons:
        return False
    return not rule.on_exit_codes or any(code in rule.on_exit_codes for code in exit_codes)


def decide_failure(
    outcome: str | None,
    reason: str,
    exit_codes: Sequence[int],
    policy: FailurePolicySpec | None,
) -> FailureVerdict | None:
    """The verdict for an ended attempt: None unless it is a real failure (outcome ``Failed``);
    else the first rule matching its reason and the exit codes of its containers that failed on
    their own, or Restart when none does."""
    if outcome != "Failed":
        return None
    for index, rule in enumerate((policy.failure_rules if policy else None) or []):
        if _matches(rule, reason, exit_codes):
            return FailureVerdict(rule.action, rule_label(rule, index))
    return FailureVerdict(DEFAULT_ACTION)


def counted_failures(
    total: int, failure_times: Sequence[str] | None, now: float, window_seconds: int | None
) -> int:
    """Failures that count against maxRestarts now: every counted failure (``total``) without a
    window, else those recorded in the last ``window_seconds``."""
    if window_seconds is None:
        return total
    count = 0
    for stamp in failure_times or []:
        at = parse_rfc3339(stamp)
        if at is not None and now - at < window_seconds:
            count += 1
    return count


def keep_failure_times(times: Sequence[str] | None, new: str, max_restarts: int) -> list[str]:
    """``times`` with ``new`` appended, bounded to the newest maxRestarts + 1 (enough to tell
    whether more than maxRestarts fall in any window) and at most MAX_FAILURE_TIMES."""
    keep = max(1, min(max_restarts + 1, MAX_FAILURE_TIMES))
    return [*(times or []), new][-keep:]
