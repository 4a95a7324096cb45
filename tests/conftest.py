"""Suite-wide: the real-control-plane tier (marker `cluster`) runs last, so its control plane
(kube-apiserver, kube-controller-manager, kwok, etcd; started once for the session) is up only
while those tests run, not beside the rest of the suite."""

from __future__ import annotations


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("cluster") is not None)
