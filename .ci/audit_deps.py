"""CI step: audit llamaserve's installed runtime dependencies for known advisories (pip-audit).

What is audited: the packages llamaserve requires, recursively, at the versions installed here (not
the dev extras' test clients, nor whatever else the machine has), pinned into a requirements file
that pip-audit checks as given (--no-deps --disable-pip: nothing is resolved or installed again).

The verdict, and why:
- an advisory with a fixed release fails the build: raise the floor in pyproject.toml (or upgrade)
  past it;
- an advisory with no fixed release is reported, not failed: there is nothing to move to, and the
  build would stay red until upstream ships one (torch carries several such);
- no advisory data at all is reported, not failed. pip-audit asks PyPI's JSON API by default (OSV is
  its other service); where a machine reaches the package index but not those (a mirror serves the
  simple index only: every package then reads as "not found on PyPI", and pip-audit would print "No
  known vulnerabilities found"), or the network fails, the step says loudly that nothing was
  audited instead of passing silently, and the build goes on. A failed audit of a package that
  could be looked up is never taken for a clean one.

Run from the repository root after `pip install -e '.[dev]'`: `python .ci/audit_deps.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

PROJECT = "llamaserve"


def runtime_closure(project: str = PROJECT) -> dict[str, str]:
    """{canonical name: installed public version} of everything `project` needs at run time."""
    installed: dict[str, str] = {}
    pending = list(_runtime_requirements(project))
    while pending:
        name = canonicalize_name(pending.pop().name)
        if name in installed:
            continue
        try:
            installed[name] = Version(metadata.version(name)).public  # torch's "+cpu" is no PyPI release
        except metadata.PackageNotFoundError:
            continue  # an optional dependency not installed here: nothing to audit
        pending.extend(_runtime_requirements(name))
    return installed


def _runtime_requirements(distribution: str) -> list[Requirement]:
    """The distribution's requirements that apply here without extras."""
    requirements = [Requirement(text) for text in metadata.requires(distribution) or ()]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def run_pip_audit(pins: dict[str, str]) -> tuple[dict | None, str]:
    """pip-audit's JSON report over exactly these pins; (None, its complaint) where it produced none."""
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / "runtime.txt"
        requirements.write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
        result = subprocess.run(
            [sys.executable, "-m", "pip_audit", "-r", str(requirements), "--no-deps", "--disable-pip",
             "--format", "json", "--progress-spinner", "off"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    try:
        return json.loads(result.stdout), ""
    except json.JSONDecodeError:
        return None, (result.stderr.strip() or result.stdout.strip())[-2000:]


def verdict(report: dict) -> tuple[bool, list[str]]:
    """(whether the build fails, the lines to print) for one pip-audit JSON report."""
    dependencies = report.get("dependencies", [])
    skipped = [d for d in dependencies if d.get("skip_reason")]
    fixable, unfixable = [], []
    for dependency in dependencies:
        for vuln in dependency.get("vulns", []):
            line = f"{dependency['name']} {dependency['version']}: {vuln['id']}"
            if vuln.get("fix_versions"):
                fixable.append(f"{line} (fixed in {', '.join(vuln['fix_versions'])})")
            else:
                unfixable.append(f"{line} (no fixed release yet)")
    lines = [f"VULNERABLE: {line}" for line in fixable] + [f"advisory without a fix: {line}" for line in unfixable]
    audited = len(dependencies) - len(skipped)
    if audited == 0:
        reason = skipped[0]["skip_reason"] if skipped else "no dependencies"
        lines.append(f"NOT AUDITED: no advisory data for any of the {len(dependencies)} runtime packages "
                     f"(the advisory service is out of reach from here; first: {reason})")
    else:
        lines += [f"not audited: {d['name']}: {d['skip_reason']}" for d in skipped]
        lines.append(f"audited {audited} runtime packages: {len(fixable)} fixable, {len(unfixable)} unfixed advisories")
    return bool(fixable), lines


def main() -> int:
    try:
        pins = runtime_closure()
    except metadata.PackageNotFoundError:
        print(f"audit: {PROJECT} is not installed; run `pip install -e '.[dev]'` first", file=sys.stderr)
        return 1
    report, complaint = run_pip_audit(pins)
    if report is None:
        print(f"audit: NOT AUDITED: pip-audit gave no report (network?): {complaint}", file=sys.stderr)
        return 0
    failed, lines = verdict(report)
    for line in lines:
        print(f"audit: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
