"""pdserve package."""
