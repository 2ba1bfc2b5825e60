"""SLED device side: drafters, the round loop and its transport. Never imports torch or transformers."""
