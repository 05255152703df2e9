"""The thin launcher: the only package that imports all three services."""
