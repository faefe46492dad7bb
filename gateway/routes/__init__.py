"""One module per endpoint family; each exposes `router`."""
