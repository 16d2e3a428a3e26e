"""The README's usage examples, run as a user copies them, against `ampd up`."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from ampd.local_redis import free_port
from tests.test_local_stack import start_up, wait_for

README = Path(__file__).resolve().parents[1] / "README.md"
README_GATEWAY = "http://127.0.0.1:8000"  # where the README's examples find `make up`'s gateway


def usage_examples() -> list[str]:
    """The Python blocks of the README's Usage section, in order (each may use what the
    ones before it defined, as a reader running them one after another does)."""
    text = README.read_text()
    usage = text[text.index("\n## Usage") : text.index("\n## Deploying")]
    return re.findall(r"```python\n(.*?)```", usage, re.DOTALL)


def test_the_readmes_usage_examples_run_as_written(tmp_path):
    """Every example runs, in order, against the stack `ampd up` starts with the alias the
    Agents SDK recipe names; only the gateway's address is this test's. What an example
    says it prints (a ``# comment`` after a ``print``), it prints."""
    examples = usage_examples()
    assert len(examples) >= 5, "the README's Usage section lost its examples"
    gateway_port = free_port()
    up = start_up(tmp_path, "--served-model-name", "llama-3.1-8b", "--gateway-port", str(gateway_port),
                  "--prefill-port", str(free_port()), "--decode-port", str(free_port()), "--speed", "50")  # fmt: skip
    try:
        stack = wait_for(tmp_path / ".ampd" / "stack.json", up)
        code = "\n".join(examples).replace(README_GATEWAY, stack["gateway"])
        ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        printed = ran.stdout.splitlines()
        prints = re.findall(r"^\s*print\(.*$", "\n".join(examples), re.MULTILINE)
        assert len(printed) == len(prints) and all(printed), printed
        promised = [(i, line.split("# ", 1)[1].strip()) for i, line in enumerate(prints) if "# " in line]
        assert promised, "no example says what it prints"
        for i, said in promised:
            assert printed[i] == said, (printed[i], said)
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
