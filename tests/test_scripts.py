"""The developer scripts in hack/: syntax (bash -n), shellcheck, and the
behaviour that can be exercised without Docker or a network."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "hack").glob("*.sh"))


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    assert found, f"{name} is not installed; run hack/setup-env.sh (shellcheck comes from the dev extra)"
    return found


def test_scripts_found():
    names = {p.name for p in SCRIPTS}
    assert {"install-helm.sh", "kind-e2e.sh", "setup-env.sh", "test.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_shellcheck_clean():
    done = subprocess.run(
        [tool("shellcheck"), "--shell=bash", "--severity=style", *map(str, SCRIPTS)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_shellcheck_finds_problems(tmp_path):
    # The check above can fail: an unquoted expansion is reported.
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/usr/bin/env bash\nrm -rf $1/out\n')
    done = subprocess.run([tool("shellcheck"), str(bad)], capture_output=True, text=True)
    assert done.returncode != 0 and "SC2086" in done.stdout


@pytest.mark.parametrize("name", ["install-helm.sh", "kind-e2e.sh"])
def test_scripts_are_strict(name):
    text = (REPO / "hack" / name).read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text


def path_with_only(tmp_path: Path, *tools: str) -> str:
    """A PATH holding just these tools, so missing ones are really missing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in tools:
        (bin_dir / name).symlink_to(tool(name))
    return str(bin_dir)


def test_kind_e2e_fails_fast_without_docker(tmp_path):
    env = {"PATH": path_with_only(tmp_path, "dirname"), "HOME": str(tmp_path)}
    done = subprocess.run(
        ["/bin/bash", str(REPO / "hack" / "kind-e2e.sh")], capture_output=True, text=True, env=env, timeout=30
    )
    assert done.returncode == 1
    assert "'docker' is not installed" in done.stderr
    assert done.stdout == ""


def test_kind_e2e_fails_fast_without_kind(tmp_path):
    # A docker on PATH, but no kind: it must stop before creating anything.
    bin_dir = Path(path_with_only(tmp_path, "dirname"))
    (bin_dir / "docker").write_text("#!/bin/sh\necho docker-called >> \"$HOME/calls\"\n")
    (bin_dir / "docker").chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    done = subprocess.run(
        ["/bin/bash", str(REPO / "hack" / "kind-e2e.sh")], capture_output=True, text=True, env=env, timeout=30
    )
    assert done.returncode == 1
    assert "'kind' is not installed" in done.stderr
    assert not (tmp_path / "calls").exists()


def test_install_helm_usage_error():
    done = subprocess.run(["bash", str(REPO / "hack" / "install-helm.sh")], capture_output=True, text=True)
    assert done.returncode == 2
    assert "usage:" in done.stderr and "DEST_BIN" in done.stderr


def test_install_helm_is_idempotent(tmp_path):
    # With helm 4 already in DEST_BIN it must do nothing (no download).
    dest = tmp_path / "bin"
    dest.mkdir()
    (dest / "helm").symlink_to(tool("helm"))
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/unreachable", "PIP_NO_INDEX": "1"}
    done = subprocess.run(
        ["bash", str(REPO / "hack" / "install-helm.sh"), str(dest)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert (dest / "helm").is_symlink()
    assert "fetching" not in done.stderr


# ---- kind-e2e.sh's whole flow, with docker, kind and kubectl replaced by
# recording stand-ins; helm renders the chart for real (`install` becomes
# `template` with the same values) and curl talks to a real HTTP server that
# stands in for rank 0 behind `kubectl port-forward`.

STAND_IN = r'''#!{python}
import json, os, subprocess, sys
tool, args = os.path.basename(sys.argv[0]), sys.argv[1:]
with open(os.environ["E2E_CALLS"], "a") as calls:
    calls.write(json.dumps([tool, *args]) + "\n")
state = os.environ["E2E_STATE"]
if tool == "kind":
    if args[:2] == ["create", "cluster"]:
        config = open(args[args.index("--config") + 1]).read()
        assert os.environ["E2E_MODELS"] in config and "/tmp/mtp-models" in config, config
        open(state, "w").write(args[args.index("--name") + 1])
    elif args[:2] == ["get", "clusters"] and os.path.exists(state):
        print(open(state).read())
    elif args[:2] == ["delete", "cluster"] and os.path.exists(state):
        os.remove(state)
elif tool == "helm" and args[0] == "install":
    rest, skip = [], False
    for arg in args[1:]:
        if skip:
            skip = False
        elif arg == "--timeout":
            skip = True
        elif arg not in ("--wait", "--create-namespace"):
            rest.append(arg)
    sys.exit(subprocess.run([os.environ["E2E_REAL_HELM"], "template", *rest], stdout=subprocess.DEVNULL).returncode)
elif tool == "kubectl":
    if "wait" in args and any(a.startswith("mtpd/") for a in args) and os.environ.get("E2E_NOT_READY"):
        print("error: timed out waiting for the condition", file=sys.stderr)
        sys.exit(1)
    if "port-forward" in args:
        local = args[-1].split(":")[0]
        os.execv(sys.executable, [sys.executable, os.environ["E2E_SERVER"], local])
    if "get" in args and "-o" in args:
        query = args[args.index("-o") + 1]
        if "clusterIP" in query:
            print("tiny-cpu")
        elif "ports" in query:
            print("8000", end="")
        elif "acceptanceRate" in query:
            print("0.46", end="")
        elif query == "jsonpath={.status}":
            print(json.dumps({"phase": "Running", "speculative": {"acceptanceRate": 0.46}}))
'''

RANK0 = r'''
import http.server, json, os, sys
class Rank0(http.server.BaseHTTPRequestHandler):
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.reply({"data": [{"id": "tiny-deepseek-v3"}]} if self.path == "/v1/models" else {"state": "ready"})
    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(os.environ["E2E_CALLS"], "a") as calls:
            calls.write(json.dumps(["rank0", self.path, request]) + "\n")
        self.reply({"choices": [{"text": "self):"}], "usage": {"completion_tokens": 2}})
    def log_message(self, *args):
        """No access log in the test output."""
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Rank0).serve_forever()
'''


@pytest.fixture(scope="module")
def e2e_models(tmp_path_factory) -> Path:
    """An existing model folder for MODELS_DIR (untrained: the script keeps it)."""
    models = tmp_path_factory.mktemp("e2e-models")
    subprocess.run([sys.executable, "-m", "mtp_runtime", "make-tiny", "--arch", "deepseek_v3",
                    "--out", str(models / "tiny-deepseek-v3")], check=True, capture_output=True)
    return models


def run_kind_e2e(tmp_path: Path, models: Path, **env: str) -> tuple[subprocess.CompletedProcess, list]:
    from mtp_operator.local.ports import free_ports

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("docker", "kind", "kubectl", "helm"):
        (bin_dir / name).write_text(STAND_IN.replace("{python}", sys.executable))
        (bin_dir / name).chmod(0o755)
    (tmp_path / "rank0.py").write_text(RANK0)
    calls = tmp_path / "calls.jsonl"
    venv_bin = Path(sys.executable).parent
    full_env = {
        "PATH": f"{bin_dir}:{venv_bin}:/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
        "E2E_CALLS": str(calls), "E2E_STATE": str(tmp_path / "cluster"), "E2E_SERVER": str(tmp_path / "rank0.py"),
        "E2E_REAL_HELM": tool("helm"), "E2E_MODELS": str(models), "MODELS_DIR": str(models),
        "LOCAL_PORT": str(free_ports(1)[0]), **env,
    }
    done = subprocess.run(["bash", str(REPO / "hack" / "kind-e2e.sh")], capture_output=True, text=True,
                          env=full_env, timeout=120, cwd=tmp_path)
    recorded = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return done, recorded


def test_kind_e2e_flow(tmp_path, e2e_models):
    done, calls = run_kind_e2e(tmp_path, e2e_models)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = [" ".join(str(part) for part in call[:3]) for call in calls]
    order = ["kind create cluster", "docker build --target", "kind load docker-image", "helm install mtp-operator",
             "kubectl -n default", "rank0 /v1/completions", "kind delete cluster"]
    positions = [next(i for i, step in enumerate(steps) if step.startswith(want)) for want in order]
    assert positions == sorted(positions), steps
    builds = [call for call in calls if call[:2] == ["docker", "build"]]
    assert {call[call.index("--target") + 1] for call in builds} == {"operator", "runtime"}
    install = next(call for call in calls if call[:2] == ["helm", "install"])
    assert "settings.runtimeImage=mtp-runtime:0.1.0" in install and "image.tag=0.1.0" in install
    applied = next(call for call in calls if "apply" in call)
    assert applied[-1] == "crds/samples/tiny-cpu.yaml"
    completions = [call[2] for call in calls if call[0] == "rank0"]
    assert len(completions) == 3 and all(c["model"] == "tiny-deepseek-v3" for c in completions)
    assert "acceptance rate: 0.46" in done.stderr and "kind e2e passed" in done.stderr
    # The user's models folder is kept, made writable for the pods' uid.
    assert (e2e_models / "tiny-deepseek-v3" / "config.json").is_file()
    assert (e2e_models / "tiny-deepseek-v3").stat().st_mode & 0o007 == 0o007


def test_kind_e2e_cleans_up_when_never_ready(tmp_path, e2e_models):
    done, calls = run_kind_e2e(tmp_path, e2e_models, E2E_NOT_READY="1")
    assert done.returncode != 0
    assert "failed; operator log and resource state follow" in done.stderr
    assert calls[-1][:3] == ["kind", "delete", "cluster"]
    assert not [call for call in calls if call[0] == "rank0"]
    assert (e2e_models / "tiny-deepseek-v3" / "config.json").is_file()


def test_quickstart_sets_up_then_runs_the_tiny_sample_with_mtp_up(tmp_path):
    # README's first command: hack/setup-env.sh (here a prepared .venv it
    # finds up to date, so nothing is installed), then `mtp up` of the tiny
    # CPU sample with completions, from the repository root.
    import hashlib

    venv = tmp_path / "venv"
    bin_dir = venv / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    (bin_dir / "helm").symlink_to(tool("helm"))
    (bin_dir / "activate").write_text(f'PATH="{bin_dir}:$PATH"\nexport PATH\n')
    (venv / ".mtp-installed").write_text(hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest() + "\n")
    calls = tmp_path / "mtp-calls.jsonl"
    (bin_dir / "mtp").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"open({str(calls)!r}, 'a').write(json.dumps([os.getcwd(), *sys.argv[1:]]) + '\\n')\n")
    (bin_dir / "mtp").chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MTP_VENV": str(venv),
           "PIP_INDEX_URL": "http://127.0.0.1:9/unreachable", "PIP_NO_INDEX": "1"}
    done = subprocess.run([str(REPO / "hack" / "quickstart.sh")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    (call,) = [json.loads(line) for line in calls.read_text().splitlines()]
    assert call[0] == str(REPO)
    assert call[1:3] == ["up", "crds/samples/tiny-cpu.yaml"] and "--once" in call
    assert int(call[call.index("--requests") + 1]) > 0
    readme = (REPO / "README.md").read_text()
    assert "```bash\n./hack/quickstart.sh\n```" in readme


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    section = readme.split("Run the tests", 1)[1]
    command = section.split("```bash\n", 1)[1].split("\n```", 1)[0].strip()
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, f"README's test command {command!r} is not a line of .ci/run"
