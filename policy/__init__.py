"""fimfleet's CrossGuard policy pack (see policy/__main__.py); importable for its unit tests."""
