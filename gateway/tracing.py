"""Per-round tracing with OpenTelemetry: a span per session, one per round, and the phases.

A session's span is recorded when the session is created and its ids are kept with the
session, so every later round - on any gateway replica - becomes its child in the same
trace. A round's span has four children: ``queue_wait`` (in the chosen worker's prefill
queue), ``prefill`` (on the prefill worker; for a local round, on the decode worker
until its first token), ``kv_transfer`` (remote rounds: the decode worker pulling the
KV and recomputing the last token, until the first token) and ``decode`` (first token
to last). Times are the gateway's own measurements, passed in explicitly, so spans are
built after the fact and never sit across an ``await``.

Without an exporter configured, the global tracer provider is OpenTelemetry's no-op
one: nothing is recorded, and no span is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from rounds.core import RoundRecord

Attributes = Mapping[str, str | int | float | bool]


@dataclass
class RoundTimes:
    """When a round's phases happened (wall clock), as the gateway saw them."""

    queued_at: float
    queued_s: float = 0.0  # the queue's own measure, enqueue to dispatch
    dispatched_at: float = 0.0
    prefilled_at: float | None = None  # remote rounds: the prefill worker answered
    decode_sent_at: float = 0.0


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def configure_otlp(endpoint: str, service: str = "ampd-gateway") -> None:
    """Export spans over OTLP/HTTP to ``endpoint`` (an OpenTelemetry collector)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces")))
    trace.set_tracer_provider(provider)


class RoundTracer:
    def __init__(self) -> None:
        self.tracer = trace.get_tracer("ampd.gateway")

    @staticmethod
    def recording() -> bool:
        """Whether a tracer provider is set. Until one is, every span is OpenTelemetry's no-op
        one, and building a round's six of them for nothing took 70 Python calls a round."""
        return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)

    def session(self, session_id: str, scope: str, start: float, end: float) -> tuple[str, str]:
        """Record a new session's span; returns its (trace id, span id) in hex to keep with it,
        empty while nothing records."""
        if not self.recording():
            return "", ""
        span = self.tracer.start_span(
            "session", start_time=_ns(start), attributes={"ampd.session.id": session_id, "ampd.scope": scope}
        )
        span.end(end_time=_ns(end))
        context = span.get_span_context()
        if not context.is_valid:
            return "", ""
        return f"{context.trace_id:032x}", f"{context.span_id:016x}"

    def round(self, parent: tuple[str, str], record: RoundRecord, times: RoundTimes, first: float, end: float) -> None:
        """A round's span under its session's, its phases as children: ``first`` and ``end``
        are its first and last token."""
        if not self.recording():
            return
        worker = record.prefill_worker if record.route == "remote" else record.decode_worker
        prefill = {"ampd.route": record.route, "ampd.worker": worker or "", "ampd.l_hist": record.l_hist,
                   "ampd.l_incr": record.l_incr}  # fmt: skip
        phases = [("queue_wait", times.queued_at, times.dispatched_at, {"ampd.worker": record.queued_on})]
        if record.route == "remote" and times.prefilled_at is not None:
            phases.append(("prefill", times.dispatched_at, times.prefilled_at, prefill))
            transfer = {"ampd.from": worker or "", "ampd.to": record.decode_worker}
            phases.append(("kv_transfer", times.decode_sent_at, first, transfer))
        else:
            phases.append(("prefill", times.decode_sent_at, first, prefill))
        decode = {"ampd.worker": record.decode_worker, "ampd.tokens": record.completion_tokens,
                  "ampd.ttft_s": record.ttft_s or 0.0, "ampd.itl_mean_s": record.mean_itl_s or 0.0,
                  "ampd.itl_p95_s": record.p95_itl_s or 0.0}  # fmt: skip
        phases.append(("decode", first, end, decode))
        attributes = {"ampd.session.id": record.session_id, "ampd.round": record.round, "ampd.kind": record.kind,
                      "ampd.route": record.route, "ampd.reason": record.reason}  # fmt: skip
        span = self.tracer.start_span(
            "round", context=_parent(parent), start_time=_ns(record.started_at), attributes=attributes
        )
        inside = trace.set_span_in_context(span)
        for name, begin, finish, attrs in phases:
            self.tracer.start_span(name, context=inside, start_time=_ns(begin), attributes=attrs).end(_ns(finish))
        span.end(end_time=_ns(end))


def _parent(ids: tuple[str, str]) -> Context | None:
    trace_id, span_id = ids
    if not trace_id:
        return None
    context = SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True,
                          trace_flags=TraceFlags(TraceFlags.SAMPLED))  # fmt: skip
    return trace.set_span_in_context(NonRecordingSpan(context))
