"""End-to-end scenarios on the real control plane (tests/cluster) with real training."""
