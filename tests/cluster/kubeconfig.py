"""Writing kubeconfig files and building API clients from them."""

from __future__ import annotations

from pathlib import Path

import kubernetes
import yaml

__all__ = ["api_client_from", "write_kubeconfig"]


def write_kubeconfig(
    path: Path,
    *,
    server: str,
    ca: Path,
    user: str,
    cert: Path | None = None,
    key: Path | None = None,
    token: str | None = None,
    namespace: str = "default",
) -> Path:
    """A one-context kubeconfig; credentials are a client certificate or a bearer token."""
    if (cert is None) == (token is None):
        raise ValueError("write_kubeconfig: give exactly one of cert/key or token")
    credentials: dict[str, str] = (
        {"token": token}
        if token is not None
        else {"client-certificate": str(cert), "client-key": str(key)}
    )
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "preemptible-test",
                "cluster": {"server": server, "certificate-authority": str(ca)},
            }
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [
            {
                "name": user,
                "context": {"cluster": "preemptible-test", "user": user, "namespace": namespace},
            }
        ],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    path.chmod(0o600)
    return path


def api_client_from(kubeconfig: Path) -> kubernetes.client.ApiClient:
    """A client for ``kubeconfig`` with a connection pool large enough for watches in threads."""
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=str(kubeconfig), client_configuration=configuration
    )
    configuration.connection_pool_maxsize = 16
    return kubernetes.client.ApiClient(configuration)
