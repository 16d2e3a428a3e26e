"""The profiler: fitting recovers a known profile; measuring a GPU-free worker recovers its profile."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from perfmodel.piecewise import Piece, PiecewiseLinear
from perfmodel.profile import DEFAULT_PROFILE, CostPieces, Profile, load_profile, t_kv
from planner.profiler import profile_worker
from planner.profiler.fit import fit, report_table
from planner.profiler.measure import (
    KEEPALIVE_S,
    Prompts,
    ShortWindow,
    _decode_point,
    _decode_point_retried,
    _models,
    _Target,
    measure,
)
from planner.profiler.samples import DecodeSample, Grid, Measurements, PrefillSample, TransferSample
from tests.engines import start_sim_worker, stop

TRUE = load_profile(DEFAULT_PROFILE)  # Llama-3.1-8B on one H100 (roofline)
# The profile it measures is held to the worker's own within 15%: on an otherwise idle machine.
pytestmark = pytest.mark.timing


def _linear(unit: str, beta: float, alpha: float = 0.0) -> PiecewiseLinear:
    return PiecewiseLinear(unit=unit, pieces=[Piece(upto=None, alpha=alpha, beta=beta)])


def _known_profile() -> Profile:
    """Costs of the shape a real engine has, with the forward's corner on a grid point:
    flat (weight reads) up to 256 tokens, then compute-bound."""
    beta = 33.7e-6
    forward = PiecewiseLinear(
        unit="tokens",
        pieces=[Piece(upto=256.0, alpha=9.6e-3, beta=0.0), Piece(upto=None, alpha=9.6e-3 - 256 * beta, beta=beta)],
    )
    pieces = CostPieces(
        forward=forward,
        prefill_attention=_linear("query-key pairs", 1.32e-9),
        context_read=_linear("tokens", 4.6e-8),
        kv_transfer=_linear("bytes", 1 / 40e9, alpha=5e-3),
    )
    return TRUE.model_copy(update={"name": "known", "pieces": pieces})


def _synthetic(profile: Profile, grid: Grid) -> Measurements:
    """What a noiseless engine running ``profile`` would measure on ``grid``."""
    prefill = [
        PrefillSample(l_hist=h, l_incr=i, seconds=profile.t_pre(h, i))
        for h in grid.prefill_hist
        for i in grid.prefill_incr
    ]
    decode = [
        DecodeSample(batch=b, context=b * (c + 10), seconds=profile.t_dec(b, b * (c + 10)), prompt_tokens=c)
        for b in grid.decode_batch
        for c in grid.decode_context
    ]
    transfer = [
        TransferSample(tokens=n, seconds=t_kv(n, profile, profile), total_seconds=0.0, recompute_seconds=0.0)
        for n in grid.transfer_tokens
    ]
    return Measurements(
        url="synthetic",
        model_name="m",
        max_model_len=32768,
        speed=1.0,
        prefill=prefill,
        decode=decode,
        transfer=transfer,
    )


def _rel(a: float, b: float) -> float:
    return abs(a - b) / b


@pytest.mark.unit
@pytest.mark.parametrize("monotone", [True, False])
def test_fit_recovers_a_known_profile_exactly(monotone):
    truth = _known_profile()
    measured = _synthetic(truth, Grid())
    fitted, report = fit(
        measured,
        model=truth.model,
        gpu=truth.gpu,
        tp=truth.tp,
        kv_capacity_tokens=1000,
        name="fitted",
        monotone=monotone,
    )
    assert fitted.method == "measured" and fitted.name == "fitted" and fitted.kv_capacity_tokens == 1000
    for piece in report.pieces:
        assert piece.samples > 0 and piece.measured
        assert piece.max_rel_error < 1e-6, piece
    # Off the grid as well as on it.
    for hist, incr in [(0, 100), (300, 700), (5000, 3000), (8192, 16), (20000, 2000)]:
        assert _rel(fitted.t_pre(hist, incr), truth.t_pre(hist, incr)) < 0.02, (hist, incr)
    for batch, context in [(1, 500), (8, 8 * 3000), (32, 32 * 700), (128, 128 * 2000)]:
        assert _rel(fitted.t_dec(batch, context), truth.t_dec(batch, context)) < 0.02, (batch, context)
    for tokens in [100, 2000, 10000, 30000]:
        assert _rel(t_kv(tokens, fitted, fitted), t_kv(tokens, truth, truth)) < 0.02, tokens
    Profile.model_validate_json(fitted.model_dump_json())  # a valid profile file


@pytest.mark.unit
def test_monotone_fit_of_noisy_samples_never_gets_cheaper_with_more_work():
    rng = random.Random(7)
    measured = _synthetic(_known_profile(), Grid())
    noisy = measured.model_copy(
        update={
            "prefill": [s.model_copy(update={"seconds": s.seconds * rng.uniform(0.9, 1.1)}) for s in measured.prefill],
            "decode": [s.model_copy(update={"seconds": s.seconds * rng.uniform(0.9, 1.1)}) for s in measured.decode],
        }
    )
    truth = TRUE
    fitted, report = fit(noisy, model=truth.model, gpu=truth.gpu, tp=1, kv_capacity_tokens=1, name="noisy")
    p = fitted.pieces
    for piece in (p.forward, p.prefill_attention, p.context_read):
        assert all(x.beta >= 0 for x in piece.pieces), piece
    assert p.forward.pieces[0].alpha >= 0
    assert report.piece("forward").max_rel_error < 0.15


@pytest.mark.unit
def test_fit_without_transfer_samples_uses_the_roofline_kv_transfer():
    truth = _known_profile()
    measured = _synthetic(truth, Grid()).model_copy(update={"transfer": []})
    fitted, report = fit(measured, model=truth.model, gpu=truth.gpu, tp=1, kv_capacity_tokens=1, name="x")
    assert not report.piece("kv_transfer").measured
    assert fitted.pieces.kv_transfer == TRUE.pieces.kv_transfer.model_copy(update={"max_rel_error": None})
    assert report_table(report).row_count == 4


# The real thing: a prefill and a decode GPU-free worker serving TRUE. They run at half
# the modelled speed and first tokens are timed by the engine's clock: on a small
# machine the Python HTTP stack adds 3-9 ms per request (client clock), which is a
# large part of an 8B model's 10 ms step and would dominate the comparison. A decode
# window is 24 steps: one stall of the worker's process inside it lengthens the window's
# mean step by the stall over the steps, and over 12 steps a stall of about 40 ms put a
# 16-stream batch 17% off (once, in a clean run of the whole suite on this machine).
# Each decode point is the median of three batches, as each prefill point is of three
# runs: with one batch, a stall inside a 24-step window still put one of the six decode
# points 12% off the fit through the rest (once, in a clean run on a slow day).
SPEED = 0.5
SMALL_GRID = Grid(
    prefill_hist=(0, 1024, 4096),
    prefill_incr=(16, 64, 256, 2048),
    decode_batch=(1, 16, 48),
    decode_context=(256, 1536),
    transfer_tokens=(257, 1025, 4097),
    repeats=3,
    decode_repeats=3,
    steady_tokens=24,
)


@pytest.fixture(scope="module")
def measured_profile(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profiler")
    prefill = start_sim_worker(tmp, "--role", "prefill", "--speed", str(SPEED))
    decode = start_sim_worker(tmp, "--role", "decode", "--speed", str(SPEED))
    out = tmp / "measured.json"
    raw = tmp / "measurements.json"
    started = time.monotonic()
    try:
        profile, report = asyncio.run(
            profile_worker(
                decode.url,
                prefill_url=prefill.url,
                model=TRUE.model,
                gpu=TRUE.gpu,
                tp=TRUE.tp,
                speed=SPEED,
                out_path=out,
                grid=SMALL_GRID,
                clock="engine",
                measurements_out=raw,
            )
        )
    finally:
        stop(prefill)
        stop(decode)
    measurements = Measurements.model_validate_json(raw.read_text())
    return profile, report, out, measurements, time.monotonic() - started


def test_measured_profile_is_written_and_loadable(measured_profile):
    profile, report, out, measurements, _ = measured_profile
    assert load_profile(out) == profile
    assert profile.method == "measured" and profile.name == "measured"
    assert profile.kv_capacity_tokens == pytest.approx(TRUE.kv_capacity_tokens, rel=0.01)
    assert len(measurements.prefill) == 12 and len(measurements.decode) == 6 and len(measurements.transfer) == 3
    # Every prefill got the cache hit it asked for; both clocks were read.
    assert {(s.l_hist, s.l_incr) for s in measurements.prefill} == {
        (h, i) for h in SMALL_GRID.prefill_hist for i in SMALL_GRID.prefill_incr
    }
    assert measurements.api_overhead_seconds is not None and measurements.api_overhead_seconds > 0
    assert report.piece("kv_transfer").samples == len(SMALL_GRID.transfer_tokens)
    # Each piece fits its samples. A loaded machine delays the odd sample (one of twelve was
    # 11.8% off its fit in a CI run); how close the pieces come to the worker's own costs is
    # what the tests below check. The transfer's three points are 10-13 ms pulls, where one
    # late wake-up of a loaded worker by 1 ms is 8-10% of one: each point is the shortest of
    # its repeats (the host only ever lengthens a pull), and its mean is held to 10%.
    for piece in report.pieces:
        mean_bound = 0.1 if piece.piece == "kv_transfer" else 0.05
        assert piece.mean_rel_error < mean_bound and piece.max_rel_error < 0.2, piece


@pytest.mark.parametrize(("hist", "incr"), [(0, 512), (512, 512), (2048, 1024), (2048, 64), (3072, 3000)])
def test_measured_t_pre_matches_the_worker(measured_profile, hist, incr):
    profile = measured_profile[0]
    assert _rel(profile.t_pre(hist, incr), TRUE.t_pre(hist, incr)) < 0.15


@pytest.mark.parametrize(("batch", "context"), [(1, 1024), (4, 4 * 512), (16, 16 * 1024), (24, 24 * 1500)])
def test_measured_t_dec_matches_the_worker(measured_profile, batch, context):
    profile = measured_profile[0]
    assert _rel(profile.t_dec(batch, context), TRUE.t_dec(batch, context)) < 0.15


@pytest.mark.parametrize("tokens", [600, 2049, 4000])
def test_measured_t_kv_matches_the_worker(measured_profile, tokens):
    profile = measured_profile[0]
    # Both workers on this host: the path measured, and priced, is the one within a server.
    assert _rel(t_kv(tokens, profile, profile, True), t_kv(tokens, TRUE, TRUE, True)) < 0.25


def test_a_decode_point_whose_streams_started_apart_is_run_again_with_more_tokens(tmp_path):
    """A loaded client once started a batch's 48 streams so far apart that the first ran
    out of its max_tokens (sized for streams that start together) before the last had its
    window. Here the client holds back the first try's last stream until the point gives up
    on it: the point is run again with twice the tokens, and measures.

    The worker runs at a tenth of the GPU's speed: at half speed its 48 streams' chunks took
    enough of a loaded machine's CPU to stretch its own steps by 10-50%."""
    batch, context, steady, max_tokens, speed = 48, 256, 12, 17, 0.1
    held = 0
    t: _Target

    async def hold_the_last_stream(request: httpx.Request) -> None:
        nonlocal held
        if request.url.path == "/v1/completions" and b'"stream":true' in request.content:
            held += 1
            if held == batch:  # the first try's last stream, until the others ran
                while not await t.busy():
                    await asyncio.sleep(0.05)
                await t.wait_idle()  # ... and ran out

    async def run(url: str) -> tuple[DecodeSample, list[str]]:
        nonlocal t
        said: list[str] = []
        hooks = {"request": [hold_the_last_stream]}
        limits = httpx.Limits(max_connections=64, keepalive_expiry=KEEPALIVE_S)
        async with httpx.AsyncClient(timeout=60, limits=limits, event_hooks=hooks) as client:
            model, max_len = await _models(client, url)
            t = _Target(client, url, model, clock="engine")
            fresh = Prompts(random.Random(0), await t.vocabulary())
            sample = await _decode_point_retried(
                t, fresh, batch, context, steady, max_tokens, max_len - context, said.append
            )
        return sample, said

    worker = start_sim_worker(tmp_path, "--speed", str(speed))
    try:
        sample, said = asyncio.run(run(worker.url))
    finally:
        stop(worker)
    assert held >= 2 * batch and said and said[0].endswith("before the batch was steady; again with max_tokens 34"), (
        said
    )
    assert _rel(sample.seconds * speed, TRUE.t_dec(batch, sample.context)) < 0.05, sample  # a GPU at --speed


def test_a_decode_point_gives_back_every_connection_it_took(tmp_path):
    """A task cancelled while httpx closed a finished stream kept its pooled connection
    (httpcore's shield does not hold against asyncio's own cancel): in CI a profile's
    retried points lost connections try by try until the pool timed out. Here each point's
    streams run out together (3 tokens for a 12-token window), most of them closing as the
    point gives up; the pool keeps one connection beyond the batch alive, and a stream of
    the next point that has to wait for one times out."""
    batch = 48

    async def run(url: str) -> None:
        limits = httpx.Limits(
            max_connections=batch + 1, max_keepalive_connections=batch + 1, keepalive_expiry=KEEPALIVE_S
        )
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, pool=0.05), limits=limits) as client:
            model, _ = await _models(client, url)
            t = _Target(client, url, model, clock="engine")
            ids = await t.vocabulary()
            for k in range(30):
                with pytest.raises(ShortWindow):
                    await _decode_point(t, Prompts(random.Random(k), ids), batch, 256, 12, 3)

    worker = start_sim_worker(tmp_path, "--speed", str(SPEED))
    try:
        asyncio.run(run(worker.url))
    finally:
        stop(worker)


def test_engine_clock_times_decode_steps_for_a_client_starved_of_its_cpu(tmp_path):
    """A client that gets its CPU back only now and then reads a stream's tokens in bursts:
    its arrival slopes came out 17x too fast once on a loaded machine. The engine's clock
    (vllm:inter_token_latency_seconds) does not see the client at all."""
    grid = Grid(prefill_hist=(), prefill_incr=(), decode_batch=(1, 16), decode_context=(1024,),
                transfer_tokens=(), repeats=1, steady_tokens=12)  # fmt: skip

    async def starved(url: str) -> Measurements:
        async def hog() -> None:
            while True:
                time.sleep(0.25)  # blocks the event loop: the client's reads wait
                await asyncio.sleep(0.01)

        task = asyncio.create_task(hog())
        try:
            return await measure(url, grid=grid, speed=SPEED, clock="engine")
        finally:
            task.cancel()

    worker = start_sim_worker(tmp_path, "--speed", str(SPEED))
    try:
        measured = asyncio.run(starved(worker.url))
    finally:
        stop(worker)
    assert [s.batch for s in measured.decode] == [1, 16]
    for s in measured.decode:
        assert _rel(s.seconds, TRUE.t_dec(s.batch, s.context)) < 0.05, s
