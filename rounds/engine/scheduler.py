"""The engine core's scheduler: a pure state machine, stepped by its caller's clock.

Modelled on vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py): continuous
batching under a per-step token budget (``max_num_batched_tokens``) with chunked
prefill, at most ``max_num_seqs`` running requests, paged KV with prefix caching
(rounds.engine.kv_cache), and recompute preemption when the cache runs out.

A step schedules as vLLM 0.32's does (``Scheduler.schedule`` in
vllm/v1/core/sched/scheduler.py): first the running requests in the order they were
admitted - a decode takes its one token, a request mid-prefill its next chunk - then
admissions from the waiting queue, in order, while budget remains. So a local
incremental prefill runs in the same step as the decodes of the engine it lands on and
lengthens it (AMPD, "Efficient Multi-round LLM Inference over Disaggregated Serving",
section 3, footnote 3: the prefill is not deferred behind decoding), and a prompt longer
than what the decodes leave of the budget is chunked, as on vLLM.

The caller drives it::

    step = scheduler.schedule(now)          # what runs, and how long it takes (profile)
    ... wait step.duration (real or virtual) ...
    outputs = scheduler.finish_step(step, now)

A caller in virtual time (planner.simulator) may ask for up to ``max_decode_steps``
steps at once. They are fused only when nothing else could change them - every
request decoding, nothing admissible waiting - and no request can finish before the
last one, so the fused step equals that many single steps (vLLM's multi-step
scheduling did the same, with look-ahead KV slots). If work arrives meanwhile, the
caller asks at the sub-step boundary where a real engine would next have scheduled:
requests that only wait there for their prompt's KV join without changing the batch, so
the step goes on (:meth:`admit_during`); anything else cuts the step there (:meth:`cut`).
:meth:`kv_usage` reads the usage mid-step without cutting.

Disaggregated prefill follows vLLM's NixlConnector: a ``do_remote_decode`` request
keeps its blocks after finishing until the decoder has read them
(:meth:`release_transfer`) or the hold expires; a request with ``remote_prefill``
allocates blocks for the prompt tokens it has no cache hit for, waits in
WAITING_FOR_REMOTE_KVS while the caller pulls them (:attr:`Step.kv_loads`), and
after :meth:`finish_kv_load` recomputes only its last prompt token. A split request
(DynaServe's micro-requests: the remote engine computed only the first s prompt
tokens, ``RemotePrefill.num_tokens``) pulls those and prefills the rest itself.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field, replace

from perfmodel.profile import Profile
from rounds.engine.kv_cache import BlockHasher, KVCache, extend_block_hashes
from rounds.engine.request import Request, RequestStatus
from rounds.engine.step_budget import prefill_within_target


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    num_blocks: int = 0  # 0: from the profile's KV capacity
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0  # vLLM's: a request prefills at most this many tokens a step; 0 = no cap
    step_target_s: float = 0.0  # while requests decode, prefill only what keeps a step this short; 0 = off
    enable_prefix_caching: bool = True
    transfer_hold_s: float = 480.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT


@dataclass(frozen=True)
class KVLoad:
    """Blocks to pull from a remote prefill engine into this engine's ``local_block_ids``."""

    request: Request
    local_block_ids: list[int]
    remote_block_ids: list[int]
    first_token: int  # position in the prompt of the first token pulled
    end_token: int  # ... and of the first one not pulled (the prompt's end, or a split's point)

    @property
    def num_tokens(self) -> int:
        return max(0, self.end_token - self.first_token)


@dataclass(slots=True)
class Step:
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens)
    decodes: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)
    duration: float = 0.0
    boundaries: list[float] = field(default_factory=list)  # fused steps: end of each, from the start

    @property
    def num_steps(self) -> int:
        return len(self.boundaries) or 1

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes) * self.num_steps

    def truncate(self, elapsed: float) -> None:
        """Keep the fused sub-steps up to the first one ending at or after ``elapsed``."""
        del self.boundaries[bisect_left(self.boundaries, elapsed) + 1 :]
        self.duration = self.boundaries[-1] if self.boundaries else self.duration

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


@dataclass(slots=True)
class RequestOutput:
    request: Request
    new_token_ids: list[int]
    finished: bool
    held_block_ids: tuple[int, ...] = ()  # prefill-only: blocks kept for the remote decoder


@dataclass
class _Hold:
    block_ids: list[int]
    token_ids: list[int]  # those whose KV the blocks hold: the prompt, and any output but the last token
    expires_at: float


class Scheduler:
    def __init__(
        self,
        profile: Profile,
        config: SchedulerConfig = SchedulerConfig(),
        hasher: BlockHasher = extend_block_hashes,
        record_kv_events: bool = False,
    ) -> None:
        """``hasher`` and ``record_kv_events`` go to the KV cache (rounds.engine.kv_cache):
        the GPU-free engine hashes blocks as vLLM does and publishes what the cache records."""
        num_blocks = config.num_blocks or profile.kv_capacity_tokens // config.block_size
        self.profile = profile
        self.config = config
        self.kv = KVCache(num_blocks, config.block_size, config.enable_prefix_caching, hasher, record_kv_events)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.held: dict[str, _Hold] = {}
        self._next_expiry = float("inf")  # no hold expires before this: schedule() scans only then
        self.num_preemptions = 0
        self.num_expired_holds = 0

    def keep_steps_to(self, target_s: float) -> None:
        """A step target assigned while the engine runs (surface.registry.follow_step_target):
        the next step is sized to it, as vLLM's engine takes one under ampd's scheduler."""
        self.config = replace(self.config, step_target_s=target_s)

    # -- intake ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        if self.kv.blocks_for(request.num_prompt_tokens + 1) > self.kv.num_blocks:
            raise ValueError(
                f"a prompt of {request.num_prompt_tokens} tokens is larger than the whole KV cache "
                f"({self.kv.num_blocks} blocks of {self.kv.block_size} tokens)"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free(request)
        request.status = RequestStatus.FINISHED_ABORTED
        return request

    @property
    def has_work(self) -> bool:
        return bool(self.running) or any(r.status != RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.waiting)

    # -- one step ----------------------------------------------------------------
    def schedule(self, now: float, max_decode_steps: int = 1) -> Step:
        if now >= self._next_expiry:
            self._expire_holds(now)
        step = Step()
        if not self.has_work:
            return step
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        decoding = (
            [r.num_computed_tokens for r in self.running if r.is_decoding] if self.config.step_target_s > 0 else []
        )  # the contexts a step's prefills are sized around (SLO-aware batching)

        # 1. The running requests, in the order they were admitted: a decode's token, or the
        #    next chunk of a request mid-prefill ...
        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if request.is_decoding:
                if self._reserve(request, 1, step, scheduled):
                    step.decodes.append(request)
                    scheduled.add(request.request_id)
                    budget -= 1
                continue
            n = self._chunk(request.num_tokens - request.num_computed_tokens, budget,
                            step, request.num_computed_tokens, decoding)  # fmt: skip
            if n == 0:
                continue
            if self._reserve(request, n, step, scheduled):
                step.prefills.append((request, n))
                scheduled.add(request.request_id)
                budget -= n

        # 2. ... then admissions from the waiting queue, in order.
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(self.waiting.popleft())
                continue
            n = self._admit(request, budget, step, decoding)
            if n is None:
                break
            self.waiting.popleft()
            if n == 0:  # parked until its remote KV arrives
                skipped.append(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.prefills.append((request, n))
            scheduled.add(request.request_id)
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        step.duration = self.profile.step_time(
            prefills=[(r.num_computed_tokens, n) for r, n in step.prefills],
            decode_contexts=[r.num_computed_tokens for r in step.decodes],
        )
        if max_decode_steps > 1 and self._fusable(step):
            self._fuse(step, max_decode_steps)
        return step

    def _fusable(self, step: Step) -> bool:
        return (
            bool(step.decodes)
            and not step.prefills
            and not step.preempted
            and len(step.decodes) == len(self.running)
            and all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.waiting)
        )

    def _fuse(self, step: Step, max_steps: int) -> None:
        """Extend a decode-only step to k sub-steps, KV permitting (see the module docstring).

        The blocks of later sub-steps are taken only when the step is cut or finished
        (:meth:`cut`): taking them now would evict cached prefixes and raise the KV
        usage a scrape sees earlier than k single steps would.
        """
        k = min(max_steps, *(r.remaining_output_tokens for r in step.decodes))
        if k < 2 or not self.kv.can_allocate(self._fused_blocks(step, k)):
            return
        context = sum(r.num_computed_tokens for r in step.decodes)
        step.boundaries = self.profile.decode_steps(len(step.decodes), context, k)
        step.duration = step.boundaries[-1]

    def _fused_blocks(self, step: Step, k: int) -> int:
        """Blocks the decodes of ``step`` still need to run ``k`` sub-steps."""
        return sum(max(0, self._blocks_short(r, k)) for r in step.decodes)

    def kv_usage(self, step: Step | None = None, elapsed: float = 0.0) -> float:
        """KV usage as a scrape sees it; ``elapsed`` seconds into a fused ``step``, as if the
        sub-steps begun by then had taken their blocks (what :meth:`cut` would settle)."""
        used = self.kv.num_blocks - self.kv.num_free_blocks
        if step is not None and step.num_steps > 1:
            begun = min(bisect_left(step.boundaries, elapsed) + 1, step.num_steps)
            used += self._fused_blocks(step, begun)
        return used / self.kv.num_blocks

    def cut(self, step: Step, elapsed: float) -> None:
        """Settle a fused step ``elapsed`` seconds after it started: keep the sub-steps a
        real engine would have begun by then, and take their blocks as it would have."""
        step.truncate(elapsed)
        self._take_fused_blocks(step, step.num_steps)

    def _take_fused_blocks(self, step: Step, k: int) -> None:
        """The blocks of the first ``k`` sub-steps of a fused ``step``, as single steps would have taken them."""
        for request in step.decodes:
            needed = self._blocks_short(request, k)
            if needed > 0:  # _fuse checked the cache could give this many, admit_during after what it admitted
                request.block_ids += self.kv.allocate(needed)

    def admit_during(self, step: Step, elapsed: float, now: float) -> tuple[list[KVLoad], bool]:
        """At the sub-step boundary of a fused ``step`` where a real engine would next schedule
        (the first ending at or after ``elapsed``; ``now`` is that time), admit what waits
        there - provided it is only requests whose prompt KV is to be pulled - and let the
        step go on: :meth:`schedule` at that boundary would park them for their pulls and
        give the decodes the same batch again. Returns the pulls begun, and whether the step
        goes on.

        It does not where the batch would change there: a request to prefill here or one the
        cache cannot take yet, decodes whose next sub-steps would no longer find their
        blocks, or the step ends at that boundary anyway. What was done by then (holds
        expired, the decodes' blocks, the pulls of requests admitted before the one that
        could not be) is what that boundary's schedule would do first too; the caller cuts
        the step there and schedules the next.
        """
        parked = Step()
        i = bisect_left(step.boundaries, elapsed)
        if i >= len(step.boundaries) - 1:
            return parked.kv_loads, False
        if now >= self._next_expiry:
            self._expire_holds(now)
        self._take_fused_blocks(step, i + 1)
        if len(self.running) >= self.config.max_num_seqs:
            return parked.kv_loads, False
        for request in self.waiting:
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            if request.remote_prefill is None or not self._first_admission(request):
                return parked.kv_loads, False
            if self._admit(request, self.config.max_num_batched_tokens, parked, []) is None:
                return parked.kv_loads, False
        return parked.kv_loads, self.kv.can_allocate(self._fused_blocks(step, len(step.boundaries)))

    def finish_step(self, step: Step, now: float) -> list[RequestOutput]:
        """Apply a step's results: advance progress, sample planned tokens, finish."""
        if len(step.boundaries) > 1:  # fused: take the blocks of its later sub-steps
            self.cut(step, step.duration)
        outputs: list[RequestOutput] = []
        for request, n in step.prefills:
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += n
            self._cache_computed_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a chunk of a longer prefill: nothing sampled yet
            self._sampled(request, request.append_planned(1), now, outputs)
        k, block_size = step.num_steps, self.kv.block_size
        for request in step.decodes:  # each computes its last token, then samples, k times
            if request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += k
            tokens = request.append_planned(k)  # a fused step never ends a request early
            if request.num_computed_tokens // block_size > request.num_cached_blocks:  # a block filled up
                self._cache_computed_blocks(request)
            self._sampled(request, tokens, now, outputs)
        return outputs

    def _sampled(self, request: Request, tokens: list[int], now: float, outputs: list[RequestOutput]) -> None:
        status = request.stop_status()
        if status is None:
            outputs.append(RequestOutput(request, tokens, finished=False))
        else:
            outputs.append(self._finish(request, status, tokens, now))

    # -- disaggregation ----------------------------------------------------------
    def finish_kv_load(self, request_id: str, ok: bool) -> None:
        """The caller pulled (or failed to pull) a request's remote KV."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return
        request.status = RequestStatus.WAITING
        if ok:
            # The pulled KV is here. A whole prompt's last token is recomputed to sample from;
            # a split request prefills the rest of its prompt here, as any admitted request.
            assert request.remote_prefill is not None
            pulled = min(request.remote_prefill.covers(request.num_prompt_tokens), request.num_prompt_tokens - 1)
            request.num_computed_tokens = max(request.num_computed_tokens, pulled)
            self._cache_computed_blocks(request)
        # On failure the blocks stay allocated and the missing tokens are prefilled
        # locally (vLLM's "recompute" load-failure policy).

    def release_transfer(self, request_id: str) -> bool:
        """The remote decoder has read these blocks: free them."""
        hold = self.held.pop(request_id, None)
        if hold is None:
            return False
        self.kv.free(hold.block_ids)
        return True

    def read_held(self, request_id: str, block_ids: list[int]) -> list[list[int]] | None:
        """The token ids each requested held block stores (the sim's stand-in for KV).

        None if the request holds no blocks (never existed, already read, expired) or
        a block id is not one of its blocks.
        """
        hold = self.held.get(request_id)
        if hold is None:
            return None
        size = self.kv.block_size
        position = {b: i for i, b in enumerate(hold.block_ids)}
        if any(b not in position for b in block_ids):
            return None
        return [hold.token_ids[position[b] * size : (position[b] + 1) * size] for b in block_ids]

    # -- internals ---------------------------------------------------------------
    def _chunk(self, remaining: int, budget: int, step: Step, context: int, decoding: list[int]) -> int:
        """A prefill's tokens this step: what is left, within the budget, vLLM's per-request
        cap and, while requests decode, the step-time target (:meth:`_within_target`)."""
        cap = self.config.long_prefill_token_threshold
        n = min(remaining, budget, cap) if cap > 0 else min(remaining, budget)
        return self._within_target(step, context, n, decoding) if decoding else n

    def _within_target(self, step: Step, context: int, n: int, decoding: list[int]) -> int:
        """At most ``n`` prefill tokens at ``context`` that keep the step - the prefills chosen
        so far and every decoding request - within ``step_target_s`` (rounds.engine.step_budget,
        the function ampd's scheduler inside vLLM calls too)."""
        chosen = [(r.num_computed_tokens, k) for r, k in step.prefills]
        return prefill_within_target(self.profile, self.config.step_target_s, decoding, chosen, context, n)

    def _admit(self, request: Request, budget: int, step: Step, decoding: list[int]) -> int | None:
        """Take cache hits and blocks for a waiting request.

        Returns the tokens to prefill this step, 0 if it now waits for remote KV, or
        None if the cache cannot take it yet (admission never preempts) or the step has
        no room left for it under its time target.
        """
        first_admission = self._first_admission(request)
        if first_admission:
            self.kv.hash_blocks(request.block_hashes, request.token_ids, request.cache_salt)
            hits = self.kv.find_cached_prefix(request.block_hashes, request.num_tokens)
        else:  # a failed remote load keeps its blocks and resumes its prefill
            hits = []
        hit_tokens = len(hits) * self.kv.block_size

        if request.remote_prefill is not None and first_admission:
            end = request.remote_prefill.covers(request.num_prompt_tokens)
            needed = max(0, self.kv.blocks_for(end) - len(hits))
            if not self.kv.can_allocate(needed, hits):
                return None
            self._take(request, hits)
            new_blocks = self.kv.allocate(needed)
            request.block_ids += new_blocks
            request.num_computed_tokens = hit_tokens
            remote = list(request.remote_prefill.block_ids)
            step.kv_loads.append(KVLoad(request, new_blocks, remote[len(remote) - needed :], hit_tokens, end))
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return 0

        context = request.num_computed_tokens + hit_tokens
        n = self._chunk(request.num_tokens - context, budget, step, context, decoding)
        if n == 0:
            return None
        total = context + n
        needed = max(0, self.kv.blocks_for(total) - len(request.block_ids) - len(hits))
        if not self.kv.can_allocate(needed, hits):
            return None
        if first_admission:
            self._take(request, hits)
            request.num_computed_tokens = hit_tokens
        request.block_ids += self.kv.allocate(needed)
        return n

    @staticmethod
    def _first_admission(request: Request) -> bool:
        """Never admitted yet: a failed remote load keeps its blocks and resumes instead."""
        return request.num_computed_tokens == 0 and not request.block_ids

    def _blocks_short(self, request: Request, tokens: int) -> int:
        """Blocks ``request`` lacks to compute ``tokens`` more tokens (0 or less: none)."""
        return self.kv.blocks_for(request.num_computed_tokens + tokens) - len(request.block_ids)

    def _take(self, request: Request, hits: list[int]) -> None:
        self.kv.touch(hits)
        request.block_ids = list(hits)
        request.num_cached_blocks = len(hits)
        hit_tokens = len(hits) * self.kv.block_size
        if request.num_preemptions == 0:
            request.num_cached_tokens = hit_tokens
            self.kv.record_query(request.num_tokens, hit_tokens)

    def _reserve(self, request: Request, n: int, step: Step, scheduled: set[str]) -> bool:
        """Blocks for ``n`` more tokens of a running request, preempting if needed.

        Victims come from the tail of the running list (the most recently admitted)
        and are never requests already scheduled in this step. Returns False if the
        request itself had to be preempted.
        """
        needed = self._blocks_short(request, n)
        if needed <= 0:  # the common case (a decode inside its last block): nothing to take
            return True
        while not self.kv.can_allocate(needed):
            victim = next(
                (r for r in reversed(self.running) if r.request_id not in scheduled and r is not request),
                request,
            )
            self._preempt(victim, step)
            if victim is request:
                return False
        request.block_ids += self.kv.allocate(needed)
        return True

    def _preempt(self, request: Request, step: Step) -> None:
        self.running.remove(request)
        self._free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        step.preempted.append(request)

    def _cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's newly completed full blocks in the prefix cache."""
        full = request.num_computed_tokens // self.kv.block_size
        if full <= request.num_cached_blocks:
            return
        self.kv.hash_blocks(request.block_hashes, request.token_ids, request.cache_salt)
        start = request.num_cached_blocks
        self.kv.cache_full_blocks(
            request.block_ids, request.block_hashes, start, full, request.token_ids, request.cache_salt
        )
        request.num_cached_blocks = full

    def _finish(self, request: Request, status: RequestStatus, tokens: list[int], now: float) -> RequestOutput:
        request.status = status
        self.running.remove(request)
        self.requests.pop(request.request_id, None)
        if request.do_remote_decode:
            computed = request.token_ids[: request.num_computed_tokens]
            expires_at = now + self.config.transfer_hold_s
            self.held[request.request_id] = _Hold(request.block_ids, computed, expires_at)
            self._next_expiry = min(self._next_expiry, expires_at)
            held = tuple(request.block_ids)
            request.block_ids = []
            return RequestOutput(request, tokens, finished=True, held_block_ids=held)
        self._free(request)
        return RequestOutput(request, tokens, finished=True)

    def _free(self, request: Request) -> None:
        if request.block_ids:
            self.kv.free(request.block_ids)
            request.block_ids = []
        request.num_cached_blocks = 0

    def _expire_holds(self, now: float) -> None:
        for request_id in [k for k, h in self.held.items() if h.expires_at <= now]:
            self.release_transfer(request_id)
            self.num_expired_holds += 1
        self._next_expiry = min((h.expires_at for h in self.held.values()), default=float("inf"))
