"""What can be checked of the Dockerfile without a Docker engine: the build
targets, the base-image and version build args, the entrypoints' commands
existing in the package, non-root users, and the build context."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (the package supports it): the same parser, as pip vendors it
    from pip._vendor import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
TARGETS = ("operator", "runtime", "runtime-npu")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def last(self, keyword: str) -> str | None:
        values = [arg for kw, arg in self.instructions if kw == keyword]
        return values[-1] if values else None


def dockerfile_lines(text: str) -> list[str]:
    """Logical lines: comments dropped, backslash continuations joined."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    assert not current, "Dockerfile ends inside a line continuation"
    return lines


def parse_dockerfile(text: str) -> tuple[dict[str, str | None], dict[str, Stage]]:
    """(global ARGs before the first FROM with their defaults, stages by name)."""
    global_args: dict[str, str | None] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for line in dockerfile_lines(text):
        keyword, _, arg = line.partition(" ")
        keyword, arg = keyword.upper(), arg.strip()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", arg, re.IGNORECASE)
            assert match, f"every stage must be named: FROM {arg}"
            stage = Stage(name=match.group(2), base=match.group(1))
            stages[stage.name] = stage
        elif stage is None:
            assert keyword == "ARG", f"only ARG may precede the first FROM, got {keyword}"
            name, _, default = arg.partition("=")
            global_args[name] = default or None
        else:
            stage.instructions.append((keyword, arg))
    return global_args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str | None], dict[str, Stage]]:
    return parse_dockerfile((REPO / "Dockerfile").read_text())


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    out = [stages[name]]
    while out[-1].base in stages:
        out.append(stages[out[-1].base])
    return out


def test_targets_exist(dockerfile):
    _, stages = dockerfile
    for target in TARGETS:
        assert target in stages, f"Dockerfile has no `{target}` target"


def test_base_images_are_build_args(dockerfile):
    global_args, stages = dockerfile
    assert stages["runtime-npu"].base == "${CANN_BASE_IMAGE}"
    assert global_args.get("CANN_BASE_IMAGE"), "CANN_BASE_IMAGE needs a default tag"
    python_image = global_args["PYTHON_IMAGE"]
    # Pinned: a patch version, never `latest` or a bare major.minor.
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+", python_image), python_image
    for name in ("operator", "runtime"):
        assert chain(stages, name)[-1].base == "${PYTHON_IMAGE}"


def test_every_arg_used_in_a_stage_is_declared_there(dockerfile):
    # A global ARG is invisible inside a stage until re-declared: forgetting
    # that silently expands to an empty string.
    global_args, stages = dockerfile
    for stage in stages.values():
        declared = {arg.partition("=")[0] for kw, arg in stage.instructions if kw == "ARG"}
        for keyword, arg in stage.instructions:
            for used in re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", arg):
                if used in global_args:
                    assert used in declared, f"stage {stage.name}: {keyword} uses ${used} without `ARG {used}`"


def test_torch_pins_match_the_package(dockerfile):
    global_args, _ = dockerfile
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    runtime_extra = pyproject["project"]["optional-dependencies"]["runtime"]
    torch_pin = next(req for req in runtime_extra if req.startswith("torch=="))
    assert global_args["TORCH_VERSION"] == torch_pin.removeprefix("torch==")
    # torch_npu releases track torch's version; a mismatch fails at import.
    npu = global_args["TORCH_NPU_VERSION"]
    assert npu.split(".")[:2] == global_args["TORCH_VERSION"].split(".")[:2]


# What pip receives for the torch install of a stage, as the image's /bin/sh
# expands it: the torch install step of its RUN, with pip replaced by printf.
def torch_install_argv(stage: Stage, index: str) -> list[str]:
    (run,) = [arg for kw, arg in stage.instructions if kw == "RUN" and "torch==" in arg]
    (step,) = [part.strip() for part in run.split("&&") if "TORCH_CPU_INDEX" in part]
    command = re.sub(r"^python3? -m pip install ", r"printf '%s\\n' ", step)
    assert command != step, f"stage {stage.name}: torch is not installed with pip: {step}"
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True,
                          env={"TORCH_CPU_INDEX": index, "TORCH_VERSION": "9.9.9", "PATH": "/usr/bin:/bin"})
    return done.stdout.splitlines()


@pytest.mark.parametrize("target", ["runtime", "runtime-npu"])
def test_torch_index_is_pip_default_unless_given(dockerfile, target):
    global_args, stages = dockerfile
    assert global_args["TORCH_CPU_INDEX"] is None, "TORCH_CPU_INDEX must default to empty (pip's own index)"
    assert torch_install_argv(stages[target], "") == ["torch==9.9.9"]
    assert torch_install_argv(stages[target], "http://mirror.example/whl cpu") == \
        ["--index-url", "http://mirror.example/whl cpu", "torch==9.9.9"]


def test_no_package_index_url_in_the_dockerfile():
    # Which index to use is the builder's choice (build args, pip config), never baked in.
    text = (REPO / "Dockerfile").read_text()
    assert not re.findall(r"https?://\S+", text)
    for option in re.findall(r"--(?:extra-)?index-url[ =](\S+)", text):
        assert option.strip('"').startswith("${"), f"index given literally: {option}"


def final_user(stages: dict[str, Stage], target: str) -> str:
    """The user a target's container starts as (root when no USER is set)."""
    user = next((s.last("USER") for s in chain(stages, target) if s.last("USER")), None)
    return (user or "root").split(":")[0]


@pytest.mark.parametrize("target", TARGETS)
def test_targets_end_as_non_root(dockerfile, target):
    _, stages = dockerfile
    assert final_user(stages, target) not in ("root", "0")


def test_final_user_sees_root():
    _, stages = parse_dockerfile("FROM a AS one\nUSER 10\nFROM one AS two\nRUN x\nFROM a AS three\n")
    assert final_user(stages, "two") == "10"
    assert final_user(stages, "three") == "root"


def entrypoint_argv(stage: Stage) -> list[str]:
    import json

    return json.loads(stage.last("ENTRYPOINT")) + json.loads(stage.last("CMD") or "[]")


def test_entrypoints_are_the_mtp_console_script(dockerfile):
    _, stages = dockerfile
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "mtp" in scripts
    assert entrypoint_argv(stages["operator"])[:2] == ["mtp", "operator"]
    assert entrypoint_argv(stages["runtime"])[:2] == ["mtp", "serve"]
    # On the NPU image `mtp` is the CANN wrapper (next test), first on PATH.
    assert entrypoint_argv(stages["runtime-npu"])[:2] == ["mtp", "serve"]


NPU_WRAPPER_DIR = "/opt/mtp/bin"


def test_npu_mtp_sources_cann_even_when_the_pod_replaces_the_entrypoint(dockerfile, tmp_path):
    # The operator's pods run `command: [mtp, ...]`, which replaces ENTRYPOINT:
    # so `mtp` itself, resolved on the image's PATH, must set up CANN. Writes
    # the wrapper as the image build does, then runs it with a stand-in
    # set_env.sh and python3.
    _, stages = dockerfile
    npu = stages["runtime-npu"]
    paths = [arg for kw, arg in npu.instructions if kw == "ENV" and arg.startswith("PATH=")]
    assert paths and paths[-1].startswith(f"PATH={NPU_WRAPPER_DIR}:"), paths
    (run,) = [arg for kw, arg in npu.instructions if kw == "RUN" and f"{NPU_WRAPPER_DIR}/mtp" in arg]
    wrapper_dir = tmp_path / "wrapper"
    subprocess.run(["sh", "-c", run.replace(NPU_WRAPPER_DIR, str(wrapper_dir))], check=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/sh\nprintf \'%s|\' "$CANN_READY" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    set_env = tmp_path / "set_env.sh"
    set_env.write_text('[ "$#" -eq 0 ] && export CANN_READY=yes\n')
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "ASCEND_SET_ENV": str(set_env)}
    done = subprocess.run([str(wrapper_dir / "mtp"), "serve", "--port=8000", "a b"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "yes|-m|mtp_runtime|serve|--port=8000|a b|"
    env["ASCEND_SET_ENV"] = str(tmp_path / "absent.sh")
    done = subprocess.run([str(wrapper_dir / "mtp"), "serve"], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "no CANN environment script" in done.stderr and not done.stdout


@pytest.mark.parametrize(
    "argv",
    [["operator", "--help"], ["serve", "--help"], ["export", "--help"]],
    ids=lambda argv: argv[0],
)
def test_entrypoint_subcommands_exist(argv):
    # The images run exactly these; the runtime build also runs them as a smoke test.
    done = subprocess.run([sys.executable, "-m", "mtp_runtime", *argv], capture_output=True, text=True)
    assert done.returncode == 0, f"mtp {' '.join(argv)} failed:\n{done.stderr[-2000:]}"


def test_dockerignore_keeps_the_context_small():
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "allow-list: ignore everything first"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    # Exactly what the stages COPY: the wheel stage's sources, the images' pins.
    assert allowed == {"pyproject.toml", "README.md", "operator", "runtime", CONSTRAINTS}
    copied = re.findall(r"^COPY (?!--from)(.+?) \S+$", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    sources = {src for line in copied for src in line.split()}
    assert sources == allowed


CONSTRAINTS = "hack/image-constraints.txt"
WHEEL = "/wheels/mtp_operator-0.1.0-py3-none-any.whl"


def load_constraints_generator():
    spec = importlib.util.spec_from_file_location("gen_image_constraints", REPO / "hack" / "gen_image_constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What pip receives for each install of the wheel in a stage, as /bin/sh
# expands it (pip replaced by printf, $wheel set as the RUN's `ls` sets it).
def wheel_install_argvs(stage: Stage) -> list[list[str]]:
    argvs = []
    for run in (arg for kw, arg in stage.instructions if kw == "RUN"):
        for step in (part.strip() for part in run.split("&&")):
            if not re.match(r"python3? -m pip install ", step) or "${wheel}" not in step:
                continue
            command = re.sub(r"^python3? -m pip install ", r"printf '%s\\n' ", step)
            env = {"wheel": WHEEL, "TORCH_VERSION": "9.9.9", "TORCH_NPU_VERSION": "9.9.9", "PATH": "/usr/bin:/bin"}
            done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True, env=env)
            argvs.append(done.stdout.splitlines())
    return argvs


def constraint_files(argv: list[str]) -> list[str]:
    files = []
    for i, arg in enumerate(argv):
        if arg in ("-c", "--constraint") and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif arg.startswith("--constraint="):
            files.append(arg.partition("=")[2])
        elif arg.startswith("-c") and len(arg) > 2:
            files.append(arg[2:])
    return files


def constraints_path_in_image(stage: Stage) -> str | None:
    """Where the stage COPYs the constraints file to, if it does."""
    for keyword, arg in stage.instructions:
        if keyword == "COPY" and not arg.startswith("--from"):
            *sources, dest = arg.split()
            if CONSTRAINTS in sources:
                return dest + Path(CONSTRAINTS).name if dest.endswith("/") else dest
    return None


@pytest.mark.parametrize("target", TARGETS)
def test_every_wheel_install_uses_the_constraints(dockerfile, target):
    # Without them the package's open ranges (kopf>=1.37, ...) resolve to
    # whatever is newest on the day of the build.
    _, stages = dockerfile
    stage = stages[target]
    argvs = wheel_install_argvs(stage)
    assert argvs, f"stage {target} installs no wheel (expected `pip install ... \"${{wheel}}[...]\"`)"
    path = constraints_path_in_image(stage)
    assert path, f"stage {target} does not COPY {CONSTRAINTS}"
    copy_at = stage.instructions.index(next(i for i in stage.instructions if i[0] == "COPY" and CONSTRAINTS in i[1]))
    first_run = next(n for n, (kw, arg) in enumerate(stage.instructions) if kw == "RUN" and "${wheel}" in arg)
    assert copy_at < first_run, f"stage {target}: COPY {CONSTRAINTS} must come before the RUN that installs the wheel"
    for argv in argvs:
        assert any(arg.startswith(WHEEL) for arg in argv), argv
        assert constraint_files(argv) == [path], f"stage {target}: pip install {' '.join(argv)} lacks -c {path}"


def constraint_lines() -> list[str]:
    text = (REPO / CONSTRAINTS).read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_constraints_pin_every_line_exactly(dockerfile):
    global_args, _ = dockerfile
    lines = constraint_lines()
    bad = [line for line in lines if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[0-9][0-9A-Za-z.!]*", line)]
    assert not bad, f"{CONSTRAINTS}: not `name==version`: {bad}"
    names = [line.partition("==")[0] for line in lines]
    assert names == sorted(names), f"{CONSTRAINTS} is not sorted (run python hack/gen_image_constraints.py)"
    assert "mtp-operator" not in names
    # The same torch the package and the images pin (a local label such as +cpu would match one build only).
    assert f"torch=={global_args['TORCH_VERSION']}" in lines


def test_constraints_cover_the_closure(dockerfile):
    global_args, _ = dockerfile
    image_python = re.match(r"python:(\d+)\.(\d+)", global_args["PYTHON_IMAGE"]).groups()
    if sys.version_info[:2] != tuple(map(int, image_python)) or not sys.platform.startswith("linux"):
        pytest.skip(f"the pins are for the images' Python {'.'.join(image_python)} on Linux: markers differ here")
    if "+cpu" not in importlib.metadata.version("torch"):
        pytest.skip("the pins are made beside the CPU torch build; another build brings its own dependencies")
    problems = load_constraints_generator().check_constraints((REPO / CONSTRAINTS).read_text())
    assert not problems, "\n".join(problems) + "\n(run python hack/gen_image_constraints.py)"


def test_constraints_check_names_only():
    gen = load_constraints_generator()
    closure = {"typing-extensions": "4.16.0", "kopf": "1.45.2", "numpy": "2.4.6"}
    assert gen.check_constraints("# header\nTyping_Extensions==4.0\nkopf==1.50\nnumpy==2.4.6\n", closure) == []
    problems = gen.check_constraints("kopf>=1.37\nnumpy==2.4.6\nnumpy==2.4.6\n", closure)
    assert problems == ["line 1: 'kopf>=1.37' is not `name==version`", "line 3: numpy is pinned twice",
                        "typing-extensions (installed: 4.16.0) is not pinned", "kopf (installed: 1.45.2) is not pinned"]


@dataclass
class FakeDistribution:
    version: str
    requires: list[str] | None = None


def test_constraints_closure_follows_markers_and_requested_extras(monkeypatch):
    gen = load_constraints_generator()
    installed = {
        "mtp-operator": FakeDistribution("0.1.0", [
            "pyyaml>=6", 'torch==2.13.0; extra == "runtime"', 'kopf; extra == "operator"',
            'pytest; extra == "dev"', 'legacy; python_version < "3.0"']),
        "pyyaml": FakeDistribution("6.0.4"),
        "torch": FakeDistribution("2.13.0+cpu", ["sympy", 'optree; extra == "optree"']),
        "sympy": FakeDistribution("1.14.0", ["mpmath"]),
        "mpmath": FakeDistribution("1.3.0", ["sympy"]),  # a cycle
        "kopf": FakeDistribution("1.45.2", ['Requests[Socks]; extra == "full-auth"', "aiohttp"]),
        "aiohttp": FakeDistribution("3.14.5", ['requests; extra == "speedups"']),
    }

    def distribution(name: str) -> FakeDistribution:
        if name not in installed:
            raise gen.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(gen.metadata, "distribution", distribution)
    assert gen.dependency_closure("mtp-operator", ("runtime", "operator")) == {
        "aiohttp": "3.14.5", "kopf": "1.45.2", "mpmath": "1.3.0", "pyyaml": "6.0.4",
        "sympy": "1.14.0", "torch": "2.13.0"}
    installed["kopf"].requires.append("absent")
    with pytest.raises(LookupError, match="absent .required by kopf. is not installed"):
        gen.dependency_closure("mtp-operator", ("operator",))


# Runs in a fresh interpreter: makes every import of the runtime extra's own
# packages fail, as in the operator image, then imports the operator package
# and runs `mtp operator --help`.
OPERATOR_IMAGE_PROBE = """
import importlib, importlib.abc, pkgutil, sys
blocked = set(sys.argv[1].split(","))
class RuntimeExtraAbsent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"{name} is not installed in the operator image")
sys.meta_path.insert(0, RuntimeExtraAbsent())
import mtp_operator
for module in pkgutil.walk_packages(mtp_operator.__path__, "mtp_operator."):
    importlib.import_module(module.name)
from mtp_runtime.cli import main
try:
    main(["operator", "--help"])
except SystemExit as exit:
    sys.exit(exit.code)
"""


def test_operator_image_needs_no_runtime_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def import_names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=;\[ ]", req, maxsplit=1)[0].lower().replace("-", "_") for req in requirements}

    runtime_only = import_names(extras["runtime"]) - import_names(extras["operator"] + project["dependencies"])
    assert "torch" in runtime_only
    done = subprocess.run([sys.executable, "-c", OPERATOR_IMAGE_PROBE, ",".join(sorted(runtime_only))],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: mtp operator" in done.stdout
