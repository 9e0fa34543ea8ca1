"""kopf handlers (the only package that imports kopf). Importing it registers every handler with kopf.

startup: settings, the shared Kubernetes client and the metrics server (in memo); servedmodel: the
reconcile handlers; probe: the request-path probe daemon; chat_template: the watched chat template
ConfigMaps.
"""

from . import chat_template, probe, servedmodel, startup

__all__ = ["chat_template", "probe", "servedmodel", "startup"]
