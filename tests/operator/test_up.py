"""`mtp up` end to end on this machine: the tiny CPU sample's model made by
`mtp make-tiny`, its draft exported by `mtp export`, a real `mtp serve` rank,
real completions, and the operator's status with acceptance figures; plus
clean shutdown on SIGTERM, whole-group restarts running out of budget, and
bad input."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mtp_operator.local.model_prep import MAKE_TINY_ANNOTATION

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "crds" / "samples" / "tiny-cpu.yaml"
UP_TIMEOUT = 300


def mtp_up(*args: str, timeout: float = UP_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtp_runtime", "up", *args],
                          capture_output=True, text=True, timeout=timeout)


def final_status(stdout: str) -> dict:
    """The status document `mtp up` prints last."""
    start = stdout.rindex("name: ")
    return yaml.safe_load(stdout[start:])["status"]


def conditions(status: dict) -> dict[str, dict]:
    return {cond["type"]: cond for cond in status["conditions"]}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def write_cr(path: Path, spec_changes: dict, annotations: dict | None = None) -> Path:
    resource = yaml.safe_load(SAMPLE.read_text())
    resource["spec"].update(spec_changes)
    if annotations is not None:
        resource["metadata"]["annotations"] = annotations
    path.write_text(yaml.safe_dump(resource))
    return path


# The sample trains its tiny model (minutes on 2 cores); the tests build the
# same architecture untrained, which exercises every step but the training.
UNTRAINED = {MAKE_TINY_ANNOTATION: "--arch deepseek_v3 --seed 0"}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """The sample's model (untrained), made once through `mtp up --make-model-only`."""
    models = tmp_path_factory.mktemp("models")
    cr = write_cr(tmp_path_factory.mktemp("cr") / "tiny.yaml", {}, annotations=UNTRAINED)
    done = mtp_up(str(cr), "--models-dir", str(models), "--make-model-only")
    assert done.returncode == 0, done.stderr
    assert (models / "tiny-deepseek-v3" / "config.json").is_file()
    assert "making the model: mtp make-tiny --arch deepseek_v3" in done.stdout
    return models


def test_sample_make_tiny_annotation_is_valid_for_make_tiny():
    from mtp_runtime.cli import build_parser

    annotation = yaml.safe_load(SAMPLE.read_text())["metadata"]["annotations"][MAKE_TINY_ANNOTATION]
    args = build_parser().parse_args(["make-tiny", *shlex.split(annotation), "--out", "/tmp/unused"])
    assert args.arch == "deepseek_v3"
    assert args.train_steps and args.train_steps > 0  # a trained model: acceptance worth showing


@pytest.mark.slow
def test_up_once_serves_completions_and_reports_acceptance(models_dir, tmp_path):
    status_file = tmp_path / "status.json"
    # The sample with the annotation models_dir's model was made with (another one would remake it).
    cr = write_cr(tmp_path / "tiny.yaml", {}, annotations=UNTRAINED)
    done = mtp_up(str(cr), "--models-dir", str(models_dir), "--once", "--requests", "2", "--max-tokens", "6",
                  "--timeout", "240", "--log-dir", str(tmp_path / "logs"), "--status-file", str(status_file))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # The export step ran (the draft now exists with its manifest written last).
    assert (models_dir / "tiny-deepseek-v3-mtp" / "mtp-export.json").is_file()
    assert "Exporting" in out and "Starting" in out
    assert out.count("completion 'def main(' ->") == 1
    status = final_status(out)
    assert status == json.loads(status_file.read_text())["status"]
    conds = conditions(status)
    assert conds["DraftReady"]["status"] == "True" and conds["DraftReady"]["reason"] == "ExportSucceeded"
    assert conds["Ready"]["status"] == "True"
    assert status["readyNodes"] == 1 and status["nodes"] == "1/1"
    assert status["endpoint"].startswith("http://127.0.0.1:")
    assert status["draftModelPath"] == "/models/tiny-deepseek-v3-mtp"
    # Acceptance from rank 0's own /metrics after the requests (k = 1).
    spec = status["speculative"]
    assert spec["draftTokens"] > 0
    assert 0.0 <= spec["acceptanceRate"] <= 1.0
    assert spec["perPositionAcceptance"] and len(spec["perPositionAcceptance"]) == 1
    assert "acceptance rate" in out
    assert status["throughput"]["requestsRunning"] == 0  # every request had returned when it was scraped
    minimum = yaml.safe_load(SAMPLE.read_text())["spec"]["speculative"]["minAcceptanceRate"]
    low = spec["acceptanceRate"] < minimum
    assert status["phase"] == ("Degraded" if low else "Running")
    assert (conds["Degraded"]["reason"] == "LowAcceptance") == low
    # Every rank was stopped on the way out.
    assert "stopped rank-0" in out
    rank_pid = int(status["gang"]["members"]["0"].split("/")[0])
    assert not pid_alive(rank_pid)


# What `mtp serve` says when this build cannot run a group of several ranks.
def wait_for_status(proc: subprocess.Popen, status_file: Path, done, log_dir: Path, seconds: float = 240) -> dict:
    """Poll the --status-file until `done(status)`; fails if `mtp up` exits first."""
    deadline = time.monotonic() + seconds
    status: dict = {}
    while time.monotonic() < deadline and proc.poll() is None:
        if status_file.exists():
            status = json.loads(status_file.read_text())["status"]
            if done(status):
                return status
        time.sleep(0.3)
    rank_logs = "".join(path.read_text() for path in sorted(log_dir.glob("rank-*.log")))
    pytest.fail(f"mtp up (exit {proc.poll()}) never reached the expected status; last: {status}\n{rank_logs[-3000:]}")


def rank_pids(status: dict) -> dict[str, int]:
    return {rank: int(member.split("/")[0]) for rank, member in status["gang"]["members"].items()}


@pytest.mark.slow
def test_two_ranks_on_loopback_restart_together_and_stop_on_sigterm(models_dir, tmp_path):
    # nnodes 2: rank 1 finds rank 0 through the master address on loopback.
    # Killing rank 1 restarts the whole group (rank 0 too), as the operator's
    # gang restart does; SIGTERM then stops every rank and exits 0.
    cr = write_cr(tmp_path / "two.yaml", {"nnodes": 2}, annotations=UNTRAINED)
    status_file = tmp_path / "status.json"
    manifest = models_dir / "tiny-deepseek-v3-mtp" / "mtp-export.json"
    exported_before = manifest.stat().st_mtime_ns if manifest.exists() else None
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtp_runtime", "up", str(cr), "--models-dir", str(models_dir),
         "--log-dir", str(tmp_path / "logs"), "--status-file", str(status_file), "--restart-backoff", "0.2",
         "--grace-period", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        ready = lambda s: s.get("phase") in ("Running", "Degraded") and len(s["gang"]["members"]) == 2  # noqa: E731
        status = wait_for_status(proc, status_file, ready, tmp_path / "logs")
        assert status["nodes"] == "2/2" and status["masterAddress"].startswith("127.0.0.1:")
        first = rank_pids(status)
        os.kill(first["1"], signal.SIGKILL)
        # At least one whole-group restart (on 2 loaded cores a slow restart can fail its rendezvous and
        # restart once more; the operator's exactly-once count is tested on the real control plane).
        status = wait_for_status(proc, status_file, lambda s: ready(s) and s["gang"]["restarts"] >= 1,
                                 tmp_path / "logs")
        second = rank_pids(status)
        assert set(second.values()).isdisjoint(first.values())
        assert not pid_alive(first["0"])
        assert status["gang"]["reason"] == "RankRestarted"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err
    assert "rank-1 exited with code -9" in out
    assert "restarting the whole group" in out
    assert "stopped rank-0" in out and "rank-1" in out
    assert not any(pid_alive(pid) for pid in second.values())
    if exported_before is not None:
        # The draft was already exported and up to date: not rewritten, and DraftReady says so.
        assert "up to date" in out
        assert conditions(final_status(out))["DraftReady"]["message"].endswith("up to date")
        assert manifest.stat().st_mtime_ns == exported_before


def test_crashing_ranks_restart_the_group_until_the_budget_is_spent(tmp_path):
    # The draft named by the spec is not a model: every rank exits at start.
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    (models / "m" / "config.json").write_text("{}")
    (models / "not-a-draft").mkdir()
    cr = write_cr(tmp_path / "cr.yaml", {
        "model": {"path": "/models/m", "mountPath": "/models", "volume": {"hostPath": "/unused"}},
        "export": None, "draftModel": {"path": "/models/not-a-draft"},
    })
    raw = yaml.safe_load(cr.read_text())
    del raw["spec"]["export"]
    cr.write_text(yaml.safe_dump(raw))
    done = mtp_up(str(cr), "--models-dir", str(models), "--once", "--timeout", "120",
                  "--restart-budget", "2", "--restart-backoff", "0.1", "--log-dir", str(tmp_path / "logs"))
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert out.count("rank-0 exited with code") == 3  # first start + 2 restarts
    assert "restarting the whole group in 0s (1/2)" in out and "(2/2)" in out
    status = final_status(out)
    assert status["phase"] == "Failed"
    assert status["gang"]["reason"] == "GangRestartBudgetExhausted" and status["gang"]["restarts"] == 2
    assert conditions(status)["Ready"]["reason"] == "GangRestartBudgetExhausted"
    assert "--draft_model" in out  # the rank's own error, from its log


def test_ctrl_c_during_a_restart_backoff_exits_at_once(tmp_path):
    # Ranks that crash at start, a 120 s backoff before the group restarts:
    # SIGINT (Ctrl-C) in the backoff ends `mtp up` cleanly, without waiting.
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    (models / "m" / "config.json").write_text("{}")
    (models / "not-a-draft").mkdir()
    raw = yaml.safe_load(write_cr(tmp_path / "cr.yaml", {
        "model": {"path": "/models/m", "mountPath": "/models", "volume": {"hostPath": "/unused"}},
        "draftModel": {"path": "/models/not-a-draft"},
    }).read_text())
    del raw["spec"]["export"]
    cr = tmp_path / "cr.yaml"
    cr.write_text(yaml.safe_dump(raw))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtp_runtime", "up", str(cr), "--models-dir", str(models),
         "--restart-backoff", "120", "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "restarting the whole group in 120s" in line:
                break
        assert seen and "restarting the whole group" in seen[-1], "".join(seen)
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # the fault handler prints where every thread is
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"mtp up still ran 30 s after SIGINT; its threads:\n{err[-8000:]}")
        assert time.monotonic() - interrupted < 20
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, "".join(seen) + out + err
    assert final_status(out)["gang"]["restarts"] == 0


def test_failed_export_is_reported_as_the_operator_would_and_starts_no_rank(tmp_path):
    # A checkpoint with no weights: the export step fails, so DraftReady=False
    # (ExportFailed, with the export's own error), phase Failed, exit 1.
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    (models / "m" / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_hidden_layers": 2}))
    cr = write_cr(tmp_path / "cr.yaml", {
        "model": {"path": "/models/m", "mountPath": "/models", "volume": {"hostPath": "/unused"}},
        "export": {"outputPath": "/models/m-mtp"},
    })
    log_dir = tmp_path / "logs"
    done = mtp_up(str(cr), "--models-dir", str(models), "--once", "--log-dir", str(log_dir), timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    status = final_status(done.stdout)
    assert status["phase"] == "Failed" and status["readyNodes"] == 0
    draft = conditions(status)["DraftReady"]
    assert draft["status"] == "False" and draft["reason"] == "ExportFailed"
    assert "mtp export: error:" in draft["message"] and str(models / "m") in draft["message"]
    assert conditions(status)["Ready"]["reason"] == "ExportFailed"
    assert not list(log_dir.glob("rank-*.log")) and not (models / "m-mtp").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"nnodes": 0}, "spec.nnodes"),
        ({"engine": "tgi"}, "spec.engine"),
        ({"model": {"path": "/models/x; rm -rf /", "volume": {"hostPath": "/tmp"}}}, "spec.model.path"),
        ({"model": {"path": "/models/m", "volume": {"claimName": "weights"}}}, "spec.model.volume.claimName"),
    ],
    ids=["nnodes", "engine", "shell-path", "claim-without-models-dir"],
)
def test_bad_spec_is_refused_naming_the_field(tmp_path, change, message):
    cr = write_cr(tmp_path / "cr.yaml", change)
    done = mtp_up(str(cr), "--once", timeout=60)
    assert done.returncode == 2
    assert message in done.stderr and str(cr) in done.stderr
    assert done.stdout == ""


def test_bad_files_are_refused(tmp_path):
    missing = mtp_up(str(tmp_path / "absent.yaml"), timeout=60)
    assert missing.returncode == 2 and "absent.yaml" in missing.stderr
    wrong_kind = tmp_path / "pod.yaml"
    wrong_kind.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n")
    done = mtp_up(str(wrong_kind), timeout=60)
    assert done.returncode == 2 and "expected exactly one MtpDeployment" in done.stderr
    bad_name = write_cr(tmp_path / "name.yaml", {})
    raw = yaml.safe_load(bad_name.read_text())
    raw["metadata"]["name"] = "Tiny_CPU"
    bad_name.write_text(yaml.safe_dump(raw))
    done = mtp_up(str(bad_name), timeout=60)
    assert done.returncode == 2 and "metadata.name" in done.stderr


def test_missing_model_without_annotation_is_explained(tmp_path):
    cr = write_cr(tmp_path / "cr.yaml", {}, annotations={})
    done = mtp_up(str(cr), "--models-dir", str(tmp_path / "empty"), "--once", timeout=60)
    assert done.returncode == 2
    assert "spec.model.path: no model at" in done.stderr and "mtp.inference.dev/make-tiny" in done.stderr


def test_dry_run_prints_the_processes(tmp_path):
    models = tmp_path / "models"  # no model there: a dry run makes nothing
    cr = write_cr(tmp_path / "two.yaml", {"nnodes": 2})
    done = mtp_up(str(cr), "--models-dir", str(models), "--dry-run", "--port", "18300", "--master-port", "18399",
                  timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "# export" and lines[2] == "# rank-0 (HTTP port 18300)"
    assert lines[4] == "# rank-1 (HTTP port 18301)"
    assert f"--input-dir {models}/tiny-deepseek-v3 " in lines[1]
    assert "MTP_MASTER_ADDR=127.0.0.1:18399" in lines[5] and "--node_rank=1" in lines[5]
    assert not models.exists()  # nothing ran, nothing was made


def test_a_remade_model_gets_its_draft_exported_again(tmp_path):
    # make-tiny keeps config.json and the index for other seeds or training, and the export's
    # fingerprint is theirs: without --force the old model's draft would pass as up to date.
    from mtp_operator.commands import up
    from mtp_runtime.cli import build_parser

    models = tmp_path / "models"
    annotation = {MAKE_TINY_ANNOTATION: "--arch deepseek_v3 --num-hidden-layers 1 --shards 1 --seed 4"}
    args = build_parser().parse_args(["up", str(write_cr(tmp_path / "cr.yaml", {}, annotation)),
                                      "--models-dir", str(models)])
    made = up.prepare(args)
    assert made.export is not None and made.export.argv[-1] == "--force"
    again = up.prepare(args)  # present and made with these arguments: the export may skip
    assert "--force" not in again.export.argv


def test_dry_run_prints_every_groups_processes(tmp_path):
    cr = write_cr(tmp_path / "fleet.yaml", {"replicas": 2, "nnodes": 2})
    done = mtp_up(str(cr), "--models-dir", str(tmp_path / "models"), "--dry-run", "--port", "18300",
                  "--master-port", "18399", timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    headers = [line for line in lines if line.startswith("# ")]
    assert headers == ["# export",
                       "# group 0: endpoint http://127.0.0.1:18300, master 127.0.0.1:18399",
                       "# rank-0 (HTTP port 18300)", "# rank-1 (HTTP port 18301)",
                       "# group 1: endpoint http://127.0.0.1:18302, master 127.0.0.1:18400",
                       "# g1-rank-0 (HTTP port 18302)", "# g1-rank-1 (HTTP port 18303)"]
    g1_rank1 = lines[lines.index("# g1-rank-1 (HTTP port 18303)") + 1]
    assert "MTP_MASTER_ADDR=127.0.0.1:18400" in g1_rank1 and "--node_rank=1" in g1_rank1 and "--port=18303" in g1_rank1
    zero = mtp_up(str(write_cr(tmp_path / "zero.yaml", {"replicas": 0})), "--models-dir", str(tmp_path / "models"),
                  "--dry-run", timeout=60)
    assert zero.returncode == 0, zero.stderr
    assert zero.stdout.splitlines()[0] == "# export" and "# spec.replicas is 0: no group would start" in zero.stdout
    assert "rank-0" not in zero.stdout


def test_replicas_zero_runs_the_export_step_only_and_says_so(tmp_path):
    # A draft given (nothing to export): no rank starts, the status says scaled to zero, exit 0.
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    (models / "m" / "config.json").write_text("{}")
    raw = yaml.safe_load(write_cr(tmp_path / "cr.yaml", {
        "model": {"path": "/models/m", "mountPath": "/models", "volume": {"hostPath": "/unused"}},
        "draftModel": {"path": "/models/m-mtp"}, "replicas": 0,
    }).read_text())
    del raw["spec"]["export"]
    cr = tmp_path / "cr.yaml"
    cr.write_text(yaml.safe_dump(raw))
    log_dir = tmp_path / "logs"
    done = mtp_up(str(cr), "--models-dir", str(models), "--log-dir", str(log_dir), timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "spec.replicas is 0: no group will start" in done.stdout
    assert "spec.replicas is 0: no group started, nothing serves" in done.stdout
    status = final_status(done.stdout)
    assert status["phase"] == "Pending" and status["replicas"] == 0 and status["groups"] == []
    assert conditions(status)["Ready"]["reason"] == "ScaledToZero"
    assert not list(log_dir.glob("*rank-*.log"))


@pytest.mark.slow
def test_two_groups_each_serve_on_their_own_ports(models_dir, tmp_path):
    # replicas 2 of the tiny model: two real `mtp serve` ranks, one per group, each with its own
    # HTTP and master ports; --once waits for both and sends the completion to each group's rank 0.
    cr = write_cr(tmp_path / "fleet.yaml", {"replicas": 2}, annotations=UNTRAINED)
    done = mtp_up(str(cr), "--models-dir", str(models_dir), "--once", "--requests", "1", "--max-tokens", "4",
                  "--timeout", "240", "--log-dir", str(tmp_path / "logs"))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    status = final_status(out)
    assert (status["replicas"], status["readyReplicas"], status["nodes"]) == (2, 2, "2/2")
    first, second = status["groups"]
    assert first["endpoint"] != second["endpoint"] and first["masterAddress"] != second["masterAddress"]
    for group in (first, second):
        assert f"group {group['index']}: endpoint {group['endpoint']} (OpenAI API" in out
        assert f"group {group['index']}: completion 'def main(' ->" in out
        assert group["phase"] == "Running" and group["draftTokens"] > 0
        assert out.count(f"group {group['index']}: Running, 1 rank(s) ready, {group['endpoint']}") == 1
    assert status["speculative"]["draftTokens"] == first["draftTokens"] + second["draftTokens"]
    assert "stopped rank-0" in out and "g1-rank-0" in out
    assert (tmp_path / "logs" / "g1-rank-0.log").is_file()
