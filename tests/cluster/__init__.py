"""The cluster test tier: a real control plane (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, Kueue) on loopback and a stand-in node agent. See docs/cluster-tests.md."""

from .binaries import Binaries, MissingBinariesError, find_binaries
from .controlplane import ControlPlane
from .kueue import Kueue
from .node_agent import ContainerRun, NodeAgent, PodRecord

__all__ = [
    "Binaries",
    "ContainerRun",
    "ControlPlane",
    "Kueue",
    "MissingBinariesError",
    "NodeAgent",
    "PodRecord",
    "find_binaries",
]
