"""fastddp's version (its own module: imported below the package, e.g. by fastddp.agree)."""

__version__ = "0.1.0"
