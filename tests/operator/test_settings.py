"""Operator settings from MTP_OPERATOR_* variables."""

from __future__ import annotations

import pytest

from mtp_operator.settings import OperatorSettings, SettingsError


def test_defaults_and_environment():
    assert OperatorSettings.from_env({}) == OperatorSettings()
    s = OperatorSettings.from_env({
        "MTP_OPERATOR_NAMESPACE": "a, b", "MTP_OPERATOR_METRICS_INTERVAL": "2.5",
        "MTP_OPERATOR_GANG_RESTART_BUDGET": "7", "MTP_OPERATOR_PROBE_PODS": "false",
        "MTP_OPERATOR_RUNTIME_IMAGE": "img:2", "MTP_OPERATOR_HEALTH_PORT": "9090", "UNRELATED": "x",
    })
    assert s.namespace == ("a", "b") and s.metrics_interval == 2.5 and s.gang_restart_budget == 7
    assert s.probe_pods is False and s.runtime_image == "img:2" and s.health_port == 9090


def test_overrides_win_over_environment():
    s = OperatorSettings.from_env({"MTP_OPERATOR_NAMESPACE": "a"}, namespace=("b",))
    assert s.namespace == ("b",)


@pytest.mark.parametrize("env,message", [
    ({"MTP_OPERATOR_METRICS_INTERVAL": "soon"}, "MTP_OPERATOR_METRICS_INTERVAL='soon'"),
    ({"MTP_OPERATOR_METRICS_INTERVAL": "0"}, "MTP_OPERATOR_METRICS_INTERVAL must be > 0"),
    ({"MTP_OPERATOR_PROBE_PODS": "maybe"}, "MTP_OPERATOR_PROBE_PODS='maybe'"),
    ({"MTP_OPERATOR_HEALTH_PORT": "70000"}, "MTP_OPERATOR_HEALTH_PORT must be a TCP port"),
    ({"MTP_OPERATOR_NAMESPACE": "a", "MTP_OPERATOR_ALL_NAMESPACES": "true"}, "not both"),
])
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(SettingsError) as err:
        OperatorSettings.from_env(env)
    assert message in str(err.value)
