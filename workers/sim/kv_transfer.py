"""The KV side channel between GPU-free engines: vLLM's NIXL hand-off, over HTTP.

vLLM's NixlConnector (vllm/distributed/kv_transfer/kv_connector/v1/nixl/) has the
decode engine handshake once with each prefill engine on its side channel (engine
id, block size, layout), then READ the blocks it lacks and notify the prefill engine,
which frees them. Here the handshake returns the peer's profile too, so the puller
can charge T_kv for the pair (perfmodel.profile.t_kv), and a read both returns the
blocks' contents (their token ids) and counts as the notification.

Routes (served by every sim worker, under its HTTP port, which it advertises as
``remote_port`` in ``kv_transfer_params``):

* ``GET  /kv/handshake`` -> ``{"engine_id", "block_size", "profile", "node"}``
* ``POST /kv/read`` ``{"request_id", "block_ids"}`` -> ``{"blocks": [[token ids], ...]}``
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from perfmodel.profile import Profile


class TransferError(Exception):
    """The remote engine could not hand over the requested blocks."""


@dataclass(frozen=True)
class Peer:
    engine_id: str
    base_url: str
    block_size: int
    profile: Profile
    node: str = ""  # the server it runs on


class KVSideChannel:
    def __init__(self, timeout_s: float = 10.0) -> None:
        self._client = httpx.AsyncClient(timeout=timeout_s)
        self._peers: dict[tuple[str, int], Peer] = {}

    async def close(self) -> None:
        await self._client.aclose()

    async def handshake(self, host: str, port: int, engine_id: str) -> Peer:
        peer = self._peers.get((host, port))
        if peer is not None and peer.engine_id == engine_id:
            return peer
        base_url = f"http://{host}:{port}"
        try:
            response = await self._client.get(f"{base_url}/kv/handshake")
        except httpx.HTTPError as exc:
            raise TransferError(f"handshake with {base_url} failed: {exc!r}") from exc
        if response.status_code != 200:
            raise TransferError(f"handshake with {base_url} failed: HTTP {response.status_code}")
        meta = response.json()
        if meta["engine_id"] != engine_id:
            raise TransferError(f"{base_url} is engine {meta['engine_id']}, not {engine_id}")
        peer = Peer(
            engine_id, base_url, meta["block_size"], Profile.model_validate(meta["profile"]), meta.get("node", "")
        )
        self._peers[(host, port)] = peer
        return peer

    async def read(self, peer: Peer, request_id: str, block_ids: list[int]) -> list[list[int]]:
        try:
            response = await self._client.post(
                f"{peer.base_url}/kv/read", json={"request_id": request_id, "block_ids": block_ids}
            )
        except httpx.HTTPError as exc:
            raise TransferError(f"read of {request_id} from {peer.base_url} failed: {exc!r}") from exc
        if response.status_code != 200:
            raise TransferError(f"read of {request_id} from {peer.base_url}: HTTP {response.status_code}")
        return response.json()["blocks"]
