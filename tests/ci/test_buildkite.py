"""The Buildkite definitions (.buildkite/): schema, real paths, the nightly's trigger coverage,
and the step selection of the pipeline generator."""

from __future__ import annotations

import ast
import glob
import importlib.util
import os
import re
import shutil
import subprocess

import pytest
import yaml

from tests import REPO_ROOT

REPO = str(REPO_ROOT)
BK = os.path.join(REPO, ".buildkite")
NIGHTLY = "lm-eval-hisparse-nightly-4xb200"

_spec = importlib.util.spec_from_file_location(
    "generate_pipeline", os.path.join(BK, "generate_pipeline.py")
)
gp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gp)


@pytest.fixture(scope="module")
def steps():
    return {s["label"]: s for s in gp.load_steps(REPO)}


# ----------------------------------------------------------------------------- the real files


def test_every_area_file_validates(steps):
    assert len(steps) >= 3
    for s in steps.values():
        assert s["timeout_in_minutes"] > 0
        assert s.get("device", "cpu") in gp.DEVICES


def test_every_dependency_path_exists(steps):
    """A renamed file must fail here, not silently stop a GPU job from triggering."""
    missing = [
        (label, d)
        for label, s in steps.items()
        for d in s["source_file_dependencies"]
        if not os.path.exists(os.path.join(REPO, d))
    ]
    assert missing == []
    for s in steps.values():
        for d in s["source_file_dependencies"]:
            if d.endswith("/"):
                assert os.path.isdir(os.path.join(REPO, d)), d


def test_every_dependency_path_is_tracked_by_git(steps):
    """Existing only in a local checkout (untracked) is not enough: CI clones the repo."""
    if shutil.which("git") is None or not os.path.exists(os.path.join(REPO, ".git")):
        pytest.skip("not a git checkout")
    probe = subprocess.run(
        ["git", "ls-files", "--", "setup.py"], cwd=REPO, capture_output=True, text=True
    )
    if probe.returncode != 0 or not probe.stdout.strip():
        pytest.skip("the git index here does not describe this tree (a copied working tree)")
    untracked = []
    for s in steps.values():
        for d in s["source_file_dependencies"]:
            out = subprocess.run(
                ["git", "ls-files", "--", d], cwd=REPO, capture_output=True, text=True
            )
            if out.returncode == 0 and not out.stdout.strip():
                untracked.append((s["label"], d))
    assert untracked == []


_REPO_PATH = re.compile(r"^(?:tests|evals|benchmarks|hisparse|\.buildkite)/\S+\.(?:py|yaml|txt)$")


def test_every_repo_file_named_in_a_command_exists(steps):
    named = []
    for s in steps.values():
        for cmd in s["commands"]:
            for tok in cmd.split():
                tok = tok.strip("'\"")
                if _REPO_PATH.match(tok):
                    named.append(tok)
    assert "evals/gsm8k/configs/GLM-5.2-NVFP4-HiSparse.yaml" in named
    assert [p for p in named if not os.path.isfile(os.path.join(REPO, p))] == []


def test_nightly_job(steps):
    s = steps[NIGHTLY]
    assert s["device"] == "b200" and s["num_devices"] == 4
    assert s["timeout_in_minutes"] == 60 and s["optional"] is True
    deps = set(s["source_file_dependencies"])
    assert deps >= {
        "csrc/",
        "hisparse/runtime/",
        "hisparse/connector/",
        "evals/gsm8k/",
    }
    assert any(
        "evals/gsm8k/run_gsm8k.py" in c and "GLM-5.2-NVFP4-HiSparse.yaml" in c
        for c in s["commands"]
    )
    with open(os.path.join(REPO, "evals", "gsm8k", "configs", "models-hisparse.txt")) as f:
        assert "GLM-5.2-NVFP4-HiSparse.yaml" in f.read().split()


def _hisparse_import_closure(module: str):
    """hisparse module files reachable from `module` through `import`/`from` statements
    (including those inside functions), as repo-relative paths."""
    seen, todo = set(), [module]
    while todo:
        mod = todo.pop()
        base = os.path.join(REPO, *mod.split("."))
        path = base + ".py" if os.path.isfile(base + ".py") else os.path.join(base, "__init__.py")
        if not os.path.isfile(path):
            continue
        rel = os.path.relpath(path, REPO)
        if rel in seen:
            continue
        seen.add(rel)
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] == "hisparse":
                    todo.append(node.module)
                    todo.extend(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                todo.extend(a.name for a in node.names if a.name.split(".")[0] == "hisparse")
    return seen


def _covered(path, deps):
    return any(path == d.rstrip("/") or path.startswith(d.rstrip("/") + "/") for d in deps)


def test_nightly_covers_every_module_on_the_vllm_path(steps):
    """vLLM imports hisparse.vllm.connector; every hisparse module it pulls in (and the C++/CUDA
    sources) must trigger the nightly when changed."""
    closure = _hisparse_import_closure("hisparse.vllm.connector")
    assert "hisparse/connector/facade.py" in closure
    assert "hisparse/runtime/index_group.py" in closure
    closure.discard("hisparse/__init__.py")
    deps = steps[NIGHTLY]["source_file_dependencies"]
    assert sorted(p for p in closure if not _covered(p, deps)) == []


def test_gpu_kernel_job(steps):
    gpu = [
        s
        for s in steps.values()
        if s.get("device") in ("h100", "h200") and any("-m cuda" in c for c in s["commands"])
    ]
    assert gpu, "no H100/H200 job runs the CUDA tests"
    s = next(x for x in gpu if not x.get("optional"))
    cmds = "\n".join(s["commands"])
    assert re.search(r"pytest .*-m cuda", cmds)
    assert re.search(r"compute-sanitizer --tool memcheck .*tests/cuda_sanitizer_workload\.py", cmds)
    assert re.search(
        r"compute-sanitizer --tool racecheck .*tests/cuda_sanitizer_workload\.py", cmds
    )
    assert "benchmarks/bench_ops.py --device cuda" in cmds
    cuda_sources = [
        os.path.relpath(p, REPO)
        for p in glob.glob(os.path.join(REPO, "csrc", "**", "*.cu"), recursive=True)
    ]
    assert cuda_sources, "no CUDA sources under csrc/"
    for src in cuda_sources:
        assert _covered(src, s["source_file_dependencies"]), src
        assert _covered(src, steps[NIGHTLY]["source_file_dependencies"]), src


def test_cpu_unit_job(steps):
    cpu = [
        s
        for s in steps.values()
        if s.get("device", "cpu") == "cpu" and any("pytest" in c for c in s["commands"])
    ]
    assert cpu and all(s.get("num_devices", 1) == 1 for s in cpu)
    assert _covered("tests/ci/test_buildkite.py", cpu[0]["source_file_dependencies"])
    assert _covered("hisparse/runtime/index_group.py", cpu[0]["source_file_dependencies"])


def test_pipeline_yml_bootstraps_the_generator():
    with open(os.path.join(BK, "pipeline.yml")) as f:
        doc = yaml.safe_load(f)
    assert isinstance(doc["steps"], list) and doc["steps"]
    cmds = " ".join(" ".join(s.get("commands", [s.get("command", "")])) for s in doc["steps"])
    assert ".buildkite/generate_pipeline.py" in cmds and "pipeline upload" in cmds
    assert all("label" in s and "agents" in s for s in doc["steps"])


# ----------------------------------------------------------------------------- selection


def _labels(pipeline):
    return [s["label"] for g in pipeline["steps"] for s in g["steps"] if "label" in s]


def test_a_binding_change_triggers_the_nightly_behind_a_block(steps):
    pl = gp.build_pipeline(list(steps.values()), ["hisparse/runtime/views.py"], nightly=False)
    assert NIGHTLY in _labels(pl)
    flat = [s for g in pl["steps"] for s in g["steps"]]
    job = next(s for s in flat if s.get("label") == NIGHTLY)
    assert job["depends_on"] == f"block-{job['key']}"
    assert any(s.get("key") == job["depends_on"] and "block" in s for s in flat)
    assert job["agents"] == {"queue": "gpu_b200_queue", "gpus": "4"}
    assert job["timeout_in_minutes"] == 60


@pytest.mark.parametrize(
    "path,nightly_runs",
    [
        ("csrc/cuda_ops.cu", True),
        ("hisparse/connector/facade.py", True),
        ("hisparse/connector/worker.py", True),
        ("evals/gsm8k/configs/GLM-5.2-NVFP4-HiSparse.yaml", True),
        ("README.md", False),
        ("docs/engine.md", False),
        ("csrcx/thing.cu", False),  # prefix of a name is not a folder match
        ("hisparse/engine/dsa/generate.py", False),  # the engines are not on the vLLM path
    ],
)
def test_trigger_rules(steps, path, nightly_runs):
    pl = gp.build_pipeline(list(steps.values()), [path], nightly=False)
    assert (NIGHTLY in _labels(pl)) is nightly_runs


def test_nightly_mode_runs_everything_unblocked(steps):
    pl = gp.build_pipeline(list(steps.values()), ["README.md"], nightly=True)
    assert sorted(_labels(pl)) == sorted(steps)
    flat = [s for g in pl["steps"] for s in g["steps"]]
    assert not any("block" in s for s in flat)
    assert not any("depends_on" in s for s in flat)
    assert gp.main(["--validate"]) == 0


def test_changed_files_from_git(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, env=env)

    git("init", "-q", "-b", "main")
    (tmp_path / "a.txt").write_text("1")
    git("add", "a.txt")
    git("commit", "-q", "-m", "one")
    git("checkout", "-q", "-b", "pr")
    (tmp_path / "hisparse").mkdir()
    (tmp_path / "hisparse" / "binding.py").write_text("x = 1\n")
    git("add", "hisparse/binding.py")
    git("commit", "-q", "-m", "two")
    assert gp.changed_files("main", repo=str(tmp_path)) == ["hisparse/binding.py"]
    with pytest.raises(gp.PipelineError, match="merge-base"):
        gp.changed_files("no-such-ref", repo=str(tmp_path))


# ----------------------------------------------------------------------------- validator errors


def _step(**over):
    s = {
        "label": "x",
        "timeout_in_minutes": 10,
        "commands": ["true"],
        "source_file_dependencies": ["csrc/"],
    }
    s.update(over)
    return s


def _area(*steps_):
    return {"group": "g", "steps": list(steps_)}


@pytest.mark.parametrize(
    "step,match",
    [
        ({k: v for k, v in _step().items() if k != "label"}, "missing required key 'label'"),
        (
            {k: v for k, v in _step().items() if k != "timeout_in_minutes"},
            "missing required key 'timeout_in_minutes'",
        ),
        ({k: v for k, v in _step().items() if k != "commands"}, "missing required key 'commands'"),
        (
            {k: v for k, v in _step().items() if k != "source_file_dependencies"},
            "missing required key 'source_file_dependencies'",
        ),
        (_step(timeout_in_minutes="60"), "'timeout_in_minutes' must be an integer"),
        (_step(timeout_in_minutes=True), "'timeout_in_minutes' must be an integer"),
        (_step(timeout_in_minutes=0), "'timeout_in_minutes' must be > 0"),
        (_step(timeout_in_minutes=-5), "'timeout_in_minutes' must be > 0"),
        (_step(commands="pytest"), "'commands' must be a list"),
        (_step(commands=[]), "'commands' must be a non-empty list"),
        (_step(device="tpu"), "unknown device 'tpu'"),
        (_step(device="b200", num_devices=0), "'num_devices' must be >= 1"),
        (_step(num_devices=2), "must be 1 on device cpu"),
        (_step(optional="yes"), "'optional' must be true/false"),
        (_step(timeout=5), "unknown key 'timeout'"),
        (_step(source_file_dependencies=[]), "non-empty list of paths"),
        (
            _step(source_file_dependencies=["hisparse/no_such_module.py"]),
            "path 'hisparse/no_such_module.py' does not exist",
        ),
        (_step(source_file_dependencies=["/etc/passwd"]), "must be a path inside the repo"),
        (_step(env={"A": 1}), "'env' must map strings to strings"),
    ],
)
def test_validator_names_the_problem(step, match):
    with pytest.raises(gp.PipelineError, match=match):
        gp.validate_area(_area(step), "area.yaml", REPO)


def test_validator_file_level_errors(tmp_path):
    with pytest.raises(gp.PipelineError, match="must be a mapping"):
        gp.validate_area([_step()], "a.yaml", REPO)
    with pytest.raises(gp.PipelineError, match="missing top-level key 'group'"):
        gp.validate_area({"steps": [_step()]}, "a.yaml", REPO)
    with pytest.raises(gp.PipelineError, match="'steps' is empty"):
        gp.validate_area({"group": "g", "steps": []}, "a.yaml", REPO)
    with pytest.raises(gp.PipelineError, match="unknown top-level key 'stepz'"):
        gp.validate_area({"group": "g", "stepz": []}, "a.yaml", REPO)
    # duplicate labels across files, and a broken YAML file, in a scratch repo
    areas = tmp_path / ".buildkite" / "test_areas"
    areas.mkdir(parents=True)
    (tmp_path / "csrc").mkdir()
    (areas / "a.yaml").write_text(yaml.safe_dump(_area(_step())))
    (areas / "b.yaml").write_text(yaml.safe_dump(_area(_step())))
    with pytest.raises(gp.PipelineError, match="label 'x' already used"):
        gp.load_steps(str(tmp_path))
    (areas / "b.yaml").write_text("group: [\n")
    with pytest.raises(gp.PipelineError, match="not valid YAML"):
        gp.load_steps(str(tmp_path))
    shutil.rmtree(tmp_path / "csrc")
    (areas / "b.yaml").unlink()
    with pytest.raises(gp.PipelineError, match="'csrc/' does not exist"):
        gp.load_steps(str(tmp_path))


def test_generator_cli_reports_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gp, "REPO", str(tmp_path))
    monkeypatch.setattr(
        gp,
        "load_steps",
        lambda: gp.validate_area(
            _area(_step(source_file_dependencies=["gone/"])), "a.yaml", str(tmp_path)
        ),
    )
    assert gp.main(["--validate"]) == 1
    assert "'gone/' does not exist" in capsys.readouterr().err
