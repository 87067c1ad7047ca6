"""operator/rbac.py grants what the operator's own requests need; its admission policy covers
every cluster-wide write outside TrainingJobs; the user roles aggregate into edit/admin/view."""

from __future__ import annotations

import pytest

from preemptible_operator import models, rbac, render


def _grants() -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in [*rbac.NAMESPACED_RULES, *rbac.CLUSTER_RULES]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_owner_references_with_block_owner_deletion_are_allowed() -> None:
    """blockOwnerDeletion on a Job's owner reference needs update on trainingjobs/finalizers
    where the OwnerReferencesPermissionEnforcement admission plugin runs (OpenShift)."""
    assert (models.GROUP, f"{models.PLURAL}/finalizers", "update") in _grants()


def test_the_watch_caches_and_ownership_checks_are_allowed() -> None:
    grants = _grants()
    for verb in ("list", "watch"):
        assert ("kueue.x-k8s.io", "workloads", verb) in grants
        assert ("batch", "jobs", verb) in grants and ("", "pods", verb) in grants
    assert ("", "services", "get") in grants  # AlreadyExists: is it ours?


def test_chart_copy_of_the_policy_and_user_roles_is_generated() -> None:
    """charts/preemptible/files/generated-access.json is what operator/rbac.py generates."""
    assert rbac.main(["--check"]) == 0, "run: python -m preemptible_operator.rbac --write"


# Every cluster-wide write the operator holds on objects that are not its own TrainingJobs, and
# the admission operation it arrives as: the policy must see each of them.
_WRITE_OPERATIONS = {"create": "CREATE", "update": "UPDATE", "patch": "UPDATE", "delete": "DELETE"}
_GUARDED = {
    ("", "pods"),
    ("", "services"),
    ("batch", "jobs"),
    ("kueue.x-k8s.io", "workloads"),
    ("kueue.x-k8s.io", "workloads/status"),  # an elastic job's own Workload
}


@pytest.mark.parametrize(
    ("group", "resource", "verb"),
    sorted(
        (group, resource, verb)
        for group, resource, verb in _grants()
        if (group, resource) in _GUARDED and verb in _WRITE_OPERATIONS
    ),
)
def test_every_write_outside_training_jobs_is_under_the_policy(
    group: str, resource: str, verb: str
) -> None:
    rules = rbac.POLICY_MATCH_CONSTRAINTS["resourceRules"]
    assert any(
        group in r["apiGroups"]
        and resource in r["resources"]
        and _WRITE_OPERATIONS[verb] in r["operations"]
        for r in rules
    ), (group, resource, verb)


@pytest.mark.parametrize("verb", ["patch", "delete"])
def test_training_job_writes_are_under_the_policy(verb: str) -> None:
    """A patch of a TrainingJob's spec makes the operator launch what it says: the policy sees
    every write of the main resource (issue 39)."""
    assert (models.GROUP, models.PLURAL, verb) in _grants()
    assert any(
        models.GROUP in r["apiGroups"]
        and models.PLURAL in r["resources"]
        and _WRITE_OPERATIONS[verb] in r["operations"]
        for r in rbac.POLICY_MATCH_CONSTRAINTS["resourceRules"]
    )


def test_the_children_policy_checks_every_create_against_the_training_jobs() -> None:
    """Params: every TrainingJob of the namespace, none: refused; only labelled objects (params
    are looked up before the match condition)."""
    binding = rbac.children_policy_binding("c")["spec"]
    assert binding["paramRef"] == {"selector": {}, "parameterNotFoundAction": "Deny"}
    assert binding["matchResources"]["objectSelector"] == {
        "matchExpressions": [{"key": render.LABEL_TRAINING_JOB, "operator": "Exists"}]
    }
    policy = rbac.children_policy("c", "ns", "sa")["spec"]
    assert policy["paramKind"] == {"apiVersion": models.API_VERSION, "kind": models.KIND}
    creates = {
        (g, r) for rule in policy["matchConstraints"]["resourceRules"]
        for g in rule["apiGroups"] for r in rule["resources"] if "CREATE" in rule["operations"]
    }  # fmt: skip
    assert creates == {("batch", "jobs"), ("", "services")}


def test_the_writes_outside_training_jobs_are_the_guarded_ones() -> None:
    """A new write verb on another kind (say configmaps) must be added to the policy too."""
    writes = {
        (group, resource)
        for group, resource, verb in _grants()
        if verb in _WRITE_OPERATIONS and group != models.GROUP and resource != "events"
    }
    assert writes <= _GUARDED


def test_the_policy_matches_only_the_operator_service_account() -> None:
    policy = rbac.admission_policy("p", "preemptible-system", "preemptible")
    spec = policy["spec"]
    assert spec["matchConditions"] == [
        {
            "name": "operator-service-account",
            "expression": "request.userInfo.username == "
            "'system:serviceaccount:preemptible-system:preemptible'",
        }
    ]
    assert spec["failurePolicy"] == "Fail"
    assert rbac.admission_policy_binding("p")["spec"] == {
        "policyName": "p",
        "validationActions": ["Deny"],
    }
    # Each check names the finalizer or label it is about, so a refusal explains itself.
    messages = " ".join(v["message"] for v in spec["validations"])
    assert render.ATTEMPT_FINALIZER in messages and render.LABEL_TRAINING_JOB in messages


@pytest.mark.parametrize(
    ("role", "labels", "verbs"),
    [
        (
            "preemptible-edit",
            {rbac.AGGREGATE_TO_ADMIN, rbac.AGGREGATE_TO_EDIT},
            {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"},
        ),
        ("preemptible-view", {rbac.AGGREGATE_TO_VIEW}, {"get", "list", "watch"}),
    ],
)
def test_user_roles_aggregate_into_the_builtin_roles(
    role: str, labels: set[str], verbs: set[str]
) -> None:
    (found,) = [r for r in rbac.user_roles() if r["metadata"]["name"] == role]
    assert found["metadata"]["labels"] == dict.fromkeys(labels, "true")
    granted: dict[str, set[str]] = {}
    for rule in found["rules"]:
        assert rule["apiGroups"] == [models.GROUP]
        for resource in rule["resources"]:
            granted.setdefault(resource, set()).update(rule["verbs"])
    # Users manage TrainingJobs and read their status; the status is the operator's to write.
    assert granted == {models.PLURAL: verbs, f"{models.PLURAL}/status": {"get", "list", "watch"}}


def test_the_job_controllers_failed_create_events_can_be_read() -> None:
    """Pods refused by a ResourceQuota or Pod Security Admission show only as FailedCreate
    Events on the attempt's Job (issue 30)."""
    assert ("", "events", "list") in _grants()
