"""Operator init container: create the kopf peering object(s) if missing, retrying while the CRD
settles (one `kubectl apply` cannot create a CRD and its objects). See docs/install.md."""

import os
import sys
import time

from kubernetes import client, config
from kubernetes.client.rest import ApiException

GROUP, VERSION = "kopf.dev", "v1"


def ensure(api, name, namespace, deadline):
    kind = "ClusterKopfPeering" if namespace is None else "KopfPeering"
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": {"name": name}}
    where = f"{kind} {name}" + ("" if namespace is None else f" in namespace {namespace}")
    while True:
        try:
            if namespace is None:
                api.create_cluster_custom_object(GROUP, VERSION, "clusterkopfpeerings", body)
            else:
                api.create_namespaced_custom_object(GROUP, VERSION, namespace, "kopfpeerings", body)
            print(f"created {where}", flush=True)
            return True
        except ApiException as exc:
            if exc.status == 409:
                print(f"{where} exists", flush=True)
                return True
            if exc.status == 404 and time.monotonic() < deadline:
                # The CRD (or the namespace) is not served yet.
                time.sleep(2)
                continue
            print(f"cannot create {where}: HTTP {exc.status} {exc.reason}: {exc.body}", flush=True)
            return False


def main():
    name = os.environ.get("PEERING_NAME", "")
    if not name:
        print("PEERING_NAME is empty: set it to the peering object's name", file=sys.stderr)
        return 2
    namespaces = os.environ.get("PEERING_NAMESPACES", "").split()
    deadline = time.monotonic() + float(os.environ.get("PEERING_TIMEOUT_SECONDS", "120"))
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.CustomObjectsApi()
    ok = all([ensure(api, name, ns, deadline) for ns in (namespaces or [None])])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
