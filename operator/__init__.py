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
from preemptible_operator.workload import (
    Admission,
    Eviction,
    admitted_size,
    clear_reservation_patch,
    eviction,
    finished_patch,
    render_replacement,
    render_workload,
)

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "Admission",
    "AttemptParams",
    "Decision",
    "Eviction",
    "GraceDecision",
    "Interruption",
    "PhaseInputs",
    "Reason",
    "ResumeChoice",
    "TrainingJobSpec",
    "TrainingJobStatus",
    "admitted_size",
    "classify_interruption",
    "clear_reservation_patch",
    "eviction",
    "finished_patch",
    "grace_sufficiency",
    "next_grace",
    "next_phase",
    "pod_finished",
    "render_job",
    "render_replacement",
    "render_service",
    "render_workload",
    "resume_checkpoint",
]
