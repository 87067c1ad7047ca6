"""preemptible trainer runtime: a Hugging Face style Trainer that survives preemption."""

__all__: list[str] = []
