"""spec.elastic (issue 40): what the models refuse, with a message naming the field, the value and
the fix, and the CEL the CRD carries for the same rules (the apiserver's side runs in
tests/operator/test_crd_validation.py)."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import crd, models
from preemptible_operator.spec_rules import MAX_ELASTIC_NODES, KeepsGlobalBatch, NotAbove, Requires

BASE: dict[str, Any] = {"image": "i", "command": ["python", "t.py"], "checkpoint": {"uri": "/c"}}


def _spec(
    low: int | None,
    high: int | None = None,
    steps: int | None = None,
    *,
    num_nodes: int = 4,
    queue: str | None = "q",
    **more: Any,
) -> dict[str, Any]:
    elastic: dict[str, Any] = {}
    for key, value in (("minNodes", low), ("maxNodes", high), ("gradientAccumulationSteps", steps)):
        if value is not None:
            elastic[key] = value
    spec = {**BASE, "numNodes": num_nodes, "elastic": elastic, **more}
    if queue is not None:
        spec["queueName"] = queue
    return spec


def _refusal(spec: dict[str, Any]) -> str:
    with pytest.raises(models.ValidationError) as info:
        models.parse_spec(spec)
    return models.format_validation_error(info.value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            _spec(3, 2),
            "spec.elastic.minNodes: minNodes (3) must not exceed maxNodes (2); lower minNodes or "
            "raise maxNodes",
        ),
        (
            _spec(5, num_nodes=4),
            "spec.elastic.minNodes: elastic.minNodes (5) must not exceed numNodes (4) while "
            "elastic.maxNodes is unset (it defaults to numNodes); lower minNodes or set maxNodes",
        ),
        (
            _spec(1, queue=None),
            "spec.queueName: elastic needs queueName: Kueue decides each attempt's size (a "
            "Workload admitted with minNodes..maxNodes pods), so set queueName to a Kueue "
            "LocalQueue",
        ),
        (
            _spec(1, queue=""),
            "spec.queueName: elastic needs queueName: Kueue decides each attempt's size (a "
            "Workload admitted with minNodes..maxNodes pods), so set queueName to a Kueue "
            "LocalQueue",
        ),
        (
            _spec(3, 3, 2, num_nodes=4),
            "spec.elastic: the range elastic.minNodes..maxNodes (maxNodes default numNodes) = "
            "[3, 3] holds no size that keeps the global batch of numNodes (4) x "
            "elastic.gradientAccumulationSteps (2) = 8 node micro-batches per optimizer step: a "
            "size must divide 8; sizes that do: [1, 2, 4, 8]; widen the range to include one, or "
            "change elastic.gradientAccumulationSteps",
        ),
        (
            _spec(5, 7, num_nodes=4),
            "spec.elastic: the range elastic.minNodes..maxNodes (maxNodes default numNodes) = "
            "[5, 7] holds no size that keeps the global batch of numNodes (4) x "
            "elastic.gradientAccumulationSteps (1) = 4 node micro-batches per optimizer step: a "
            "size must divide 4; sizes that do: [1, 2, 4]; widen the range to include one, or "
            "change elastic.gradientAccumulationSteps",
        ),
        (
            _spec(2, 3, num_nodes=5),
            "spec.elastic: the range elastic.minNodes..maxNodes (maxNodes default numNodes) = "
            "[2, 3] holds no size that keeps the global batch of numNodes (5) x "
            "elastic.gradientAccumulationSteps (1) = 5 node micro-batches per optimizer step: a "
            "size must divide 5; sizes that do: [1, 5]; widen the range to include one, or change "
            "elastic.gradientAccumulationSteps",
        ),
        (_spec(0), "spec.elastic.minNodes: Input should be greater than or equal to 1 (got 0)"),
        (
            _spec(1, MAX_ELASTIC_NODES + 1),
            "spec.elastic.maxNodes: Input should be less than or equal to 1024 (got 1025)",
        ),
        (_spec(1, 0), "spec.elastic.maxNodes: Input should be greater than or equal to 1 (got 0)"),
        (
            _spec(1, steps=0),
            "spec.elastic.gradientAccumulationSteps: Input should be greater than or equal to 1 "
            "(got 0)",
        ),
        (_spec(None), "spec.elastic.minNodes: Field required"),
        (
            _spec(1) | {"elastic": {"minNodes": 1, "growCooldownSeconds": -1}},
            "spec.elastic.growCooldownSeconds: Input should be greater than or equal to 0 (got -1)",
        ),
        # numProcPerNode: auto without a GPU request: the existing rule refuses it for an elastic
        # job as for any (the processes per pod must be known; elastic sizes only the pod count)
        (
            _spec(2, numProcPerNode="auto"),
            "spec.numProcPerNode: numProcPerNode: auto starts one process per GPU, but "
            "resourcesPerNode requests no nvidia.com/gpu: add "
            "resourcesPerNode.limits['nvidia.com/gpu'] or give a number",
        ),
        (
            _spec(2, numProcPerNode="auto", resourcesPerNode={"requests": {"cpu": 4}}),
            "spec.numProcPerNode: numProcPerNode: auto starts one process per GPU, but "
            "resourcesPerNode requests no nvidia.com/gpu: add "
            "resourcesPerNode.limits['nvidia.com/gpu'] or give a number",
        ),
    ],
)
def test_the_models_refuse_a_bad_elastic_spec(spec: dict[str, Any], message: str) -> None:
    assert _refusal(spec) == message


def test_an_empty_range_is_the_order_rules_message_only() -> None:
    # The apiserver evaluates every rule of the object; the global-batch rule has nothing to say
    # about a range with no sizes at all (minNodes > maxNodes says it), so it holds there.
    rule = models.TrainingJobSpec.rules[-1]
    values = {"numNodes": 4, "elastic": {"minNodes": 3, "maxNodes": 2}}
    assert (
        rule.violation(values | {"elastic": values["elastic"] | {"gradientAccumulationSteps": 1}})
        is None
    )


@pytest.mark.parametrize(
    "spec",
    [
        _spec(1),  # 1..numNodes
        _spec(4),  # exactly numNodes (a fixed size, through Kueue's Workload)
        _spec(2, 8, 2),  # 2, 4, 8 keep 4 x 2
        _spec(3, 3, 2, num_nodes=3),  # below numNodes: 3 divides 3 x 2
        _spec(2, 2, 3, num_nodes=2),  # the reference size alone, accumulation 3
        _spec(6, 6, 3, num_nodes=2),  # above numNodes: 6 divides 2 x 3
        _spec(8, MAX_ELASTIC_NODES, 2, num_nodes=4),  # up to the bound
        _spec(1500, num_nodes=2000),  # past the bound, through the default maxNodes
        _spec(1, numProcPerNode="auto", resourcesPerNode={"limits": {"nvidia.com/gpu": 8}}),
        _spec(1) | {"elastic": {"minNodes": 1, "growCooldownSeconds": 0}},
        {**BASE, "numNodes": 4},  # no spec.elastic: none of these rules, no queue needed
    ],
)
def test_the_models_accept_an_elastic_spec_that_keeps_the_global_batch(
    spec: dict[str, Any],
) -> None:
    models.parse_spec(spec)


def _brute_force(nodes: int, accumulation: int, low: int, high: int | None) -> bool:
    top = nodes if high is None else high
    return any((nodes * accumulation) % n == 0 for n in range(low, top + 1))


@pytest.mark.parametrize("nodes", [1, 2, 3, 4, 6, 7, 12])
@pytest.mark.parametrize("accumulation", [1, 2, 3, 5])
def test_the_global_batch_rule_accepts_exactly_the_ranges_holding_a_divisor(
    nodes: int, accumulation: int
) -> None:
    rule = models.TrainingJobSpec.rules[-1]
    assert isinstance(rule, KeepsGlobalBatch)
    for low in range(1, 16):
        for high in (None, *range(low, 16)):
            if high is None and low > nodes:
                continue  # the minNodes <= numNodes rule's case
            values = {
                "numNodes": nodes,
                "elastic": {
                    "minNodes": low,
                    "maxNodes": high,
                    "gradientAccumulationSteps": accumulation,
                },
            }
            broken = rule.violation(values) is not None
            assert broken is not _brute_force(nodes, accumulation, low, high), (values, broken)


def test_the_sizes_listed_are_every_divisor_up_to_the_bound() -> None:
    message = _refusal(_spec(1001, 1024, 1, num_nodes=3000))
    listed = message.split("sizes that do: [")[1].split("]")[0]
    assert [int(n) for n in listed.split(", ")] == [
        n for n in range(1, MAX_ELASTIC_NODES + 1) if 3000 % n == 0
    ]


def _spec_rule(kind: type) -> Any:
    (rule,) = [r for r in models.TrainingJobSpec.rules if type(r) is kind and "elastic" in str(r)]
    return rule


def test_cel_of_the_queue_rule() -> None:
    out = _spec_rule(Requires).to_cel()
    assert out["rule"] == (
        "!(has(self.elastic)) || (has(self.queueName) && size(self.queueName) > 0)"
    )
    assert out["fieldPath"] == ".queueName"


def test_cel_of_the_default_max_rule_checks_parents_first_and_skips_a_set_max() -> None:
    out = _spec_rule(NotAbove).to_cel()
    assert out["rule"] == (
        "!(has(self.elastic) && has(self.elastic.minNodes) && has(self.numNodes)) || "
        "((has(self.elastic) && has(self.elastic.maxNodes)) || "
        "self.elastic.minNodes <= self.numNodes)"
    )
    assert out["fieldPath"] == ".elastic.minNodes"
    assert out["messageExpression"] == (
        "'elastic.minNodes (%s) must not exceed numNodes (%s) while elastic.maxNodes is unset "
        "(it defaults to numNodes); lower minNodes or set maxNodes'"
        ".format([self.elastic.minNodes, self.numNodes])"
    )


def test_cel_of_the_global_batch_rule_tries_a_fixed_list_of_sizes() -> None:
    out = _spec_rule(KeepsGlobalBatch).to_cel()
    sizes = "[" + ", ".join(str(n) for n in range(1, MAX_ELASTIC_NODES + 1)) + "]"
    high = (
        "(has(self.elastic) && has(self.elastic.maxNodes) ? self.elastic.maxNodes : self.numNodes)"
    )
    total = "(self.numNodes * self.elastic.gradientAccumulationSteps)"
    assert out["rule"] == (
        "!(has(self.elastic) && has(self.elastic.minNodes) && has(self.numNodes) && "
        "has(self.elastic.gradientAccumulationSteps)) || "
        f"(self.elastic.minNodes > {high} || "
        f"(self.elastic.minNodes <= self.numNodes && self.numNodes <= {high}) || "
        f"{sizes}.exists(n, n >= self.elastic.minNodes && n <= {high} && {total} % n == 0))"
    )
    assert out["fieldPath"] == ".elastic"
    # One format argument per %s, in the text's order (the product shows twice).
    expression = out["messageExpression"]
    literal, args = expression.split("'.format([", 1)
    assert literal.count("%s") == 7
    assert args.endswith(f"{sizes}.filter(n, {total} % n == 0)])")
    assert args.count(total) == 3  # twice shown, once in the filter
    assert "<sizes>" in out["message"] and "<total>" in out["message"]


def test_the_crd_bounds_max_nodes_and_carries_the_rules_where_they_apply() -> None:
    spec = crd.openapi_schema()["properties"]["spec"]
    elastic = spec["properties"]["elastic"]
    assert elastic["properties"]["maxNodes"]["maximum"] == MAX_ELASTIC_NODES
    assert elastic["properties"]["minNodes"]["minimum"] == 1
    assert elastic["required"] == ["minNodes"]
    assert [v["fieldPath"] for v in elastic["x-kubernetes-validations"]] == [".minNodes"]
    paths = [v.get("fieldPath") for v in spec["x-kubernetes-validations"]]
    assert paths[-3:] == [".queueName", ".elastic.minNodes", ".elastic"]
