"""Rendering of the attempt Job and the rendezvous Service (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import render
from tests.unit.operator.builders import META, make_spec
from trainer_runtime import protocol


def _params(**kw: Any) -> render.AttemptParams:
    base = {
        "attempt": 3,
        "grace_seconds": 77,
        "resume_from": "/ckpt/run/checkpoint-10",
        "suspended": False,
    }
    base.update(kw)
    return render.AttemptParams(**base)


def _env(job: dict[str, Any]) -> dict[str, Any]:
    container = job["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_job_identity_policies_and_owner() -> None:
    job = render.render_job(META, make_spec(numNodes=4), _params())
    assert job["metadata"]["name"] == "tj-a3"
    assert job["metadata"]["labels"] == {
        render.LABEL_TRAINING_JOB: "tj",
        render.LABEL_ATTEMPT: "3",
    }
    (owner,) = job["metadata"]["ownerReferences"]
    assert owner == {
        "apiVersion": "preemptible.dev/v1alpha1",
        "kind": "TrainingJob",
        "name": "tj",
        "uid": "uid-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 4, 4)
    assert spec["backoffLimit"] == 0
    assert spec["podReplacementPolicy"] == "Failed"
    assert spec["suspend"] is False
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "FailJob",
        "onExitCodes": {
            "containerName": "trainer",
            "operator": "In",
            "values": [protocol.EXIT_PREEMPTED],
        },
    }
    assert rules[1] == {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]}
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] == 77
    assert pod["subdomain"] == "tj"
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert container["command"] == ["python", "-m", "trainer_runtime.toy"]
    assert spec["template"]["metadata"]["finalizers"] == [render.ATTEMPT_FINALIZER]


def test_runtime_environment_contract() -> None:
    env = _env(render.render_job(META, make_spec(numNodes=2, masterPort=1234), _params()))
    index_ref = {
        "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
    }
    assert env[protocol.ENV_OUTPUT_DIR] == "/ckpt/run"
    assert env[protocol.ENV_RESUME_FROM] == "/ckpt/run/checkpoint-10"
    assert env[protocol.ENV_GRACE_SECONDS] == "77"
    # the grace less the launcher's margin (7.7 s: a tenth, within 2..5 s): 72
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "72"
    assert env[protocol.ENV_KILL_WAIT_SECONDS] == "3"
    assert env[protocol.ENV_ATTEMPT] == "3"
    assert env[protocol.ENV_METRICS_PORT] == "9090"
    assert env[protocol.ENV_METRICS_HOST] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["MASTER_ADDR"] == "tj-a3-0.tj.ns.svc"
    assert env["MASTER_PORT"] == "1234"
    assert env["WORLD_SIZE"] == "2"
    assert env["NODE_RANK"] == index_ref and env["RANK"] == index_ref
    assert env["LOCAL_RANK"] == "0"


def test_single_node_gets_no_process_group_env() -> None:
    env = _env(render.render_job(META, make_spec(numNodes=1), _params()))
    assert not {
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "NODE_RANK",
    } & set(env)
    assert env[protocol.ENV_OUTPUT_DIR] == "/ckpt/run"


INDEX = {
    "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
}
TOPOLOGY = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "RANK", "LOCAL_RANK", "PET_NNODES",
    "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
)  # fmt: skip
MASTER = "tj-a3-0.tj.ns.svc"


@pytest.mark.parametrize(
    ("overrides", "topology"),
    [
        ({"numNodes": 1}, {}),
        ({"numNodes": 1, "numProcPerNode": 1}, {}),
        # One process per pod: exactly as before numProcPerNode existed.
        ({"numNodes": 2, "numProcPerNode": 1}, {
            "MASTER_ADDR": MASTER, "MASTER_PORT": "29500", "WORLD_SIZE": "2",
            "NODE_RANK": INDEX, "RANK": INDEX, "LOCAL_RANK": "0"}),
        # Several: world = nodes x processes, torchrun's PET_* options, no RANK / LOCAL_RANK (the
        # launcher gives each worker its own).
        ({"numNodes": 2, "numProcPerNode": 8}, {
            "MASTER_ADDR": MASTER, "MASTER_PORT": "29500", "WORLD_SIZE": "16",
            "NODE_RANK": INDEX, "PET_NNODES": "2", "PET_NPROC_PER_NODE": "8",
            "PET_NODE_RANK": INDEX, "PET_MASTER_ADDR": MASTER, "PET_MASTER_PORT": "29500"}),
        ({"numNodes": 1, "numProcPerNode": 4}, {
            "WORLD_SIZE": "4", "NODE_RANK": INDEX, "PET_NNODES": "1",
            "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": INDEX}),
        ({"numNodes": 3, "numProcPerNode": "auto",
          "resourcesPerNode": {"limits": {"nvidia.com/gpu": 4}}}, {
            "MASTER_ADDR": MASTER, "MASTER_PORT": "29500", "WORLD_SIZE": "12",
            "NODE_RANK": INDEX, "PET_NNODES": "3", "PET_NPROC_PER_NODE": "4",
            "PET_NODE_RANK": INDEX, "PET_MASTER_ADDR": MASTER, "PET_MASTER_PORT": "29500"}),
    ],
)  # fmt: skip
def test_process_group_environment_by_shape(
    overrides: dict[str, Any], topology: dict[str, Any]
) -> None:
    env = _env(render.render_job(META, make_spec(**overrides), _params()))
    assert {k: v for k, v in env.items() if k in TOPOLOGY} == topology


def test_several_processes_per_pod_start_through_the_launcher_with_a_shm() -> None:
    spec = make_spec(
        numProcPerNode=2,
        args=["--max-steps", "4"],
        volumes=[{"name": "ckpt", "hostPath": {"path": "/ckpt"}}],
        volumeMounts=[{"name": "ckpt", "mountPath": "/ckpt"}],
    )
    pod = render.render_job(META, spec, _params())["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == [
        "trainer-runtime", "launch", "--", "python", "-m", "trainer_runtime.toy"
    ]  # fmt: skip
    assert container["args"] == ["--max-steps", "4"]
    assert pod["volumes"][0] == {
        "name": render.SHM_VOLUME,
        "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"},
    }
    assert [m["mountPath"] for m in container["volumeMounts"]] == [
        "/dev/shm",
        "/ckpt",
        render.NODE_NOTICE_DIR,
    ]
    # One process per pod: no /dev/shm of ours, the command as it is.
    one = render.render_job(META, make_spec(numNodes=2), _params())["spec"]["template"]["spec"]
    assert [v["name"] for v in one["volumes"]] == [render.NODE_NOTICE_VOLUME]
    assert [m["name"] for m in one["containers"][0]["volumeMounts"]] == [render.NODE_NOTICE_VOLUME]
    assert one["containers"][0]["command"] == ["python", "-m", "trainer_runtime.toy"]


def test_rdma_through_the_pod_template_keeps_our_hardening() -> None:
    """IPC_LOCK and RDMA devices through podTemplate: the capability is added to our drop-all
    (not replacing it), the device resources join ours, the user's /dev/shm mount gives way."""
    spec = make_spec(
        numProcPerNode=8,
        resourcesPerNode={"limits": {"nvidia.com/gpu": 8, "memory": "512Gi"}},
        podTemplate={"spec": {"containers": [{
            "name": "trainer",
            "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
            "resources": {"limits": {"rdma/rdma_shared_device_a": 1},
                          "requests": {"rdma/rdma_shared_device_a": 1}},
            "volumeMounts": [{"name": "mine", "mountPath": "/dev/shm"}],
        }]}},
    )  # fmt: skip
    pod = render.render_job(META, spec, _params())["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    assert trainer["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
    }
    assert trainer["resources"] == {
        "limits": {"nvidia.com/gpu": 8, "memory": "512Gi", "rdma/rdma_shared_device_a": 1},
        "requests": {"rdma/rdma_shared_device_a": 1},
    }
    shm = [m for m in trainer["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert shm == [{"name": render.SHM_VOLUME, "mountPath": "/dev/shm"}]
    # A `drop` of the user's replaces ours.
    caps = {"capabilities": {"drop": ["NET_RAW"]}}
    spec = make_spec(
        podTemplate={"spec": {"containers": [{"name": "trainer", "securityContext": caps}]}}
    )
    (trainer,) = render.render_job(META, spec, _params())["spec"]["template"]["spec"]["containers"]
    assert trainer["securityContext"]["capabilities"] == {"drop": ["NET_RAW"]}


@pytest.mark.parametrize(
    ("secret", "template_env_from", "expected"),
    [
        (None, None, None),
        ("s3-creds", None, [{"secretRef": {"name": "s3-creds"}}]),
        (None, [{"configMapRef": {"name": "cfg"}}], [{"configMapRef": {"name": "cfg"}}]),
        (
            "s3-creds",
            [{"configMapRef": {"name": "cfg"}}, {"secretRef": {"name": "s3-creds"}}],
            [{"secretRef": {"name": "s3-creds"}}, {"configMapRef": {"name": "cfg"}}],
        ),
    ],
)
def test_checkpoint_credentials_secret_becomes_env_from(
    secret: str | None, template_env_from: list | None, expected: list | None
) -> None:
    """spec.checkpoint.credentialsSecret reaches the training container as envFrom; sources the
    user adds through podTemplate come after it (nothing of theirs is dropped, nothing doubled)."""
    checkpoint = {"uri": "s3://bucket/run", **({"credentialsSecret": secret} if secret else {})}
    template = (
        {"spec": {"containers": [{"name": "trainer", "envFrom": template_env_from}]}}
        if template_env_from
        else None
    )
    spec = make_spec(checkpoint=checkpoint, podTemplate=template)
    (trainer,) = render.render_job(META, spec, _params())["spec"]["template"]["spec"]["containers"]
    assert trainer.get("envFrom") == expected
    assert _env(render.render_job(META, spec, _params()))[protocol.ENV_OUTPUT_DIR] == (
        "s3://bucket/run"
    )


@pytest.mark.parametrize("name", ["Bad_Name", "-x", "a" * 254])
def test_credentials_secret_must_be_a_secret_name(name: str) -> None:
    with pytest.raises(ValueError):
        make_spec(checkpoint={"uri": "s3://b/r", "credentialsSecret": name})


@pytest.mark.parametrize(
    ("queue", "priority", "suspended", "labels"),
    [
        (None, None, False, {}),
        ("team-a", None, True, {render.KUEUE_QUEUE_LABEL: "team-a"}),
        (
            "team-a",
            "high",
            True,
            {render.KUEUE_QUEUE_LABEL: "team-a", render.KUEUE_PRIORITY_LABEL: "high"},
        ),
    ],
)
def test_kueue_labels_and_suspension(
    queue: str | None, priority: str | None, suspended: bool, labels: dict[str, str]
) -> None:
    spec = make_spec(queueName=queue, priorityClass=priority)
    job = render.render_job(META, spec, _params(suspended=suspended))
    kueue = {k: v for k, v in job["metadata"]["labels"].items() if k.startswith("kueue")}
    assert kueue == labels
    assert job["spec"]["suspend"] is suspended
    # Kueue labels stay off the pods (Kueue's pod integration must not adopt them).
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert not any(k.startswith("kueue") for k in pod_labels)


def test_user_overrides_merge_without_losing_ours() -> None:
    spec = make_spec(
        env=[{"name": "HF_HOME", "value": "/cache"}],
        resourcesPerNode={"requests": {"cpu": 2}, "limits": {"memory": "1Gi"}},
        volumes=[{"name": "ckpt", "hostPath": {"path": "/ckpt"}}],
        volumeMounts=[{"name": "ckpt", "mountPath": "/ckpt"}],
        podTemplate={
            "metadata": {
                "labels": {"team": "a", render.LABEL_ATTEMPT: "999"},
                "annotations": {"note": "x"},
            },
            "spec": {
                "nodeSelector": {"pool": "spot"},
                "tolerations": [{"key": "spot", "operator": "Exists"}],
                "volumes": [{"name": "cache", "emptyDir": {}}],
                "restartPolicy": "Always",
                "terminationGracePeriodSeconds": 1,
                "securityContext": {"runAsUser": 4242},
                "serviceAccountName": "trainer",
                "containers": [
                    {
                        "name": "trainer",
                        "image": "evil",
                        "resources": {"limits": {"nvidia.com/gpu": 1}},
                        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                        "env": [{"name": "EXTRA", "value": "1"}],
                    },
                    {"name": "sidecar", "image": "busybox"},
                ],
            },
        },
    )
    template = render.render_job(META, spec, _params())["spec"]["template"]
    meta, pod = template["metadata"], template["spec"]
    assert meta["labels"]["team"] == "a"
    assert meta["labels"][render.LABEL_ATTEMPT] == "3"  # ours win
    assert meta["annotations"]["note"] == "x"
    assert meta["annotations"][render.ANNOTATION_GRACE] == "77"
    assert pod["nodeSelector"] == {"pool": "spot"}
    assert pod["tolerations"] == [{"key": "spot", "operator": "Exists"}]
    assert [v["name"] for v in pod["volumes"]] == ["ckpt", render.NODE_NOTICE_VOLUME, "cache"]
    assert pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] == 77
    assert pod["securityContext"]["runAsUser"] == 4242
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["serviceAccountName"] == "trainer"
    trainer, sidecar = pod["containers"]
    assert sidecar["name"] == "sidecar"
    assert trainer["image"] == "preemptible:dev"
    assert trainer["resources"] == {
        "requests": {"cpu": 2},
        "limits": {"memory": "1Gi", "nvidia.com/gpu": 1},
    }
    assert [m["mountPath"] for m in trainer["volumeMounts"]] == [
        "/ckpt",
        render.NODE_NOTICE_DIR,
        "/cache",
    ]
    names = [e["name"] for e in trainer["env"]]
    assert names.count(protocol.ENV_OUTPUT_DIR) == 1
    assert "HF_HOME" in names and "EXTRA" in names


def test_service_is_headless_and_selects_all_attempts() -> None:
    svc = render.render_service(META, make_spec())
    assert svc["metadata"]["name"] == "tj"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {render.LABEL_TRAINING_JOB: "tj"}
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("tj", True),
        ("a" * 52, True),
        ("a" * 53, False),
        ("My-Job", False),
        ("1job", False),
        ("job.v1", False),
        ("job-", False),
    ],
)
def test_validate_name(name: str, ok: bool) -> None:
    problem = render.validate_name(name)
    assert (problem is None) is ok
    if problem:
        assert problem.startswith("metadata.name")


_OURS = {render.LABEL_TRAINING_JOB: "tj", render.LABEL_ATTEMPT: "3"}


@pytest.mark.parametrize(
    ("tj_labels", "tj_annotations", "job_labels", "job_annotations"),
    [
        # a team's labels and annotations reach the Job and the pods
        (
            {"team": "nlp", "app.kubernetes.io/name": "llm"},
            {"cost-center": "42"},
            {"team": "nlp", "app.kubernetes.io/name": "llm"},
            {"cost-center": "42"},
        ),
        # other tools' bookkeeping of the TrainingJob object itself stays on it
        (
            {"app.kubernetes.io/instance": "argo-app", "argocd.argoproj.io/x": "y"},
            {
                "kubectl.kubernetes.io/last-applied-configuration": "{...}",
                "argocd.argoproj.io/tracking-id": "app:preemptible.dev/TrainingJob:ns/tj",
                "meta.helm.sh/release-name": "r",
            },
            {},
            {},
        ),
        # keys the operator, Kueue and the Job controller own are never taken from the user
        (
            {
                render.LABEL_TRAINING_JOB: "other",
                render.LABEL_ATTEMPT: "99",
                render.KUEUE_QUEUE_LABEL: "sneaky",
                "batch.kubernetes.io/job-name": "x",
                "job-name": "x",
                "controller-uid": "u",
            },
            {render.ANNOTATION_GRACE: "1", render.ANNOTATION_TJ_UID: "forged"},
            {},
            {},
        ),
    ],
)
def test_training_job_labels_and_annotations_propagate_to_jobs_and_pods(
    tj_labels: dict[str, str],
    tj_annotations: dict[str, str],
    job_labels: dict[str, str],
    job_annotations: dict[str, str],
) -> None:
    meta = {**META, "labels": tj_labels, "annotations": tj_annotations}
    job = render.render_job(meta, make_spec(), _params())
    plain = render.render_job(META, make_spec(), _params())
    for got, base in ((job, plain), (job["spec"]["template"], plain["spec"]["template"])):
        labels, annotations = got["metadata"]["labels"], got["metadata"]["annotations"]
        assert labels == {**base["metadata"]["labels"], **job_labels}
        assert annotations == {**base["metadata"]["annotations"], **job_annotations}
        assert _OURS.items() <= labels.items()
    assert job["metadata"]["labels"].get(render.KUEUE_QUEUE_LABEL) is None


def test_pod_template_metadata_wins_over_the_training_job_labels() -> None:
    meta = {**META, "labels": {"team": "nlp", "tier": "a"}, "annotations": {"note": "tj"}}
    spec = make_spec(
        podTemplate={"metadata": {"labels": {"tier": "b"}, "annotations": {"note": "pod"}}}
    )
    pod = render.render_job(meta, spec, _params())["spec"]["template"]["metadata"]
    assert pod["labels"]["team"] == "nlp"
    assert pod["labels"]["tier"] == "b"
    assert pod["annotations"]["note"] == "pod"
    assert pod["labels"][render.LABEL_TRAINING_JOB] == "tj"
