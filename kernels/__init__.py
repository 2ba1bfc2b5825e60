"""Pure tensor math for SLED: rejection sampling and attention over a session's KV."""
