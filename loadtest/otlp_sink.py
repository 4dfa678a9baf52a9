"""A minimal OTLP/HTTP traces sink for benchmarks: answers every export with success.

It decodes nothing (the benchmark measures the proxy's cost of tracing, not a collector's);
it counts requests and bytes so a run can show that spans were really exported.
Loopback only.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web


@dataclass
class OtlpSink:
    exports: int = 0
    bytes: int = 0
    _runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> OtlpSink:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._export)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.exports += 1
        self.bytes += len(body)
        # An empty ExportTraceServiceResponse is zero bytes of protobuf.
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
