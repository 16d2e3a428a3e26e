"""ampd's scheduler for vLLM: each step's tokens sized to a step-time target while requests decode.

vLLM gives every step the same token budget (``max_num_batched_tokens``), so a long
prompt's chunk lands beside the running decodes and every stream's next token waits for
it. DynaServe's local scheduler ("DynaServe: Unified and Elastic Execution for Dynamic
Disaggregated LLM Serving", section 4.2, Alg. 2) instead gives a step's prefill only
what the decodes leave under the TBT SLO. This scheduler does that inside vLLM: before
each ``schedule()`` it lowers the step's token budget to what
rounds.engine.step_budget.step_token_budget allows - the function the GPU-free engine
sizes its steps with - priced by the engine's ampd profile; vLLM's own loop then shares
the budget out as ever (running requests first, then admissions). With nothing decoding,
a prefill has the whole budget.

The profile was measured elsewhere, so the scheduler corrects its prices as it runs
(perfmodel.step_correction): each step's time, from the end of ``schedule()`` to vLLM's
``update_from_output()`` for it, against what the profile predicted, and the step's
target is met in corrected seconds.

It is loaded by vLLM's engine core, in vLLM's environment, through ``--scheduler-cls
workers.vllm.step_sizing.step_sized_scheduler`` (``ampd worker vllm --step-target-ms``,
which also puts ampd's packages on its path): :class:`StepSizedScheduler` where vLLM
schedules synchronously (its CPU build), :class:`StepSizedAsyncScheduler` where it
schedules asynchronously (its default on GPUs).
It reads, from the environment:

- ``AMPD_STEP_PROFILE``: the engine's ampd profile (JSON);
- ``AMPD_STEP_TARGET_FILE``: a file holding the target in milliseconds (0: off), read
  again whenever it changes, so a new target needs no restart;
- ``AMPD_STEP_PRICES_FILE``: where it writes its corrections, by step shape, as JSON (at
  most once every PRICES_EVERY_S), for the supervisor to publish in the registry;
- ``AMPD_STEP_LOG``: optionally, a file to which each step that carried decodes appends a
  JSON line (its decodes, budget, scheduled tokens, predicted and measured seconds, and
  the correction its budget was sized with).

vLLM's scheduler interface is not public. What this relies on - ``schedule()`` starting
from ``self.max_num_scheduled_tokens`` as its token budget, ``update_from_output()`` called
with each step's scheduler output, the running list and the waiting queue, a request's
computed and prompt tokens - is checked by :func:`check`
(``python -m workers.vllm.step_sizing``), and the supported vLLM range is
:data:`SUPPORTED_VLLM`.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
import time
from pathlib import Path

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from perfmodel.profile import Profile, load_profile
from perfmodel.step_correction import StepCorrection, shape_of
from rounds.engine.step_budget import step_token_budget

SUPPORTED_VLLM = (">=0.32", "<0.33")
PROFILE_ENV, TARGET_ENV, LOG_ENV = "AMPD_STEP_PROFILE", "AMPD_STEP_TARGET_FILE", "AMPD_STEP_LOG"
PRICES_ENV = "AMPD_STEP_PRICES_FILE"
PRICES_EVERY_S = 1.0
SEAM = "token_budget = self.max_num_scheduled_tokens"  # the line of Scheduler.schedule this leans on


class StepTarget:
    """The target in seconds, from its file, read again when the file changes."""

    def __init__(self, path: Path) -> None:
        self.path, self._stamp, self.seconds = path, (0, 0), 0.0

    def current(self) -> float:
        try:
            stat = self.path.stat()
            stamp = (stat.st_mtime_ns, stat.st_ino)  # a replaced file is a new inode
        except OSError:
            return self.seconds  # a file mid-replace keeps the last target
        if stamp != self._stamp:
            self._stamp = stamp
            text = self.path.read_text().strip()
            self.seconds = max(0.0, float(text)) / 1e3 if text else 0.0
        return self.seconds


class StepSizer:
    """What both scheduler classes add, before vLLM's class in their bases: the budget set
    before vLLM's ``schedule()`` runs and put back after."""

    max_num_scheduled_tokens: int
    running: list[Request]
    waiting: RequestQueue
    requests: dict[str, Request]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._profile: Profile = load_profile(os.environ[PROFILE_ENV])
        self._target = StepTarget(Path(os.environ[TARGET_ENV]))
        self._log = open(os.environ[LOG_ENV], "a", buffering=1) if os.environ.get(LOG_ENV) else None  # noqa: SIM115
        self.correction = StepCorrection()
        self._prices = Path(os.environ[PRICES_ENV]) if os.environ.get(PRICES_ENV) else None
        self._prices_written: tuple[float, dict[str, float]] = (0.0, {})
        self._in_flight: dict[int, tuple[float, dict]] = {}  # by id() of the scheduler output
        self._last_update = 0.0  # when vLLM last folded a step's output back

    def schedule(self, *args, **kwargs):
        target = self._target.current()
        full = self.max_num_scheduled_tokens
        decoding = [r.num_computed_tokens for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        history = self._prefill_context()
        factor = self.correction.factor(shape_of(1, history))  # the budget sizes the step's prefill
        budget = step_token_budget(self._profile, target / factor, decoding, history, full)
        self.max_num_scheduled_tokens = budget
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = full
        if output.total_num_scheduled_tokens:
            step = self._step(output, len(decoding), budget, full, target, factor, history)
            self._in_flight[id(output)] = (time.monotonic(), step)
        return output

    def update_from_output(self, scheduler_output, model_runner_output):
        """The step's measured time: from its scheduling, or from the step before it where
        vLLM schedules ahead (asynchronously), to its output."""
        now = time.monotonic()
        started, step = self._in_flight.pop(id(scheduler_output), (None, None))
        if step is not None:
            step["measured_s"] = now - max(started, self._last_update)
            shape = shape_of(step["prefill_tokens"], step["history"])
            self.correction.observe(shape, step["predicted_s"], step["measured_s"])
            if self._log is not None and step["decodes"]:
                self._log.write(json.dumps(step) + "\n")
        self._last_update = now
        self._publish(now)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _publish(self, now: float) -> None:
        """The corrections for the supervisor, when they changed, at most every PRICES_EVERY_S,
        replaced whole (a reader never sees half a file)."""
        at, written = self._prices_written
        if self._prices is None or now - at < PRICES_EVERY_S:
            return
        factors = self.correction.factors()
        if factors == written:
            return
        staged = self._prices.with_name(f"{self._prices.name}.new")
        staged.write_text(json.dumps(factors))
        os.replace(staged, self._prices)
        self._prices_written = (now, factors)

    def _prefill_context(self) -> int:
        """The history of the prefill this step would carry: the first running request mid-prefill's,
        else the first waiting request's computed tokens (its prefix-cache hits are not known yet)."""
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                return r.num_computed_tokens
        return self.waiting.peek_request().num_computed_tokens if self.waiting else 0

    def _step(self, output, decodes: int, budget: int, full: int, target: float, factor: float, history: int) -> dict:
        """The step as scheduled (vLLM has advanced each request's computed tokens by its
        share) and the profile's uncorrected price of it."""
        before = {rid: (self.requests[rid], self.requests[rid].num_computed_tokens - n)
                  for rid, n in output.num_scheduled_tokens.items()}  # fmt: skip
        prefills = [(hist, output.num_scheduled_tokens[rid]) for rid, (r, hist) in before.items()
                    if hist < r.num_prompt_tokens]  # fmt: skip
        contexts = [hist for r, hist in before.values() if hist >= r.num_prompt_tokens]
        return {"t": time.time(), "decodes": decodes, "budget": budget, "full": full, "target_s": target,
                "scheduled": output.total_num_scheduled_tokens, "prefill_tokens": sum(n for _, n in prefills),
                "predicted_s": self._profile.step_time(prefills, contexts), "factor": factor,
                "history": history}  # fmt: skip


class StepSizedScheduler(StepSizer, Scheduler):
    """vLLM's synchronous scheduler with ampd's step sizing."""


class StepSizedAsyncScheduler(StepSizer, AsyncScheduler):
    """vLLM's asynchronous scheduler (its default where async scheduling applies) with ampd's step sizing."""


def step_sized_scheduler(*args, **kwargs) -> Scheduler:
    """What ``--scheduler-cls`` names: vLLM settles whether it schedules asynchronously only
    after its platform has had its say, so the variant is chosen here, from the final config."""
    asynchronous = kwargs["vllm_config"].scheduler_config.async_scheduling
    return (StepSizedAsyncScheduler if asynchronous else StepSizedScheduler)(*args, **kwargs)


def check() -> list[str]:
    """What of vLLM's scheduler this module, and ampd's KV connector (workers.vllm.connector),
    lean on and the installed vLLM lacks (empty: all there)."""
    import vllm
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
    from vllm.v1.engine.core import EngineCore

    missing = []
    version = Version(vllm.__version__.split("+")[0])
    if version not in SpecifierSet(",".join(SUPPORTED_VLLM)):
        missing.append(f"vLLM {vllm.__version__} is outside ampd's supported range {','.join(SUPPORTED_VLLM)}")
    if "get_scheduler_cls()" not in inspect.getsource(EngineCore.__init__):
        missing.append("EngineCore no longer builds its scheduler from scheduler_config.get_scheduler_cls()")
    if SEAM not in inspect.getsource(Scheduler.schedule):
        missing.append(f"Scheduler.schedule no longer starts from `{SEAM}`: the step's budget cannot be set")
    if list(inspect.signature(Scheduler.update_from_output).parameters)[1:] != [
        "scheduler_output",
        "model_runner_output",
    ]:
        missing.append("Scheduler.update_from_output no longer takes (scheduler_output, model_runner_output)")
    init = inspect.getsource(Scheduler.__init__)
    missing += [f"Scheduler.__init__ no longer sets self.{name}" for name in ("max_num_scheduled_tokens", "running",
                "waiting", "requests") if not re.search(rf"self\.{name}\b[^=\n]*=", init)]  # fmt: skip
    request = inspect.getsource(Request.__init__)
    missing += [f"Request no longer has {name}" for name in ("num_computed_tokens", "num_prompt_tokens")
                if f"self.{name}" not in request]  # fmt: skip
    if not issubclass(AsyncScheduler, Scheduler):
        missing.append("AsyncScheduler is no longer a Scheduler")
    from workers.vllm import connector  # ampd's KV connector travels in the same folder of packages

    return missing + [f"connector: {problem}" for problem in connector.check()]


if __name__ == "__main__":
    problems = check()
    for problem in problems:
        print(f"ampd's vLLM scheduler and connector: {problem}", file=sys.stderr)
    sys.exit(1 if problems else 0)
