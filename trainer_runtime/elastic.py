"""The elastic sizing rule shared by the operator and the runtime (torch-free, like grace.py).

An attempt of an elastic job may run on fewer or more nodes than the reference size
(``spec.numNodes``). The training stays the same training only when the global batch stays the
same: ``per_device_train_batch_size x processes per node x nodes x gradient_accumulation_steps``.
Processes per node and the per-device batch do not change with the size, so a size ``n`` keeps
the global batch exactly when ``n`` divides ``reference_nodes x accumulation``; the attempt then
accumulates ``reference_nodes x accumulation / n`` micro-batches per optimizer step. Design:
docs/elastic.md (the operator side is not built yet).
"""

from __future__ import annotations

from trainer_runtime.errors import ConfigurationError

__all__ = [
    "accumulation_at",
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
