"""The console: ``/ui`` (a playground and an operator view, static files in ``static/``) and the JSON
the operator view reads (``/v1/console/...``, an admin key behind API keys). docs/console.md."""
