"""ServedModel: serve models with vLLM on Kubernetes and OpenShift, and measure the request path."""

__version__ = "0.1.0"
