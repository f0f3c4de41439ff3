#!/usr/bin/env python3
"""Validate .buildkite/test_areas/*.yaml and turn them into a Buildkite pipeline (JSON).

Step schema (the subset of vLLM's test-area schema this repo uses):

    label                      str, unique across all files (required)
    timeout_in_minutes         int > 0 (required)
    commands                   non-empty list of str (required)
    source_file_dependencies   non-empty list of repo paths; a step runs when a changed file
                               equals a path or lies under it (required here: a step without
                               one would run on every change, which no step of ours wants)
    device                     one of DEVICES (default cpu)
    num_devices                int >= 1 (default 1; must be 1 for cpu)
    optional                   bool: manual unblock on pull requests, always run at night
    working_dir, env, soft_fail, autorun_on_main, key   (passed through)

Each file: `group` (str), optional `depends_on` (list of str), `steps` (non-empty list).

    python3 .buildkite/generate_pipeline.py --validate           # check the files only
    python3 .buildkite/generate_pipeline.py --changed-from origin/main
    python3 .buildkite/generate_pipeline.py --nightly            # every step, none blocked
    python3 .buildkite/generate_pipeline.py --changed-files a b  # explicit change list
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# device -> Buildkite agent queue (one GPU kind per queue; num_devices picks the machine size)
DEVICES = {
    "cpu": "cpu_queue",
    "h100": "gpu_h100_queue",
    "h200": "gpu_h200_queue",
    "b200": "gpu_b200_queue",
}

FILE_KEYS = {"group": str, "depends_on": list, "steps": list}
STEP_KEYS: Dict[str, Any] = {
    "label": str,
    "timeout_in_minutes": int,
    "commands": list,
    "source_file_dependencies": list,
    "device": str,
    "num_devices": int,
    "optional": bool,
    "working_dir": str,
    "env": dict,
    "soft_fail": bool,
    "autorun_on_main": bool,
    "key": str,
}
REQUIRED_STEP_KEYS = ("label", "timeout_in_minutes", "commands", "source_file_dependencies")


class PipelineError(ValueError):
    pass


def _tname(t) -> str:
    return {
        str: "a string",
        int: "an integer",
        list: "a list",
        dict: "a mapping",
        bool: "true/false",
    }[t]


def validate_area(
    data: Any, where: str, repo: str = REPO, check_paths: bool = True
) -> List[Dict[str, Any]]:
    """Check one test-area file; return its steps (each with 'group' and 'area' added)."""
    if not isinstance(data, dict):
        raise PipelineError(f"{where}: must be a mapping with 'group' and 'steps'")
    for k in data:
        if k not in FILE_KEYS:
            raise PipelineError(
                f"{where}: unknown top-level key {k!r} (allowed: {', '.join(FILE_KEYS)})"
            )
    for k in ("group", "steps"):
        if k not in data:
            raise PipelineError(f"{where}: missing top-level key {k!r}")
    for k, t in FILE_KEYS.items():
        if k in data and not isinstance(data[k], t):
            raise PipelineError(f"{where}: {k!r} must be {_tname(t)}")
    if not data["steps"]:
        raise PipelineError(f"{where}: 'steps' is empty")
    out = []
    for i, step in enumerate(data["steps"]):
        w = f"{where}: step {i}"
        if not isinstance(step, dict):
            raise PipelineError(f"{w}: must be a mapping")
        if isinstance(step.get("label"), str):
            w = f"{where}: step {step['label']!r}"
        for k in step:
            if k not in STEP_KEYS:
                raise PipelineError(f"{w}: unknown key {k!r} (allowed: {', '.join(STEP_KEYS)})")
        for k in REQUIRED_STEP_KEYS:
            if k not in step:
                raise PipelineError(f"{w}: missing required key {k!r}")
        for k, v in step.items():
            t = STEP_KEYS[k]
            if (t is int and isinstance(v, bool)) or not isinstance(v, t):
                raise PipelineError(f"{w}: {k!r} must be {_tname(t)}, got {v!r}")
        if not step["label"].strip():
            raise PipelineError(f"{w}: 'label' is empty")
        if step["timeout_in_minutes"] <= 0:
            raise PipelineError(
                f"{w}: 'timeout_in_minutes' must be > 0, got {step['timeout_in_minutes']}"
            )
        if not step["commands"] or not all(
            isinstance(c, str) and c.strip() for c in step["commands"]
        ):
            raise PipelineError(f"{w}: 'commands' must be a non-empty list of non-empty strings")
        device = step.get("device", "cpu")
        if device not in DEVICES:
            raise PipelineError(f"{w}: unknown device {device!r} (known: {', '.join(DEVICES)})")
        n = step.get("num_devices", 1)
        if n < 1:
            raise PipelineError(f"{w}: 'num_devices' must be >= 1, got {n}")
        if device == "cpu" and n != 1:
            raise PipelineError(f"{w}: 'num_devices' must be 1 on device cpu, got {n}")
        deps = step["source_file_dependencies"]
        if not deps or not all(isinstance(d, str) and d.strip() for d in deps):
            raise PipelineError(
                f"{w}: 'source_file_dependencies' must be a non-empty list of paths"
            )
        for d in deps:
            if os.path.isabs(d) or ".." in d.split("/"):
                raise PipelineError(f"{w}: dependency {d!r} must be a path inside the repo")
            if check_paths and not os.path.exists(os.path.join(repo, d)):
                raise PipelineError(
                    f"{w}: source_file_dependencies path {d!r} does not exist in the repo "
                    f"(renamed or removed?); this step would silently stop triggering"
                )
        if "env" in step:
            for k, v in step["env"].items():
                if not isinstance(k, str) or not isinstance(v, str):
                    raise PipelineError(f"{w}: 'env' must map strings to strings ({k!r})")
        out.append({**step, "group": data["group"], "area": where})
    return out


def load_steps(repo: str = REPO, check_paths: bool = True) -> List[Dict[str, Any]]:
    """Every step of every .buildkite/test_areas/*.yaml, validated; labels must be unique."""
    files = sorted(glob.glob(os.path.join(repo, ".buildkite", "test_areas", "*.yaml")))
    if not files:
        raise PipelineError("no .buildkite/test_areas/*.yaml files")
    steps: List[Dict[str, Any]] = []
    seen: Dict[str, str] = {}
    for path in files:
        rel = os.path.relpath(path, repo)
        with open(path, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise PipelineError(f"{rel}: not valid YAML: {e}") from None
        for s in validate_area(data, rel, repo, check_paths):
            if s["label"] in seen:
                raise PipelineError(
                    f"{rel}: label {s['label']!r} already used in {seen[s['label']]}"
                )
            seen[s["label"]] = rel
            steps.append(s)
    return steps


def matches(step: Dict[str, Any], changed: Sequence[str]) -> bool:
    """True if a changed path equals a dependency or lies under it (directories end in '/')."""
    for dep in step["source_file_dependencies"]:
        d = dep.rstrip("/")
        for path in changed:
            if path == d or path.startswith(d + "/"):
                return True
    return False


def changed_files(base: str, repo: str = REPO) -> List[str]:
    mb = subprocess.run(
        ["git", "merge-base", base, "HEAD"], cwd=repo, capture_output=True, text=True
    )
    if mb.returncode != 0:
        raise PipelineError(f"git merge-base {base} HEAD failed: {mb.stderr.strip()}")
    diff = subprocess.run(
        ["git", "diff", "--name-only", mb.stdout.strip(), "HEAD"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in diff.stdout.splitlines() if line.strip()]


def build_pipeline(
    steps: List[Dict[str, Any]], changed: Optional[Sequence[str]], nightly: bool
) -> Dict[str, Any]:
    """Buildkite pipeline: groups of command steps. `changed=None` or nightly = run all.
    On pull requests an optional step is preceded by a block step and depends on it."""
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for s in steps:
        if not nightly and changed is not None and not matches(s, changed):
            continue
        key = s.get("key") or "".join(c if c.isalnum() else "-" for c in s["label"]).strip("-")
        n = s.get("num_devices", 1)
        cmd: Dict[str, Any] = {
            "label": s["label"],
            "key": key,
            "timeout_in_minutes": s["timeout_in_minutes"],
            "agents": {"queue": DEVICES[s.get("device", "cpu")]},
            "commands": ([f"cd {s['working_dir']}"] if "working_dir" in s else [])
            + list(s["commands"]),
            "env": {**s.get("env", {}), "HISPARSE_CI_NUM_DEVICES": str(n)},
        }
        if s.get("device", "cpu") != "cpu":
            cmd["agents"]["gpus"] = str(n)
        if s.get("soft_fail"):
            cmd["soft_fail"] = True
        out = groups.setdefault(s["group"], [])
        if s.get("optional") and not nightly:
            out.append({"block": f"Run {s['label']}", "key": f"block-{key}"})
            cmd["depends_on"] = f"block-{key}"
        out.append(cmd)
    return {"steps": [{"group": g, "steps": st} for g, st in groups.items()]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--validate", action="store_true", help="check the files and exit")
    p.add_argument(
        "--nightly",
        action="store_true",
        help="every step, optional ones unblocked (also: NIGHTLY=1 or a scheduled "
        "build, BUILDKITE_SOURCE=schedule)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--changed-from", help="git ref; run the steps the diff against it touches")
    src.add_argument("--changed-files", nargs="*", help="explicit list of changed paths")
    args = p.parse_args(argv)
    try:
        steps = load_steps()
        if args.validate:
            for s in steps:
                print(
                    f"ok  {s['area']}: {s['label']} ({s.get('device', 'cpu')} x "
                    f"{s.get('num_devices', 1)}, {s['timeout_in_minutes']} min"
                    f"{', optional' if s.get('optional') else ''})"
                )
            return 0
        nightly = (
            args.nightly
            or os.environ.get("NIGHTLY") == "1"
            or os.environ.get("BUILDKITE_SOURCE") == "schedule"
        )
        on_main = os.environ.get("BUILDKITE_BRANCH") == "main"
        changed: Optional[List[str]] = None
        if args.changed_files is not None:
            changed = list(args.changed_files)
        elif args.changed_from and not (nightly or on_main):
            changed = changed_files(args.changed_from)
        pipeline = build_pipeline(steps, changed, nightly)
    except PipelineError as e:
        print(f"pipeline error: {e}", file=sys.stderr)
        return 1
    json.dump(pipeline, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
