"""The served model's tokenizer and chat template, published for gateways to count prompts
with (gateway.engines.model_tokenizer), so no round waits for the engine's ``/tokenize``.

The supervisor reads them where vLLM does - the model's folder, or its snapshot in the
Hugging Face cache that vLLM downloaded it into - and writes them to one Redis key per
served model name (surface.registry.publish_tokenizer) before it registers the engine. Where
it cannot know what vLLM counts with, it publishes nothing and gateways keep asking the
engine: a model with no local ``tokenizer.json``, or vLLM started with an argument that
changes the template, the tokenizer or how messages reach the template.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from surface.registry import publish_tokenizer
from workers.vllm.launch import VllmLaunch

log = logging.getLogger(__name__)

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# vLLM arguments after which the files alone no longer say what /tokenize counts.
CHANGING = (
    "--chat-template", "--chat-template-content-format", "--default-chat-template-kwargs", "--tokenizer",
    "--tokenizer-mode", "--revision", "--tokenizer-revision", "--hf-overrides", "--trust-remote-code",
)  # fmt: skip


def model_folder(model: str) -> Path | None:
    """Where the model's files are: its folder, or its snapshot in the Hugging Face cache
    (never downloaded here: vLLM fetched it already)."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=list(FILES), local_files_only=True))
    except Exception:  # not a repo id, or not in the cache: the engine is asked instead
        return None


def read(launch: VllmLaunch) -> dict[str, Any] | None:
    """The files as gateway.engines.model_tokenizer takes them, or None where they would not
    count what the engine counts."""
    if any(arg.split("=", 1)[0] in CHANGING for arg in launch.extra_args):
        return None
    folder = model_folder(launch.model)
    if folder is None or not (folder / "tokenizer.json").is_file():
        return None
    config_path, template_path = folder / "tokenizer_config.json", folder / "chat_template.jinja"
    return {
        "tokenizer": (folder / "tokenizer.json").read_text(),
        "config": json.loads(config_path.read_text()) if config_path.is_file() else {},
        "chat_template": template_path.read_text() if template_path.is_file() else None,
    }


async def publish(redis: aioredis.Redis, prefix: str, launch: VllmLaunch) -> bool:
    """Publish the served model's files for gateways; whether there were any, and they landed."""
    files = read(launch)
    if files is None:
        log.info("%s: prompts are counted by the engine (no tokenizer files to publish)", launch.model_name)
        return False
    return await publish_tokenizer(redis, prefix, launch.model_name, files)
