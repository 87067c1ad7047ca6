"""operator/rbac.py grants what the operator's own requests need."""

from __future__ import annotations

from preemptible_operator import models, rbac


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


def test_the_job_controllers_failed_create_events_can_be_read() -> None:
    """Pods refused by a ResourceQuota or Pod Security Admission show only as FailedCreate
    Events on the attempt's Job (issue 30)."""
    assert ("", "events", "list") in _grants()
