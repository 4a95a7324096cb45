"""Revisions of an MtpDeployment's group template, kept the Kubernetes way: ControllerRevisions.

    template = group_template(spec)              # the spec minus what is not the groups' template
    rev = revision_hash(template)                # names the revision (status.updateRevision)
    body = build_controller_revision(cr, rev, template, number)

Every spec field except `replicas` and `rollout` is the group template (model, draft, image, engine,
flags, numSpeculativeTokens, nnodes, ...): changing it is a rollout, changing `replicas` is scaling.
Each ControllerRevision is owned by the MtpDeployment (the garbage collector removes it with it) and
holds the template, so rolling a group back to an older revision never depends on the operator's
memory; the newest `history` (MTP_OPERATOR_REVISION_HISTORY) are kept, and every revision in use.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from mtp_operator import constants as c
from mtp_operator.spec import MtpDeploymentSpec

NOT_TEMPLATE = ("replicas", "rollout")


def group_template(spec: MtpDeploymentSpec) -> dict[str, Any]:
    """The validated spec as plain camelCase data, without the fields that are not the template.
    Defaults are left out, so an operator release that adds a defaulted field rolls nothing."""
    data = spec.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True, mode="json")
    return {k: v for k, v in data.items() if k not in NOT_TEMPLATE}


def revision_hash(template: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def revision_name(name: str, rev: str) -> str:
    return f"{name[:52].rstrip('-')}-{rev}"


def build_controller_revision(owner: Mapping[str, Any], rev: str, template: Mapping[str, Any],
                              number: int) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "apiVersion": "apps/v1", "kind": "ControllerRevision",
        "metadata": {
            "name": revision_name(meta["name"], rev), "namespace": meta["namespace"],
            "labels": {**c.selector_labels(meta["name"]), c.LABEL_REVISION_HASH: rev},
            "ownerReferences": [{"apiVersion": c.API_VERSION, "kind": c.KIND, "name": meta["name"],
                                 "uid": meta.get("uid", ""), "controller": True, "blockOwnerDeletion": True}],
        },
        "data": {"spec": dict(template)},
        "revision": number,
    }


def stale_revisions(revisions: list[Mapping[str, Any]], in_use: set[str], history: int) -> list[str]:
    """Names of ControllerRevisions to delete: beyond the newest `history` and used by no group."""
    ordered = sorted(revisions, key=lambda r: r.get("revision", 0), reverse=True)
    return [r["name"] for r in ordered[history:] if r.get("hash") not in in_use]
