"""Operator surfaces of a running Sluice: REST API, web page, /metrics.

SUMMARY
    sluice.api.server.start_api(config, queue, manager)   (sluice serve)
    sluice.api.client.ApiClient, explain(config, qid)      (the CLI)

DESCRIPTION
    The API runs inside `sluice serve`, on the queue manager's event loop
    (FastAPI on uvicorn); it lists and changes the queue, shows and
    changes the pickup policy and suspensions live, keeps an audit
    history of every change that one call rolls back, serves the web
    administration page and the Prometheus metrics.

    Modules: app (routes, errors, the page), models (request and response
    shapes), control (what each operation does), audit (the history),
    history (a message's accounting lines), metrics, auth (tokens),
    server (uvicorn inside serve), client (the CLI's side, standard
    library only).  Importing this package imports none of them, so the
    CLI stays quick to start.

SEE ALSO
    docs/api.md
"""
