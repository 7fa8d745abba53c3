"""Issue 29 (7): the runtime dependency floors admit no release with a known, fixed advisory, and the CI
audit step (.ci/audit_deps.py) fails on a fixable advisory, reports the rest, and never passes silently
when it had no advisory data."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]

# (package, the last release an advisory affects, the advisory): each floor must exclude that release.
KNOWN_ADVISORIES = [
    ("jinja2", "3.1.5", "CVE-2025-27516: sandbox escape through the |attr filter"),
    ("jinja2", "3.1.4", "CVE-2024-56201, CVE-2024-56326: compiler and sandbox escapes"),
    ("aiohttp", "3.9.3", "CVE-2024-30251: multipart infinite loop"),
    ("aiohttp", "3.13.2", "CVE-2025-69223: compressed-body zip bomb"),
    ("aiohttp", "3.13.5", "CVE-2026-34993, CVE-2026-47265 (fixed in 3.14.0)"),
    ("aiohttp", "3.14.0", "CVE-2026-54273..54280: a compressed body decompressed in one chunk, cookies"),
    ("aiohttp", "3.14.2", "CVE-2026-69244: out-of-bounds read in the C response parser"),
    ("aiohttp", "3.14.3", "GHSA-2g87-pp6c-29x5: inputs that use memory or CPU without bound"),
    ("tqdm", "4.66.2", "CVE-2024-34062: CLI arguments evaluated"),
    ("sentencepiece", "0.2.0", "CVE-2026-1260: heap memory access in model loading"),
    ("tokenizers", "0.22.2", "AIKIDO-2026-10636: EncodingVisualizer XSS (fixed in 0.23.1)"),
    ("torch", "2.5.1", "CVE-2025-32434: torch.load(weights_only=True) bypass"),
    ("torch", "2.8.0", "PYSEC-2025-203, -204, -206: DoS in linalg.lu, rot90, nan_to_num (fixed in 2.9.0)"),
]


def runtime_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {Requirement(text).name.lower(): Requirement(text) for text in project["dependencies"]}


@pytest.mark.parametrize("package, vulnerable, advisory", KNOWN_ADVISORIES,
                         ids=[f"{p}-{v}" for p, v, _ in KNOWN_ADVISORIES])
def test_floors_exclude_releases_with_known_advisories(package, vulnerable, advisory):
    requirement = runtime_requirements()[package]
    assert not requirement.specifier.contains(vulnerable, prereleases=True), f"{requirement} admits {vulnerable}: {advisory}"


def test_torch_stays_installable_at_the_version_ci_and_the_readme_name():
    assert runtime_requirements()["torch"].specifier.contains("2.13.0")
    assert "torch==2.13.0" in (ROOT / ".ci" / "run").read_text()


def test_pip_audit_is_a_dev_dependency_and_the_ci_runs_it():
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert "pip-audit" in {Requirement(text).name for text in dev}
    assert "python .ci/audit_deps.py" in (ROOT / ".ci" / "run").read_text()


# --------------------------------------------------------------------------- the audit step's verdict
@pytest.fixture(scope="module")
def audit():
    spec = importlib.util.spec_from_file_location("audit_deps", ROOT / ".ci" / "audit_deps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dep(name: str, *vulns: tuple[str, list[str]]) -> dict:
    return {"name": name, "version": "1.0", "vulns": [{"id": vid, "fix_versions": fixes} for vid, fixes in vulns]}


def skipped(name: str) -> dict:
    return {"name": name, "skip_reason": f"Dependency not found on PyPI and could not be audited: {name} (1.0)"}


def test_a_fixable_advisory_fails_the_build(audit):
    failed, lines = audit.verdict({"dependencies": [dep("jinja2", ("GHSA-cpwx-vrp4-4pq7", ["3.1.6"])), dep("numpy")]})
    assert failed and "VULNERABLE: jinja2 1.0: GHSA-cpwx-vrp4-4pq7 (fixed in 3.1.6)" in lines


def test_an_advisory_without_a_fix_is_reported_not_failed(audit):
    failed, lines = audit.verdict({"dependencies": [dep("torch", ("PYSEC-2026-139", []))]})
    assert not failed and any("torch 1.0: PYSEC-2026-139 (no fixed release yet)" in line for line in lines)


def test_no_advisory_data_is_said_loudly_never_taken_for_clean(audit):
    failed, lines = audit.verdict({"dependencies": [skipped("aiohttp"), skipped("jinja2")]})
    assert not failed and lines[-1].startswith("NOT AUDITED: no advisory data for any of the 2 runtime packages")
    failed, lines = audit.verdict({"dependencies": [dep("numpy"), skipped("torch")]})
    assert not failed and "not audited: torch: " in lines[0] and lines[-1].startswith("audited 1 runtime packages")


def test_no_report_at_all_is_not_audited_and_not_failed(audit, monkeypatch, capsys):
    monkeypatch.setattr(audit, "run_pip_audit", lambda pins: (None, "ConnectionError: no route"))
    assert audit.main() == 0
    assert "NOT AUDITED: pip-audit gave no report (network?): ConnectionError" in capsys.readouterr().err


def test_the_audited_set_is_the_runtime_closure(audit):
    pins = audit.runtime_closure()
    assert {"aiohttp", "jinja2", "markupsafe", "torch"} <= set(pins)  # markupsafe: through jinja2
    assert not {"pytest", "openai", "pip-audit"} & set(pins)  # dev extras are not served
    assert "+" not in pins["torch"]  # a local label ("+cpu") is no release an advisory names
