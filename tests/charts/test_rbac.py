"""The chart's RBAC grants exactly what the operator uses: nothing missing,
nothing extra, in cluster-wide and single-namespace mode.

What the operator uses is derived from its code, not a hand-kept list:
- every Kubernetes client call in operator/mtp_operator/kube.py (AST), with
  the API group and resource read from the URL the official client sends
  for that method, and the verb from the method's name;
- every kopf index/handler decorator in the operator package (AST): kopf
  lists and watches what it indexes or handles.
Only kopf's framework needs that no decorator shows are listed by hand
(from kopf's deployment docs and its source): patching the handled resource
and its status, posting events, watching CRDs.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from pathlib import Path

import pytest
from kubernetes import client

from mtp_operator import constants as c

REPO = Path(__file__).resolve().parents[2]
OPERATOR = REPO / "operator" / "mtp_operator"
KUBE_PY = OPERATOR / "kube.py"

Permission = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

VERB_PREFIXES = [  # longest first: delete_collection before delete
    ("delete_collection_", "deletecollection"),
    ("create_", "create"),
    ("read_", "get"),
    ("list_", "list"),
    ("patch_", "patch"),
    ("replace_", "update"),
    ("delete_", "delete"),
]
CLUSTER_SCOPED = {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces")}

# kopf's own needs that no decorator in our code spells out. Peering is off
# (standalone: one replica), so no kopfpeerings.
KOPF_FRAMEWORK: set[Permission] = {
    (c.GROUP, c.PLURAL, "patch"),  # progress annotations, finalizers
    (c.GROUP, f"{c.PLURAL}/status", "patch"),  # status subresource
    ("", "events", "create"),  # kopf's handler error/success events
}
# With scanning on, kopf also watches CRDs (resource discovery at run time)
# and, in single-namespace mode, lists namespaces (falling back to the given
# one when forbidden).
KOPF_SCANNING: set[Permission] = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
}


def kopf_scanning_disabled(source: str) -> bool:
    """Whether the code sets `settings.scanning.disabled = True`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is True:
            if any(ast.unparse(t).endswith("scanning.disabled") for t in node.targets):
                return True
    return False


def client_api_classes(tree: ast.AST) -> dict[str, str]:
    """`self.core = client.CoreV1Api(...)` -> {"core": "CoreV1Api"}."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Attribute) and func.attr.endswith("Api"):
                for target in node.targets:
                    if isinstance(target, ast.Attribute):
                        found[target.attr] = func.attr
    return found


def client_calls(source: str) -> set[tuple[str, str]]:
    """(Api class, method) of every `self.<api>.<method>(...)` call."""
    tree = ast.parse(source)
    apis = client_api_classes(tree)
    calls = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr in apis:
                calls.add((apis[owner.attr], node.func.attr))
    return calls


def url_of(api_class: str, method: str) -> str:
    """The path template the official client requests for this method."""
    api = getattr(client, api_class)
    # Newer clients build the request in `_<method>_serialize`, older ones in
    # `<method>_with_http_info`.
    request_builder = getattr(api, f"_{method}_serialize", None) or getattr(api, f"{method}_with_http_info")
    paths = re.findall(r"""['"](/apis?/[^'"]+)['"]""", inspect.getsource(request_builder))
    assert len(paths) == 1, f"{api_class}.{method}: expected one URL, found {paths}"
    return paths[0]


def group_and_resource(path: str) -> tuple[str, str]:
    """/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}/status -> ("apps", "statefulsets/status")."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    else:
        group, rest = parts[1], parts[3:]
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    names = [p for p in rest if not p.startswith("{")]
    return group, "/".join(names)


def permission_of_call(api_class: str, method: str) -> Permission:
    verb = next((v for prefix, v in VERB_PREFIXES if method.startswith(prefix)), None)
    assert verb is not None, f"{api_class}.{method}: not a verb+resource client method"
    group, resource = group_and_resource(url_of(api_class, method))
    return group, resource, verb


def kopf_watched(source: str, constants: dict[str, object]) -> set[tuple[str, str]]:
    """(group, plural) of every kopf.index / kopf.on.* / kopf.timer decorator."""
    watched = set()
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        dotted = ast.unparse(node.func)
        if not re.fullmatch(r"kopf\.(index|timer|daemon|on\.(create|update|resume|delete|field|event))", dotted):
            continue
        args: list[object] = []
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                args.extend(constants[ast.unparse(arg.value)])  # e.g. *RESOURCE
            else:
                args.append(ast.literal_eval(arg))
        group, _version, plural = args
        watched.add((group, plural))
    return watched


@functools.cache
def required_permissions() -> frozenset[Permission]:
    needed = {permission_of_call(api, method) for api, method in client_calls(KUBE_PY.read_text())}
    import mtp_operator.handlers as handlers

    constants = {name: value for name, value in vars(handlers).items() if name.isupper()}
    scanning = True
    for path in OPERATOR.rglob("*.py"):
        source = path.read_text()
        for group, plural in kopf_watched(source, constants):
            needed |= {(group, plural, "list"), (group, plural, "watch")}
        scanning = scanning and not kopf_scanning_disabled(source)
    return frozenset(needed | KOPF_FRAMEWORK | (KOPF_SCANNING if scanning else set()))


def granted(objects: list[dict], kind: str, service_account: str) -> set[Permission]:
    """Permissions of `kind` roles bound to the service account."""
    bindings = [o for o in objects if o["kind"] == f"{kind}Binding"
                and any(s["kind"] == "ServiceAccount" and s["name"] == service_account for s in o["subjects"])]
    role_names = {b["roleRef"]["name"] for b in bindings if b["roleRef"]["kind"] == kind}
    perms = set()
    for role in objects:
        if role["kind"] == kind and role["metadata"]["name"] in role_names:
            for rule in role["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            perms.add((group, resource, verb))
    return perms


def test_calls_are_parsed_from_kube_py():
    # The derivation itself: real methods of the official client, mapped right.
    calls = client_calls(KUBE_PY.read_text())
    assert ("BatchV1Api", "create_namespaced_job") in calls
    perms = {permission_of_call(api, method) for api, method in calls}
    assert ("batch", "jobs", "create") in perms
    assert ("apps", "statefulsets", "patch") in perms
    assert permission_of_call("CoreV1Api", "delete_collection_namespaced_pod") == ("", "pods", "deletecollection")
    assert permission_of_call("CoreV1Api", "read_namespaced_pod_log") == ("", "pods/log", "get")
    assert permission_of_call("AppsV1Api", "replace_namespaced_stateful_set_status") == (
        "apps", "statefulsets/status", "update")


def test_kopf_decorators_are_parsed():
    source = (
        "import kopf\nR = ('mtp.inference.dev', 'v1alpha1', 'mtpdeployments')\n"
        "@kopf.index('batch', 'v1', 'jobs')\ndef f(**_): pass\n"
        "@kopf.on.create(*R)\ndef g(**_): pass\n"
    )
    assert kopf_watched(source, {"R": ("mtp.inference.dev", "v1alpha1", "mtpdeployments")}) == {
        ("batch", "jobs"), ("mtp.inference.dev", "mtpdeployments")}
    assert not kopf_scanning_disabled(source)
    assert kopf_scanning_disabled("def f(settings):\n    settings.scanning.disabled = True\n")


@pytest.mark.parametrize("cluster_wide", [True, False], ids=["cluster-wide", "namespace"])
def test_rbac_is_exactly_what_the_operator_uses(chart, cluster_wide):
    values = chart.values({"rbac": {"clusterWide": cluster_wide}, "watchNamespace": "models"})
    objects = chart.template(values)
    account = chart.only(objects, "ServiceAccount")["metadata"]["name"]
    cluster = granted(objects, "ClusterRole", account)
    namespaced = granted(objects, "Role", account)
    required = required_permissions()
    if cluster_wide:
        assert not namespaced
        have = cluster
    else:
        roles = chart.by_kind(objects, "Role")
        assert {r["metadata"]["namespace"] for r in roles} == {"models"}
        # Only cluster-scoped resources may come from a ClusterRole.
        assert {(g, r) for g, r, _ in cluster} <= CLUSTER_SCOPED
        assert not {(g, r.split("/")[0]) for g, r, _ in namespaced} & CLUSTER_SCOPED
        have = cluster | namespaced
    missing = sorted(required - have)
    extra = sorted(have - required)
    assert not missing, f"the operator calls these but the chart does not grant them: {missing}"
    assert not extra, f"the chart grants these but the operator never uses them: {extra}"


def test_no_wildcards(chart):
    for rbac_mode in (True, False):
        values = chart.values({"rbac": {"clusterWide": rbac_mode}}, f"v{rbac_mode}.yaml")
        for obj in chart.template(values):
            for rule in obj.get("rules", []):
                for key in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule[key], f"{obj['metadata']['name']}: wildcard in {key}"


def test_rbac_can_be_left_out(chart):
    objects = chart.template(chart.values({"rbac": {"create": False}}))
    assert not [o for o in objects if o["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]
