"""The peer gateways and routers the benches compare ampd with, each installed from PyPI
into its own venv under bench/venvs/ at run time (never vendored), pinned here.

``ensure_venv`` installs a peer on first use and reuses its venv while the marker it wrote
(``.installed``: what was installed) matches what is pinned now; ``installed`` says whether
it is there without installing anything (the tests run a peer only then: they never install).
``python -m bench.peer_venvs PEER ...`` installs ahead of time (``make test`` does it for the
peers the suite runs).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

VENVS = Path("bench/venvs")
# The versions the benches were run with (`ampd bench overhead`, `ampd bench peers`).
REQUIREMENTS = {
    "litellm": "litellm[proxy]==1.106.2",
    "vllm-router": "vllm-router==0.1.17",
    "sglang-router": "sglang-router==0.3.2",  # the SGLang project's model gateway (its `smg` crate)
    "smg": "smg==1.13.0",  # the Shepherd Model Gateway (sglang-router's binary is built from a crate of this name)
    "ai-dynamo": "ai-dynamo==1.6.1",
}
# Peers whose pinned requirement does not install from PyPI alone: the pip invocations that
# do, in order. ai-dynamo 1.6.1 requires ``aisimulate==0.13.0``, a wheel stub whose build
# downloads the real wheel from NVIDIA's own index (and fails where only PyPI is reachable);
# only Dynamo's planner imports it, so the rest of ai-dynamo's requirements are installed
# and ai-dynamo itself without its requirements.
RECIPES: dict[str, list[list[str]]] = {
    "ai-dynamo": [
        ["ai-dynamo-runtime==1.6.1", "aiohttp>=3.14.3,<4", "certifi>=2026.10.19", "kubernetes>=32.0.1,<33",
         "msgspec>=0.19", "prometheus-client>=0.23.1,<1", "pyzmq>=26", "redis>=6.2,<9", "tqdm",
         "transformers>=4.56", "typing-extensions>=4.10", "zstandard>=0.23,<1"],
        ["--no-deps", "ai-dynamo==1.6.1"],
    ],
}  # fmt: skip


def recipe(peer: str) -> list[list[str]]:
    """The pip arguments that install ``peer``, one list per pip call."""
    return RECIPES.get(peer, [[REQUIREMENTS[peer]]])


def installed(peer: str) -> bool:
    """Whether the peer's venv holds what is pinned now (nothing is installed to find out)."""
    marker = VENVS / peer / ".installed"
    return marker.exists() and marker.read_text() == _wanted(peer)


def _wanted(peer: str) -> str:
    return "\n".join(" ".join(step) for step in recipe(peer))


def ensure_venv(peer: str, timeout_s: float = 900.0) -> Path:
    """The peer's venv, installed on first use; raises RuntimeError with pip's words if not
    (or if pip runs past ``timeout_s``). It says on stderr what it installs, and where."""
    venv, steps = VENVS / peer, recipe(peer)
    if installed(peer):
        return venv
    print(f"installing {peer} into {venv}: pip install {' ; '.join(' '.join(s) for s in steps)}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for step in steps:
        try:
            done = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", *step], capture_output=True,
                                  text=True, timeout=timeout_s)  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"pip install {' '.join(step)} ran past {timeout_s:.0f} s") from exc
        if done.returncode != 0:
            raise RuntimeError(f"pip install {' '.join(step)} failed: {done.stderr.strip()[-600:]}")
    (venv / ".installed").write_text(_wanted(peer))
    return venv


if __name__ == "__main__":
    for name in sys.argv[1:]:
        ensure_venv(name)
