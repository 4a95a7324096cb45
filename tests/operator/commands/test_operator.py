"""`mtp operator` command line (the operator itself runs in the integration tests)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from mtp_operator.commands import operator as command


def _parse(argv):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(argv)


def test_scope_is_required(monkeypatch, capsys):
    monkeypatch.delenv("MTP_OPERATOR_NAMESPACE", raising=False)
    monkeypatch.delenv("MTP_OPERATOR_ALL_NAMESPACES", raising=False)
    assert command.run(_parse([])) == 2
    assert "--namespace NS or --all-namespaces" in capsys.readouterr().out


def test_bad_setting_is_reported(monkeypatch, capsys):
    monkeypatch.setenv("MTP_OPERATOR_METRICS_INTERVAL", "often")
    assert command.run(_parse(["--namespace", "a"])) == 2
    assert "MTP_OPERATOR_METRICS_INTERVAL='often'" in capsys.readouterr().out


def test_flags_are_exclusive_and_repeatable():
    assert _parse(["-n", "a", "-n", "b"]).namespace == ["a", "b"]
    assert _parse(["--all-namespaces"]).all_namespaces is True


def test_registered_with_the_mtp_cli():
    out = subprocess.run([sys.executable, "-m", "mtp_runtime", "operator", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--all-namespaces" in out and "MTP_OPERATOR_" in out


def test_runs_kopf_with_scope_and_liveness_endpoint(monkeypatch):
    import kopf

    seen = {}

    async def fake_operator(**kwargs):
        seen.update(kwargs)

    monkeypatch.setattr(kopf, "operator", fake_operator)
    monkeypatch.setenv("MTP_OPERATOR_HEALTH_PORT", "9191")
    monkeypatch.delenv("MTP_OPERATOR_ALL_NAMESPACES", raising=False)
    assert command.run(_parse(["-n", "team-a", "-n", "team-b"])) == 0
    assert seen["namespaces"] == ["team-a", "team-b"] and seen["clusterwide"] is False
    assert seen["liveness_endpoint"] == "http://0.0.0.0:9191/healthz" and seen["standalone"] is True
    assert isinstance(seen["registry"], kopf.OperatorRegistry)
    seen.clear()
    monkeypatch.delenv("MTP_OPERATOR_NAMESPACE", raising=False)
    assert command.run(_parse(["--all-namespaces"])) == 0
    assert seen["clusterwide"] is True and seen["namespaces"] == []
