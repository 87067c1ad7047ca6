"""The elastic sizing rule shared by the operator and the runtime (torch-free, like grace.py).

An attempt of an elastic job may run on fewer or more nodes than the reference size
(``spec.numNodes``). The training stays the same training only when the global batch stays the
same: ``per_device_train_batch_size x processes per node x nodes x gradient_accumulation_steps``.
Processes per node and the per-device batch do not change with the size, so a size ``n`` keeps
the global batch exactly when ``n`` divides ``reference_nodes x accumulation``; the attempt then
accumulates ``reference_nodes x accumulation / n`` micro-batches per optimizer step. Design:
docs/elastic.md (the operator applies it: operator/elastic_attempt.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.protocol import ENV_ELASTIC_ACCUMULATION, ENV_ELASTIC_REFERENCE_NODES

__all__ = [
    "accumulation_at",
    "elastic_accumulation",
    "restart_pays",
    "sizes_keeping_global_batch",
]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{name} must be an integer >= 1, got {value!r}")


def sizes_keeping_global_batch(
    reference_nodes: int, accumulation: int, min_nodes: int, max_nodes: int
) -> tuple[int, ...]:
    """The node counts in ``[min_nodes, max_nodes]`` that keep the reference global batch.

    Empty when none does; the caller names the fields (``spec.elastic``) and the sizes that work
    (``sizes_keeping_global_batch(reference_nodes, accumulation, 1, reference_nodes *
    accumulation)``).
    """
    _check_positive(
        reference_nodes=reference_nodes,
        accumulation=accumulation,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
    )
    if min_nodes > max_nodes:
        raise ConfigurationError(
            f"min_nodes ({min_nodes}) must be <= max_nodes ({max_nodes}): swap them"
        )
    micro_batches = reference_nodes * accumulation  # node micro-batches per optimizer step
    return tuple(
        n for n in range(min_nodes, min(max_nodes, micro_batches) + 1) if micro_batches % n == 0
    )


def accumulation_at(nodes: int, reference_nodes: int, accumulation: int) -> int:
    """Gradient accumulation steps at ``nodes`` that keep the global batch of ``reference_nodes``
    nodes accumulating ``accumulation`` micro-batches; a size that cannot is refused, naming the
    sizes that work."""
    _check_positive(nodes=nodes, reference_nodes=reference_nodes, accumulation=accumulation)
    micro_batches = reference_nodes * accumulation
    if micro_batches % nodes:
        works = sizes_keeping_global_batch(reference_nodes, accumulation, 1, micro_batches)
        raise ConfigurationError(
            f"{nodes} nodes cannot keep the global batch of {reference_nodes} nodes x "
            f"gradient_accumulation_steps={accumulation} ({micro_batches} node micro-batches per "
            f"optimizer step); sizes that can: {', '.join(map(str, works))}"
        )
    return micro_batches // nodes


def restart_pays(
    current_nodes: int, target_nodes: int, cooldown_seconds: float, pause_seconds: float
) -> bool:
    """Whether growing from ``current_nodes`` to ``target_nodes`` repays its pause (JIT save, pod
    start, resume: no progress) within ``cooldown_seconds``: progress ``target x (cooldown -
    pause)`` at the larger size against ``current x cooldown`` staying as is."""
    _check_positive(current_nodes=current_nodes, target_nodes=target_nodes)
    if target_nodes <= current_nodes or pause_seconds >= cooldown_seconds:
        return False
    return target_nodes * (cooldown_seconds - pause_seconds) >= current_nodes * cooldown_seconds


def _env_int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        raise ConfigurationError(f"${name}={raw!r} must be an integer >= 1") from None
    if value < 1:
        raise ConfigurationError(f"${name}={raw!r} must be an integer >= 1")
    return value


def elastic_accumulation(requested: int, env: Mapping[str, str]) -> tuple[int, str] | None:
    """The gradient accumulation this process trains with in an elastic attempt, and the line
    to log; None outside one (``$PREEMPTIBLE_ELASTIC_REFERENCE_NODES`` unset).

    Nodes are ``WORLD_SIZE / LOCAL_WORLD_SIZE`` (the launcher's). ``requested`` (the script's
    ``gradient_accumulation_steps``) must be the accumulation at the reference size, or already
    the one at this size (arguments rebuilt from a resolved copy); anything else means the job's
    spec and the script disagree, and training would silently change its global batch.
    """
    if not env.get(ENV_ELASTIC_REFERENCE_NODES):
        return None
    reference = _env_int(env, ENV_ELASTIC_REFERENCE_NODES)
    accumulation = _env_int(env, ENV_ELASTIC_ACCUMULATION)
    world = _env_int({"WORLD_SIZE": env.get("WORLD_SIZE", "1")}, "WORLD_SIZE")
    local = _env_int({"LOCAL_WORLD_SIZE": env.get("LOCAL_WORLD_SIZE", "1")}, "LOCAL_WORLD_SIZE")
    if world % local:
        raise ConfigurationError(
            f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: every node of an "
            "elastic attempt runs the same number of processes"
        )
    nodes = world // local
    target = accumulation_at(nodes, reference, accumulation)
    if requested not in (accumulation, target):
        raise ConfigurationError(
            f"gradient_accumulation_steps={requested} but the job says the script accumulates "
            f"{accumulation} at {reference} node(s) (${ENV_ELASTIC_ACCUMULATION}, "
            "spec.elastic.gradientAccumulationSteps): make them agree"
        )
    message = (
        f"elastic attempt on {nodes} of {reference} reference node(s): "
        f"gradient_accumulation_steps {requested} -> {target} keeps the global batch "
        f"({reference} x {accumulation} node micro-batches per optimizer step)"
    )
    return target, message
