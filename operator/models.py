"""The TrainingJob API (``preemptible.dev/v1alpha1``): spec and status as pydantic models.

These models are the single source of truth: the CRD's openAPIV3Schema is generated from them
(``crd.py``) and the operator parses every object through them. Structural checks (types, required
fields, enums, bounds such as numNodes >= 1) end up in the CRD schema, and the rules over several
fields or a set of values (min <= max, label formats, reserved env names: ``spec_rules``) become its
CEL ``x-kubernetes-validations``, so the apiserver refuses an invalid object with the same message
the operator gives. An object that gets past the apiserver anyway (stored before the rules existed)
is caught here: before its first attempt it is Failed / InvalidSpec, an edit of a job that has run
is rejected while the attempt goes on (reconcile.py).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import InitErrorDetails, PydanticCustomError

from preemptible_operator.spec_rules import (
    MAX_ELASTIC_NODES,
    ExcludesItems,
    IntOrWord,
    KeepsGlobalBatch,
    Matches,
    NeedsItems,
    NotAbove,
    NotOneOf,
    Requires,
    Rule,
    Within,
    WordNeedsKey,
)
from trainer_runtime import protocol
from trainer_runtime.grace import GracePolicy

__all__ = [
    "API_VERSION",
    "FAILURE_REASONS",
    "GPU_RESOURCE",
    "GROUP",
    "KIND",
    "MAX_ELASTIC_NODES",
    "MAX_GRACE_SECONDS",
    "PLURAL",
    "RESERVED_ENV",
    "SHORT_NAME",
    "SINGULAR",
    "VERSION",
    "AttemptRecord",
    "CheckpointIntervalStatus",
    "CheckpointRef",
    "CheckpointSpec",
    "Condition",
    "ElasticSpec",
    "EnvVar",
    "FailurePolicyAction",
    "FailurePolicyRule",
    "FailurePolicySpec",
    "GracePeriodSpec",
    "GraceStatus",
    "IncompleteCheckpoint",
    "Phase",
    "PodTemplateOverride",
    "PreemptionSpec",
    "Progress",
    "ResourcesPerNode",
    "Timings",
    "TrainingJobSpec",
    "TrainingJobStatus",
    "UnreachableNodeSpec",
    "format_validation_error",
    "parse_spec",
]

GROUP = "preemptible.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAME = "tj"

Phase = Literal[
    "Pending",
    "Queued",
    "Running",
    "Checkpointing",
    "Requeueing",
    "Suspended",
    "Succeeded",
    "Failed",
]

# Env names the operator sets itself (the runtime contract); a user value would silently break
# resume or rendezvous, so the spec rejects them.
RESERVED_ENV = frozenset(
    {
        protocol.ENV_OUTPUT_DIR,
        protocol.ENV_RESUME_FROM,
        protocol.ENV_GRACE_SECONDS,
        protocol.ENV_KILL_WAIT_SECONDS,
        protocol.ENV_ATTEMPT,
        protocol.ENV_METRICS_PORT,
        protocol.ENV_METRICS_HOST,
        protocol.ENV_STOP_POLICY,
        protocol.ENV_NODE_NOTICE_SECONDS,
        protocol.ENV_NODE_NOTICE_FILE,
        protocol.ENV_SAVE_INTERVAL_SECONDS,
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "NODE_RANK",
        # torchrun's options as environment, rendered for numProcPerNode (render.py)
        "PET_NNODES",
        "PET_NPROC_PER_NODE",
        "PET_NODE_RANK",
        "PET_MASTER_ADDR",
        "PET_MASTER_PORT",
    }
)

# The extended resource `numProcPerNode: auto` counts (one process per GPU the pod requests).
GPU_RESOURCE = "nvidia.com/gpu"
# spec.shmSize: a Kubernetes quantity written as a string (what an emptyDir's sizeLimit takes).
_QUANTITY = r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?"

# Kubernetes label value: at most 63 characters, alphanumerics with - _ . inside.
_LABEL_VALUE = r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
_LABEL_VALUE_MAX = 63
_LABEL_VALUE_RULE = (
    " is not a valid Kubernetes label value (at most 63 characters: letters, digits, '-', '_', "
    "'.', starting and ending with a letter or digit)"
)
# Bounds that keep the CEL rules' worst-case cost within the apiserver's budget (a rule over an
# unbounded list or string is refused when the CRD is applied); far above any real spec.
MAX_ENV = 1024
MAX_ENV_NAME = 1024

_FREE_FORM = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}

# Bounds of the grace fields (spec.gracePeriod): a grace period is how long a preempted or
# suspended pod keeps its node (and Kueue's preemptor waits), so no field may ask for more than
# two hours (twice the automatic rule's default max, far above any JIT save measured).
MAX_GRACE_SECONDS = 7200
MAX_HEADROOM = 10.0
MAX_KILL_WAIT_SECONDS = 300.0
MAX_EXIT_MARGIN_SECONDS = 600


def _schema_rules(schema: dict[str, Any], model: type) -> None:
    # The model's rules become the CRD's CEL validations of this object (crd.py keeps them);
    # a bound (Within) also becomes its field's minimum/maximum.
    rules: tuple[Rule, ...] = getattr(model, "rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [r.to_cel() for r in rules]
    for rule in rules:
        if isinstance(rule, Within):
            schema["properties"][rule.field].update(rule.schema_keywords())


class _Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are an error in the spec (the
    CRD prunes them anyway; an operator older than its CRD drops them with a note:
    pass_spec.parse_spec_tolerant); the status models keep them (``_Status``).
    ``rules`` are checked after the fields and emitted as the CRD's CEL validations."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        json_schema_extra=_schema_rules,
    )

    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> Any:
        if not self.rules:
            return self
        values = {
            (info.alias or name): getattr(self, name)
            for name, info in type(self).model_fields.items()
        }
        errors = [
            # Located at the rule's field (as the apiserver's fieldPath); the message already
            # shows the value, so the input is the whole object (format_validation_error then
            # adds no "got ...").
            InitErrorDetails(
                type=PydanticCustomError("spec_rule", "{message}", {"message": message}),
                loc=(rule.field_path,) if rule.field_path else (),
                input=values,
            )
            for rule in self.rules
            if (message := rule.violation(values)) is not None
        ]
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def to_k8s(self) -> dict[str, Any]:
        """Dump as the apiserver stores it: camelCase keys, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# ---------------------------------------------------------------------------------------- spec


class EnvVar(_Model):
    """An environment variable for the training container (Kubernetes EnvVar)."""

    name: str = Field(min_length=1, max_length=MAX_ENV_NAME)
    """Variable name."""
    value: str | None = None
    """Literal value."""
    value_from: dict[str, Any] | None = Field(default=None, json_schema_extra=_FREE_FORM)
    """A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef)."""

    rules: ClassVar[tuple[Rule, ...]] = (
        NotOneOf(
            "{name} is set by the operator; remove it from spec.env "
            "(use spec.checkpoint / spec.gracePeriod instead)",
            field="name",
            values=RESERVED_ENV,
        ),
    )


_QUANTITY_MAP = {
    "type": "object",
    "additionalProperties": {"x-kubernetes-int-or-string": True},
}


class ResourcesPerNode(_Model):
    """Resources of the training container on each node (Kubernetes ResourceRequirements)."""

    requests: dict[str, int | str] | None = Field(default=None, json_schema_extra=_QUANTITY_MAP)
    """Resource requests, e.g. {cpu: 4, memory: 16Gi, nvidia.com/gpu: 1}."""
    limits: dict[str, int | str] | None = Field(default=None, json_schema_extra=_QUANTITY_MAP)
    """Resource limits."""


class CheckpointSpec(_Model):
    """Where checkpoints go."""

    uri: str = Field(min_length=1)
    """fsspec URL (or absolute path) of the checkpoint root, as the training pods see it. Passed
    to the runtime as PREEMPTIBLE_OUTPUT_DIR; checkpoints are checkpoint-<step>/ below it."""
    credentials_secret: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
    )
    """Name of a Secret in the TrainingJob's namespace whose keys become environment variables of
    every training container (envFrom): the object store's credentials and endpoint, e.g.
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for s3://. The operator only
    names it in the pods; it never reads it."""
    keep: int | None = Field(default=None, ge=1)
    """How many checkpoints to keep (save_total_limit). The newest complete one is never removed."""
    interval: Literal["auto"] | None = None
    """`auto`: the operator passes the checkpoint interval it recommends from this job's observed
    preemptions and save times (status.checkpointInterval, Young's rule sqrt(2 x save x mean time
    between preemptions)) to each new attempt as PREEMPTIBLE_SAVE_INTERVAL_SECONDS, and the
    runtime saves at least that often (on top of the script's save_steps). Unset: the script's
    own schedule only (the recommendation is still shown in status)."""


class GracePeriodSpec(_Model):
    """How terminationGracePeriodSeconds is chosen for each attempt.

    Without `seconds` the grace is automatic: ceil(killWait + (1+headroom)*(stepMax+saveMax)) +
    exitMargin from the runtime's measurements, clamped to [min, max]; initialSeconds before any
    measurement. With `seconds` the user pins it (the operator still warns through condition
    GracePeriodSufficient when measurements say it is too short).
    """

    seconds: int | None = None
    """Pinned grace period in seconds (disables the automatic rule)."""
    # Defaults are trainer_runtime.grace.GracePolicy's, so both halves document one rule.
    initial_seconds: int = GracePolicy.initial_seconds
    """Grace of the first attempt, before anything was measured."""
    min: int = GracePolicy.minimum
    """Lower bound of the automatic grace."""
    max: int = GracePolicy.maximum
    """Upper bound of the automatic grace."""
    headroom: float = GracePolicy.headroom
    """Relative safety margin on (stepMax + saveMax)."""
    kill_wait_seconds: float = GracePolicy.kill_wait
    """Seconds the runtime waits after SIGTERM before it stops (PREEMPTIBLE_KILL_WAIT_SECONDS)."""
    exit_margin: int = GracePolicy.exit_margin
    """Seconds added for process exit and termination-message writing."""
    stop_policy: Literal["finish_step", "micro_batch"] = "finish_step"
    """How the runtime stops after SIGTERM (PREEMPTIBLE_STOP_POLICY; a script's own
    TrainingArguments.jit_stop_policy wins). finish_step: finish the optimizer step in flight, then
    save (the grace covers stepMax + saveMax; if the rest of the step cannot fit the deadline the
    runtime stops as micro_batch does). micro_batch: stop at the next micro-batch boundary, drop
    the partial gradient accumulation and save the last completed step at once (the grace covers
    the longest micro-batch + saveMax, so preempted GPUs are freed nearly a step sooner)."""
    node_notice_seconds: int | None = None
    """The notice the nodes give before they go away whatever grace a pod asked for (spot VMs:
    15 for user pods on GKE, 120 on AWS). Passed as PREEMPTIBLE_NODE_NOTICE_SECONDS: the runtime's
    deadline is SIGTERM + the shorter of grace and notice, and it does not start a save that
    cannot finish by then (the attempt ends as DeadlineTooShort). The grace is never doubled
    beyond it after a SIGKILL: the node would not wait longer anyway. Where a node says its
    notice (spot labels of GKE, EKS, Karpenter, AKS, or the annotation
    preemptible.dev/node-notice-seconds), the operator also passes that to the pod on it, and the
    shorter applies."""

    rules: ClassVar[tuple[Rule, ...]] = (
        NotAbove(
            "min ({min}) must not exceed max ({max}); lower min or raise max", low="min", high="max"
        ),
        Within(
            "gracePeriod.seconds ({seconds}) must be between 1 and "
            f"{MAX_GRACE_SECONDS}: a preempted pod holds its node that long; pin a shorter "
            "grace or unset seconds for the automatic one",
            field="seconds",
            minimum=1,
            maximum=MAX_GRACE_SECONDS,
        ),
        Within(
            "gracePeriod.initialSeconds ({initialSeconds}) must be between 1 and "
            f"{MAX_GRACE_SECONDS}: it is the first attempt's grace; give one in that range",
            field="initialSeconds",
            minimum=1,
            maximum=MAX_GRACE_SECONDS,
        ),
        Within(
            f"gracePeriod.min ({{min}}) must be between 1 and {MAX_GRACE_SECONDS}; give one in "
            "that range",
            field="min",
            minimum=1,
            maximum=MAX_GRACE_SECONDS,
        ),
        Within(
            f"gracePeriod.max ({{max}}) must be between 1 and {MAX_GRACE_SECONDS}: a preempted "
            "pod may hold its node that long; give one in that range",
            field="max",
            minimum=1,
            maximum=MAX_GRACE_SECONDS,
        ),
        Within(
            f"gracePeriod.headroom must be between 0 and {MAX_HEADROOM:g} (a fraction of "
            "stepMax + saveMax: 0.25 adds a quarter); give one in that range",
            field="headroom",
            minimum=0.0,
            maximum=MAX_HEADROOM,
        ),
        Within(
            f"gracePeriod.killWaitSeconds must be between 0 and {MAX_KILL_WAIT_SECONDS:g} "
            "(the runtime's wait after SIGTERM, spent out of the grace period); give one in "
            "that range",
            field="killWaitSeconds",
            minimum=0.0,
            maximum=MAX_KILL_WAIT_SECONDS,
        ),
        Within(
            "gracePeriod.exitMargin ({exitMargin}) must be between 0 and "
            f"{MAX_EXIT_MARGIN_SECONDS}; give one in that range",
            field="exitMargin",
            minimum=0,
            maximum=MAX_EXIT_MARGIN_SECONDS,
        ),
        Within(
            "gracePeriod.nodeNoticeSeconds ({nodeNoticeSeconds}) must be between 1 and "
            f"{MAX_GRACE_SECONDS}: give the notice your nodes get before they go (about 30 on "
            "GKE spot, up to 120 on AWS) or unset it",
            field="nodeNoticeSeconds",
            minimum=1,
            maximum=MAX_GRACE_SECONDS,
        ),
    )


class PodTemplateOverride(_Model):
    """Pod template fields merged into the operator's pod template (volumes, nodeSelector,
    tolerations, affinity, serviceAccountName, securityContext, extra containers, a container
    named `trainer` to extend the training container...). The operator keeps its own restart
    policy, grace period, rendezvous subdomain and runtime environment."""

    metadata: dict[str, Any] | None = Field(default=None, json_schema_extra=_FREE_FORM)
    """Labels and annotations added to the pods."""
    spec: dict[str, Any] | None = Field(default=None, json_schema_extra=_FREE_FORM)
    """A partial Kubernetes PodSpec."""


class PreemptionSpec(_Model):
    """How this job is chosen as a Kueue preemption victim (issue 32). Takes effect only where the
    operator runs with --priority-boost (Helm operator.priorityBoost.enabled) and Kueue with its
    PriorityBoost feature gate: the operator then keeps annotation kueue.x-k8s.io/priority-boost
    on the running attempt's Workload, so that within one priority class Kueue preempts the job
    whose preemption costs least now (docs/operator.md, "Checkpoint-aware victims")."""

    min_run_seconds: int | None = Field(default=None, ge=0, le=604_800)
    """Protect each attempt from preemption by jobs of its own priority class until it has run
    this many seconds and written a checkpoint of its own (0: only until that checkpoint): its
    Workload gets the highest boost of the band. A higher priority class still preempts it.
    Unset: no protection, the boost follows the cost alone. Unlike Kueue's own options (the
    ClusterQueue's withinClusterQueue policy, waitForPodsReady), which know neither run time nor
    checkpoints, this stops a job from being preempted again before it saved once."""


# ------------------------------------------- failure policy, unreachable nodes (issue 30)

FailurePolicyAction = Literal["FailJob", "Restart", "Ignore"]

# Reasons of attempts classified as real failures (classify.py): the only ones a failure-policy
# rule can match. Preemptions and suspensions are never failures, so no rule can turn one into a
# failure (exit code 75, Kueue eviction, node loss... keep the preemption contract).
FAILURE_REASONS = (
    "TrainingFailed",
    "OOMKilled",
    "KubeletEvicted",
    "PodsNeverReady",
    "JobFailed",
)
# What failure-policy rules can never match: 0 (success) is excluded by the schema's bounds, the
# runtime's preemption exit code by this rule (an exit 75 is a preemption, not a failure).
MAX_FAILURE_RULES = 32
MAX_RULE_EXIT_CODES = 255
DEFAULT_UNREACHABLE_ESCALATE_SECONDS = 600


class FailurePolicyRule(_Model):
    """One rule of spec.failurePolicy: when a failed attempt matches it, `action` decides what
    happens. The first matching rule wins; a failure that matches none is a Restart."""

    name: str | None = Field(
        default=None, max_length=63, pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
    )
    """Name of the rule, shown in the Failed condition and Events (default: rules[<index>])."""
    action: FailurePolicyAction
    """FailJob: the TrainingJob is Failed at once (condition Failed, reason FailedByPolicy,
    naming the rule). Restart: a new attempt after the restart backoff, counted against
    maxRestarts (what a failure that matches no rule gets). Ignore: a new attempt after
    restartBackoffSeconds, not counted against maxRestarts."""
    on_exit_codes: list[Annotated[int, Field(ge=1, le=255)]] | None = Field(
        default=None, max_length=MAX_RULE_EXIT_CODES
    )
    """Matches when a training container that failed on its own (not a rank stopped because
    another one failed, not one killed at a grace deadline) exited with one of these codes
    (1-255; 137 is an OOM kill). 75, the runtime's preemption exit code, is not allowed: that
    exit is a preemption, never a failure. Unset: any exit code."""
    on_reasons: list[Literal[FAILURE_REASONS]] | None = Field(  # type: ignore[valid-type]
        default=None, max_length=len(FAILURE_REASONS)
    )
    """Matches when the failed attempt's reason is one of these: TrainingFailed (a non-zero
    exit), OOMKilled, KubeletEvicted (node pressure or the pod's ephemeral-storage limit),
    PodsNeverReady (Kueue evicted the attempt before all its pods ran), JobFailed. Unset: any
    failure reason. With both lists set, both must match."""

    rules: ClassVar[tuple[Rule, ...]] = (
        ExcludesItems(
            f"onExitCodes must not list {protocol.EXIT_PREEMPTED}: it is the runtime's "
            "preemption exit code (the attempt is a preemption, never a failure a rule applies to)",
            field="onExitCodes",
            values=(protocol.EXIT_PREEMPTED,),
        ),
    )


class FailurePolicySpec(_Model):
    """What a real failure does (preemptions and suspensions never reach it)."""

    failure_rules: list[FailurePolicyRule] | None = Field(
        default=None, alias="rules", max_length=MAX_FAILURE_RULES
    )
    """Rules over failed attempts (exit codes, reasons), the first matching one wins: FailJob,
    Restart or Ignore. A failure that matches none is a Restart."""
    restart_window_seconds: int | None = Field(default=None, ge=1)
    """Count only the failures of the last restartWindowSeconds against maxRestarts (e.g. 86400:
    maxRestarts per day), so rare failures spread over weeks never fail a long job for good.
    The restart backoff doubles with the failures in the window too. Unset: every failure
    counts."""


class UnreachableNodeSpec(_Model):
    """What happens when an attempt's pod is stuck on a NotReady node that is never deleted."""

    escalate_after_seconds: int = Field(default=DEFAULT_UNREACHABLE_ESCALATE_SECONDS, ge=0)
    """Seconds past a stuck pod's grace deadline (its deletionTimestamp, else the time its node
    went NotReady plus its grace) after which the operator sets condition NodeUnreachable and
    posts a Warning Event asking an administrator to taint the node out-of-service or delete
    it. The attempt waits for that in any case: the operator cannot tell a dead node from a
    partitioned one whose pods still write checkpoints."""


class ElasticSpec(_Model):
    """Run each attempt on any number of pods in [minNodes, maxNodes] that Kueue can admit now,
    keeping the global batch of spec.numNodes pods (issue 40, docs/elastic.md). The operator
    then creates one Kueue Workload for the TrainingJob (pod set count maxNodes, minCount
    minNodes) that keeps its place in the queue across attempts, starts each attempt with the
    admitted count, and grows back at a checkpoint when more quota frees up and the restart pays
    within growCooldownSeconds. Needs spec.queueName."""

    min_nodes: int = Field(ge=1)
    """Fewest pods an attempt may start with (>= 1; at most maxNodes, or numNodes when maxNodes
    is unset)."""
    max_nodes: int | None = Field(default=None, ge=1, le=MAX_ELASTIC_NODES)
    """Most pods an attempt may run on (at most 1024). Default: spec.numNodes. The range
    [minNodes, maxNodes] must hold a size that keeps the global batch."""
    gradient_accumulation_steps: int = Field(default=1, ge=1)
    """The training script's gradient accumulation at spec.numNodes pods (its
    --gradient_accumulation_steps). The global batch is per-device batch x processes per pod x
    numNodes x this; a size n keeps it only when n divides numNodes x this, and the attempt then
    accumulates numNodes x this / n micro-batches. The runtime refuses to start when the
    script's own value disagrees."""
    grow_cooldown_seconds: int = Field(default=600, ge=0)
    """Grow at most once per this many seconds, and only when the measured restart (JIT save,
    pod start, resume) is repaid within it at the larger size."""

    rules: ClassVar[tuple[Rule, ...]] = (
        NotAbove(
            "minNodes ({minNodes}) must not exceed maxNodes ({maxNodes}); lower minNodes or "
            "raise maxNodes",
            low="minNodes",
            high="maxNodes",
        ),
    )


class TrainingJobSpec(_Model):
    """Desired state of a TrainingJob."""

    image: str = Field(min_length=1)
    """Container image with the trainer runtime and the user's training script."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    """Image pull policy of the training container."""
    command: list[str] | None = None
    """Entrypoint (e.g. [python, -m, trainer_runtime.toy] or a stock HF Trainer script)."""
    args: list[str] | None = None
    """Arguments to the entrypoint."""
    working_dir: str | None = None
    """Working directory of the training container."""
    num_nodes: int = Field(default=1, ge=1)
    """Number of pods (one node's worth of processes each, see numProcPerNode); becomes the Job's
    completions and parallelism."""
    num_proc_per_node: int | str | None = None
    """Training processes per pod: an integer >= 1, or `auto` (one per nvidia.com/gpu in
    resourcesPerNode). Unset or 1: one process per pod, the command as it is. Above 1 the
    operator starts the command through `trainer-runtime launch` (torchrun underneath; a command
    that starts torchrun, accelerate launch or trainer-runtime launch itself is kept as it is),
    renders torchrun's PET_NNODES / PET_NPROC_PER_NODE / PET_NODE_RANK / PET_MASTER_ADDR /
    PET_MASTER_PORT and WORLD_SIZE = numNodes x processes, and mounts a memory-backed /dev/shm
    (shmSize). Needs spec.command."""
    shm_size: str | None = Field(default=None, max_length=32, pattern=f"^{_QUANTITY}$")
    """Size limit of the memory-backed /dev/shm (a quantity, e.g. 16Gi) mounted in each pod.
    Default: 2Gi per process when numProcPerNode is above 1, none otherwise (the container
    runtime's own, often 64 MiB); 0: none. What is written there counts against the container's
    memory limit."""
    resources_per_node: ResourcesPerNode | None = None
    """Resources of the training container in each pod."""
    env: list[EnvVar] | None = Field(default=None, max_length=MAX_ENV)
    """Extra environment variables. Names the operator sets (PREEMPTIBLE_*, MASTER_ADDR, RANK...)
    are not allowed."""
    volumes: list[dict[str, Any]] | None = Field(
        default=None, json_schema_extra={"items": _FREE_FORM}
    )
    """Kubernetes Volumes added to the pods."""
    volume_mounts: list[dict[str, Any]] | None = Field(
        default=None, json_schema_extra={"items": _FREE_FORM}
    )
    """Kubernetes VolumeMounts of the training container."""
    checkpoint: CheckpointSpec
    """Checkpoint location and retention."""
    grace_period: GracePeriodSpec = Field(default_factory=GracePeriodSpec)
    """Grace period policy (automatic by default)."""
    max_restarts: int = Field(default=3, ge=0)
    """Restarts allowed after real failures (preemptions never count)."""
    restart_backoff_seconds: int = Field(default=10, ge=0)
    """Delay before the first restart after a real failure; doubles with each further failure."""
    active_deadline_seconds: int | None = Field(default=None, ge=1)
    """Seconds the whole TrainingJob may take, over all its attempts, counted from the start of
    the first (status.startTime) and including time queued, pending, suspended or requeued after
    preemptions. When it passes the job is Failed with reason DeadlineExceeded and the running
    attempt is stopped (its pods still write their JIT checkpoint). Unset: no limit."""
    max_preemptions: int | None = Field(default=None, ge=0)
    """Preemptions tolerated (status.preemptions, less those of attempts that had not run yet:
    status.preemptionsBeforeRunning); the one after that ends the job as Failed with reason
    PreemptionLimitExceeded instead of requeueing it, so a job preempted in a loop ends with a
    clear reason. 0: the first preemption fails the job. Unset: no limit."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    """Seconds after the job finished (Succeeded or Failed, status.completionTime) when the
    operator deletes the TrainingJob; its Jobs, pods and Service go with it (owner references).
    Checkpoints in storage are kept. 0: deleted as soon as it finishes. Unset: kept until
    deleted by hand (as a batch/v1 Job's ttlSecondsAfterFinished)."""
    queue_name: str | None = Field(default=None, max_length=_LABEL_VALUE_MAX)
    """Kueue LocalQueue; copied to label kueue.x-k8s.io/queue-name (the Job is created suspended
    and Kueue admits it)."""
    priority_class: str | None = Field(default=None, max_length=_LABEL_VALUE_MAX)
    """Kueue WorkloadPriorityClass; copied to label kueue.x-k8s.io/priority-class."""
    suspend: bool = False
    """true stops the job gracefully (JIT checkpoint, pods removed); false resumes it."""
    metrics_port: int = Field(default=9090, ge=1, le=65535)
    """Port of the runtime's /metrics in the pods (PREEMPTIBLE_METRICS_PORT)."""
    master_port: int = Field(default=29500, ge=1, le=65535)
    """torch.distributed rendezvous port (MASTER_PORT)."""
    pod_template: PodTemplateOverride | None = None
    """Pod template overrides merged into the operator's template."""
    preemption: PreemptionSpec | None = None
    """How Kueue picks this job as a preemption victim (spec.preemption.minRunSeconds)."""
    # --- failure policy and unreachable nodes (issue 30)
    failure_policy: FailurePolicySpec | None = None
    """Rules by exit code and reason for failed attempts (FailJob, Restart, Ignore) and the
    window maxRestarts counts failures in. Preemptions and suspensions never reach it."""
    unreachable_node: UnreachableNodeSpec = Field(default_factory=UnreachableNodeSpec)
    """When to ask an administrator to act on a NotReady node that holds an attempt's pod."""
    elastic: ElasticSpec | None = None
    """Elastic size: attempts on fewer (or more) pods than numNodes when that is what Kueue can
    admit now, the global batch kept (issue 40). Unset: every attempt runs on numNodes pods."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Matches('"{queueName}"' + _LABEL_VALUE_RULE, field="queueName", pattern=_LABEL_VALUE),
        Matches(
            '"{priorityClass}"' + _LABEL_VALUE_RULE, field="priorityClass", pattern=_LABEL_VALUE
        ),
        IntOrWord(
            "numProcPerNode ({numProcPerNode}) must be a positive integer (processes per pod) or "
            "'auto' (one per nvidia.com/gpu the pod requests)",
            field="numProcPerNode",
            minimum=1,
            word="auto",
        ),
        WordNeedsKey(
            "numProcPerNode: auto starts one process per GPU, but resourcesPerNode requests no "
            f"{GPU_RESOURCE}: add resourcesPerNode.limits['{GPU_RESOURCE}'] or give a number",
            field="numProcPerNode",
            word="auto",
            key=GPU_RESOURCE,
            maps=(("resourcesPerNode", "limits"), ("resourcesPerNode", "requests")),
        ),
        NeedsItems(
            "numProcPerNode ({numProcPerNode}) starts the training command through the "
            "launcher, so spec.command must name it (the image's entrypoint is unknown to the "
            "operator): set command, e.g. [python, train.py]",
            field="numProcPerNode",
            other="command",
            unless=1,
        ),
        # spec.elastic against the fields around it (its own minNodes <= maxNodes: ElasticSpec)
        Requires(
            "elastic needs queueName: Kueue decides each attempt's size (a Workload admitted "
            "with minNodes..maxNodes pods), so set queueName to a Kueue LocalQueue",
            field="elastic",
            other="queueName",
        ),
        NotAbove(
            "elastic.minNodes ({elastic.minNodes}) must not exceed numNodes ({numNodes}) while "
            "elastic.maxNodes is unset (it defaults to numNodes); lower minNodes or set maxNodes",
            low="elastic.minNodes",
            high="numNodes",
            unless="elastic.maxNodes",
        ),
        KeepsGlobalBatch(
            nodes="numNodes",
            min_nodes="elastic.minNodes",
            max_nodes="elastic.maxNodes",
            accumulation="elastic.gradientAccumulationSteps",
        ),
    )


# -------------------------------------------------------------------------------------- status


def _status_schema(schema: dict[str, Any], model: type) -> None:
    # Status models keep unknown fields (below), but the CRD's schema stays as the known fields
    # describe it: the apiserver prunes what the installed (possibly newer) CRD does not declare.
    _schema_rules(schema, model)
    schema.pop("additionalProperties", None)


_FROM_WIRE = "preemptible.fromWire"


def _newer_value_kept(
    value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
) -> Any:
    # A status enum read from the apiserver may hold a value a newer operator added (the CRD
    # is never downgraded on a rollback, so the apiserver accepts it): kept as the string it is
    # and written back unchanged, as unknown fields are. From Python it stays an error.
    try:
        return handler(value)
    except ValidationError:
        if (
            isinstance(value, str)
            and isinstance(info.context, dict)
            and info.context.get(_FROM_WIRE)
        ):
            return value
        raise


_NewerValueKept = WrapValidator(_newer_value_kept)
StatusPhase = Annotated[Phase, _NewerValueKept]
ConditionStatus = Annotated[Literal["True", "False", "Unknown"], _NewerValueKept]
AttemptOutcome = Annotated[
    Literal["Succeeded", "Preempted", "Failed", "Suspended"], _NewerValueKept
]
RecordedFailureAction = Annotated[FailurePolicyAction, _NewerValueKept]


class _Status(_Model):
    """A status model: fields it does not know are kept and written back unchanged.

    A newer operator may add status fields (``attempts[].failureAction`` did); after a rollback of
    the operator (helm never downgrades the CRD, so the apiserver still stores them) this version
    must neither refuse such an object (every pass would raise and the job would wedge) nor drop
    the fields on its next write (the status is written whole: the newer version, rolled forward
    again, would lose what it recorded). Unknown wire fields are therefore round-tripped
    (``extra="allow"``). In Python the models stay strict: a constructor keyword or attribute
    that is not a field is an error, so a typo never reaches the status silently."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_status_schema)

    @classmethod
    def model_validate(  # type: ignore[override]
        cls, obj: Any, *, context: dict[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        """Parse what the apiserver stores: unknown fields and newer enum values are kept (the
        constructor, for Python callers, refuses both)."""
        return super().model_validate(obj, context={_FROM_WIRE: True, **(context or {})}, **kwargs)

    @model_validator(mode="after")
    def _wire_names_only(self) -> Any:
        # Fields a newer version wrote are camelCase on the wire; a snake_case extra is a
        # Python caller's misspelt keyword.
        misspelt = [k for k in self.model_extra or {} if "_" in k]
        if misspelt:
            raise ValueError(f"{type(self).__name__} has no field(s) {', '.join(misspelt)}")
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in type(self).model_fields and not name.startswith("_"):
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        super().__setattr__(name, value)


class Condition(_Status):
    """A Kubernetes-style condition."""

    type: str
    """Admitted, Running, Checkpointing, Preempted, Succeeded, Failed, GracePeriodSufficient."""
    status: ConditionStatus
    """Condition status."""
    reason: str | None = None
    """CamelCase machine-readable reason."""
    message: str | None = None
    """Human-readable detail."""
    last_transition_time: str | None = None
    """RFC3339 time of the last status change."""
    observed_generation: int | None = None
    """metadata.generation this condition was computed for."""


class AttemptRecord(_Status):
    """One attempt (one Job) of the TrainingJob."""

    attempt: int
    """Attempt number (1-based); the Job is <name>-a<attempt>."""
    job_name: str
    """Name of the attempt's Job."""
    start_time: str | None = None
    """When the attempt's Job was created."""
    running_time: str | None = None
    """When the operator first saw all the attempt's pods running together (it started)."""
    end_time: str | None = None
    """When the attempt was recorded as over."""
    reason: str | None = None
    """Why it ended (Completed, KueuePreempted, PodEvicted, NodeLost, RuntimePreempted,
    DeadlineTooShort: the runtime did not start a save that could not finish in time...)."""
    message: str | None = None
    """Detail of the ending."""
    outcome: AttemptOutcome | None = None
    """Outcome class: preemptions and suspensions never count against maxRestarts."""
    start_step: int | None = None
    """Checkpoint step the attempt resumed from (0 for a fresh start)."""
    end_step: int | None = None
    """Last global step this attempt reported (termination message, else its last scraped step;
    its startStep when it reported none, e.g. preempted while loading)."""
    checkpoint: str | None = None
    """Newest complete checkpoint when the attempt ended."""
    resume_from: str | None = None
    """PREEMPTIBLE_RESUME_FROM given to the attempt."""
    resumed_from: str | None = None
    """Checkpoint the attempt actually loaded, as its runtime reported it when it ended (empty
    for a fresh start). It differs from resumeFrom when that checkpoint turned out corrupt and
    the runtime fell back to an earlier complete one; startStep is then that one's step."""
    grace_seconds: int | None = None
    """terminationGracePeriodSeconds of the attempt's pods."""
    sigterm_to_exit_seconds: float | None = None
    """Seconds from SIGTERM to process exit (rank 0's termination message)."""
    exit_codes: list[int] | None = None
    """Exit codes of the training containers."""
    killed: bool | None = None
    """True when a container was SIGKILLed (grace too short)."""
    lost_steps: int | None = None
    """Steps done in this attempt that no complete checkpoint holds (endStep minus the newer of
    the newest complete checkpoint and startStep)."""
    lost_steps_estimated: bool | None = None
    """True when no pod of the attempt left a termination message (a kill at the grace
    deadline, an OOM kill, a lost node): endStep and lostSteps are then estimated from
    lastScrapedStep, its time and stepsPerSecond up to when training stopped (its container's
    end; on a lost node, the middle of lastScrapedTime and unreachableSince)."""
    last_scraped_step: int | None = None
    """The last step scraped from the attempt's rank 0 (/metrics) and written to status."""
    last_scraped_time: str | None = None
    """When lastScrapedStep was scraped (RFC3339, milliseconds)."""
    steps_per_second: float | None = None
    """The attempt's training rate measured between its scrapes (saves included)."""
    unreachable_since: str | None = None
    """When the first scrape of rank 0's /metrics after its last answered one went unanswered
    (RFC3339, milliseconds; cleared when it answers again): when its pods end with no
    terminated state (a lost node), training stopped between lastScrapedTime and this time,
    and lostSteps is estimated at their middle."""
    failure_rule: str | None = None
    """The spec.failurePolicy rule a failed attempt matched (its name, else rules[<index>])."""
    failure_action: RecordedFailureAction | None = None
    """What the failure policy decided for a failed attempt: FailJob, Restart or Ignore."""
    nodes: int | None = None
    """Pods the attempt ran on (spec.numNodes, or the size Kueue admitted for an elastic job)."""


class Progress(_Status):
    """Training progress as reported by the runtime."""

    step: int | None = None
    """Global step."""
    max_steps: int | None = None
    """Total steps."""
    epoch: float | None = None
    """Fractional epoch."""
    attempt: int | None = None
    """Attempt whose runtime reported `step` (an attempt's endStep and lostSteps count only its
    own reports, never a step an earlier attempt reached)."""
    scraped_at: str | None = None
    """When `step` was scraped (RFC3339, milliseconds)."""
    steps_per_second: float | None = None
    """Training rate of attempt `attempt`, measured between its scrapes (saves included)."""
    progress_percentage: int | None = None
    """Percent of maxSteps done (floor(100 x step / maxSteps); 100 once Succeeded). Kubeflow's
    convention (KEP-2779); a printer column of `kubectl get tj`."""
    estimated_remaining_seconds: int | None = None
    """Training seconds left at the measured step time: (maxSteps - step) x
    timings.stepSecondsEma. Time queued, suspended, checkpointing or restarting after a
    preemption is not in it; absent until a step time is measured, 0 once Succeeded, absent
    once Failed."""


class Timings(_Status):
    """Measured timings (seconds), maxima over all attempts."""

    step_seconds_max: float | None = None
    """Longest optimizer step seen."""
    step_seconds_p99: float | None = None
    """99th percentile of step time (latest report)."""
    step_seconds_ema: float | None = None
    """Exponential moving average of step time (latest report)."""
    save_seconds_last: float | None = None
    """Duration of the latest checkpoint save."""
    save_seconds_max: float | None = None
    """Longest checkpoint save seen."""
    sigterm_to_exit_seconds_max: float | None = None
    """Longest SIGTERM-to-exit time observed (ground truth for the grace rule)."""
    micro_batch_seconds_max: float | None = None
    """Longest micro-batch (mean per step, with gradient accumulation): the micro_batch stop
    policy's grace term."""


class GraceStatus(_Status):
    """Grace period bookkeeping."""

    current: int | None = None
    """Grace of the current (latest) attempt's pods."""
    recommended: int | None = None
    """What the rule recommends now, applied to the next attempt."""
    reason: str | None = None
    """How `recommended` was obtained."""
    inputs: dict[str, float | None] | None = Field(
        default=None,
        json_schema_extra={"type": "object", "additionalProperties": {"type": "number"}},
    )
    """Inputs of the rule (stepMax, saveMax, observedExitMax...)."""


class CheckpointIntervalStatus(_Status):
    """The checkpoint interval that minimises the expected lost time for this job."""

    recommended_seconds: int | None = None
    """sqrt(2 x saveSeconds x meanTimeBetweenPreemptionsSeconds) (Young's rule); None until a
    preemption and a save were observed."""
    save_seconds: float | None = None
    """Cost of one checkpoint save used (latest save, else the longest)."""
    mean_time_between_preemptions_seconds: float | None = None
    """runningSeconds divided by preemptions (both over the same attempts)."""
    running_seconds: float | None = None
    """Seconds the pods of the ended attempts among the kept records (status.attempts) ran."""
    preemptions: int | None = None
    """Preemptions among those same attempts (of attempts that ran)."""
    applied: bool | None = None
    """True when spec.checkpoint.interval is auto: new attempts get the recommended interval."""
    reason: str | None = None
    """How the recommendation was obtained (or why there is none yet)."""


class CheckpointRef(_Status):
    """A complete checkpoint."""

    step: int
    """Global step of the checkpoint."""
    path: str
    """Path as the pods see it."""
    completed_at: str | None = None
    """When it was committed (manifest created_at)."""
    save_seconds: float | None = None
    """How long the save took."""


class IncompleteCheckpoint(_Status):
    """A checkpoint directory that must not be resumed from."""

    step: int
    """Global step in its name."""
    path: str
    """Path as the pods see it."""
    reason: str | None = None
    """Why it is incomplete (sentinel present, manifest missing, file size mismatch...)."""


class TrainingJobStatus(_Status):
    """Observed state of a TrainingJob (written by the operator only)."""

    # Fields a newer operator wrote are kept (``_Status``); the docstring above is the CRD's.

    phase: StatusPhase | None = None
    """Pending, Queued, Running, Checkpointing, Requeueing, Suspended, Succeeded or Failed."""
    message: str | None = None
    """Human-readable summary of the current state."""
    observed_generation: int | None = None
    """metadata.generation the status was computed for."""
    conditions: list[Condition] | None = None
    """Conditions (see docs/operator.md)."""
    attempt: int | None = None
    """Current (latest) attempt number."""
    attempts: list[AttemptRecord] | None = None
    """Every attempt, oldest first."""
    nodes: str | None = None
    """Pods of the current attempt over the most it may run on (e.g. 3/4; 4/4 for a job
    without spec.elastic): the NODES printer column."""
    workload: str | None = None
    """The Kueue Workload the job holds its place in the queue with (spec.elastic jobs only: the
    operator creates it; a grow replaces it by the next slice, <name>-w<k>)."""
    progress: Progress | None = None
    """Training progress."""
    timings: Timings | None = None
    """Measured timings."""
    grace_period: GraceStatus | None = None
    """Grace period bookkeeping."""
    last_complete_checkpoint: CheckpointRef | None = None
    """Newest complete checkpoint (from storage when the operator can read it, else from the
    runtime's reports)."""
    incomplete_checkpoints: list[IncompleteCheckpoint] | None = None
    """Checkpoint directories that are incomplete (only when the operator can read storage)."""
    preemptions: int | None = None
    """Number of preemptions (Kueue eviction, pod disruption, node loss, runtime preemption)."""
    preemptions_before_running: int | None = None
    """Of those, preemptions of attempts that had not run yet (evicted while their pods were
    pending): spec.maxPreemptions does not count them."""
    failures: int | None = None
    """Number of real failures counted against maxRestarts (failures a failurePolicy rule
    ignores are not; with failurePolicy.restartWindowSeconds only those in the window count
    toward the limit, see failureTimes)."""
    failure_times: list[str] | None = None
    """RFC3339 times of the newest counted failures, oldest first (at most maxRestarts + 1, up
    to 1000): what failurePolicy.restartWindowSeconds counts, kept apart from the attempt
    records because only the newest 20 of those are kept."""
    lost_steps: int | None = None
    """Steps computed but lost (not in any complete checkpoint) over all attempts."""
    lost_steps_estimated: bool | None = None
    """True when lostSteps includes an estimate: an attempt that left no termination message
    (attempts[].lostStepsEstimated)."""
    checkpoint_interval: CheckpointIntervalStatus | None = None
    """Recommended checkpoint interval from the observed preemption rate and save cost."""
    next_attempt_after: str | None = None
    """RFC3339 time before which no new attempt is created (restart backoff)."""
    start_time: str | None = None
    """When the first attempt was created."""
    completion_time: str | None = None
    """When the job reached Succeeded or Failed."""
    checkpoint_storage_readable: bool | None = None
    """Whether the operator reads the checkpoint storage itself."""
    attempts_omitted: int | None = None
    """Oldest attempt records dropped from ``attempts`` to bound the object's size (the
    counters preemptions, failures and lostSteps still cover every attempt)."""


# ------------------------------------------------------------------------------------- parsing


def format_validation_error(exc: ValidationError, prefix: str = "spec") -> str:
    """The InvalidSpec message: one part per problem, naming the field by its camelCase path."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "__root__")
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        value = err.get("input")
        shown = "" if isinstance(value, dict | list) or value is None else f" (got {value!r})"
        parts.append(f"{loc}: {msg}{shown}")
    return "; ".join(parts)


def parse_spec(spec: dict[str, Any] | None) -> TrainingJobSpec:
    """Validate a raw spec (as stored by the apiserver). Raises ValidationError."""
    return TrainingJobSpec.model_validate(spec or {})
