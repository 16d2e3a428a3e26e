"""The profiler: measure a running engine (measure), fit its profile (fit), write it.

``ampd profile --worker URL`` runs :func:`profile_worker`.
"""

from __future__ import annotations

from pathlib import Path

from perfmodel.memory import MemoryPlan
from perfmodel.memory import kv_capacity_tokens as modelled_kv_capacity
from perfmodel.profile import Profile
from perfmodel.specs import GPUSpec, ModelSpec
from planner.profiler.fit import FitReport, fit
from planner.profiler.measure import Progress, measure
from planner.profiler.samples import DEFAULT_GRID, Clock, Grid


async def profile_worker(
    url: str,
    *,
    prefill_url: str | None = None,
    model: ModelSpec,
    gpu: GPUSpec,
    tp: int = 1,
    speed: float = 1.0,
    out_path: Path,
    grid: Grid = DEFAULT_GRID,
    progress: Progress | None = None,
    clock: Clock = "client",
    measurements_out: Path | None = None,
) -> tuple[Profile, FitReport]:
    """Measure the engine at ``url``, fit a profile, and write it to ``out_path``.

    The engine speaks vLLM's OpenAI HTTP API (vLLM, or ``ampd worker sim``) and should
    serve nothing else while it is measured. Options:

    * ``prefill_url``: a prefill worker (NIXL kv_producer) of the same model and TP;
      with it the KV hand-off into ``url`` is timed and kv_transfer fitted, without it
      kv_transfer is the roofline's for ``gpu``;
    * ``model``, ``gpu``, ``tp``: what the engine runs (they go into the profile and give
      the bytes of KV per token, so T_kv is fitted on bytes per link);
    * ``speed``: how many times faster than the modelled GPU the engine runs (a GPU-free
      worker's ``--speed``; 1 for real hardware);
    * ``out_path``: the profile file; its stem is the profile's name (so
      ``planner/profiles/<name>.json`` is loadable by name);
    * ``grid``: the sample points (:class:`Grid`);
    * ``progress``: called with one line per measured point;
    * ``clock``: ``"client"`` (default) times first tokens at the client, so HTTP and
      API-server overhead becomes part of the fitted constants; ``"engine"`` uses the
      engine's own TTFT histogram instead (vLLM and the GPU-free engine export it);
    * ``measurements_out``: also write the raw samples there (JSON).

    The KV capacity is the engine's own (``vllm:cache_config_info``, or probed through
    ``vllm:kv_cache_usage_perc``), else the memory model's estimate. Returns the profile
    and the fit's report (see :func:`report_table`).
    """
    m = await measure(url, prefill_url=prefill_url, grid=grid, speed=speed, progress=progress, clock=clock)
    if measurements_out is not None:
        measurements_out.write_text(m.model_dump_json(indent=2) + "\n")
    capacity = m.kv_capacity_tokens
    if capacity is None:
        capacity = modelled_kv_capacity(model, gpu, tp, MemoryPlan())
        m = m.model_copy(update={"kv_capacity_source": "perfmodel.memory's estimate (the engine reported none)"})
    profile, report = fit(m, model=model, gpu=gpu, tp=tp, kv_capacity_tokens=capacity, name=out_path.stem)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    profile.dump(out_path)
    return profile, report
