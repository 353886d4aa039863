"""A small OTLP/HTTP trace receiver, as its own process, for tests and a look by hand:

    python -m kvstate.testing.otlp --out spans.jsonl [--port 0]

It listens on 127.0.0.1, prints ``listening on http://127.0.0.1:PORT`` once ready (the
value for ``OTEL_EXPORTER_OTLP_ENDPOINT``), and for every ``POST /v1/traces`` decodes
the ExportTraceServiceRequest (protobuf, gzip or not) with opentelemetry-proto, the
types an OpenTelemetry Collector decodes with, and appends one JSON line per span to
``--out``: ids in hex, times in ns, attributes, events, links, status, and the
resource's attributes. It answers what a collector answers (an empty
ExportTraceServiceResponse), so the exporter sees a success. Not for production.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _value(v: Any) -> Any:
    """An OTLP AnyValue as plain JSON."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind) if kind else None


def _attrs(items: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in items}


def spans_of(body: bytes) -> list[dict[str, Any]]:
    """Every span of one ExportTraceServiceRequest, as JSON-ready dicts."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for rs in request.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for span in ss.spans:
                out.append(
                    {
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "name": span.name,
                        "start_ns": span.start_time_unix_nano,
                        "end_ns": span.end_time_unix_nano,
                        "attributes": _attrs(span.attributes),
                        "events": [
                            {
                                "name": e.name,
                                "time_ns": e.time_unix_nano,
                                "attributes": _attrs(e.attributes),
                            }
                            for e in span.events
                        ],
                        "links": [
                            {
                                "trace_id": link.trace_id.hex(),
                                "span_id": link.span_id.hex(),
                                "attributes": _attrs(link.attributes),
                            }
                            for link in span.links
                        ],
                        "status": {"code": span.status.code, "message": span.status.message},
                        "scope": ss.scope.name,
                        "resource": resource,
                    }
                )
    return out


def serve(port: int, out_path: str) -> ThreadingHTTPServer:
    """A receiver on 127.0.0.1:``port`` (0: a free one) appending to ``out_path``."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceResponse,
    )

    lock = threading.Lock()
    answer = ExportTraceServiceResponse().SerializeToString()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.headers.get("Content-Encoding", "").lower() == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_error(404, "only /v1/traces")
                return
            try:
                spans = spans_of(body)
            except Exception as exc:  # noqa: BLE001 - a bad request is the sender's
                self.send_error(400, f"not an ExportTraceServiceRequest: {exc}")
                return
            with lock, open(out_path, "a") as f:
                for span in spans:
                    f.write(json.dumps(span) + "\n")
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", required=True, help="append one JSON line per span here")
    args = ap.parse_args()
    server = serve(args.port, args.out)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
