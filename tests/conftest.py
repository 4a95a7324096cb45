"""Suite-wide settings.

- The real-control-plane tier (marker `cluster`) runs last, so its control plane
  (kube-apiserver, kube-controller-manager, kwok, etcd; started once for the session) is up only
  while those tests run, not beside the rest of the suite.
- Engines whose test leaves `enable_graph` unset run eager ($MTP_ENABLE_GRAPH=false, inherited by
  the servers tests start): graph mode is the product's default, but compiling every test's
  engine would take the suite past its budget. The graph-mode tests set it explicitly, and
  tests/runtime/engine/test_graph_default.py covers the default itself.
"""

from __future__ import annotations

import os

os.environ.setdefault("MTP_ENABLE_GRAPH", "false")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("cluster") is not None)
