"""The version of mbtune (the package and its profiles' metadata read it here)."""

__version__ = "0.1.0"
