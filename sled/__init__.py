"""Generated SLED wire modules (sled.v1); run `make proto` to build them."""
