"""ampd's KV connector for vLLM: vLLM's NixlConnector, plus split requests (``split_at``).

A split request (DynaServe's micro-requests, rounds.split_point) prefills a prompt's head
on the prefill engine and the rest on the decode engine, which pulls the head's KV. The
gateway sends it as it sends any hand-off: the chat request to the prefill engine with
``kv_transfer_params = surface.wire.prefill_params(split_at)``, and that engine's answer to
the decode engine. vLLM 0.32's NixlConnector (``nixl/pull_scheduler.py``) cannot run it
as it is: the prefill side prefills the whole prompt, and the decode side's
``NixlPullConnectorScheduler.get_num_new_matched_tokens`` claims the whole prompt from the
remote, ignoring ``remote_num_tokens``; it then allocates blocks for all of it, more than
the prefill engine holds, and the worker's ``_apply_prefix_caching``
(``nixl/base_worker.py``) asserts there are enough remote blocks and kills the engine core.
This class changes both ends, through the connector's own hooks (``KVConnectorBase_V1``):

* prefill side, ``on_new_request``: a request with ``do_remote_decode`` and ``split_at``
  keeps only the prompt's first ``split_at`` tokens, exactly as vLLM's own
  ``NixlBaseConnectorScheduler._truncate_request_for_prefill`` drops a Mamba prompt's last
  token (the same fields, at the same point: ``Scheduler.add_request`` calls the hook
  before the request is ever scheduled). vLLM's ``request_finished`` then answers
  ``remote_num_tokens = request.num_computed_tokens``, the head's length, and holds the
  head's blocks;
* decode side, ``get_num_new_matched_tokens``: the tokens claimed from the remote end at
  ``remote_num_tokens``. The scheduler (``vllm/v1/core/sched/scheduler.py``,
  ``Scheduler.schedule``) allocates blocks for the local hit plus that claim only, so the
  blocks to fill are the remote's own count; the worker's ``_apply_prefix_caching``
  end-trims the remote list to them, and both lists end at the same token. After the load
  ``_update_waiting_for_remote_kv`` leaves ``num_computed_tokens`` at the claim (it backs
  off one token only where the claim is the whole prompt), and the scheduler prefills the
  rest locally like any prompt with a cache hit.

An unsplit hand-off is vLLM's, unchanged: ``remote_num_tokens`` is then the whole prompt
and the claim is not capped. Splits run only on models with one full-attention KV cache
group and no speculative decoding (:func:`splittable`): Mamba state, sliding windows and
MTP lookahead tie the KV to where the prompt ends. Elsewhere the prefill side ignores
``split_at``, so the decode side gets a whole prompt's KV as ever. A ``split_at`` that is
not a positive multiple of the block size, or not short of the prompt, is ignored too (the
GPU-free engine answers a 400 instead): the engine core has no way to refuse a request.

vLLM's configuration treats a connector by its class name (``has_connector("NixlConnector")``
in ``vllm/config/vllm.py`` and ``vllm/platforms/cpu.py``), so the class keeps vLLM's name
and is loaded through ``kv_connector_module_path`` (``KVConnectorFactory.get_connector_class``).
What this relies on in vLLM is checked by :func:`check`, run by workers.vllm.step_sizing's.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler, base_worker, pull_scheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MLAAttentionSpec
from vllm.v1.request import Request

from surface.wire import SPLIT_AT

MODULE = "workers.vllm.connector"  # kv_connector_module_path
SPLITTABLE_SPECS = (FullAttentionSpec, MLAAttentionSpec)  # exact types: subclasses window or sink their KV


def splittable(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> bool:
    """Whether a prompt's KV up to any block boundary is all a decode engine needs to go on
    from there: one full-attention group, and no drafter whose lookahead the prefill side
    must leave uncomputed (``NixlBaseConnectorScheduler._prefill_backoff``)."""
    groups = kv_cache_config.kv_cache_groups
    return (
        vllm_config.speculative_config is None
        and len(groups) == 1
        and type(groups[0].kv_cache_spec) in SPLITTABLE_SPECS
    )


def head_length(params: dict[str, Any] | None, num_prompt_tokens: int, block_size: int) -> int | None:
    """The prompt head a prefill-only request computes, or None for the whole prompt."""
    if not params or not params.get("do_remote_decode"):
        return None
    split_at = params.get(SPLIT_AT)
    if not isinstance(split_at, int) or isinstance(split_at, bool) or split_at < 1 or split_at % block_size:
        return None
    return split_at if split_at < num_prompt_tokens else None


def remote_end(params: dict[str, Any] | None, num_prompt_tokens: int) -> int | None:
    """Where a decode request's pull ends: the remote's ``remote_num_tokens`` where that is
    short of the prompt (a split), else None (vLLM's own claim stands)."""
    if not params or not params.get("do_remote_prefill"):
        return None
    held = params.get("remote_num_tokens")
    if not isinstance(held, int) or isinstance(held, bool) or not 0 <= held < num_prompt_tokens:
        return None
    return held


def keep_head(request: Request, length: int) -> None:
    """Cut a request's prompt to its first ``length`` tokens before it is scheduled: the
    fields vLLM's ``_truncate_request_for_prefill`` cuts. The block hashes of the dropped
    tail stay, as they do there: only the first ``num_tokens // block`` are ever read
    (``get_computed_blocks`` caps its hit below ``num_tokens``, ``cache_blocks`` hashes
    the computed full blocks, and the block hasher adds none while it has more than
    the tokens fill)."""
    assert request.prompt_token_ids is not None
    del request.prompt_token_ids[length:]
    del request._all_token_ids[length:]
    request.num_prompt_tokens = length
    request.max_tokens = 1


class NixlConnector(NixlPullConnector):
    """vLLM's NixlConnector (pull mode), running split requests (the module's docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._splits = splittable(vllm_config, kv_cache_config)

    def on_new_request(self, request: Request) -> None:
        super().on_new_request(request)
        if not self._splits or request.prompt_token_ids is None or request.get_skip_reading_prefix_cache():
            return  # prompt logprobs: the whole prompt is read, as vLLM's truncation leaves it
        length = head_length(request.kv_transfer_params, request.num_prompt_tokens, self._block_size)
        if length is not None:
            keep_head(request, length)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        end = remote_end(request.kv_transfer_params, request.num_prompt_tokens) if self._splits else None
        if not count or end is None:
            return count, load_async
        capped = min(count, end - num_computed_tokens)
        return (capped, load_async) if capped > 0 else (0, False)


def _source(owner: object, name: str) -> str:
    """A vLLM function's source, or "" where it is gone or unreadable (then every seam in it is missing)."""
    try:
        return inspect.getsource(getattr(owner, name))
    except (AttributeError, OSError, TypeError):
        return ""


def check() -> list[str]:
    """What of vLLM this connector leans on and the installed vLLM lacks (empty: all there)."""
    missing = []
    hooks = {"on_new_request": ["self", "request"],
             "get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
             "__init__": ["self", "vllm_config", "role", "kv_cache_config"]}  # fmt: skip
    for name, params in hooks.items():
        hook = getattr(NixlPullConnector, name, None)
        if hook is None or list(inspect.signature(hook).parameters) != params:
            missing.append(f"NixlConnector.{name} no longer takes ({', '.join(params[1:])}): ampd's overrides it")
    truncate = _source(base_scheduler.NixlBaseConnectorScheduler, "_truncate_request_for_prefill")
    for line in ("del request.prompt_token_ids[", "del request._all_token_ids[", "request.num_prompt_tokens -=",
                 "request.max_tokens = 1"):  # fmt: skip
        if line not in truncate:
            missing.append(f"vLLM's prefill truncation no longer does `{line}`: keep_head must cut what it cuts")
    seams = (
        (KVConnectorFactory, "get_connector_class", "kv_connector_module_path",
         "KVConnectorFactory no longer loads a connector from kv_connector_module_path"),
        (Scheduler, "add_request", "self.connector.on_new_request(request)",
         "Scheduler.add_request no longer calls the connector's on_new_request"),
        (pull_scheduler.NixlPullConnectorScheduler, "request_finished",
         "remote_num_tokens = request.num_computed_tokens",
         "NixlPullConnectorScheduler.request_finished no longer answers remote_num_tokens as computed"),
        (base_worker.NixlBaseConnectorWorker, "_apply_prefix_caching", "prefill_group[-num_decode_blocks:]",
         "the NIXL worker no longer end-trims the remote blocks to the local ones (_apply_prefix_caching)"),
        (Scheduler, "schedule", "num_new_local_computed_tokens + num_external_computed_tokens",
         "Scheduler.schedule no longer computes a request as its local hit plus the connector's claim"),
        (Scheduler, "_update_waiting_for_remote_kv", "elif request.num_computed_tokens == request.num_tokens:",
         "Scheduler._update_waiting_for_remote_kv no longer keeps a partial load's computed tokens"),
    )  # fmt: skip
    missing += [message for owner, name, line, message in seams if line not in _source(owner, name)]
    request = _source(Request, "__init__")
    missing += [f"Request no longer has {name}" for name in ("prompt_token_ids", "_all_token_ids", "num_prompt_tokens",
                "max_tokens", "kv_transfer_params") if f"self.{name}" not in request]  # fmt: skip
    if not hasattr(Request, "get_skip_reading_prefix_cache"):
        missing.append("Request no longer has get_skip_reading_prefix_cache")
    if "kv_cache_groups" not in getattr(KVCacheConfig, "__dataclass_fields__", {}):
        missing.append("KVCacheConfig no longer has kv_cache_groups")
    return missing
