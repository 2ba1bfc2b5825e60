"""Stress checks against a real server, pass or fail: many devices through kills, restarts and garbage (soak), and
random message sequences (fuzz). `sled-bench soak` and `sled-bench fuzz` run them."""
