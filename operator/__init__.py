"""preemptible operator (import name ``preemptible_operator``)."""

__all__: list[str] = []
