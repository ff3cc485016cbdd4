"""The REST API's routers, one module per resource; sluice.api.app puts them together.

SUMMARY
    queue (entries, counts, qshape, actions, messages, why), messages (a
    message's headers and body), scheduler (stats, sub-queues, counters,
    destinations, throughput), destinations (the console's table), charts
    (the last hour in memory), policy (the
    running policy, reloads, conditions), suspensions, audit (history and
    rollbacks), metrics (/metrics and health), page (the web page);
    common holds what they share: authentication, selectors, error
    responses.

DESCRIPTION
    Each module has ``router(control, auth) -> APIRouter``: the routes
    validate shapes (sluice.api.models) and hand over to the operations
    of sluice.api.control, which answer with typed models.  The modules
    do not use ``from __future__ import annotations``: FastAPI reads the
    annotations of the route functions, which name types made inside
    router().

SEE ALSO
    sluice.api.app, sluice.api.control, docs/api.md
"""
