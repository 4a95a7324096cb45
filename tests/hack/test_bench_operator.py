"""hack/bench_operator.py and hack/fake_apiserver.py: the fake StatefulSet controller, set-based
selectors, the summaries, and one small fleet run end to end (real operator process; figures unchecked)."""

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

HACK = Path(__file__).resolve().parents[2] / "hack"


def load(name: str):
    if str(HACK) not in sys.path:
        sys.path.insert(0, str(HACK))  # bench_operator imports fake_apiserver by name
    spec = importlib.util.spec_from_file_location(name, HACK / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


fake = load("fake_apiserver")
STS, PODS, REVISIONS = "apps/v1/statefulsets", "v1/pods", "apps/v1/controllerrevisions"


def test_set_based_selectors_as_the_operator_writes_them():
    match = fake.label_match
    group0 = "app=x,group notin (1,2,3),hash!=new"
    assert match({"app": "x", "group": "0", "hash": "old"}, group0)
    assert match({"app": "x", "hash": "old"}, group0)  # a pod from before fleets: no group label
    assert not match({"app": "x", "group": "2", "hash": "old"}, group0)
    assert not match({"app": "x", "group": "0", "hash": "new"}, group0)
    assert match({"group": "2"}, "group in (1, 2)") and not match({}, "group in (1,2)")
    assert match({"a": "1"}, "a,!b") and not match({"a": "1", "b": "2"}, "a,!b")
    assert match({"a": "1"}, "a==1") and not match({"a": "1"}, "a=2")


def statefulset(name: str, replicas: int, image: str) -> dict:
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name},
            "spec": {"replicas": replicas, "template": {
                "metadata": {"labels": {"app": name, "image": image.replace(":", "-")}},
                "spec": {"containers": [{"name": "server", "image": image}]}}}}


def test_statefulset_controller_plays_on_delete_groups():
    async def scenario() -> None:
        server = fake.FakeApiServer({STS: ("StatefulSet", True), PODS: ("Pod", True),
                                     REVISIONS: ("ControllerRevision", True)})
        controller = fake.StatefulSetController(server)

        async def settle() -> None:
            while controller.tasks or controller.pending:
                await asyncio.sleep(0)

        def pods() -> dict[str, dict]:
            return {name: obj for (key, _, name), obj in server.objects.items() if key == PODS}

        await server._create(STS, "ns", statefulset("web-g1", 2, "img:1"))
        await settle()
        assert sorted(pods()) == ["web-g1-0", "web-g1-1"]
        pod = pods()["web-g1-1"]
        assert pod["metadata"]["labels"]["apps.kubernetes.io/pod-index"] == "1"
        assert pod["status"]["phase"] == "Running" and pod["status"]["conditions"][0]["status"] == "True"
        sts = server.objects[(STS, "ns", "web-g1")]
        assert sts["status"]["replicas"] == 2 and sts["status"]["readyReplicas"] == 2
        revisions = [obj for (key, _, _), obj in server.objects.items() if key == REVISIONS]
        assert len(revisions) == 1 and revisions[0]["metadata"]["labels"]["app"] == "web-g1"

        # OnDelete: a new template changes no pod until the pod is deleted; then it comes back new.
        await server._patch(STS, "ns", "web-g1", None, {"spec": {"template": statefulset("web-g1", 2, "img:2")
                                                                 ["spec"]["template"]}})
        await settle()
        assert {p["spec"]["containers"][0]["image"] for p in pods().values()} == {"img:1"}
        await server._delete_collection(PODS, "ns", "app=web-g1,image notin (img-2)")
        await settle()
        assert {p["spec"]["containers"][0]["image"] for p in pods().values()} == {"img:2"}
        assert sum(key == REVISIONS for key, _, _ in server.objects) == 2

        await server._patch(STS, "ns", "web-g1", None, {"spec": {"replicas": 1}})
        await settle()
        assert sorted(pods()) == ["web-g1-0"]
        await server._delete(STS, "ns", "web-g1")
        await settle()
        assert pods() == {}

    asyncio.run(scenario())


def test_rounds_combine_into_medians_and_a_ratio_row():
    bench = load("bench_operator")
    base = {"n": 2, "statefulsets": 2, "pods_created": 4, "create_s": 1.0, "create_per_resource_s_median": 0.5,
            "roll_s": 2.0, "roll_per_resource_s_median": 1.0, "reconcile_ms_median": 10.0, "reconcile_ms_p95": 20.0,
            "reconcile_calls": 10, "idle_reconcile_ms_median": 5.0, "peak_rss_mb": 100.0,
            "rss_per_resource_kb": 500.0, "stale_after_roll": 0, "operator_log": "x", "reconcile_cpu_ms_median": 4.0,
            "reconcile_cpu_ms_p95": 8.0, "reconcile_overlap": 1.5, "create_writes_per_resource": 6.0,
            "roll_writes_per_resource": 9.0, "roll_ticks": 2.0, "roll_cpu_s": 1.0, "idle_requests_per_s": 0.0,
            "roll_requests": {"post pods": 1}}
    one = [dict(base, replicas=1, create_s=s, stale_after_roll=stale) for s, stale in ((1.0, 0), (3.0, 1), (2.0, 0))]
    case1 = bench.median_case(one)
    assert case1["create_s"] == 2.0 and case1["stale_after_roll"] == 1 and case1["rounds"] == 3
    case4 = bench.median_case([dict(base, replicas=4, statefulsets=8, reconcile_ms_median=30.0)])
    table = bench.fleet_table([case1, case4])  # the cost columns
    assert len(table) == 5 and table[-1].startswith("| 4 vs 1 (groups x4) | 4.0x")
    assert "3.00x" in table[-1]  # reconcile median 30 vs 10 ms
    assert case1["roll_requests"] == {"post pods": 1}  # not a figure: kept from the first round
    times = bench.fleet_table([case1, case4], bench.TIME_COLUMNS)
    assert times[2].startswith("| 1 | 2 | 2.0 |") and times[-1].endswith("| 0.0x |")  # stale: worst of 1 round, then 0
    assert bench.percentile([1, 2, 3, 4, 5], 50) == 3 and bench.percentile([1.0, 2.0], 95) == pytest.approx(1.95)


@pytest.mark.slow
def test_a_small_fleet_is_created_and_rolled_by_the_real_operator():
    bench = load("bench_operator")
    result = asyncio.run(bench.fleet_case(n=2, replicas=2, reconcile_interval=0.3, idle_window=0.5, timeout=120))
    assert result["statefulsets"] == 4 and result["stale_after_roll"] == 0
    assert result["pods_created"] >= 2 * 2 * 2 * 2  # nnodes 2 per group, once created and once rolled
    assert result["reconcile_calls"] > 0 and result["peak_rss_mb"] > 0 and result["roll_writes_per_resource"] > 0


def test_json_patch_applies_every_op_the_jsonpatch_library_writes_for_a_diff():
    # kopf writes its JSON patches with jsonpatch.from_diff: list elements replaced, inserted, moved,
    # removed. Our emulator must end where the library's own applier ends, for any pair.
    import random

    import jsonpatch

    rng = random.Random(7)
    kinds = ["Ready", "Progressing", "Degraded", "DraftReady", "ExternalCheck", "Policy"]
    for _ in range(400):
        def conditions() -> list[dict]:
            picked = rng.sample(kinds, rng.randint(0, len(kinds)))
            return [{"type": t, "status": rng.choice(["True", "False"]), "message": f"m{rng.randint(0, 2)}"}
                    for t in picked]
        before = {"metadata": {"resourceVersion": "5"}, "status": {"conditions": conditions(), "phase": "A"}}
        after = {"metadata": {"resourceVersion": "5"}, "status": {"conditions": conditions(), "phase": "B"}}
        ops = jsonpatch.JsonPatch.from_diff(before, after).patch
        assert fake.json_patch(before, ops) == jsonpatch.apply_patch(before, ops) == after, ops
    ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": "4"},
           {"op": "replace", "path": "/status/phase", "value": "C"}]
    with pytest.raises(ValueError, match="test failed at /metadata/resourceVersion"):
        fake.json_patch(before, ops)
