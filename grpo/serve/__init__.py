"""``grpo serve``: an HTTP server that exposes the local backend with PyTRIO's service API."""
