"""The operator's health endpoints on OperatorConfig.health_port (aiohttp, which kopf already brings).

- ``GET /healthz`` (liveness): 200 while the event loop answers. It says nothing of the API server: an
  operator whose API server is away is alive, waiting, and restarting it would only lose its cache.
- ``GET /readyz`` (readiness): 200 once every informer listed once (its cache is synced) and while every
  watch is up; else 503 naming each watch that is not synced or is down, with its last error. The body
  also says whether this replica leads (``leader: yes|no``): followers are ready, and idle.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from servedmodel.k8s.informer import Informers


async def serve(
    address: str, port: int, informers: Informers, leading: Callable[[], bool]
) -> web.AppRunner | None:
    """Start the endpoints on `address:port` (None when port is 0); stop with `runner.cleanup()`."""
    if not port:
        return None

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_request: web.Request) -> web.Response:
        leader = f"leader: {'yes' if leading() else 'no'}\n"
        problems = informers.not_ready()
        if problems:
            return web.Response(status=503, text="".join(f"{p}\n" for p in problems) + leader)
        return web.Response(text=f"ok\n{leader}")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, address, port).start()
    return runner
