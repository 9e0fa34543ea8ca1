"""kopf glue (the only package that imports kopf). Importing it registers the handlers with kopf.

startup: the operator's start and stop (settings, client, cache and informers, controller, leader
election, health and metrics servers, in memo); servedmodel: `reconcile_key`, what the controller's
workers run; prober: starting and stopping the probe scheduler; health and metrics: the HTTP endpoints.
"""

from . import prober, servedmodel, startup

__all__ = ["prober", "servedmodel", "startup"]
