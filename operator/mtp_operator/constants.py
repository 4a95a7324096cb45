"""Names shared by the CRD, the manifests, the handlers and the local backend.

Every label, annotation and injected environment variable is a named constant
here, so tests, the Helm chart and `mtp up` refer to one spelling.
"""

from __future__ import annotations

GROUP = "mtp.inference.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MtpDeployment"
PLURAL = "mtpdeployments"
SINGULAR = "mtpdeployment"
SHORT_NAMES = ["mtpd"]
CRD_NAME = f"{PLURAL}.{GROUP}"

# Labels on every child object (Job, pods, Services, StatefulSet).
LABEL_NAME = "app.kubernetes.io/name"  # always "mtp-runtime"
LABEL_INSTANCE = "app.kubernetes.io/instance"  # the MtpDeployment's name
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"  # always "mtp-operator"
LABEL_COMPONENT = "app.kubernetes.io/component"  # COMPONENT_EXPORT or COMPONENT_SERVER
LABEL_DEPLOYMENT = f"{GROUP}/deployment"  # the MtpDeployment's name, for selectors
LABEL_TEMPLATE_HASH = f"{GROUP}/template-hash"  # pod template fingerprint (whole-group rolls)
# Set by the StatefulSet controller (Kubernetes >= 1.28) on every pod: its ordinal.
LABEL_POD_INDEX = "apps.kubernetes.io/pod-index"
# Fleet: the group (0..replicas-1) of a StatefulSet and its pods; each group has its own master.
LABEL_GROUP = f"{GROUP}/group"
# On a group's StatefulSet: the revision (ControllerRevision hash) of the MtpDeployment spec it runs.
ANNOTATION_REVISION = f"{GROUP}/revision"
# On a ControllerRevision of ours: the hash it is named after.
LABEL_REVISION_HASH = f"{GROUP}/revision-hash"
# On the two Services only: which one it is, so a ServiceMonitor can select
# the client Service (rank 0 alone) and never the headless one (every rank).
LABEL_SERVICE_ROLE = f"{GROUP}/service-role"

NAME_VALUE = "mtp-runtime"
MANAGED_BY_VALUE = "mtp-operator"
COMPONENT_EXPORT = "export"
COMPONENT_SERVER = "server"
SERVICE_ROLE_CLIENT = "client"  # the OpenAI endpoint; selects rank 0's pod only
SERVICE_ROLE_HEADLESS = "headless"  # rank discovery; selects every rank

# Annotation on the StatefulSet: the template hash it was last rolled to.
ANNOTATION_TEMPLATE_HASH = f"{GROUP}/template-hash"
# Annotation prefix for kopf's own bookkeeping (progress, last-handled spec).
KOPF_ANNOTATION_PREFIX = f"kopf.{GROUP}"

# Environment variables the runtime pods receive.
ENV_NODE_RANK = "MTP_NODE_RANK"  # from LABEL_POD_INDEX via the downward API
ENV_NNODES = "MTP_NNODES"  # group size
ENV_MASTER_ADDR = "MTP_MASTER_ADDR"  # host:port of rank 0's rendezvous
ENV_POD_IP = "MTP_POD_IP"  # status.podIP via the downward API
ENV_HCCL_IF_IP = "HCCL_IF_IP"  # NPU: the interface HCCL binds to (the pod IP)
ENV_HCCL_CONNECT_TIMEOUT = "HCCL_CONNECT_TIMEOUT"  # NPU: seconds to wait for peers
HCCL_CONNECT_TIMEOUT_SECONDS = "7200"  # large models load slowly; peers wait that long
ENV_API_KEY = "MTP_API_KEY"  # the builtin runtime's API key, from spec.apiKeySecret (secretKeyRef)
ENV_VLLM_API_KEY = "VLLM_API_KEY"  # the same Secret, for engine vllm

# Container and port names.
CONTAINER_SERVER = "server"
CONTAINER_EXPORT = "export"
PORT_NAME_HTTP = "http"
PORT_NAME_MASTER = "master"
MODEL_VOLUME_NAME = "models"

# Export output manifest, written last by `mtp export`.
EXPORT_MANIFEST = "mtp-export.json"

# Condition types and phases written into status.
CONDITION_DRAFT_READY = "DraftReady"
CONDITION_READY = "Ready"
CONDITION_PROGRESSING = "Progressing"
CONDITION_DEGRADED = "Degraded"
PHASES = ("Pending", "Exporting", "Starting", "Running", "Degraded", "Failed")


def selector_labels(resource_name: str) -> dict[str, str]:
    """Labels that select every child of one MtpDeployment."""
    return {LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_DEPLOYMENT: resource_name}


def child_labels(resource_name: str, component: str) -> dict[str, str]:
    """Full label set of a child object of `component` (export or server)."""
    return {
        LABEL_NAME: NAME_VALUE,
        LABEL_INSTANCE: resource_name,
        LABEL_COMPONENT: component,
        **selector_labels(resource_name),
    }
