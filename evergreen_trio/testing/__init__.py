"""Tools for testing Evergreen servers and clients: a pytest plugin with in-process fixtures."""
