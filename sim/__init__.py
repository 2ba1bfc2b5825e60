"""SLED's parts as processes on one machine: the server as a child process and free ports (processes), an emulated
network link (linkemu), and `make simulate`, the compose file's services run without Docker (compose)."""
