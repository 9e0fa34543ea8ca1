"""The operator's own HTTP/1.1 wire: one asyncio Protocol per kept-alive connection (http11.py), with the
kernel's receive time of each read where the socket gives it (rxstamp.py). Below both its users: the
probe (engine pods over plain http) and the Kubernetes client (the API server over TLS)."""
