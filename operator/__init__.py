"""preemptible operator (import name ``preemptible_operator``).

The pure parts (models, rendering, classification, phases, grace, resume choice) import without
a cluster; ``handlers`` wires them into kopf and ``cli`` is the ``preemptible-operator`` command.
"""

from preemptible_operator.classify import Interruption, classify_interruption, pod_finished
from preemptible_operator.conditions import Reason
from preemptible_operator.grace import GraceDecision, grace_sufficiency, next_grace
from preemptible_operator.models import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    TrainingJobSpec,
    TrainingJobStatus,
)
from preemptible_operator.phases import Decision, PhaseInputs, next_phase
from preemptible_operator.render import AttemptParams, render_job, render_service
from preemptible_operator.resume import ResumeChoice, resume_checkpoint

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "AttemptParams",
    "Decision",
    "GraceDecision",
    "Interruption",
    "PhaseInputs",
    "Reason",
    "ResumeChoice",
    "TrainingJobSpec",
    "TrainingJobStatus",
    "classify_interruption",
    "grace_sufficiency",
    "next_grace",
    "next_phase",
    "pod_finished",
    "render_job",
    "render_service",
    "resume_checkpoint",
]
