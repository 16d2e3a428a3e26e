"""What a clone of the repository must not carry: paths of the machine a result was made on,
package hosts' addresses, tests that reach beyond this machine, results nobody can trace to
the command that made them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# A home, work, temp or tool directory of some machine, followed by a name inside it.
MACHINE_PATH = re.compile(r"(?<![\w.])/(home|work|tmp|opt|root|Users|var/folders)/[A-Za-z0-9_.-]+")
URL = re.compile(r"https?://(\[[^\]]+\]|[A-Za-z0-9_.-]+)")
# Hosts a test may name: this machine, and names that resolve nowhere (a single label, or a
# TLD reserved for examples and tests, RFC 2606).
LOCAL_HOST = re.compile(
    r"^(localhost|127\.\d+\.\d+\.\d+|0\.0\.0\.0|\[::1?\]|[A-Za-z0-9_-]+|.*\.(test|example|invalid|localhost))$"
)
UNTRACKED = {"__pycache__", "venvs"}  # what git ignores there: compiled code, the peers' venvs (bench/venvs)
PACKAGE_HOSTS = re.compile(r"(pypi\.org|pythonhosted\.org|pypi\.nvidia\.com|download\.pytorch\.org)")


def _texts(*folders: Path, suffixes: tuple[str, ...] | None = None) -> list[tuple[Path, str]]:
    """Every text file under ``folders`` (binary files, such as figures, are skipped)."""
    out = []
    for folder in folders:
        for path in sorted(p for p in folder.rglob("*") if p.is_file() and not UNTRACKED & set(p.parts)):
            if suffixes is not None and path.suffix not in suffixes:
                continue
            try:
                out.append((path, path.read_text(encoding="utf-8")))
            except UnicodeDecodeError:
                continue
    return out


def _hits(pattern: re.Pattern[str], texts: list[tuple[Path, str]], keep=lambda match: True) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for path, text in texts
        for m in pattern.finditer(text)
        if keep(m)
    ]


def test_results_and_docs_hold_no_path_of_the_machine_they_were_made_on():
    texts = _texts(RESULTS, ROOT / "docs") + [(ROOT / "README.md", (ROOT / "README.md").read_text())]
    assert _hits(MACHINE_PATH, texts) == []


def test_no_test_names_a_host_beyond_this_machine():
    hits = _hits(URL, _texts(ROOT / "tests", suffixes=(".py",)), keep=lambda m: not LOCAL_HOST.match(m.group(1)))
    assert hits == []


def test_no_package_host_is_named_in_code_results_or_docs():
    """Peers install from the registries pip is configured with; the code says "the vendor's
    own index", never its address."""
    folders = [ROOT / name for name in ("bench", "tests", "docs", "ampd", "gateway", "workers", "planner")]
    hits = _hits(PACKAGE_HOSTS, _texts(*folders), keep=lambda m: True)
    assert [h for h in hits if "test_repository_hygiene.py" not in h] == []


def test_every_result_is_listed_with_the_command_that_made_it():
    """bench/results/README.md has a row for each file (its path, or a glob covering it, in
    backticks) and every row names the command that made it (`ampd ...`, a Python script, `make`)."""
    index = (RESULTS / "README.md").read_text()
    rows = [line for line in index.splitlines() if line.startswith("|") and "`" in line]
    listed = [m for row in rows for m in re.findall(r"`([^`]+)`", row.split("|")[1])]
    files = [p.relative_to(RESULTS) for p in RESULTS.rglob("*") if p.is_file() and p.name != "README.md"]
    assert files
    unlisted = [str(f) for f in files if not any(f.match(pattern) or str(f) == pattern for pattern in listed)]
    assert unlisted == []
    for row in rows:
        command = row.split("|")[2] if row.count("|") > 3 else ""
        assert re.search(r"ampd |python|make |\.(py|sh)\b", command), row


def test_every_module_that_starts_vllm_engines_is_named_so():
    """tests/conftest.py runs the modules named test_vllm* one after another on one xdist
    worker; a module that starts vLLM engines (it takes VLLM_TIMEOUT) under another name
    would run beside them and starve with them."""
    here = Path(__file__).name
    takers = [p.name for p in (ROOT / "tests").glob("test_*.py") if p.name != here and "VLLM_TIMEOUT" in p.read_text()]
    assert takers and [name for name in takers if not name.startswith("test_vllm")] == []
